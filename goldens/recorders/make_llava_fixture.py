"""A small LLaVA fixture for the Rust unit tests of the CLIP tower, the projector and the
LLaVA image processors (issue 39), made with transformers 5.23.0 on CPU:

- model/: a random LlavaForConditionalGeneration (CLIP tower hidden 32, 2 heads, MLP 64,
  3 layers, patch 14, image 56, quick_gelu; Llama text model hidden 64, 2 layers, vocab 512),
  weights N(0, 0.15), biases N(0, 0.1), norm weights 1 + N(0, 0.1), seed 0;
- stages.safetensors: HF's tower and projector stages on 2 random images of pixels
  (`vision.pixels` [2, 3, 56, 56], then rows flattened to [rows, width]): patch_embed,
  pre_norm, per block norm1, q, attn_out, mlp_fc1, out, proj_fc1 and projector
  (vision_feature_layer -2, CLS dropped), recorded with forward hooks;
- img-56x70.png, img-56x56.png (random, seed 3) and pixels.safetensors: CLIPImageProcessorPil
  on the first (shortest edge 56 and a centre crop: no resampling) and
  LlavaNextImageProcessorPil (pinpoints [[56,112],[112,56],[112,112]]) on the second (base
  image, then two zero-padded tiles), with proc/preprocessor_config.json.

This is a unit-test fixture, not a golden: the LLaVA specs' goldens are recorded separately.

    python goldens/recorders/make_llava_fixture.py goldens/llava-fixture
"""
import os
import sys

import numpy as np
import torch
from PIL import Image
from safetensors.numpy import save_file as save_np
from safetensors.torch import save_file
from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration
from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil
from transformers.models.llava_next.image_processing_pil_llava_next import LlavaNextImageProcessorPil


def model_and_stages(out):
    torch.manual_seed(0)
    vc = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2,
                          patch_size=14, image_size=56, hidden_act="quick_gelu", layer_norm_eps=1e-5)
    tc = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=16, vocab_size=512, rms_norm_eps=1e-6)
    m = LlavaForConditionalGeneration(LlavaConfig(vision_config=vc, text_config=tc, image_token_index=5)).eval()
    with torch.no_grad():
        for n, p in m.named_parameters():
            if p.dim() == 1 and ("norm" in n or "layrnorm" in n) and n.endswith("weight"):
                p.copy_(1 + 0.1 * torch.randn_like(p))
            elif p.dim() == 1:
                p.copy_(0.1 * torch.randn_like(p))
            else:
                p.copy_(0.15 * torch.randn_like(p))
    m.save_pretrained(os.path.join(out, "model"))
    px = torch.randn(2, 3, 56, 56)
    rec = {}

    def hook(name):
        def f(mod, inp, o):
            rec[name] = (o[0] if isinstance(o, tuple) else o).detach().clone()
        return f
    vt = m.model.vision_tower
    vt = getattr(vt, "vision_model", vt)
    for i, layer in enumerate(vt.encoder.layers):
        layer.layer_norm1.register_forward_hook(hook(f"vision.blk.{i}.norm1"))
        layer.self_attn.q_proj.register_forward_hook(hook(f"vision.blk.{i}.q"))
        layer.self_attn.out_proj.register_forward_hook(hook(f"vision.blk.{i}.attn_out"))
        layer.mlp.fc1.register_forward_hook(hook(f"vision.blk.{i}.mlp_fc1"))
        layer.register_forward_hook(hook(f"vision.blk.{i}.out"))
    vt.pre_layrnorm.register_forward_hook(hook("vision.pre_norm"))
    vt.embeddings.patch_embedding.register_forward_hook(hook("vision.patch_embed"))
    mp = m.model.multi_modal_projector
    mp.linear_1.register_forward_hook(hook("vision.proj_fc1"))
    mp.linear_2.register_forward_hook(hook("vision.projector"))
    with torch.no_grad():
        m.model.get_image_features(pixel_values=px, vision_feature_layer=-2, vision_feature_select_strategy="default")
    stages = {"vision.pixels": px}
    for k, v in rec.items():
        if k == "vision.patch_embed":
            v = v.flatten(2).transpose(1, 2)
        stages[k] = v.reshape(-1, v.shape[-1])
    save_file({k: v.float().contiguous() for k, v in stages.items()}, os.path.join(out, "stages.safetensors"))


def pixels(out):
    rng = np.random.default_rng(3)
    a, b = os.path.join(out, "img-56x70.png"), os.path.join(out, "img-56x56.png")
    Image.fromarray(rng.integers(0, 256, (56, 70, 3), dtype=np.uint8)).save(a)
    Image.fromarray(rng.integers(0, 256, (56, 56, 3), dtype=np.uint8)).save(b)
    kw = dict(size={"shortest_edge": 56}, crop_size={"height": 56, "width": 56})
    nxt = LlavaNextImageProcessorPil(image_grid_pinpoints=[[56, 112], [112, 56], [112, 112]], **kw)
    res = {
        "clip_56x70": CLIPImageProcessorPil(**kw)(Image.open(a), return_tensors="np")["pixel_values"][0],
        "next_56x56": nxt(Image.open(b), return_tensors="np")["pixel_values"][0],
    }
    save_np({k: v.astype(np.float32) for k, v in res.items()}, os.path.join(out, "pixels.safetensors"))
    nxt.save_pretrained(os.path.join(out, "proc"))


if __name__ == "__main__":
    out = sys.argv[1] if len(sys.argv) > 1 else "goldens/llava-fixture"
    os.makedirs(out, exist_ok=True)
    model_and_stages(out)
    pixels(out)
