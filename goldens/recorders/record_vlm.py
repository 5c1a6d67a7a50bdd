#!/usr/bin/env python3
"""Record golden tensors of a vision-language model (Qwen2-VL, Qwen3-VL, LLaVA-1.5, LLaVA-NeXT) with HF transformers.

usage: record_vlm.py MODEL_DIR OUT_FILE --prompt TEXT --image PNG [--chat] [--decode-steps N]
                     [--dtype float32|float64] [--oracle ORACLE]

MODEL_DIR is an HF folder as make_vlm_model.py writes it (config.json,
model.safetensors, tokenizer.json, tokenizer_config.json with the chat
template, preprocessor_config.json). TEXT holds the image placeholder
`<|vision_start|><|image_pad|><|vision_end|>` literally, once. With --chat it
is rendered by the tokenizer's chat template as ONE user message whose
content is that plain string, with the generation prompt
(apply_chat_template(tokenize=False, add_generation_prompt=True)); without,
it is used as it is. The processor (Qwen2VLProcessor / Qwen3VLProcessor
around the PIL image processor Qwen2VLImageProcessorPil built from
preprocessor_config.json, no video processor) then takes text=[rendered],
images=[the PNG as PIL loads it] and expands the one <|image_pad|> into M =
grid_t*grid_h*grid_w / merge^2 copies; its input_ids are asserted equal to
tokenizer.json's own encoding of the expanded text.

The model runs as record_hf.py runs a text model (PyTorch, CPU, one thread,
deterministic algorithms, eager attention in the LM AND the vision tower,
asserted): one prefill pass (input_ids, pixel_values, image_grid_thw,
mm_token_type_ids; no position ids and no attention mask: HF computes the
M-RoPE positions with get_rope_index and keeps rope_deltas), then N greedy
decode steps through the KV cache, each fed this run's own greedy id (the
HF float32 golden's ids are the oracle's too: asserted by the sanity check,
see the README), positions as HF derives them (cache length + rope_deltas).
The positions stored are those HF's rotary embedding received. Cross-checks:
HF's own generate() (greedy, same inputs) must produce the same ids; one
forward over prompt + fed tokens must give the last step's logits
(provenance cache_vs_full_max_abs_diff).

Keys are `<step>/<stage>` (the contract of issue 24, /goldens/recorders/
README.md "Vision-language models"); N patches, M image tokens, Ev/Hv/Dv/Fv
the vision hidden/heads/head dim/MLP width, E the LM hidden, T tokens:

  prefill/vision.pixels          [N, C*Tp*P*P] the processor's pixel_values (float32 as given)
  prefill/vision.grid            [1, 3] int64  image_grid_thw
  prefill/vision.patch_embed     [N, Ev]       patch_embed output (Conv3d; Qwen3-VL with its bias)
  prefill/vision.pos_embed       [N, Ev]       Qwen3-VL: patch_embed + bilinearly interpolated
                                               learned position embeddings (the input of block 0)
  prefill/vision.blk.{i}.norm1 / q / k / v / q_rope / k_rope / attn_probs / attn_ctx / attn_out /
                  mlp_inp / norm2 / mlp_fc1 / mlp_act / mlp_out / out
        norm1, mlp_inp, norm2, attn_out, mlp_out, out [N, Ev]; q, k, v, q_rope, k_rope [N, Hv, Dv]
        (q/k/v from the fused qkv with its bias, before the 2-D rotary); attn_probs [Hv, N, N]
        (softmax, bidirectional: no mask); attn_ctx [N, Hv*Dv] (input of attn.proj);
        mlp_fc1, mlp_act [N, Fv] (fc1 output, activation output: quick_gelu / gelu_pytorch_tanh)
  prefill/vision.merger_norm     [N, Ev]       Qwen2-VL merger.ln_q, Qwen3-VL merger.norm output
  prefill/vision.merger          [M, E]        the merger's output (the image features)
  prefill/vision.deepstack.{j}   [M, E]        Qwen3-VL: deepstack_merger_list[j] output (taken
                                               after vision block deepstack_visual_indexes[j])
  prefill/inputs_embeds          [T, E]        the LM's input: embed with the image-pad rows
                                               replaced by vision.merger (masked_scatter)
  <step>/tokens [T] int64, <step>/positions [3, T] int64 (M-RoPE t, h, w; decode [3, 1])
  <step>/embed, blk.{i}.* ... logits           record_hf.py's LM stages, every step, every row
                                               (Qwen3-VL with q_norm/k_norm)
  prefill/blk.{i}.deepstack      [T, E]        Qwen3-VL, i < len(deepstack_visual_indexes): the
                                               hidden after the deepstack add that follows layer i
                                               (blk.{i}.out is the layer's output, before the add)

Patch order everywhere in the vision tower is the processor's (merge-window
order: t, h/m, w/m, m, m).

--dtype float64 records the ORACLE (vlm_oracle_f64.py): the whole model
converted to float64 (tiny models: no streaming needed; record_hf.py's
streamed oracle equals the whole-model conversion, docs/goldens.md) and the
processor's float32 pixel_values widened exactly to float64 before the
forward. HF's float32
islands are replaced for the run by the same formulas in float64 (each
checked against HF's own float32 version): the LM's RMSNorm (q_norm/k_norm
too), the LM's M-RoPE tables (inv_freq 1/theta^(2i/d) and angles in float64,
then HF's own recomposition_frequencies), the vision tower's 2-D RoPE tables,
apply_rotary_pos_emb_vision (HF casts q, k, cos, sin to float32), the eager
softmax (dtype=float32 in HF), and Qwen3-VL's bilinear interpolation weights
of the learned position embeddings (HF computes them in float32; here the
same taps, the weights in float64). oracle_f64.py's F32Guard asserts no
operation of any forward produced a floating tensor of another dtype. Stored
tensors are the float64 values rounded once to float32; vision.pixels is the
processor's float32 input as given.

The hooks: hf_hooks.Recorder for the LM, vlm_hooks.VisionRecorder for the
vision tower and the fusion.

An overflow is data (overflow.py): every stage of every step is watched in
execution order (the vision stages, embed, inputs_embeds, then the LM's,
golden_io.vlm_order); at the first non-finite one nothing more is stored,
the steps after it are not run (each is fed the previous step's greedy
pick, which non-finite logits do not give), provenance `overflow` says where
(`oracle_max_abs` from --oracle, the float64 oracle's golden) and the
cross-checks run on the steps before it; exit 0, one `overflow: ` line.

LLaVA-1.5 and LLaVA-NeXT (model_type llava, llava_next; issue 39) are
recorded by llava_recording.py (its docstring: the inputs, what the
processor does, asserted). TEXT holds `<image>` once and is used as it is
(no --chat: LLaVA-1.5's `USER: <image>\nWhat is in the picture? ASSISTANT:`
is a plain string). No mm_token_type_ids, no M-RoPE: positions are [T],
0..T-1 then one per decode step. P is the number of 56x56 images the CLIP
tower sees (LLaVA-1.5: 1; NeXT: the base image, then the tiles row-major),
N its patches per image (16), R = N + 1 rows with CLS, Ev/Hv/Fv the tower's
hidden/heads/MLP width, E the LM hidden, M the image rows (the expanded
<image> tokens):

  prefill/vision.pixels          [P, 3, 56, 56] the processor's pixel_values (float32, the P used)
  prefill/vision.patch_embed     [P*N, Ev]     the patch Conv2d's output, row-major patches, image by image
  prefill/vision.pos_embed       [P*R, Ev]     cat(class_embedding, patches) + position_embedding (CLS first)
  prefill/vision.pre_norm        [P*R, Ev]     pre_layrnorm's output (CLIP's hidden_states[0])
  prefill/vision.blk.{i}.norm1 / q / k / v / attn_probs / attn_ctx / attn_out / mlp_inp / norm2 /
                  mlp_fc1 / mlp_act / mlp_out / out     (every block, the unused last one too)
        q, k, v [P*R, Hv, Dv] (q_proj/k_proj/v_proj with bias; q not pre-scaled); attn_probs
        [P*Hv, R, R] (image p's head h at p*Hv + h; softmax(q k^T Dv^-0.5), no mask); mlp_fc1,
        mlp_act [P*R, Fv] (quick_gelu); the others [P*R, Ev]
  prefill/vision.features        [P*N, Ev]     hidden_states[vision_feature_layer] without CLS
                                               (= vision.blk.{L-2}.out without its CLS rows)
  prefill/vision.proj_fc1 / proj_act / projector  [P*N, E]  linear_1, GELU (erf), linear_2
  prefill/vision.merger          [M, E]        the rows that replace the <image> tokens: LLaVA-1.5
                                               vision.projector itself; NeXT the base image's rows,
                                               then the unpadded tile grid row by row, each row
                                               followed by image_newline
  prefill/inputs_embeds          [T, E]        embed with the <image> rows replaced by vision.merger
  <step>/tokens [T], <step>/positions [T], and record_hf.py's Llama stages, every step, every row

build_provenance: versions (+ pillow), prompt {text, chat, rendered,
token_ids}, greedy_ids, decode_steps, steps, model_config (config.json as
saved, vision_config included), seeds, dtype, model_sha256,
tokenizer_sha256, cache_vs_full_max_abs_diff) plus image {file, sha256,
size [H, W]}, preprocessor_sha256, processor {the settings used},
grid_thw, generate_ids. Nothing varies between runs or machines: a rerun
with the pinned packages is byte-for-byte identical.
"""
import argparse
import contextlib
import importlib
import json
import os
import sys
import types

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np
import PIL
import tokenizers
import torch
import transformers
from PIL import Image
from transformers import (AutoTokenizer, LlavaForConditionalGeneration, LlavaNextForConditionalGeneration,
                          LlavaNextProcessor, LlavaProcessor, Qwen2VLForConditionalGeneration,
                          Qwen3VLForConditionalGeneration)
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from transformers.models.qwen2_vl.processing_qwen2_vl import Qwen2VLProcessor
from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor

