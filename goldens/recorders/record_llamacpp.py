#!/usr/bin/env python3
"""Record golden tensors for every canonical stage with llama.cpp.

usage: record_llamacpp.py GGUF OUT_FILE --hf-golden HF_GOLDEN [--threads N]

Runs libllama (built by build_llamacpp.py from the pinned llama-cpp-python
sdist) through that sdist's low-level ctypes bindings (llama_cpp/llama_cpp.py,
loaded without the high-level package, never pip-installed) on EXACTLY the
token ids of the HF golden: `prefill/tokens` as one batch, then
`decode1/tokens`, `decode2/tokens`, ... one by one, at the HF golden's
positions (teacher forcing: both sources see identical inputs, whatever
llama.cpp would have predicted). Settings without which llama.cpp differs
from HF by ~3e-3: F32 K and V cache (the default F16 rounds them), flash
attention DISABLED (and only then is there a softmax node to record), logits
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

`__metadata__`: `format` = touchstone-golden/1 and `provenance` (compact
sorted JSON). Nothing in the output varies between runs (no time, host or
path): a rerun is byte-for-byte identical.
"""
import argparse
import ctypes
import hashlib
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
from golden_io import FORMAT, save_deterministic  # noqa: E402

RECORDER = "goldens/recorders/record_llamacpp.py"

# ---- the node-name map (llama.cpp as vendored by llama-cpp-python 0.3.36) --
# canonical stage -> (node name, op, selector). `{L}` is the layer. A name
# occurs several times in one graph (Qcur-L: MUL_MAT, [ADD bias,] RESHAPE,
# ROPE); the op picks the one meant. Selectors:
#   "last"       the last node with this name and op (a name/op pair is
#                unique except where noted)
#   "after"      the first node with this op after the node `name`: o_proj's
#                output is unnamed in the Qwen2 graph (the MUL_MAT right after
#                kqv_out-L); Llama names that same node attn_out-L.
# Layout transforms (by stage): numpy shape is ggml `ne` reversed, reshaped to
# the HF golden's shape; attn_probs is sliced from the padded KV length to the
# real S (the sliced-off columns must be exactly 0); q/k/q_rope/k_rope are
# un-permuted for architectures in QK_PERMUTED.
NODE_MAP = [
    ("embed", "embd", "GET_ROWS", "last"),
    ("blk.{L}.attn_norm", "attn_norm-{L}", "MUL", "last"),
    ("blk.{L}.q", "Qcur-{L}", "RESHAPE", "last"),    # [T,H,D], after the bias add if any
    ("blk.{L}.k", "Kcur-{L}", "RESHAPE", "last"),
    ("blk.{L}.v", "Vcur-{L}", "RESHAPE", "last"),
    ("blk.{L}.q_rope", "Qcur-{L}", "ROPE", "last"),
    ("blk.{L}.k_rope", "Kcur-{L}", "ROPE", "last"),
    ("blk.{L}.attn_probs", "kq_soft_max-{L}", "SOFT_MAX", "last"),  # [H,T,n_kv padded]
    ("blk.{L}.attn_ctx", "kqv_out-{L}", "CONT", "last"),            # [T,H*D]
    ("blk.{L}.attn_out", "kqv_out-{L}", "MUL_MAT", "after"),
    ("blk.{L}.ffn_inp", "ffn_inp-{L}", "ADD", "last"),
    ("blk.{L}.ffn_norm", "ffn_norm-{L}", "MUL", "last"),
    ("blk.{L}.ffn_gate", "ffn_gate-{L}", "MUL_MAT", "last"),
    ("blk.{L}.ffn_up", "ffn_up-{L}", "MUL_MAT", "last"),
    ("blk.{L}.ffn_act", "ffn_swiglu-{L}", "SWIGLU", "last"),       # silu(gate)*up, one op
    ("blk.{L}.ffn_out", "ffn_out-{L}", "MUL_MAT", "last"),
    ("blk.{L}.out", "l_out-{L}", "ADD", "last"),
    ("output_norm", "result_norm", "MUL", "last"),
    ("logits", "result_output", "MUL_MAT", "last"),
]
# The names the o_proj output may carry ("after" selector): ggml calls an
# unnamed node "node_<index>" (Qwen2), Llama's graph names it attn_out-L.
ATTN_OUT_NAMES = (r"node_\d+", r"attn_out-{L}")
# general.architecture values whose converter permutes Q/K weight rows
# (LlamaModel.permute in vendor/llama.cpp/conversion/llama.py) and whose
# graph uses the interleaved-pair ("NORM") RoPE on them.
QK_PERMUTED = {"llama"}
ROPE_TYPE = {"llama": 0, "qwen2": 2}  # LLAMA_ROPE_TYPE_NORM, _NEOX
VIEW_OPS = {"VIEW", "PERMUTE", "TRANSPOSE", "SET_ROWS", "CPY"}
GGML_TYPE_F32 = 0


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


