"""Record the goldens of a LLaVA-1.5 or LLaVA-NeXT model with HF transformers (issue 39).

record_vlm.py hands a model whose config.json says model_type `llava` or
`llava_next` to record() here (its docstring lists every key and shape of
these goldens); the rest is record_vlm.py's recording, shared where it can
be: hf_hooks.Recorder for the Llama LM, vlm_hooks.LlavaVisionRecorder for the
CLIP tower, the projector and the fusion, vlm_oracle_f64.to_float64_llava
for the oracle, overflow.py's watch, hf_model's provenance, golden_io's
writer.

Inputs. The prompt is LLaVA-1.5's conversation as plain text (no chat
template), holding `<image>` once; AutoProcessor on the model folder
(LlavaProcessor / LlavaNextProcessor around the PIL image processors
CLIPImageProcessorPil / LlavaNextImageProcessorPil: no torchvision) takes
text=[prompt], images=[the PNG] and expands `<image>` into M copies: for
LLaVA-1.5 (56/8)^2 + num_additional_image_tokens 1 - 1 (the `default`
strategy drops CLS) = 49, for NeXT its packed count (llava_families.
next_geometry's M, asserted equal to the processor's, to the packed rows and
to HF's own select_best_resolution, image_size_to_num_patches and
unpad_image). The ids are asserted equal to tokenizer.json's own encoding
of the expanded text.

What the processor does, asserted here rather than assumed: LLaVA-1.5's
image is taken as it is (resize to shortest edge 56 and the 56x56 centre
crop are the identity: the pixels equal the processor's with both turned
off). NeXT's pixel_values are [base image, tiles in row-major order]: the
tiles are the image fitted into the best pinpoint (no resize at scale 1),
zero-padded as uint8 BEFORE rescaling and normalising (so a padded pixel is
(0 - mean) / std per channel), and cut into 56x56 windows; the base image is
the whole image resized to 56x56 by PIL's bicubic, which touchstone's
processor refuses to imitate: the image must be 56x56 (asserted), so the
resize is the identity (PIL's own resize asserted to return the image
unchanged; the provenance's next.base_image says `resampled: false`). Each
is asserted equal, bit for bit, to CLIPImageProcessorPil on its window (the
base image: on the image itself).
"""
import contextlib
import json
import os
import sys
import types

import numpy as np
import PIL
import tokenizers
import torch
from PIL import Image
from transformers import AutoProcessor, LlavaForConditionalGeneration, LlavaNextForConditionalGeneration
from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil
from transformers.models.llava_next import modeling_llava_next

import golden_io
import hf_model
import llava_families
import overflow
import vlm_oracle_f64
from golden_io import sha256_file
from hf_hooks import Recorder, attention_rows, attention_summary, config_dims
from model_source import folder_source
from oracle_f64 import F32Guard
from vlm_hooks import LlavaVisionRecorder, llava_vision_shape, std_line

CLASSES = {"llava": LlavaForConditionalGeneration, "llava_next": LlavaNextForConditionalGeneration}
PLACEHOLDER = "<image>"


def clip_pixels(ip, array):
    """CLIPImageProcessorPil with `ip`'s settings on a [H, W, 3] uint8 array."""
    clip = CLIPImageProcessorPil(size={"shortest_edge": ip.size.shortest_edge},
                                 crop_size={"height": ip.crop_size.height, "width": ip.crop_size.width},
                                 resample=ip.resample, rescale_factor=ip.rescale_factor,
                                 image_mean=list(ip.image_mean), image_std=list(ip.image_std))
    return clip(Image.fromarray(array, mode="RGB"), return_tensors="pt")["pixel_values"][0]


