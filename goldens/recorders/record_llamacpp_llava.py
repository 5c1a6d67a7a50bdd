#!/usr/bin/env python3
"""Convert a tiny LLaVA-1.5 model for llama.cpp and record its llama.cpp
golden through libmtmd (goldens/llava-tiny/).

usage: record_llamacpp_llava.py convert MODEL_DIR OUT_DIR
           -> OUT_DIR/model.gguf (the Llama LM) and OUT_DIR/mmproj.gguf (CLIP tower + projector)
       record_llamacpp_llava.py record GGUF MMPROJ OUT_FILE --hf-golden HF --image PNG
                                       [--oracle ORACLE] [--threads N] [--list-nodes]
       record_llamacpp_llava.py compare LLAMACPP HF ORACLE
           -> per stage max |llama.cpp - oracle| and max |HF - oracle|; the greedy ids

Conversion. The pinned converter (convert_hf_to_gguf.py) converts
LlavaForConditionalGeneration's language model only as a plain Llama, and
its mmproj class for that architecture accepts Pixtral only; LLaVA-1.5's
tower is the legacy route's (tools/mtmd/legacy-models/llava_surgery_v2.py +
convert_image_encoder_to_gguf.py --llava-projector), which writes the patch
Conv2d and the projector matrices in f16 whatever --use-f32 says and needs
transformers 4's CLIP names. So: the LM is exported alone (text_config,
`language_model.` stripped, the tokenizer files) to a temporary folder and
converted by convert_gguf.py (the vendored converter, f32); the mmproj is
written here with the vendored gguf-py, with the legacy converter's keys,
tensor names and order (its `fc1 -> ffn_down` naming included, which clip.cpp
swaps back), every tensor f32 (the f16 that ggml computes at is then the
kernels' own, declared below, not a storage rounding), and the legacy
converter's cut: block_count = the feature layer (2: blocks 0 and 1; block 2
feeds nothing and is not written), no post_layernorm.

Recording: mtmd's own image loading and preprocessing, tokenization
(asserted equal to the HF golden's ids, 49 image tokens), the vision graph
(clip_graph_llava) through mtmd_context_params.cb_eval, the image chunk
decoded as an embedding batch, decode steps teacher-forced on the HF
golden's tokens; record_llamacpp_vlm.py's machinery (Rec, the LM node map
of llamacpp_graph for `llama`, q/k un-permuted).

One correction of llama.cpp's inputs, declared in the provenance
(`input_fix`): the pinned clip_graph_llava appends the class embedding AFTER
the patches (ggml_concat(patches, class_embd)) but adds position embeddings
0..N in row order and then keeps rows 1..N (clip.cpp: `patches[i] = i + 1`):
as shipped, every patch gets its left neighbour's position embedding, CLS
gets the last one, and the first patch is dropped while CLS reaches the
projector, a different model than HF's (and than LLaVA's). The eval
callback, asked before each GET_ROWS runs, rewrites those two index inputs
to what the graph's own layout needs: positions [1..N, 0] (patch j gets
position j+1, CLS 0, as in HF) and patches [0..N-1]. Every value is then
computed by llama.cpp's graph and ggml's kernels as they are. Vision stages
are stored in HF's row order (CLS first); llama.cpp's rows are [patches,
CLS].

Arithmetic (ggml CPU, recorded as it is): ggml_conv_2d holds the pixels in
f16 (im2col) and the kernel is rounded to f16 by the F16 x F32 matmul
(`patch: f16`); GELU and quick-GELU (the tower's mlp_act, the projector's
proj_act) read an f16 table at the f16-rounded input (`act: f16`; the LM's
SiLU is f32), and the projector's GELU is ggml_gelu, the tanh form, where
HF's is erf. Storage and KV cache f32.
"""
import argparse
import ctypes
import importlib
import json
import os
import subprocess
import sys
import tempfile

import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

sys.dont_write_bytecode = True
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import build_llamacpp  # noqa: E402
import golden_io  # noqa: E402
import llamacpp_graph as graph  # noqa: E402
import llamacpp_lib as lib  # noqa: E402
import overflow  # noqa: E402
from golden_io import progress, sha256_file  # noqa: E402
from record_llamacpp_vlm import Rec, api_check, idx, node, node_array  # noqa: E402

