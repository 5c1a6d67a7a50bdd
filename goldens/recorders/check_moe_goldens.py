#!/usr/bin/env python3
"""Check a tiny MoE model's goldens against each other: the routing every reference chose, and its margin.

usage: check_moe_goldens.py DIR [DIR ...]

DIR is a goldens/<family>-tiny/ folder (moe_families.py's models) holding hf.safetensors,
oracle.safetensors and llamacpp.safetensors. For every step and MoE layer it compares ffn_moe_topk of the
float64 oracle and of llama.cpp with HF's, token by token; a token where they differ is printed with its
two selection scores in each reference (a near-tie: with decisive routers there is none). It reports the
smallest float32 margin between the k-th and (k+1)-th selection score over every token, layer and step of
the HF golden (the smallest absolute one, and the smallest relative to the k-th score), computed from
ffn_moe_probs (DeepSeek-V3's hold sigmoid + e_score_correction_bias; its group limit is applied first, as
HF's router does: only the topk_group groups with the largest sum of their two best scores stay), and
checks that every expert of every MoE layer is chosen at least once over the prefill and that the three
goldens hold the same keys and shapes (but the stages a golden's provenance names `absent_stages`).

Exit 0 when every reference chose the same experts everywhere and every expert was used, 1 otherwise.
regen.sh runs it on the MoE models it regenerates.
"""
import json
import sys

import numpy as np
from safetensors import safe_open


def load(path):
    with safe_open(path, "np") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, json.loads(f.metadata()["provenance"])


def selection(scores, cfg):
    """The scores top-k is taken over, [T, n]: DeepSeek-V3's group limit masks the groups outside the
    topk_group best (sum of each group's two best scores) with -inf, as HF's router does."""
    if cfg.get("model_type") != "deepseek_v3" or cfg.get("n_group", 1) <= 1:
        return scores.astype(np.float64)
    s = scores.astype(np.float64)
    g = s.reshape(s.shape[0], cfg["n_group"], -1)
    best = -np.sort(-g, axis=-1)[..., :2].sum(-1)
    keep = np.argsort(-best, axis=-1, kind="stable")[:, :cfg["topk_group"]]
    mask = np.full(g.shape[:2], -np.inf)
    np.put_along_axis(mask, keep, 0.0, axis=-1)
    return (g + mask[..., None]).reshape(s.shape)


def check(folder):
    hf, prov = load(f"{folder}/hf.safetensors")
    others, absent = {}, {}
    for name in ("oracle", "llamacpp"):
        others[name], p = load(f"{folder}/{name}.safetensors")
        absent[name] = set(p.get("absent_stages", {}))  # (llama.cpp's MLA: no per-head k, v, k_rope)
    cfg = prov["model_config"]
    bad = 0
    for name, g in others.items():
        want = [k for k in hf if k.split(".")[-1] not in absent[name]]
        if sorted(g) != sorted(want) or any(g[k].shape != hf[k].shape for k in want):
            print(f"{folder}: {name}'s keys or shapes differ from HF's")
            bad += 1
    worst = worst_rel = None
    unused = {}
    for key in sorted(k for k in hf if k.endswith(".ffn_moe_topk")):
        step, stage = key.split("/")
        probs_key = key.replace("ffn_moe_topk", "ffn_moe_probs")
        ids = hf[key].astype(np.int64)
        k = ids.shape[1]
        sel = selection(hf[probs_key], cfg)
        top = -np.sort(-sel, axis=-1)
        gap = top[:, k - 1] - top[:, k]
        row = int(np.argmin(gap))
        m = {"margin": float(gap[row]), "relative": float(gap[row] / abs(top[row, k - 1])), "at": f"{step}/{stage}",
             "row": row, "kth": float(top[row, k - 1]), "next": float(top[row, k])}
        if worst is None or m["margin"] < worst["margin"]:
            worst = m
        rel = gap / np.abs(top[:, k - 1])
        r = int(np.argmin(rel))
        if worst_rel is None or rel[r] < worst_rel["relative"]:
            worst_rel = {"relative": float(rel[r]), "margin": float(gap[r]), "at": f"{step}/{stage}", "row": r,
                         "kth": float(top[r, k - 1]), "next": float(top[r, k])}
        if step == "prefill":
            n = sel.shape[1]
            missing = sorted(set(range(n)) - set(ids.reshape(-1).tolist()))
            if missing:
                unused[stage] = missing
        for name, g in others.items():
            diff = np.nonzero((g[key].astype(np.int64) != ids).any(axis=1))[0]
            for t in diff:
                theirs = selection(g[probs_key], cfg)[t]
                print(f"{folder}: {step}/{stage} token {t}: HF chose {ids[t].tolist()} (scores "
                      f"{sel[t][ids[t]].tolist()}), {name} {g[key][t].astype(int).tolist()} (its scores "
                      f"{theirs[g[key][t].astype(int)].tolist()})")
                bad += 1
    print(json.dumps({"folder": folder, "model_type": cfg["model_type"], "smallest_topk_margin_f32": worst,
                      "smallest_relative_topk_margin_f32": worst_rel,
                      "experts_never_chosen_in_prefill": unused, "topk_disagreements": bad}))
    return bad == 0 and not unused


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__.split("\n\n")[1])
    ok = all([check(d.rstrip("/")) for d in sys.argv[1:]])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
