#!/usr/bin/env python3
"""Fixtures that prove touchstone's GGUF dequantisation bit-exact against
llama.cpp's own reference dequantisation: gguf-py's `gguf/quants.py` (numpy).

usage: make_quant_fixtures.py [--gguf-py DIR] [--out DIR] [--real-model GGUF]

For each type touchstone dequantises (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K,
Q4_K, Q5_K, Q6_K) it writes raw blocks and the f32 values gguf-py's
`quants.dequantize` gives for them:

  OUT/<TYPE>.blocks   the blocks, concatenated (GGML_QUANT_SIZES bytes each)
  OUT/<TYPE>.f32      the values, little-endian f32, block after block
  OUT/manifest.json   per type: block size, bytes per block, one label per
                      block (what edge case it is), sha256 of both files; the
                      gguf-py and numpy versions and the seed

`tests/quant_fixtures.rs` compares every value with `to_bits()`.

The blocks are random (numpy PCG64, fixed seed: the output is byte-for-byte
reproducible with the pinned numpy) plus edge cases: all-zero blocks; every
quant and sub-scale bit set; the f16 scales (d, and m / dmin where the type
has one) at +-65504 (max finite), +-2^-24 (smallest subnormal), the largest
subnormal, the smallest normal, +-0, +-inf and NaN; negative scales; every
quant value of the type (0..15, 0..31, -128..127, ...); for the K-quants every
code of the packed 4- / 6- / 8-bit sub-block scales and mins. The "every
value" claims are not taken on trust: each is checked here by dequantising a
probe block with unit scales through gguf-py itself (an assertion fails
otherwise).

With --real-model it also writes OUT/real_model_tensors.json: for a few tensors
of different types of that GGUF (read with gguf-py's GGUFReader), the sha256
of the f32 values gguf-py dequantises (little-endian, row-major), which
`tests/real_model.rs` compares with touchstone's load of the same file.

gguf-py must be the one vendored by the pinned llama-cpp-python sdist
(vendor/llama.cpp/gguf-py, gguf 0.19.0 in 0.3.36), never a pip `gguf`:
--gguf-py DIR names it, otherwise build_llamacpp.py fetches and extracts the
sdist (no build) and its gguf-py is used. Needs numpy (pinned in
requirements.txt) and PyYAML / tqdm (gguf-py imports them).
"""
import argparse
import hashlib
import json
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
SEED = 20261123

# Bytes of each field, per type (offsets within a block), as in ggml-common.h:
#   f16: the f16 scales; sub: packed sub-block scales (K-quants); quants: the rest.
LAYOUT = {
    "Q4_0": dict(f16=[0], quants=(2, 18)),
    "Q4_1": dict(f16=[0, 2], quants=(4, 20)),
    "Q5_0": dict(f16=[0], quants=(2, 22)),
    "Q5_1": dict(f16=[0, 2], quants=(4, 24)),
    "Q8_0": dict(f16=[0], quants=(2, 34)),
    "Q2_K": dict(f16=[80, 82], sub=(0, 16), quants=(16, 80)),
    "Q3_K": dict(f16=[108], sub=(96, 108), quants=(0, 96)),
    "Q4_K": dict(f16=[0, 2], sub=(4, 16), quants=(16, 144)),
    "Q5_K": dict(f16=[0, 2], sub=(4, 16), quants=(16, 176)),
    "Q6_K": dict(f16=[208], sub=(192, 208), quants=(0, 192)),
}
# The range of the integer quant q of each type, as the dequantised value
# shows it with unit scales (value = q, or q - offset folded in).
Q_RANGE = {
    "Q4_0": (-8, 7), "Q4_1": (0, 15), "Q5_0": (-16, 15), "Q5_1": (0, 31), "Q8_0": (-128, 127),
    "Q2_K": (0, 3), "Q3_K": (-4, 3), "Q4_K": (0, 15), "Q5_K": (0, 31), "Q6_K": (-32, 31),
}
# f16 bit patterns of the edge-case scales.
F16_EDGES = [
    ("+65504 (max finite)", 0x7BFF), ("-65504", 0xFBFF),
    ("+2^-24 (smallest subnormal)", 0x0001), ("-2^-24", 0x8001),
    ("largest subnormal", 0x03FF), ("2^-14 (smallest normal)", 0x0400),
    ("+0", 0x0000), ("-0", 0x8000), ("+inf", 0x7C00), ("-inf", 0xFC00), ("NaN", 0x7E00),
]
ONE, HALF, NEG = 0x3C00, 0x3800, 0xBE00  # 1.0, 0.5, -1.5
# The edges also tried on d and on m / dmin separately (the other one 0.5).
SPLIT_EDGES = {0x7BFF, 0xFBFF, 0x0001, 0x7C00, 0x7E00}


