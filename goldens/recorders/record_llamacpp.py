#!/usr/bin/env python3
"""Record golden tensors for every canonical stage with llama.cpp.

usage: record_llamacpp.py GGUF OUT_FILE --hf-golden HF_GOLDEN [--threads N]
                          [--steps STEP,...] [--stages PATTERN,...] [--logits all|last]
                          [--rows ROW,...] [--kv-type f32|f16] [--list-nodes]

GGUF is used as it is, quantised or not (a real model's Q4_K_M file runs
as downloaded; the tiny models' F32 GGUFs come from convert_gguf.py).

Runs libllama (built by build_llamacpp.py from the pinned llama-cpp-python
sdist) through that sdist's low-level ctypes bindings (llama_cpp/llama_cpp.py,
loaded without the high-level package, never pip-installed) on EXACTLY the
token ids of the HF golden: `prefill/tokens` as one batch, then
`decode1/tokens`, `decode2/tokens`, ... one by one, at the HF golden's
positions (teacher forcing: both sources see identical inputs, whatever
llama.cpp would have predicted). Settings without which llama.cpp differs
from HF by ~3e-3: F32 K and V cache (the default F16 rounds them; `--kv-type
f16` records llama.cpp with its default cache, a reference whose arithmetic
says kv f16), flash attention DISABLED (and only then is there a softmax node to record), logits
for every token (else the last layer is pruned to the output rows). One
thread by default.

An eval callback (`cb_eval`) copies the graph nodes out as they are
computed; NODE_MAP, the one table below, turns llama.cpp node names of the
pinned version into the canonical stages and layouts of record_hf.py
(the same keys `<step>/<stage>`, the same shapes, checked against the HF
golden), plus `<step>/tokens` and `<step>/positions`. For Llama models the
converter permutes the rows of the Q and K weights (so llama.cpp's
interleaved-pair RoPE equals HF's rotate-half RoPE); the recorder undoes that
permutation on q, k, q_rope and k_rope so the golden is in HF's layout.

--steps/--stages/--stages-at/--logits/--rows store a subset, as in record_hf.py; by
default the same subset the HF golden stored (its provenance `record`), so the
two files have the same keys. Tokens and positions are stored for every step.

blk.{i}.attn_scores [H,T,S] is record_hf.py's stage (the scaled scores
q_rope . k_rope^T / sqrt(D), the softmax input before the mask, causally
masked entries exactly 0), which llama.cpp never materialises: its graph
computes kq-L (MUL_MAT, unscaled) and ggml_soft_max_ext applies kq_scale
inside the softmax. The recorder takes kq-L, slices it from the padded KV
length to S, multiplies it in float32 by the kq_scale of the SOFT_MAX node
(its op_params; exactly what the op computes before adding the mask) and
zeroes the causally masked entries (see NODE_MAP). For Phi-3 the graph scales
Q before kq (kq_scale 1), so the stored scores are kq as it is; so does
Gemma 3's, after RoPE (an unnamed SCALE node by f_attention_scale,
1/sqrt(head_dim) for every size but the 27B, which must equal HF's
query_pre_attn_scalar^-0.5: asserted), so its scores are
(q_rope * scale) . k_rope^T.

If every logits row of the HF golden ties in pairs (logits[2j] == logits[2j+1]
bit for bit: phi3-tiny's LM head has rows equal in pairs), llama.cpp's logits
must tie the same way and every greedy id must be even; asserted.

Architectures: qwen2, llama, qwen3 (per-head q/k RMSNorm: `Qcur_normed-L`,
`Kcur_normed-L`), phi3 (fused `wqkv-L` and fused up/gate `ffn_up-L`,
split into the canonical q/k/v and ffn_gate/ffn_up here) and gemma3 (HF
model_type gemma3_text; see NODE_MAP's gemma3 entry).

Sliding-window attention (gemma3): the context keeps a full-size SWA cache
(swa_full = true, llama.cpp's default, pinned: provenance
`settings.swa_full`), so cell p holds position p in every layer's cache and
the [H,T,S] columns are positions, as for full attention. Which layers
slide and how far is asserted from the graph, against the HF config's
layer_types and sliding_window: every attn_probs entry masked by the causal
mask or the layer's window (query - key >= sliding_window) is exactly 0, every
other one is > 0 in some head, a full-attention layer has non-zero entries
beyond the window, and each layer's RoPE of Q and K uses its layer type's
base (ROPE op_params freq_base: rope.freq_base_swa on sliding layers). The
stored attn_scores are zeroed on the same masked entries.

Gemma 3's GELU: ggml's CPU GEGLU (ggml_vec_geglu_f32, GGML_GELU_FP16 is
defined unconditionally in ggml-cpu/vec.h) rounds the gate to float16 and
looks the GELU up in a float16 table for |gate| < 10, then multiplies by up
in float32: its ffn_act is about 1e3 float32 roundings from the oracle
(5e-4 relative), and everything after the first layer's FFN inherits that.
The golden records it as it is: it is llama.cpp's arithmetic.

`__metadata__`: `format` = touchstone-golden/1 and `provenance` (compact
sorted JSON). Nothing in the output varies between runs (no time, host or
path): a rerun is byte-for-byte identical.
"""
import argparse
import ctypes
import importlib
import json
import os
import platform
import re
import sys
import types

import numpy as np
import safetensors
from safetensors import safe_open

sys.dont_write_bytecode = True
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import build_llamacpp  # noqa: E402
import golden_io  # noqa: E402
from golden_io import FORMAT, progress, save_deterministic, sha256_file  # noqa: E402

RECORDER = "goldens/recorders/record_llamacpp.py"

