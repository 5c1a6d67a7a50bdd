"""safetensors, read and written by hand (numpy and the standard library
only): an 8-byte little-endian header length, a JSON header, then the raw
tensor bytes. numpy_engine.py reads a model's weights and writes its run
files with these, so neither `safetensors` nor `torch` is ever imported.
"""
import json
import mmap
import os
import struct

import numpy as np

from protocol_v1 import EngineError

_ST_DTYPES = {
    "F64": np.dtype("<f8"), "F32": np.dtype("<f4"), "F16": np.dtype("<f2"),
    "I64": np.dtype("<i8"), "I32": np.dtype("<i4"), "I16": np.dtype("<i2"), "I8": np.dtype("i1"),
    "U64": np.dtype("<u8"), "U32": np.dtype("<u4"), "U16": np.dtype("<u2"), "U8": np.dtype("u1"),
    "BOOL": np.dtype("?"),
}
_NP_TO_ST = {np.dtype("<f4"): "F32", np.dtype("<f8"): "F64", np.dtype("<f2"): "F16",
             np.dtype("<i8"): "I64", np.dtype("<i4"): "I32", np.dtype("u1"): "U8"}


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
