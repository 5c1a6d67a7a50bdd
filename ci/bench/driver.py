#!/usr/bin/env python3
"""The driver behind ci/bench.sh: touchstone against its peers, interleaved,
medians and ratios. Run it through ci/bench.sh (which builds touchstone and
finds the Python environment); `ci/bench.sh --help` lists the options.

Per round r = 1..R, each group in an order rotated by r (no peer always goes
first or last):
  bandwidth   `touchstone bench bandwidth`: the memory read bandwidth
  engines     touchstone (`touchstone bench engine`), llama.cpp
              (peer_llamacpp.py), HF transformers (peer_hf.py): one fresh
              process each, loading the model, one warm-up, one timed
              repetition (prefill, then greedy decode steps)
  comparator  `touchstone bench compare`, numpy and torch (peer_compare.py)
              in-process on the same two .npy tensors, 3 repetitions each
  whole       `touchstone compare A B` and the numpy script, as processes
Then medians per peer over the rounds, ratios, a table, and every record
(with each process's wall time, peak RSS and the CPU share other processes
took meanwhile) in the --out JSON.
"""
import argparse
import datetime
import json
import os
import platform
import subprocess
import sys

sys.dont_write_bytecode = True
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import procs  # noqa: E402
import report  # noqa: E402
from common import RECORDERS, ROOT  # noqa: E402

sys.path.insert(0, RECORDERS)
import build_llamacpp  # noqa: E402

CACHE = os.path.join(build_llamacpp.touchstone_cache(), "bench")
RANDOM_MODEL = "qwen2.5-0.5b-random"
TINY = os.path.join(ROOT, "goldens", "qwen2-tiny")


def say(msg):
    print(f"bench: {msg}", file=sys.stderr, flush=True)


def prompt_tokens(n, vocab):
    """The prompt of `touchstone bench engine` (src/cmd/bench/engine.rs
    prompt_tokens); checked against the ids touchstone prints."""
    return [(17 + 7919 * i) % vocab for i in range(n)]


