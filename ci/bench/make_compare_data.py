#!/usr/bin/env python3
"""The two tensors every comparator peer of ci/bench.sh reads: OUT_DIR/a.npy
and OUT_DIR/b.npy, float32, MIB MiB each, 1-D.

usage: make_compare_data.py OUT_DIR --mib MIB

Golden-check-like values, from numpy.random.default_rng(0): a ~ N(0, 1),
b = a + N(0, 1e-5): differences at the scale of the default f32 tolerance
(atol 1e-5 + rtol 1.3e-6·|b|), so the allclose test sits near its boundary
and about a third of the elements fail it, as in a real near-miss. All
finite (the comparators' non-finite branches are not what is timed).
Written through a temporary name and renamed, so an interrupted run leaves no
half file for the next run to trust.
"""
import argparse
import os
import sys

import numpy as np

CHUNK = 1 << 24  # elements generated at a time: bounded memory for any size


def write(path, n, fill):
    tmp = path + ".tmp"
    arr = np.lib.format.open_memmap(tmp, mode="w+", dtype=np.float32, shape=(n,))
    fill(arr)
    arr.flush()
    del arr
    os.replace(tmp, path)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir")
    ap.add_argument("--mib", type=int, required=True)
    args = ap.parse_args()
    if args.mib < 1:
        ap.error("--mib must be >= 1")
    n = args.mib * (1 << 20) // 4
    os.makedirs(args.out_dir, exist_ok=True)
    rng = np.random.default_rng(0)
    a_path, b_path = os.path.join(args.out_dir, "a.npy"), os.path.join(args.out_dir, "b.npy")
    noise = []

    def fill_a(a):
        for s in range(0, n, CHUNK):
            e = min(n, s + CHUNK)
            a[s:e] = rng.standard_normal(e - s, dtype=np.float32)
            noise.append(rng.standard_normal(e - s, dtype=np.float32) * np.float32(1e-5))

    write(a_path, n, fill_a)
    a = np.load(a_path, mmap_mode="r")

    def fill_b(b):
        for k, s in enumerate(range(0, n, CHUNK)):
            e = min(n, s + CHUNK)
            b[s:e] = a[s:e] + noise[k]

    write(b_path, n, fill_b)
    print(f"make_compare_data.py: {a_path}, {b_path}: {n} float32 each ({args.mib} MiB)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
