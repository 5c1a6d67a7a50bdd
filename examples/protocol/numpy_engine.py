#!/usr/bin/env python3
"""numpy-ref: a reference engine for touchstone's subprocess protocol, version 1.

    touchstone run SPEC --engine "exec:python3 examples/protocol/numpy_engine.py"

A decoder-only transformer (Qwen2, Llama, Qwen3, Phi-3) in numpy, float32
arithmetic like HF transformers' eager attention on the CPU. It needs numpy
and the Python standard library only: safetensors files are read and written
here (an 8-byte little-endian header length, a JSON header, then the raw
tensor bytes), and neither `safetensors` nor `torch` is imported.

The protocol as this engine implements it
-----------------------------------------
touchstone starts the command once per spec and keeps it running. Requests
come one JSON object per line on stdin; each gets exactly one JSON object on
one line on stdout, flushed at once. stdout carries nothing else (anything
the program would print goes to stderr, which is the engine's log: touchstone
keeps it and shows it when something fails). Every response has "ok": true,
or "ok": false with "error": a sentence saying what was wrong. A request
that fails leaves the engine running and able to take the next one; a line
that is not a JSON object is answered with ok:false too.

  {"op":"load","protocol":1,"model":"/abs/dir","storage":"f32"}
      -> {"ok":true,"engine":"numpy-ref"}
    model: an HF folder (config.json and model.safetensors, or a sharded
    model.safetensors.index.json with its shards; tokenizer files are not
    read: the protocol speaks token ids). storage: "f32", "f16" or "bf16".
    Refused (ok:false, naming the problem): a protocol other than 1, another
    storage, an architecture other than qwen2/llama/qwen3/phi3, a config field
    this engine does not implement (RoPE scaling of any kind, a
    partial_rotary_factor != 1, an activation other than SiLU, soft-capping,
    mlp_bias, pretraining_tp > 1, scaled embeddings/residuals/logits, a layer
    type other than full attention), a tensor missing from the file, a tensor
    of the wrong shape, or a tensor in the file that no layer uses. A second
    load replaces the first model.

  {"op":"run","prompt":[ids],"decode_steps":N,"sampling":"greedy",
   "seed":S,"forced":null,"taps":["embed","blk.0.q",...],"out":"/abs/f.safetensors"}
      -> {"ok":true}
    sampling: "greedy" (argmax, the lowest index on ties) or
    {"temperature":T,"top_k":K|null,"top_p":P|null}. seed: an integer.
    forced: null, or a list of at least N token ids. Runs the prompt as one
    prefill step (positions 0..T-1), then N one-token decode steps using a KV
    cache; decode step n is fed forced[n-1] when forced is given, else the
    token sampled after the step before. Writes `out`, a safetensors file with
      <step>/<stage>  float32, canonical layout, for every step (prefill,
                      decode1, ..., decodeN) and every tapped stage
      tokens          int64 [1+N], the token sampled after each step (from
                      the last row of that step's logits; sampled even where
                      the next step is fed a forced token)
    and its __metadata__ {"format":"touchstone-engine-out/1","engine":...}.
    Only tapped stages are written. An unknown stage name, or a layer the
    model does not have, is an error; q_norm/k_norm tapped on a model other
    than Qwen3 (which alone has them) are skipped, not written. The
    file is written to out + ".tmp" and renamed into place, so a failed run
    never leaves a half-written file at `out`.

  {"op":"shutdown"} -> {"ok":true}, then exit 0. End of stdin: exit 0 too.

Canonical stages (T tokens in the step, S KV positions after it, H heads, KV
kv heads, D head dim, E hidden, F FFN width, V vocab; row-major, no batch
dim): embed [T,E]; blk.{i}.attn_norm [T,E]; blk.{i}.q [T,H,D], .k/.v
[T,KV,D] (bias included, before RoPE; Phi-3: the pieces of qkv_proj's
output, q then k then v); blk.{i}.q_norm/.k_norm (Qwen3 only, per-head
RMSNorm, before RoPE); blk.{i}.q_rope [T,H,D], .k_rope [T,KV,D];
blk.{i}.attn_scores [H,T,S] (q_rope.k_rope^T / sqrt(D), the softmax input,
causally masked entries exactly 0); blk.{i}.attn_probs [H,T,S] (masked
entries exactly 0); blk.{i}.attn_ctx [T,H*D]; blk.{i}.attn_out [T,E];
blk.{i}.ffn_inp [T,E]; blk.{i}.ffn_norm [T,E]; blk.{i}.ffn_gate/.ffn_up
[T,F] (Phi-3: the halves of gate_up_proj's output, gate first);
blk.{i}.ffn_act [T,F]; blk.{i}.ffn_out [T,E]; blk.{i}.out [T,E];
output_norm [T,E]; logits [T,V]; sample_probs [1,V].

sample_probs exists only with random sampling (with greedy sampling it is
not written even when tapped, and the log says so): the distribution the
step's token is drawn from, i.e. the softmax of the last row's logits / T
after top-k (keep the k largest, ties broken by the lower index) and then
top-p (keep the smallest prefix, in descending order, whose mass reaches p,
renormalised); 0 for removed tokens. This is HF's TemperatureLogitsWarper ->
TopKLogitsWarper -> TopPLogitsWarper order. A temperature <= 0 is greedy
(sample_probs one-hot at the argmax). The probabilities are computed in
float64 and stored as float32. The draw: numpy's default_rng(seed), one
uniform u = rng.random() per step taken before anything else, then the first
token (in descending order) at which the running mass exceeds u. Same seed,
same tokens; another seed, other tokens.

Arithmetic (float32 throughout, as HF's eager forward): RMSNorm is
w * (x * 1/sqrt(mean(x^2) + eps)); RoPE is neox style (rotate halves) with
inv_freq = 1/theta^(2j/D) and angle = position * inv_freq in float32 and
cos/sin of that float32 angle correctly rounded; scores are (q.k^T) times
the float32 scale D^-0.5; softmax subtracts the row max and multiplies by
1/sum; query head h reads KV head h // (H/KV); silu(g) = g / (1 + exp(-g)).

Storage "f16"/"bf16" emulates an engine that holds weights and stage outputs
in that type and computes in float32, with touchstone's CPU engine's
rounding points: every weight is rounded once at load (round to nearest
even, kept as float32), and every stage output right after it is computed:
norms, projections (the GEMM output, and again after a bias add), q_norm /
k_norm, RoPE, the attention context, silu*up, both residual adds and the
logits. attn_scores and attn_probs stay float32 (not rounded). The KV cache
therefore holds the rounded k_rope and v, and sampling reads the rounded
logits. With "f32" nothing is rounded.

Options: --threads N sets the BLAS thread count (default 1: results then do
not depend on the machine's core count). For tests: --bug rope-decode
leaves RoPE out of every decode step (the prefill is right), the planted bug
numpy_engine_rope_bug.py runs.
"""
import os
import sys


