"""RoPE scalings in float64, and which table each forward of a recording used.

transformers' scaled RoPE (modeling_rope_utils: linear, dynamic, yarn,
longrope, llama3) computes its inverse frequencies in float32. The float64
oracle (oracle_f64.to_float64) needs them in float64, and two of them change
from one forward to the next: HF's dynamic_rope_update decorator picks the
table of every forward call from seq_len = max(position_ids) + 1 (a prefill
of 30 tokens has seq_len 30, the decode step at position 32 has 33), and the
keys already in the KV cache keep the rotation they were given:

  dynamic   the table is rebuilt (NTK base change for that seq_len) when
            seq_len exceeds the largest one seen so far (max_seq_len_cached,
            max_position_embeddings at first), and reset to the original
            table when a shorter pass follows a longer-than-original one;
  longrope  the long factors when seq_len > original_max_position_embeddings,
            the short ones otherwise (the attention factor is the init's,
            always applied).

RopeF64 replicates the formulas of the pinned transformers (5.23.0) in
float64 and that per-forward state, from the config alone; check_hf asserts
a float32 HF rotary module holds the same table (inv_freq within float32
rounding, rtol 1e-6; a 16-bit recording's table within its dtype's eps) and attention scaling (1e-9 relative). Two users:

  - the oracle: the model's rotary forward becomes RopeF64's (oracle_f64),
    and a float32 HF rotary module of the model's class, fed the same
    position_ids, runs beside it as the reference of every pass
    (OracleRope);
  - record_hf.py in float32: HF computes the tables itself; after every
    step RopeF64, updated with the step's seq_len, must agree with the
    model's own rotary module (Float32Watch), so the golden records the
    table the per-forward rule gives for that step.

Both report `passes` (provenance `rope.passes`: per step its seq_len, the
table and the attention scaling) and reset() the rotary state to that of a
freshly loaded model, which the cross-checks (hf_crosschecks.py) call
before their own forwards: a one-pass recompute of a per-pass scaling
uses one table for every position, so it is compared from a fresh state,
and its difference from the cached steps is expected (provenance
`rope.per_pass_tables`).
"""
import math

import torch

F64 = torch.float64
SCALED = ("linear", "dynamic", "yarn", "longrope", "llama3")
PER_PASS = ("dynamic", "longrope")


def rope_params(cfg):
    """The config's (non-nested) rope_parameters, or None for Gemma 3's
    per-layer-type ones."""
    rp = cfg.rope_parameters
    return None if "rope_theta" not in rp else rp


def is_scaled(cfg):
    rp = rope_params(cfg)
    return rp is not None and rp.get("rope_type", "default") != "default"


def _dim(cfg, rp):
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return int(head_dim * rp.get("partial_rotary_factor", 1.0))


def _default(base, dim):
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=F64) / dim))


