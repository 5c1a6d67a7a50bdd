#!/usr/bin/env bash
# Regenerate the tiny models and every committed golden from scratch and
# compare them, byte for byte, with the committed ones:
#   goldens/{qwen2,llama,qwen3,phi3,gemma3}-tiny/: model/, hf.safetensors,
#     model.gguf, llamacpp.safetensors, oracle.safetensors (--dtype float64)
#   goldens/qwen2-tiny/long-hf.safetensors, long-oracle.safetensors (the
#     prompt of specs/qwen2-tiny-long.yaml), sampling-hf.safetensors and
#     sampling-oracle.safetensors (--sample-probs 0.7,40,0.9), and
#     tokens-{hf,llamacpp,oracle}.safetensors (the token-id prompt of
#     specs/qwen2-tiny-tokens.yaml)
#   the long-context models (issue 37; make_model.py --family llama3, yarn,
#     longrope, linear, dynamic, swa: long_context_families.py), goldens/
#     <family>-tiny/: the same files as the tiny models above, recorded on
#     the 30 prompt token ids LONG_TOKENS with 4 decode steps
#   the mixture-of-experts models (issue 38; make_model.py --family mixtral,
#     qwen2_moe, qwen3_moe, gpt_oss, deepseek_v3: moe_families.py), goldens/
#     <family>-tiny/: the same
#     files, recorded as the long-context models (LONG_TOKENS, 4 decode
#     steps), then check_moe_goldens.py (every reference chose the same
#     experts; every expert chosen in each prefill; mixtral's twin router
#     rows tie exactly and every reference gives the ties to expert 0)
#   goldens/qwen2.5-0.5b/ (and gemma3-270m/, gemma3-270m-neartie/): hf,
#     llamacpp and oracle .safetensors and the 16-bit HF goldens a spec
#     declares (hf-bf16, hf-f16), from the
#     prompt and `record:` of specs/qwen2.5-0.5b.yaml, when the real model's
#     GGUF is in $TOUCHSTONE_CACHE/models/ (ci/fetch_real_model.py puts it
#     there); skipped with a message otherwise.
#   next-token goldens (record_next_token.py): for specs/qwen2-tiny.yaml and
#     each real spec whose run_checks hold a `next_token` item, its
#     oracle, hf, hf-bf16, hf-f16 and llamacpp .safetensors into the item's
#     `goldens:` folder (goldens/<model>/next-token/), from its `prompts:` set;
#     skipped with a message for a spec without the item.
#   goldens/images/grid-112x168.png, grid-224x320.png (make_test_image.py) and
#     the vision-language models goldens/{qwen2-vl,qwen3-vl}-tiny/: model/
#     (make_vlm_model.py, preprocessor_config.json included), hf.safetensors
#     and oracle.safetensors (record_vlm.py, --dtype float64), on the prompt
#     VLM_PROMPT below with --chat, 4 decode steps, each with its image.
#   goldens/images/grid-56x56.png and the LLaVA models
#     (issue 39) goldens/{llava,llava-next}-tiny/: model/ (make_vlm_model.py
#     --family llava|llava-next, processor files included), hf.safetensors and
#     oracle.safetensors (record_vlm.py, --dtype float64) on LLAVA_PROMPT (no
#     chat template), 4 decode steps, then check_llava_goldens.py; for
#     llava-tiny also model.gguf, mmproj.gguf and llamacpp.safetensors
#     (record_llamacpp_llava.py convert / record, libmtmd).
#
# usage: goldens/recorders/regen.sh [OUT_DIR]     (from any directory)
#        REGEN_ONLY=vlm goldens/recorders/regen.sh [OUT_DIR]
#            only the images and the vision-language models, LLaVA's
#            included (no text model; libmtmd is built if missing),
#            compared the same way
#        REGEN_ONLY=reals goldens/recorders/regen.sh [OUT_DIR]
#            only the real models (each whose GGUF is cached)
#        REGEN_ONLY=long goldens/recorders/regen.sh [OUT_DIR]
#            only the long-context tiny models
#        REGEN_ONLY=moe goldens/recorders/regen.sh [OUT_DIR]
#            only the mixture-of-experts tiny models
#
#   OUT_DIR  where to write (default: $TOUCHSTONE_CACHE/regen), one subfolder
#            per model; a relative path is taken from the current directory.
#            Never inside goldens/: this script only proposes, a human accepts.
#
# Creates (or reuses) the virtual environment $TOUCHSTONE_CACHE/recorders-venv
# (the one `touchstone goldens regen` uses; TOUCHSTONE_CACHE defaults to
# ~/.cache/touchstone, outside the checkout) with the pinned packages of
# requirements.txt, and builds (or reuses) libllama from the pinned
# llama-cpp-python sdist (build_llamacpp.py; cache in
# $TOUCHSTONE_CACHE/llamacpp, or $TOUCHSTONE_LLAMACPP_CACHE). Set PYTHON to choose
# the interpreter that creates the venv (default python3; the goldens were
# recorded with 3.11, and the Python version is part of their provenance).
#
# Exit status: 0 all files identical to the committed ones (the real model's
# skipped if its GGUF is absent), 1 some differ or are not committed yet,
# 2 usage or environment error.
set -euo pipefail