sys.dont_write_bytecode = True
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import golden_io  # noqa: E402
from golden_io import progress, sha256_file  # noqa: E402
import hf_model  # noqa: E402  (determinism, provenance)
import llava_recording  # noqa: E402  (model_type llava, llava_next)
import overflow  # noqa: E402  (a forward that overflows is data)
import vlm_oracle_f64  # noqa: E402
from hf_hooks import Recorder, attention_rows, attention_summary, config_dims  # noqa: E402
from model_source import folder_source  # noqa: E402
from oracle_f64 import F32Guard, allowed  # noqa: E402
from golden_io import vision_stages  # noqa: E402
from vlm_hooks import VisionRecorder, images_only, processor_settings, std_line, vision_shape  # noqa: E402

RECORDER = "goldens/recorders/record_vlm.py"
PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"
FAMILIES = {
    # model_type: (model class, processor class, golden_io stage family of the LM)
    "qwen2_vl": (Qwen2VLForConditionalGeneration, Qwen2VLProcessor, "qwen2"),
    "qwen3_vl": (Qwen3VLForConditionalGeneration, Qwen3VLProcessor, "qwen3"),
    # LLaVA: recorded by llava_recording.py (AutoProcessor reads the folder's processor files).
    "llava": (LlavaForConditionalGeneration, LlavaProcessor, "llama"),
    "llava_next": (LlavaNextForConditionalGeneration, LlavaNextProcessor, "llama"),
}


