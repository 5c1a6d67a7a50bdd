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
cargo run --release --locked --quiet --bin touchstone -- kernels --arch sm_90 --arch sm_80
cargo test --release --locked --quiet --test kernels
# Without ptxas the check cannot see registers or spills: it must fail rather
# than print "kernels: ok", unless --ptx-only says PTX is all that is wanted.
NO_PTXAS_PATH=$(echo "$PATH" | tr ':' '\n' | grep -v "^$CU/bin$" | paste -sd: -)
if PATH="$NO_PTXAS_PATH" cargo run --release --locked --quiet --bin touchstone -- kernels --arch sm_90 > /tmp/touchstone-no-ptxas.$$ 2>&1; then
    echo "kernels.sh: FAIL: 'touchstone kernels' without ptxas exited 0"; cat /tmp/touchstone-no-ptxas.$$; rm -f /tmp/touchstone-no-ptxas.$$; exit 1
fi
grep -q "NOT checked" /tmp/touchstone-no-ptxas.$$ || { echo "kernels.sh: FAIL: no 'NOT checked' message"; cat /tmp/touchstone-no-ptxas.$$; exit 1; }
PATH="$NO_PTXAS_PATH" cargo run --release --locked --quiet --bin touchstone -- kernels --arch sm_90 --ptx-only > /tmp/touchstone-no-ptxas.$$ 2>&1 \
    || { echo "kernels.sh: FAIL: --ptx-only without ptxas did not pass"; cat /tmp/touchstone-no-ptxas.$$; rm -f /tmp/touchstone-no-ptxas.$$; exit 1; }
rm -f /tmp/touchstone-no-ptxas.$$
echo "kernels.sh: without ptxas the check fails (exit 1) and --ptx-only passes, as it should"
