"""numpy-ref's model: a decoder-only transformer (Qwen2, Llama, Qwen3,
Phi-3) in numpy, float32 arithmetic like HF transformers' eager attention on
the CPU, with f16/bf16 storage emulated at touchstone's CPU engine's rounding
points. numpy_engine.py's docstring describes the arithmetic and the stages;
Model.forward() runs one step and hands each tapped stage to `put`.

With ranks > 1 the attention heads and FFN columns are split as Megatron-style
tensor-parallel ranks would split them (Model._split, Model.forward), and the
stages a rank holds are handed to `put` under per-rank names (Tap).
"""
import json
import os

import numpy as np

from protocol_v1 import EngineError
from safetensors_np import read_safetensors

F32 = np.float32


# ---------------------------------------------------------------------------
# storage rounding (f16 / bf16 emulation; the values stay float32)
# ---------------------------------------------------------------------------
def round_bf16(x):
    """Round-to-nearest-even to bfloat16, widened back to float32 (NaN kept)."""
    x = np.ascontiguousarray(x, dtype=F32)
    u = x.view(np.uint32)
    r = ((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) & np.uint32(0xFFFF0000))
    r = r.astype(np.uint32).view(F32)
    return np.where(np.isnan(x), x, r)


def round_f16(x):
    with np.errstate(over="ignore"):
        return np.asarray(x, dtype=F32).astype(np.float16).astype(F32)


STORAGE = {
    "f32": lambda x: x,
    "f16": round_f16,
    "bf16": round_bf16,
}


# ---------------------------------------------------------------------------
# the model
# ---------------------------------------------------------------------------
ARCHS = {"qwen2", "llama", "qwen3", "phi3"}


def stage_names(model_type, n_layers):
    """Every canonical stage of a model, in execution order (sample_probs last)."""
    blk = ["attn_norm", "q", "k", "v"]
    if model_type == "qwen3":
        blk += ["q_norm", "k_norm"]
    blk += ["q_rope", "k_rope", "attn_scores", "attn_probs", "attn_ctx", "attn_out", "ffn_inp",
            "ffn_norm", "ffn_gate", "ffn_up", "ffn_act", "ffn_out", "out"]
    names = ["embed"]
    for i in range(n_layers):
        names += [f"blk.{i}.{s}" for s in blk]
    return names + ["output_norm", "logits", "sample_probs"]


# Tensor-parallel stages: the axis of the canonical tensor a rank's shard
# cuts (its offset is rank * the shard's size along it, every rank's shard
# being the same size), and the row-parallel outputs each rank holds as a
# full-shape partial sum.
SHARD_AXIS = {"q": 1, "k": 1, "v": 1, "q_norm": 1, "k_norm": 1, "q_rope": 1, "k_rope": 1,
              "attn_scores": 0, "attn_probs": 0, "attn_ctx": 1,
              "ffn_gate": 1, "ffn_up": 1, "ffn_act": 1}
PARTIAL = {"attn_out", "ffn_out"}


class Tap:
    """Hands tapped stages to put(name, array). A rank's Tap (rank(r), only
    with ranks > 1) names what that rank holds as a real sharded engine
    would: `<stage>@rank<r>:axis=<a>:offset=<o>` for its slice of a
    SHARD_AXIS stage, `<stage>@rank<r>:partial` for its partial sum of a
    PARTIAL stage; a stage is matched against `taps` by its plain name."""

    def __init__(self, taps, put, prefix="", rank=None):
        self.taps, self.put, self.prefix, self.r = taps, put, prefix, rank

    def layer(self, i):
        return Tap(self.taps, self.put, f"blk.{i}.", self.r)

    def rank(self, r):
        return Tap(self.taps, self.put, self.prefix, r)

    def want(self, stage):
        return self.prefix + stage in self.taps

    def __call__(self, stage, a):
        if self.want(stage):
            self.put(self.prefix + stage + self._suffix(stage, a), a)

    def _suffix(self, stage, a):
        if self.r is None:
            return ""
        if stage in PARTIAL:
            return f"@rank{self.r}:partial"
        ax = SHARD_AXIS[stage]
        return f"@rank{self.r}:axis={ax}:offset={self.r * a.shape[ax]}"