die() { echo "regen.sh: error: $*" >&2; exit 2; }
say() { echo "regen.sh: $*"; }

[ $# -le 1 ] || die "usage: $0 [OUT_DIR]"
case "${1:-}" in -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0;; esac

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
CACHE="${TOUCHSTONE_CACHE:-$HOME/.cache/touchstone}"
VENV="$CACHE/recorders-venv"
REQS="$HERE/requirements.txt"
GOLDENS="$ROOT/goldens"
# model folder name -> make_model.py --family
MODELS="qwen2-tiny:qwen2 llama-tiny:llama qwen3-tiny:qwen3 phi3-tiny:phi3 gemma3-tiny:gemma3"
# The long-context models (issue 37), model folder name -> make_model.py
# --family, recorded on LONG_TOKENS with 4 decode steps: the passes reach
# 31 .. 34 positions and straddle 32, the boundary of every scaling
# (original_max_position_embeddings 32; dynamic's max_position_embeddings
# 32), and the prefill crosses swa-tiny's window of 8.
LONG_MODELS="llama3-tiny:llama3 yarn-tiny:yarn longrope-tiny:longrope linear-tiny:linear dynamic-tiny:dynamic swa-tiny:swa"
# The mixture-of-experts models (issue 38), model folder name -> make_model.py
# --family, recorded exactly as LONG_MODELS (LONG_TOKENS, 4 decode steps).
MOE_MODELS="mixtral-tiny:mixtral qwen2_moe-tiny:qwen2_moe qwen3_moe-tiny:qwen3_moe gpt_oss-tiny:gpt_oss
            deepseek_v3-tiny:deepseek_v3"
LONG_TOKENS=""  # (7 i + 3) mod 500 + 1 for i = 0 .. 29
for i in $(seq 0 29); do LONG_TOKENS="$LONG_TOKENS${LONG_TOKENS:+,}$(( (7 * i + 3) % 500 + 1 ))"; done

OUT="${1:-$CACHE/regen}"
[ -n "$OUT" ] || die "OUT_DIR is empty"
# Resolve to an absolute, normalised path before creating anything, so the
# committed goldens can be refused however they are spelled.
OUT="$(realpath -m -- "$OUT")" || die "cannot resolve OUT_DIR"
case "$OUT/" in
    "$GOLDENS/"*) die "OUT_DIR ($OUT) is or is inside goldens/; regenerate elsewhere and copy after review";;
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
    mkdir -p "$(dirname "$VENV")" || die "cannot create $(dirname "$VENV")"
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
PYBIN="$VENV/bin/python"

# The touchstone binary says what a compact golden records (`touchstone
# goldens args SPEC`: the spec's `record:` subset and the auxiliary stages
# its floors read), so this script records exactly what `touchstone goldens
# regen` does: $TOUCHSTONE, else this checkout's release build (built if absent).
TS="${TOUCHSTONE:-$ROOT/target/release/touchstone}"
if [ ! -x "$TS" ]; then
    say "building $TS (cargo build --release)"
    cargo build --release --quiet --manifest-path "$ROOT/Cargo.toml" || die "cargo build --release failed; set TOUCHSTONE=/path/to/touchstone"
fi
record_args() { "$TS" goldens args -0 "$1" || die "touchstone goldens args $1 failed"; }

# REGEN_ONLY=vlm: the images and the vision-language models only;
# REGEN_ONLY=reals: the real models only (their GGUFs cached);
# REGEN_ONLY=long: the long-context tiny models only;
# REGEN_ONLY=moe: the mixture-of-experts tiny models only.
ONLY="${REGEN_ONLY:-}"
case "$ONLY" in
    "") ;;
    vlm) say "REGEN_ONLY=vlm: the test images and the vision-language models only"
         MODELS="" LONG_MODELS="" MOE_MODELS="";;  # REALS is emptied where it is set, below
    reals) say "REGEN_ONLY=reals: the real models only"
         MODELS="" LONG_MODELS="" MOE_MODELS="";;
    long) say "REGEN_ONLY=long: the long-context tiny models only"
         MODELS="" MOE_MODELS="";;
    moe) say "REGEN_ONLY=moe: the mixture-of-experts tiny models only"
         MODELS="" LONG_MODELS="";;
    *) die "REGEN_ONLY=$ONLY: the values are 'vlm', 'reals', 'long' and 'moe'";;
esac

if [ "$ONLY" != vlm ]; then
    say "libllama from the pinned llama-cpp-python sdist (build_llamacpp.py; cached builds are reused)"
    LIBDIR="$("$PYBIN" "$HERE/build_llamacpp.py")" || die "build_llamacpp.py failed"
    say "libllama in $LIBDIR"
