"""libllama as every llama.cpp recorder (and engine_llamacpp.py) opens it.

The libraries are build_llamacpp.py's build of the pinned llama-cpp-python
sdist, reached through that sdist's own low-level ctypes bindings
(llama_cpp/llama_cpp.py, loaded without the package's __init__, never
pip-installed): load_bindings(). NodeRecorder is the eval callback that
copies graph nodes out as ggml computes them (GgmlTensor mirrors struct
ggml_tensor of the pinned ggml, checked on every node). open_model() and
context_params() are the settings the recorders share: the CPU, no mmap,
flash attention disabled, one batch as large as the context, the K/V cache
type asked for. versions_and_build() is the provenance entry every
llama.cpp golden carries.
"""
import ctypes
import importlib
import os
import platform
import sys
import types

import numpy as np
import safetensors

VIEW_OPS = {"VIEW", "PERMUTE", "TRANSPOSE", "SET_ROWS", "CPY"}
GGML_TYPE_F32 = 0
GGML_TYPE_F16 = 1
GGML_TYPE_I32 = 26
KV_TYPES = {"f32": GGML_TYPE_F32, "f16": GGML_TYPE_F16}


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
    views), a copy of the data (and of the I32 ARGSORT of a MoE router);
    for a ROPE, its frequency factors' tensor (name and values;
    `freq_factors`, None without).

    `keep` (None: every node) makes the capture lean: an object whose
    wants(name, op), asked for every node in graph order, says whether its
    data is needed (llamacpp_graph.LeanNodes). Any other F32 node is read,
    checked for finiteness and dropped (data None), or kept whole when it is
    not finite (the overflow watch describes it), so a long prompt never
    holds every layer's [H,T,n_kv] at once."""

    def __init__(self, g, keep=None):
        self.g = g
        self.nodes = []
        self.keep = keep

    def read(self, t):
        """A copy of an F32 tensor's data (numpy shape = ggml `ne` reversed,
        its strides followed), or None for another type."""
        tt = ctypes.cast(t, ctypes.POINTER(GgmlTensor)).contents
        if tt.type != GGML_TYPE_F32:
            return None
        ne = [int(x) for x in tt.ne]
        nb = [int(x) for x in tt.nb]
        n = self.g.ggml_nbytes(t)
        buf = (ctypes.c_uint8 * n)()
        self.g.ggml_backend_tensor_get(t, buf, 0, n)
        flat = np.frombuffer(buf, dtype=np.uint8)
        shape, strides = tuple(reversed(ne)), tuple(reversed(nb))
        if strides == np.empty(shape, dtype=np.float32).strides and n == 4 * int(np.prod(shape)):
            return flat.view(np.float32).reshape(shape)  # contiguous: the buffer itself, no second copy
        return np.lib.stride_tricks.as_strided(flat.view(np.float32), shape=shape, strides=strides).copy()

    def read_i32(self, t):
        """A contiguous I32 tensor's data (numpy shape = ggml `ne` reversed):
        a MoE router's ARGSORT, the experts in descending score."""
        tt = ctypes.cast(t, ctypes.POINTER(GgmlTensor)).contents
        shape, n = tuple(reversed([int(x) for x in tt.ne])), self.g.ggml_nbytes(t)
        assert n == 4 * int(np.prod(shape)), "a non-contiguous I32 node"
        buf = (ctypes.c_uint8 * n)()
        self.g.ggml_backend_tensor_get(t, buf, 0, n)
        return np.frombuffer(buf, dtype=np.int32).reshape(shape).copy()

    def callback(self, t, ask, user_data):
        if ask:
            return True  # observe every node (unnamed ones too: o_proj in Qwen2)
        tt = ctypes.cast(t, ctypes.POINTER(GgmlTensor)).contents
        name = tt.name.decode("utf-8")
        assert self.g.ggml_get_name(t).decode("utf-8") == name, "struct ggml_tensor layout mismatch"
        op = self.g.ggml_op_desc(t).decode()
        ne = [int(x) for x in tt.ne]
        wanted = self.keep is None or self.keep.wants(name, op)  # asked of every node, in order
        data = self.read(t) if tt.type == GGML_TYPE_F32 and op not in VIEW_OPS else \
            self.read_i32(t) if tt.type == GGML_TYPE_I32 and op == "ARGSORT" else None
        if not wanted and data is not None and np.isfinite(data).all():
            data = None  # lean: not needed, and finite
        node = {"name": name, "op": op, "ne": ne, "data": data, "op_params": bytes(bytearray(tt.op_params))}
        if op == "ROPE":
            # A ROPE's frequency factors (src[2]: rope_freqs, Phi-3's
            # rope_factors_long/short), or None: what the scaling was given.
            f = tt.src[2]
            node["freq_factors"] = None if not f else (self.g.ggml_get_name(f).decode("utf-8"), self.read(f))
        self.nodes.append(node)
        return True