def f16_bits(x):
    return int(np.array([x], dtype=np.float16).view(np.uint16)[0])


class Builder:
    """Blocks of one type, each with a label."""

    def __init__(self, name, quants, rng):
        self.name, self.q, self.rng = name, quants, rng
        self.qtype = quants.GGMLQuantizationType[name]
        self.block_size, self.type_size = quants.GGML_QUANT_SIZES[self.qtype]
        self.lay = LAYOUT[name]
        self.blocks, self.labels = [], []

    def new(self, fill=None):
        """A block of random bytes (or `fill`), f16 scales random normal-sized."""
        b = self.rng.integers(0, 256, self.type_size, dtype=np.uint8) if fill is None \
            else np.full(self.type_size, fill, dtype=np.uint8)
        if fill is None:
            for at in self.lay["f16"]:
                self.set_f16(b, at, f16_bits(self.rng.normal(0, 0.02)))
        return b

    @staticmethod
    def set_f16(b, at, bits):
        b[at:at + 2] = np.array([bits], dtype="<u2").view(np.uint8)

    def set_scales(self, b, bits):
        for at, v in zip(self.lay["f16"], bits):
            self.set_f16(b, at, v)

    def add(self, b, label):
        assert b.dtype == np.uint8 and b.shape == (self.type_size,)
        self.blocks.append(b.copy())
        self.labels.append(label)

    def deq(self, blocks):
        return self.q.dequantize(np.stack(blocks), self.qtype).reshape(len(blocks), self.block_size)

    def random_finite_f16(self):
        while True:
            bits = int(self.rng.integers(0, 1 << 16))
            if (bits >> 10) & 0x1F != 0x1F:
                return bits


def unit_sub(name, b):
    """Sub-block scales of a K-quant set so that value = d * q (scale 1, min 0)."""
    lo, hi = LAYOUT[name]["sub"]
    if name == "Q2_K":
        b[lo:hi] = 0x01
    elif name == "Q3_K":  # 6-bit code 33 = scale 1: low nibbles 1, high bits 2
        b[lo:lo + 8] = 0x11
        b[lo + 8:hi] = 0xAA
    elif name in ("Q4_K", "Q5_K"):
        b[lo:hi] = pack_k4([1] * 8, [0] * 8)
    elif name == "Q6_K":
        b[lo:hi] = 1


def pack_k4(sc, m):
    """The 12 bytes of 8 (scale, min) 6-bit pairs, inverse of get_scale_min_k4."""
    out = np.zeros(12, dtype=np.uint8)
    for j in range(4):
        out[j] = (sc[j] & 63) | ((sc[j + 4] >> 4) << 6)
        out[j + 4] = (m[j] & 63) | ((m[j + 4] >> 4) << 6)
        out[j + 8] = (sc[j + 4] & 0xF) | ((m[j + 4] & 0xF) << 4)
    return out


