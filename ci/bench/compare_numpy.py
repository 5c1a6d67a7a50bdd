"""The numpy equivalent of `touchstone compare A.npy B.npy`, the baseline it is timed against.

Loads both arrays with np.load and computes what touchstone reports, in float64 as
touchstone does: the greatest |a-e| and its index, the greatest |a-e|/|e| (over e != 0)
and its index (np.argmax: the first index of a tie, as touchstone), the number of
elements breaking |a-e| <= atol + rtol*|e|, NMSE = sum((a-e)^2)/sum(e^2) and cosine =
a.e/(|a||e|). touchstone also screens NaN/Inf and counts ULPs; this script assumes
finite inputs, which makes it no slower than the real equivalent.

Prints one JSON line: the metrics, and the seconds spent loading, computing and in all.

usage: python3 ci/bench/compare_numpy.py A.npy B.npy [--atol 1e-5] [--rtol 1.3e-6]
"""

import argparse
import json
import time

import numpy as np


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("a")
    p.add_argument("b")
    p.add_argument("--atol", type=float, default=1e-5)
    p.add_argument("--rtol", type=float, default=1.3e-6)
    args = p.parse_args()

    t0 = time.perf_counter()
    a, e = np.load(args.a), np.load(args.b)
    t1 = time.perf_counter()
    a64, e64 = a.astype(np.float64).ravel(), e.astype(np.float64).ravel()
    d = np.abs(a64 - e64)
    ae = np.abs(e64)
    i_abs = int(np.argmax(d))
    with np.errstate(divide="ignore", invalid="ignore"):
        rel = np.where(e64 != 0, d / ae, -1.0)
    i_rel = int(np.argmax(rel))
    mismatched = int(np.count_nonzero(~(d <= args.atol + args.rtol * ae)))
    e2, a2 = float(e64 @ e64), float(a64 @ a64)
    nmse = float(d @ d) / e2
    cosine = float(a64 @ e64) / (a2 * e2) ** 0.5
    t2 = time.perf_counter()

    unravel = lambda i: [int(k) for k in np.unravel_index(i, a.shape)]
    print(json.dumps({
        "shape": list(a.shape),
        "max_abs": float(d[i_abs]), "max_abs_at": unravel(i_abs),
        "max_rel": float(rel[i_rel]), "max_rel_at": unravel(i_rel),
        "mismatched": mismatched, "nmse": nmse, "cosine": cosine,
        "load_s": round(t1 - t0, 4), "compute_s": round(t2 - t1, 4), "total_s": round(t2 - t0, 4),
    }))


if __name__ == "__main__":
    main()
