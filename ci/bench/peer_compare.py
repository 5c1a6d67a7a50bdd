#!/usr/bin/env python3
"""numpy and torch, the peers of `touchstone bench compare`: the metrics of
touchstone's comparator (src/compare/mod.rs) on the same two tensors, in GB/s of
input read, with the same JSON lines.

usage: peer_compare.py {numpy,torch} A.npy B.npy --threads T [--reps R] [--once]
                       [--atol X] [--rtol Y]

The metrics and their definitions are touchstone's, so the driver can check
that every peer computed the same numbers: NaN/Inf counts per side; the
allclose mismatch count (|a-e| <= atol + rtol·|e| in float64; a non-finite
pair mismatches unless it is the same infinity); the greatest |a-e| and
|a-e|/|e| (e != 0) over finite pairs with the flat index of the first
occurrence; the greatest distance in f32 ULPs; NMSE Σ(a-e)²/Σe² and cosine
a·e/(|a||e|) accumulated in float64.

Both walk the data in blocks so the float64 temporaries stay in cache: the
way to use numpy and torch well on arrays of this size (whole-array float64
temporaries would be 512 MB each for 2 x 256 MiB of input). Block sizes
measured here (Zen 4, 1 MiB L2 per core, 2 x 16 MiB input, 2 threads):
numpy 2^13..2^18 gave 0.90, 1.04, 1.11, 1.23, 0.58, 0.37 GB/s, so 2^16 (its
float64 temporaries, 512 KiB each, fit in L2); torch 0.26, 0.36, 0.39, 0.60,
0.60, 0.35, so 2^17. numpy's elementwise work is one thread whatever
OpenBLAS does; its per-block dot products with OPENBLAS_NUM_THREADS=2 were
slower (2^16: 0.44 against 1.23 GB/s: waking a second thread per small dot
costs more than it saves), so the driver runs this numpy peer with one BLAS
thread. torch runs with torch.set_num_threads(T).

--once: load both files, compute once, print the metrics: the whole-process
numpy peer of `touchstone compare A B` (used by the driver when
ci/bench/compare_numpy.py does not exist).
"""
import argparse
import os
import sys
import time

import numpy as np

sys.dont_write_bytecode = True
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from common import emit, median  # noqa: E402

# touchstone's default f32 tolerance (Tolerance::default_for(F32)).
ATOL, RTOL = 1e-5, 1.3e-6
BLOCK = {"numpy": 1 << 16, "torch": 1 << 17}


class Acc:
    """What the blocks add up to, merged in block order (ties keep the
    earlier index, as touchstone's chunks do)."""

    def __init__(self):
        self.nan_a = self.inf_a = self.nan_e = self.inf_e = self.mismatched = 0
        self.max_abs = self.max_rel = None  # (value, flat index)
        self.max_ulp = 0
        self.sd2 = self.se2 = self.sa2 = self.sae = 0.0

    def keep(self, field, value, index):
        cur = getattr(self, field)
        if cur is None or value > cur[0]:
            setattr(self, field, (float(value), int(index)))

    def result(self, numel, atol, rtol):
        nmse = self.sd2 / self.se2 if self.se2 > 0 else (0.0 if self.sd2 == 0 else float("inf"))
        if self.sa2 > 0 and self.se2 > 0:
            cosine = max(-1.0, min(1.0, self.sae / (self.sa2 * self.se2) ** 0.5))
        else:
            cosine = 1.0 if self.sa2 == 0 and self.se2 == 0 else 0.0
        worst = lambda m: None if m is None else {"value": m[0], "index": m[1]}  # noqa: E731
        return {"numel": numel, "atol": atol, "rtol": rtol, "mismatched": self.mismatched,
                "non_finite": self.nan_a + self.inf_a + self.nan_e + self.inf_e,
                "max_abs": worst(self.max_abs), "max_rel": worst(self.max_rel), "max_ulp": self.max_ulp,
                "nmse": nmse, "cosine": cosine}


def ulp_keys_np(x32):
    """f32 bit patterns on a monotone integer line, touchstone's ulp_distance
    key (sign-magnitude: -|bits| for negatives, so +0 and -0 are 0 apart),
    computed in place: for a negative b, (b ^ 0x7fffffff) is -1 - magnitude,
    and subtracting the sign (-1) gives -magnitude."""
    k = x32.view(np.int32).astype(np.int64)
    sign = k >> 63
    k ^= sign & 0x7FFFFFFF
    k -= sign
    return k


def metrics_numpy(a, e, atol, rtol, block=BLOCK["numpy"]):
    acc = Acc()
    for s in range(0, a.size, block):
        x32, y32 = a[s:s + block], e[s:s + block]
        fin = np.isfinite(x32) & np.isfinite(y32)
        where = None
        if not fin.all():
            acc.nan_a += int(np.isnan(x32).sum()); acc.inf_a += int(np.isinf(x32).sum())  # noqa: E702
            acc.nan_e += int(np.isnan(y32).sum()); acc.inf_e += int(np.isinf(y32).sum())  # noqa: E702
            acc.mismatched += int(np.count_nonzero(~fin & (x32 != y32)))
            where = np.flatnonzero(fin)
            x32, y32 = x32[fin], y32[fin]
        if x32.size == 0:
            continue
        x, y = x32.astype(np.float64), y32.astype(np.float64)
        d = np.abs(x - y)
        ay = np.abs(y)
        acc.mismatched += int(np.count_nonzero(d > atol + rtol * ay))
        at = (lambda i: s + int(i)) if where is None else (lambda i: s + int(where[i]))
        i = int(d.argmax())
        acc.keep("max_abs", d[i], at(i))
        nz = ay != 0
        if nz.any():
            r = np.divide(d, ay, out=np.full_like(d, -1.0), where=nz)
            i = int(r.argmax())
            acc.keep("max_rel", r[i], at(i))
        acc.max_ulp = max(acc.max_ulp, int(np.abs(ulp_keys_np(x32) - ulp_keys_np(y32)).max()))
        acc.sd2 += float(d @ d); acc.se2 += float(y @ y)  # noqa: E702
        acc.sa2 += float(x @ x); acc.sae += float(x @ y)  # noqa: E702
    return acc.result(int(a.size), atol, rtol)


