"""The cross-checks of an HF recording (record_hf.py): the cached steps
against a recomputation.

- cache_cross_check: one forward over the prompt and every token fed up to
  the last step must give (nearly) the same last logits row as that cached
  step (provenance `cache_vs_full_max_abs_diff`).
- sliding_cross_check, for sliding-window models (Gemma 3, Qwen2 with
  use_sliding_window; a layer slides when config.layer_types says
  sliding_attention): the canonical [H,T,S] has
  S = every position so far, but HF's default cache for such a config
  (DynamicCache(config=...)) keeps only the last sliding_window - 1
  positions of a sliding layer, so its decode-step attentions would be
  narrower. record_hf.py passes a plain DynamicCache() instead (every layer
  keeps every position: asserted after each step, and the attention tap
  asserts S keys); HF's mask still applies the window (asserted by the tap).
  The same steps are run again here through HF's own trimmed cache (its
  trimming asserted) and every step's last logits row must agree with the
  recording (provenance `sliding_cache_vs_full_cache_max_abs_diff`, asserted
  < 1e-3; about 2e-6 in float32).

Both run on the steps before any overflow only (overflow.py): `run.clean`,
and from a fresh model's RoPE state (record_hf.py resets a scaled RoPE's
per-forward table first: rope_scaling_f64.py).
"""
import contextlib

import numpy as np
import torch

import overflow
from golden_io import progress
from hf_hooks import layer_windows


def log(msg):
    progress("record_hf.py", msg)


def run_sliding(cfg):
    """Whether any layer of this model slides (Gemma 3, Qwen2 with use_sliding_window)."""
    return any(w is not None for w in layer_windows(cfg))


def sliding_cross_check(m, run, prompt_ids):
    """The steps before any overflow through HF's own cache for this config
    (sliding layers trimmed to the last window - 1 positions, asserted): the
    last-row logits of every step must agree with the full cache's (not bit
    for bit: the softmax sums over different key counts). Returns the
    largest difference (None: no step to check)."""
    model, guard, windows = m.model, m.guard, layer_windows(m.cfg)
    if not run.clean:
        return None
    log("sliding-window cross-check: the same steps with HF's own (trimmed) cache")
    own, diffs, p0 = None, [], 0
    with torch.no_grad():
        for si, step in enumerate(run.clean):
            ids = prompt_ids if si == 0 else [run.fed[len(prompt_ids) + si - 1]]
            pos_ids = torch.arange(p0, p0 + len(ids), dtype=torch.int64)[None]
            with guard or contextlib.nullcontext():
                o = model(input_ids=torch.tensor([ids], dtype=torch.int64), position_ids=pos_ids,
                          past_key_values=own, use_cache=True)
            own = o.past_key_values
            p0 += len(ids)
            diffs.append(float(np.abs(o.logits[0, -1].to(torch.float64).numpy() - run.step_last_logits[si]).max()))
    lens = [layer.keys.shape[-2] for layer in own.layers]
    want = [p0 if w is None else min(p0, w - 1) for w in windows]
    assert lens == want and own.is_sliding == [w is not None for w in windows], \
        f"HF's own cache holds {lens} positions per layer, expected {want}"
    worst = max(diffs)
    assert worst < 1e-3, f"HF's own sliding cache gives other logits: {diffs}"
    return worst


def cache_cross_check(m, run, prompt_ids):
    """One forward over prompt + every token fed up to the last step before
    any overflow must give (nearly) the same last-row logits as that cached
    step (None: no step to check)."""
    if not run.clean:
        return None
    last = len(run.clean) - 1
    log("KV-cache cross-check: one forward over prompt + fed tokens")
    with torch.no_grad():
        full = torch.tensor([run.fed[:len(prompt_ids) + last]], dtype=torch.int64)
        with m.guard or contextlib.nullcontext():
            lf = m.model(input_ids=full).logits[0, -1].to(torch.float64).numpy()
    return overflow.finite_or_none(np.abs(lf - run.step_last_logits[last]).max())
