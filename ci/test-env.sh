# Sourced by ci/test.sh and ci/nextest.sh (from the checkout's root): what the
# tests need besides Rust. numpy, pinned as the recorders pin it, into
# .cache/protocol-py for the protocol reference engines; the real model into
# touchstone's cache (its trials are reported ignored with the reason if it
# cannot be fetched); the fuzz targets' fixed number of executions.
NUMPY_PIN="$(grep -E '^numpy==' goldens/recorders/requirements.txt)"
PYDEPS="$PWD/.cache/protocol-py"
if ! PYTHONPATH="$PYDEPS" python3 -c "import numpy, sys; sys.exit(numpy.__version__ != '${NUMPY_PIN#numpy==}')" 2>/dev/null; then
    python3 -m pip install --quiet --disable-pip-version-check --root-user-action ignore --target "$PYDEPS" "$NUMPY_PIN"
fi
export PYTHONPATH="$PYDEPS${PYTHONPATH:+:$PYTHONPATH}"
if ! python3 ci/fetch_real_model.py >/dev/null; then
    echo "test.sh: the real model could not be fetched; its trials will be reported ignored" >&2
fi
# The fuzz targets (tests/fuzz.rs) run a fixed number of executions each.
export BOLERO_RANDOM_ITERATIONS="${BOLERO_RANDOM_ITERATIONS:-20000}" BOLERO_RANDOM_TEST_TIME_MS=600000
