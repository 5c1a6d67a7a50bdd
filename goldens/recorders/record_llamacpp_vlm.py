#!/usr/bin/env python3
"""Record golden tensors of a vision-language model (Qwen2-VL, Qwen3-VL) with
llama.cpp's multimodal library (mtmd).

usage: record_llamacpp_vlm.py GGUF MMPROJ_GGUF OUT_FILE --hf-golden HF_GOLDEN --image PNG
                              [--threads N] [--list-nodes] [--oracle ORACLE]

GGUF and MMPROJ_GGUF: convert_gguf.py MODEL_DIR X.gguf and convert_gguf.py
MODEL_DIR X-mmproj.gguf --mmproj (the vendored converter). The libraries:
build_llamacpp.py --mtmd (libmtmd.so next to its own libllama, same source
and flags as the text goldens' libllama), through the sdist's ctypes
bindings (llama_cpp/llama_cpp.py and llama_cpp/mtmd_cpp.py).

What runs is llama.cpp's own pipeline: mtmd_helper_bitmap_init_from_file
reads the PNG (stb_image), mtmd_tokenize splits the HF golden's rendered chat
prompt (with `<|vision_start|><|image_pad|><|vision_end|>` replaced by mtmd's
media marker; mtmd puts vision_start / vision_end back around the image
itself) into text and image chunks and preprocesses the image (llama.cpp's
own resize and normalisation), mtmd_encode_chunk runs the vision tower (its
eval callback, mtmd_context_params.cb_eval, sees the vision graph), and the
language model decodes the chunks in order: the text chunks as token
batches, the image chunk as an embedding batch with the M-RoPE positions of
mtmd_helper_image_get_decoder_pos (what mtmd_helper_decode_image_chunk
does), then decode1.. one token each. Two deviations from
mtmd_helper_eval_chunks, both needed to record every row: logits are
requested for every token (else the last layer is pruned to the output
rows), and the image chunk is decoded through llama_decode with a classic
llama_batch (embd + 4 positions per token) so that it, too, requests every
row. The token ids fed are asserted to be the HF golden's (text chunks from
llama.cpp's tokenizer, the image chunk as many image tokens as HF's
image_pad run) and the decode tokens are the HF golden's (teacher forcing).

The prefill is three llama.cpp graphs (text, image, text); each LM stage is
the three chunks' rows concatenated (attention probabilities/scores padded
with the exact zeros of the causal mask to the prompt's length).

Stages: every key of the HF golden except STAGE_NOTES' (embed, at every
step: the prefill's image rows never exist in llama.cpp; prefill/vision.grid:
not a graph tensor, asserted equal); `record.stages` lists the patterns
recorded, so readers plan no embed check against this golden. vision.pixels is the image the patch Conv2Ds read
(IM2COL's input, a graph input copied in the eval callback) in HF's patch
layout; it equals HF's processor output bit for bit on both test images.

llama.cpp's arithmetic, recorded as it is: ggml_conv_2d (the patch
embedding) runs im2col into FLOAT16 for an F32 kernel (ggml.c: `a->type ==
GGML_TYPE_BF16 ? GGML_TYPE_F32 : GGML_TYPE_F16`), so the pixels are rounded
to f16 before the patch matmul: vision.patch_embed is ~6e-3 from the
oracle (HF 1.8e-5), and every later stage, vision and language model,
inherits an error a few hundred times HF's. The merger's GELU is ggml_gelu
(tanh form) where HF's PatchMerger uses the exact erf GELU.

An overflow is data, as in record_vlm.py (overflow.py): every stage is
watched in execution order (golden_io.vlm_order); at the first non-finite
one nothing more is stored and no later step is decoded (their tokens and
positions, the HF golden's, are), provenance `overflow` says where
(`oracle_max_abs` from --oracle), and the key-set comparison with the HF
golden is left out. Exit 0, one `overflow: ` line on stderr.
"""
import argparse
import ctypes
import importlib
import json
import os
import sys

import numpy as np
from safetensors import safe_open

