"""Loading a model for the HF recorders (record_hf.py, record_next_token.py)
in float32 within about its own size: a GGUF dequantised a block of rows at
a time (lean_gguf_loading), the weights copied into aligned allocations with
the file's pages let go as they are copied (fresh_weights). Neither changes
a value: the goldens recorded with them are byte-identical to those before
(docs/recorders.md, "The oracle's memory")."""
import contextlib
import ctypes
import os
import weakref

import numpy as np
import torch


@contextlib.contextmanager
def lean_gguf_loading():
    """While transformers' GGUF loader runs: dequantise a large tensor a
    block of rows at a time into one float32 array, and let the loader keep
    that array instead of copying it. gguf-py's dequantize holds the whole
    output twice (the list of its per-group results, then their
    concatenation) and the loader copies it once more (`np.copy`, in
    load_gguf_checkpoint): 3x the largest tensor at once, which took the
    real Gemma 3 270M's load (a 262144 x 640 embedding, 63% of the model) to
    2.8x its float32 size. Dequantisation is elementwise per quant block, so
    the values are the same whatever the grouping (checked bit for bit on
    every tensor of both real GGUFs; the goldens are byte-identical), and
    the copy skipped is of an array nothing else holds. Any other array
    (a view of the file, a processor's permuted result) is copied as before.
    The loader imports `gguf.dequantize` when it runs and reads the module
    global `np`: both are put back on exit."""
    import gguf  # the pinned package transformers' GGUF loader reads with
    import transformers.modeling_gguf_pytorch_utils as loader
    whole, real_np = gguf.dequantize, loader.np
    block = 16 << 20  # bytes of output rows per block
    # id -> weak reference of each array made here: an array a processor
    # replaced (a permuted copy) must be freed, not kept to the end.
    fresh = {}

    def dequantize(data, qtype):
        if qtype == gguf.GGMLQuantizationType.F32 or data.ndim < 2 or data.shape[0] < 2:
            return whole(data, qtype)  # F32 is a view of the file: the loader must copy it
        first = whole(data[:1], qtype)
        rows = max(1, block // max(1, first.nbytes))
        if rows >= data.shape[0]:
            return whole(data, qtype)
        out = np.empty((data.shape[0],) + first.shape[1:], dtype=first.dtype)
        for a in range(0, data.shape[0], rows):
            out[a:a + rows] = whole(data[a:a + rows], qtype)
        fresh[id(out)] = weakref.ref(out)
        return out

    class LeanNumpy:
        """numpy, but copy() of an array dequantize() just made is the array."""

        def __getattr__(self, name):
            return getattr(real_np, name)

        @staticmethod
        def copy(a, *args, **kwargs):
            ref = fresh.pop(id(a), None)
            if not args and not kwargs and ref is not None and ref() is a and a.flags.c_contiguous:
                return a
            return real_np.copy(a, *args, **kwargs)

    gguf.dequantize, loader.np = dequantize, LeanNumpy()
    try:
        yield
    finally:
        gguf.dequantize, loader.np = whole, real_np
        fresh.clear()


def fresh_weights(model):
    """Copy every parameter into a fresh (64-byte aligned) allocation.

    Weights loaded from safetensors are views into the mmapped file, at
    addresses that depend on the file's header length and shard layout (mod
    64: 56 for qwen2-tiny, 32 for a single-file Qwen2.5, 8 for its shards);
    a GGUF's dequantised weights are fresh allocations. Torch's CPU
    matrix-vector kernels (decode steps, T = 1) round differently for
    differently aligned operands: the same weights as one file and as four
    shards gave decode goldens up to 2.2e-5 apart. So the golden depends on
    the weights only, not on how the file lays them out.

    The file's pages a copied view read stay in this process's RSS as long
    as the file is mapped (until the last view goes): the copies beside them
    took an HF folder's load to 2x the model above the interpreter. So once
    a view is copied, the whole pages inside it are dropped from the mapping
    (madvise MADV_DONTNEED: a clean file-backed page is read again from the
    file if ever touched, so nothing can change). Only mappings of a
    `.safetensors` file are touched, never anonymous memory."""
    files = []  # (start, end) of the mappings of safetensors files
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 6 and parts[5].endswith(".safetensors"):
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                files.append((lo, hi))
    page = os.sysconf("SC_PAGE_SIZE")
    madvise = None
    if files:
        libc = ctypes.CDLL(None, use_errno=True)
        madvise = libc.madvise
        madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    with torch.no_grad():
        for prm in model.parameters():
            old = prm.data
            prm.data = old.clone()
            lo, hi = old.data_ptr(), old.data_ptr() + old.numel() * old.element_size()
            del old
            first, last = -(-lo // page) * page, hi // page * page  # whole pages inside the view
            if madvise is not None and last > first and any(a <= lo and hi <= b for a, b in files):
                madvise(first, last - first, 4)  # MADV_DONTNEED; a failure only costs memory
        for buf in model.buffers():
            if buf.data_ptr() % 64:
                buf.data = buf.data.clone()
    assert all(prm.data_ptr() % 64 == 0 for prm in model.parameters())