fi

FILES="model/config.json model/generation_config.json model/model.safetensors model/tokenizer.json model/tokenizer_config.json hf.safetensors model.gguf llamacpp.safetensors oracle.safetensors"
# Extra goldens per model folder (compared like FILES).
EXTRA_qwen2_tiny="long-hf.safetensors long-oracle.safetensors sampling-hf.safetensors sampling-oracle.safetensors
                  tokens-hf.safetensors tokens-llamacpp.safetensors tokens-oracle.safetensors"
# The real models: golden folder:spec, each recorded when its GGUF is cached.
REALS="qwen2.5-0.5b:qwen2.5-0.5b.yaml gemma3-270m:gemma3-270m.yaml gemma3-270m-neartie:gemma3-270m-neartie.yaml"
[ "$ONLY" != vlm ] && [ "$ONLY" != long ] && [ "$ONLY" != moe ] || REALS=""  # REGEN_ONLY=vlm, long, moe
REAL_FILES="hf.safetensors llamacpp.safetensors oracle.safetensors"
# A spec's next-token goldens (record_next_token.py), in its next_token folder.
NT_FILES="oracle.safetensors hf.safetensors hf-bf16.safetensors hf-f16.safetensors llamacpp.safetensors"

# Arguments from a spec, NUL-separated (a prompt may hold newlines):
#   prompt SPEC  -> --prompt TEXT [--chat] [--decode-steps N]
#   kv SPEC      -> [--kv-type f16] (llama.cpp's KV cache as the spec declares it)
#   next_token SPEC -> PROMPT_SET GOLDEN_FOLDER of its `next_token` run check (or nothing)
#   arithmetic SPEC -> llama.cpp's declared arithmetic as a JSON map (or nothing)
#   model SPEC   -> the model path (`cache:NAME` is $CACHE/models/NAME)
spec_args() {
    "$PYBIN" - "$1" "$2" "$CACHE" <<'PY'
import os, sys, yaml
what, path, cache = sys.argv[1], sys.argv[2], sys.argv[3]
spec = yaml.safe_load(open(path))
out = []
if what == "prompt":
    p = spec["prompt"]
    if "tokens" in p:
        out += ["--prompt-tokens", ",".join(str(t) for t in p["tokens"])]
    else:
        out += ["--prompt", p["text"]]
    if p.get("chat"):
        out.append("--chat")
    if "decode_steps" in p:
        out += ["--decode-steps", str(p["decode_steps"])]
elif what == "kv":
    # llama.cpp's KV cache as the spec's declared arithmetic says (as
    # `touchstone goldens regen` passes it).
    a = ((spec.get("scaled") or {}).get("arithmetic") or {}).get("llama.cpp")
    if isinstance(a, dict) and a.get("kv") == "f16":
        out += ["--kv-type", "f16"]
elif what == "next_token":
    # The spec's `next_token` run check: its prompt set and golden folder,
    # relative to the spec's folder (nothing when the spec has none).
    for item in spec.get("run_checks") or []:
        if isinstance(item, dict) and "next_token" in item:
            nt = item["next_token"] or {}
            base = os.path.dirname(os.path.abspath(path))
            out += [os.path.normpath(os.path.join(base, nt["prompts"])),
                    os.path.normpath(os.path.join(base, nt["goldens"]))]
            break
elif what == "arithmetic":
    # llama.cpp's arithmetic as the spec declares it, as a JSON map (a name
    # expanded as touchstone reads it: f32/f16/bf16 a storage, q8_0/q8_k
    # f32 storage with 8-bit activations); nothing when undeclared.
    import json
    a = ((spec.get("scaled") or {}).get("arithmetic") or {}).get("llama.cpp")
    if isinstance(a, str):
        a = {"storage": "f32", "activations": a} if a in ("q8_0", "q8_k") else {"storage": a}
    if isinstance(a, dict):
        out.append(json.dumps(a, sort_keys=True, separators=(",", ":")))
elif what == "halves":
    # The 16-bit HF goldens the spec declares: DTYPE FILE pairs.
    for src, dt in (("hf-bf16", "bfloat16"), ("hf-f16", "float16")):
        g = (spec.get("goldens") or {}).get(src)
        if g:
            out += [dt, os.path.basename(g)]
elif what == "model":
    m = spec["model"]
    out.append(os.path.join(cache, "models", m[len("cache:"):]) if m.startswith("cache:")
               else os.path.normpath(os.path.join(os.path.dirname(path), m)))
sys.stdout.write("".join(a + "\0" for a in out))
PY
}

