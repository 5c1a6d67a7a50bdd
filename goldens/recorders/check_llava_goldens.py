"""Sanity checks of the LLaVA goldens (issue 39), the LLaVA sibling of check_vlm_goldens.py.

usage: check_llava_goldens.py [DIR ...]   (default goldens/llava-tiny goldens/llava-next-tiny)

Each DIR holds model/ (make_vlm_model.py --family llava|llava-next), hf.safetensors and
oracle.safetensors (record_vlm.py, float32 and --dtype float64). Asserted, for HF and the
oracle alike: the same keys, tokens and positions (so the same greedy ids); positions are
0..T-1 then one per step; every vision attention row sums to 1 and every entry is > 0 (no mask:
the tower is bidirectional); vision.features is vision.blk.{L-2}.out without its CLS rows, bit for
bit (L = 3: blk.1; the layer LLaVA reads is not the last); LLaVA-1.5's vision.merger is
vision.projector bit for bit; NeXT's merger is the base image's projector rows, then the unpadded
tile grid row by row, each row followed by image_newline (model.safetensors' own, bit for bit);
M (merger rows) is the number of <image> tokens in the prompt, and inputs_embeds is embed except
exactly at those rows, where it is vision.merger. Printed: max |HF - oracle| per stage group
(absolute and relative to the oracle's largest |x|), the worst stage, and the NeXT layout.
"""
import json
import os
import sys

import numpy as np
from safetensors import safe_open
from safetensors.numpy import load_file

GOLDENS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def group(stage):
    if stage in ("tokens", "positions"):
        return None
    if stage == "vision.pixels":
        return "vision.pixels"
    if stage.startswith("vision.blk."):
        return "vision blocks"
    if stage.startswith("vision."):
        return "vision " + stage.split(".")[1]
    return "inputs_embeds" if stage == "inputs_embeds" else "LM"


