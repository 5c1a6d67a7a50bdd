#!/usr/bin/env bash
# Regenerate the tiny Qwen2 model and its HF goldens from scratch and compare
# them, byte for byte, with the committed ones in goldens/qwen2-tiny/.
#
# usage: goldens/recorders/regen.sh [OUT_DIR]     (from any directory)
#
#   OUT_DIR  where to write (default: <repo>/.cache/regen/qwen2-tiny); a
#            relative path is taken from the current directory. Never the
#            committed goldens: this script only proposes, a human accepts.
#
# Creates (or reuses) the virtual environment <repo>/.venv-recorders with the
# pinned packages of requirements.txt. Set PYTHON to choose the interpreter
# that creates it (default python3; the goldens were recorded with 3.11, and
# the Python version is part of their provenance).
#
# Exit status: 0 all files identical to the committed ones, 1 some differ or
# are not committed yet, 2 usage or environment error.
set -euo pipefail

die() { echo "regen.sh: error: $*" >&2; exit 2; }
say() { echo "regen.sh: $*"; }

[ $# -le 1 ] || die "usage: $0 [OUT_DIR]"
case "${1:-}" in -h|--help) sed -n '2,17p' "$0" | sed 's/^# \{0,1\}//'; exit 0;; esac

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
VENV="$ROOT/.venv-recorders"
REQS="$HERE/requirements.txt"
COMMITTED="$ROOT/goldens/qwen2-tiny"

OUT="${1:-$ROOT/.cache/regen/qwen2-tiny}"
[ -n "$OUT" ] || die "OUT_DIR is empty"
# Resolve to an absolute, normalised path before creating anything, so the
# committed goldens can be refused however they are spelled.
OUT="$(realpath -m -- "$OUT")" || die "cannot resolve OUT_DIR"
case "$OUT/" in
    "$COMMITTED/"*) die "OUT_DIR ($OUT) is or is inside the committed goldens; regenerate elsewhere and copy after review";;
esac
mkdir -p "$OUT" || die "cannot create $OUT"

# ---- virtual environment ---------------------------------------------------
# Reuse the venv when every pin in requirements.txt is installed at exactly
# that version (checked offline); otherwise (re)install from requirements.txt.
pins_ok() {
    "$VENV/bin/python" - "$REQS" <<'PY'
import sys
from importlib.metadata import PackageNotFoundError, version
bad = []
for line in open(sys.argv[1]):
    line = line.split("#", 1)[0].strip()
    if not line:
        continue
    name, _, want = line.partition("==")
    try:
        have = version(name.strip())
    except PackageNotFoundError:
        have = None
    if have != want.strip():
        bad.append(f"{name.strip()} (want {want.strip()}, have {have})")
if bad:
    print("regen.sh: pins not satisfied: " + ", ".join(bad), file=sys.stderr)
    sys.exit(1)
PY
}

if [ ! -x "$VENV/bin/python" ]; then
    PY="${PYTHON:-python3}"
    command -v "$PY" >/dev/null || die "no '$PY' on PATH; set PYTHON=/path/to/python3.11"
    say "creating virtual environment $VENV with $("$PY" -V 2>&1)"
    "$PY" -m venv "$VENV" || die "could not create $VENV (is the venv module installed?)"
fi
if pins_ok; then
    say "reusing $VENV (all pins of requirements.txt installed)"
else
    say "installing requirements.txt into $VENV (torch from PyPI is a large download)"
    "$VENV/bin/python" -m pip install --disable-pip-version-check -q -r "$REQS" \
        || die "pip install -r $REQS failed"
    pins_ok || die "pins still not satisfied after pip install"
fi
PYV="$("$VENV/bin/python" -c 'import platform; print(platform.python_version())')"
case "$PYV" in 3.11.*) ;; *) say "warning: Python $PYV, the committed goldens used 3.11; provenance (and so hf.safetensors) will differ";; esac

# ---- record ----------------------------------------------------------------
# Everything on the CPU with one thread; no Hub access.
export CUDA_VISIBLE_DEVICES="" OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 PYTHONHASHSEED=0 PYTHONDONTWRITEBYTECODE=1
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# Start from empty outputs so no stale file from an earlier run survives.
rm -rf "$OUT/model" "$OUT/hf.safetensors"

say "building the model into $OUT/model"
"$VENV/bin/python" "$HERE/make_model.py" "$OUT/model" || die "make_model.py failed"
say "recording HF goldens into $OUT/hf.safetensors"
"$VENV/bin/python" "$HERE/record_hf.py" "$OUT/model" "$OUT/hf.safetensors" || die "record_hf.py failed"

# ---- compare with the committed files ---------------------------------------
FILES="model/config.json model/generation_config.json model/model.safetensors model/tokenizer.json model/tokenizer_config.json hf.safetensors"
sha() { if [ -f "$1" ]; then sha256sum "$1" | cut -d' ' -f1; else echo "(missing)"; fi; }
echo
printf '%-30s %-64s  %-64s  %s\n' file new committed same
differ=0
for f in $FILES; do
    new="$(sha "$OUT/$f")"
    old="$(sha "$COMMITTED/$f")"
    if [ "$new" = "$old" ]; then same=yes; else same=NO; differ=1; fi
    printf '%-30s %-64s  %-64s  %s\n' "$f" "$new" "$old" "$same"
done
echo
if [ "$differ" = 0 ]; then
    say "IDENTICAL: the regenerated files match goldens/qwen2-tiny byte for byte"
else
    say "DIFFERENT: the regenerated files do not match goldens/qwen2-tiny"
    say "review the change, then accept with: rm -rf '$COMMITTED' && mkdir -p '$COMMITTED' && cp -r '$OUT/model' '$OUT/hf.safetensors' '$COMMITTED/'"
    exit 1
fi
