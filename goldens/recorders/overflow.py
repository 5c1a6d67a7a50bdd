"""A reference whose forward overflows is data: where it first went
non-finite, and what a golden keeps of it.

Every recorder watches every canonical stage of every step it runs, not only
the stages it stores (the overflow may be in a layer a subset leaves out), in
execution order (golden_io's stage order, step by step). At the first
(step, stage) holding a non-finite value the recording stops storing: the
golden keeps every tensor computed before that point (all finite) and the
tokens and positions of every step, and its provenance says where and how
much (Watch.provenance(), the `overflow` entry):

    {"step": "prefill", "stage": "blk.7.out", "dtype": "float16",
     "nonfinite": <non-finite values in that tensor, every row>,
     "max_abs_finite_before": <largest |x| among its finite values, or null>,
     "oracle_max_abs": <largest |x| of the float64 oracle's tensor at that
                        (step, stage) when --oracle names one holding it, else null>}

The recorder exits 0 (the golden was written) and prints one line on stderr
starting `overflow: `. The internal consistency checks that would compare
non-finite data run only on what came before the overflow; the provenance's
`overflow_skipped` says what was left out and why.
"""
import sys

import numpy as np


# What a lean capture (hf_hooks.Recorder.lean, llamacpp_lib.NodeRecorder's
# keep) holds for a stage it does not store and found finite: an empty
# float32 array, which first_nonfinite reads as finite.
STANDIN = np.zeros((0,), dtype=np.float32)
STANDIN.flags.writeable = False


def first_nonfinite(tensors, order):
    """The first stage of `order` whose tensor in `tensors` holds a
    non-finite value (integer tensors and absent stages are skipped), as
    (stage, its array), or None when every one is finite."""
    for stage in order:
        v = tensors.get(stage)
        if v is None or v.dtype.kind != "f":
            continue
        if not np.isfinite(v).all():
            return stage, v
    return None


def describe(v):
    """(non-finite count, largest |x| among the finite values or None) of
    an array."""
    fin = np.isfinite(v)
    n = int(v.size - np.count_nonzero(fin))
    return n, (float(np.abs(v[fin].astype(np.float64)).max()) if fin.any() else None)


def first_row(stage, v):
    """The first token row of `stage`'s tensor `v` holding a non-finite value
    (golden_io.row_axis: axis 1 for attn_scores/attn_probs, else 0), or None
    for a stage without a token axis."""
    import golden_io
    axis = golden_io.row_axis(stage)
    if axis is None:
        return None
    bad = ~np.isfinite(v)
    rows = np.nonzero(bad.any(axis=tuple(a for a in range(v.ndim) if a != axis)))[0]
    return int(rows[0]) if len(rows) else None


class Oracle:
    """The float64 oracle's stage golden (`--oracle`), read lazily: the
    largest |x| of its tensor at a (step, stage), or None where it holds
    none (or no oracle was given)."""

    def __init__(self, path):
        self.path = path

    def max_abs(self, step, stage):
        if self.path is None:
            return None
        from safetensors import safe_open
        with safe_open(self.path, "np") as f:
            key = f"{step}/{stage}"
            if key not in f.keys():
                return None
            return float(np.abs(f.get_tensor(key).astype(np.float64)).max())


def check_oracle(path, what="--oracle"):
    """`path` must be a touchstone-golden/1 file (exit 2 otherwise)."""
    import os
    from safetensors import safe_open
    if not os.path.isfile(path):
        sys.exit(f"{what} {path} does not exist")
    with safe_open(path, "np") as f:
        fmt = (f.metadata() or {}).get("format")
    if fmt != "touchstone-golden/1":
        sys.exit(f"{what} {path} is not a touchstone-golden/1 file (format {fmt!r})")


class Watch:
    """The first non-finite (step, stage) of a recording. scan() each step's
    tensors in execution order; once found, keeps() says which of the
    overflow step's stages may still be stored (those before it) and
    `found` is the provenance entry."""

    def __init__(self, dtype, oracle_path=None):
        self.dtype = dtype
        self.oracle = Oracle(oracle_path)
        self.found = None
        self.order = None  # the overflow step's stage order

    def scan(self, step, tensors, order):
        """Looks at `tensors` ({stage: array} of one step) in `order`; returns
        True when everything is finite (or the overflow was already found at
        an earlier step: then False)."""
        if self.found is not None:
            return False
        hit = first_nonfinite(tensors, order)
        if hit is None:
            return True
        stage, v = hit
        n, biggest = describe(v)
        self.found = {"step": step, "stage": stage, "dtype": self.dtype, "nonfinite": n,
                      "max_abs_finite_before": biggest, "oracle_max_abs": self.oracle.max_abs(step, stage)}
        self.order = list(order)
        return False

    def keeps(self, step, stage):
        """Whether `step/stage` comes before the overflow (always, when none
        was found). Only meaningful for steps scanned or before."""
        if self.found is None:
            return True
        if step != self.found["step"]:
            return True  # an earlier step (later steps are not stored at all)
        order = self.order
        return stage in order and order.index(stage) < order.index(self.found["stage"])

    def line(self):
        f = self.found
        return (f"overflow: {f['step']}/{f['stage']}: {f['nonfinite']} non-finite value(s) in {f['dtype']} "
                f"(largest finite |x| {f['max_abs_finite_before']}), oracle_max_abs {f['oracle_max_abs']}; the "
                f"golden keeps what came before it (provenance `overflow`)")

    def report(self):
        """The `overflow: ` line on stderr (nothing when none was found)."""
        if self.found is not None:
            print(self.line(), file=sys.stderr, flush=True)


def finite_or_none(x):
    """A float for the provenance: JSON has no NaN or infinity."""
    return float(x) if x is not None and np.isfinite(x) else None


def skipped(found, clean, not_run, checks):
    """The provenance's `overflow_skipped`: what the golden does not hold
    and which checks ran on what. `clean`: the steps before the overflow's;
    `not_run`: steps never run (no token to feed them); `checks`: the names
    of the recorder's cross-checks over the steps (the provenance keys
    they fill, null when there was no step to check)."""
    note = {
        "stored": f"nothing from {found['step']}/{found['stage']} on in execution order (the rest of that step, "
                  "every stage of the steps after it); the tokens and positions of every step are"
                  + (" (but steps_not_run's)" if not_run else ""),
        "greedy_ids": "the picks of the steps whose logits were finite",
        "checks": {c: (f"run on {', '.join(clean)} only, the steps before the overflow" if clean else
                       "not run: no step came before the overflow") for c in checks},
        "consistency": "the checks that compare data (attention recomputation, tied logit pairs, greedy "
                       "agreement, key sets) ran only where it was finite",
    }
    if not_run:
        note["steps_not_run"] = {"steps": not_run, "why": "no token to feed them: the step before had no finite "
                                                          "greedy pick and no golden of tokens was given"}
    return note