sys.dont_write_bytecode = True
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import build_llamacpp  # noqa: E402
import golden_io  # noqa: E402
import llamacpp_graph as graph  # noqa: E402  (the text recorder's node map: the LM's stages)
import llamacpp_lib as lib  # noqa: E402
import overflow  # noqa: E402  (a forward that overflows is data)
from golden_io import progress, sha256_file  # noqa: E402

RECORDER = "goldens/recorders/record_llamacpp_vlm.py"
# GGUF architecture -> the text architecture whose LM node map applies (the
# qwen2vl / qwen3vl LM graphs name their nodes as qwen2 / qwen3 do).
LM_ARCH = {"qwen2vl": "qwen2", "qwen3vl": "qwen3"}
IMAGE_MARK = "<|vision_start|><|image_pad|><|vision_end|>"
# Stages llama.cpp does not produce, and why (stored in the provenance).
STAGE_NOTES = {
    "embed": "llama.cpp never looks up embeddings for the image-pad rows (the image chunk is decoded from the "
             "vision tower's embeddings, not from tokens): the prefill's embed would lack them, so embed is not "
             "recorded at any step (inputs_embeds, which it does have, is)",
    "vision.grid": "not a tensor of llama.cpp's graph (the image chunk's nx/ny give it; asserted equal)",
}

# Every stage pattern but `embed` (a pattern matches dot-part for dot-part).
RECORDED_STAGES = [
    "vision.pixels", "vision.patch_embed", "vision.pos_embed", "vision.blk.*.*", "vision.merger_norm",
    "vision.merger", "vision.deepstack.*", "inputs_embeds", "positions", "blk.*.*", "output_norm", "logits",
]


def log(msg):
    progress("record_llamacpp_vlm.py", msg)


class Rec(lib.NodeRecorder):
    """llamacpp_lib.NodeRecorder plus: each node's own address and its
    sources' (to follow the graph), views copied too (Qwen3-VL's q/k/v are
    views of the fused qkv), and an IM2COL's image input (the preprocessed
    pixels, a graph input that is never a node itself)."""

    def callback(self, t, ask, user_data):
        if ask:
            return True
        tt = ctypes.cast(t, ctypes.POINTER(lib.GgmlTensor)).contents
        name = tt.name.decode("utf-8")
        op = self.g.ggml_op_desc(t).decode()
        ne = [int(x) for x in tt.ne]
        data = self.read(t) if tt.type == lib.GGML_TYPE_F32 and op not in ("SET_ROWS", "CPY") else None
        srcs = [int(s) if s else 0 for s in tt.src]
        extra = {}
        if op == "IM2COL" and srcs[1]:
            extra["src1"] = self.read(srcs[1])
        self.nodes.append({"name": name, "op": op, "ne": ne, "data": data, "ptr": int(t), "srcs": srcs,
                           "op_params": bytes(bytearray(tt.op_params)), **extra})
        return True


def api_check(api, lg):
    """llama_get_logits_ith's rows against the graph's result_output: the
    largest difference (asserted 0 at the end), or, where the logits are
    not finite, asserted bit for bit here."""
    if np.isfinite(lg).all():
        return float(np.abs(api - lg).max())
    assert np.array_equal(api, lg, equal_nan=True), "llama_get_logits_ith differs from result_output"
    return 0.0


def node(nodes, name, op=None, last=True):
    hits = [n for n in nodes if n["name"] == name and (op is None or n["op"] == op)]
    assert hits, f"no vision node {name} {op or ''}"
    return hits[-1] if last else hits[0]


def idx(nodes, n):
    return next(i for i, m in enumerate(nodes) if m is n)


def down_bias(nodes, name, k):
    """The bias add right after the k-th (0: only) MUL_MAT called `name`."""
    hits = [i for i, n in enumerate(nodes) if n["name"] == name and n["op"] == "MUL_MAT"]
    assert len(hits) == k + 1, f"{len(hits)} {name} nodes, expected {k + 1}"
    i = hits[k]
    nxt = nodes[i + 1]
    assert nxt["op"] == "ADD" and nodes[i]["ptr"] in nxt["srcs"], f"{name}: no bias add after it"
    return nxt