def ensure_random_model(py):
    """The random-weights 0.5B model (HF folder and F32 GGUF), made once in the
    cache; remade when make_bench_model.py changed since (its sha256 is stamped)."""
    base = os.path.join(CACHE, RANDOM_MODEL)
    model, gguf = os.path.join(base, "model"), os.path.join(base, "model-f32.gguf")
    stamp = os.path.join(model, "bench-model.json")
    import make_bench_model
    want = make_bench_model.script_sha256()
    fresh = False
    if os.path.isfile(stamp):
        with open(stamp) as f:
            fresh = json.load(f).get("script_sha256") == want
    if not fresh:
        say(f"making the random-weights Qwen2.5-0.5B-shaped model in {model} (about 20 s, 2 GB)")
        subprocess.run([py, os.path.join(HERE, "make_bench_model.py"), model], check=True, stdout=subprocess.DEVNULL)
        if os.path.exists(gguf):
            os.remove(gguf)
    if not os.path.isfile(gguf):
        say(f"converting it to an F32 GGUF with llama.cpp's converter: {gguf} (about 10 s)")
        subprocess.run([py, os.path.join(RECORDERS, "convert_gguf.py"), model, gguf, "--model-name",
                        "touchstone-bench-" + RANDOM_MODEL], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    with open(stamp) as f:
        info = json.load(f)
    return model, gguf, info


def ensure_compare_data(py, mib):
    d = os.path.join(CACHE, f"compare-{mib}mib")
    a, b = os.path.join(d, "a.npy"), os.path.join(d, "b.npy")
    if not (os.path.isfile(a) and os.path.isfile(b)):
        say(f"writing the comparator's data, 2 x {mib} MiB, into {d}")
        subprocess.run([py, os.path.join(HERE, "make_compare_data.py"), d, "--mib", str(mib)], check=True)
    return a, b


def warm_page_cache(paths):
    """Read each file once, so that no peer pays for the disk (the first to
    load a 2 GB model would otherwise be timed on it)."""
    for p in paths:
        files = [os.path.join(p, f) for f in sorted(os.listdir(p))] if os.path.isdir(p) else [p]
        for f in files:
            with open(f, "rb") as fh:
                while fh.read(64 << 20):
                    pass


def llamacpp_lib(args):
    """(lib_dir, None) or (None, why the llama.cpp peer is skipped)."""
    native = args.llamacpp_build == "native"
    found = build_llamacpp.find_built(native=native)
    if found:
        return found[0], None
    if args.setup:
        say(f"building libllama ({args.llamacpp_build}) from the pinned sdist: about 7-11 minutes on 2 cores")
        return build_llamacpp.ensure_built(native=native)[0], None
    flag = " --native" if native else ""
    return None, (f"no {args.llamacpp_build} libllama build in {build_llamacpp.build_dir(native=native)}: build it "
                  f"with `goldens/recorders/build_llamacpp.py{flag}` (7-11 minutes on 2 cores) or pass --setup")


def git_commit():
    try:
        head = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", ROOT, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True).stdout.strip()
        return head + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def cpu_name():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def rotated(items, r):
    k = r % len(items) if items else 0
    return items[k:] + items[:k]


def main():
    ap = argparse.ArgumentParser(description="touchstone against llama.cpp, HF transformers, numpy and torch, "
                                             "interleaved; medians and ratios (ci/bench.sh)")
    ap.add_argument("--touchstone", required=True, help="the touchstone binary (ci/bench.sh builds it)")
    ap.add_argument("--reps", type=int, default=None, help="rounds (default 5; --quick: 1)")
    ap.add_argument("--threads", type=int, default=2, help="threads for every peer (default 2)")
    ap.add_argument("--prompt-tokens", type=int, default=None, help="prompt length (default 32; --quick: 8)")
    ap.add_argument("--decode", type=int, default=None, help="greedy decode steps (default 32; --quick: 8)")
    ap.add_argument("--compare-mib", type=int, default=None, help="each comparator tensor, MiB (default 256; --quick: 16)")
    ap.add_argument("--bandwidth-mib", type=int, default=None, help="bandwidth buffer, MiB (default 1024; --quick: 128)")
    ap.add_argument("--skip-hf", action="store_true", help="leave out HF transformers")
    ap.add_argument("--skip-llamacpp", action="store_true", help="leave out llama.cpp")
    ap.add_argument("--skip-compare", action="store_true", help="leave out the comparator benchmarks")
    ap.add_argument("--llamacpp-build", choices=["native", "portable"], default="native",
                    help="native: build_llamacpp.py --native (the default: llama.cpp at its best here); "
                         "portable: the goldens' GGML_NATIVE=OFF build")
    ap.add_argument("--quick", action="store_true",
                    help="test the script itself: the committed tiny qwen2 model, 1 round, small sizes (seconds)")
    ap.add_argument("--setup", action="store_true", help="build what is missing (libllama) instead of skipping it")
    ap.add_argument("--timeout", type=int, default=1800, help="seconds before a peer process is killed")
    ap.add_argument("--out", default=None, help="write every record and the summary as JSON to this file")
    args = ap.parse_args()
    q = args.quick
    args.reps = args.reps or (1 if q else 5)
    args.prompt_tokens = args.prompt_tokens or (8 if q else 32)
    args.decode = args.decode or (8 if q else 32)
    args.compare_mib = args.compare_mib or (16 if q else 256)
    args.bandwidth_mib = args.bandwidth_mib or (128 if q else 1024)
    for k in ("reps", "threads", "prompt_tokens", "decode", "compare_mib", "bandwidth_mib", "timeout"):
        if getattr(args, k) < 1:
            ap.error(f"--{k.replace('_', '-')} must be >= 1")
    if not os.access(args.touchstone, os.X_OK):
        ap.error(f"--touchstone {args.touchstone}: not an executable (ci/bench.sh builds it)")
    py = sys.executable
    T = str(args.threads)
    os.makedirs(CACHE, exist_ok=True)

    # ---- inputs ------------------------------------------------------------
    if q:
        model_dir, gguf = os.path.join(TINY, "model"), os.path.join(TINY, "model.gguf")
        with open(os.path.join(model_dir, "config.json")) as f:
            vocab = json.load(f)["vocab_size"]
        model_info = {"name": "qwen2-tiny (committed, goldens/qwen2-tiny)", "params": None}
    else:
        model_dir, gguf, info = ensure_random_model(py)
        vocab = info["config"]["vocab_size"]
        model_info = {"name": "random weights at the Qwen2.5-0.5B shape", "params": info["params"],
                      "weight_bytes_f32": info["weight_bytes_f32"], "dir": model_dir, "gguf": gguf}
    skipped = {}
    lib_dir = None
    if args.skip_llamacpp:
        skipped["llama.cpp"] = "--skip-llamacpp"
    else:
        lib_dir, why = llamacpp_lib(args)
        if why:
            skipped["llama.cpp"] = why
            say(f"llama.cpp peer skipped: {why}")
    if args.skip_hf:
        skipped["hf"] = "--skip-hf"
    a_npy = b_npy = None
    if not args.skip_compare:
        a_npy, b_npy = ensure_compare_data(py, args.compare_mib)
    say("reading the model files and data once (page cache)")
    warm_page_cache([p for p in (model_dir, gguf if lib_dir else None, a_npy, b_npy) if p])

    tokens = prompt_tokens(args.prompt_tokens, vocab)
    toks = ",".join(map(str, tokens))
    P, D = str(args.prompt_tokens), str(args.decode)
    engines = [("touchstone", [args.touchstone, "bench", "engine", "--model", model_dir, "--prompt-tokens", P,
                               "--decode", D, "--threads", T, "--reps", "1", "--warmup", "1"], None)]
    if lib_dir:
        engines.append(("llama.cpp", [py, os.path.join(HERE, "peer_llamacpp.py"), gguf, "--tokens", toks,
                                      "--decode", D, "--threads", T, "--lib-dir", lib_dir], None))
    if not args.skip_hf:
        engines.append(("hf", [py, os.path.join(HERE, "peer_hf.py"), model_dir, "--tokens", toks, "--decode", D,
                               "--threads", T], None))
    # BLAS threads: capped at T like everyone's threads. The in-process numpy
    # peer uses one: its per-block dot products ran slower with two
    # (peer_compare.py's docstring has the measurement).
    blas_env = dict(os.environ, OPENBLAS_NUM_THREADS=T, OMP_NUM_THREADS=T, MKL_NUM_THREADS=T)
    blas1_env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    inproc, whole = [], []
    numpy_script = os.path.join(HERE, "compare_numpy.py")
    if not args.skip_compare:
        inproc = [("touchstone", [args.touchstone, "bench", "compare", "--a", a_npy, "--b", b_npy, "--threads", T,
                                  "--reps", "3", "--bandwidth-mib", str(args.bandwidth_mib)], None),
                  ("numpy", [py, os.path.join(HERE, "peer_compare.py"), "numpy", a_npy, b_npy, "--threads", T,
                             "--reps", "3"], blas1_env),
                  ("torch", [py, os.path.join(HERE, "peer_compare.py"), "torch", a_npy, b_npy, "--threads", T,
                             "--reps", "3"], blas_env)]
        numpy_cmd = ([py, numpy_script, a_npy, b_npy] if os.path.isfile(numpy_script)
                     else [py, os.path.join(HERE, "peer_compare.py"), "numpy", a_npy, b_npy, "--once"])
        whole = [("touchstone compare", [args.touchstone, "compare", a_npy, b_npy],
                  dict(os.environ, RAYON_NUM_THREADS=T)),
                 ("numpy " + os.path.basename(numpy_cmd[1]), numpy_cmd, blas_env)]
    bandwidth = ("bandwidth", [args.touchstone, "bench", "bandwidth", "--threads", T, "--mib",
                               str(args.bandwidth_mib), "--reps", "5"], None)

    started = datetime.datetime.now(datetime.timezone.utc)
    say(f"{args.reps} round(s), {args.threads} threads; engines: {', '.join(e[0] for e in engines)}"
        + (f"; comparators: {', '.join(c[0] for c in inproc)}" if inproc else ""))
    # Whole-process runs once untimed first: the binary and interpreter start
    # from the page cache in every timed run.
    for name, cmd, env in whole:
        procs.run(name, cmd, env=env, ok_codes=(0, 1), timeout_s=args.timeout, echo=False)
    runs = []
    for r in range(args.reps):
        say(f"round {r + 1}/{args.reps}")
        plan = ([("bandwidth", bandwidth)] + [("engine", e) for e in rotated(engines, r)]
                + [("compare", c) for c in rotated(inproc, r)] + [("whole", w) for w in rotated(whole, r)])
        for group, (name, cmd, env) in plan:
            say(f"  {group}: {name}")
            # `touchstone compare` exits 1 when the tensors differ, as they do here.
            ok = (0, 1) if group == "whole" else (0,)
            res = procs.run(name, cmd, env=env, ok_codes=ok, timeout_s=args.timeout)
            runs.append({"round": r + 1, "group": group, **res.to_json()})
            if res.error:
                say(f"  {group}: {name} FAILED: {res.error}")
    finished = datetime.datetime.now(datetime.timezone.utc)

    meta = {"started": started.isoformat(timespec="seconds"), "finished": finished.isoformat(timespec="seconds"),
            "seconds": round((finished - started).total_seconds(), 1), "commit": git_commit(), "cpu": cpu_name(),
            "cores": os.cpu_count(), "threads": args.threads, "rounds": args.reps, "quick": q,
            "prompt_tokens": args.prompt_tokens, "decode_steps": args.decode, "prompt": tokens,
            "compare_mib": None if args.skip_compare else args.compare_mib, "bandwidth_mib": args.bandwidth_mib,
            "model": model_info, "skipped": skipped, "llamacpp_build": args.llamacpp_build if lib_dir else None,
            "numpy_whole_process": None if args.skip_compare else whole[1][1][1],
            "python": platform.python_version()}
    summary = report.summarise(runs, meta)
    text = report.render(summary, meta)
    print(text)
    if args.out:
        tmp = args.out + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"meta": meta, "summary": summary, "runs": runs}, f, indent=1, sort_keys=True)
        os.replace(tmp, args.out)
        say(f"every record is in {args.out}")
    failed = [r for r in runs if r["error"]]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