_KEEP = []  # ctypes callbacks handed to libllama: never garbage-collected


def silence(lc):
    """Silences libllama's log for the rest of the process (the callback is
    kept referenced here: libllama calls it for as long as the process
    lives). Returns it, for mtmd's log setters."""
    quiet = lc.llama_log_callback(lambda level, text, ud: None)
    _KEEP.append(quiet)
    lc.llama_log_set(quiet, None)
    return quiet


def open_model(lc, path):
    """The GGUF at `path` on the CPU, read into memory (no mmap), or None
    when libllama cannot load it."""
    lc.llama_backend_init()
    mparams = lc.llama_model_default_params()
    mparams.n_gpu_layers = 0
    mparams.use_mmap = False
    return lc.llama_model_load_from_file(path.encode(), mparams)


def meta_str(lc, model, key, size=256):
    """A GGUF metadata value as text, or None."""
    buf = ctypes.create_string_buffer(size)
    n = lc.llama_model_meta_val_str(model, key.encode(), buf, len(buf))
    return buf.value.decode() if n >= 0 else None


def context_params(lc, n_ctx, threads, kv_type="f32", cb=None, swa_full=None):
    """The recorders' context: one batch (and ubatch) of the whole context,
    one sequence, flash attention disabled (only then is there a softmax
    node to record), the K/V cache of `kv_type`, the eval callback `cb` (a
    ggml_backend_sched_eval_callback, or None); `swa_full` pinned when given
    (a full-size SWA cache: cell p is position p in every layer)."""
    cparams = lc.llama_context_default_params()
    cparams.n_ctx = n_ctx
    cparams.n_batch = n_ctx
    cparams.n_ubatch = n_ctx
    cparams.n_seq_max = 1
    cparams.n_threads = threads
    cparams.n_threads_batch = threads
    cparams.flash_attn_type = lc.LLAMA_FLASH_ATTN_TYPE_DISABLED
    if swa_full is not None:
        cparams.swa_full = swa_full
    cparams.type_k = KV_TYPES[kv_type]
    cparams.type_v = KV_TYPES[kv_type]
    if cb is not None:
        cparams.cb_eval = cb
        cparams.cb_eval_user_data = None
    return cparams


def fill_batch(batch, toks, positions):
    """A token batch with logits for every row (else the last layer is
    pruned to the output rows)."""
    batch.n_tokens = len(toks)
    for i, (tok, p) in enumerate(zip(toks, positions)):
        batch.token[i] = tok
        batch.pos[i] = p
        batch.n_seq_id[i] = 1
        batch.seq_id[i][0] = 0
        batch.logits[i] = 1


def logits_vs_graph(lc, ctx, graph):
    """The largest |llama_get_logits_ith(i) - graph[i]| over the rows of
    `graph` [n, n_vocab] (row by row: a long prompt's logits are GB)."""
    n, n_vocab = graph.shape
    return max(float(np.abs(np.ctypeslib.as_array(lc.llama_get_logits_ith(ctx, i), shape=(n_vocab,)) - graph[i]).max())
               for i in range(n))


def all_logits(lc, ctx, n, n_vocab):
    """llama_get_logits_ith of rows 0..n-1, [n, n_vocab] float32."""
    return np.stack([np.ctypeslib.as_array(lc.llama_get_logits_ith(ctx, i), shape=(n_vocab,)).copy()
                     for i in range(n)])


def versions_and_build(binfo, **more):
    """The `versions` and `build` entries of a llama.cpp golden's provenance:
    the Python side's packages and what build_llamacpp.py built libllama
    from (`binfo`), plus `more` versions. record_llamacpp.py,
    record_llamacpp_vlm.py and record_next_token.py write the same entries."""
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