def node_array(n, shape):
    """A graph node's F32 data as a contiguous array of `shape`."""
    a = n["data"]
    assert a is not None, f"{n['name']} {n['op']}: no F32 data"
    assert a.size == int(np.prod(shape)), f"{n['name']}: {a.shape} cannot be {shape}"
    return np.ascontiguousarray(a.reshape(shape), dtype=np.float32)


def vision_stages(nodes, family, depth, ds_idx, N, M, Ev, Hv, Dv, Fv, E):
    """The vision graph's nodes -> canonical vision stages (contract layouts)."""
    out = {}
    by_ptr = {n["ptr"]: n for n in nodes}
    arr = node_array

    # patch_embed: Qwen2-VL: the input of block 0's first norm (the merge-order
    # CONT after the two Conv2Ds); Qwen3-VL: `patch_bias` (with the conv bias),
    # pos_embed `inp_pos_emb`.
    ln1_0 = node(nodes, "ln1-0")
    first_norm = next(n for n in nodes[:idx(nodes, ln1_0) + 1] if n["op"] == "NORM")
    if family == "qwen3_vl":
        out["vision.patch_embed"] = arr(node(nodes, "patch_bias", "ADD"), (N, Ev))
        out["vision.pos_embed"] = arr(node(nodes, "inp_pos_emb", "ADD"), (N, Ev))
        assert by_ptr[first_norm["srcs"][0]]["name"] == "inp_pos_emb"
    else:
        out["vision.patch_embed"] = arr(by_ptr[first_norm["srcs"][0]], (N, Ev))
    for i in range(depth):
        p = f"vision.blk.{i}."
        out[p + "norm1"] = arr(node(nodes, f"ln1-{i}"), (N, Ev))
        for s, nm in (("q", "Qcur"), ("k", "Kcur"), ("v", "Vcur")):
            out[p + s] = arr(node(nodes, f"{nm}-{i}"), (N, Hv, Dv))
        out[p + "q_rope"] = arr(node(nodes, f"Qcur_rope-{i}", "ROPE"), (N, Hv, Dv))
        out[p + "k_rope"] = arr(node(nodes, f"Kcur_rope-{i}", "ROPE"), (N, Hv, Dv))
        lo, hi = idx(nodes, node(nodes, f"Kcur_rope-{i}", "ROPE")), idx(nodes, node(nodes, f"kqv_out-{i}"))
        sm = [n for n in nodes[lo:hi] if n["op"] == "SOFT_MAX"]
        assert len(sm) == 1, f"block {i}: {len(sm)} SOFT_MAX nodes"
        out[p + "attn_probs"] = arr(sm[0], (Hv, N, N))
        out[p + "attn_ctx"] = arr(node(nodes, f"kqv_out-{i}", "CONT"), (N, Hv * Dv))
        out[p + "attn_out"] = arr(node(nodes, f"attn_out-{i}"), (N, Ev))
        out[p + "mlp_inp"] = arr(node(nodes, f"ffn_inp-{i}", "ADD"), (N, Ev))
        out[p + "norm2"] = arr(node(nodes, f"ffn_inp_normed-{i}"), (N, Ev))
        # fc1 with its bias: the first ffn_up_b-<i> (a deepstack merger after
        # block i has a later one)
        out[p + "mlp_fc1"] = arr(node(nodes, f"ffn_up_b-{i}", "ADD", last=False), (N, Fv))
        act = "ffn_gelu_quick" if family == "qwen2_vl" else "ffn_gelu"
        out[p + "mlp_act"] = arr(node(nodes, f"{act}-{i}", last=False), (N, Fv))
        out[p + "mlp_out"] = arr(node(nodes, f"ffn_out-{i}", last=False), (N, Ev))
        out[p + "out"] = arr(node(nodes, f"layer_out-{i}", "ADD"), (N, Ev))
    # merger_norm: the post-layernorm (build_norm(..., il = depth) -> norm_b-<depth>)
    out["vision.merger_norm"] = arr(node(nodes, f"norm_b-{depth}"), (N, Ev))
    # merger: the projector FFN (build_ffn with il = -1: unsuffixed names)
    # ends in `ffn_down` (MUL_MAT) and its bias add (an unnamed ADD).
    out["vision.merger"] = arr(down_bias(nodes, "ffn_down", 0), (M, E))
    for j, li in enumerate(ds_idx):
        # the deepstack merger after block li: the second ffn_down-<li> (the
        # first is the block's own MLP) and its bias add.
        out[f"vision.deepstack.{j}"] = arr(down_bias(nodes, f"ffn_down-{li}", 1), (M, E))
    return out


