#!/usr/bin/env python3
"""numpy-ref as a flash-attention engine would tap it, for showing capabilities.

    touchstone run SPEC --engine "exec:python3 examples/protocol/numpy_engine_flash.py"

Identical to numpy_engine.py (same protocol, same arithmetic) except that it
never writes blk.{i}.attn_scores and blk.{i}.attn_probs, as an engine whose
attention kernel is fused (flash attention) cannot: they never exist in
memory. Its load answer says so (`"cannot_tap"` with `"why"`), so touchstone
reports the checks on those stages as not applicable and judges everything
else. With `--claim-all` it does NOT say so (it claims every stage) and still
writes none of them: touchstone then fails those checks as missing captures,
and the first divergence stays where numbers differ (there are none here).
run_batch leaves them out in the same way.
"""
import os
import sys

sys.dont_write_bytecode = True  # leave no __pycache__ beside the examples
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy_engine  # noqa: E402

FUSED = ("attn_scores", "attn_probs")
CLAIM_ALL = "--claim-all" in sys.argv[1:]


class FlashEngine(numpy_engine.Engine):
    name = "numpy-ref-flash"

    def load(self, req):
        answer = super().load(req)
        if not CLAIM_ALL:
            answer["cannot_tap"] = [f"blk.*.{s}" for s in FUSED]
            answer["why"] = "flash attention never materialises the scores or probabilities"
        return answer

    def run(self, req):
        return super().run(without_fused(req))

    def run_batch(self, req):
        return super().run_batch(without_fused(req))


def without_fused(req):
    """The request with the stages a fused kernel cannot give back untapped,
    whatever was asked."""
    taps = req.get("taps") or []
    if isinstance(taps, list):
        req = dict(req, taps=[t for t in taps if not (isinstance(t, str) and t.split(".")[-1] in FUSED)])
    return req


if __name__ == "__main__":
    sys.exit(numpy_engine.serve(FlashEngine, [a for a in sys.argv[1:] if a != "--claim-all"]))
