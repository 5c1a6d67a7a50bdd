#!/usr/bin/env python3
"""Compare two golden files stage by stage (e.g. HF vs llama.cpp).

usage: compare_sources.py A.safetensors B.safetensors [--tol X]

For every `<step>/<stage>` key both files hold: max abs diff and cosine
similarity (float64), printed per (step, stage), then the worst. `tokens`
and `positions` must be identical, and so must the greedy ids in the two
provenances. Exit 0 when the worst max abs diff is <= --tol (default 1e-5)
and everything else matches; 1 otherwise.
"""
import argparse
import json
import sys

import numpy as np
from safetensors import safe_open


def load(path):
    with safe_open(path, "np") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, json.loads(f.metadata()["provenance"])


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("a")
    ap.add_argument("b")
    ap.add_argument("--tol", type=float, default=1e-5)
    args = ap.parse_args()
    a, pa = load(args.a)
    b, pb = load(args.b)
    ok = True
    if sorted(a) != sorted(b):
        print(f"keys differ: only in A {sorted(set(a) - set(b))}, only in B {sorted(set(b) - set(a))}")
        ok = False
    steps = pa["steps"]
    print(f"A: {pa['source']}  B: {pb['source']}")
    print(f"{'step':<8} {'stage':<20} {'shape':<14} {'max|A-B|':>10} {'cosine':>13} {'max|A|':>8}")
    worst = (0.0, None)
    for step in steps:
        keys = sorted((k for k in a if k.startswith(step + "/") and k in b),
                      key=lambda k: list(a).index(k))
        for k in keys:
            stage = k.split("/", 1)[1]
            x, y = a[k], b[k]
            if x.shape != y.shape:
                print(f"{step:<8} {stage:<20} shape {x.shape} vs {y.shape}")
                ok = False
                continue
            if stage in ("tokens", "positions"):
                if not np.array_equal(x, y):
                    print(f"{step:<8} {stage:<20} DIFFER: {x.tolist()} vs {y.tolist()}")
                    ok = False
                continue
            x64, y64 = x.astype(np.float64).ravel(), y.astype(np.float64).ravel()
            d = float(np.abs(x64 - y64).max())
            cos = float(x64 @ y64 / (np.linalg.norm(x64) * np.linalg.norm(y64) + 1e-300))
            print(f"{step:<8} {stage:<20} {str(tuple(x.shape)):<14} {d:>10.3e} {cos:>13.10f} {np.abs(x64).max():>8.3g}")
            if d > worst[0] or worst[1] is None:
                worst = (d, k)
    print(f"\nworst max abs diff: {worst[0]:.3e} at {worst[1]}")
    ga, gb = pa.get("greedy_ids"), pb.get("greedy_ids")
    print(f"greedy ids: A {ga}  B {gb}  {'identical' if ga == gb else 'DIFFER'}")
    ok = ok and ga == gb and worst[0] <= args.tol
    print("OK" if ok else f"NOT OK (tol {args.tol:g})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