# ---- the node-name map (llama.cpp as vendored by llama-cpp-python 0.3.36) --
# canonical stage -> (node name, op, selector). `{L}` is the layer. A name
# occurs several times in one graph (Qcur-L: MUL_MAT, [ADD bias,] RESHAPE,
# ROPE); the op picks the one meant. Selectors:
#   "last"       the last node with this name and op (a name/op pair is
#                unique except where noted)
#   "after"      the first node with this op after the last node called
#                `name`, whose own name must be one of AFTER_NAMES[stage]:
#                o_proj's output is unnamed in the Qwen2 graph (the MUL_MAT
#                right after kqv_out-L; Llama names it attn_out-L), and the
#                Phi-3 graph leaves the residual after attention unnamed.
#   "split:P/N"  piece P of N of the node's last dimension, in the sizes of
#                SPLITS[stage kind]: Phi-3's fused projections. q, k, v are
#                the first H*D, next KV*D and last KV*D features of wqkv-L
#                (build_qkv's views); gate and up are the first and second
#                F features of ffn_up-L (ggml_swiglu: silu(first half) *
#                second half, as HF's Phi3MLP `gate, up = x.chunk(2)`).
# Layout transforms (by stage): numpy shape is ggml `ne` reversed, reshaped to
# the canonical shape; attn_probs is sliced from the padded KV length to the
# real S (the sliced-off columns must be exactly 0); q/k/q_rope/k_rope are
# un-permuted for architectures in QK_PERMUTED.
# attn_scores: llama.cpp never materialises the scaled scores. The graph
# computes kq-L = k·q (MUL_MAT, unscaled) and hands it to
# ggml_soft_max_ext(kq, mask, kq_scale, max_bias), which scales, adds the
# mask and normalises in one op. So the recorder takes kq-L, slices it from
# the padded KV length to S like attn_probs, multiplies it in float32 by the
# kq_scale that SOFT_MAX node carries (op_params[0], as the op does: x*scale
# in float32, then + mask), and sets the entries the causal mask removes
# (key position > query position) to exactly 0. Phi-3's graph scales Q by
# 1/sqrt(D) (a SCALE node) before kq and passes kq_scale 1; either way the
# product of the two scales is asserted to be 1/sqrt(D) (max_bias 0: no
# ALiBi).
NODE_MAP = {
    "embed": ("embd", "GET_ROWS", "last"),
    "blk.{L}.attn_norm": ("attn_norm-{L}", "MUL", "last"),
    "blk.{L}.q": ("Qcur-{L}", "RESHAPE", "last"),    # [T,H,D], after the bias add if any
    "blk.{L}.k": ("Kcur-{L}", "RESHAPE", "last"),
    "blk.{L}.v": ("Vcur-{L}", "RESHAPE", "last"),
    "blk.{L}.q_rope": ("Qcur-{L}", "ROPE", "last"),
    "blk.{L}.k_rope": ("Kcur-{L}", "ROPE", "last"),
    "blk.{L}.attn_scores": ("kq-{L}", "MUL_MAT", "last"),           # [H,T,n_kv padded], unscaled
    "blk.{L}.attn_probs": ("kq_soft_max-{L}", "SOFT_MAX", "last"),  # [H,T,n_kv padded]
    "blk.{L}.attn_ctx": ("kqv_out-{L}", "CONT", "last"),            # [T,H*D]
    "blk.{L}.attn_out": ("kqv_out-{L}", "MUL_MAT", "after"),
    "blk.{L}.ffn_inp": ("ffn_inp-{L}", "ADD", "last"),
    "blk.{L}.ffn_norm": ("ffn_norm-{L}", "MUL", "last"),
    "blk.{L}.ffn_gate": ("ffn_gate-{L}", "MUL_MAT", "last"),
    "blk.{L}.ffn_up": ("ffn_up-{L}", "MUL_MAT", "last"),
    "blk.{L}.ffn_act": ("ffn_swiglu-{L}", "SWIGLU", "last"),       # silu(gate)*up, one op
    "blk.{L}.ffn_out": ("ffn_out-{L}", "MUL_MAT", "last"),
    "blk.{L}.out": ("l_out-{L}", "ADD", "last"),
    "output_norm": ("result_norm", "MUL", "last"),
    "logits": ("result_output", "MUL_MAT", "last"),
}
# Per-architecture differences from NODE_MAP.
ARCH_NODE_MAP = {
    # Qwen3: build_norm(Qcur, attn_q_norm) = RMS_NORM then MUL by the weight,
    # named after the MUL; the RESHAPE named Qcur-L is still the projection.
    "qwen3": {
        "blk.{L}.q_norm": ("Qcur_normed-{L}", "MUL", "last"),
        "blk.{L}.k_norm": ("Kcur_normed-{L}", "MUL", "last"),
    },
    # Gemma 3 (llama.cpp's models/gemma3.cpp): the embeddings times sqrt(n_embd) are
    # `inp_scaled` (a SCALE of embd); per-head q/k norms as Qwen3; the norm
    # of the attention output is attn_post_norm-L (MUL), the residual after
    # attention sa_out-L, the gated GELU one GEGLU op (ffn_geglu-L: the tanh
    # GELU of the gate times up) and the norm of the FFN output
    # ffn_post_norm-L (MUL), before l_out-L adds the residual. Q is scaled by
    # f_attention_scale after RoPE, in an unnamed SCALE node (see
    # kq_scale_of), and the softmax gets kq_scale 1.
    "gemma3": {
        "embed": ("inp_scaled", "SCALE", "last"),
        "blk.{L}.q_norm": ("Qcur_normed-{L}", "MUL", "last"),
        "blk.{L}.k_norm": ("Kcur_normed-{L}", "MUL", "last"),
        "blk.{L}.attn_post_norm": ("attn_post_norm-{L}", "MUL", "last"),
        "blk.{L}.ffn_inp": ("sa_out-{L}", "ADD", "last"),
        "blk.{L}.ffn_act": ("ffn_geglu-{L}", "GEGLU", "last"),
        "blk.{L}.ffn_post_norm": ("ffn_post_norm-{L}", "MUL", "last"),
    },
    # Phi-3: fused projections (Qcur/Kcur/Vcur before RoPE are only views of
    # wqkv-L, which the recorder does not copy), an unnamed residual add.
    "phi3": {
        "blk.{L}.q": ("wqkv-{L}", "MUL_MAT", "split:0/3"),
        "blk.{L}.k": ("wqkv-{L}", "MUL_MAT", "split:1/3"),
        "blk.{L}.v": ("wqkv-{L}", "MUL_MAT", "split:2/3"),
        "blk.{L}.ffn_inp": ("kqv_out-{L}", "ADD", "after"),
        "blk.{L}.ffn_gate": ("ffn_up-{L}", "MUL_MAT", "split:0/2"),
        "blk.{L}.ffn_up": ("ffn_up-{L}", "MUL_MAT", "split:1/2"),
    },
}
# The names an "after" node may carry: ggml calls an unnamed node
# "node_<index>" (Qwen2's o_proj output), Llama's graph names it attn_out-L.
AFTER_NAMES = {
    "attn_out": (r"node_\d+", r"attn_out-{L}"),
    "ffn_inp": (r"node_\d+", r"ffn_inp-{L}"),
}
# general.architecture values whose converter permutes Q/K weight rows
# (LlamaModel.permute in vendor/llama.cpp/conversion/llama.py) and whose
# graph uses the interleaved-pair ("NORM") RoPE on them.
QK_PERMUTED = {"llama"}
ROPE_TYPE = {"llama": 0, "qwen2": 2, "qwen3": 2, "phi3": 2, "gemma3": 2}  # LLAMA_ROPE_TYPE_NORM, _NEOX
# HF model_type -> GGUF general.architecture, where they differ.
HF_MODEL_TYPE_ARCH = {"gemma3_text": "gemma3"}
# Architectures whose graph scales Q after RoPE in an unnamed SCALE node
# (gemma3.cpp: Qcur = ggml_scale(Qcur, f_attention_scale) after cb(Qcur,
# "Qcur")) and passes kq_scale 1 to the softmax.
Q_SCALE_AFTER_ROPE = {"gemma3"}


