"""What every peer of ci/bench.sh shares with `touchstone bench`: one JSON line
per measurement on stdout (flushed at once, the driver reads a pipe) and a
readable line on stderr; the process's peak RSS as Linux reports it
(/proc/self/status VmHWM, the figure `touchstone bench` reads); medians."""
import argparse
import json
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
RECORDERS = os.path.join(ROOT, "goldens", "recorders")


def emit(record, human):
    print(json.dumps(record, sort_keys=True), flush=True)
    print(human, file=sys.stderr, flush=True)


def peak_rss_bytes():
    """VmHWM in bytes, or None where /proc does not say."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    kib, unit = line.split()[1:3]
                    return int(kib) * 1024 if unit == "kB" else None
    except OSError:
        return None
    return None


def median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def rate(count, seconds):
    return count / seconds if seconds > 0 else None


def parse_tokens(text):
    """--tokens 17,7936,...: the prompt `touchstone bench engine` printed."""
    try:
        ids = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise SystemExit(f"--tokens: not a comma-separated list of token ids: {text[:80]!r}")
    if not ids or min(ids) < 0:
        raise SystemExit("--tokens: give at least one non-negative token id")
    return ids


def model_file_bytes(path):
    """A .gguf's size, or the sum of an HF folder's *.safetensors (as touchstone counts)."""
    if os.path.isdir(path):
        return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.endswith(".safetensors"))
    return os.path.getsize(path)


def engine_peer_parser(doc, model_arg, model_help):
    """The arguments every engine peer takes, as `touchstone bench engine` gets them."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument(model_arg, help=model_help)
    ap.add_argument("--tokens", required=True, help="comma-separated prompt token ids")
    ap.add_argument("--decode", type=int, required=True, help="greedy decode steps")
    ap.add_argument("--threads", type=int, required=True)
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--warmup", type=int, default=1)
    return ap


def engine_peer_args(ap):
    """Parsed and checked arguments of `engine_peer_parser`, and the prompt ids."""
    args = ap.parse_args()
    if args.decode < 1 or args.threads < 1 or args.reps < 1 or args.warmup < 0:
        ap.error("--decode, --threads and --reps must be >= 1, --warmup >= 0")
    return args, parse_tokens(args.tokens)


def timed_reps(engine, generate, n_prompt, args):
    """`args.warmup` untimed runs, then `args.reps` timed ones of
    `generate(n_decode) -> (prefill s, decode s, ids)`, each emitted; returns
    the prefill and decode tok/s of every rep and the last rep's ids."""
    for _ in range(args.warmup):
        generate(1)
    pre, dec, generated = [], [], []
    for rep in range(1, args.reps + 1):
        prefill_s, decode_s, generated = generate(args.decode)
        p, d = rate(n_prompt, prefill_s), rate(args.decode, decode_s)
        pre.append(p)
        dec.append(d)
        emit({"bench": "engine", "engine": engine, "rep": rep, "prefill_s": prefill_s, "decode_s": decode_s,
              "prefill_tok_s": p, "decode_tok_s": d},
             f"{engine} rep {rep}/{args.reps}: prefill {n_prompt} tokens in {prefill_s:.3f} s = {p:.2f} tok/s; "
             f"decode {args.decode} steps in {decode_s:.3f} s = {d:.2f} tok/s")
    return pre, dec, generated
