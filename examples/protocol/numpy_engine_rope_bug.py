#!/usr/bin/env python3
"""numpy-ref with a planted bug, for showing what touchstone reports.

    touchstone run SPEC --engine "exec:python3 examples/protocol/numpy_engine_rope_bug.py"

Identical to numpy_engine.py (same protocol, same arithmetic) except that
RoPE is NOT applied in decode steps: the prefill is right, and every decode
step's q_rope/k_rope equal q/k (the rotation for position 0, whatever the
real position). The keys it caches at decode steps are unrotated too. The
first stage this changes is decode1/blk.0.q_rope, which is where touchstone
(and check_against_goldens.py) must put the first divergence.
"""
import os
import sys

sys.dont_write_bytecode = True  # leave no __pycache__ beside the examples
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy_engine  # noqa: E402


class RopeDecodeBugEngine(numpy_engine.Engine):
    name = "numpy-ref-rope-bug"
    rope_in_decode = False  # the one thing flipped


if __name__ == "__main__":
    sys.exit(numpy_engine.serve(RopeDecodeBugEngine))