def check_config(cfg):
    """Refuses, naming the field, anything this engine would silently compute
    differently from what the config says."""
    mt = cfg.get("model_type")
    if mt not in ARCHS:
        raise EngineError(f"unsupported architecture: model_type {mt!r} "
                          f"(this engine runs {', '.join(sorted(ARCHS))})")
    rp = cfg.get("rope_parameters") or {}
    if cfg.get("rope_scaling"):
        raise EngineError(f"config field rope_scaling = {cfg['rope_scaling']!r}: RoPE scaling is not implemented")
    if rp.get("rope_type", "default") != "default":
        raise EngineError(f"config field rope_parameters.rope_type = {rp['rope_type']!r}: "
                          "only the default RoPE is implemented")
    for k in ("factor", "low_freq_factor", "high_freq_factor", "short_factor", "long_factor",
              "beta_fast", "beta_slow", "mrope_section"):
        if rp.get(k) is not None:
            raise EngineError(f"config field rope_parameters.{k}: RoPE scaling is not implemented")
    prf = rp.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    if prf is not None and float(prf) != 1.0:
        raise EngineError(f"config field partial_rotary_factor = {prf}: only full rotary is implemented")
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise EngineError(f"config field hidden_act = {act!r}: only silu is implemented")
    for k in ("attn_logit_softcapping", "final_logit_softcapping"):
        if cfg.get(k) is not None:
            raise EngineError(f"config field {k} = {cfg[k]!r}: soft-capping is not implemented")
    if cfg.get("mlp_bias"):
        raise EngineError("config field mlp_bias = true: MLP biases are not implemented")
    if int(cfg.get("pretraining_tp") or 1) > 1:
        raise EngineError(f"config field pretraining_tp = {cfg['pretraining_tp']}: not implemented")
    for k in ("embedding_multiplier", "residual_multiplier", "logits_scaling", "attention_multiplier",
              "scale_emb", "scale_depth", "logit_scale"):
        if cfg.get(k) not in (None, 1, 1.0):
            raise EngineError(f"config field {k} = {cfg[k]!r}: scaled embeddings/residuals/logits "
                              "are not implemented")
    for i, lt in enumerate(cfg.get("layer_types") or []):
        if lt != "full_attention":
            raise EngineError(f"config field layer_types[{i}] = {lt!r}: only full attention is implemented")


class Linear:
    """y = x @ w.T (+ b), rounded to storage after the GEMM and after the bias add."""

    def __init__(self, w, b=None):
        self.w, self.b = w, b
        self.wt = None

    def finish(self, rnd):
        self.w = rnd(np.ascontiguousarray(self.w, dtype=F32))
        self.b = None if self.b is None else rnd(np.ascontiguousarray(self.b, dtype=F32))
        # Transposed once, so every call is a plain row-major GEMM.
        self.wt = np.ascontiguousarray(self.w.T)

    def __call__(self, x, rnd):
        y = rnd(x @ self.wt)
        if self.b is not None:
            y = rnd(y + self.b)
        return y

    # Tensor-parallel shards, cut from a finished (already rounded) Linear.
    def rows(self, lo, hi):
        """Column-parallel shard: output features lo..hi, their bias included."""
        return Linear(self.w[lo:hi], None if self.b is None else self.b[lo:hi])._finished()

    def cols(self, lo, hi):
        """Row-parallel shard: input features lo..hi and no bias (the bias is
        added once, after the partial sums are reduced)."""
        return Linear(self.w[:, lo:hi])._finished()

    def unbiased(self):
        """The same weights (shared, not copied) without the bias."""
        lin = Linear(self.w)
        lin.wt = self.wt
        return lin

    def _finished(self):
        self.finish(lambda a: a)  # cut from rounded weights: nothing to round again
        return self


