#!/usr/bin/env bash
# The project's test command (README "Run the tests"); .ci/run calls exactly this.
# Goldens are committed and Python never runs the tests; the kernel check
# (ci/kernels.sh) uses pip once to fetch the pinned NVRTC/ptxas wheels into
# .cache/cuda-wheels, then proves every CUDA kernel compiles with 0 spills.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo test --locked "$@"
bash ci/kernels.sh