def sha256(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


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
        self.nodes.append({"name": name, "op": op, "ne": ne, "data": data})
        return True


def pick(nodes, name, op, sel, layer):
    if sel == "last":
        hits = [n for n in nodes if n["name"] == name and n["op"] == op]
        assert hits, f"no node {name} with op {op}"
        return hits[-1]
    assert sel == "after"
    idx = max(i for i, n in enumerate(nodes) if n["name"] == name)
    for n in nodes[idx + 1:]:
        if n["op"] == op:
            allowed = [a.format(L=layer) for a in ATTN_OUT_NAMES]
            assert any(re.fullmatch(a, n["name"]) for a in allowed), f"node after {name} is {n['name']!r}, expected one of {allowed}"
            return n
    raise AssertionError(f"no {op} after {name}")


def unpermute_qk(x):
    """Undo LlamaModel.permute on the head dim: llama.cpp's feature 2i+h of
    each head is HF's feature h*D/2+i. [T,H,D] -> [T,H,D]."""
    T, H, D = x.shape
    return np.ascontiguousarray(x.reshape(T, H, D // 2, 2).swapaxes(-1, -2).reshape(T, H, D))


def canonical(step_nodes, hf, step, n_layer, S, permuted):
    out = {}
    for stage, name, op, sel in NODE_MAP:
        for L in (range(n_layer) if "{L}" in stage else [None]):
            st = stage.format(L=L)
            node = pick(step_nodes, name.format(L=L), op, sel, L)
            a = node["data"]
            assert a is not None, f"{step}/{st}: node {node['name']} {op} has no F32 data"
            want = hf[f"{step}/{st}"].shape
            if st.endswith("attn_probs"):
                a = a.reshape(a.shape[-3:])
                assert a.shape[:2] == want[:2] and a.shape[2] >= S, f"{step}/{st}: {a.shape} vs {want}"
                tail = a[..., S:]
                assert tail.size == 0 or not tail.any(), f"{step}/{st}: masked KV cells are not exactly 0"
                a = a[..., :S]
            assert a.size == int(np.prod(want)), f"{step}/{st}: {a.shape} cannot be {want}"
            a = np.ascontiguousarray(a.reshape(want), dtype=np.float32)
            if permuted and st.split(".")[-1] in ("q", "k", "q_rope", "k_rope"):
                a = unpermute_qk(a)
            assert np.isfinite(a).all(), f"{step}/{st} is not finite"
            out[st] = a
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("gguf")
    ap.add_argument("out_file")
    ap.add_argument("--hf-golden", required=True, help="take the token ids (and steps) from this HF golden")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--list-nodes", action="store_true",
                    help="print every graph node (step, index, name, op, numpy shape) to stderr")
    ap.add_argument("--cache-dir", default=build_llamacpp.DEFAULT_CACHE,
                    help="build_llamacpp.py's cache (sdist, source, build)")
    args = ap.parse_args()

    lib_dir, binfo = build_llamacpp.ensure_built(os.path.abspath(args.cache_dir))
    src = build_llamacpp.source_dir(os.path.abspath(args.cache_dir))
    lc, g = load_bindings(src, lib_dir)

    # ---- the HF golden: steps, tokens, positions ----------------------------
    hf = {}
    with safe_open(args.hf_golden, "np") as f:
        hf_meta = f.metadata()
        for k in f.keys():
            hf[k] = f.get_tensor(k)
    assert hf_meta["format"] == FORMAT, hf_meta.get("format")
    hf_prov = json.loads(hf_meta["provenance"])
    steps = hf_prov["steps"]
    prompt_ids = [int(x) for x in hf["prefill/tokens"]]
    assert prompt_ids == hf_prov["prompt"]["token_ids"]
    hf_cfg = hf_prov["model_config"]
    n_layer = hf_cfg["num_hidden_layers"]

    # ---- model and context ----------------------------------------------------
    quiet = lc.llama_log_callback(lambda level, text, ud: None)
    lc.llama_log_set(quiet, None)
    lc.llama_backend_init()
    mparams = lc.llama_model_default_params()
    mparams.n_gpu_layers = 0
    mparams.use_mmap = False
    model = lc.llama_model_load_from_file(args.gguf.encode(), mparams)
    assert model, "model load failed"
    vocab = lc.llama_model_get_vocab(model)
    n_vocab = lc.llama_vocab_n_tokens(vocab)
    buf = ctypes.create_string_buffer(128)
    n = lc.llama_model_meta_val_str(model, b"general.architecture", buf, len(buf))
    assert n > 0
    arch = buf.value.decode()
    rope_type = lc.llama_model_rope_type(model)
    assert arch in ROPE_TYPE and rope_type == ROPE_TYPE[arch], f"arch {arch}, rope type {rope_type}"
    permuted = arch in QK_PERMUTED
    assert hf_cfg["model_type"] == arch, (hf_cfg["model_type"], arch)

    # llama.cpp's own tokenization of the prompt text: recorded, and must
    # agree with HF's (the tokens fed are HF's either way).
    text = hf_prov["prompt"]["text"].encode()
    tbuf = (lc.llama_token * 1024)()
    nt = lc.llama_tokenize(vocab, text, len(text), tbuf, 1024, False, False)
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
    cparams.type_k = GGML_TYPE_F32
    cparams.type_v = GGML_TYPE_F32
    cparams.cb_eval = cb
    cparams.cb_eval_user_data = None
    assert n_total <= cparams.n_ctx
    ctx = lc.llama_init_from_model(model, cparams)
    assert ctx, "context init failed"

    out, greedy_ids, api_vs_graph = {}, [], 0.0
    batch = lc.llama_batch_init(cparams.n_batch, 0, 1)
    pos_next = 0
    try:
        for step in steps:
            toks = [int(x) for x in hf[f"{step}/tokens"]]
            positions = [int(x) for x in hf[f"{step}/positions"]]
            assert positions == list(range(pos_next, pos_next + len(toks))), f"{step}: positions {positions}"
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
            stages = canonical(rec.nodes, hf, step, n_layer, S, permuted)
            api = np.stack([np.ctypeslib.as_array(lc.llama_get_logits_ith(ctx, i), shape=(n_vocab,)).copy()
                            for i in range(len(toks))])
            api_vs_graph = max(api_vs_graph, float(np.abs(api - stages["logits"]).max()))
            stages["tokens"] = np.array(toks, dtype=np.int64)
            stages["positions"] = np.array(positions, dtype=np.int64)
            assert sorted(f"{step}/{k}" for k in stages) == sorted(k for k in hf if k.startswith(step + "/")), \
                "stage set differs from the HF golden's"
            for k, v in stages.items():
                out[f"{step}/{k}"] = v
            greedy_ids.append(int(stages["logits"][-1].argmax()))
            pos_next = S
    finally:
        lc.llama_batch_free(batch)
        lc.llama_free(ctx)
        lc.llama_model_free(model)
    assert api_vs_graph == 0.0, f"llama_get_logits_ith differs from result_output by {api_vs_graph}"

    prov = {
        "source": "llama.cpp",
        "recorder": RECORDER,
        "versions": {
            "python": platform.python_version(),
            "numpy": np.__version__,
            "safetensors": safetensors.__version__,
            "llama_cpp_python": binfo["llama_cpp_python"],
            "llama_cpp_commit": binfo["llama_cpp_commit"],
            "ggml": binfo["ggml_version"],
            "cmake": binfo["cmake"],
            "compiler": binfo["compiler"],
        },
        "build": {"cmake_flags": binfo["flags"], "target": binfo["target"]},
        "settings": {
            "kv_cache_type": "f32",
            "flash_attn": "disabled",
            "n_threads": args.threads,
            "n_ctx": cparams.n_ctx,
            "n_gpu_layers": 0,
            "logits": "all tokens",
            "tokens": "teacher-forced from the HF golden",
        },
        "gguf_sha256": sha256(args.gguf),
        "gguf_architecture": arch,
        "qk_unpermuted": permuted,
        "hf_golden_sha256": sha256(args.hf_golden),
        "prompt": {"text": hf_prov["prompt"]["text"], "token_ids": prompt_ids,
                   "llamacpp_token_ids": lcpp_ids},
        "greedy_ids": greedy_ids,
        "decode_steps": len(steps) - 1,
        "steps": steps,
        "model_config": hf_cfg,
    }
    metadata = {"format": FORMAT, "provenance": json.dumps(prov, sort_keys=True, separators=(",", ":"))}
    os.makedirs(os.path.dirname(os.path.abspath(args.out_file)), exist_ok=True)
    tmp = args.out_file + ".tmp"
    save_deterministic(out, metadata, tmp)
    os.replace(tmp, args.out_file)
    print(json.dumps({
        "out": args.out_file,
        "tensors": len(out),
        "bytes": os.path.getsize(args.out_file),
        "sha256": sha256(args.out_file),
        "architecture": arch,
        "qk_unpermuted": permuted,
        "prompt_ids": prompt_ids,
        "greedy_ids": greedy_ids,
        "hf_greedy_ids": hf_prov["greedy_ids"],
    }))
    if greedy_ids != hf_prov["greedy_ids"]:
        print("record_llamacpp.py: warning: greedy ids differ from the HF golden's", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