def check_next(image, pixels, ip, cfg, processor):
    """NeXT's geometry and pixels against HF's own functions (see the module
    docstring). Returns the provenance entry."""
    W, H = image.size
    side, patch = cfg.vision_config.image_size, cfg.vision_config.patch_size
    pins = [list(p) for p in cfg.image_grid_pinpoints]
    geo = llava_families.next_geometry(H, W, pins, side, patch)
    bh, bw = geo["best_resolution"]
    assert list(modeling_llava_next.select_best_resolution((H, W), pins)) == [bh, bw]
    n_tiles = geo["tiles"][0] * geo["tiles"][1]
    assert modeling_llava_next.image_size_to_num_patches((H, W), pins, side) == 1 + n_tiles == pixels.shape[0]
    gh, gw = geo["patch_grid"]
    label = torch.arange(gh * gw, dtype=torch.float64).reshape(1, gh, gw)
    kept = modeling_llava_next.unpad_image(label, [H, W])[0]
    (r0, r1), (c0, c1) = geo["unpad"]["rows_kept"], geo["unpad"]["columns_kept"]
    assert torch.equal(kept, label[0, r0:r1, c0:c1]), "unpad_image keeps other rows/columns"
    assert processor._get_number_of_features(H, W, side, side) - 1 == geo["M"]
    # Pixels: base = the image resized to side x side (PIL bicubic), then the
    # tiles of the zero-padded image, row-major.
    arr = np.asarray(image)
    assert geo["scale"] == 1.0 and geo["fit"] == [H, W], "the tiles would be resampled"
    # The planted bug "unpadding rounded the other way" keeps other columns
    # only when the difference is odd: the golden must be able to tell.
    assert geo["unpad"]["difference"] % 2 == 1, f"unpad difference {geo['unpad']['difference']} is even"
    # touchstone's processor does not resample: NeXT's base image (the whole
    # image squashed to side x side) must be the identity.
    assert (H, W) == (side, side), f"a {H}x{W} image's base image would be resampled to {side}x{side}"
    t, b, l, r = geo["padding_hw"]
    padded = np.pad(arr, ((t, b), (l, r), (0, 0)), mode="constant", constant_values=0)
    base = np.asarray(image.resize((side, side), resample=int(ip.resample)))
    assert np.array_equal(base, arr), "PIL's resize to the tower side changed the image: it would be resampled"
    want = [clip_pixels(ip, base)] + [clip_pixels(ip, padded[i * side:(i + 1) * side, j * side:(j + 1) * side])
                                       for i in range(geo["tiles"][0]) for j in range(geo["tiles"][1])]
    for k, w_ in enumerate(want):
        assert torch.equal(pixels[k], w_), f"tower image {k} differs from the CLIP processor on its window"
    pad_value = clip_pixels(ip, np.zeros((side, side, 3), dtype=np.uint8))[:, 0, 0]
    if l:
        assert (pixels[1][:, :, :l] == pad_value[:, None, None]).all(), "the padding is not (0 - mean) / std"
    geo["order"] = ["base"] + [f"tile {i},{j}" for i in range(geo["tiles"][0]) for j in range(geo["tiles"][1])]
    geo["padding"] = {"value_uint8": 0, "applied": "to the uint8 image, before rescale and normalise",
                      "normalised": [float(x) for x in pad_value]}
    geo["base_image"] = {"resampled": False, "how": f"not resampled: the image is {H}x{W}, the tower's side, so "
                         f"HF's resize of the whole image to {side}x{side} (PIL resample {int(ip.resample)}, "
                         "bicubic) returns it unchanged (asserted); the base image is the image itself"}
    return geo


def check_merger(v, P, N, cfg, geo, newline):
    """vision.merger from vision.projector (and image_newline), bit for bit."""
    proj = v["vision.projector"].reshape(P, N, -1)
    merger = v["vision.merger"]
    if geo is None:
        assert np.array_equal(merger, v["vision.projector"]), "LLaVA-1.5: merger != projector"
        return
    g = int(round(N ** 0.5))
    th, tw = geo["tiles"]
    grid = proj[1:].reshape(th, tw, g, g, -1).transpose(0, 2, 1, 3, 4).reshape(th * g, tw * g, -1)
    (r0, r1), (c0, c1) = geo["unpad"]["rows_kept"], geo["unpad"]["columns_kept"]
    rows = [proj[0]] + [np.concatenate([grid[r, c0:c1], newline[None]]) for r in range(r0, r1)]
    assert np.array_equal(merger, np.concatenate(rows)), "NeXT: merger != base + unpadded grid + newlines"


