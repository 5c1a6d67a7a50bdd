"""Shared by the golden recorders: the golden file format and its
deterministic writer (record_hf.py and record_llamacpp.py write the same
format, so an engine test reads either source the same way)."""
import json
import struct

import numpy as np
import safetensors
from safetensors.numpy import load_file, save

FORMAT = "touchstone-golden/1"


def save_deterministic(tensors, metadata, path):
    """Write a safetensors file whose bytes depend only on the inputs.

    The safetensors library keeps `__metadata__` in a Rust HashMap, whose
    iteration order is randomised per process: with two metadata keys the
    header came out in either order on different runs (seen with 0.8.0).
    Keep the library's tensor layout (dtype, then name: aligned, and
    deterministic) but re-serialise the header with `__metadata__` first
    and its keys sorted. Offsets are relative to the data section, so
    rewriting the header leaves them valid.
    """
    blob = save(dict(sorted(tensors.items())), metadata=metadata)
    n = struct.unpack("<Q", blob[:8])[0]
    header = json.loads(blob[8:8 + n])  # dicts keep the file's order
    meta = header.pop("__metadata__")
    assert meta == metadata
    header = {"__metadata__": dict(sorted(meta.items())), **header}
    hb = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    hb += b" " * (-len(hb) % 8)  # the format pads the header with spaces to 8 bytes
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(hb)) + hb + blob[8 + n:])
    # Read it back through the library: same tensors, same metadata.
    back = load_file(path)
    assert sorted(back) == sorted(tensors)
    assert all(np.array_equal(back[k], tensors[k]) and back[k].dtype == tensors[k].dtype for k in tensors)
    with safetensors.safe_open(path, "np") as f:
        assert f.metadata() == metadata