def node_map(arch):
    """stage template -> (node, op, selector) for one architecture, in the
    canonical execution order."""
    m = dict(NODE_MAP, **ARCH_NODE_MAP.get(arch, {}))
    order = ["embed"] + [f"blk.{{L}}.{s}" for s in golden_io.block_stages(arch)] + ["output_norm", "logits"]
    missing = [s for s in order if s not in m]
    assert not missing, f"no node for {missing} in the {arch} map"
    return [(s, *m[s]) for s in order]


VIEW_OPS = {"VIEW", "PERMUTE", "TRANSPOSE", "SET_ROWS", "CPY"}
GGML_TYPE_F32 = 0
GGML_TYPE_F16 = 1


class GgmlTensor(ctypes.Structure):
    """struct ggml_tensor of the pinned ggml (GGML_MAX_DIMS 4, GGML_MAX_SRC 10,
    GGML_MAX_OP_PARAMS 64 bytes, GGML_MAX_NAME 64); the callback checks the
    layout against ggml_get_name on every node."""
    _fields_ = [
        ("type", ctypes.c_int),
        ("buffer", ctypes.c_void_p),
        ("ne", ctypes.c_int64 * 4),
        ("nb", ctypes.c_size_t * 4),
        ("op", ctypes.c_int),
        ("op_params", ctypes.c_int32 * 16),
        ("flags", ctypes.c_int32),
        ("src", ctypes.c_void_p * 10),
        ("view_src", ctypes.c_void_p),
        ("view_offs", ctypes.c_size_t),
        ("data", ctypes.c_void_p),
        ("name", ctypes.c_char * 64),
        ("extra", ctypes.c_void_p),
        ("padding", ctypes.c_char * 8),
    ]


def log(msg):
    progress("record_llamacpp.py", msg)


def load_bindings(src, lib_dir):
    """The sdist's llama_cpp/llama_cpp.py (ctypes bindings) on our libllama,
    without running llama_cpp/__init__.py (whose high-level API would pull in
    diskcache and jinja2)."""
    os.environ["LLAMA_CPP_LIB_PATH"] = lib_dir
    pkg = types.ModuleType("llama_cpp")
    pkg.__path__ = [os.path.join(src, "llama_cpp")]
    sys.modules["llama_cpp"] = pkg
    lc = importlib.import_module("llama_cpp.llama_cpp")
    assert os.path.dirname(lc.__file__) == os.path.join(src, "llama_cpp"), lc.__file__
    g = ctypes.CDLL(os.path.join(lib_dir, "libggml-base.so"))
    for fn, args, res in [
        ("ggml_nbytes", [ctypes.c_void_p], ctypes.c_size_t),
        ("ggml_op_desc", [ctypes.c_void_p], ctypes.c_char_p),
        ("ggml_get_name", [ctypes.c_void_p], ctypes.c_char_p),
        ("ggml_backend_tensor_get", [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t], None),
    ]:
        getattr(g, fn).argtypes = args
        getattr(g, fn).restype = res
    return lc, g


class NodeRecorder:
    """The eval callback: for every node, its name, op and shape; for F32
    nodes that are not pure views of other memory (KV cache writes and
    views), a copy of the data."""

    def __init__(self, g):
        self.g = g
        self.nodes = []

    def callback(self, t, ask, user_data):
        if ask:
            return True  # observe every node (unnamed ones too: o_proj in Qwen2)
        tt = ctypes.cast(t, ctypes.POINTER(GgmlTensor)).contents
        name = tt.name.decode("utf-8")
        assert self.g.ggml_get_name(t).decode("utf-8") == name, "struct ggml_tensor layout mismatch"
        op = self.g.ggml_op_desc(t).decode()
        ne = [int(x) for x in tt.ne]
        data = None
        if tt.type == GGML_TYPE_F32 and op not in VIEW_OPS:
            nb = [int(x) for x in tt.nb]
            n = self.g.ggml_nbytes(t)
            buf = (ctypes.c_uint8 * n)()
            self.g.ggml_backend_tensor_get(t, buf, 0, n)
            flat = np.frombuffer(buf, dtype=np.uint8)
            data = np.lib.stride_tricks.as_strided(
                flat.view(np.float32), shape=tuple(reversed(ne)), strides=tuple(reversed(nb))).copy()
        self.nodes.append({"name": name, "op": op, "ne": ne, "data": data,
                           "op_params": bytes(bytearray(tt.op_params))})
        return True


