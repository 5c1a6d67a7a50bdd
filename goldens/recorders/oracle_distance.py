#!/usr/bin/env python3
"""Distance of golden files from an f64 oracle, scaled by the float32 rounding model.

usage: oracle_distance.py ORACLE GOLDEN [GOLDEN ...] [--names N,...] [--summary]

ORACLE is a golden recorded with `record_hf.py --dtype float64` (its
provenance says `"dtype": "float64"`; a warning otherwise), each GOLDEN a
golden of the same prompt and tokens (an HF float32 golden, a llama.cpp
golden, an engine's capture in the golden format). For every (step, stage)
both hold, it prints

  M                 max |oracle|
  max|g - oracle|   per GOLDEN
  ratio             max|g - oracle| / (2^-24 * sqrt(K) * M) per GOLDEN

K is the stage's reduction length: embed 1; attn_norm, ffn_norm,
output_norm, attn_post_norm, ffn_post_norm (Gemma 3), q, k, v, q_norm,
k_norm, q_rope, k_rope, ffn_gate, ffn_up, ffn_act and logits E (hidden); attn_scores D (head dim); attn_probs and
attn_ctx S (the KV length of the step: the last dim of attn_probs);
attn_out and ffn_inp H*D; ffn_out and out F (FFN width); sample_probs V;
a mixture-of-experts layer's ffn_moe_logits and ffn_moe_weights E,
ffn_moe_probs n_expert, ffn_moe_topk 1 (ids: exact or not), ffn_moe_out,
ffn_shexp_out and its ffn_out the expert width (moe_intermediate_size).
A ratio of about 1 is the size of one float32 reduction's rounding; the
tolerance constants of a spec are set on these ratios. --summary prints
only the worst ratio per stage family (`blk.*.q`, ...) over steps and layers.

Needs numpy and safetensors (the recorder venv has both).
"""
import argparse
import json
import math
import os
import re
import sys

import numpy as np
from safetensors import safe_open

sys.dont_write_bytecode = True
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from golden_io import BLOCK_STAGES, OPTIONAL_STAGES  # noqa: E402  (the canonical stage order)

U = 2.0 ** -24


def load(path):
    with safe_open(path, "np") as f:
        meta = f.metadata() or {}
        return {k: f.get_tensor(k) for k in f.keys()}, json.loads(meta.get("provenance", "{}"))


def dims(prov):
    c = prov["model_config"]
    H = c["num_attention_heads"]
    D = c.get("head_dim") or c["hidden_size"] // H
    if c.get("kv_lora_rank"):  # MLA (DeepSeek-V3): config.json's head_dim is the RoPE part only
        D = c["qk_nope_head_dim"] + c["qk_rope_head_dim"]
    return {"E": c["hidden_size"], "H": H, "D": D, "F": c["intermediate_size"], "V": c["vocab_size"],
            "FE": c.get("moe_intermediate_size") or c["intermediate_size"]}


def reduction_length(stage, shape, d, moe=False):
    """K of `stage` (see the module docstring); `moe`: the stage's layer routes (its ffn_out is the experts')."""
    name = stage.split(".")[-1]
    if name == "embed":
        return 1
    if name in ("attn_norm", "ffn_norm", "output_norm", "attn_post_norm", "ffn_post_norm", "q", "k", "v", "q_norm",
                "k_norm", "q_rope", "k_rope", "ffn_gate", "ffn_up", "ffn_act", "logits"):
        return d["E"]
    if name == "attn_scores":
        return d["D"]
    if name == "attn_probs":
        return shape[-1]
    if name == "attn_ctx":
        return None  # S: taken from the step's attn_probs / attn_scores
    if name in ("attn_out", "ffn_inp"):
        return d["H"] * d["D"]
    if name in ("ffn_moe_logits", "ffn_moe_weights"):
        return d["E"]
    if name == "ffn_moe_probs":
        return shape[-1]
    if name == "ffn_moe_topk":
        return 1
    if name in ("ffn_moe_out", "ffn_shexp_out") or (name == "ffn_out" and moe):
        return d["FE"]
    if name in ("ffn_out", "out"):
        return d["F"]
    if name == "sample_probs":
        return d["V"]
    return None


def step_order(step):
    return -1 if step == "prefill" else int(step[len("decode"):])


