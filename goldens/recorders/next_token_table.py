#!/usr/bin/env python3
"""Print how far each next-token golden is from the oracle, per prompt.

usage: next_token_table.py ORACLE SOURCE_FILE... [--top-k N] [--markdown]

ORACLE and each SOURCE_FILE are record_next_token.py outputs of the same
prompt set (the SOURCE_FILEs with `at_oracle`). For each source and prompt,
over the prompt's T positions:

  KL_K   max over positions of KL(oracle || source) on the oracle's top K ids
         plus one "rest" bucket:
           sum_{i in topK} p_i (lp_o,i - lp_x,i) + p_rest (log p_rest - log q_rest)
         p = exp(the oracle's top_logprobs), q = exp(the source's at_oracle),
         p_rest = 1 - sum p_i and q_rest = 1 - sum q_i, each computed as
         -expm1(logsumexp(...)) (no cancellation); a rest mass that rounds to
         <= 0 is taken as 1e-300 (then the term is 0 for p_rest)
  mean   the mean of KL_K over the positions
  top-1  positions where the source's top id is the oracle's, of T
  in top-N  positions where the oracle's top id is among the source's top N
         ids (--top-k, default 5), of T
  max|dlp| max over positions and the oracle's top K ids of
         |at_oracle - the oracle's top_logprobs|
  worst  the position of the largest KL_K

and a line over all prompts. This is what the Rust `next_token` check judges;
the script shows the measured distances before (and besides) it.
"""
import argparse
import json
import os
import sys

import numpy as np
from safetensors import safe_open

FORMAT = "touchstone-next-token/1"
TINY = 1e-300


def load(path):
    if not os.path.isfile(path):
        sys.exit(f"next_token_table.py: error: {path}: no such file")
    with safe_open(path, "np") as f:
        meta = f.metadata() or {}
        if meta.get("format") != FORMAT:
            sys.exit(f"next_token_table.py: error: {path} is not a {FORMAT} file")
        return json.loads(meta["provenance"]), {k: f.get_tensor(k) for k in f.keys()}


def rest_log(lp):
    """log(1 - sum(exp(lp))) per row, and whether the rest rounded to <= 0."""
    lse = np.logaddexp.reduce(lp, axis=1)
    rest = -np.expm1(lse)
    return np.log(np.maximum(rest, TINY)), rest


def kl_k(lp_o, lp_x):
    """Per-position KL(oracle || source) on the oracle's top K + a rest bucket."""
    p = np.exp(lp_o)
    lpr, pr = rest_log(lp_o)
    lqr, _ = rest_log(lp_x)
    head = (p * (lp_o - lp_x)).sum(axis=1)
    tail = np.where(pr > 0, np.maximum(pr, 0.0) * (lpr - lqr), 0.0)
    return head + tail


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("oracle")
    ap.add_argument("sources", nargs="+")
    ap.add_argument("--top-k", type=int, default=5, help="N of the `in top-N` column (default 5)")
    ap.add_argument("--markdown", action="store_true", help="a markdown table (docs/recorders.md)")
    args = ap.parse_args()
    o_prov, o = load(args.oracle)
    if o_prov.get("source") != "oracle":
        sys.exit(f"next_token_table.py: error: {args.oracle} is source {o_prov.get('source')!r}, not the oracle")
    names = o_prov["prompts"]
    rows = []
    for path in args.sources:
        prov, x = load(path)
        if prov.get("prompts") != names or prov.get("prompt_set", {}).get("sha256") != o_prov["prompt_set"]["sha256"]:
            sys.exit(f"next_token_table.py: error: {path} was recorded from another prompt set than {args.oracle}")
        src = prov["source"]
        tot = {"kl": 0.0, "klsum": 0.0, "top1": 0, "intop": 0, "T": 0, "dlp": 0.0, "worst": ""}
        for n in names:
            assert (x[f"{n}/tokens"] == o[f"{n}/tokens"]).all(), f"{path}: {n}: other tokens than the oracle's"
            lp_o, lp_x = o[f"{n}/top_logprobs"], x[f"{n}/at_oracle"]
            kl = kl_k(lp_o, lp_x)
            top1 = int((x[f"{n}/top_ids"][:, 0] == o[f"{n}/top_ids"][:, 0]).sum())
            intop = int((x[f"{n}/top_ids"][:, :args.top_k] == o[f"{n}/top_ids"][:, :1]).any(axis=1).sum())
            T = len(kl)
            dlp = float(np.abs(lp_x - lp_o).max())
            w = int(np.argmax(kl))
            rows.append((src, n, float(kl.max()), float(kl.mean()), top1, intop, T, dlp, w))
            if kl.max() >= tot["kl"]:
                tot["kl"], tot["worst"] = float(kl.max()), f"{n}@{w}"
            tot["top1"] += top1
            tot["intop"] += intop
            tot["klsum"] += float(kl.sum())
            tot["T"] += T
            tot["dlp"] = max(tot["dlp"], dlp)
        rows.append((src, "ALL", tot["kl"], tot["klsum"] / tot["T"], tot["top1"], tot["intop"], tot["T"], tot["dlp"],
                     tot["worst"]))
    N = args.top_k
    if args.markdown:
        print(f"| source | prompt | max KL_K | mean KL_K | top-1 | in top-{N} | max \\|Δlogprob\\| | worst position |")
        print("|---|---|---:|---:|---:|---:|---:|---:|")
        for src, n, kl, klm, t1, it, T, dlp, w in rows:
            b = "**" if n == "ALL" else ""
            print(f"| {b}{src}{b} | {b}{n}{b} | {b}{kl:.2e}{b} | {b}{klm:.1e}{b} | {b}{t1}/{T}{b} | {b}{it}/{T}{b} | "
                  f"{b}{dlp:.2e}{b} | {w} |")
    else:
        print(f"{'source':<10} {'prompt':<16} {'max KL_K':>10} {'mean KL_K':>10} {'top-1':>9} {f'in top-{N}':>9} "
              f"{'max|dlp|':>10}  worst")
        for src, n, kl, klm, t1, it, T, dlp, w in rows:
            print(f"{src:<10} {n:<16} {kl:10.2e} {klm:10.1e} {f'{t1}/{T}':>9} {f'{it}/{T}':>9} {dlp:10.2e}  {w}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