def check(d):
    hf, orc = load_file(f"{d}/hf.safetensors"), load_file(f"{d}/oracle.safetensors")
    with safe_open(f"{d}/hf.safetensors", "np") as f:
        p = json.loads(f.metadata()["provenance"])
    with safe_open(f"{d}/oracle.safetensors", "np") as f:
        po = json.loads(f.metadata()["provenance"])
    assert sorted(hf) == sorted(orc), set(hf) ^ set(orc)
    assert p["greedy_ids"] == po["greedy_ids"] == p["generate_ids"] == po["generate_ids"]
    cfg = p["model_config"]
    vc, mt = cfg["vision_config"], cfg["model_type"]
    L, layer = vc["num_hidden_layers"], cfg["vision_feature_layer"]
    fb = L + layer  # hidden_states[L + 1 + layer] is block fb's output
    N = (vc["image_size"] // vc["patch_size"]) ** 2
    print(f"== {os.path.basename(os.path.abspath(d))} ({mt}): greedy {p['greedy_ids']} (hf = oracle = generate())")
    groups = {}
    for k in sorted(hf):
        step, st = k.split("/", 1)
        if hf[k].dtype == np.int64:
            assert np.array_equal(hf[k], orc[k]), k
            continue
        g = {"LM": "LM (prefill)"}.get(group(st), group(st)) if step == "prefill" else "LM (decode)"
        diff = float(np.abs(hf[k].astype(np.float64) - orc[k]).max())
        rel = diff / max(float(np.abs(orc[k]).max()), 1e-30)
        a = groups.setdefault(g, [0.0, "", 0.0])
        if diff >= a[0]:
            a[0], a[1] = diff, k
        a[2] = max(a[2], rel)
    for g, (mx, k, rel) in groups.items():
        print(f"  {g:18s} max|hf-oracle| {mx:.2e} (at {k}), max relative to the oracle's max|x| {rel:.1e}")
    tokens = hf["prefill/tokens"]
    T = len(tokens)
    img = tokens == cfg["image_token_index"]
    M = int(img.sum())
    steps = p["steps"]
    assert hf["prefill/positions"].tolist() == list(range(T))
    for i, s in enumerate(steps[1:], start=1):
        assert hf[f"{s}/positions"].tolist() == [T + i - 1] and hf[f"{s}/tokens"].tolist() == [p["greedy_ids"][i - 1]]
    with safe_open(f"{d}/model/model.safetensors", "np") as f:
        newline = f.get_tensor("image_newline") if "image_newline" in f.keys() else None
    for src, g in (("hf", hf), ("oracle", orc)):
        P = g["prefill/vision.pixels"].shape[0]
        for b in range(L):
            pr = g[f"prefill/vision.blk.{b}.attn_probs"].astype(np.float64)
            assert pr.shape == (P * vc["num_attention_heads"], N + 1, N + 1), pr.shape
            s = float(np.abs(pr.sum(-1) - 1).max())
            assert s < 1e-5 and (pr > 0).all(), (src, b, s)
        out = g[f"prefill/vision.blk.{fb}.out"].reshape(P, N + 1, -1)
        assert np.array_equal(g["prefill/vision.features"], out[:, 1:].reshape(P * N, -1)), src
        proj, merger = g["prefill/vision.projector"], g["prefill/vision.merger"]
        assert merger.shape[0] == M == p["image_tokens"], (merger.shape, M)
        if newline is None:
            assert np.array_equal(merger, proj), f"{src}: merger != projector"
        else:
            nx = p["next"]
            proj = proj.reshape(P, N, -1)
            gs = int(round(N ** 0.5))
            th, tw = nx["tiles"]
            grid = proj[1:].reshape(th, tw, gs, gs, -1).transpose(0, 2, 1, 3, 4).reshape(th * gs, tw * gs, -1)
            (r0, r1), (c0, c1) = nx["unpad"]["rows_kept"], nx["unpad"]["columns_kept"]
            assert np.array_equal(merger[:N], proj[0]), f"{src}: the base image's rows"
            at = N
            for r in range(r0, r1):
                assert np.array_equal(merger[at:at + c1 - c0], grid[r, c0:c1]), (src, r)
                at += c1 - c0
                assert at in nx["newline_rows"] and np.array_equal(merger[at], newline), (src, at)
                at += 1
            assert at == M == nx["M"]
            # The committed image is chosen so that the padding to remove is odd: HF's floor
            # split keeps one padding column (or row) more than its ceiling would.
            assert nx["unpad"]["difference"] % 2 == 1 and nx["unpad"]["padding_each_side"] == \
                nx["unpad"]["difference"] // 2, nx["unpad"]
        e, ie = g["prefill/embed"], g["prefill/inputs_embeds"]
        assert np.array_equal(ie[img], merger) and np.array_equal(ie[~img], e[~img]), src
        assert ((e != ie).any(-1) == img).all(), src
    rows = np.flatnonzero(img)
    print(f"  T {T}, <image> rows {M} ({rows[0]}..{rows[-1]}), tower images P = {P}; vision attention rows sum to 1 "
          f"(max dev {s:.1e}), every entry > 0 (no mask)")
    print(f"  vision.features == vision.blk.{fb}.out without CLS (bit for bit); inputs_embeds == embed except the "
          f"<image> rows, == vision.merger there (hf and oracle)")
    if newline is None:
        print("  vision.merger == vision.projector (bit for bit)")
    else:
        nx = p["next"]
        print(f"  NeXT: image {nx['image_size']} -> best {nx['best_resolution']} (scale {nx['scale']}), padding "
              f"{nx['padding_hw']} (H before/after, W before/after; value {nx['padding']['normalised']}), tower "
              f"images {nx['order']}; grid {nx['patch_grid']}, unpad {nx['unpad']}; newline rows "
              f"{nx['newline_rows']} == image_newline; M {nx['M']}")


def main():
    dirs = sys.argv[1:] or [os.path.join(GOLDENS, n) for n in ("llava-tiny", "llava-next-tiny")]
    for d in dirs:
        check(d)


if __name__ == "__main__":
    main()