def _threads_from_argv(argv):
    for i, a in enumerate(argv):
        if a == "--threads" and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith("--threads="):
            return a.split("=", 1)[1]
    return "1"


# BLAS reads these when numpy is first imported.
_THREADS = _threads_from_argv(sys.argv[1:])
for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, _THREADS)

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import mmap  # noqa: E402
import struct  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402

import numpy as np  # noqa: E402

PROTOCOL = 1
ENGINE = "numpy-ref"
F32 = np.float32

# ---------------------------------------------------------------------------
# safetensors, read and written by hand
# ---------------------------------------------------------------------------
_ST_DTYPES = {
    "F64": np.dtype("<f8"), "F32": np.dtype("<f4"), "F16": np.dtype("<f2"),
    "I64": np.dtype("<i8"), "I32": np.dtype("<i4"), "I16": np.dtype("<i2"), "I8": np.dtype("i1"),
    "U64": np.dtype("<u8"), "U32": np.dtype("<u4"), "U16": np.dtype("<u2"), "U8": np.dtype("u1"),
    "BOOL": np.dtype("?"),
}
_NP_TO_ST = {np.dtype("<f4"): "F32", np.dtype("<f8"): "F64", np.dtype("<f2"): "F16",
             np.dtype("<i8"): "I64", np.dtype("<i4"): "I32", np.dtype("u1"): "U8"}


