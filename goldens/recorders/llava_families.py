"""The tiny LLaVA-1.5 and LLaVA-NeXT models of issue 39 (make_vlm_model.py --family llava|llava-next).

Both are HF's own classes (transformers 5.23.0): LlavaForConditionalGeneration
from a LlavaConfig, LlavaNextForConditionalGeneration from a LlavaNextConfig,
each a CLIP vision tower, LLaVA's two-layer projector and a Llama text model.

Vision tower (CLIPVisionConfig, model_type clip_vision_model): hidden 32, 2
heads (head dim 16), intermediate 64, 3 layers (vision_feature_layer -2 takes
the output of layer 1, so layer 2 runs but feeds nothing: an engine that
takes the last layer fails), patch 8, image_size 56 (7x7 = 49 patches + CLS
= 50 rows), quick_gelu, LayerNorm eps 1e-5, Conv2d patch embedding without
bias, learned class embedding and 50 position embeddings, pre_layrnorm (and
post_layernorm, which only the pooled CLS output reads: LLaVA never uses it).
Projector: linear_1 32 -> 64, GELU (`gelu`: the exact erf form), linear_2
64 -> 64, both with biases; vision_feature_select_strategy `default` (the
CLS row dropped). LLaVA-NeXT adds image_grid_pinpoints [[56, 112], [112, 56],
[112, 112]] (the real [[336, 672], [672, 336], [672, 672], ...] scaled by
56/336, the 1008 ones left out) and the learned image_newline (64).
Text model (LlamaConfig): hidden 64, 2 layers, 4 query heads on 2 KV heads,
head_dim 16, FFN 128 (SiLU-gated), no biases, RMSNorm eps 1e-5 (Vicuna's and
Mistral's), RoPE theta 1e4, untied LM head (as every LLaVA), vocab 512, 1024
positions.

Tokenizer: make_model.py's byte-level BPE (Llama 3's pre-tokenizer, as
llama-tiny) with LLaVA's specials at ids 0..4: <unk> <s> </s> (the Llama
tokenizer's 0, 1, 2), <image> 3 (the config's image_token_index; the real one
is 32000) and <pad> 4 (the real 32001). EOS </s>, pad <pad>; no BOS is added
(as for every tiny model). Processor files as the real llava-hf folders hold
them: preprocessor_config.json (the image processor: CLIP's mean and std,
rescale 1/255, resize shortest_edge 56, centre crop 56x56, bicubic; NeXT also
do_pad and the pinpoints) and processor_config.json (image_token,
patch_size 8, vision_feature_select_strategy default,
num_additional_image_tokens 1: the CLS row, so the processor expands one
<image> into 49 tokens for LLaVA-1.5, and for NeXT into next_geometry's M).

Patch 8 (not CLIP's 14) makes the tile's patch grid odd (7x7): a 56x56
image's best pinpoint [56, 112] gives a 7x14 grid of which unpad_image keeps
7 + 1 columns, its odd difference 7 split floor/ceil; an even grid would
split evenly, and an engine that rounds the padding the other way would
pass (llava_recording.check_next asserts the difference is odd).
transformers 5.23's save_pretrained nests the image processor inside
processor_config.json instead; AutoProcessor reads either layout (asserted).

Weights: every matrix, embedding, the Conv2d kernel, the class embedding,
the position embeddings and image_newline N(0, INITIALIZER_RANGE) from a
generator seeded make_model.WEIGHT_SEED, drawn in named_parameters order,
image_newline last, so both models share every other tensor bit for bit (CLIP's
own initialisation ignores initializer_range for most of its tensors, with
stds from 0.07 to 0.18: one std for everything is easier to reason about);
every bias N(0, 0.1) and every norm weight 1 + N(0, 0.1) (LayerNorm biases
included) from make_model.BIAS_NORM_SEED's generator, as the other tiny models.
Then the rows of <image> and <pad> in the embedding and the LM head are set
to the mean of the other rows (added_tokens_as_llava_hf says why).

next_geometry() is LLaVA-NeXT's image arithmetic (best resolution, padding,
tiles, unpadding, the packed feature count M) in plain integers, for the
assertions of make and record (checked there against HF's own functions).
"""
import json
import math
import os

import torch
from transformers import (CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration, LlavaNextConfig,
                          LlavaNextForConditionalGeneration, PreTrainedTokenizerFast)

