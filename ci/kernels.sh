#!/usr/bin/env bash
# The kernel check (no GPU needed): installs the pinned CUDA 13.0 NVRTC/ptxas
# wheels into .cache/cuda-wheels (outside git, reused when present), then
# compiles every kernel in cuda/ with NVRTC for sm_90 and sm_80, runs ptxas -v
# on the PTX (fails on a compile error or any spill), and runs the
# `kernels::<file>::<kernel>::<arch>` trials with NVRTC loadable.
# Pinned to 13.0.x: driver 580 (CUDA 13.0) loads PTX ISA <= 9.0; newer NVRTC
# emits PTX it refuses.
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=.cache/cuda-wheels
PINS="nvidia-cuda-nvrtc==13.0.88 nvidia-cuda-nvcc==13.0.88 nvidia-cuda-runtime==13.0.96"
STAMP="$WHEELS/.pins"
if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$PINS" ]; then
    rm -rf "$WHEELS"
    # One pip call: a second --target install would replace the nvidia/ tree.
    # shellcheck disable=SC2086
    python3 -m pip install --quiet --disable-pip-version-check --no-deps --target "$WHEELS" $PINS
    find "$WHEELS" -name '*.alt.*' -delete
    echo "$PINS" > "$STAMP"
fi
CU="$PWD/$WHEELS/nvidia/cu13"
export LD_LIBRARY_PATH="$CU/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export PATH="$CU/bin:$PATH"
cargo run --locked --quiet --bin touchstone -- kernels --arch sm_90 --arch sm_80
cargo test --locked --quiet --test kernels