def pixels_from_im2col(nodes, P, T, m):
    """The preprocessed image llama.cpp fed the patch Conv2Ds (IM2COL's input,
    [C, H, W]) in HF's vision.pixels layout: patches in merge-window order
    (h/m, w/m, m, m), each [C, T, P, P] with the frame repeated T times
    (HF's processor repeats a still image over temporal_patch_size; llama.cpp
    runs the two temporal kernel halves on the same frame and adds)."""
    ims = [n["src1"] for n in nodes if n["op"] == "IM2COL"]
    assert ims, "no IM2COL node"
    assert all(np.array_equal(ims[0], x) for x in ims[1:]), "the two Conv2Ds see different images"
    img = ims[0].reshape(ims[0].shape[-3:])  # [C, H, W]
    C, H, W = img.shape
    gh, gw = H // P, W // P
    x = img.reshape(C, gh // m, m, P, gw // m, m, P)            # c, bh, mh, ph, bw, mw, pw
    x = x.transpose(1, 4, 2, 5, 0, 3, 6)                         # bh, bw, mh, mw, c, ph, pw
    x = np.repeat(x[:, :, :, :, :, None], T, axis=5)            # ..., c, t, ph, pw
    return np.ascontiguousarray(x.reshape(gh * gw, C * T * P * P), dtype=np.float32), (H, W)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("gguf")
    ap.add_argument("mmproj")
    ap.add_argument("out_file")
    ap.add_argument("--hf-golden", required=True)
    ap.add_argument("--image", required=True)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--list-nodes", action="store_true")
    ap.add_argument("--oracle", default=None, metavar="ORACLE",
                    help="the float64 oracle's golden: an overflow's provenance gives its largest |x| there")
    ap.add_argument("--cache-dir", default=build_llamacpp.DEFAULT_CACHE)
    args = ap.parse_args()

    cache = os.path.abspath(args.cache_dir)
    lib_dir, binfo = build_llamacpp.ensure_built(cache, mtmd=True)
    src = build_llamacpp.source_dir(cache)
    lc, g = lib.load_bindings(src, lib_dir)
    os.environ["MTMD_CPP_LIB"] = lib_dir
    mt = importlib.import_module("llama_cpp.mtmd_cpp")

    hf = {}
    with safe_open(args.hf_golden, "np") as f:
        hf_meta = f.metadata() or {}
        for k in f.keys():
            hf[k] = f.get_tensor(k)
    hf_prov = json.loads(hf_meta["provenance"])
    steps = hf_prov["steps"]
    cfg = hf_prov["model_config"]
    tcfg, vcfg = cfg["text_config"], cfg["vision_config"]
    family = cfg["model_type"]
    n_layer = tcfg["num_hidden_layers"]
    dims = golden_io.model_dims(tcfg)
    H, KV, D, E, F, V, _ = dims
    img_id = cfg["image_token_id"]
    assert sha256_file(args.image) == hf_prov["image"]["sha256"], "not the HF golden's image"

    # ---- model, contexts -------------------------------------------------------
    quiet = lib.silence(lc)
    mt.mtmd_helper_log_set(quiet, None)
    mt.mtmd_log_set(quiet, None)
    model = lib.open_model(lc, args.gguf)
    assert model, f"cannot load {args.gguf}"
    vocab = lc.llama_model_get_vocab(model)
    n_vocab = lc.llama_vocab_n_tokens(vocab)
    arch = lib.meta_str(lc, model, "general.architecture")
    lm_arch = LM_ARCH[arch]
    n_embd_inp = lc.llama_model_n_embd_inp(model) if hasattr(lc, "llama_model_n_embd_inp") else E

    lrec, vrec = Rec(g), Rec(g)
    lcb = lc.ggml_backend_sched_eval_callback(lrec.callback)
    vcb = lc.ggml_backend_sched_eval_callback(vrec.callback)
    cparams = lib.context_params(lc, 256, args.threads, "f32", lcb)
    ctx = lc.llama_init_from_model(model, cparams)
    assert ctx

    mparams_mt = mt.mtmd_context_params_default()
    mparams_mt.use_gpu = False
    mparams_mt.print_timings = False
    mparams_mt.n_threads = args.threads
    mparams_mt.flash_attn_type = lc.LLAMA_FLASH_ATTN_TYPE_DISABLED
    mparams_mt.warmup = False
    mparams_mt.cb_eval = vcb
    mparams_mt.cb_eval_user_data = None
    mctx = mt.mtmd_init_from_file(args.mmproj.encode(), model, mparams_mt)
    assert mctx, f"mtmd cannot load {args.mmproj}"
    assert mt.mtmd_support_vision(mctx) and mt.mtmd_decode_use_mrope(mctx)

    # ---- tokenize: llama.cpp's chunks must be the HF golden's tokens ----------
    rendered = hf_prov["prompt"]["rendered"]
    assert rendered.count(IMAGE_MARK) == 1, "one image per prompt"
    marker = mt.mtmd_default_marker().decode()
    text = rendered.replace(IMAGE_MARK, marker)
    bitmap = mt.mtmd_helper_bitmap_init_from_file(mctx, os.path.abspath(args.image).encode(), False)
    assert bitmap, "mtmd cannot read the image"
    bm_nx, bm_ny = mt.mtmd_bitmap_get_nx(bitmap), mt.mtmd_bitmap_get_ny(bitmap)
    chunks = mt.mtmd_input_chunks_init()
    itext = mt.mtmd_input_text()
    tb = text.encode()
    itext.text = tb
    itext.text_len = len(tb)
    itext.add_special = False
    itext.parse_special = True
    bms = (mt.mtmd_bitmap_p_ctypes * 1)(bitmap)
    rc = mt.mtmd_tokenize(mctx, chunks, ctypes.byref(itext), bms, 1)
    assert rc == 0, f"mtmd_tokenize: {rc}"
    parts = []  # ("text", ids) / ("image", chunk, n_tokens, nx, ny)
    for i in range(mt.mtmd_input_chunks_size(chunks)):
        ch = mt.mtmd_input_chunks_get(chunks, i)
        typ = mt.mtmd_input_chunk_get_type(ch)
        if typ == mt.MTMD_INPUT_CHUNK_TYPE_TEXT:
            n = ctypes.c_size_t()
            p = mt.mtmd_input_chunk_get_tokens_text(ch, ctypes.byref(n))
            parts.append(("text", [int(p[j]) for j in range(n.value)]))
        else:
            assert typ == mt.MTMD_INPUT_CHUNK_TYPE_IMAGE
            it = mt.mtmd_input_chunk_get_tokens_image(ch)
            parts.append(("image", ch, mt.mtmd_image_tokens_get_n_tokens(it), mt.mtmd_image_tokens_get_nx(it),
                          mt.mtmd_image_tokens_get_ny(it)))
    hf_tokens = [int(x) for x in hf["prefill/tokens"]]
    ours = []
    for p in parts:
        ours += p[1] if p[0] == "text" else [img_id] * p[2]
    assert ours == hf_tokens, f"llama.cpp's chunks give {ours}, HF {hf_tokens}"
    img_part = next(p for p in parts if p[0] == "image")
    n_img, gx, gy = img_part[2], img_part[3], img_part[4]
    grid = [int(x) for x in hf["prefill/vision.grid"].reshape(-1)]
    m = vcfg["spatial_merge_size"]
    assert [1, gy * m, gx * m] == grid, f"llama.cpp's image grid {gy * m}x{gx * m}, HF's {grid}"
    log(f"{arch}: tokens = HF's ({len(ours)}), image {bm_nx}x{bm_ny} -> {gx}x{gy} merged tokens ({n_img})")

    # ---- the vision tower ------------------------------------------------------
    rc = mt.mtmd_encode_chunk(mctx, img_part[1])
    assert rc == 0, f"mtmd_encode_chunk: {rc}"
    if args.list_nodes:
        for i, nd in enumerate(vrec.nodes):
            print(f"vision {i:4d} {nd['name']:<22} {nd['op']:<10} {list(reversed(nd['ne']))}", file=sys.stderr)
    emb = np.ctypeslib.as_array(mt.mtmd_get_output_embd(mctx), shape=(n_img * n_embd_inp,)).copy()
    emb = emb.reshape(n_img, n_embd_inp)
    P = vcfg["patch_size"]
    Tp = vcfg["temporal_patch_size"]
    N, M = n_img * m * m, n_img
    Ev = vcfg.get("embed_dim") or vcfg["hidden_size"]
    Hv = vcfg["num_heads"]
    Fv = vcfg.get("intermediate_size") or int(Ev * vcfg["mlp_ratio"])
    ds_idx = vcfg.get("deepstack_visual_indexes") or []
    out = {}
    pix, (ph, pw) = pixels_from_im2col(vrec.nodes, P, Tp, m)
    vs = vision_stages(vrec.nodes, family, vcfg["depth"], ds_idx, N, M, Ev, Hv, Ev // Hv, Fv, E)
    vs["vision.pixels"] = pix
    # what the LM receives must be the graph's merger (and deepstack) output
    assert np.array_equal(emb[:, :E], vs["vision.merger"], equal_nan=True), "mtmd output != merger node"
    for j in range(len(ds_idx)):
        assert np.array_equal(emb[:, E * (j + 1):E * (j + 2)], vs[f"vision.deepstack.{j}"], equal_nan=True)
    vrec.nodes = []

    # ---- the language model ------------------------------------------------------
    keep = set(golden_io.all_stages(lm_arch, n_layer)) - {"embed"}
    greedy_ids, api_vs_graph = [], 0.0

    def decode(toks=None, embd=None, pos4=None, cell0=0):
        """One llama_decode with logits for every row; returns (stages, logits)."""
        n = len(toks) if toks is not None else embd.shape[0]
        b = lc.llama_batch_init(4 * n, 0 if toks is not None else n_embd_inp, 1)
        try:
            b.n_tokens = n
            for i in range(n):
                if toks is not None:
                    b.token[i] = toks[i]
                b.n_seq_id[i] = 1
                b.seq_id[i][0] = 0
                b.logits[i] = 1
            if embd is not None:
                flat = np.ascontiguousarray(embd, dtype=np.float32).reshape(-1)
                ctypes.memmove(b.embd, flat.ctypes.data, flat.nbytes)
            for i, p in enumerate(pos4):
                b.pos[i] = p
            lrec.nodes = []
            rc = lc.llama_decode(ctx, b)
            assert rc == 0, f"llama_decode: {rc}"
        finally:
            lc.llama_batch_free(b)
        nodes = lrec.nodes
        lrec.nodes = []
        S = cell0 + n
        st = graph.canonical(nodes, "x", lm_arch, n_layer, n, S, False, dims, keep,
                             list(range(cell0, cell0 + n)), {"arch": lm_arch, "scale": 1.0 / np.sqrt(D),
                                                             "windows": [None] * n_layer, "rope_bases": None},
                             finite=False)
        extra = {}
        # token rows: the embedding lookup, the graph's first GET_ROWS
        # (`embd` in the qwen2vl graph; unnamed in qwen3vl's, whose
        # build_inp_embd then pads it with zeros to n_embd_inp for the
        # deepstack slots).
        if toks is not None:
            gr = [x for x in nodes if x["op"] == "GET_ROWS"]
            assert gr and gr[0]["ne"][:2] == [E, n], "no embedding lookup"
            extra["inp"] = gr[0]["data"].reshape(n, E)
        if lm_arch == "qwen3":
            for L in range(len(ds_idx)):
                extra[f"blk.{L}.deepstack"] = np.ascontiguousarray(
                    graph.pick(nodes, f"deepstack_out-{L}", "ADD", "last", "", L)["data"].reshape(n, E), np.float32)
        api = np.stack([np.ctypeslib.as_array(lc.llama_get_logits_ith(ctx, i), shape=(n_vocab,)).copy()
                        for i in range(n)])
        return st, extra, api, nodes

    hf_pos = hf["prefill/positions"]  # [3, T]
    chunks_out, pos_rows, cell = [], [], 0
    for p in parts:
        if p[0] == "text":
            n = len(p[1])
            pos = [int(x) for x in hf_pos[0, cell:cell + n]]
            assert (hf_pos[:, cell:cell + n] == hf_pos[0, cell:cell + n]).all()
            # A token batch: llama.cpp repeats the position over t, h and w and sets
            # the 4th (e) to 0 (llama-graph.cpp, llm_graph_input_pos::set_input);
            # interleaved M-RoPE pairs outside the t/h/w strides turn by e in ggml
            # (Qwen3-VL's sections [4, 2, 2]: pair 7 never turns), HF's by t.
            pos4 = pos
            st, ex, api, nodes = decode(toks=p[1], pos4=pos4, cell0=cell)
            pos_rows.append(np.array([pos] * 3, dtype=np.int64))
            inp = ex["inp"][:, :E]
        else:
            n = p[2]
            rel = (mt.mtmd_decoder_pos * n)()
            it = mt.mtmd_input_chunk_get_tokens_image(p[1])
            n_past = int(hf_pos[:, :cell].max()) + 1 if cell else 0
            mt.mtmd_helper_image_get_decoder_pos(it, n_past, rel)
            t_, y_, x_, z_ = ([int(getattr(r, a)) for r in rel] for a in ("t", "y", "x", "z"))
            pos4 = t_ + y_ + x_ + z_
            st, ex, api, nodes = decode(embd=emb, pos4=pos4, cell0=cell)
            pos_rows.append(np.array([t_, y_, x_], dtype=np.int64))
            inp = emb[:, :E]
        if args.list_nodes:
            for i, nd in enumerate(nodes):
                print(f"lm-{p[0]} {i:4d} {nd['name']:<22} {nd['op']:<10} {list(reversed(nd['ne']))}", file=sys.stderr)
        api_vs_graph = max(api_vs_graph, api_check(api, st["logits"]))
        st["inputs_embeds"] = np.ascontiguousarray(inp, dtype=np.float32)
        st.update({k: v for k, v in ex.items() if k != "inp"})
        chunks_out.append((n, st))
        cell += n
    T = cell
    positions = np.concatenate(pos_rows, axis=1)
    assert np.array_equal(positions, hf_pos), f"llama.cpp's M-RoPE positions differ from HF's:\n{positions}\n{hf_pos}"
    merged = {}
    for k in chunks_out[0][1]:
        rows = []
        for n, st in chunks_out:
            a = st[k]
            if k.endswith("attn_probs") or k.endswith("attn_scores"):
                a = np.pad(a, ((0, 0), (0, 0), (0, T - a.shape[2])))
                rows.append(a)
            else:
                rows.append(a)
        ax = 1 if (k.endswith("attn_probs") or k.endswith("attn_scores")) else 0
        merged[k] = np.ascontiguousarray(np.concatenate(rows, axis=ax), dtype=np.float32)
    merged["tokens"] = np.array(hf_tokens, dtype=np.int64)
    merged["positions"] = positions
    # Every stage, watched in execution order (overflow.py): what came
    # before a first non-finite value is stored, then the tokens fed only.
    watch = overflow.Watch("float32", args.oracle)
    n_ds = len(ds_idx)

    def keep_step(step, st, prefill):
        watch.scan(step, st, golden_io.vlm_order(family, lm_arch, vcfg["depth"], n_ds, n_layer, prefill))
        if np.isfinite(st["logits"]).all():
            greedy_ids.append(int(st["logits"][-1].argmax()))
        out.update({f"{step}/{k}": v for k, v in st.items() if k in ("tokens", "positions") or watch.keeps(step, k)})
    keep_step("prefill", {**vs, **merged}, True)

    for step in steps[1:]:
        tok = [int(x) for x in hf[f"{step}/tokens"]]
        p = hf[f"{step}/positions"].reshape(3, -1)
        assert p.shape[1] == 1 and (p == p[0, 0]).all()
        if watch.found is not None:
            out[f"{step}/tokens"], out[f"{step}/positions"] = np.array(tok, dtype=np.int64), p.astype(np.int64)
            continue
        st, ex, api, nodes = decode(toks=tok, pos4=[int(p[0, 0])], cell0=cell)
        api_vs_graph = max(api_vs_graph, api_check(api, st["logits"]))
        cell += 1
        st["embed"] = np.ascontiguousarray(ex["inp"][:, :E], dtype=np.float32)
        st["tokens"] = np.array(tok, dtype=np.int64)
        st["positions"] = p.astype(np.int64)
        keep_step(step, st, False)
    assert api_vs_graph == 0.0, api_vs_graph

    mt.mtmd_input_chunks_free(chunks)
    mt.mtmd_bitmap_free(bitmap)
    mt.mtmd_free(mctx)
    lc.llama_free(ctx)
    lc.llama_model_free(model)

    # ---- the same keys and shapes as the HF golden, less what llama.cpp lacks --
    # (Where either overflowed, each stops where its own forward did.)
    out = {k: v for k, v in out.items() if k.split("/", 1)[1] != "embed"}
    if watch.found is None and "overflow" not in hf_prov:
        missing = sorted(k for k in hf if k not in out and k.split("/", 1)[1] not in STAGE_NOTES)
        extra = sorted(k for k in out if k not in hf)
        assert not extra, f"keys the HF golden does not have: {extra}"
        assert not missing, f"unexpected missing keys: {missing}"
    for k, v in out.items():
        assert k not in hf or v.shape == hf[k].shape, f"{k}: {v.shape} vs HF {hf[k].shape}"

    versions, build = lib.versions_and_build(binfo)
    prov = {
        "source": "llama.cpp",
        "recorder": RECORDER,
        "versions": versions,
        "build": build,
        "settings": {
            "kv_cache_type": "f32", "flash_attn": "disabled (LM and vision)", "n_threads": args.threads,
            "n_ctx": 256, "n_gpu_layers": 0, "logits": "all tokens",
            "tokens": "prompt: llama.cpp's mtmd chunks, asserted equal to the HF golden's; decode: teacher-forced "
                      "from the HF golden",
            "image": "mtmd_helper_bitmap_init_from_file + llama.cpp's own preprocessing",
        },
        "gguf_sha256": sha256_file(args.gguf),
        "mmproj_sha256": sha256_file(args.mmproj),
        "gguf_architecture": arch,
        "hf_golden_sha256": sha256_file(args.hf_golden),
        "image": {"file": os.path.basename(args.image), "sha256": sha256_file(args.image),
                  "bitmap": [bm_ny, bm_nx], "preprocessed": [ph, pw]},
        "prompt": {"text": hf_prov["prompt"]["text"], "rendered": rendered, "chat": True,
                   "token_ids": hf_tokens, "mtmd_text": text},
        "greedy_ids": greedy_ids,
        "decode_steps": len(steps) - 1,
        "steps": steps,
        "model_config": cfg,
        # `record.stages` in the schema every golden reader knows: the
        # patterns recorded, every stage but `embed`.
        "record": {"stages": RECORDED_STAGES, "not_recorded": STAGE_NOTES},
        # How it computes, as touchstone's scaled policy reads it
        # (src/arithmetic.rs): f32 storage and KV cache, the pixels rounded to
        # f16 by ggml_conv_2d's im2col before the patch embedding. It makes
        # llama.cpp a reference of its own arithmetic, never a peer that
        # widens an f32 engine's allowance. (The merger's GELU is ggml's tanh
        # approximation, HF's is exact: a model difference, not a rounding.)
        "arithmetic": {"storage": "f32", "kv": "f32", "patch": "f16"},
    }
    if watch.found is not None:
        prov["overflow"] = watch.found
        prov["overflow_skipped"] = overflow.skipped(watch.found, [], [], [])
    golden_io.write_golden(out, golden_io.metadata(prov), args.out_file)
    print(json.dumps({"out": args.out_file, "tensors": len(out), "sha256": sha256_file(args.out_file),
                      "greedy_ids": greedy_ids, "hf_greedy_ids": hf_prov["greedy_ids"],
                      "not_recorded": sorted(STAGE_NOTES)}))
    watch.report()
    return 0


if __name__ == "__main__":
    sys.exit(main())
