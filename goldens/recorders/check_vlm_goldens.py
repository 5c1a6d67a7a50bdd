"""Sanity checks of the committed VLM goldens (issue 24): HF float32 vs the float64 oracle per
stage group, vision attention rows sum to 1 and are not causal, inputs_embeds = embed except
exactly at the image-pad rows where it is vision.merger, Qwen3-VL deepstack adds, and the
M-RoPE positions. usage: check_vlm_goldens.py (reads goldens/{qwen2-vl,qwen3-vl}-tiny/)."""
import json, os, sys, numpy as np
GOLDENS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
from safetensors import safe_open
from safetensors.numpy import load_file
for name, image_id in [("qwen2-vl-tiny", 12), ("qwen3-vl-tiny", 12)]:
    d = os.path.join(GOLDENS, name)
    hf, orc = load_file(f"{d}/hf.safetensors"), load_file(f"{d}/oracle.safetensors")
    with safe_open(f"{d}/hf.safetensors", "np") as f: p = json.loads(f.metadata()["provenance"])
    assert sorted(hf) == sorted(orc)
    groups = {}
    for k in hf:
        if hf[k].dtype == np.int64:
            assert np.array_equal(hf[k], orc[k]), k; continue
        st = k.split("/", 1)[1]
        g = "vision.pixels" if st == "vision.pixels" else "vision.*" if st.startswith("vision") else "inputs_embeds" if st == "inputs_embeds" else "LM (prefill)" if k.startswith("prefill") else "LM (decode)"
        diff = float(np.abs(hf[k].astype(np.float64) - orc[k]).max())
        rel = diff / max(float(np.abs(orc[k]).max()), 1e-30)
        a = groups.setdefault(g, [0, "", 0]); 
        if diff > a[0]: a[0], a[1] = diff, k
        a[2] = max(a[2], rel)
    print(f"== {name}: greedy hf {p['greedy_ids']}; tokens equal hf/oracle: yes")
    for g, (m, k, r) in groups.items(): print(f"  {g:14s} max|hf-oracle| {m:.3e} (at {k}), max rel to |oracle| max {r:.2e}")
    T = hf["prefill/tokens"]; img = T == image_id
    print(f"  T {len(T)}, image-pad rows {img.sum()} ({np.flatnonzero(img)[0]}..{np.flatnonzero(img)[-1]})")
    for src, g in (("hf", hf), ("oracle", orc)):
        e, ie, mg = g["prefill/embed"], g["prefill/inputs_embeds"], g["prefill/vision.merger"]
        differ = (e != ie).any(-1)
        assert np.array_equal(differ, img), "inputs_embeds differs from embed exactly at the image rows"
        assert np.array_equal(ie[img], mg) and np.array_equal(ie[~img], e[~img])
        depth = max(int(k.split(".")[2]) for k in g if k.startswith("prefill/vision.blk.")) + 1
        for b in range(depth):
            P = g[f"prefill/vision.blk.{b}.attn_probs"].astype(np.float64)
            s = np.abs(P.sum(-1) - 1).max()
            iu = np.triu_indices(P.shape[-1], 1)
            upper = P[:, iu[0], iu[1]]
            assert s < 1e-5 and (upper > 0).all(), (s, (upper > 0).mean())
        if src == "hf": print(f"  vision attn_probs: {depth} blocks, max |row sum - 1| {s:.1e}; strictly-upper (future) entries > 0: {(upper>0).mean()*100:.1f}%, their max {upper.max():.3f} (not causal); [Hv,N,N] {P.shape}")
    print("  inputs_embeds == embed except exactly the image-pad rows, == vision.merger there (bit for bit, hf and oracle)")
    pos = hf["prefill/positions"]
    np.set_printoptions(linewidth=250)
    print(f"  prefill positions [3,{pos.shape[1]}] (rope_deltas {p['rope_deltas']}):")
    for r, n in enumerate("thw"): print(f"    {n}: {pos[r].tolist()}")
    print("  decode positions:", [hf[f'decode{i}/positions'][:, 0].tolist() for i in range(1, 5)])
    if "prefill/blk.0.deepstack" in hf:
        for i in range(2):
            o, ds = hf[f"prefill/blk.{i}.out"], hf[f"prefill/blk.{i}.deepstack"]
            dv = hf[f"prefill/vision.deepstack.{i}"]
            assert np.allclose(ds[img], o[img] + dv, atol=1e-6) and np.array_equal(ds[~img], o[~img])
        print("  blk.i.deepstack == blk.i.out + vision.deepstack.i on the image rows, == blk.i.out elsewhere (i = 0, 1)")
