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

Twin router rows (moe_families.TWIN_ROUTER_ROWS: mixtral-tiny's experts 0 and 1): the rows are asserted
equal bit for bit in DIR/model/model.safetensors, and the twins' ffn_moe_logits and ffn_moe_probs equal bit
for bit in every golden, so they tie exactly for every token. The margins count the twins as one score
(moe_families.topk_gaps). It lists the boundary ties (the twins the k-th and (k+1)-th scores) per step and
layer, and what each reference chose there: touchstone's rule is the lower id, and a reference that takes
the higher one, or none in the first MoE layer's prefill, fails the check; where both twins are chosen,
ffn_moe_topk must hold them in ascending id.

Exit 0 when every reference chose the same experts everywhere, every expert was used and the twins (if
any) tie as above, 1 otherwise.
regen.sh runs it on the MoE models it regenerates.
"""
import json
import sys

import numpy as np
from safetensors import safe_open

sys.dont_write_bytecode = True  # import the sibling module without leaving a __pycache__
import moe_families  # noqa: E402  (TWIN_ROUTER_ROWS, topk_gaps)


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


def check_twins(folder, goldens, twins):
    """The twin rows' checks (module docstring); returns (report, failures)."""
    a, b = twins
    bad = 0
    with safe_open(f"{folder}/model/model.safetensors", "np") as f:
        routers = [n for n in f.keys() if n.endswith("block_sparse_moe.gate.weight")]
        for n in routers:
            w = f.get_tensor(n)
            if not np.array_equal(w[a], w[b]):
                print(f"{folder}: {n}: rows {a} and {b} differ")
                bad += 1
    ties, chose, both = {}, {name: {"lower": 0, "higher": 0} for name in goldens}, {}
    for key in sorted(k for k in goldens["hf"] if k.endswith(".ffn_moe_topk")):
        step, stage = key.split("/")
        for name, g in goldens.items():
            for st in ("ffn_moe_logits", "ffn_moe_probs"):
                x = g[key.replace("ffn_moe_topk", st)]
                if not np.array_equal(x[:, a], x[:, b]):
                    print(f"{folder}: {name} {step}/{stage}: the twins' {st} differ")
                    bad += 1
        k = goldens["hf"][key].shape[1]
        gaps = moe_families.topk_gaps(goldens["hf"][key.replace("ffn_moe_topk", "ffn_moe_probs")], k, twins)
        rows = [t for t, gp in enumerate(gaps) if gp[3]]
        ties[f"{step}/{stage}"] = rows
        for name, g in goldens.items():
            ids = g[key].astype(np.int64)
            for t in rows:
                chose[name]["lower" if a in ids[t] and b not in ids[t] else "higher"] += 1
            for t in np.nonzero((ids == a).any(1) & (ids == b).any(1))[0]:
                both[name] = both.get(name, 0) + 1
                if list(ids[t]).index(a) > list(ids[t]).index(b):
                    print(f"{folder}: {name} {step}/{stage} row {t}: both twins chosen, the higher id first")
                    bad += 1
    for name, c in chose.items():
        if c["higher"]:
            print(f"{folder}: {name} took the higher twin at {c['higher']} boundary ties")
            bad += 1
    first = min((k for k in ties if k.startswith("prefill/")), key=lambda k: int(k.split(".")[1]))
    if not ties[first]:
        print(f"{folder}: no boundary tie in {first}")
        bad += 1
    if not routers:
        print(f"{folder}: no router matrix in model/model.safetensors")
        bad += 1
    return {"twin_router_rows": [a, b], "twin_routers_equal_rows": len(routers),
            "boundary_ties": {k: v for k, v in ties.items() if v}, "tie_choices": chose,
            "both_twins_chosen_rows": both, "twin_failures": bad}, bad


def check(folder):
    hf, prov = load(f"{folder}/hf.safetensors")
    others, absent = {}, {}
    for name in ("oracle", "llamacpp"):
        others[name], p = load(f"{folder}/{name}.safetensors")
        absent[name] = set(p.get("absent_stages", {}))  # (llama.cpp's MLA: no per-head k, v, k_rope)
    cfg = prov["model_config"]
    twins = moe_families.TWIN_ROUTER_ROWS.get(cfg["model_type"])
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
        gaps = moe_families.topk_gaps(sel, k, twins)  # (above, below, relative, boundary tie) per row
        gap = np.array([g[0] - g[1] for g in gaps])
        rel = np.array([g[2] for g in gaps])
        for r, into in ((int(np.argmin(gap)), "abs"), (int(np.argmin(rel)), "rel")):
            m = {"margin": float(gap[r]), "relative": float(rel[r]), "at": f"{step}/{stage}", "row": r,
                 "kth": gaps[r][0], "next": gaps[r][1]}
            if into == "abs" and (worst is None or m["margin"] < worst["margin"]):
                worst = m
            if into == "rel" and (worst_rel is None or m["relative"] < worst_rel["relative"]):
                worst_rel = m
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
    twin_report, twin_bad = check_twins(folder, {"hf": hf, **others}, twins) if twins else ({}, 0)
    print(json.dumps({"folder": folder, "model_type": cfg["model_type"], "smallest_topk_margin_f32": worst,
                      "smallest_relative_topk_margin_f32": worst_rel,
                      "experts_never_chosen_in_prefill": unused, "topk_disagreements": bad, **twin_report}))
    return bad == 0 and twin_bad == 0 and not unused


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__.split("\n\n")[1])
    ok = all([check(d.rstrip("/")) for d in sys.argv[1:]])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