class Model:
    def __init__(self, folder, storage, ranks=1):
        self.folder = folder
        self.ranks = ranks
        cfg_path = os.path.join(folder, "config.json")
        if not os.path.isfile(cfg_path):
            raise EngineError(f"no config.json in {folder}")
        with open(cfg_path, encoding="utf-8") as f:
            cfg = json.load(f)
        check_config(cfg)
        self.cfg = cfg
        self.type = cfg["model_type"]
        self.E = int(cfg["hidden_size"])
        self.H = int(cfg["num_attention_heads"])
        self.KV = int(cfg.get("num_key_value_heads") or self.H)
        self.D = int(cfg.get("head_dim") or self.E // self.H)
        self.F = int(cfg["intermediate_size"])
        self.V = int(cfg["vocab_size"])
        self.L = int(cfg["num_hidden_layers"])
        self.eps = F32(cfg.get("rms_norm_eps", 1e-6))
        rp = cfg.get("rope_parameters") or {}
        self.theta = float(rp.get("rope_theta", cfg.get("rope_theta", 10000.0)))
        self.max_pos = int(cfg.get("max_position_embeddings") or 1 << 30)
        sw = cfg.get("sliding_window")
        use_sw = cfg.get("use_sliding_window", self.type != "qwen2")
        self.window = int(sw) if sw and use_sw else None
        if self.H % self.KV:
            raise EngineError(f"num_attention_heads {self.H} is not a multiple of num_key_value_heads {self.KV}")
        if self.D % 2:
            raise EngineError(f"head_dim {self.D} is odd: RoPE rotates halves")
        self._check_ranks()
        self.storage = storage
        self.rnd = STORAGE[storage]
        self._load_weights()
        # RoPE as HF computes it in float32: inv_freq = 1 / theta^(2j/D).
        j2 = np.arange(0, self.D, 2, dtype=np.int64).astype(F32) / F32(self.D)
        self.inv_freq = (F32(1.0) / np.power(F32(self.theta), j2)).astype(F32)
        self.scale = F32(self.D ** -0.5)

    def _check_ranks(self):
        R = self.ranks
        for what, n in (("num_attention_heads", self.H), ("num_key_value_heads", self.KV),
                        ("intermediate_size", self.F)):
            if n % R:
                raise EngineError(f"--ranks {R}: {what} {n} is not divisible by {R}, so the model cannot "
                                  f"be split into {R} tensor-parallel ranks")

    # -- weights ------------------------------------------------------------
    def _read_all(self):
        single = os.path.join(self.folder, "model.safetensors")
        index = os.path.join(self.folder, "model.safetensors.index.json")
        if os.path.isfile(single):
            return read_safetensors(single)[0]
        if os.path.isfile(index):
            with open(index, encoding="utf-8") as f:
                shards = sorted(set(json.load(f)["weight_map"].values()))
            out = {}
            for s in shards:
                out.update(read_safetensors(os.path.join(self.folder, s))[0])
            return out
        raise EngineError(f"no model.safetensors (or model.safetensors.index.json) in {self.folder}")

    def _load_weights(self):
        raw = self._read_all()
        used = set()
        E, H, KV, D, F, V = self.E, self.H, self.KV, self.D, self.F, self.V

        def take(name, shape, optional=False):
            if name not in raw:
                if optional:
                    return None
                raise EngineError(f"tensor {name} is missing from the model file")
            a = raw[name]
            if list(a.shape) != list(shape):
                raise EngineError(f"tensor {name} has shape {list(a.shape)}, expected {list(shape)}")
            if a.dtype.kind != "f":
                raise EngineError(f"tensor {name} has dtype {a.dtype}, expected a float type")
            used.add(name)
            return np.ascontiguousarray(a, dtype=F32)

        rnd = self.rnd
        self.embed = rnd(take("model.embed_tokens.weight", (V, E)))
        self.norm = rnd(take("model.norm.weight", (E,)))
        head = take("lm_head.weight", (V, E), optional=True)
        if head is None:
            if self.cfg.get("tie_word_embeddings") is False:
                raise EngineError("tensor lm_head.weight is missing and tie_word_embeddings is false")
            head = self.embed  # tied: the LM head is the (stored) embedding table
        self.lm_head = Linear(head)
        self.blocks = []
        for i in range(self.L):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            m = p + "mlp."
            b = {"attn_norm": rnd(take(p + "input_layernorm.weight", (E,))),
                 "ffn_norm": rnd(take(p + "post_attention_layernorm.weight", (E,)))}
            if self.type == "phi3":
                qkv = take(a + "qkv_proj.weight", ((H + 2 * KV) * D, E))
                qkvb = take(a + "qkv_proj.bias", ((H + 2 * KV) * D,), optional=True)
                cut = [0, H * D, (H + KV) * D, (H + 2 * KV) * D]
                for n, (lo, hi) in zip("qkv", zip(cut, cut[1:])):
                    b[n] = Linear(qkv[lo:hi], None if qkvb is None else qkvb[lo:hi])
                gu = take(m + "gate_up_proj.weight", (2 * F, E))
                b["gate"], b["up"] = Linear(gu[:F]), Linear(gu[F:])
            else:
                for n, rows in (("q", H * D), ("k", KV * D), ("v", KV * D)):
                    b[n] = Linear(take(a + f"{n}_proj.weight", (rows, E)),
                                  take(a + f"{n}_proj.bias", (rows,), optional=True))
                b["gate"] = Linear(take(m + "gate_proj.weight", (F, E)))
                b["up"] = Linear(take(m + "up_proj.weight", (F, E)))
            b["o"] = Linear(take(a + "o_proj.weight", (E, H * D)), take(a + "o_proj.bias", (E,), optional=True))
            b["down"] = Linear(take(m + "down_proj.weight", (E, F)))
            if self.type == "qwen3":
                b["q_norm"] = rnd(take(a + "q_norm.weight", (D,)))
                b["k_norm"] = rnd(take(a + "k_norm.weight", (D,)))
            for k in ("q", "k", "v", "o", "gate", "up", "down"):
                b[k].finish(rnd)
            self.blocks.append(self._split(b))
        self.lm_head.finish(rnd)
        unused = sorted(set(raw) - used)
        # HF keeps these buffers in some checkpoints; nothing computes with them.
        unused = [n for n in unused if not n.endswith("rotary_emb.inv_freq")]
        if unused:
            more = f" and {len(unused) - 5} more" if len(unused) > 5 else ""
            raise EngineError(f"the model file has tensors no layer of a {self.type} model uses: "
                              f"{', '.join(unused[:5])}{more}")

    def _split(self, b):
        """A block as self.ranks tensor-parallel ranks hold it: {"attn_norm",
        "ffn_norm", "o_bias", "ranks": [per rank: q/k/v/gate/up as their
        column-parallel rows, o/down as their row-parallel input columns,
        q_norm/k_norm (per head, shared)]}. One rank holds the whole
        projections; only the o_proj bias is set apart, added after the sum."""
        R, H, KV, D, F = self.ranks, self.H, self.KV, self.D, self.F
        ranks = []
        for r in range(R):
            def part(n, r=r):
                return r * n // R, (r + 1) * n // R
            if R == 1:
                rk = {k: b[k] for k in ("q", "k", "v", "gate", "up", "down")}
                rk["o"] = b["o"].unbiased()
            else:
                rk = {"q": b["q"].rows(*part(H * D)), "k": b["k"].rows(*part(KV * D)),
                      "v": b["v"].rows(*part(KV * D)), "o": b["o"].cols(*part(H * D)),
                      "gate": b["gate"].rows(*part(F)), "up": b["up"].rows(*part(F)),
                      "down": b["down"].cols(*part(F))}
            for k in ("q_norm", "k_norm"):
                if k in b:
                    rk[k] = b[k]
            ranks.append(rk)
        return {"attn_norm": b["attn_norm"], "ffn_norm": b["ffn_norm"], "o_bias": b["o"].b, "ranks": ranks}

    # -- memory ---------------------------------------------------------------
    def new_cache(self):
        """An empty KV cache: cache[layer][rank] = [keys, values], each
        [S, KV/ranks, D] (keys after RoPE, both as stored)."""
        kv = self.KV // self.ranks
        return [[[np.zeros((0, kv, self.D), F32), np.zeros((0, kv, self.D), F32)]
                 for _ in range(self.ranks)] for _ in range(self.L)]

    @staticmethod
    def cache_prefix(cache, n):
        """A copy of the first n positions of a cache (a prefix-cache hit)."""
        return [[[kv[0][:n].copy(), kv[1][:n].copy()] for kv in layer] for layer in cache]

    def nbytes(self, *more):
        """Bytes of the distinct numpy arrays the model holds (weights, their
        transposes, RoPE frequencies), plus those inside `more` (caches)."""
        seen = {}

        def walk(o):
            if isinstance(o, np.ndarray):
                seen[id(o)] = o.nbytes
            elif isinstance(o, Linear):
                walk([o.w, o.wt, o.b])
            elif isinstance(o, dict):
                walk(list(o.values()))
            elif isinstance(o, (list, tuple)):
                for x in o:
                    walk(x)
        walk([self.embed, self.norm, self.lm_head, self.blocks, self.inv_freq, list(more)])
        return sum(seen.values())

    # -- ops ----------------------------------------------------------------
    def rmsnorm(self, x, w):
        """HF's RMSNorm in float32 over the last axis: w * (x * rsqrt(mean(x^2) + eps))."""
        var = np.mean(x * x, axis=-1, keepdims=True, dtype=F32)
        r = F32(1.0) / np.sqrt(var + self.eps)
        return w * (x * r)

    def rope(self, x, positions):
        """Neox RoPE of x [T, heads, D] at positions [T] (float32, as HF)."""
        ang = positions.astype(F32)[:, None] * self.inv_freq[None, :]  # [T, D/2], float32
        a64 = ang.astype(np.float64)
        cos = np.cos(a64).astype(F32)[:, None, :]  # correctly rounded f32 cos/sin
        sin = np.sin(a64).astype(F32)[:, None, :]
        half = self.D // 2
        x1, x2 = x[..., :half], x[..., half:]
        # q*cos + rotate_half(q)*sin, each product rounded separately.
        return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(F32)

    # -- one step ------------------------------------------------------------
    def forward(self, tokens, pos0, cache, taps, put, rope_on=True):
        """Runs `tokens` at positions pos0.. appending to `cache` (new_cache()'s
        per-layer, per-rank [keys, values] arrays [S, KV/ranks, D]). Calls
        put(name, array) for tapped stages (per-rank names with ranks > 1,
        see Tap); returns the (stored) logits of the last row."""
        rnd = self.rnd
        positions = np.arange(pos0, pos0 + len(tokens), dtype=np.int64)
        tap = Tap(taps, put)

        x = self.embed[np.asarray(tokens, dtype=np.int64)]  # already in storage
        tap("embed", x)
        for i, b in enumerate(self.blocks):
            t = tap.layer(i)
            h = rnd(self.rmsnorm(x, b["attn_norm"]))
            t("attn_norm", h)
            # Each rank: its heads' attention, then its o_proj input columns.
            parts = [rk["o"](self._attention(rk, h, positions, cache[i][r], self._rank_tap(t, r), rope_on), rnd)
                     for r, rk in enumerate(b["ranks"])]
            ao = self._all_reduce(parts, b["o_bias"], t, "attn_out")
            x = rnd(x + ao)
            t("ffn_inp", x)
            h = rnd(self.rmsnorm(x, b["ffn_norm"]))
            t("ffn_norm", h)
            # Each rank: its FFN columns, then its down_proj input columns.
            parts = [rk["down"](self._ffn_act(rk, h, self._rank_tap(t, r)), rnd)
                     for r, rk in enumerate(b["ranks"])]
            fo = self._all_reduce(parts, None, t, "ffn_out")
            x = rnd(x + fo)
            t("out", x)
        xn = rnd(self.rmsnorm(x, self.norm))
        tap("output_norm", xn)
        logits = self.lm_head(xn, rnd)
        tap("logits", logits)
        return logits[-1]

    def _rank_tap(self, t, r):
        # One rank holds whole tensors: their plain names, as before ranks.
        return t if self.ranks == 1 else t.rank(r)

    def _all_reduce(self, parts, bias, t, stage):
        """The row-parallel output: the ranks' partial sums (each already
        rounded to storage) added in rank order, the running sum rounded to
        storage after each add, then the bias (if any) added once and rounded.
        With ranks > 1 the partials are tapped per rank and the sum is not:
        rank 0's with the bias added (as the protocol asks: the partial sums
        add up to the stage), the others without; with one rank the sum (bias
        included) is the stage."""
        rnd = self.rnd
        if len(parts) > 1:
            for r, part in enumerate(parts):
                t.rank(r)(stage, rnd(part + bias) if r == 0 and bias is not None else part)
        total = parts[0]
        for part in parts[1:]:
            total = rnd(total + part)
        if bias is not None:
            total = rnd(total + bias)
        if len(parts) == 1:
            t(stage, total)
        return total

    def _attention(self, rk, h, positions, kc, t, rope_on):
        """q/k/v through the attention context for the heads rank `rk` holds
        (all of them with one rank), appending its keys and values to kc;
        returns the stored context [T, heads*D]."""
        rnd = self.rnd
        T, D = h.shape[0], self.D
        q = rk["q"](h, rnd).reshape(T, -1, D)
        k = rk["k"](h, rnd).reshape(T, -1, D)
        v = rk["v"](h, rnd).reshape(T, -1, D)
        grp = q.shape[1] // k.shape[1]
        t("q", q)
        t("k", k)
        t("v", v)
        if "q_norm" in rk:
            q = rnd(self.rmsnorm(q, rk["q_norm"]))
            k = rnd(self.rmsnorm(k, rk["k_norm"]))
            t("q_norm", q)
            t("k_norm", k)
        if rope_on:
            q = rnd(self.rope(q, positions))
            k = rnd(self.rope(k, positions))
        t("q_rope", q)
        t("k_rope", k)

        kc[0] = np.concatenate([kc[0], k], axis=0)
        kc[1] = np.concatenate([kc[1], v], axis=0)
        keys, vals = kc[0], kc[1]
        S = keys.shape[0]
        # GQA: query head h reads KV head h // (H/KV) (within a rank too:
        # its query heads' KV heads are the ones it holds).
        kh = np.repeat(keys.transpose(1, 0, 2), grp, axis=0)  # [heads, S, D]
        vh = np.repeat(vals.transpose(1, 0, 2), grp, axis=0)  # [heads, S, D]
        qh = np.ascontiguousarray(q.transpose(1, 0, 2))  # [heads, T, D]
        scores = np.matmul(qh, kh.transpose(0, 2, 1)) * self.scale  # [heads, T, S]
        # Key j is visible to query row t iff j <= pos0 + t.
        masked = np.arange(S)[None, :] > positions[:, None]  # [T, S]
        if self.window is not None:
            masked |= np.arange(S)[None, :] <= positions[:, None] - self.window
        if t.want("attn_scores"):
            t("attn_scores", np.where(masked[None], F32(0.0), scores))
        s = np.where(masked[None], F32(-np.inf), scores)
        e = np.exp(s - s.max(axis=-1, keepdims=True))
        probs = e * (F32(1.0) / e.sum(axis=-1, keepdims=True, dtype=F32))
        t("attn_probs", probs)
        ctx = np.matmul(probs, vh)  # [heads, T, D]
        ctx = rnd(ctx.transpose(1, 0, 2).reshape(T, -1))
        t("attn_ctx", ctx)
        return ctx

    def _ffn_act(self, rk, h, t):
        """gate, up and silu(gate)*up for the FFN columns rank `rk` holds."""
        rnd = self.rnd
        g = rk["gate"](h, rnd)
        t("ffn_gate", g)
        u = rk["up"](h, rnd)
        t("ffn_up", u)
        with np.errstate(over="ignore"):
            act = rnd((g / (F32(1.0) + np.exp(-g))) * u)
        t("ffn_act", act)
        return act