class EngineError(Exception):
    """A request the engine refuses: its message is the response's `error`."""


def read_safetensors(path):
    """(tensors, metadata) of a safetensors file. Tensors are numpy arrays
    (BF16 widened to float32 exactly); metadata is the __metadata__ dict."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        # Mapped, not read: a weight tensor stays on disk until it is used.
        raw = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else b""
    if len(raw) < 8:
        raise EngineError(f"{path}: not a safetensors file (shorter than 8 bytes)")
    (n,) = struct.unpack("<Q", raw[:8])
    if 8 + n > len(raw):
        raise EngineError(f"{path}: header length {n} runs past the end of the file")
    try:
        header = json.loads(raw[8:8 + n].decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise EngineError(f"{path}: the header is not JSON ({e})")
    meta = header.pop("__metadata__", None) or {}
    data = memoryview(raw)[8 + n:]
    out = {}
    for name, info in header.items():
        dt, shape, (b, e) = info["dtype"], [int(s) for s in info["shape"]], info["data_offsets"]
        if not (0 <= b <= e <= len(data)):
            raise EngineError(f"{path}: tensor {name} lies outside the file")
        count = int(np.prod(shape, dtype=np.int64))
        if dt == "BF16":
            if e - b != 2 * count:
                raise EngineError(f"{path}: tensor {name} has {e - b} bytes for shape {shape}")
            u = np.frombuffer(data[b:e], dtype="<u2").astype(np.uint32) << 16
            arr = u.view(np.float32)
        elif dt in _ST_DTYPES:
            want = _ST_DTYPES[dt]
            if e - b != want.itemsize * count:
                raise EngineError(f"{path}: tensor {name} has {e - b} bytes for shape {shape}")
            arr = np.frombuffer(data[b:e], dtype=want)
        else:
            raise EngineError(f"{path}: tensor {name} has dtype {dt}, which this engine cannot read")
        out[name] = arr.reshape(shape)
    return out, meta


def write_safetensors(path, tensors, metadata=None):
    """Writes {name: array} (float32/float64/float16/int64/int32/uint8) as a
    safetensors file, tensors in name order, to path + '.tmp' and renames it
    into place."""
    header, blobs, off = {}, [], 0
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    for name in sorted(tensors):
        a = np.ascontiguousarray(tensors[name])
        a = a.astype(a.dtype.newbyteorder("<"), copy=False)
        st = _NP_TO_ST.get(a.dtype)
        if st is None:
            raise EngineError(f"cannot write tensor {name} of dtype {a.dtype}")
        b = a.tobytes()
        header[name] = {"dtype": st, "shape": list(a.shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    h = json.dumps(header, separators=(",", ":")).encode("utf-8")
    h += b" " * (-len(h) % 8)  # the data starts 8-byte aligned
    tmp = path + ".tmp"
    try:
        with open(tmp, "wb") as f:
            f.write(struct.pack("<Q", len(h)))
            f.write(h)
            for b in blobs:
                f.write(b)
        os.replace(tmp, path)
    except OSError as e:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise EngineError(f"cannot write {path}: {e.strerror or e}")


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


class Model:
    def __init__(self, folder, storage):
        self.folder = folder
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
        self.storage = storage
        self.rnd = STORAGE[storage]
        self._load_weights()
        # RoPE as HF computes it in float32: inv_freq = 1 / theta^(2j/D).
        j2 = np.arange(0, self.D, 2, dtype=np.int64).astype(F32) / F32(self.D)
        self.inv_freq = (F32(1.0) / np.power(F32(self.theta), j2)).astype(F32)
        self.scale = F32(self.D ** -0.5)

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
            self.blocks.append(b)
        self.lm_head.finish(rnd)
        unused = sorted(set(raw) - used)
        # HF keeps these buffers in some checkpoints; nothing computes with them.
        unused = [n for n in unused if not n.endswith("rotary_emb.inv_freq")]
        if unused:
            more = f" and {len(unused) - 5} more" if len(unused) > 5 else ""
            raise EngineError(f"the model file has tensors no layer of a {self.type} model uses: "
                              f"{', '.join(unused[:5])}{more}")

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
        """Runs `tokens` at positions pos0.. appending to `cache` (a list of
        per-layer [keys, values] arrays [S, KV, D]). Calls put(stage, array)
        for tapped stages; returns the (stored) logits of the last row."""
        rnd = self.rnd
        T = len(tokens)
        E, H, KV, D = self.E, self.H, self.KV, self.D
        grp = H // KV
        positions = np.arange(pos0, pos0 + T, dtype=np.int64)
        want = taps.__contains__

        x = self.embed[np.asarray(tokens, dtype=np.int64)]  # already in storage
        if want("embed"):
            put("embed", x)
        for i, b in enumerate(self.blocks):
            p = f"blk.{i}."
            h = rnd(self.rmsnorm(x, b["attn_norm"]))
            if want(p + "attn_norm"):
                put(p + "attn_norm", h)
            q = b["q"](h, rnd).reshape(T, H, D)
            k = b["k"](h, rnd).reshape(T, KV, D)
            v = b["v"](h, rnd).reshape(T, KV, D)
            for n, t in (("q", q), ("k", k), ("v", v)):
                if want(p + n):
                    put(p + n, t)
            if "q_norm" in b:
                q = rnd(self.rmsnorm(q, b["q_norm"]))
                k = rnd(self.rmsnorm(k, b["k_norm"]))
                if want(p + "q_norm"):
                    put(p + "q_norm", q)
                if want(p + "k_norm"):
                    put(p + "k_norm", k)
            if rope_on:
                q = rnd(self.rope(q, positions))
                k = rnd(self.rope(k, positions))
            if want(p + "q_rope"):
                put(p + "q_rope", q)
            if want(p + "k_rope"):
                put(p + "k_rope", k)

            kc = cache[i]
            kc[0] = np.concatenate([kc[0], k], axis=0)
            kc[1] = np.concatenate([kc[1], v], axis=0)
            keys, vals = kc[0], kc[1]
            S = keys.shape[0]
            # GQA: query head h reads KV head h // (H/KV).
            kh = np.repeat(keys.transpose(1, 0, 2), grp, axis=0)  # [H, S, D]
            vh = np.repeat(vals.transpose(1, 0, 2), grp, axis=0)  # [H, S, D]
            qh = np.ascontiguousarray(q.transpose(1, 0, 2))  # [H, T, D]
            scores = np.matmul(qh, kh.transpose(0, 2, 1)) * self.scale  # [H, T, S]
            # Key j is visible to query row t iff j <= pos0 + t.
            masked = np.arange(S)[None, :] > positions[:, None]  # [T, S]
            if self.window is not None:
                masked |= np.arange(S)[None, :] <= positions[:, None] - self.window
            if want(p + "attn_scores"):
                put(p + "attn_scores", np.where(masked[None], F32(0.0), scores))
            s = np.where(masked[None], F32(-np.inf), scores)
            e = np.exp(s - s.max(axis=-1, keepdims=True))
            probs = e * (F32(1.0) / e.sum(axis=-1, keepdims=True, dtype=F32))
            if want(p + "attn_probs"):
                put(p + "attn_probs", probs)
            ctx = np.matmul(probs, vh)  # [H, T, D]
            ctx = rnd(ctx.transpose(1, 0, 2).reshape(T, H * D))
            if want(p + "attn_ctx"):
                put(p + "attn_ctx", ctx)
            ao = b["o"](ctx, rnd)
            if want(p + "attn_out"):
                put(p + "attn_out", ao)
            x = rnd(x + ao)
            if want(p + "ffn_inp"):
                put(p + "ffn_inp", x)
            h = rnd(self.rmsnorm(x, b["ffn_norm"]))
            if want(p + "ffn_norm"):
                put(p + "ffn_norm", h)
            g = b["gate"](h, rnd)
            if want(p + "ffn_gate"):
                put(p + "ffn_gate", g)
            u = b["up"](h, rnd)
            if want(p + "ffn_up"):
                put(p + "ffn_up", u)
            with np.errstate(over="ignore"):
                act = rnd((g / (F32(1.0) + np.exp(-g))) * u)
            if want(p + "ffn_act"):
                put(p + "ffn_act", act)
            fo = b["down"](act, rnd)
            if want(p + "ffn_out"):
                put(p + "ffn_out", fo)
            x = rnd(x + fo)
            if want(p + "out"):
                put(p + "out", x)
        xn = rnd(self.rmsnorm(x, self.norm))
        if want("output_norm"):
            put("output_norm", xn)
        logits = self.lm_head(xn, rnd)
        if want("logits"):
            put("logits", logits)
        return logits[-1]


# ---------------------------------------------------------------------------
# sampling
# ---------------------------------------------------------------------------
def argmax(row):
    """The lowest index of the maximum (NaN never wins)."""
    r = np.where(np.isnan(row), -np.inf, row)
    return int(np.argmax(r))


def sample_distribution(row, temperature, top_k, top_p):
    """(order, probs): the tokens a draw chooses from, in descending logit
    order (ties by index), and their probabilities (float64, sum 1):
    temperature, then top-k, then top-p, renormalised."""
    row = np.asarray(row, dtype=np.float64)
    idx = np.flatnonzero(np.isfinite(row))
    if idx.size == 0:
        return np.array([argmax(row)]), np.array([1.0])
    idx = idx[np.lexsort((idx, -row[idx]))]  # descending logit, ties by lower index
    if top_k is not None:
        idx = idx[:max(int(top_k), 1)]
    z = (row[idx] - row[idx[0]]) / float(temperature)
    pr = np.exp(z)
    pr /= pr.sum()
    if top_p is not None:
        c = np.cumsum(pr)
        hit = np.flatnonzero(c >= float(top_p))
        keep = int(hit[0]) + 1 if hit.size else pr.size
        idx, pr = idx[:keep], pr[:keep]
        pr = pr / pr.sum()
    return idx, pr


def parse_sampling(s):
    if s == "greedy" or s is None:
        return None
    if not isinstance(s, dict):
        raise EngineError(f'sampling must be "greedy" or {{"temperature":T,"top_k":K|null,"top_p":P|null}}, '
                          f"not {s!r}")
    extra = set(s) - {"temperature", "top_k", "top_p"}
    if extra:
        raise EngineError(f"sampling has unknown field(s) {sorted(extra)}")
    t = s.get("temperature", 1.0)
    k = s.get("top_k")
    p = s.get("top_p")
    if not isinstance(t, (int, float)) or isinstance(t, bool) or not math.isfinite(t):
        raise EngineError(f"sampling.temperature must be a finite number, not {t!r}")
    if k is not None and (not isinstance(k, int) or isinstance(k, bool) or k < 0):
        raise EngineError(f"sampling.top_k must be a non-negative integer or null, not {k!r}")
    if p is not None and (not isinstance(p, (int, float)) or isinstance(p, bool) or not 0.0 <= p <= 1.0):
        raise EngineError(f"sampling.top_p must be a number in [0, 1] or null, not {p!r}")
    # HF's switches: top_k 0 and top_p 1.0 turn that filter off.
    return {"temperature": float(t), "top_k": k if k else None,
            "top_p": None if p is None or p >= 1.0 else float(p)}


class Sampler:
    def __init__(self, sampling, seed, vocab):
        self.sampling = sampling
        self.vocab = vocab
        self.rng = np.random.default_rng(seed)

    def __call__(self, row):
        """(token, sample_probs [1,V] float32 or None for greedy)."""
        s = self.sampling
        if s is None:
            return argmax(row), None
        u = self.rng.random()  # one draw per step, taken first
        dist = np.zeros((1, self.vocab), dtype=F32)
        if s["temperature"] <= 0.0:
            tok = argmax(row)
            dist[0, tok] = 1.0
            return tok, dist
        idx, pr = sample_distribution(row, s["temperature"], s["top_k"], s["top_p"])
        dist[0, idx] = pr.astype(F32)
        c = np.cumsum(pr)
        n = int(np.searchsorted(c, u, side="right"))
        tok = int(idx[min(n, idx.size - 1)])
        return tok, dist


# ---------------------------------------------------------------------------
# the protocol
# ---------------------------------------------------------------------------
def _int_list(v, what):
    if not isinstance(v, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in v):
        raise EngineError(f"{what} must be a list of integer token ids")
    return v


class Engine:
    name = ENGINE
    rope_in_decode = True  # the planted bug (numpy_engine_rope_bug.py) turns this off

    def __init__(self, log):
        self.log = log
        self.model = None

    def handle(self, req):
        if not isinstance(req, dict):
            raise EngineError("a request must be a JSON object")
        op = req.get("op")
        if op == "load":
            return self.load(req)
        if op == "run":
            return self.run(req)
        if op == "shutdown":
            return {"ok": True}
        raise EngineError(f"unknown op {op!r} (this engine knows load, run, shutdown)")

    def load(self, req):
        proto = req.get("protocol")
        if proto != PROTOCOL:
            raise EngineError(f"unsupported protocol version {proto!r}: this engine speaks protocol {PROTOCOL}")
        storage = req.get("storage", "f32")
        if storage not in STORAGE:
            raise EngineError(f"unsupported storage {storage!r}: this engine supports f32, f16 and bf16")
        folder = req.get("model")
        if not isinstance(folder, str) or not folder:
            raise EngineError("load needs `model`, the path of an HF model folder")
        if not os.path.isdir(folder):
            raise EngineError(f"model {folder!r} is not a folder (this engine reads HF folders: "
                              "config.json + model.safetensors)")
        t0 = time.monotonic()
        self.model = None
        m = Model(folder, storage)
        self.model = m
        self.log(f"loaded {folder}: {m.type}, {m.L} layers, E {m.E}, H {m.H}, KV {m.KV}, D {m.D}, "
                 f"F {m.F}, V {m.V}, theta {m.theta:g}, storage {storage} ({time.monotonic() - t0:.2f}s)")
        return {"ok": True, "engine": self.name}

    def run(self, req):
        m = self.model
        if m is None:
            raise EngineError("run before load: send a load request first")
        prompt = _int_list(req.get("prompt"), "prompt")
        if not prompt:
            raise EngineError("prompt is empty")
        n = req.get("decode_steps", 0)
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise EngineError(f"decode_steps must be a non-negative integer, not {n!r}")
        sampling = parse_sampling(req.get("sampling", "greedy"))
        seed = req.get("seed", 0)
        if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
            raise EngineError(f"seed must be a non-negative integer, not {seed!r}")
        forced = req.get("forced")
        if forced is not None:
            forced = _int_list(forced, "forced")
            if len(forced) < n:
                raise EngineError(f"forced has {len(forced)} token(s) for {n} decode step(s)")
        for t in prompt + (forced or [])[:n]:
            if not 0 <= t < m.V:
                raise EngineError(f"token id {t} is outside the vocabulary (0..{m.V - 1})")
        total = len(prompt) + n
        if total > m.max_pos:
            raise EngineError(f"prompt + decode steps = {total} positions, more than the model's "
                              f"max_position_embeddings {m.max_pos}")
        taps = req.get("taps") or []
        if not isinstance(taps, list) or not all(isinstance(s, str) for s in taps):
            raise EngineError("taps must be a list of stage names")
        known = set(stage_names(m.type, m.L))
        # q_norm/k_norm are canonical stages that only Qwen3 has: tapped on
        # another architecture they are skipped (not written), like
        # sample_probs under greedy sampling. Any other name is an error.
        absent = set(stage_names("qwen3", m.L)) - known
        bad = [s for s in taps if s not in known and s not in absent]
        if bad:
            raise EngineError(f"unknown stage(s) for a {m.L}-layer {m.type} model: {', '.join(bad[:5])}")
        skipped = sorted(set(taps) & absent)
        if skipped:
            self.log(f"{', '.join(skipped)}: tapped, but a {m.type} model has no such stage: not written")
        taps = set(taps) - absent
        out = req.get("out")
        if not isinstance(out, str) or not out:
            raise EngineError("run needs `out`, the path of the safetensors file to write")
        if "sample_probs" in taps and sampling is None:
            self.log("sample_probs is tapped but sampling is greedy: no sample_probs is written")

        t0 = time.monotonic()
        cache = [[np.zeros((0, m.KV, m.D), F32), np.zeros((0, m.KV, m.D), F32)] for _ in range(m.L)]
        sampler = Sampler(sampling, seed, m.V)
        tensors, tokens = {}, []
        feed, pos = list(prompt), 0
        for si in range(n + 1):
            step = "prefill" if si == 0 else f"decode{si}"

            def put(stage, a, step=step):
                tensors[f"{step}/{stage}"] = np.array(a, dtype=F32, copy=True)
            with np.errstate(divide="ignore", invalid="ignore"):
                row = m.forward(feed, pos, cache, taps, put, rope_on=si == 0 or self.rope_in_decode)
            tok, dist = sampler(row)
            if dist is not None and "sample_probs" in taps:
                put("sample_probs", dist)
            tokens.append(tok)
            pos += len(feed)
            if si < n:
                feed = [forced[si] if forced is not None else tok]
        tensors["tokens"] = np.array(tokens, dtype=np.int64)
        write_safetensors(out, tensors, {"format": "touchstone-engine-out/1", "engine": self.name})
        self.log(f"run: {len(prompt)} prompt token(s), {n} decode step(s), "
                 f"{'greedy' if sampling is None else sampling}, seed {seed}, "
                 f"{'forced' if forced is not None else 'free'}, {len(taps)} tap(s) -> tokens {tokens} "
                 f"({time.monotonic() - t0:.2f}s, {out})")
        return {"ok": True}


def serve(engine_cls, argv=None):
    ap = argparse.ArgumentParser(description="numpy reference engine for touchstone's subprocess "
                                             "protocol (JSON lines on stdin/stdout; see the module docstring)")
    ap.add_argument("--threads", default="1", help="BLAS threads (default 1)")
    ap.add_argument("--bug", choices=["rope-decode"], help="plant a bug (for tests)")
    args = ap.parse_args(argv)

    # The protocol owns the real stdout; anything else printed goes to the log.
    proto = sys.stdout
    sys.stdout = sys.stderr

    def log(msg):
        print(f"[{engine_cls.name}] {msg}", file=sys.stderr, flush=True)

    engine = engine_cls(log)
    if args.bug == "rope-decode":
        engine.rope_in_decode = False
        engine.name += "+rope-decode-bug"
    log(f"protocol {PROTOCOL}, numpy {np.__version__}, pid {os.getpid()}; waiting for requests on stdin")

    def reply(obj):
        proto.write(json.dumps(obj, separators=(",", ":")) + "\n")
        proto.flush()

    for line in sys.stdin.buffer:
        line = line.strip()
        if not line:
            continue
        try:
            req = json.loads(line.decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as e:
            log(f"bad request line: {e}")
            reply({"ok": False, "error": f"the request is not a JSON object on one line: {e}"})
            continue
        op = req.get("op") if isinstance(req, dict) else None
        try:
            resp = engine.handle(req)
        except EngineError as e:
            log(f"{op}: refused: {e}")
            resp = {"ok": False, "error": str(e)}
        except Exception as e:  # a bug here: say so, keep serving
            log(f"{op}: internal error\n{traceback.format_exc()}")
            resp = {"ok": False, "error": f"internal error in {engine.name} during {op}: "
                                          f"{type(e).__name__}: {e}"}
        reply(resp)
        if op == "shutdown":
            log("shutdown")
            return 0
    log("end of input; exiting")
    return 0


if __name__ == "__main__":
    sys.exit(serve(Engine))