def pick(nodes, name, op, sel, stage, layer):
    if sel == "last" or sel.startswith("split:"):
        hits = [n for n in nodes if n["name"] == name and n["op"] == op]
        assert hits, f"no node {name} with op {op}"
        return hits[-1]
    assert sel == "after", sel
    named = [i for i, n in enumerate(nodes) if n["name"] == name]
    assert named, f"no node {name}"
    allowed = [a.format(L=layer) for a in AFTER_NAMES[stage.split(".")[-1]]]
    for n in nodes[named[-1] + 1:]:
        if n["op"] == op:
            assert any(re.fullmatch(a, n["name"]) for a in allowed), \
                f"node after {name} is {n['name']!r}, expected one of {allowed}"
            return n
    raise AssertionError(f"no {op} after {name}")


def split_piece(a, sel, stage, dims):
    """Piece P/N of a fused projection's output [T, sum(sizes)] (see NODE_MAP)."""
    H, KV, D, E, F, V, _ = dims
    p, n = (int(x) for x in sel[len("split:"):].split("/"))
    sizes = [H * D, KV * D, KV * D] if n == 3 else [F, F]
    a = a.reshape(-1, a.shape[-1])
    assert a.shape[-1] == sum(sizes), f"{stage}: fused node has {a.shape[-1]} features, expected {sizes}"
    lo = sum(sizes[:p])
    return a[:, lo:lo + sizes[p]]


