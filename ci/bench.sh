#!/usr/bin/env bash
# Benchmarks against peers: touchstone's CPU engine against llama.cpp (CPU)
# and HF transformers at the Qwen2.5-0.5B shape, touchstone's comparator
# against numpy and torch, all interleaved in one run, with the machine's
# memory read bandwidth beside them as the limit. Prints medians and ratios;
# --out FILE keeps every record as JSON. NOT part of CI: the peers take
# minutes to build and the numbers need a quiet machine.
#
# usage: ci/bench.sh [--reps R] [--threads T] [--skip-hf] [--skip-llamacpp] [--skip-compare]
#                    [--quick] [--setup] [--llamacpp-build native|portable] [--out FILE]
#                    [--prompt-tokens N] [--decode N] [--compare-mib M] [--bandwidth-mib M] [--timeout S]
#
#   --reps R        rounds (default 5); each round runs every peer once, in an order rotated per round
#   --threads T     threads for every peer (default 2)
#   --quick         test this script: the committed tiny qwen2 model, 1 round, small sizes (under a minute)
#   --setup         create the Python environment / build libllama when missing, instead of stopping or skipping
#   --out FILE      write every record and the summary as JSON
#
# Needs: the recorders' Python environment ($TOUCHSTONE_CACHE/recorders-venv,
# made by goldens/recorders/regen.sh or by --setup: torch, transformers, numpy,
# the pinned cmake), and for the llama.cpp peer libllama built with
# `goldens/recorders/build_llamacpp.py --native` (7-11 minutes on 2 cores;
# --setup builds it; without it the llama.cpp peer is skipped with that
# message). Caches, never in the checkout: $TOUCHSTONE_CACHE/bench (the
# random-weights model, 2 GB as safetensors + 2 GB as GGUF; the comparator's
# data, 2 x 256 MiB) and $TOUCHSTONE_CACHE/llamacpp (libllama).
# A full run takes 3 minutes on a quiet 2-core machine (5.5 beside a cargo build), plus about 30 s the
# first time (model and data).
#
# Exit status: 0 every measurement ran, 1 a peer failed (the others' results are still printed), 2 setup missing.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CACHE="${TOUCHSTONE_CACHE:-$HOME/.cache/touchstone}"
VENV="$CACHE/recorders-venv"
REQS="$ROOT/goldens/recorders/requirements.txt"

die() { echo "bench.sh: error: $*" >&2; exit 2; }
say() { echo "bench.sh: $*" >&2; }

SETUP=0
for a in "$@"; do
    case "$a" in
        -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0;;
        --setup) SETUP=1;;
    esac
done

# ---- the Python environment (the recorders'; see goldens/recorders/regen.sh) ----
imports_ok() { "$VENV/bin/python" -c 'import numpy, torch, transformers, safetensors, tokenizers, yaml, tqdm' 2>/dev/null; }
if [ ! -x "$VENV/bin/python" ]; then
    [ "$SETUP" = 1 ] || die "no Python environment at $VENV. Make it with goldens/recorders/regen.sh (it also regenerates goldens), or rerun with --setup (python3 -m venv + pip install -r goldens/recorders/requirements.txt; torch is a large download)"
    PY="${PYTHON:-python3}"
    command -v "$PY" >/dev/null || die "no '$PY' on PATH to create $VENV; set PYTHON=/path/to/python3.11"
    say "creating $VENV with $("$PY" -V 2>&1)"
    mkdir -p "$(dirname "$VENV")"
    "$PY" -m venv "$VENV" || die "could not create $VENV (is the venv module installed?)"
fi
if ! imports_ok; then
    [ "$SETUP" = 1 ] || die "$VENV lacks packages the peers import (numpy, torch, transformers, ...): rerun with --setup, or: $VENV/bin/python -m pip install -r $REQS"
    say "installing $REQS into $VENV (torch is a large download)"
    "$VENV/bin/python" -m pip install --disable-pip-version-check -q -r "$REQS" || die "pip install -r $REQS failed"
    imports_ok || die "packages still missing after pip install"
fi

# ---- touchstone itself ------------------------------------------------------
say "building touchstone (cargo build --release)"
(cd "$ROOT" && cargo build --release --quiet) || die "cargo build --release failed"
BIN="${CARGO_TARGET_DIR:-$ROOT/target}/release/touchstone"
[ -x "$BIN" ] || die "no binary at $BIN after cargo build"

export TOUCHSTONE_CACHE="$CACHE" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONDONTWRITEBYTECODE=1
exec "$VENV/bin/python" "$ROOT/ci/bench/driver.py" --touchstone "$BIN" "$@"