RECORDER = "goldens/recorders/record_llamacpp_llava.py"
IMAGE = "<image>"
STAGE_NOTES = {
    "embed": "llama.cpp never embeds the image tokens (the image chunk is decoded from the projector's output): "
             "not recorded at any step (inputs_embeds is)",
    "vision.blk.2.*": "the last CLIP block feeds nothing at vision_feature_layer -2: the legacy converter's cut "
                      "(block_count 2) leaves it out of the mmproj, llama.cpp never runs it",
}
RECORDED_STAGES = ["vision.pixels", "vision.patch_embed", "vision.pos_embed", "vision.pre_norm", "vision.blk.0.*",
                   "vision.blk.1.*", "vision.features", "vision.proj_fc1", "vision.proj_act", "vision.projector",
                   "vision.merger", "inputs_embeds", "positions", "blk.*.*", "output_norm", "logits"]
ARITHMETIC = {"storage": "f32", "kv": "f32", "patch": "f16", "act": "f16"}


def log(msg):
    progress("record_llamacpp_llava.py", msg)


# ---- conversion -----------------------------------------------------------------
def export_lm(model_dir, tmp):
    """The Llama LM alone as an HF folder (text_config, weights without the
    `language_model.` prefix, the tokenizer files)."""
    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)
    tc = dict(cfg["text_config"], architectures=["LlamaForCausalLM"], model_type="llama")
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(tc, f, indent=2, sort_keys=True)
    with safe_open(os.path.join(model_dir, "model.safetensors"), "np") as f:
        w = {k[len("language_model."):]: f.get_tensor(k) for k in f.keys() if k.startswith("language_model.")}
    save_file(w, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
    for fn in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        with open(os.path.join(model_dir, fn), "rb") as a, open(os.path.join(tmp, fn), "wb") as b:
            b.write(a.read())


def mmproj_tensors(w, n_keep):
    """(GGUF name, f32 array) in the legacy converter's order: the projector,
    then the CLIP state dict (its get_tensor_name mapping)."""
    out = [("mm.0.weight", "multi_modal_projector.linear_1.weight"), ("mm.0.bias", "multi_modal_projector.linear_1.bias"),
           ("mm.2.weight", "multi_modal_projector.linear_2.weight"), ("mm.2.bias", "multi_modal_projector.linear_2.bias"),
           ("v.class_embd", "vision_tower.embeddings.class_embedding"),
           ("v.patch_embd.weight", "vision_tower.embeddings.patch_embedding.weight"),
           ("v.position_embd.weight", "vision_tower.embeddings.position_embedding.weight"),
           ("v.pre_ln.weight", "vision_tower.pre_layrnorm.weight"), ("v.pre_ln.bias", "vision_tower.pre_layrnorm.bias")]
    sub = [("attn_k", "self_attn.k_proj"), ("attn_v", "self_attn.v_proj"), ("attn_q", "self_attn.q_proj"),
           ("attn_out", "self_attn.out_proj"), ("ln1", "layer_norm1"), ("ffn_down", "mlp.fc1"),
           ("ffn_up", "mlp.fc2"), ("ln2", "layer_norm2")]
    for i in range(n_keep):
        for g, h in sub:
            for s in ("weight", "bias"):
                out.append((f"v.blk.{i}.{g}.{s}", f"vision_tower.encoder.layers.{i}.{h}.{s}"))
    return [(g, np.ascontiguousarray(w[h], dtype=np.float32)) for g, h in out]


def convert(model_dir, out_dir):
    model_dir, out_dir = os.path.abspath(model_dir), os.path.abspath(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)
    assert cfg["model_type"] == "llava", "LLaVA-1.5 only"
    vc = cfg["vision_config"]
    assert cfg["vision_feature_select_strategy"] == "default" and vc["hidden_act"] == "quick_gelu"
    assert cfg["projector_hidden_act"] == "gelu" and cfg.get("multimodal_projector_bias", True)
    name = "touchstone-" + os.path.basename(os.path.dirname(model_dir.rstrip("/")))
    # the language model: convert_gguf.py on the exported Llama
    with tempfile.TemporaryDirectory() as tmp:
        export_lm(model_dir, tmp)
        subprocess.run([sys.executable, os.path.join(HERE, "convert_gguf.py"), tmp,
                        os.path.join(out_dir, "model.gguf"), "--model-name", name],
                       check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    # the mmproj: the legacy converter's keys and names, f32
    llama_dir = os.path.join(build_llamacpp.source_dir(), "vendor", "llama.cpp")
    sys.path.insert(0, os.path.join(llama_dir, "gguf-py"))
    import gguf  # noqa: E402
    assert os.path.dirname(gguf.__file__).startswith(llama_dir), f"wrong gguf: {gguf.__file__}"
    with open(os.path.join(model_dir, "preprocessor_config.json")) as f:
        pp = json.load(f)
    L = vc["num_hidden_layers"]
    fl = cfg["vision_feature_layer"]
    feature = fl if fl >= 0 else L + fl + 1  # the legacy converter's non-negative index
    with safe_open(os.path.join(model_dir, "model.safetensors"), "np") as f:
        w = {k: f.get_tensor(k) for k in f.keys()}
    path = os.path.join(out_dir, "mmproj.gguf")
    fout = gguf.GGUFWriter(path=path + ".tmp", arch="clip")
    fout.add_bool("clip.has_text_encoder", False)
    fout.add_bool("clip.has_vision_encoder", True)
    fout.add_bool("clip.has_llava_projector", True)
    fout.add_file_type(0)
    fout.add_name(name)
    fout.add_description("image encoder for LLaVA")
    fout.add_string("clip.projector_type", "mlp")
    fout.add_uint32("clip.vision.image_size", vc["image_size"])
    fout.add_uint32("clip.vision.patch_size", vc["patch_size"])
    fout.add_uint32("clip.vision.embedding_length", vc["hidden_size"])
    fout.add_uint32("clip.vision.feed_forward_length", vc["intermediate_size"])
    fout.add_uint32("clip.vision.projection_dim", vc["projection_dim"])
    fout.add_uint32("clip.vision.attention.head_count", vc["num_attention_heads"])
    fout.add_float32("clip.vision.attention.layer_norm_epsilon", vc["layer_norm_eps"])
    fout.add_uint32("clip.vision.block_count", feature)
    fout.add_array("clip.vision.feature_layer", [feature])
    fout.add_array("clip.vision.image_mean", [float(x) for x in pp["image_mean"]])
    fout.add_array("clip.vision.image_std", [float(x) for x in pp["image_std"]])
    fout.add_bool("clip.use_gelu", vc["hidden_act"] == "gelu")
    for g, a in mmproj_tensors(w, feature):
        fout.add_tensor(g, a)
    fout.write_header_to_file()
    fout.write_kv_data_to_file()
    fout.write_tensors_to_file()
    fout.close()
    os.replace(path + ".tmp", path)
    print(json.dumps({"model.gguf": sha256_file(os.path.join(out_dir, "model.gguf")), "mmproj.gguf": sha256_file(path)}))
    return 0


# ---- recording ----------------------------------------------------------------
class LlavaRec(Rec):
    """Rec plus the input fix (module docstring): before a GET_ROWS reads the
    `positions` or `patches` input, those indices are rewritten."""

    def __init__(self, g, n_patches):
        super().__init__(g)
        self.n = n_patches
        self.fixed = {}

    def callback(self, t, ask, user_data):
        if ask:
            tt = ctypes.cast(t, ctypes.POINTER(lib.GgmlTensor)).contents
            if self.g.ggml_op_desc(t).decode() == "GET_ROWS" and tt.src[1]:
                s = ctypes.cast(tt.src[1], ctypes.POINTER(lib.GgmlTensor)).contents
                nm = s.name.decode()
                want = {"positions": list(range(1, self.n + 1)) + [0], "patches": list(range(self.n))}.get(nm)
                if want is not None:
                    assert s.type == 26 and int(s.ne[0]) == len(want), f"{nm}: {s.type} {list(s.ne)}"  # GGML_TYPE_I32
                    arr = (ctypes.c_int32 * len(want)).from_address(s.data)
                    self.fixed[nm] = [int(x) for x in arr]  # what llama.cpp set
                    arr[:] = want
            return True
        return super().callback(t, ask, user_data)


def vision_stages(nodes, N, Ev, Hv, Fv, E, depth):
    """llama.cpp's clip_graph_llava nodes -> HF's vision stages (rows CLS first)."""
    R = N + 1
    perm = [N] + list(range(N))  # llama.cpp rows [p0..p(N-1), CLS] -> HF's [CLS, p0..]
    by_ptr = {n["ptr"]: n for n in nodes}
    arr = node_array

    def rows(n, shape):
        return np.ascontiguousarray(arr(n, shape)[perm])

    out = {}
    cat = next(n for n in nodes if n["op"] == "CONCAT")
    out["vision.patch_embed"] = arr(by_ptr[cat["srcs"][0]], (N, Ev))
    add = next(n for n in nodes[idx(nodes, cat):] if n["op"] == "ADD" and cat["ptr"] in n["srcs"])
    out["vision.pos_embed"] = rows(add, (R, Ev))
    out["vision.pre_norm"] = rows(node(nodes, "pre_ln"), (R, Ev))
    for i in range(depth):
        p = f"vision.blk.{i}."
        out[p + "norm1"] = rows(node(nodes, f"layer_inp_normed-{i}"), (R, Ev))
        for s, nm in (("q", "Qcur"), ("k", "Kcur"), ("v", "Vcur")):
            out[p + s] = rows(node(nodes, f"{nm}-{i}"), (R, Hv, Ev // Hv))
        lo, hi = idx(nodes, node(nodes, f"Vcur-{i}")), idx(nodes, node(nodes, f"attn_out-{i}"))
        sm = [n for n in nodes[lo:hi] if n["op"] == "SOFT_MAX"]
        assert len(sm) == 1, f"block {i}: {len(sm)} SOFT_MAX nodes"
        out[p + "attn_probs"] = np.ascontiguousarray(arr(sm[0], (Hv, R, R))[:, perm][:, :, perm])
        out[p + "attn_ctx"] = rows(node(nodes, f"kqv_out-{i}"), (R, Ev))
        out[p + "attn_out"] = rows(node(nodes, f"attn_out-{i}"), (R, Ev))
        out[p + "mlp_inp"] = rows(node(nodes, f"ffn_inp-{i}"), (R, Ev))
        out[p + "norm2"] = rows(node(nodes, f"ffn_inp_normed-{i}"), (R, Ev))
        out[p + "mlp_fc1"] = rows(node(nodes, f"ffn_up_b-{i}", "ADD"), (R, Fv))
        out[p + "mlp_act"] = rows(node(nodes, f"ffn_gelu_quick-{i}"), (R, Fv))
        out[p + "mlp_out"] = rows(node(nodes, f"ffn_out-{i}"), (R, Ev))
        out[p + "out"] = rows(node(nodes, f"layer_out-{i}"), (R, Ev))
    gr = [n for n in nodes if n["op"] == "GET_ROWS"]
    feat = gr[-1]
    out["vision.features"] = arr(feat, (N, Ev))
    after = nodes[idx(nodes, feat) + 1:]
    adds = [n for n in after if n["op"] == "ADD"]
    gelu = [n for n in after if n["op"] == "GELU" or (n["op"] == "UNARY" and "gelu" in n["name"].lower())]
    assert len(adds) == 2 and len(gelu) == 1, [(n["name"], n["op"]) for n in after]
    out["vision.proj_fc1"] = arr(adds[0], (N, E))
    out["vision.proj_act"] = arr(gelu[0], (N, E))
    out["vision.projector"] = arr(adds[1], (N, E))
    out["vision.merger"] = out["vision.projector"].copy()
    return out


def record(args):
    cache = os.path.abspath(args.cache_dir)
    lib_dir, binfo = build_llamacpp.ensure_built(cache, mtmd=True)
    lc, g = lib.load_bindings(build_llamacpp.source_dir(cache), lib_dir)
    os.environ["MTMD_CPP_LIB"] = lib_dir
    mt = importlib.import_module("llama_cpp.mtmd_cpp")

    hf = {}
    with safe_open(args.hf_golden, "np") as f:
        hf_prov = json.loads((f.metadata() or {})["provenance"])
        for k in f.keys():
            hf[k] = f.get_tensor(k)
    steps, cfg = hf_prov["steps"], hf_prov["model_config"]
    tcfg, vcfg = cfg["text_config"], cfg["vision_config"]
    n_layer = tcfg["num_hidden_layers"]
    dims = golden_io.model_dims(tcfg)
    H, KV, D, E, F, V, _ = dims
    img_id = cfg["image_token_index"]
    assert sha256_file(args.image) == hf_prov["image"]["sha256"], "not the HF golden's image"
    N = (vcfg["image_size"] // vcfg["patch_size"]) ** 2
    Ev, Hv, Fv = vcfg["hidden_size"], vcfg["num_attention_heads"], vcfg["intermediate_size"]
    depth = vcfg["num_hidden_layers"] + cfg["vision_feature_layer"] + 1

    quiet = lib.silence(lc)
    mt.mtmd_helper_log_set(quiet, None)
    mt.mtmd_log_set(quiet, None)
    model = lib.open_model(lc, args.gguf)
    assert model, f"cannot load {args.gguf}"
    n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(model))
    arch = lib.meta_str(lc, model, "general.architecture")
    assert arch == "llama", arch
    lrec, vrec = Rec(g), LlavaRec(g, N)
    lcb = lc.ggml_backend_sched_eval_callback(lrec.callback)
    vcb = lc.ggml_backend_sched_eval_callback(vrec.callback)
    ctx = lc.llama_init_from_model(model, lib.context_params(lc, 256, args.threads, "f32", lcb))
    assert ctx
    mp = mt.mtmd_context_params_default()
    mp.use_gpu, mp.print_timings, mp.n_threads, mp.warmup = False, False, args.threads, False
    mp.flash_attn_type = lc.LLAMA_FLASH_ATTN_TYPE_DISABLED
    mp.cb_eval, mp.cb_eval_user_data = vcb, None
    mctx = mt.mtmd_init_from_file(args.mmproj.encode(), model, mp)
    assert mctx, f"mtmd cannot load {args.mmproj}"
    assert mt.mtmd_support_vision(mctx) and not mt.mtmd_decode_use_mrope(mctx)

    # ---- tokenize: llama.cpp's chunks must be the HF golden's ids ---------------
    prompt = hf_prov["prompt"]["text"]
    assert prompt.count(IMAGE) == 1
    text = prompt.replace(IMAGE, mt.mtmd_default_marker().decode())
    bitmap = mt.mtmd_helper_bitmap_init_from_file(mctx, os.path.abspath(args.image).encode(), False)
    assert bitmap, "mtmd cannot read the image"
    bm = [mt.mtmd_bitmap_get_ny(bitmap), mt.mtmd_bitmap_get_nx(bitmap)]
    chunks = mt.mtmd_input_chunks_init()
    itext = mt.mtmd_input_text()
    tb = text.encode()
    itext.text, itext.text_len, itext.add_special, itext.parse_special = tb, len(tb), False, True
    rc = mt.mtmd_tokenize(mctx, chunks, ctypes.byref(itext), (mt.mtmd_bitmap_p_ctypes * 1)(bitmap), 1)
    assert rc == 0, f"mtmd_tokenize: {rc}"
    parts = []
    for i in range(mt.mtmd_input_chunks_size(chunks)):
        ch = mt.mtmd_input_chunks_get(chunks, i)
        if mt.mtmd_input_chunk_get_type(ch) == mt.MTMD_INPUT_CHUNK_TYPE_TEXT:
            n = ctypes.c_size_t()
            p = mt.mtmd_input_chunk_get_tokens_text(ch, ctypes.byref(n))
            parts.append(("text", [int(p[j]) for j in range(n.value)]))
        else:
            it = mt.mtmd_input_chunk_get_tokens_image(ch)
            parts.append(("image", ch, mt.mtmd_image_tokens_get_n_tokens(it)))
    hf_tokens = [int(x) for x in hf["prefill/tokens"]]
    ours = []
    for p in parts:
        ours += p[1] if p[0] == "text" else [img_id] * p[2]
    assert ours == hf_tokens, f"llama.cpp's chunks give {ours}, HF {hf_tokens}"
    img_part = next(p for p in parts if p[0] == "image")
    assert img_part[2] == N
    log(f"tokens = HF's ({len(ours)}), image {bm[1]}x{bm[0]} -> {N} image tokens")

    # ---- the vision tower -------------------------------------------------------
    assert mt.mtmd_encode_chunk(mctx, img_part[1]) == 0
    assert set(vrec.fixed) == {"positions", "patches"}, vrec.fixed
    assert vrec.fixed == {"positions": list(range(N + 1)), "patches": list(range(1, N + 1))}, vrec.fixed
    if args.list_nodes:
        for i, nd in enumerate(vrec.nodes):
            print(f"vision {i:4d} {nd['name']:<22} {nd['op']:<10} {list(reversed(nd['ne']))}", file=sys.stderr)
    emb = np.ctypeslib.as_array(mt.mtmd_get_output_embd(mctx), shape=(N * E,)).copy().reshape(N, E)
    ims = [n["src1"] for n in vrec.nodes if n["op"] == "IM2COL"]
    assert len(ims) == 1
    vs = vision_stages(vrec.nodes, N, Ev, Hv, Fv, E, depth)
    vs["vision.pixels"] = np.ascontiguousarray(ims[0].reshape((1,) + ims[0].shape[-3:]), dtype=np.float32)
    assert np.array_equal(emb, vs["vision.merger"], equal_nan=True), "mtmd output != projector node"
    vrec.nodes = []

    # ---- the language model -------------------------------------------------------
    keep = set(golden_io.all_stages("llama", n_layer)) - {"embed"}
    attn = {"arch": "llama", "scale": 1.0 / np.sqrt(D), "windows": [None] * n_layer, "rope_bases": None}

    def decode(toks=None, embd=None, cell0=0):
        n = len(toks) if toks is not None else embd.shape[0]
        b = lc.llama_batch_init(n, 0 if toks is not None else E, 1)
        try:
            b.n_tokens = n
            for i in range(n):
                if toks is not None:
                    b.token[i] = toks[i]
                b.pos[i], b.n_seq_id[i], b.logits[i] = cell0 + i, 1, 1
                b.seq_id[i][0] = 0
            if embd is not None:
                flat = np.ascontiguousarray(embd, dtype=np.float32).reshape(-1)
                ctypes.memmove(b.embd, flat.ctypes.data, flat.nbytes)
            lrec.nodes = []
            assert lc.llama_decode(ctx, b) == 0
        finally:
            lc.llama_batch_free(b)
        nodes, lrec.nodes = lrec.nodes, []
        st = graph.canonical(nodes, "x", "llama", n_layer, n, cell0 + n, True, dims, keep,
                             list(range(cell0, cell0 + n)), attn, finite=False)
        inp = None
        if toks is not None:
            gr = [x for x in nodes if x["op"] == "GET_ROWS"]
            assert gr and gr[0]["ne"][:2] == [E, n], "no embedding lookup"
            inp = gr[0]["data"].reshape(n, E)
        api = np.stack([np.ctypeslib.as_array(lc.llama_get_logits_ith(ctx, i), shape=(n_vocab,)).copy()
                        for i in range(n)])
        return st, inp, api, nodes

    assert np.array_equal(hf["prefill/positions"], np.arange(len(hf_tokens)))
    chunks_out, cell, api_vs_graph, greedy_ids = [], 0, 0.0, []
    for p in parts:
        if p[0] == "text":
            st, inp, api, nodes = decode(toks=p[1], cell0=cell)
        else:
            st, _, api, nodes = decode(embd=emb, cell0=cell)
            inp = emb
        if args.list_nodes:
            for i, nd in enumerate(nodes):
                print(f"lm-{p[0]} {i:4d} {nd['name']:<22} {nd['op']:<10} {list(reversed(nd['ne']))}", file=sys.stderr)
        api_vs_graph = max(api_vs_graph, api_check(api, st["logits"]))
        st["inputs_embeds"] = np.ascontiguousarray(inp, dtype=np.float32)
        chunks_out.append(st)
        cell += len(st["logits"])
    T = cell
    merged = {}
    for k in chunks_out[0]:
        square = k.endswith("attn_probs") or k.endswith("attn_scores")
        rows = [np.pad(st[k], ((0, 0), (0, 0), (0, T - st[k].shape[2]))) if square else st[k] for st in chunks_out]
        merged[k] = np.ascontiguousarray(np.concatenate(rows, axis=1 if square else 0), dtype=np.float32)
    merged["tokens"] = np.array(hf_tokens, dtype=np.int64)
    merged["positions"] = hf["prefill/positions"].astype(np.int64)
    watch = overflow.Watch("float32", args.oracle)
    out = {}

    def keep_step(step, st, prefill):
        order = golden_io.vlm_order("llava", "llama", depth, 0, n_layer, prefill)
        watch.scan(step, st, [s for s in order if s in st])
        if np.isfinite(st["logits"]).all():
            greedy_ids.append(int(st["logits"][-1].argmax()))
        out.update({f"{step}/{k}": v for k, v in st.items() if k in ("tokens", "positions") or watch.keeps(step, k)})
    keep_step("prefill", {**vs, **merged}, True)
    for step in steps[1:]:
        tok = [int(x) for x in hf[f"{step}/tokens"]]
        pos = hf[f"{step}/positions"]
        assert [int(x) for x in pos.reshape(-1)] == [cell]
        if watch.found is not None:
            out[f"{step}/tokens"], out[f"{step}/positions"] = np.array(tok, dtype=np.int64), pos.astype(np.int64)
            continue
        st, _, api, _ = decode(toks=tok, cell0=cell)
        api_vs_graph = max(api_vs_graph, api_check(api, st["logits"]))
        cell += 1
        st["tokens"], st["positions"] = np.array(tok, dtype=np.int64), pos.astype(np.int64)
        keep_step(step, st, False)
    assert api_vs_graph == 0.0, api_vs_graph
    mt.mtmd_input_chunks_free(chunks)
    mt.mtmd_bitmap_free(bitmap)
    mt.mtmd_free(mctx)
    lc.llama_free(ctx)
    lc.llama_model_free(model)

    skipped = [k for k in hf if k.split("/", 1)[1] == "embed" or k.split("/", 1)[1].startswith("vision.blk.2.")]
    if watch.found is None and "overflow" not in hf_prov:
        missing = sorted(k for k in hf if k not in out and k not in skipped)
        extra = sorted(k for k in out if k not in hf)
        assert not missing and not extra, (missing, extra)
    for k, v in out.items():
        assert v.shape == hf[k].shape and v.dtype == hf[k].dtype, f"{k}: {v.shape} {v.dtype} vs HF {hf[k].shape}"
    assert np.array_equal(out["prefill/vision.pixels"], hf["prefill/vision.pixels"]), "pixels differ from HF's"

    versions, build = lib.versions_and_build(binfo)
    prov = {
        "source": "llama.cpp", "recorder": RECORDER, "versions": versions, "build": build,
        "settings": {"kv_cache_type": "f32", "flash_attn": "disabled (LM and vision)", "n_threads": args.threads,
                     "n_ctx": 256, "n_gpu_layers": 0, "logits": "all tokens",
                     "tokens": "prompt: llama.cpp's mtmd chunks, asserted equal to the HF golden's; decode: "
                               "teacher-forced from the HF golden",
                     "image": "mtmd_helper_bitmap_init_from_file + llama.cpp's own preprocessing (equal to HF's "
                              "pixels bit for bit)"},
        "input_fix": {"why": "clip_graph_llava appends the class embedding after the patches but indexes position "
                             "embeddings and output rows as if it came first",
                      "llama_cpp_set": vrec.fixed,
                      "fed": {"positions": list(range(1, N + 1)) + [0], "patches": list(range(N))}},
        "gguf_sha256": sha256_file(args.gguf), "mmproj_sha256": sha256_file(args.mmproj),
        "gguf_architecture": arch, "hf_golden_sha256": sha256_file(args.hf_golden),
        "image": {"file": os.path.basename(args.image), "sha256": sha256_file(args.image), "bitmap": bm},
        "prompt": {"text": prompt, "chat": False, "token_ids": hf_tokens, "mtmd_text": text},
        "greedy_ids": greedy_ids, "decode_steps": len(steps) - 1, "steps": steps, "model_config": cfg,
        "qk_unpermuted": True,
        "record": {"stages": RECORDED_STAGES, "not_recorded": STAGE_NOTES},
        "arithmetic": ARITHMETIC,
        "arithmetic_notes": "patch: im2col holds the pixels in f16 and the F16 x F32 matmul rounds the Conv2d kernel "
                            "to f16; act: the tower's quick-GELU and the projector's GELU read ggml's f16 tables at "
                            "the f16-rounded input (the LM's SiLU is f32); the projector's GELU is the tanh form "
                            "(HF: erf)",
    }
    if watch.found is not None:
        prov["overflow"] = watch.found
        prov["overflow_skipped"] = overflow.skipped(watch.found, [], [], [])
    golden_io.write_golden(out, golden_io.metadata(prov), args.out_file)
    print(json.dumps({"out": args.out_file, "tensors": len(out), "sha256": sha256_file(args.out_file),
                      "greedy_ids": greedy_ids, "hf_greedy_ids": hf_prov["greedy_ids"]}))
    watch.report()
    return 0


def compare(args):
    """Per stage (every step): max |llama.cpp - oracle| against max |HF - oracle|, and the greedy ids."""
    def load(p):
        with safe_open(p, "np") as f:
            return {k: f.get_tensor(k) for k in f.keys()}, json.loads(f.metadata()["provenance"])
    (lc, lp), (hf, hp), (orc, _) = load(args.llamacpp), load(args.hf), load(args.oracle)
    print(f"{'stage':34s} {'llama.cpp':>10s} {'HF':>10s} {'ratio':>8s}")
    for k in lc:
        if k.rsplit("/", 1)[1] in ("tokens", "positions"):
            assert np.array_equal(lc[k], hf[k]), k
            continue
        a = float(np.abs(lc[k].astype(np.float64) - orc[k]).max())
        b = float(np.abs(hf[k].astype(np.float64) - orc[k]).max())
        print(f"{k:34s} {a:10.2e} {b:10.2e} {a / b if b else float('inf'):8.0f}")
    print(f"greedy ids: llama.cpp {lp['greedy_ids']}, HF {hp['greedy_ids']}, "
          f"{'equal' if lp['greedy_ids'] == hp['greedy_ids'] else 'DIFFERENT'}")
    return 0 if lp["greedy_ids"] == hp["greedy_ids"] else 1


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("convert")
    c.add_argument("model_dir")
    c.add_argument("out_dir")
    r = sub.add_parser("record")
    r.add_argument("gguf")
    r.add_argument("mmproj")
    r.add_argument("out_file")
    r.add_argument("--hf-golden", required=True)
    r.add_argument("--image", required=True)
    r.add_argument("--oracle", default=None)
    r.add_argument("--threads", type=int, default=1)
    r.add_argument("--list-nodes", action="store_true")
    r.add_argument("--cache-dir", default=build_llamacpp.DEFAULT_CACHE)
    m = sub.add_parser("compare")
    for a in ("llamacpp", "hf", "oracle"):
        m.add_argument(a)
    args = ap.parse_args()
    if args.cmd == "compare":
        return compare(args)
    return convert(args.model_dir, args.out_dir) if args.cmd == "convert" else record(args)


if __name__ == "__main__":
    sys.exit(main())