def unpermute_qk(x):
    """Undo LlamaModel.permute on the head dim: llama.cpp's feature 2i+h of
    each head is HF's feature h*D/2+i. [T,H,D] -> [T,H,D]."""
    T, H, D = x.shape
    return np.ascontiguousarray(x.reshape(T, H, D // 2, 2).swapaxes(-1, -2).reshape(T, H, D))


def op_param_f32(node, i):
    """float op_params[i] of a node (ggml stores float parameters bitwise)."""
    return float(np.frombuffer(node["op_params"], dtype=np.float32)[i])


def kq_scale_of(step_nodes, layer, attn):
    """The scale the SOFT_MAX node kq_soft_max-L applies to kq-L; asserts it,
    times any SCALE of Q (Phi-3's named Qcur-L, Gemma 3's unnamed one right
    after the RoPE of Q), is the model's attention scale (attn["scale"]:
    1/sqrt(D), or query_pre_attn_scalar^-0.5 for Gemma 3), and that
    max_bias is 0."""
    sm = pick(step_nodes, f"kq_soft_max-{layer}", "SOFT_MAX", "last", "attn_probs", layer)
    scale, max_bias = op_param_f32(sm, 0), op_param_f32(sm, 1)
    assert max_bias == 0.0, f"layer {layer}: soft_max max_bias {max_bias} (ALiBi is not supported)"
    q_scales = [op_param_f32(n, 0) for n in step_nodes if n["name"] == f"Qcur-{layer}" and n["op"] == "SCALE"]
    if attn["arch"] in Q_SCALE_AFTER_ROPE:
        i = max(j for j, n in enumerate(step_nodes) if n["name"] == f"Qcur-{layer}" and n["op"] == "ROPE")
        sc = step_nodes[i + 1]
        assert sc["op"] == "SCALE" and re.fullmatch(r"node_\d+", sc["name"]), \
            f"layer {layer}: the node after Qcur-{layer} ROPE is {sc['name']} {sc['op']}, not the scale of Q"
        # ... and it is what kq multiplies (through a view and a permute).
        assert any(n["name"] == f"{sc['name']} (view) (permuted)" for n in step_nodes), \
            f"layer {layer}: {sc['name']} does not feed kq-{layer}"
        q_scales.append(op_param_f32(sc, 0))
        assert scale == 1.0, f"layer {layer}: Q is scaled, yet the softmax scales by {scale}"
    total = scale * float(np.prod(q_scales)) if q_scales else scale
    assert abs(total / attn["scale"] - 1.0) < 1e-6, f"layer {layer}: attention scale {total}, not {attn['scale']}"
    return np.float32(scale)


def attention_layout(hf_cfg, arch, dims):
    """What the attention of each layer must be, from the HF config: the
    total scale (query_pre_attn_scalar^-0.5 where the config has one, Gemma
    3; else 1/sqrt(D)), the sliding window of each layer (None: full
    attention; Gemma 3's layer_types) and the RoPE base of each layer (where
    rope_parameters are kept per layer type), else None."""
    n_layer = hf_cfg["num_hidden_layers"]
    qpas = hf_cfg.get("query_pre_attn_scalar")
    scale = float(qpas) ** -0.5 if qpas is not None else 1.0 / np.sqrt(dims[2])
    types_ = hf_cfg.get("layer_types") or ["full_attention"] * n_layer
    assert len(types_) == n_layer and set(types_) <= {"full_attention", "sliding_attention"}, types_
    windows = [hf_cfg["sliding_window"] if t == "sliding_attention" else None for t in types_]
    rp = hf_cfg.get("rope_parameters") or {}
    bases = [float(rp[t]["rope_theta"]) for t in types_] if all(t in rp for t in types_) else None
    return {"arch": arch, "scale": scale, "windows": windows, "rope_bases": bases}


def masked_entries(positions, S, window):
    """[T,S] True where the key is masked for the query: in the future, or,
    on a sliding-window layer, `window` or more positions back (llama.cpp's
    LLAMA_SWA_TYPE_STANDARD: p1 - p0 >= n_swa; HF: kv_idx > q_idx - window
    is kept)."""
    q = np.asarray(positions)[:, None]
    k = np.arange(S)[None, :]
    m = k > q
    if window is not None:
        m |= q - k >= window
    return m


def check_rope_bases(step_nodes, step, attn):
    """Each layer's RoPE of Q and K uses its layer type's base (ggml_rope_ext
    op_params[5], freq_base): Gemma 3's sliding layers 10000, full ones 1e6."""
    if attn["rope_bases"] is None:
        return
    for L, base in enumerate(attn["rope_bases"]):
        for name in (f"Qcur-{L}", f"Kcur-{L}"):
            node = pick(step_nodes, name, "ROPE", "last", "q_rope", L)
            got = op_param_f32(node, 5)
            assert got == np.float32(base), f"{step}: layer {L} {name} RoPE base {got}, HF's layer type has {base}"
            assert op_param_f32(node, 6) == 1.0, f"{step}: layer {L} {name}: freq_scale {op_param_f32(node, 6)}"


def canonical(step_nodes, step, arch, n_layer, T, S, permuted, dims, keep, positions, attn):
    """The stages in `keep` of one step, canonical layout (see NODE_MAP).
    `attn`: attention_layout()."""
    out = {}
    for stage, name, op, sel in node_map(arch):
        for L in (range(n_layer) if "{L}" in stage else [None]):
            st = stage.format(L=L)
            if st not in keep:
                continue
            node = pick(step_nodes, name.format(L=L), op, sel, st, L)
            a = node["data"]
            assert a is not None, f"{step}/{st}: node {node['name']} {op} has no F32 data"
            want = golden_io.expected_shape(st, T, S, dims)
            if sel.startswith("split:"):
                a = split_piece(a, sel, st, dims)
            if st.endswith("attn_probs"):
                a = a.reshape(a.shape[-3:])
                assert a.shape[:2] == want[:2] and a.shape[2] >= S, f"{step}/{st}: {a.shape} vs {want}"
                tail = a[..., S:]
                assert tail.size == 0 or not tail.any(), f"{step}/{st}: masked KV cells are not exactly 0"
                a = a[..., :S]
                window = attn["windows"][L]
                if any(w is not None for w in attn["windows"]):
                    # Sliding-window model: column j must be position j (a
                    # linear cell layout: swa_full, a fresh cache) and the
                    # layer's window must be HF's. Every masked entry (future,
                    # or outside this layer's window) is exactly 0 ...
                    masked = masked_entries(positions, S, window)
                    assert not a[:, masked].any(), f"{step}/{st}: masked entries (window {window}) are not exactly 0"
                    # ... every entry the mask keeps is > 0 in some head (so
                    # llama.cpp's window is not narrower) ...
                    assert a.any(axis=0)[~masked].all(), f"{step}/{st}: a key inside the window has probability 0"
                    # ... and a full-attention layer attends beyond the window
                    # some sliding layer would have.
                    w = max(x for x in attn["windows"] if x is not None)
                    beyond = ~masked & masked_entries(positions, S, w)
                    if window is None and beyond.any():
                        assert a[:, beyond].any(), f"{step}/{st}: a full-attention layer is windowed"
            if st.endswith("attn_scores"):
                a = a.reshape(a.shape[-3:])
                assert a.shape[:2] == want[:2] and a.shape[2] >= S, f"{step}/{st}: {a.shape} vs {want}"
                # float32 product, as ggml_compute_forward_soft_max_f32 scales.
                a = a[..., :S].astype(np.float32) * kq_scale_of(step_nodes, L, attn)
                masked = masked_entries(positions, S, attn["windows"][L])  # [T,S]
                a = np.where(masked[None], np.float32(0.0), a).astype(np.float32)
            assert a.size == int(np.prod(want)), f"{step}/{st}: {a.shape} cannot be {want}"
            a = np.ascontiguousarray(a.reshape(want), dtype=np.float32)
            if permuted and st.split(".")[-1] in ("q", "k", "q_rope", "k_rope", "q_norm", "k_norm"):
                a = unpermute_qk(a)
            assert np.isfinite(a).all(), f"{step}/{st} is not finite"
            out[st] = a
    return out


def versions_and_build(binfo, **more):
    """The `versions` and `build` entries of a llama.cpp golden's provenance:
    the Python side's packages and what build_llamacpp.py built libllama
    from (`binfo`), plus `more` versions. record_llamacpp_vlm.py and
    record_next_token.py write the same entries."""
    versions = {
        "python": platform.python_version(),
        "numpy": np.__version__,
        "safetensors": safetensors.__version__,
        "llama_cpp_python": binfo["llama_cpp_python"],
        "llama_cpp_commit": binfo["llama_cpp_commit"],
        "ggml": binfo["ggml_version"],
        "cmake": binfo["cmake"],
        "compiler": binfo["compiler"],
        **more,
    }
    return versions, {"cmake_flags": binfo["flags"], "target": binfo["target"]}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("gguf")
    ap.add_argument("out_file")
    ap.add_argument("--hf-golden", required=True, help="take the token ids (and steps) from this HF golden")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--steps", default=None,
                    help="comma-separated steps to store (default: those the HF golden stored)")
    ap.add_argument("--stages", default=None,
                    help="comma-separated stage patterns to store (default: those the HF golden stored)")
    ap.add_argument("--stages-at", action="append", default=None, metavar="STEP=PATTERN[,PATTERN]",
                    help="also store these stages at this one step (default: the HF golden's stages_at)")
    ap.add_argument("--logits", choices=["all", "last"], default=None,
                    help="`last`: only the last row of each step's logits (default: as the HF golden)")
    ap.add_argument("--rows", default=None, metavar="ROW[,ROW]",
                    help="keep only these token rows of every stage (default: the HF golden's rows)")
    ap.add_argument("--kv-type", choices=["f32", "f16"], default="f32",
                    help="K and V cache type: f32 (default; closest to HF) or f16 (llama.cpp's own default)")
    ap.add_argument("--list-nodes", action="store_true",
                    help="print every graph node (step, index, name, op, numpy shape) to stderr")
    ap.add_argument("--cache-dir", default=build_llamacpp.DEFAULT_CACHE,
                    help="build_llamacpp.py's cache (sdist, source, build)")
    args = ap.parse_args()
    for path, what in ((args.gguf, "GGUF"), (args.hf_golden, "--hf-golden")):
        if not os.path.isfile(path):
            ap.error(f"{what} {path} does not exist")
    with open(args.gguf, "rb") as f:
        if f.read(4) != b"GGUF":
            ap.error(f"{args.gguf} is not a GGUF file (no GGUF magic)")

    lib_dir, binfo = build_llamacpp.ensure_built(os.path.abspath(args.cache_dir))
    src = build_llamacpp.source_dir(os.path.abspath(args.cache_dir))
    lc, g = load_bindings(src, lib_dir)

    # ---- the HF golden: steps, tokens, positions ----------------------------
    hf = {}
    with safe_open(args.hf_golden, "np") as f:
        hf_meta = f.metadata() or {}
        for k in f.keys():
            hf[k] = f.get_tensor(k)
    if hf_meta.get("format") != FORMAT:
        ap.error(f"--hf-golden {args.hf_golden} is not a {FORMAT} file (format {hf_meta.get('format')!r})")
    hf_prov = json.loads(hf_meta["provenance"])
    steps = hf_prov["steps"]
    prompt_ids = [int(x) for x in hf["prefill/tokens"]]
    assert prompt_ids == hf_prov["prompt"]["token_ids"]
    hf_cfg = hf_prov["model_config"]
    n_layer = hf_cfg["num_hidden_layers"]
    dims = golden_io.model_dims(hf_cfg)

    # What to store: as asked, else what the HF golden stored.
    hf_rec = hf_prov.get("record") or {}
    try:
        keep_steps = golden_io.parse_steps(
            args.steps if args.steps is not None else ",".join(hf_rec.get("steps", steps)), len(steps) - 1)
        patterns, keep = golden_io.parse_stages(
            args.stages if args.stages is not None else ",".join(hf_rec.get("stages", ["*"])),
            hf_cfg["model_type"], n_layer)
        stages_at_args = args.stages_at if args.stages_at is not None else \
            [f"{k}={','.join(v)}" for k, v in (hf_rec.get("stages_at") or {}).items()]
        stages_at, stages_at_sets = golden_io.parse_stages_at(stages_at_args, hf_cfg["model_type"], n_layer,
                                                              len(steps) - 1)
    except golden_io.SelectionError as e:
        ap.error(str(e))
    logits_rows = args.logits or hf_rec.get("logits", "all")
    try:
        rows = golden_io.parse_rows(args.rows) if args.rows is not None else hf_rec.get("rows_asked")
    except golden_io.SelectionError as e:
        ap.error(str(e))
    step_tokens = {}  # {step: T}, for the row subset
    # The HF golden's LM head has rows equal in pairs (phi3-tiny) when all its
    # recorded logit pairs tie bit for bit: then llama.cpp's must too, and
    # every greedy id must be even (argmax picks the lowest index of a tie).
    hf_logits = [v for k, v in hf.items() if k.endswith("/logits")]
    pair_ties = bool(hf_logits) and hf_cfg["vocab_size"] % 2 == 0 and all(
        np.array_equal(v[:, 0::2].view(np.uint32), v[:, 1::2].view(np.uint32)) for v in hf_logits)
    if pair_ties:
        log("the HF golden's logits tie in pairs: checking llama.cpp's ties and even greedy ids")

    # ---- model and context ----------------------------------------------------
    log(f"loading {args.gguf}")
    quiet = lc.llama_log_callback(lambda level, text, ud: None)
    lc.llama_log_set(quiet, None)
    lc.llama_backend_init()
    mparams = lc.llama_model_default_params()
    mparams.n_gpu_layers = 0
    mparams.use_mmap = False
    model = lc.llama_model_load_from_file(args.gguf.encode(), mparams)
    if not model:
        sys.exit(f"record_llamacpp.py: libllama could not load {args.gguf} (an architecture or tensor type "
                 "this llama.cpp does not know?)")
    vocab = lc.llama_model_get_vocab(model)
    n_vocab = lc.llama_vocab_n_tokens(vocab)

    def meta(key):
        buf = ctypes.create_string_buffer(256)
        n = lc.llama_model_meta_val_str(model, key.encode(), buf, len(buf))
        return buf.value.decode() if n >= 0 else None
    arch = meta("general.architecture")
    assert arch, "GGUF without general.architecture"
    rope_type = lc.llama_model_rope_type(model)
    if arch not in ROPE_TYPE:
        sys.exit(f"record_llamacpp.py: architecture {arch!r} has no node map (known: {sorted(ROPE_TYPE)})")
    assert rope_type == ROPE_TYPE[arch], f"arch {arch}, rope type {rope_type}"
    permuted = arch in QK_PERMUTED
    assert HF_MODEL_TYPE_ARCH.get(hf_cfg["model_type"], hf_cfg["model_type"]) == arch, (hf_cfg["model_type"], arch)
    # Read now: the model is freed before the provenance is written.
    general_name, file_type = meta("general.name"), meta("general.file_type")
    attn = attention_layout(hf_cfg, arch, dims)
    sliding = any(w is not None for w in attn["windows"])
    if sliding:
        # llama.cpp's window is the GGUF's; which layers slide is checked on
        # the graph (attn_probs' zeros, each layer's RoPE base).
        swa = meta(f"{arch}.attention.sliding_window")
        assert swa is not None and int(swa) == hf_cfg["sliding_window"], (swa, hf_cfg["sliding_window"])
    log(f"{arch} `{general_name}`, {n_layer} layers, vocab {n_vocab}")

    # llama.cpp's own tokenization of the prompt text: recorded, and must
    # agree with HF's (the tokens fed are HF's either way). A chat prompt is
    # the rendered template, whose special tokens must be parsed as such.
    # A prompt given as token ids has no text: nothing to tokenize.
    chat = bool(hf_prov["prompt"].get("chat"))
    given_tokens = hf_prov["prompt"].get("given") == "tokens"
    lcpp_ids = None
    if not given_tokens:
        text = hf_prov["prompt"].get("rendered", hf_prov["prompt"]["text"]).encode()
        n_max = len(text) + 16
        tbuf = (lc.llama_token * n_max)()
        nt = lc.llama_tokenize(vocab, text, len(text), tbuf, n_max, False, chat)
        assert nt >= 0, "tokenize failed"
        lcpp_ids = list(tbuf[:nt])
        assert lcpp_ids == prompt_ids, f"llama.cpp tokenizes the prompt as {lcpp_ids}, HF as {prompt_ids}"

    n_total = sum(len(hf[f"{s}/tokens"]) for s in steps)
    rec = NodeRecorder(g)
    cb = lc.ggml_backend_sched_eval_callback(rec.callback)  # keep a reference while ctx lives
    cparams = lc.llama_context_default_params()
    cparams.n_ctx = 256
    cparams.n_batch = 256
    cparams.n_ubatch = 256
    cparams.n_seq_max = 1
    cparams.n_threads = args.threads
    cparams.n_threads_batch = args.threads
    cparams.flash_attn_type = lc.LLAMA_FLASH_ATTN_TYPE_DISABLED
    # Sliding-window layers: a full-size SWA cache (n_ctx cells, the
    # context's default, pinned here), so that, in a fresh context, token p
    # lands in cell p of every layer's cache as in the full-attention cache:
    # the recorder reads column j of kq/attn_probs as position j. A small SWA
    # cache (swa_full false: n_swa + n_ubatch cells) may hand a cell whose
    # position left the window to a later token, and the columns would no
    # longer be positions. The window itself is applied by llama.cpp's SWA
    # mask either way; the zeros are checked in canonical().
    cparams.swa_full = True
    kv_type = {"f32": GGML_TYPE_F32, "f16": GGML_TYPE_F16}[args.kv_type]
    cparams.type_k = kv_type
    cparams.type_v = kv_type
    cparams.cb_eval = cb
    cparams.cb_eval_user_data = None
    if n_total > cparams.n_ctx:
        sys.exit(f"record_llamacpp.py: {n_total} tokens do not fit the context of {cparams.n_ctx}")
    ctx = lc.llama_init_from_model(model, cparams)
    assert ctx, "context init failed"

    out, greedy_ids, api_vs_graph = {}, [], 0.0
    disagreement = None  # the first step whose greedy pick is not HF's
    batch = lc.llama_batch_init(cparams.n_batch, 0, 1)
    pos_next = 0
    try:
        for step in steps:
            toks = [int(x) for x in hf[f"{step}/tokens"]]
            positions = [int(x) for x in hf[f"{step}/positions"]]
            assert positions == list(range(pos_next, pos_next + len(toks))), f"{step}: positions {positions}"
            log(f"{step}: {len(toks)} token(s) at position {pos_next}")
            rec.nodes = []
            batch.n_tokens = len(toks)
            for i, (tok, p) in enumerate(zip(toks, positions)):
                batch.token[i] = tok
                batch.pos[i] = p
                batch.n_seq_id[i] = 1
                batch.seq_id[i][0] = 0
                batch.logits[i] = 1  # every row, or the last layer is row-pruned
            rc = lc.llama_decode(ctx, batch)
            assert rc == 0, f"llama_decode returned {rc}"
            S = positions[-1] + 1
            if args.list_nodes:
                for i, nd in enumerate(rec.nodes):
                    print(f"{step} {i:4d} {nd['name']:<22} {nd['op']:<10} {list(reversed(nd['ne']))}", file=sys.stderr)
            want = (keep if step in keep_steps else set()) | stages_at_sets.get(step, set()) | {"logits"}
            check_rope_bases(rec.nodes, step, attn)
            stages = canonical(rec.nodes, step, arch, n_layer, len(toks), S, permuted, dims, want, positions, attn)
            rec.nodes = []  # a real model's nodes are large; drop them now
            api = np.stack([np.ctypeslib.as_array(lc.llama_get_logits_ith(ctx, i), shape=(n_vocab,)).copy()
                            for i in range(len(toks))])
            api_vs_graph = max(api_vs_graph, float(np.abs(api - stages["logits"]).max()))
            greedy_ids.append(int(stages["logits"][-1].argmax()))
            log(f"{step}: greedy token {greedy_ids[-1]}")
            hf_ids = hf_prov["greedy_ids"]
            hf_pick = hf_ids[len(greedy_ids) - 1] if len(greedy_ids) <= len(hf_ids) else None
            if disagreement is None and hf_pick is not None and greedy_ids[-1] != hf_pick:
                # A near-tie that llama.cpp's arithmetic (8-bit activations,
                # f16 K/V) resolves the other way is normal on quantised
                # models; the references stay fed HF's tokens (teacher
                # forcing), so both goldens remain comparable. Recorded as
                # data: both picks and each side's margin between them.
                mine = stages["logits"][-1]
                hf_logits = hf.get(f"{step}/logits")
                disagreement = {
                    "step": step,
                    "index": len(greedy_ids) - 1,
                    "hf_id": hf_pick,
                    "llamacpp_id": greedy_ids[-1],
                    "llamacpp_margin": float(mine[greedy_ids[-1]]) - float(mine[hf_pick]),
                    "hf_margin": None if hf_logits is None else
                    float(hf_logits[-1][hf_pick]) - float(hf_logits[-1][greedy_ids[-1]]),
                }
                log(f"{step}: greedy token {greedy_ids[-1]}, HF's {hf_pick} (llama.cpp's margin "
                    f"{disagreement['llamacpp_margin']:.3g})")
            if pair_ties:
                lg = stages["logits"]
                assert np.array_equal(lg[:, 0::2].view(np.uint32), lg[:, 1::2].view(np.uint32)), \
                    f"{step}: the HF golden's logit pairs tie exactly, llama.cpp's do not"
                assert greedy_ids[-1] % 2 == 0, f"{step}: greedy id {greedy_ids[-1]} is odd despite the tied pairs"
            if not golden_io.stored(step, "logits", keep_steps, keep, stages_at_sets):
                del stages["logits"]
            elif logits_rows == "last":
                stages["logits"] = np.ascontiguousarray(stages["logits"][-1:])
            if rows is not None:
                stages = {k: v if k == "logits" and logits_rows == "last" else
                          golden_io.take_rows(k, v, rows, len(toks)) for k, v in stages.items()}
            step_tokens[step] = len(toks)
            stages["tokens"] = np.array(toks, dtype=np.int64)
            stages["positions"] = np.array(positions, dtype=np.int64)
            for k, v in stages.items():
                out[f"{step}/{k}"] = v
            pos_next = S
    finally:
        lc.llama_batch_free(batch)
        lc.llama_free(ctx)
        lc.llama_model_free(model)
    assert api_vs_graph == 0.0, f"llama_get_logits_ith differs from result_output by {api_vs_graph}"
    # Same keys and shapes as the HF golden when both stored the same subset.
    record = golden_io.record_section(keep_steps, steps, patterns, logits_rows, stages_at, rows, step_tokens)
    if record == hf_prov.get("record"):
        # sample_probs (record_hf.py --sample-probs) has no llama.cpp counterpart.
        hf_keys = sorted(k for k in hf if not k.endswith("/sample_probs"))
        assert sorted(out) == hf_keys, \
            f"stage set differs from the HF golden's: {sorted(set(out) ^ set(hf_keys))[:10]}"
        for k, v in out.items():
            assert v.shape == hf[k].shape, f"{k}: {v.shape} vs the HF golden's {hf[k].shape}"

    gguf_sha = sha256_file(args.gguf)
    versions, build = versions_and_build(binfo)
    prov = {
        "source": "llama.cpp",
        "recorder": RECORDER,
        "versions": versions,
        "build": build,
        "settings": {
            "kv_cache_type": args.kv_type,
            "flash_attn": "disabled",
            "n_threads": args.threads,
            "n_ctx": cparams.n_ctx,
            "n_gpu_layers": 0,
            "logits": "all tokens",
            "tokens": "teacher-forced from the HF golden",
        },
        "gguf_sha256": gguf_sha,
        "gguf_architecture": arch,
        "qk_unpermuted": permuted,
        "hf_golden_sha256": sha256_file(args.hf_golden),
        "prompt": ({"given": "tokens", "token_ids": prompt_ids} if given_tokens else
                   {"text": hf_prov["prompt"]["text"], "token_ids": prompt_ids, "llamacpp_token_ids": lcpp_ids}),
        "greedy_ids": greedy_ids,
        "decode_steps": len(steps) - 1,
        "steps": steps,
        "model_config": hf_cfg,
    }
    if sliding:
        # Sliding-window models only (other goldens keep their provenance).
        prov["settings"]["swa_full"] = True
    if chat:
        prov["prompt"].update(chat=True, rendered=hf_prov["prompt"]["rendered"])
    if disagreement is not None:
        prov["greedy_disagreement"] = dict(disagreement, hf_greedy_ids=hf_prov["greedy_ids"])
    # When the HF golden was recorded from this very GGUF, the GGUF is the
    # model under test (not a conversion made for the recording, whose file
    # name means nothing): name it. Converted tiny models keep the provenance
    # they always had, so their goldens stay byte-identical.
    if hf_prov.get("gguf_sha256") == gguf_sha:
        prov["model"] = {"format": "gguf", "file": os.path.basename(args.gguf), "sha256": gguf_sha,
                         "general_name": general_name, "architecture": arch,
                         "file_type": None if file_type is None else int(file_type)}
    if record is not None:
        prov["record"] = record
    metadata = {"format": FORMAT, "provenance": json.dumps(prov, sort_keys=True, separators=(",", ":"))}
    os.makedirs(os.path.dirname(os.path.abspath(args.out_file)), exist_ok=True)
    tmp = args.out_file + ".tmp"
    save_deterministic(out, metadata, tmp)
    if os.path.exists(args.out_file):
        # Replacing is what the caller asked for (regen.sh starts from empty
        # folders, goldens regen from a fresh one), but never silently.
        log(f"replacing the existing {args.out_file}")
    os.replace(tmp, args.out_file)
    log(f"wrote {args.out_file}: {len(out)} tensors, {os.path.getsize(args.out_file)} bytes")
    print(json.dumps({
        "out": args.out_file,
        "tensors": len(out),
        "bytes": os.path.getsize(args.out_file),
        "sha256": sha256_file(args.out_file),
        "architecture": arch,
        "qk_unpermuted": permuted,
        "prompt_ids": prompt_ids,
        "greedy_ids": greedy_ids,
        "hf_greedy_ids": hf_prov["greedy_ids"],
    }))
    if disagreement is not None:
        d = disagreement
        print(f"record_llamacpp.py: warning: greedy ids differ from the HF golden's at {d['step']}: llama.cpp "
              f"{d['llamacpp_id']}, HF {d['hf_id']} (llama.cpp's margin {d['llamacpp_margin']:.3g}, HF's "
              f"{'not recorded' if d['hf_margin'] is None else format(d['hf_margin'], '.3g')}); both goldens "
              f"are written, the provenance's greedy_disagreement says so", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