def pack_q3_scales(codes):
    """The 12 bytes of 16 6-bit Q3_K scale codes (scale = code - 32)."""
    out = np.zeros(12, dtype=np.uint8)
    for g, c in enumerate(codes):
        out[g % 8] |= (c & 0xF) << (4 * (g // 8))
        out[8 + g % 4] |= ((c >> 4) & 3) << (2 * (g // 4))
    return out


def q6k_quants(q):
    """The 192 quant bytes (ql, qh) of Q6_K holding the 6-bit values q[e] (before the -32)."""
    ql, qh = np.zeros(128, dtype=np.uint8), np.zeros(64, dtype=np.uint8)
    for e, v in enumerate(q):
        h, k, l = e // 128, (e % 128) // 32, e % 32
        ql[64 * h + 32 * (k % 2) + l] |= (v & 0xF) << (4 * (k // 2))
        qh[32 * h + l] |= (v >> 4) << (2 * k)
    return np.concatenate([ql, qh])


def constant_one_quants(name, b):
    """Quants all equal to 1 (with offsets undone), for sub-scale probes."""
    lo, hi = LAYOUT[name]["quants"]
    if name == "Q2_K":
        b[lo:hi] = 0x55
    elif name == "Q3_K":  # hmask bit set = no -4 offset; 2-bit quants 1
        b[0:32] = 0xFF
        b[32:96] = 0x55
    elif name == "Q4_K":
        b[lo:hi] = 0x11
    elif name == "Q5_K":  # qh 0, nibbles 1
        b[16:48] = 0
        b[48:176] = 0x11
    elif name == "Q6_K":  # 33 = 0b10_0001: nibble 1, high bits 2
        b[0:128] = 0x11
        b[128:192] = 0xAA


def every_quant_value(bd):
    """Blocks whose quants take every value of the type, checked by a probe."""
    name, lay = bd.name, bd.lay
    lo, hi = lay["quants"]
    n = hi - lo
    if name == "Q8_0":
        patterns = [np.arange(32 * k, 32 * k + 32, dtype=np.uint8) for k in range(8)]
    else:
        ramp = (np.arange(n) * 37 + 11).astype(np.uint8)
        patterns = [np.arange(n, dtype=np.uint8), np.uint8(255) - np.arange(n, dtype=np.uint8), ramp]
    if name == "Q6_K":  # its 6-bit quants are split over ql and qh: place q = e % 64
        patterns.append(q6k_quants([e % 64 for e in range(256)]))
    seen = set()
    for k, pat in enumerate(patterns):
        b = bd.new(0)
        b[lo:hi] = pat
        # Probe: unit scales, zero min, so the value is the quant itself.
        probe = b.copy()
        bd.set_scales(probe, [ONE, 0])
        if "sub" in lay:
            unit_sub(name, probe)
        seen |= set(bd.deq([probe]).ravel().tolist())
        bd.add(probe, f"every quant value, pattern {k}, unit scales")
        real = probe.copy()
        bd.set_scales(real, [f16_bits(0.0123), f16_bits(-0.0456)])
        bd.add(real, f"every quant value, pattern {k}, d = 0.0123 (min -0.0456)")
    q_lo, q_hi = Q_RANGE[name]
    want = set(float(v) for v in range(q_lo, q_hi + 1))
    assert want <= seen, f"{name}: quant values {sorted(want - seen)} never appear"


def every_sub_code(bd):
    """K-quants: blocks covering every code of the packed sub-scales (and mins)."""
    name, lay = bd.name, bd.lay
    lo, hi = lay["sub"]
    subs = []
    if name == "Q2_K":  # 16 groups: scale nibble g, min nibble 15 - g
        subs.append(np.array([g | ((15 - g) << 4) for g in range(16)], dtype=np.uint8))
        scale_codes, min_codes = range(16), range(16)
    elif name == "Q3_K":  # 16 6-bit codes per block, 4 blocks
        for k in range(4):
            subs.append(pack_q3_scales([16 * k + g for g in range(16)]))
        scale_codes, min_codes = range(-32, 32), None
    elif name in ("Q4_K", "Q5_K"):  # 8 (scale, min) pairs per block, 8 blocks
        for k in range(8):
            sc = [8 * k + j for j in range(8)]
            subs.append(pack_k4(sc, [63 - c for c in sc]))
        scale_codes, min_codes = range(64), range(64)
    else:  # Q6_K: 16 int8 scales per block, 16 blocks
        for k in range(16):
            subs.append(np.arange(16 * k, 16 * k + 16, dtype=np.uint8))
        scale_codes, min_codes = range(-128, 128), None
    got_sc, got_m = set(), set()
    for k, s in enumerate(subs):
        b = bd.new()
        b[lo:hi] = s
        bd.add(b, f"sub-block scale codes, set {k}, random quants and scales")
        # Probes: quants 1; d = 1, dmin = 0 shows the scales; d = 0, dmin = 1 the mins.
        p = b.copy()
        constant_one_quants(name, p)
        bd.set_scales(p, [ONE, 0])
        got_sc |= set(bd.deq([p]).ravel().tolist())
        if min_codes is not None:
            bd.set_scales(p, [0, ONE])
            got_m |= set((-bd.deq([p]).ravel()).tolist())
    assert set(float(c) for c in scale_codes) <= got_sc, f"{name}: scale codes missing"
    if min_codes is not None:
        assert set(float(c) for c in min_codes) <= got_m, f"{name}: min codes missing"


def build(name, quants, rng, n_random):
    bd = Builder(name, quants, rng)
    lay = bd.lay
    two = len(lay["f16"]) == 2
    bd.add(bd.new(0), "all bytes zero")
    b = bd.new(0xFF)
    bd.set_scales(b, [ONE, ONE])
    bd.add(b, "every quant and sub-scale bit set, scales 1.0")
    b = bd.new(0xFF)
    bd.set_scales(b, [0x7BFF, 0x7BFF])
    bd.add(b, "every quant and sub-scale bit set, scales 65504")
    bd.add(bd.new(0xFF), "all bytes 0xFF (f16 scales NaN)")
    for label, bits in F16_EDGES:
        b = bd.new()
        bd.set_scales(b, [bits, bits])
        bd.add(b, f"random quants, {'d = m' if two else 'd'} = {label}")
        if two and bits in SPLIT_EDGES:
            b = bd.new()
            bd.set_scales(b, [bits, HALF])
            bd.add(b, f"random quants, d = {label}, min scale 0.5")
            b = bd.new()
            bd.set_scales(b, [HALF, bits])
            bd.add(b, f"random quants, d = 0.5, min scale = {label}")
    b = bd.new()
    bd.set_scales(b, [NEG, NEG])
    bd.add(b, "random quants, negative scales (-1.5)")
    every_quant_value(bd)
    if "sub" in lay:
        every_sub_code(bd)
    for k in range(n_random):
        b = bd.new()
        if k % 2:
            bd.set_scales(b, [bd.random_finite_f16(), bd.random_finite_f16()])
            bd.add(b, f"random block {k}, random finite f16 scales")
        else:
            bd.add(b, f"random block {k}, normal-sized scales")
    for k in range(2):
        bd.add(bd.rng.integers(0, 256, bd.type_size, dtype=np.uint8), f"random bytes {k} (scales any f16)")
    with np.errstate(all="ignore"):
        values = bd.deq(bd.blocks).astype("<f4")
    return bd, values


def sha256(b):
    return hashlib.sha256(b).hexdigest()


def real_model(gguf_mod, quants, path, names):
    r = gguf_mod.GGUFReader(path)
    by_name = {t.name: t for t in r.tensors}
    out = []
    for name in names:
        t = by_name[name]
        v = quants.dequantize(np.asarray(t.data), t.tensor_type)
        v = np.ascontiguousarray(v, dtype="<f4")
        # GGUFReader gives the row-major (numpy) shape: ne reversed.
        out.append({"name": name, "type": t.tensor_type.name, "shape": [int(x) for x in v.shape],
                    "values": int(v.size), "sha256_f32_le": sha256(v.tobytes()),
                    "first_bits": [int(x) for x in v.ravel()[:4].view("<u4")]})
        print(f"  {name}: {t.tensor_type.name} {list(v.shape)} sha256 {out[-1]['sha256_f32_le'][:16]}...")
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            h.update(chunk)
    return {"model_file": os.path.basename(path), "model_bytes": os.path.getsize(path),
            "model_sha256": h.hexdigest(), "tensors": out}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gguf-py", help="the sdist's vendor/llama.cpp/gguf-py (default: via build_llamacpp.py)")
    ap.add_argument("--out", default=os.path.join(ROOT, "tests", "fixtures", "quant"))
    ap.add_argument("--real-model", help="also record dequantised sha256 of tensors of this GGUF")
    ap.add_argument("--tensors", default="blk.0.attn_k.weight,blk.0.attn_v.weight,blk.0.ffn_down.weight,"
                    "FIRST_Q4_K,blk.0.attn_q.bias",
                    help="tensors for --real-model (FIRST_<TYPE>: the first tensor of that type)")
    args = ap.parse_args()
    gguf_py = args.gguf_py
    if gguf_py is None:
        sys.path.insert(0, HERE)
        import build_llamacpp
        gguf_py = os.path.join(build_llamacpp.source_dir(), "vendor", "llama.cpp", "gguf-py")
    gguf_py = os.path.abspath(gguf_py)
    sys.path.insert(0, gguf_py)
    import gguf
    from gguf import quants
    assert os.path.dirname(gguf.__file__).startswith(gguf_py), f"wrong gguf: {gguf.__file__}"
    with open(os.path.join(gguf_py, "pyproject.toml")) as f:
        version = next(line.split('"')[1] for line in f if line.startswith("version"))

    os.makedirs(args.out, exist_ok=True)
    rng = np.random.default_rng(SEED)
    manifest = {"generator": "goldens/recorders/make_quant_fixtures.py", "gguf_py": version,
                "numpy": np.__version__, "seed": SEED, "types": {}}
    for name in LAYOUT:
        n_random = 6 if name.endswith("_K") else 24
        bd, values = build(name, quants, rng, n_random)
        raw = np.stack(bd.blocks).tobytes()
        vals = values.tobytes()
        with open(os.path.join(args.out, f"{name}.blocks"), "wb") as f:
            f.write(raw)
        with open(os.path.join(args.out, f"{name}.f32"), "wb") as f:
            f.write(vals)
        manifest["types"][name] = {"block_size": bd.block_size, "type_size": bd.type_size,
                                   "blocks": len(bd.blocks), "labels": bd.labels,
                                   "blocks_sha256": sha256(raw), "values_sha256": sha256(vals)}
        print(f"{name}: {len(bd.blocks)} blocks, {values.size} values, "
              f"{int(np.isnan(values).sum())} NaN, {len(raw) + len(vals)} bytes")
    with open(os.path.join(args.out, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
        f.write("\n")

    if args.real_model:
        r = gguf.GGUFReader(args.real_model)
        names = []
        for n in args.tensors.split(","):
            if n.startswith("FIRST_"):
                n = next(t.name for t in r.tensors if t.tensor_type.name == n[len("FIRST_"):])
            names.append(n)
        print(f"real model {args.real_model}:")
        rec = real_model(gguf, quants, args.real_model, names)
        rec.update(gguf_py=version, numpy=np.__version__, generator=manifest["generator"])
        with open(os.path.join(args.out, "real_model_tensors.json"), "w") as f:
            json.dump(rec, f, indent=1, sort_keys=True)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