from make_model import (BIAS_NORM_SEED, LLAMA3_PRETOKENIZE_REGEX, MAX_POSITIONS, VOCAB, WEIGHT_SEED,
                        build_tokenizer)

FAMILIES = ("llava", "llava-next")
MODEL_TYPE = {"llava": "llava", "llava-next": "llava_next"}
LLAVA_SPECIALS = ["<unk>", "<s>", "</s>", "<image>", "<pad>"]
IMAGE_TOKEN = "<image>"
SIDE = 56  # the tower's image_size, the processor's shortest_edge and crop
PATCH = 8
PINPOINTS = [[56, 112], [112, 56], [112, 112]]
# Std of every weight matrix (see the docstring): qwen2-tiny's value, and the
# Qwen-VL towers'. Measured on the committed prompts: README "LLaVA".
INITIALIZER_RANGE = 0.15
CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]
# The real llava-hf preprocessor_config.json, key for key, at the tiny size.
PREPROCESSOR = {"crop_size": {"height": SIDE, "width": SIDE}, "do_center_crop": True, "do_convert_rgb": True,
                "do_normalize": True, "do_rescale": True, "do_resize": True, "image_mean": CLIP_MEAN,
                "image_std": CLIP_STD, "resample": 3, "rescale_factor": 1 / 255, "size": {"shortest_edge": SIDE}}
PREPROCESSOR_OF = {
    "llava": {**PREPROCESSOR, "image_processor_type": "CLIPImageProcessor", "processor_class": "LlavaProcessor"},
    "llava-next": {**PREPROCESSOR, "do_pad": True, "image_grid_pinpoints": PINPOINTS,
                   "image_processor_type": "LlavaNextImageProcessor", "processor_class": "LlavaNextProcessor"},
}
PROCESSOR_OF = {f: {"image_token": IMAGE_TOKEN, "num_additional_image_tokens": 1, "patch_size": PATCH,
                    "processor_class": PREPROCESSOR_OF[f]["processor_class"],
                    "vision_feature_select_strategy": "default"} for f in FAMILIES}


def vision_config(r):
    return CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2,
                            num_channels=3, patch_size=PATCH, image_size=SIDE, hidden_act="quick_gelu",
                            layer_norm_eps=1e-5, attention_dropout=0.0, initializer_range=r, projection_dim=64)


def text_config(ids, r):
    return LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, hidden_act="silu",
                       max_position_embeddings=MAX_POSITIONS, rope_parameters={"rope_type": "default",
                                                                               "rope_theta": 10000.0},
                       rms_norm_eps=1e-5, tie_word_embeddings=False, attention_bias=False, mlp_bias=False,
                       bos_token_id=None, eos_token_id=ids["</s>"], pad_token_id=ids["<pad>"],
                       initializer_range=r, dtype="float32")