def inv_freq_f64(cfg, seq_len=None):
    """(inv_freq float64, attention factor) of the config's rope_type for a
    pass of `seq_len` positions (None: at init), as modeling_rope_utils'
    _compute_*_parameters compute them, in float64."""
    rp = rope_params(cfg)
    kind, base, dim = rp["rope_type"], float(rp["rope_theta"]), _dim(cfg, rp)
    max_pos = cfg.max_position_embeddings
    if kind == "linear":
        return _default(base, dim) / float(rp["factor"]), 1.0
    if kind == "dynamic":
        factor = float(rp["factor"])
        n = max_pos if seq_len is None else max(int(seq_len), max_pos)
        base = base * ((factor * n / max_pos) - (factor - 1)) ** (dim / (dim - 2))
        return _default(base, dim), 1.0
    if kind == "yarn":
        omp = rp["original_max_position_embeddings"]
        factor = rp.get("factor") or max_pos / omp
        att = rp.get("attention_factor")

        def mscale(scale, m=1.0):
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0
        if att is None:
            m, m_all = rp.get("mscale"), rp.get("mscale_all_dim")
            att = float(mscale(factor, m) / mscale(factor, m_all)) if m and m_all else mscale(factor)
        beta_fast, beta_slow = rp.get("beta_fast") or 32, rp.get("beta_slow") or 1

        def corr_dim(rot):
            return (dim * math.log(omp / (rot * 2 * math.pi))) / (2 * math.log(base))
        low, high = corr_dim(beta_fast), corr_dim(beta_slow)
        # HF reads `truncate` from the config's (top-level) rope_parameters.
        if cfg.rope_parameters.get("truncate", True):
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001
        ramp = torch.clamp((torch.arange(dim // 2, dtype=F64) - low) / (high - low), 0, 1)
        pos_freqs = base ** (torch.arange(0, dim, 2, dtype=F64) / dim)
        extrap_factor = 1 - ramp
        inv = (1.0 / (factor * pos_freqs)) * (1 - extrap_factor) + (1.0 / pos_freqs) * extrap_factor
        return inv, att
    if kind == "longrope":
        omp = rp["original_max_position_embeddings"]
        factor = rp.get("factor") or max_pos / omp
        att = rp.get("attention_factor")
        if att is None:
            att = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(omp))
        ext = rp["long_factor"] if seq_len and seq_len > omp else rp["short_factor"]
        return 1.0 / (torch.tensor(ext, dtype=F64) * base ** (torch.arange(0, dim, 2, dtype=F64) / dim)), att
    if kind == "llama3":
        inv = _default(base, dim)
        factor, lo, hi = float(rp["factor"]), float(rp["low_freq_factor"]), float(rp["high_freq_factor"])
        old = rp["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        out = torch.where(wavelen > old / lo, inv / factor, inv)
        smooth = (old / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * out / factor + smooth * out
        medium = ~(wavelen < old / hi) * ~(wavelen > old / lo)
        return torch.where(medium, smoothed, out), 1.0
    raise SystemExit(f"record_hf.py: --dtype float64 has no rope_type {kind!r} (known: default, {', '.join(SCALED)})")


def describe(cfg):
    """The `rope` string of the oracle's provenance: the scaling and its parameters."""
    rp = dict(rope_params(cfg))
    kind = rp.pop("rope_type")
    att = inv_freq_f64(cfg)[1]
    rp.pop("short_factor", None), rp.pop("long_factor", None)
    keys = ", ".join(f"{k} {rp[k]}" for k in sorted(rp))
    per = "; table per forward from max(position_ids) + 1" if kind in PER_PASS else ""
    return f"float64 {kind} ({keys}; attention factor {att:.6g}{per})"


class RopeF64:
    """HF's rotary state, in float64: the table of the current forward
    (update(seq_len) before each) as dynamic_rope_update keeps it."""

    def __init__(self, cfg):
        self.cfg = cfg
        self.kind = rope_params(cfg)["rope_type"]
        self.reset()

    def reset(self):
        self.inv, self.att = inv_freq_f64(self.cfg)
        self.original = self.inv
        self.max_seq_len_cached = self.original_max_seq_len = self.cfg.max_position_embeddings
        self.table = "static" if self.kind not in PER_PASS else ("short" if self.kind == "longrope" else "original")
        self.seq_len = None

    def update(self, seq_len):
        """The table of a forward whose max(position_ids) + 1 is seq_len;
        returns its name."""
        self.seq_len = seq_len = int(seq_len)
        if self.kind == "dynamic":
            cached = self.max_seq_len_cached
            if seq_len > cached:  # growth: a table for this length
                self.inv, self.att = inv_freq_f64(self.cfg, seq_len)
                self.max_seq_len_cached = seq_len
                self.table = f"ntk seq_len {seq_len}"
            if seq_len < self.original_max_seq_len and cached > self.original_max_seq_len:  # reset
                self.inv, self.table = self.original, "original"
                self.max_seq_len_cached = self.original_max_seq_len
        elif self.kind == "longrope":
            omp = rope_params(self.cfg)["original_max_position_embeddings"]
            long_ = seq_len > omp
            self.inv = inv_freq_f64(self.cfg, seq_len)[0] if long_ else self.original
            self.table = "long" if long_ else "short"
        return self.table

    # gpt-oss's rotary module returns the half-width table (its rotation pairs x[:D/2] with x[D/2:]).
    half = False

    def cos_sin(self, x, position_ids):
        freqs = position_ids[..., None].to(F64) * self.inv
        emb = freqs if self.half else torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.att).to(x.dtype), (emb.sin() * self.att).to(x.dtype)

    def pass_info(self):
        return {"seq_len": self.seq_len, "table": self.table, "attention_scaling": self.att}


def check_hf(rot, rope, what):
    """A float32 HF rotary module `rot` holds RopeF64's table: inv_freq
    within float32 rounding, the same attention scaling."""
    hf = rot.inv_freq.detach().to(F64)
    assert hf.shape == rope.inv.shape, f"{what}: inv_freq {tuple(hf.shape)} vs {tuple(rope.inv.shape)}"
    rel = float(((hf - rope.inv).abs() / rope.inv.abs()).max())
    # A 16-bit recording's model.to(dtype) rounded the init table too.
    tol = max(1e-6, torch.finfo(rot.inv_freq.dtype).eps)
    assert rel < tol, f"{what}: HF's inv_freq is {rel:.3g} (relative) from the float64 {rope.table} table"
    att = float(rot.attention_scaling)
    assert abs(att - rope.att) <= 1e-9 * abs(rope.att), f"{what}: attention scaling {att} vs {rope.att}"
    return rel


class OracleRope:
    """The oracle's rotary forward: RopeF64, with a float32 HF rotary module
    of the model's class (`shadow`) fed the same position_ids every pass as
    the reference of its table. `guard`: the F32Guard the forwards run
    under (the shadow's float32 ops are allowed)."""

    def __init__(self, rot, cfg, guard, allowed):
        self.cls, self.cfg, self.guard, self.allowed = type(rot), cfg, guard, allowed
        self.rope = RopeF64(cfg)
        self.rope.half = type(rot).__name__ == "GptOssRotaryEmbedding"
        self.worst = check_hf(rot, self.rope, "init")  # HF's own table, as loaded
        self.reset()

    def reset(self):
        self.rope.reset()
        with self.allowed(self.guard):
            self.shadow = self.cls(self.cfg)
        self.last = None

    def forward(self, x, position_ids):
        seq_len = int(position_ids.max()) + 1
        self.rope.update(seq_len)
        with self.allowed(self.guard), torch.no_grad():
            self.shadow(torch.zeros(1, dtype=torch.float32), position_ids)
            self.worst = max(self.worst, check_hf(self.shadow, self.rope, f"pass of seq_len {seq_len}"))
        self.last = self.rope.pass_info()
        return self.rope.cos_sin(x, position_ids)

    def after(self, step, seq_len):
        assert self.last is not None and self.last["seq_len"] == seq_len, (step, seq_len, self.last)
        return dict(self.last)


class Float32Watch:
    """record_hf.py in float32 (or 16-bit): after each step, RopeF64 updated
    with the step's seq_len must hold the model's own table (HF computed it)."""

    def __init__(self, model):
        self.rot, self.rope = model.model.rotary_emb, RopeF64(model.config)
        self.worst = check_hf(self.rot, self.rope, "init")
        # A fresh model's rotary state, for reset().
        self.fresh = {"inv_freq": self.rot.inv_freq.clone(), "max_seq_len_cached": self.rot.max_seq_len_cached,
                      "attention_scaling": self.rot.attention_scaling, "keys": set(vars(self.rot))}

    def after(self, step, seq_len):
        self.rope.update(seq_len)
        self.worst = max(self.worst, check_hf(self.rot, self.rope, f"{step} (seq_len {seq_len})"))
        return self.rope.pass_info()

    def reset(self):
        f = self.fresh
        self.rot.register_buffer("inv_freq", f["inv_freq"].clone(), persistent=False)
        self.rot.max_seq_len_cached, self.rot.attention_scaling = f["max_seq_len_cached"], f["attention_scaling"]
        for k in set(vars(self.rot)) - f["keys"]:  # e.g. longrope's cached long_inv_freq
            delattr(self.rot, k)
        self.rope.reset()


def watch(model):
    """The rope watch of a recording (None: unscaled RoPE): the oracle's
    OracleRope (set by oracle_f64.to_float64) or a Float32Watch."""
    if not is_scaled(model.config):
        return None
    return getattr(model, "oracle_rope", None) or Float32Watch(model)


def provenance(model, w, passes, dtype):
    """Provenance `rope` of a scaled model's HF golden."""
    rp = rope_params(model.config)
    return {
        "rope_type": rp["rope_type"],
        "rope_parameters": rp,
        "max_position_embeddings": model.config.max_position_embeddings,
        "tables": "float64, rope_scaling_f64.RopeF64 (checked against HF's float32 tables)" if dtype == "float64"
        else f"{dtype}, HF's own (checked against rope_scaling_f64.RopeF64)",
        "max_rel_diff_from_float64_table": w.worst,
        "per_pass_tables": rp["rope_type"] in PER_PASS,
        "passes": passes,
    }