def stage_order(stage):
    """Execution order: embed, blocks (layer, then BLOCK_STAGES), the rest."""
    m = re.fullmatch(r"blk\.(\d+)\.(.+)", stage)
    if m:
        name = m.group(2)
        return (1, int(m.group(1)), BLOCK_STAGES.index(name) if name in BLOCK_STAGES else 99, name)
    tail = ["output_norm", "logits"] + OPTIONAL_STAGES
    return (0, 0, 0, stage) if stage == "embed" else (2, tail.index(stage) if stage in tail else 99, 0, stage)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("oracle")
    ap.add_argument("goldens", nargs="+")
    ap.add_argument("--names", default=None, help="comma-separated column names for the GOLDENs")
    ap.add_argument("--summary", action="store_true", help="only the worst ratio per stage family")
    args = ap.parse_args()
    names = args.names.split(",") if args.names else [f"g{i + 1}" for i in range(len(args.goldens))]
    if len(names) != len(args.goldens):
        ap.error("--names: one name per GOLDEN")

    o, oprov = load(args.oracle)
    if oprov.get("dtype") != "float64":
        print(f"warning: {args.oracle} has dtype {oprov.get('dtype')!r}, not float64: not an oracle",
              file=sys.stderr)
    d = dims(oprov)
    gs = []
    for path, name in zip(args.goldens, names):
        g, gprov = load(path)
        for k in o:
            if k.endswith("/tokens") or k.endswith("/positions"):
                if k in g and not np.array_equal(g[k], o[k]):
                    print(f"warning: {name}: {k} differs from the oracle's: the distances compare different inputs",
                          file=sys.stderr)
        gs.append(g)

    # S of each step (attn_ctx's reduction length): the positions after it.
    S_of = {k.split("/")[0]: int(v[-1]) + 1 for k, v in o.items() if k.endswith("/positions")}
    keys = sorted((k for k in o if not (k.endswith("/tokens") or k.endswith("/positions"))
                   and any(k in g for g in gs)),
                  key=lambda k: (step_order(k.split("/")[0]), stage_order(k.split("/", 1)[1])))
    rows = []
    for k in keys:
        step, stage = k.split("/", 1)
        ov = o[k].astype(np.float64)
        K = reduction_length(stage, ov.shape, d, k.replace(".ffn_out", ".ffn_moe_out") in o)
        if K is None:
            K = S_of[step]
        M = float(np.abs(ov).max())
        cols = []
        for g in gs:
            if k not in g:
                cols.append(None)
                continue
            gv = g[k].astype(np.float64)
            if gv.shape != ov.shape:
                if stage == "logits" and gv.shape[0] != ov.shape[0]:  # a last-row golden vs a full one
                    n = min(gv.shape[0], ov.shape[0])
                    gv, ovv = gv[-n:], ov[-n:]
                else:
                    print(f"warning: {k}: shape {gv.shape} vs the oracle's {ov.shape}; skipped", file=sys.stderr)
                    cols.append(None)
                    continue
            else:
                ovv = ov
            diff = float(np.abs(gv - ovv).max())
            scale = U * math.sqrt(K) * M
            cols.append((diff, diff / scale if scale > 0 else (0.0 if diff == 0 else math.inf)))
        rows.append((step, stage, ov.shape, K, M, cols))

    if args.summary:
        fam = {}
        for step, stage, shape, K, M, cols in rows:
            f = re.sub(r"^blk\.\d+\.", "blk.*.", stage)
            cur = fam.setdefault(f, [None] * len(gs))
            for i, c in enumerate(cols):
                if c is not None and (cur[i] is None or c[1] > cur[i][1]):
                    cur[i] = (c[0], c[1], f"{step}/{stage}", M, K)
        hdr = f"{'stage':<20}"
        for n in names:
            hdr += f" | {'ratio ' + n:>16} {'max|d|':>10} {'at':<26} {'M':>9} {'K':>6}"
        print(hdr)
        for f, cur in fam.items():
            line = f"{f:<20}"
            for c in cur:
                line += f" | {'-':>16} {'':>10} {'':<26} {'':>9} {'':>6}" if c is None else \
                    f" | {c[1]:>16.3f} {c[0]:>10.2e} {c[2]:<26} {c[3]:>9.4g} {c[4]:>6}"
            print(line.rstrip())
        return 0

    hdr = f"{'step':<8} {'stage':<20} {'K':>6} {'M=max|oracle|':>13}"
    for n in names:
        hdr += f" {'max|' + n + '-or|':>16} {'ratio ' + n:>12}"
    print(hdr)
    for step, stage, shape, K, M, cols in rows:
        line = f"{step:<8} {stage:<20} {K:>6} {M:>13.4g}"
        for c in cols:
            line += f" {'-':>16} {'-':>12}" if c is None else f" {c[0]:>16.3e} {c[1]:>12.3f}"
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