def build_config(family, ids, r):
    common = dict(vision_config=vision_config(r), text_config=text_config(ids, r), image_token_index=ids[IMAGE_TOKEN],
                  projector_hidden_act="gelu", vision_feature_layer=-2, vision_feature_select_strategy="default",
                  multimodal_projector_bias=True, tie_word_embeddings=False, image_seq_length=(SIDE // PATCH) ** 2,
                  bos_token_id=None, eos_token_id=ids["</s>"], pad_token_id=ids["<pad>"], dtype="float32")
    if family == "llava":
        return LlavaConfig(**common)
    return LlavaNextConfig(**common, image_grid_pinpoints=[list(p) for p in PINPOINTS])


def next_geometry(h, w, pinpoints=PINPOINTS, side=SIDE, patch=PATCH):
    """LLaVA-NeXT's arithmetic for an H x W image, HF's formulas in plain
    integers and floats: select_best_resolution, get_patch_output_size,
    _get_padding_size, divide_to_patches (row-major tiles after the base
    image), pack_image_features' unpad_image on the combined patch grid, and
    the processor's token count. Returns a JSON-able dict."""
    best, best_eff, best_waste = None, 0, float("inf")
    for ph, pw in pinpoints:
        s = min(pw / w, ph / h)
        eff = min(int(w * s) * int(h * s), w * h)
        waste = pw * ph - eff
        if eff > best_eff or (eff == best_eff and waste < best_waste):
            best, best_eff, best_waste = (ph, pw), eff, waste
    bh, bw = best
    sw, sh = bw / w, bh / h
    fit = (min(math.ceil(h * sw), bh), bw) if sw < sh else (bh, min(math.ceil(w * sh), bw))
    top, left = (bh - fit[0]) // 2, (bw - fit[1]) // 2
    pad = [top, bh - fit[0] - top, left, bw - fit[1] - left]  # before/after H, before/after W
    g = side // patch  # patches per tile side
    cur_h, cur_w = (bh // side) * g, (bw // side) * g
    if w / h > cur_w / cur_h:
        new = int(round(h * (cur_w / w), 7))
        p = (cur_h - new) // 2
        rows, cols, axis = [p, cur_h - p], [0, cur_w], "rows"
    else:
        new = int(round(w * (cur_h / h), 7))
        p = (cur_w - new) // 2
        rows, cols, axis = [0, cur_h], [p, cur_w - p], "columns"
    kh, kw = rows[1] - rows[0], cols[1] - cols[0]
    base = g * g  # + 1 CLS - 1 (strategy default)
    newlines = [base + r * (kw + 1) + kw for r in range(kh)]
    return {"image_size": [h, w], "best_resolution": [bh, bw], "scale": min(sw, sh), "fit": list(fit),
            "padding_hw": pad, "tiles": [bh // side, bw // side], "patch_grid": [cur_h, cur_w],
            "unpad": {"axis": axis, "current": cur_h if axis == "rows" else cur_w, "new": new,
                      "difference": (cur_h if axis == "rows" else cur_w) - new, "padding_each_side": p,
                      "rows_kept": rows, "columns_kept": cols},
            "kept_grid": [kh, kw], "base_rows": base, "newline_rows": newlines, "M": base + kh * kw + kh}


def save_tokenizer_and_processor(family, out):
    """tokenizer.json and tokenizer_config.json, then the two processor
    files; returns the tokenizer's special ids."""
    tok = build_tokenizer(LLAMA3_PRETOKENIZE_REGEX, LLAVA_SPECIALS)
    assert tok.get_vocab_size() <= VOCAB, tok.get_vocab_size()
    ids = {s: tok.token_to_id(s) for s in LLAVA_SPECIALS}
    assert list(ids.values()) == list(range(len(LLAVA_SPECIALS))), ids
    # <image> is one token wherever it stands (no merge with its neighbours).
    assert tok.encode(f"USER: {IMAGE_TOKEN}\nWhat").ids.count(ids[IMAGE_TOKEN]) == 1
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", pad_token="<pad>", bos_token=None,
                                   unk_token=None, model_max_length=MAX_POSITIONS)
    fast.save_pretrained(out)
    for name, content in (("preprocessor_config.json", PREPROCESSOR_OF[family]),
                          ("processor_config.json", PROCESSOR_OF[family])):
        with open(os.path.join(out, name), "w") as f:
            json.dump(content, f, indent=2, sort_keys=True)
            f.write("\n")
    return ids


def check_processor(family, out, ids):
    """AutoProcessor reads the written files as meant: the PIL image
    processor (no torchvision) with every setting, and the token expansion."""
    from transformers import AutoProcessor
    p = AutoProcessor.from_pretrained(out)
    ip = p.image_processor
    want = {"llava": ("LlavaProcessor", "CLIPImageProcessorPil"),
            "llava-next": ("LlavaNextProcessor", "LlavaNextImageProcessorPil")}[family]
    assert (type(p).__name__, type(ip).__name__) == want, (type(p).__name__, type(ip).__name__)
    assert ip.size.shortest_edge == SIDE and (ip.crop_size.height, ip.crop_size.width) == (SIDE, SIDE)
    assert ip.do_center_crop and ip.do_rescale and abs(ip.rescale_factor - 1 / 255) == 0 and ip.do_normalize
    assert list(ip.image_mean) == CLIP_MEAN and list(ip.image_std) == CLIP_STD and int(ip.resample) == 3
    assert p.num_additional_image_tokens == 1 and p.patch_size == PATCH
    assert p.vision_feature_select_strategy == "default" and p.image_token_id == ids[IMAGE_TOKEN]
    if family == "llava-next":
        assert ip.do_pad and [list(x) for x in ip.image_grid_pinpoints] == PINPOINTS
    return p


def randomise(model, r):
    """Every parameter drawn (see the docstring); returns the norm-weight names."""
    norm = {f"{n}.weight" for n, m in model.named_modules() if isinstance(m, torch.nn.LayerNorm)
            or type(m).__name__.endswith("RMSNorm")}
    gw = torch.Generator().manual_seed(WEIGHT_SEED)
    gb = torch.Generator().manual_seed(BIAS_NORM_SEED)
    # image_newline (NeXT) is drawn last, so that both families draw every
    # other tensor identically: llava-tiny and llava-next-tiny share their
    # tower, projector and text model bit for bit.
    params = sorted(model.named_parameters(), key=lambda kv: kv[0].endswith("image_newline"))  # stable
    with torch.no_grad():
        for name, p in params:  # fixed module order
            if name.endswith(".bias"):
                p.copy_(torch.randn(p.shape, generator=gb) * 0.1)
            elif name in norm:
                p.copy_(1.0 + torch.randn(p.shape, generator=gb) * 0.1)
            else:
                p.copy_(torch.randn(p.shape, generator=gw) * r)
    for name, p in model.named_parameters():
        assert p.numel() < 2 or float(p.detach().std()) > 1e-3, f"{name} is (nearly) constant"
    return norm


def added_tokens_as_llava_hf(model, rows):
    """The rows of <image> and <pad> in embed_tokens and lm_head become the
    mean of the other rows, as llava-hf's conversion initialised the two
    tokens it added to Vicuna's vocabulary (its mean, without the noise): a
    random <image> row in the LM head was the prefill's greedy pick, and a
    fed <image> token is an image placeholder, not text."""
    lm = model.model.language_model
    with torch.no_grad():
        for w in (lm.embed_tokens.weight, model.lm_head.weight):
            keep = torch.ones(w.shape[0], dtype=torch.bool)
            keep[rows] = False
            w[rows] = w[keep].mean(0)


def build(family, out, r=INITIALIZER_RANGE):
    """Writes the model folder; returns a summary for make_vlm_model.py's
    JSON line."""
    ids = save_tokenizer_and_processor(family, out)
    check_processor(family, out, ids)
    torch.manual_seed(WEIGHT_SEED)
    cfg = build_config(family, ids, r)
    cls = LlavaForConditionalGeneration if family == "llava" else LlavaNextForConditionalGeneration
    model = cls(cfg).to(torch.float32).eval()
    norms = randomise(model, r)
    added_tokens_as_llava_hf(model, [ids[IMAGE_TOKEN], ids["<pad>"]])
    m = model.model
    tower, lm = m.vision_tower, m.language_model
    assert type(tower).__name__ == "CLIPVisionModel" and type(lm).__name__ == "LlamaModel"
    assert tower.embeddings.patch_embedding.bias is None and tower.embeddings.num_positions == (SIDE // PATCH) ** 2 + 1
    assert len(tower.encoder.layers) == 3 and tower.config.hidden_act == "quick_gelu"
    assert m.multi_modal_projector.linear_1.in_features == 32 and m.multi_modal_projector.linear_2.out_features == 64
    assert type(m.multi_modal_projector.act).__name__ == "GELUActivation"
    assert model.lm_head.weight.data_ptr() != lm.embed_tokens.weight.data_ptr(), "LM head must be untied"
    a = lm.layers[0].self_attn
    assert a.head_dim == 16 and a.q_proj.bias is None and lm.config.rms_norm_eps == 1e-5
    assert len(norms) == 2 * 3 + 2 + 2 * 2 + 1, sorted(norms)  # CLIP: 2/layer + pre/post; Llama: 2/layer + final
    assert hasattr(m, "image_newline") == (family == "llava-next")
    model.config.text_config.dtype = "float32"
    model.save_pretrained(out, safe_serialization=True)
    from safetensors import safe_open
    with safe_open(os.path.join(out, "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        # transformers 5 saves the released llava-hf layout (language_model.model.*,
        # language_model.lm_head.weight, vision_tower.*, multi_modal_projector.*).
        assert "language_model.lm_head.weight" in keys and all(f.get_tensor(k).dtype == torch.float32 for k in keys)
    with open(os.path.join(out, "config.json")) as f:
        saved = json.load(f)
    assert saved["model_type"] == MODEL_TYPE[family] and saved["image_token_index"] == ids[IMAGE_TOKEN]
    assert saved["vision_config"]["model_type"] == "clip_vision_model" and saved["text_config"]["model_type"] == "llama"
    return {"special_ids": ids, "initializer_range": r, "parameters": sum(p.numel() for p in model.parameters()),
            "saved_tensors": sorted(keys)}
