#!/usr/bin/env bash
# The project's test command (README "Run the tests"); .ci/run calls exactly this.
# Needs only the Rust toolchain: goldens are committed, Python is never used here.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo test --locked "$@"