def record(args, cfg_file, log, recorder):
    mt = cfg_file["model_type"]
    if args.chat:
        sys.exit("record_vlm.py: LLaVA's prompt is given as text (USER: <image>\\n... ASSISTANT:), no --chat")
    if args.prompt.count(PLACEHOLDER) != 1:
        sys.exit(f"record_vlm.py: --prompt must hold {PLACEHOLDER} exactly once for {mt}")
    processor = AutoProcessor.from_pretrained(args.model)
    ip, tok = processor.image_processor, processor.tokenizer
    assert type(ip).__name__ == {"llava": "CLIPImageProcessorPil", "llava_next": "LlavaNextImageProcessorPil"}[mt]
    model = CLASSES[mt].from_pretrained(args.model, dtype=torch.float32, attn_implementation="eager").eval()
    cfg = model.config
    m = model.model
    tower, lm = m.vision_tower, m.language_model
    assert cfg._attn_implementation == tower.config._attn_implementation == lm.config._attn_implementation \
        == "eager", "eager attention everywhere"
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert cfg.vision_feature_select_strategy == "default" and isinstance(cfg.vision_feature_layer, int)
    vc, tcfg = cfg.vision_config, cfg.text_config
    side, N = vc.image_size, (vc.image_size // vc.patch_size) ** 2
    feature_block = vc.num_hidden_layers + cfg.vision_feature_layer  # hidden_states[i] is block i - 1's output
    assert 0 <= feature_block < vc.num_hidden_layers, cfg.vision_feature_layer

    image = Image.open(args.image)
    image.load()
    assert image.mode == "RGB", image.mode
    W, H = image.size
    inputs = processor(text=[args.prompt], images=[image], return_tensors="pt")
    ids, pixels_in = inputs["input_ids"], inputs["pixel_values"]
    assert ids.shape[0] == 1 and pixels_in.dtype == torch.float32
    prompt_ids = ids[0].tolist()
    M = prompt_ids.count(cfg.image_token_id)
    extra = {}
    if mt == "llava_next":
        sizes = inputs["image_sizes"]
        assert sizes.tolist() == [[H, W]] and pixels_in.ndim == 5 and pixels_in.shape[0] == 1
        geo = check_next(image, pixels_in[0], ip, cfg, processor)
        pixels = pixels_in[0, :1 + geo["tiles"][0] * geo["tiles"][1]]
        assert M == geo["M"], (M, geo["M"])
        extra["image_sizes"] = sizes
    else:
        geo = None
        pixels = pixels_in
        assert pixels.shape == (1, 3, side, side), "LLaVA-1.5: one tower image"
        # Resize and crop are the identity: the same pixels with both off.
        same = ip(image, do_resize=False, do_center_crop=False, return_tensors="pt")["pixel_values"]
        assert (H, W) == (side, side) and torch.equal(same, pixels), "the image was resampled or cropped"
        assert M == N + processor.num_additional_image_tokens - 1 == N
    P = pixels.shape[0]
    expanded = args.prompt.replace(PLACEHOLDER, PLACEHOLDER * M)
    raw = tokenizers.Tokenizer.from_file(os.path.join(args.model, "tokenizer.json"))
    assert raw.encode(expanded, add_special_tokens=False).ids == prompt_ids, "processor vs tokenizer.json"
    log(f"{mt}: image {W}x{H} -> {P} tower image(s), {M} image tokens; prompt {len(prompt_ids)} tokens; "
        f"{args.decode_steps} decode steps; {args.dtype}")

    guard, patched = None, None
    if args.dtype == "float64":
        patched = vlm_oracle_f64.to_float64_llava(model)
        guard = F32Guard()
        pixel_in = pixels_in.to(torch.float64)
        log(f"float64 oracle: {patched}")
    else:
        pixel_in = pixels_in

    shim = types.SimpleNamespace(model=lm, lm_head=model.lm_head, config=tcfg)
    r = Recorder(shim)
    r.guard = guard
    r.install()
    v = LlavaVisionRecorder(model, r, guard)
    v.install()
    n_layers, depth = tcfg.num_hidden_layers, vc.num_hidden_layers
    dims = config_dims(tcfg)
    E_ = dims[3]
    lm_expected = golden_io.all_stages("llama", n_layers) + ["tokens", "positions"]
    out, steps, greedy_ids, clean, not_run, step_last_logits = {}, [], [], [], [], []
    att_rows = {"prefill": [], "decode": []}
    vision_rows, stds = [], {}
    fed, x, past, pos = list(prompt_ids), ids, None, 0
    watch = overflow.Watch(args.dtype, args.oracle)
    all_steps = ["prefill"] + [f"decode{i}" for i in range(1, args.decode_steps + 1)]
    newline = None
    if geo is not None:
        newline = m.image_newline.detach().to(torch.float32).numpy()
    try:
        with torch.no_grad():
            for si, step in enumerate(all_steps):
                steps.append(step)
                r.rec.clear()
                v.rec.clear()
                r.step = step
                T = x.shape[1]
                r.S = pos + T
                kw = dict(pixel_values=pixel_in, **extra) if si == 0 else {}
                with guard or contextlib.nullcontext():
                    res = model(input_ids=x, past_key_values=past, use_cache=True, return_dict=True, **kw)
                past = res.past_key_values
                assert past.get_seq_length() == pos + T
                assert np.array_equal(r.rec["logits"], res.logits[0].to(torch.float32).numpy(), equal_nan=True)
                r.rec["tokens"] = x[0].numpy().astype(np.int64)
                assert sorted(r.rec) == sorted(lm_expected), sorted(set(r.rec) ^ set(lm_expected))
                assert r.rec["positions"].tolist() == list(range(pos, pos + T)), r.rec["positions"]
                for k, val in r.rec.items():
                    assert val.shape == golden_io.expected_shape(k, T, pos + T, dims), (k, val.shape)
                if si == 0:
                    v.rec["vision.pixels"] = pixels.numpy().copy()
                    want_v = golden_io.vision_stages(mt, depth, 0) + ["inputs_embeds"]
                    assert sorted(v.rec) == sorted(want_v), sorted(set(v.rec) ^ set(want_v))
                    for k, val in v.rec.items():
                        shape = (T, E_) if k == "inputs_embeds" else llava_vision_shape(
                            k, P, N, vc.hidden_size, vc.num_attention_heads, vc.intermediate_size, E_, M, side)
                        assert val.shape == shape, (k, val.shape, shape)
                tensors = {**v.rec, **r.rec}
                if watch.scan(step, tensors, golden_io.vlm_order(mt, "llama", depth, 0, n_layers, si == 0)):
                    clean.append(step)
                    for li in range(n_layers):
                        att_rows["prefill" if si == 0 else "decode"] += attention_rows(
                            r.rec[f"blk.{li}.attn_probs"], np.arange(pos, pos + T))
                    if si == 0:
                        # The features are block feature_block's output without CLS, bit for bit.
                        blk = v.rec[f"vision.blk.{feature_block}.out"].reshape(P, N + 1, -1)
                        assert np.array_equal(v.rec["vision.features"], blk[:, 1:].reshape(P * N, -1))
                        check_merger(v.rec, P, N, cfg, geo, newline)
                        img = np.array(prompt_ids) == cfg.image_token_id
                        assert np.array_equal(tensors["inputs_embeds"][img], v.rec["vision.merger"])
                        assert np.array_equal(tensors["inputs_embeds"][~img], r.rec["embed"][~img])
                        for bi in range(depth):
                            pr = v.rec[f"vision.blk.{bi}.attn_probs"].astype(np.float64)
                            mx = pr.max(-1).ravel()
                            ent = (-(pr * np.log(np.clip(pr, 1e-300, 1))).sum(-1) / np.log(N + 1)).ravel()
                            vision_rows += list(zip(mx, mx * (N + 1), ent))
                        stds = std_line(tensors)
                out.update({f"{step}/{k}": val for k, val in tensors.items()
                            if k in ("tokens", "positions") or watch.keeps(step, k)})
                pos += T
                if not np.isfinite(res.logits[0]).all():
                    not_run = all_steps[si + 1:]
                    log(f"{step}: {T} token(s): non-finite logits, {len(not_run)} later step(s) not run")
                    break
                greedy = int(res.logits[0, -1].argmax())
                greedy_ids.append(greedy)
                log(f"{step}: {T} token(s), positions {pos - T}..{pos - 1}, greedy {greedy}")
                fed.append(greedy)
                x = torch.tensor([[greedy]], dtype=torch.int64)
                step_last_logits.append(res.logits[0, -1].to(torch.float64).numpy().copy())
    finally:
        v.remove()
        r.remove()

    cache_vs_full = None
    if clean:
        full = torch.tensor([fed[:len(prompt_ids) + len(clean) - 1]], dtype=torch.int64)
        with torch.no_grad(), guard or contextlib.nullcontext():
            lf = model(input_ids=full, pixel_values=pixel_in, use_cache=False, **extra).logits[0, -1]
        cache_vs_full = overflow.finite_or_none(np.abs(lf.to(torch.float64).numpy()
                                                       - step_last_logits[len(clean) - 1]).max())
        assert watch.found is not None or cache_vs_full < 1e-3, cache_vs_full
    if guard is not None:
        assert not guard.bad, f"float64 run: ops produced other float dtypes: {dict(guard.bad)}"
    with torch.no_grad():
        gen = model.generate(input_ids=ids, attention_mask=inputs["attention_mask"], pixel_values=pixel_in,
                             do_sample=False, max_new_tokens=args.decode_steps + 1,
                             min_new_tokens=args.decode_steps + 1, eos_token_id=None, pad_token_id=tok.pad_token_id,
                             **extra)
    gen_ids = gen[0, len(prompt_ids):].tolist()
    assert gen_ids[:len(greedy_ids)] == greedy_ids, f"generate() picked {gen_ids}, the recording {greedy_ids}"

    prov = hf_model.build_provenance(args, {"text": args.prompt, "token_ids": prompt_ids}, cfg_file, greedy_ids,
                                     steps, cache_vs_full, folder_source(args.model), None, None, recorder)
    prov["versions"]["pillow"] = PIL.__version__
    prov["image"] = {"file": os.path.basename(args.image), "sha256": sha256_file(args.image), "size": [H, W]}
    prov["preprocessor_sha256"] = sha256_file(os.path.join(args.model, "preprocessor_config.json"))
    prov["processor_config_sha256"] = sha256_file(os.path.join(args.model, "processor_config.json"))
    prov["processor"] = {
        "class": type(processor).__name__, "image_processor": type(ip).__name__,
        "image_token": processor.image_token, "image_token_id": int(processor.image_token_id),
        "patch_size": int(processor.patch_size), "num_additional_image_tokens": int(processor.num_additional_image_tokens),
        "vision_feature_select_strategy": processor.vision_feature_select_strategy,
        "do_resize": bool(ip.do_resize), "size": {"shortest_edge": int(ip.size.shortest_edge)},
        "resample": int(ip.resample), "do_center_crop": bool(ip.do_center_crop),
        "crop_size": {"height": int(ip.crop_size.height), "width": int(ip.crop_size.width)},
        "do_rescale": bool(ip.do_rescale), "rescale_factor": float(ip.rescale_factor),
        "do_normalize": bool(ip.do_normalize), "image_mean": [float(x) for x in ip.image_mean],
        "image_std": [float(x) for x in ip.image_std], "do_convert_rgb": bool(ip.do_convert_rgb),
        **({"do_pad": bool(ip.do_pad), "image_grid_pinpoints": [list(p) for p in ip.image_grid_pinpoints]}
           if geo is not None else {})}
    prov["image_tokens"] = M
    prov["tower_images"] = P
    prov["vision_feature"] = {"layer": cfg.vision_feature_layer, "block": feature_block, "strategy": "default"}
    if geo is not None:
        prov["next"] = geo
    prov["generate_ids"] = gen_ids
    if patched is not None:
        prov["float64"] = patched
    if watch.found is not None:
        prov["overflow"] = watch.found
        prov["overflow_skipped"] = overflow.skipped(watch.found, clean, not_run, ["cache_vs_full", "generate"])
    golden_io.write_golden(out, golden_io.metadata(prov), args.out_file, log)
    va = np.array(vision_rows)
    gaps = []
    for s in clean:
        top = np.sort(out[f"{s}/logits"][-1])
        gaps.append(round(float(top[-1] - top[-2]), 4))
    print(json.dumps({
        "out": args.out_file, "tensors": len(out), "bytes": os.path.getsize(args.out_file),
        "sha256": sha256_file(args.out_file), "tower_images": P, "image_tokens": M,
        "prompt_tokens": len(prompt_ids), "greedy_ids": greedy_ids, "greedy_text": tok.decode(greedy_ids),
        "cache_vs_full_max_abs_diff": cache_vs_full, "dtype": args.dtype,
        "logits_absmax": round(float(max(np.abs(out[f"{s}/logits"]).max() for s in clean)), 4) if clean else None,
        "last_logits_top2_gap": gaps,
        "lm_attention": {"prefill_rows": attention_summary(att_rows["prefill"]) if att_rows["prefill"] else None,
                         "decode_rows": attention_summary(att_rows["decode"]) if att_rows["decode"] else None},
        "vision_attention": {"rows": len(va), "row_max_x_n_mean": round(float(va[:, 1].mean()), 2),
                             "row_max_x_n_median": round(float(np.median(va[:, 1])), 2),
                             "row_max_mean": round(float(va[:, 0].mean()), 4),
                             "normalized_entropy_mean": round(float(va[:, 2].mean()), 3),
                             "rows_max_above_0.9": int((va[:, 0] > 0.9).sum())} if len(va) else None,
        "prefill_std": stds,
        **({"next": {k: geo[k] for k in ("best_resolution", "tiles", "unpad", "newline_rows", "M")}}
           if geo is not None else {}),
    }))
    watch.report()