def metrics_torch(torch, a, e, atol, rtol, block=BLOCK["torch"]):
    def keys(x32):  # as ulp_keys_np
        k = x32.view(torch.int32).to(torch.int64)
        sign = k >> 63
        k ^= sign & 0x7FFFFFFF
        k -= sign
        return k

    acc = Acc()
    for s in range(0, a.numel(), block):
        x32, y32 = a[s:s + block], e[s:s + block]
        fin = torch.isfinite(x32) & torch.isfinite(y32)
        where = None
        if not bool(fin.all()):
            acc.nan_a += int(torch.isnan(x32).sum()); acc.inf_a += int(torch.isinf(x32).sum())  # noqa: E702
            acc.nan_e += int(torch.isnan(y32).sum()); acc.inf_e += int(torch.isinf(y32).sum())  # noqa: E702
            acc.mismatched += int(torch.count_nonzero(~fin & (x32 != y32)))
            where = torch.nonzero(fin).flatten()
            x32, y32 = x32[fin], y32[fin]
        if x32.numel() == 0:
            continue
        x, y = x32.double(), y32.double()
        d = (x - y).abs()
        ay = y.abs()
        acc.mismatched += int(torch.count_nonzero(d > atol + rtol * ay))
        at = (lambda i: s + int(i)) if where is None else (lambda i: s + int(where[i]))
        i = int(d.argmax())  # the first of equal maxima
        acc.keep("max_abs", float(d[i]), at(i))
        nz = ay != 0
        if bool(nz.any()):
            r = torch.where(nz, d / ay, torch.full_like(d, -1.0))
            i = int(r.argmax())
            acc.keep("max_rel", float(r[i]), at(i))
        acc.max_ulp = max(acc.max_ulp, int((keys(x32) - keys(y32)).abs().max()))
        acc.sd2 += float(torch.dot(d, d)); acc.se2 += float(torch.dot(y, y))  # noqa: E702
        acc.sa2 += float(torch.dot(x, x)); acc.sae += float(torch.dot(x, y))  # noqa: E702
    return acc.result(int(a.numel()), atol, rtol)


def load(path):
    arr = np.load(path)
    if arr.dtype != np.float32:
        sys.exit(f"peer_compare.py: {path} is {arr.dtype}; the bench compares float32")
    return np.ascontiguousarray(arr).reshape(-1)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("impl", choices=["numpy", "torch"])
    ap.add_argument("a")
    ap.add_argument("b")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--once", action="store_true", help="compute once and print the metrics (a whole-process run)")
    ap.add_argument("--atol", type=float, default=ATOL)
    ap.add_argument("--rtol", type=float, default=RTOL)
    args = ap.parse_args()
    if args.threads < 1 or args.reps < 1:
        ap.error("--threads and --reps must be >= 1")
    a, e = load(args.a), load(args.b)
    if a.shape != e.shape:
        sys.exit(f"peer_compare.py: shapes differ: {a.shape} vs {e.shape}")
    if args.impl == "torch":
        import torch
        torch.set_num_threads(args.threads)
        ta, te = torch.from_numpy(a), torch.from_numpy(e)
        fn = lambda: metrics_torch(torch, ta, te, args.atol, args.rtol)  # noqa: E731
        version = torch.__version__
    else:
        fn = lambda: metrics_numpy(a, e, args.atol, args.rtol)  # noqa: E731
        version = np.__version__
    if args.once:
        print(__import__("json").dumps({"impl": args.impl, "metrics": fn()}, sort_keys=True))
        return 0
    nbytes = a.nbytes + e.nbytes
    rates, metrics = [], None
    for rep in range(1, args.reps + 1):
        t = time.perf_counter()
        metrics = fn()
        s = time.perf_counter() - t
        rates.append(nbytes / s / 1e9)
        emit({"bench": "compare", "impl": args.impl, "rep": rep, "seconds": s, "gb_s": rates[-1]},
             f"{args.impl} compare rep {rep}/{args.reps}: {nbytes / 1e6:.0f} MB in {s:.3f} s = {rates[-1]:.2f} GB/s")
    emit({"bench": "compare", "impl": args.impl, "summary": True, "threads": args.threads, "bytes": nbytes,
          "reps": args.reps, "median_gb_s": median(rates), "best_gb_s": max(rates), "metrics": metrics,
          "version": version, "block": BLOCK[args.impl]},
         f"{args.impl} compare: median {median(rates):.2f} GB/s of input ({args.impl} {version})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