def log(msg):
    progress("record_vlm.py", msg)


def vision_attention_rows(rec, depth, Hv, N):
    """(row max, row max x N, normalised entropy) of every vision attention
    row (a sanity print: nothing saturated, nothing uniform)."""
    rows = []
    for bi in range(depth):
        pr = rec[f"vision.blk.{bi}.attn_probs"].astype(np.float64)  # [Hv,N,N]
        for h in range(Hv):
            mx = pr[h].max(-1)
            ent = -(pr[h] * np.log(np.clip(pr[h], 1e-300, 1))).sum(-1) / np.log(N)
            rows += list(zip(mx, mx * N, ent))
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("out_file")
    ap.add_argument("--prompt", required=True, help=f"text with the placeholder {PLACEHOLDER} once")
    ap.add_argument("--image", required=True, help="the PNG (RGB)")
    ap.add_argument("--chat", action="store_true", help="render with the chat template (one user message)")
    ap.add_argument("--decode-steps", type=int, default=4)
    ap.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    ap.add_argument("--oracle", default=None, metavar="ORACLE",
                    help="the float64 oracle's golden: an overflow's provenance gives its largest |x| there")
    args = ap.parse_args()
    if args.oracle is not None:
        overflow.check_oracle(args.oracle)
    if args.decode_steps < 0:
        ap.error("--decode-steps must be >= 0")
    args.tokens_from = None  # for hf_model.build_provenance
    hf_model.make_deterministic()
    transformers.utils.logging.disable_progress_bar()

    with open(os.path.join(args.model, "config.json")) as f:
        cfg_file = json.load(f)
    mt = cfg_file["model_type"]
    if mt not in FAMILIES:
        sys.exit(f"record_vlm.py: model_type {mt!r} is not one of {sorted(FAMILIES)}")
    if mt in golden_io.LLAVA_TYPES:
        return llava_recording.record(args, cfg_file, log, RECORDER)
    if args.prompt.count(PLACEHOLDER) != 1:
        ap.error(f"--prompt must hold {PLACEHOLDER} exactly once")
    model_cls, proc_cls, stage_family = FAMILIES[mt]
    tok = AutoTokenizer.from_pretrained(args.model)
    ip = Qwen2VLImageProcessorPil.from_pretrained(args.model)
    processor = images_only(proc_cls)(image_processor=ip, tokenizer=tok, video_processor=None,
                                      chat_template=tok.chat_template)
    model = model_cls.from_pretrained(args.model, dtype=torch.float32, attn_implementation="eager").eval()
    cfg = model.config
    vis, lm = model.model.visual, model.model.language_model
    assert cfg._attn_implementation == "eager" and vis.config._attn_implementation == "eager" \
        and lm.config._attn_implementation == "eager", "eager attention everywhere"
    assert all(p.dtype == torch.float32 for p in model.parameters())
    modeling = importlib.import_module(type(model).__module__)

    # ---- inputs -------------------------------------------------------------
    image = Image.open(args.image)
    image.load()
    assert image.mode == "RGB", image.mode
    W, H = image.size
    if args.chat:
        text = tok.apply_chat_template([{"role": "user", "content": args.prompt}], tokenize=False,
                                       add_generation_prompt=True)
    else:
        text = args.prompt
    inputs = processor(text=[text], images=[image], return_tensors="pt")
    ids = inputs["input_ids"]
    grid = inputs["image_grid_thw"]
    pixels = inputs["pixel_values"]
    mm_types = inputs["mm_token_type_ids"]
    assert ids.shape[0] == 1 and grid.shape == (1, 3) and pixels.dtype == torch.float32
    prompt_ids = ids[0].tolist()
    merge = ip.merge_size
    N = int(grid.prod())
    M = N // merge ** 2
    assert pixels.shape[0] == N and prompt_ids.count(cfg.image_token_id) == M
    assert (mm_types[0] == 1).tolist() == [t == cfg.image_token_id for t in prompt_ids]
    expanded = text.replace("<|image_pad|>", "<|image_pad|>" * M)
    raw = tokenizers.Tokenizer.from_file(os.path.join(args.model, "tokenizer.json"))
    assert raw.encode(expanded, add_special_tokens=False).ids == prompt_ids, "processor vs tokenizer.json"
    log(f"{mt}: image {W}x{H} -> grid_thw {grid[0].tolist()}, {N} patches, {M} image tokens; "
        f"prompt {len(prompt_ids)} tokens; {args.decode_steps} decode steps; {args.dtype}")

    guard = None
    patched = None
    if args.dtype == "float64":
        patched = vlm_oracle_f64.to_float64_vlm(model, modeling)
        guard = F32Guard()
        vlm_oracle_f64.GUARD[0] = guard
        pixel_in = pixels.to(torch.float64)
        # get_rope_index's integer bookkeeping: get_vision_position_ids
        # computes `(arange(t) * time_interval).long()`, a float32 product of
        # small integers by 1.0 (exact) turned back into int64 positions; no
        # value of the forward passes through it. Allowed, the result asserted
        # int64.
        orig_gvp = model.model.get_vision_position_ids

        def gvp(*a, **k):
            with allowed(guard):
                p_ = orig_gvp(*a, **k)
            assert p_.dtype == torch.int64
            return p_
        model.model.get_vision_position_ids = gvp
        patched["rope_index_integer_positions"] = "allowed (float32 arange * 1.0 -> int64, exact)"
        log(f"float64 oracle: {patched}")
    else:
        pixel_in = pixels

    # ---- record -------------------------------------------------------------
    shim = types.SimpleNamespace(model=lm, lm_head=model.lm_head, config=cfg.text_config)
    r = Recorder(shim)
    r.guard = guard
    r.install()
    v = VisionRecorder(model, modeling, r, guard)
    v.install()
    tcfg = cfg.text_config
    n_layers = tcfg.num_hidden_layers
    n_ds = len(getattr(cfg.vision_config, "deepstack_visual_indexes", []) or [])
    depth = cfg.vision_config.depth
    dims = config_dims(tcfg)
    H_, KV_, D_, E_ = dims[:4]
    vc = cfg.vision_config
    Ev = vc.embed_dim if mt == "qwen2_vl" else vc.hidden_size
    Hv = vc.num_heads
    Fv = int(vc.embed_dim * vc.mlp_ratio) if mt == "qwen2_vl" else vc.intermediate_size
    lm_expected = golden_io.all_stages(stage_family, n_layers) + ["tokens", "positions"]
    out, steps, greedy_ids, clean, not_run, step_last_logits = {}, [], [], [], [], []
    att_rows = {"prefill": [], "decode": []}
    vision_rows = []
    stds = {}
    fed = list(prompt_ids)
    x = ids
    past, pos = None, 0
    model.model.rope_deltas = None
    watch = overflow.Watch(args.dtype, args.oracle)
    all_steps = ["prefill"] + [f"decode{i}" for i in range(1, args.decode_steps + 1)]
    try:
        with torch.no_grad():
            for si, step in enumerate(all_steps):
                steps.append(step)
                r.rec.clear()
                v.rec.clear()
                r.step = step
                T = x.shape[1]
                r.S = pos + T
                kw = dict(pixel_values=pixel_in, image_grid_thw=grid, mm_token_type_ids=mm_types) if si == 0 else {}
                with guard or contextlib.nullcontext():
                    res = model(input_ids=x, past_key_values=past, use_cache=True, return_dict=True, **kw)
                past = res.past_key_values
                assert past.get_seq_length() == pos + T
                # LM stages (hf_hooks.Recorder + the attention probabilities).
                assert np.array_equal(r.rec["logits"], res.logits[0].to(torch.float32).numpy(), equal_nan=True)
                r.rec["tokens"] = x[0].numpy().astype(np.int64)
                positions = r.rec["positions"]
                want = lm_expected + ([f"blk.{i}.deepstack" for i in range(n_ds)] if si == 0 else [])
                assert sorted(r.rec) == sorted(want), sorted(set(r.rec) ^ set(want))
                for k, val in r.rec.items():
                    if k == "positions":
                        assert val.shape == (3, T), val.shape
                    elif k.endswith(".deepstack"):
                        assert val.shape == (T, E_), (k, val.shape)
                    else:
                        assert val.shape == golden_io.expected_shape(k, T, pos + T, dims), (k, val.shape)
                if si == 0:
                    # Vision and fusion stages.
                    v.rec["vision.pixels"] = pixels[0:N].numpy().copy()
                    v.rec["vision.grid"] = grid.numpy().astype(np.int64).copy()
                    want_v = vision_stages(mt, depth, n_ds) + ["inputs_embeds"]
                    assert sorted(v.rec) == sorted(want_v), sorted(set(v.rec) ^ set(want_v))
                    for k, val in v.rec.items():
                        shape = (T, E_) if k == "inputs_embeds" else vision_shape(
                            k, N, M, Ev, Hv, Ev // Hv, Fv, E_, pixels.shape[1])
                        assert val.shape == shape, (k, val.shape, shape)
                else:
                    # Decode: text position + rope delta, the same in all 3 rows.
                    assert (positions == positions[0:1]).all(), positions
                # Every stage, vision first, watched in execution order
                # (overflow.py); what came before an overflow is stored.
                tensors = {**v.rec, **r.rec}
                if watch.scan(step, tensors, golden_io.vlm_order(mt, stage_family, depth, n_ds, n_layers, si == 0)):
                    clean.append(step)
                    for li in range(n_layers):
                        att_rows["prefill" if si == 0 else "decode"] += attention_rows(
                            r.rec[f"blk.{li}.attn_probs"], np.arange(pos, pos + T))
                    if si == 0:
                        vision_rows = vision_attention_rows(v.rec, depth, Hv, N)
                        stds = std_line(tensors)
                out.update({f"{step}/{k}": val for k, val in tensors.items()
                            if k in ("tokens", "positions") or watch.keeps(step, k)})
                pos += T
                if not np.isfinite(res.logits[0]).all():
                    not_run = all_steps[si + 1:]  # no greedy pick to feed them
                    log(f"{step}: {T} token(s): non-finite logits, {len(not_run)} later step(s) not run")
                    break
                greedy = int(res.logits[0, -1].argmax())
                greedy_ids.append(greedy)
                log(f"{step}: {T} token(s), positions t {positions[0].min()}..{positions[0].max()}, "
                    f"greedy {greedy}")
                fed.append(greedy)
                x = torch.tensor([[greedy]], dtype=torch.int64)
                step_last_logits.append(res.logits[0, -1].to(torch.float64).numpy().copy())
    finally:
        v.remove()
        r.remove()
    rope_deltas = int(model.model.rope_deltas.reshape(-1)[0])
    for si, step in enumerate(steps[1:], start=1):
        p = out[f"{step}/positions"]
        assert p.shape == (3, 1) and int(p[0, 0]) == len(prompt_ids) + si - 1 + rope_deltas, (step, p, rope_deltas)

    # KV-cache cross-check: one forward over prompt + fed tokens, up to the
    # last step before any overflow.
    cache_vs_full = None
    if clean:
        full = torch.tensor([fed[:len(prompt_ids) + len(clean) - 1]], dtype=torch.int64)
        mm_full = torch.cat([mm_types, torch.zeros((1, full.shape[1] - mm_types.shape[1]), dtype=mm_types.dtype)],
                            1)
        model.model.rope_deltas = None
        with torch.no_grad(), guard or contextlib.nullcontext():
            lf = model(input_ids=full, pixel_values=pixel_in, image_grid_thw=grid, mm_token_type_ids=mm_full,
                       use_cache=False).logits[0, -1].to(torch.float64).numpy()
        cache_vs_full = overflow.finite_or_none(np.abs(lf - step_last_logits[len(clean) - 1]).max())
        assert watch.found is not None or cache_vs_full < 1e-3, cache_vs_full
    if guard is not None:
        assert not guard.bad, f"float64 run: ops produced other float dtypes: {dict(guard.bad)}"
    # HF's own greedy generation on the same inputs must pick the same ids
    # (the steps with finite logits: all of them without an overflow).
    model.model.rope_deltas = None
    with torch.no_grad():
        gen = model.generate(input_ids=ids, attention_mask=inputs["attention_mask"], pixel_values=pixel_in,
                             image_grid_thw=grid, mm_token_type_ids=mm_types, do_sample=False,
                             max_new_tokens=args.decode_steps + 1, min_new_tokens=args.decode_steps + 1,
                             eos_token_id=None, pad_token_id=tok.pad_token_id)
    gen_ids = gen[0, len(prompt_ids):].tolist()
    assert gen_ids[:len(greedy_ids)] == greedy_ids, f"generate() picked {gen_ids}, the recording {greedy_ids}"

    # ---- provenance ---------------------------------------------------------
    prompt = {"text": args.prompt, "token_ids": prompt_ids}
    if args.chat:
        prompt = {"text": args.prompt, "chat": True, "rendered": text, "token_ids": prompt_ids}
    prov = hf_model.build_provenance(args, prompt, cfg_file, greedy_ids, steps, cache_vs_full,
                                     folder_source(args.model), None, None, RECORDER)
    prov["versions"]["pillow"] = PIL.__version__
    prov["image"] = {"file": os.path.basename(args.image), "sha256": sha256_file(args.image), "size": [H, W]}
    prov["preprocessor_sha256"] = sha256_file(os.path.join(args.model, "preprocessor_config.json"))
    prov["processor"] = processor_settings(ip)
    prov["grid_thw"] = grid[0].tolist()
    prov["rope_deltas"] = rope_deltas
    prov["generate_ids"] = gen_ids
    if patched is not None:
        prov["float64"] = patched
    if watch.found is not None:
        prov["overflow"] = watch.found
        prov["overflow_skipped"] = overflow.skipped(watch.found, clean, not_run, ["cache_vs_full", "generate"])
    golden_io.write_golden(out, golden_io.metadata(prov), args.out_file, log)
    va = np.array(vision_rows)
    print(json.dumps({
        "out": args.out_file, "tensors": len(out), "bytes": os.path.getsize(args.out_file),
        "sha256": sha256_file(args.out_file), "grid_thw": grid[0].tolist(), "prompt_tokens": len(prompt_ids),
        "greedy_ids": greedy_ids, "greedy_text": tok.decode(greedy_ids), "rope_deltas": rope_deltas,
        "cache_vs_full_max_abs_diff": cache_vs_full, "dtype": args.dtype,
        "logits_absmax": round(float(max(np.abs(out[f"{s}/logits"]).max() for s in clean)), 4) if clean else None,
        "last_logits_top2_gap": [round(float(np.sort(out[f"{s}/logits"][-1])[-1] - np.sort(out[f"{s}/logits"][-1])[-2]), 4)
                                 for s in clean],
        "lm_attention": {"prefill_rows": attention_summary(att_rows["prefill"]) if att_rows["prefill"] else None,
                         "decode_rows": attention_summary(att_rows["decode"]) if att_rows["decode"] else None},
        "vision_attention": {"rows": len(va), "row_max_x_n_mean": round(float(va[:, 1].mean()), 2),
                             "row_max_x_n_median": round(float(np.median(va[:, 1])), 2),
                             "row_max_mean": round(float(va[:, 0].mean()), 4),
                             "normalized_entropy_mean": round(float(va[:, 2].mean()), 3),
                             "rows_max_above_0.9": int((va[:, 0] > 0.9).sum())} if len(va) else None,
        "prefill_std": stds,
    }))
    watch.report()


if __name__ == "__main__":
    sys.exit(main())
