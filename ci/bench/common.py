"""What every peer of ci/bench.sh shares with `touchstone bench`: one JSON line
per measurement on stdout (flushed at once, the driver reads a pipe) and a
readable line on stderr; the process's peak RSS as Linux reports it
(/proc/self/status VmHWM, the figure `touchstone bench` reads); medians."""
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