# Next-token goldens (record_next_token.py) of one spec's `next_token` run
# check: SPEC, the HF model (folder or GGUF), the GGUF llama.cpp runs. The
# files go to $OUT/<the item's golden folder relative to goldens/>.
NT_DONE=""
record_next_token() {
    local spec="$1" model="$2" gguf="$3" rel out
    local -a NT NK NA
    mapfile -d '' NT < <(spec_args next_token "$spec")
    if [ -z "${NT[0]:-}" ]; then
        say "[${spec##*/}] no next_token run check: next-token goldens skipped"
        return 0
    fi
    [ -f "${NT[0]}" ] || die "${spec##*/}: next_token prompt set ${NT[0]} does not exist"
    rel="${NT[1]#"$GOLDENS"/}"
    [ "$rel" != "${NT[1]}" ] || die "${spec##*/}: next_token goldens ${NT[1]} are not inside $GOLDENS"
    out="$OUT/$rel"
    mkdir -p "$out" || die "cannot create $out"
    rm -f "$out"/*.safetensors
    mapfile -d '' NK < <(spec_args kv "$spec")
    mapfile -d '' NA < <(spec_args arithmetic "$spec")
    local -a P=(--prompts "${NT[0]}")
    say "[$rel] recording next-token goldens (prompt set ${NT[0]#"$ROOT"/}) into $out"
    "$PYBIN" "$HERE/record_next_token.py" "$model" "$out/oracle.safetensors" "${P[@]}" --source oracle \
        >/dev/null || die "record_next_token.py --source oracle ($rel) failed"
    "$PYBIN" "$HERE/record_next_token.py" "$model" "$out/hf.safetensors" "${P[@]}" --source hf \
        --oracle "$out/oracle.safetensors" >/dev/null || die "record_next_token.py --source hf ($rel) failed"
    for half in bf16 f16; do
        "$PYBIN" "$HERE/record_next_token.py" "$model" "$out/hf-$half.safetensors" "${P[@]}" --source "hf-$half" \
            --tokens-from "$out/hf.safetensors" --oracle "$out/oracle.safetensors" >/dev/null \
            || die "record_next_token.py --source hf-$half ($rel) failed"
    done
    "$PYBIN" "$HERE/record_next_token.py" "$gguf" "$out/llamacpp.safetensors" "${P[@]}" --source llama.cpp \
        "${NK[@]}" ${NA[0]:+--arithmetic "${NA[0]}"} --tokens-from "$out/hf.safetensors" \
        --oracle "$out/oracle.safetensors" >/dev/null || die "record_next_token.py --source llama.cpp ($rel) failed"
    NT_DONE="$NT_DONE $rel"
}

for m in $MODELS; do
    name="${m%%:*}" family="${m##*:}"
    dir="$OUT/$name"
    mkdir -p "$dir" || die "cannot create $dir"
    # Start from empty outputs so no stale file from an earlier run survives.
    rm -rf "$dir/model" "$dir"/*.safetensors "$dir/model.gguf"
    say "[$name] building the model into $dir/model"
    "$PYBIN" "$HERE/make_model.py" "$dir/model" --family "$family" >/dev/null || die "make_model.py failed"
    say "[$name] recording HF goldens into $dir/hf.safetensors"
    "$PYBIN" "$HERE/record_hf.py" "$dir/model" "$dir/hf.safetensors" >/dev/null || die "record_hf.py failed"
    say "[$name] recording the float64 oracle into $dir/oracle.safetensors"
    "$PYBIN" "$HERE/record_hf.py" "$dir/model" "$dir/oracle.safetensors" --dtype float64 >/dev/null \
        || die "record_hf.py --dtype float64 failed"
    say "[$name] converting to $dir/model.gguf"
    "$PYBIN" "$HERE/convert_gguf.py" "$dir/model" "$dir/model.gguf" >/dev/null 2>&1 || die "convert_gguf.py failed"
    say "[$name] recording llama.cpp goldens into $dir/llamacpp.safetensors"
    "$PYBIN" "$HERE/record_llamacpp.py" "$dir/model.gguf" "$dir/llamacpp.safetensors" \
        --hf-golden "$dir/hf.safetensors" >/dev/null || die "record_llamacpp.py failed"
done

# The long-context models: as the tiny models above, on LONG_TOKENS with 4
# decode steps (each step one forward on the model as loaded, so HF's
# per-forward dynamic/LongRoPE tables are recorded step by step; llama.cpp
# as it is, its differences named in the provenance: record_llamacpp.py).
# The mixture-of-experts models the same way.
for m in $LONG_MODELS $MOE_MODELS; do
    name="${m%%:*}" family="${m##*:}"
    dir="$OUT/$name"
    mkdir -p "$dir" || die "cannot create $dir"
    rm -rf "$dir/model" "$dir"/*.safetensors "$dir/model.gguf"
    say "[$name] building the model into $dir/model"
    "$PYBIN" "$HERE/make_model.py" "$dir/model" --family "$family" >/dev/null || die "make_model.py --family $family failed"
    for kind in hf oracle; do
        dt=float32; [ "$kind" = oracle ] && dt=float64
        say "[$name] recording $dir/$kind.safetensors ($dt)"
        "$PYBIN" "$HERE/record_hf.py" "$dir/model" "$dir/$kind.safetensors" --prompt-tokens "$LONG_TOKENS" \
            --decode-steps 4 --dtype "$dt" >/dev/null || die "record_hf.py ($name, $dt) failed"
    done
    say "[$name] converting to $dir/model.gguf"
    "$PYBIN" "$HERE/convert_gguf.py" "$dir/model" "$dir/model.gguf" >/dev/null 2>&1 || die "convert_gguf.py ($name) failed"
    say "[$name] recording llama.cpp goldens into $dir/llamacpp.safetensors"
    "$PYBIN" "$HERE/record_llamacpp.py" "$dir/model.gguf" "$dir/llamacpp.safetensors" \
        --hf-golden "$dir/hf.safetensors" >/dev/null || die "record_llamacpp.py ($name) failed"
done

# The MoE goldens agree on every routing choice, and every expert is chosen.
MOE_DIRS=""
for m in $MOE_MODELS; do MOE_DIRS="$MOE_DIRS $OUT/${m%%:*}"; done
if [ -n "$MOE_DIRS" ]; then
    say "checking the MoE goldens' routing (check_moe_goldens.py)"
    # shellcheck disable=SC2086
    "$PYBIN" "$HERE/check_moe_goldens.py" $MOE_DIRS || die "check_moe_goldens.py: the references' routing differs"
fi

if [ -z "$ONLY" ]; then
# qwen2-tiny, long prompt (specs/qwen2-tiny-long.yaml's text): compact, and
# the [H,T,S] scores at decode2 only (the prefill's, 348x348 per head, would
# make the file about 4 MB).
dir="$OUT/qwen2-tiny"
mapfile -d '' LONG_PROMPT < <(spec_args prompt "$ROOT/specs/qwen2-tiny-long.yaml")
[ "${LONG_PROMPT[0]:-}" = --prompt ] || die "cannot read the prompt of specs/qwen2-tiny-long.yaml"
mapfile -d '' LONG_ARGS < <(record_args "$ROOT/specs/qwen2-tiny-long.yaml")
for kind in hf oracle; do
    dt=float32; [ "$kind" = oracle ] && dt=float64
    say "[qwen2-tiny] recording the long-prompt golden into $dir/long-$kind.safetensors ($dt)"
    "$PYBIN" "$HERE/record_hf.py" "$dir/model" "$dir/long-$kind.safetensors" "${LONG_PROMPT[@]}" \
        "${LONG_ARGS[@]}" --dtype "$dt" >/dev/null || die "record_hf.py (long, $dt) failed"
done
mapfile -d '' SAMPLING_ARGS < <(record_args "$ROOT/specs/qwen2-tiny-sampling.yaml")
for kind in hf oracle; do
    dt=float32; [ "$kind" = oracle ] && dt=float64
    say "[qwen2-tiny] recording the sampling golden into $dir/sampling-$kind.safetensors ($dt)"
    "$PYBIN" "$HERE/record_hf.py" "$dir/model" "$dir/sampling-$kind.safetensors" --decode-steps 3 \
        --sample-probs 0.7,40,0.9 "${SAMPLING_ARGS[@]}" --dtype "$dt" >/dev/null \
        || die "record_hf.py --sample-probs ($dt) failed"
done
# qwen2-tiny on a prompt given as token ids (specs/qwen2-tiny-tokens.yaml).
mapfile -d '' TOKENS_PROMPT < <(spec_args prompt "$ROOT/specs/qwen2-tiny-tokens.yaml")
[ "${TOKENS_PROMPT[0]:-}" = --prompt-tokens ] || die "cannot read the tokens of specs/qwen2-tiny-tokens.yaml"
for kind in hf oracle; do
    dt=float32; [ "$kind" = oracle ] && dt=float64
    say "[qwen2-tiny] recording the token-prompt golden into $dir/tokens-$kind.safetensors ($dt)"
    "$PYBIN" "$HERE/record_hf.py" "$dir/model" "$dir/tokens-$kind.safetensors" "${TOKENS_PROMPT[@]}" \
        --dtype "$dt" >/dev/null || die "record_hf.py (tokens, $dt) failed"
done
say "[qwen2-tiny] recording the token-prompt llama.cpp golden into $dir/tokens-llamacpp.safetensors"
"$PYBIN" "$HERE/record_llamacpp.py" "$dir/model.gguf" "$dir/tokens-llamacpp.safetensors" \
    --hf-golden "$dir/tokens-hf.safetensors" >/dev/null || die "record_llamacpp.py (tokens) failed"
# qwen2-tiny's next-token goldens (specs/qwen2-tiny.yaml's next_token check),
# from the model and GGUF built above.
record_next_token "$ROOT/specs/qwen2-tiny.yaml" "$dir/model" "$dir/model.gguf"
fi

# The real models (specs/qwen2.5-0.5b.yaml, specs/gemma3-270m.yaml), each when
# its GGUF is cached.
REALS_DONE=""
for r in $REALS; do
    REAL="${r%%:*}"
    REAL_SPEC="$ROOT/specs/${r#*:}"
    mapfile -d '' REAL_MODEL < <(spec_args model "$REAL_SPEC")
    [ -n "${REAL_MODEL[0]:-}" ] || die "cannot read the model of $REAL_SPEC"
    if [ ! -f "${REAL_MODEL[0]}" ]; then
        say "[$REAL] skipped: ${REAL_MODEL[0]} is not there (python3 ci/fetch_real_model.py caches it)"
        continue
    fi
    dir="$OUT/$REAL"
    mkdir -p "$dir" || die "cannot create $dir"
    rm -f "$dir"/*.safetensors
    mapfile -d '' RP < <(spec_args prompt "$REAL_SPEC")
    mapfile -d '' RR < <(record_args "$REAL_SPEC")
    mapfile -d '' RK < <(spec_args kv "$REAL_SPEC")
    case "${RP[0]:-}" in --prompt|--prompt-tokens) ;; *) die "cannot read the prompt of $REAL_SPEC";; esac
    say "[$REAL] recording HF goldens from ${REAL_MODEL[0]} into $dir/hf.safetensors (minutes)"
    "$PYBIN" "$HERE/record_hf.py" "${REAL_MODEL[0]}" "$dir/hf.safetensors" "${RP[@]}" "${RR[@]}" >/dev/null \
        || die "record_hf.py ($REAL) failed"
    say "[$REAL] recording the float64 oracle into $dir/oracle.safetensors (minutes)"
    "$PYBIN" "$HERE/record_hf.py" "${REAL_MODEL[0]}" "$dir/oracle.safetensors" "${RP[@]}" "${RR[@]}" \
        --dtype float64 >/dev/null || die "record_hf.py --dtype float64 ($REAL) failed"
    say "[$REAL] recording llama.cpp goldens into $dir/llamacpp.safetensors"
    "$PYBIN" "$HERE/record_llamacpp.py" "${REAL_MODEL[0]}" "$dir/llamacpp.safetensors" \
        --hf-golden "$dir/hf.safetensors" "${RR[@]}" "${RK[@]}" >/dev/null || die "record_llamacpp.py ($REAL) failed"
    # The spec's 16-bit HF goldens (hf-bf16, hf-f16): the same weights cast, fed
    # the HF golden's tokens, told the oracle (where one overflows, its
    # provenance gives the oracle's magnitude there), as `goldens regen` records them.
    mapfile -d '' RH < <(spec_args halves "$REAL_SPEC")
    REAL_MORE=""
    for ((i = 0; i < ${#RH[@]}; i += 2)); do
        say "[$REAL] recording the ${RH[i]} HF golden into $dir/${RH[i+1]}"
        "$PYBIN" "$HERE/record_hf.py" "${REAL_MODEL[0]}" "$dir/${RH[i+1]}" --dtype "${RH[i]}" \
            --tokens-from "$dir/hf.safetensors" "${RR[@]}" --oracle "$dir/oracle.safetensors" >/dev/null \
            || die "record_hf.py --dtype ${RH[i]} ($REAL) failed"
        REAL_MORE="$REAL_MORE ${RH[i+1]}"
    done
    eval "MORE_${REAL//[.-]/_}=\"\$REAL_MORE\""
    record_next_token "$REAL_SPEC" "${REAL_MODEL[0]}" "${REAL_MODEL[0]}"
    REALS_DONE="$REALS_DONE $REAL"
done

# ---- vision-language models (issue 24) -------------------------------------
# The test images (make_test_image.py), then per model: the tiny model
# (make_vlm_model.py), the HF golden and the float64 oracle (record_vlm.py)
# on VLM_PROMPT with --chat and 4 decode steps, fed the regenerated image.
# model folder name : make_vlm_model.py --family : image
VLM_MODELS="qwen2-vl-tiny:qwen2-vl:grid-112x168.png qwen3-vl-tiny:qwen3-vl:grid-224x320.png"
VLM_PROMPT='<|vision_start|><|image_pad|><|vision_end|>Describe the picture in one word.'
VLM_FILES="model/config.json model/generation_config.json model/model.safetensors model/preprocessor_config.json model/tokenizer.json model/tokenizer_config.json hf.safetensors oracle.safetensors model.gguf mmproj.gguf llamacpp.safetensors"
IMAGES="grid-112x168.png grid-224x320.png grid-56x56.png"
# The LLaVA models (issue 39): model folder name : make_vlm_model.py --family : image.
# Recorded by HF (LLAVA_FILES), and llava-tiny by llama.cpp too (LLAVA_LLAMACPP: LLAVA_LC_FILES);
# LLaVA-1.5's conversation as plain text, no chat template.
LLAVA_MODELS="llava-tiny:llava:grid-56x56.png llava-next-tiny:llava-next:grid-56x56.png"
LLAVA_PROMPT=$'USER: <image>\nWhat is in the picture? ASSISTANT:'
LLAVA_FILES="model/config.json model/generation_config.json model/model.safetensors model/preprocessor_config.json model/processor_config.json model/tokenizer.json model/tokenizer_config.json hf.safetensors oracle.safetensors"
LLAVA_LLAMACPP="llava-tiny"
LLAVA_LC_FILES="model.gguf mmproj.gguf llamacpp.safetensors"
[ "$ONLY" != reals ] && [ "$ONLY" != long ] && [ "$ONLY" != moe ] || { VLM_MODELS=""; IMAGES=""; LLAVA_MODELS=""; }  # REGEN_ONLY=reals, long, moe
if [ -n "$IMAGES" ]; then
    say "[images] writing the test images into $OUT/images"
    rm -rf "$OUT/images"
    "$PYBIN" "$HERE/make_test_image.py" "$OUT/images" >/dev/null || die "make_test_image.py failed"
fi
for m in $VLM_MODELS; do
    IFS=: read -r name family image <<<"$m"
    dir="$OUT/$name"
    mkdir -p "$dir" || die "cannot create $dir"
    rm -rf "$dir/model" "$dir"/*.safetensors "$dir"/*.gguf
    say "[$name] building the model into $dir/model"
    "$PYBIN" "$HERE/make_vlm_model.py" "$dir/model" --family "$family" >/dev/null || die "make_vlm_model.py failed"
    for kind in hf oracle; do
        dt=float32; [ "$kind" = oracle ] && dt=float64
        say "[$name] recording $dir/$kind.safetensors ($dt, image $image)"
        "$PYBIN" "$HERE/record_vlm.py" "$dir/model" "$dir/$kind.safetensors" --prompt "$VLM_PROMPT" --chat \
            --image "$OUT/images/$image" --decode-steps 4 --dtype "$dt" >/dev/null || die "record_vlm.py ($name, $dt) failed"
    done
    # llama.cpp (libmtmd, build_llamacpp.py --mtmd): the language model and the
    # mmproj GGUF (convert_gguf.py, --mmproj), then record_llamacpp_vlm.py fed
    # the HF golden's tokens.
    say "[$name] converting to $dir/model.gguf and $dir/mmproj.gguf"
    "$PYBIN" "$HERE/convert_gguf.py" "$dir/model" "$dir/model.gguf" >/dev/null 2>&1 || die "convert_gguf.py ($name) failed"
    "$PYBIN" "$HERE/convert_gguf.py" "$dir/model" "$dir/mmproj.gguf" --mmproj >/dev/null 2>&1 \
        || die "convert_gguf.py --mmproj ($name) failed"
    say "[$name] recording llama.cpp goldens into $dir/llamacpp.safetensors"
    "$PYBIN" "$HERE/record_llamacpp_vlm.py" "$dir/model.gguf" "$dir/mmproj.gguf" "$dir/llamacpp.safetensors" \
        --hf-golden "$dir/hf.safetensors" --image "$OUT/images/$image" >/dev/null \
        || die "record_llamacpp_vlm.py ($name) failed"
done
LLAVA_DIRS=""
for m in $LLAVA_MODELS; do
    IFS=: read -r name family image <<<"$m"
    dir="$OUT/$name"
    mkdir -p "$dir" || die "cannot create $dir"
    rm -rf "$dir/model" "$dir"/*.safetensors "$dir"/*.gguf
    say "[$name] building the model into $dir/model"
    "$PYBIN" "$HERE/make_vlm_model.py" "$dir/model" --family "$family" >/dev/null || die "make_vlm_model.py failed"
    for kind in hf oracle; do
        dt=float32; [ "$kind" = oracle ] && dt=float64
        say "[$name] recording $dir/$kind.safetensors ($dt, image $image)"
        "$PYBIN" "$HERE/record_vlm.py" "$dir/model" "$dir/$kind.safetensors" --prompt "$LLAVA_PROMPT" \
            --image "$OUT/images/$image" --decode-steps 4 --dtype "$dt" >/dev/null || die "record_vlm.py ($name, $dt) failed"
    done
    case " $LLAVA_LLAMACPP " in *" $name "*)
        # llama.cpp (libmtmd): the Llama LM and the CLIP mmproj (f32), then the
        # golden fed the HF golden's tokens (record_llamacpp_llava.py).
        say "[$name] converting to $dir/model.gguf and $dir/mmproj.gguf"
        "$PYBIN" "$HERE/record_llamacpp_llava.py" convert "$dir/model" "$dir" >/dev/null 2>&1 \
            || die "record_llamacpp_llava.py convert ($name) failed"
        say "[$name] recording llama.cpp goldens into $dir/llamacpp.safetensors"
        "$PYBIN" "$HERE/record_llamacpp_llava.py" record "$dir/model.gguf" "$dir/mmproj.gguf" \
            "$dir/llamacpp.safetensors" --hf-golden "$dir/hf.safetensors" --image "$OUT/images/$image" \
            --oracle "$dir/oracle.safetensors" >/dev/null || die "record_llamacpp_llava.py record ($name) failed";;
    esac
    LLAVA_DIRS="$LLAVA_DIRS $dir"
done
if [ -n "$LLAVA_DIRS" ]; then
    say "check_llava_goldens.py on the LLaVA goldens"
    # shellcheck disable=SC2086
    "$PYBIN" "$HERE/check_llava_goldens.py" $LLAVA_DIRS >/dev/null || die "check_llava_goldens.py failed"
fi

# ---- compare with the committed files ---------------------------------------
sha() { if [ -f "$1" ]; then sha256sum "$1" | cut -d' ' -f1; else echo "(missing)"; fi; }
differ=0
compare_list() {  # model folder name, then its files
    local name="$1"; shift
    echo
    printf '%-42s %-64s  %-64s  %s\n' "file" new committed same
    for f in "$@"; do
        new="$(sha "$OUT/$name/$f")"
        old="$(sha "$GOLDENS/$name/$f")"
        if [ "$new" = "$old" ]; then same=yes; else same=NO; differ=1; fi
        printf '%-42s %-64s  %-64s  %s\n' "$name/$f" "$new" "$old" "$same"
    done
}
for m in $MODELS; do
    name="${m%%:*}"
    extra_var="EXTRA_${name//-/_}"
    # shellcheck disable=SC2086
    compare_list "$name" $FILES ${!extra_var:-}
done
for m in $LONG_MODELS $MOE_MODELS; do
    # shellcheck disable=SC2086
    compare_list "${m%%:*}" $FILES
done
# shellcheck disable=SC2086
for REAL in $REALS_DONE; do
    more="MORE_${REAL//[.-]/_}"
    # shellcheck disable=SC2086
    compare_list "$REAL" $REAL_FILES ${!more:-}
done
for rel in $NT_DONE; do
    # shellcheck disable=SC2086
    compare_list "$rel" $NT_FILES
done
# shellcheck disable=SC2086
compare_list images $IMAGES
for m in $VLM_MODELS; do
    # shellcheck disable=SC2086
    compare_list "${m%%:*}" $VLM_FILES
done
for m in $LLAVA_MODELS; do
    more=""; case " $LLAVA_LLAMACPP " in *" ${m%%:*} "*) more="$LLAVA_LC_FILES";; esac
    # shellcheck disable=SC2086
    compare_list "${m%%:*}" $LLAVA_FILES $more
done
echo
if [ "$differ" = 0 ]; then
    say "IDENTICAL: the regenerated files match goldens/ byte for byte"
else
    say "DIFFERENT: the regenerated files do not match goldens/"
    say "review the change (compare_sources.py OLD NEW shows per-stage differences), then accept per model with:"
    for m in $MODELS $LONG_MODELS $MOE_MODELS; do
        name="${m%%:*}"
        # Keep the folder's next-token goldens (a subfolder, accepted below).
        say "  mkdir -p '$GOLDENS/$name' && find '$GOLDENS/$name' -mindepth 1 -maxdepth 1 ! -name next-token -exec rm -rf {} + && cp -r '$OUT/$name/model' '$OUT/$name/model.gguf' '$OUT/$name/'*.safetensors '$GOLDENS/$name/'"
    done
    for REAL in $REALS_DONE; do
        say "  cp '$OUT/$REAL/'*.safetensors '$GOLDENS/$REAL/'"
    done
    say "  mkdir -p '$GOLDENS/images' && cp '$OUT/images/'*.png '$GOLDENS/images/'"
    for m in $VLM_MODELS; do
        name="${m%%:*}"
        say "  rm -rf '$GOLDENS/$name' && mkdir -p '$GOLDENS/$name' && cp -r '$OUT/$name/model' '$OUT/$name/'*.safetensors '$OUT/$name/'*.gguf '$GOLDENS/$name/'"
    done
    for m in $LLAVA_MODELS; do
        name="${m%%:*}"
        gg=""; case " $LLAVA_LLAMACPP " in *" $name "*) gg=" '$OUT/$name/'*.gguf";; esac
        say "  rm -rf '$GOLDENS/$name' && mkdir -p '$GOLDENS/$name' && cp -r '$OUT/$name/model' '$OUT/$name/'*.safetensors$gg '$GOLDENS/$name/'"
    done
    for rel in $NT_DONE; do
        say "  mkdir -p '$GOLDENS/$rel' && cp '$OUT/$rel/'*.safetensors '$GOLDENS/$rel/'"
    done
    exit 1
fi
