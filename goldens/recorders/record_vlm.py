#!/usr/bin/env python3
"""Record golden tensors of a vision-language model (Qwen2-VL, Qwen3-VL) with HF transformers.

usage: record_vlm.py MODEL_DIR OUT_FILE --prompt TEXT --image PNG [--chat] [--decode-steps N]
                     [--dtype float32|float64]

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

--dtype float64 records the ORACLE: the whole model converted to float64
(tiny models: no streaming needed; record_hf.py's streamed oracle equals the
whole-model conversion, docs/goldens.md) and the processor's float32
pixel_values widened exactly to float64 before the forward. HF's float32
islands are replaced for the run by the same formulas in float64 (each
checked against HF's own float32 version): the LM's RMSNorm (q_norm/k_norm
too), the LM's M-RoPE tables (inv_freq 1/theta^(2i/d) and angles in float64,
then HF's own recomposition_frequencies), the vision tower's 2-D RoPE tables,
apply_rotary_pos_emb_vision (HF casts q, k, cos, sin to float32), the eager
softmax (dtype=float32 in HF), and Qwen3-VL's bilinear interpolation weights
of the learned position embeddings (HF computes them in float32; here the
same taps, the weights in float64). record_hf.py's F32Guard asserts no
operation of any forward produced a floating tensor of another dtype. Stored
tensors are the float64 values rounded once to float32; vision.pixels is the
processor's float32 input as given.

`__metadata__`: format touchstone-golden/1 and provenance (record_hf.py's
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
from transformers import AutoTokenizer, Qwen2VLForConditionalGeneration, Qwen3VLForConditionalGeneration
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from transformers.models.qwen2_vl.processing_qwen2_vl import Qwen2VLProcessor
from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor

sys.dont_write_bytecode = True
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import golden_io  # noqa: E402
from golden_io import FORMAT, progress, save_deterministic, sha256_file  # noqa: E402
from oracle_f64 import F32Guard, allowed, rms_forward_f64  # noqa: E402
import record_hf  # noqa: E402  (Recorder, build_provenance, make_deterministic, attention statistics)

RECORDER = "goldens/recorders/record_vlm.py"
PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"
FAMILIES = {
    # model_type: (model class, processor class, golden_io stage family of the LM)
    "qwen2_vl": (Qwen2VLForConditionalGeneration, Qwen2VLProcessor, "qwen2"),
    "qwen3_vl": (Qwen3VLForConditionalGeneration, Qwen3VLProcessor, "qwen3"),
}
VISION_BLOCK_STAGES = ["norm1", "q", "k", "v", "q_rope", "k_rope", "attn_probs", "attn_ctx", "attn_out", "mlp_inp",
                       "norm2", "mlp_fc1", "mlp_act", "mlp_out", "out"]


def log(msg):
    progress("record_vlm.py", msg)


def vision_stages(model_type, depth, n_deepstack):
    names = ["vision.pixels", "vision.grid", "vision.patch_embed"]
    if model_type == "qwen3_vl":
        names.append("vision.pos_embed")
    for i in range(depth):
        names += [f"vision.blk.{i}.{s}" for s in VISION_BLOCK_STAGES]
    names += ["vision.merger_norm", "vision.merger"] + [f"vision.deepstack.{j}" for j in range(n_deepstack)]
    return names


def vision_shape(stage, N, M, Ev, Hv, Dv, Fv, E, C):
    name = stage.split(".")[-1]
    if stage.startswith("vision.deepstack.") or stage == "vision.merger":
        return (M, E)
    return {"pixels": (N, C), "grid": (1, 3), "q": (N, Hv, Dv), "k": (N, Hv, Dv), "v": (N, Hv, Dv),
            "q_rope": (N, Hv, Dv), "k_rope": (N, Hv, Dv), "attn_probs": (Hv, N, N), "attn_ctx": (N, Hv * Dv),
            "mlp_fc1": (N, Fv), "mlp_act": (N, Fv)}.get(name, (N, Ev))


# ---- the float64 oracle -------------------------------------------------------

def _inv_freq_f64(theta, dim):
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))


def to_float64_vlm(model, modeling):
    """Convert the whole (tiny) model to float64 and replace HF's float32
    islands by the same formulas in float64 (see the module docstring).
    Returns what was patched (for the log); the patches stay for the
    process's lifetime (one recording per process)."""
    assert all(p.dtype == torch.float32 for p in model.parameters())
    model.to(torch.float64)
    assert all(p.dtype == torch.float64 for p in model.parameters())
    for mod in model.modules():
        for bname, buf in list(mod._buffers.items()):
            if buf is not None and buf.is_floating_point():
                mod._buffers[bname] = buf.to(torch.float64)
    cfg = model.config
    tc, vc = cfg.text_config, cfg.vision_config
    patched = {}
    # LM M-RoPE tables: inv_freq and angles in float64, HF's own
    # recomposition (Qwen2-VL: sections; Qwen3-VL: interleaved).
    rot = model.model.language_model.rotary_emb
    D = getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads
    rp = tc.rope_parameters
    assert rp["rope_type"] == "default" and rot.attention_scaling == 1.0, rp
    inv64 = _inv_freq_f64(rp["rope_theta"], D)
    assert torch.allclose(rot.original_inv_freq.to(torch.float64), inv64, rtol=1e-6, atol=0)

    def rope_forward(self, x, position_ids):
        position_ids = position_ids.expand(3, -1, -1)
        freqs = position_ids[..., None].to(torch.float64) * inv64
        cos = self.recomposition_frequencies(freqs.cos())
        sin = self.recomposition_frequencies(freqs.sin())
        return cos.to(x.dtype), sin.to(x.dtype)
    rot.forward = types.MethodType(rope_forward, rot)
    patched["lm_rope"] = f"float64, theta {rp['rope_theta']}, mrope_section {rp['mrope_section']}"
    # Vision 2-D RoPE tables.
    vrot = model.model.visual.rotary_pos_emb
    Dv = vc.embed_dim // vc.num_heads if cfg.model_type == "qwen2_vl" else vc.hidden_size // vc.num_heads
    vrp = vc.rope_parameters
    assert vrp["rope_type"] == "axial" and vrot.attention_scaling == 1.0, vrp
    vinv64 = _inv_freq_f64(vrp["rope_theta"], Dv // 2)
    assert torch.allclose(vrot.original_inv_freq.to(torch.float64), vinv64, rtol=1e-6, atol=0)

    def vrope_forward(self, x, position_ids):
        freqs = position_ids[..., None].to(torch.float64) * vinv64
        return self.recomposition_frequencies(freqs.cos()), self.recomposition_frequencies(freqs.sin())
    vrot.forward = types.MethodType(vrope_forward, vrot)
    patched["vision_rope"] = f"float64, theta {vrp['rope_theta']}"
    # apply_rotary_pos_emb_vision without its float32 casts.
    rotate_half = modeling.rotate_half

    def rope_vision_f64(q, k, cos, sin):
        assert q.dtype == k.dtype == cos.dtype == sin.dtype == torch.float64
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
        return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)
    modeling.apply_rotary_pos_emb_vision = rope_vision_f64
    # RMSNorm (LM layers, final norm, q_norm/k_norm).
    norms = 0
    for name, mod in model.named_modules():
        if type(mod).__name__.endswith("RMSNorm"):
            mod.forward = types.MethodType(rms_forward_f64, mod)
            norms += 1
        elif "Norm" in type(mod).__name__:
            assert isinstance(mod, torch.nn.LayerNorm), f"{name}: {type(mod).__name__} has no float64 replacement"
    patched["rmsnorm_modules"] = norms
    # Softmax in float64 where HF asks for float32.
    real_softmax = torch.nn.functional.softmax

    def softmax(input, dim=None, _stacklevel=3, dtype=None):
        if dtype == torch.float32 and input.dtype == torch.float64:
            dtype = torch.float64
        return real_softmax(input, dim=dim, _stacklevel=_stacklevel, dtype=dtype)
    torch.nn.functional.softmax = softmax
    patched["softmax"] = "float64"
    if cfg.model_type == "qwen3_vl":
        orig_interp = modeling.get_vision_interpolation_indices_and_weights

        def interp_f64(grid_thw, num_grid_per_side, mode="bilinear", align_corners=False, spatial_merge_size=1,
                       padding="border", kwargs=None):
            # HF's taps (integers) and float32 weights, for the check.
            with allowed(GUARD[0]):
                idx, w32 = orig_interp(grid_thw, num_grid_per_side, mode=mode, align_corners=align_corners,
                                       spatial_merge_size=spatial_merge_size, padding=padding, kwargs=kwargs)
            assert mode == "bilinear" and align_corners and padding == "border" and grid_thw.shape[0] == 1
            t, h, w = (int(v) for v in grid_thw[0])
            side, m = num_grid_per_side, spatial_merge_size
            within = torch.arange(t * h * w) % (h * w)
            in_col, in_row = within % m, (within // m) % m
            block_col, block_row = (within // (m * m)) % (w // m), within // (m * m * (w // m))
            row, col = block_row * m + in_row, block_col * m + in_col

            def axis(index, size):
                src = index.to(torch.float64) * (side - 1) / max(size - 1, 1)
                floor = torch.floor(src)
                offsets = torch.arange(0, 2)
                taps = (floor.long()[:, None] + offsets).clamp(0, side - 1)
                weights = (1 - (src[:, None] - floor[:, None] - offsets).abs()).clamp(min=0)
                return taps, weights
            ht, hw_ = axis(row, h)
            wt, ww = axis(col, w)
            idx64 = (ht[:, :, None] * side + wt[:, None, :]).reshape(-1, 4)
            w64 = (hw_[:, :, None] * ww[:, None, :]).reshape(-1, 4)
            assert torch.equal(idx64, idx), "interpolation taps differ from HF's"
            with allowed(GUARD[0]):
                assert torch.allclose(w64, w32.to(torch.float64), rtol=0, atol=1e-6), "weights differ from HF's"
            return idx, w64
        modeling.get_vision_interpolation_indices_and_weights = interp_f64
        patched["pos_embed_interpolation"] = "float64 bilinear weights"
    return patched


GUARD = [None]  # the F32Guard of a float64 run (the interpolation patch reads it)


# ---- hooks ---------------------------------------------------------------------

class VisionRecorder:
    """Forward hooks and wrappers that copy every vision stage (prefill only)
    and the fusion stages into `rec`."""

    def __init__(self, model, modeling, lm_recorder, guard):
        self.model, self.modeling, self.lm, self.guard = model, modeling, lm_recorder, guard
        self.rec = {}
        self.handles = []
        self.block = None
        self.orig_rope_vision = None
        self.orig_eager = None
        self.orig_deepstack = None
        self.vision_attn_cls = type(model.model.visual.blocks[0].attn)

    def put(self, name, t, drop_batch=False):
        assert name not in self.rec, f"{name} recorded twice"
        with allowed(self.guard):
            if drop_batch:
                assert t.shape[0] == 1, (name, t.shape)
                t = t[0]
            self.rec[name] = t.detach().to(torch.float32).contiguous().numpy().copy()

    def install(self):
        vis = self.model.model.visual
        fwd = lambda mod, fn: self.handles.append(mod.register_forward_hook(fn))
        pre = lambda mod, fn: self.handles.append(mod.register_forward_pre_hook(fn))
        qwen3 = self.model.config.model_type == "qwen3_vl"
        fwd(vis.patch_embed, lambda m, i, o: self.put("vision.patch_embed", o))
        if qwen3:
            # The input of block 0 is patch_embed + the interpolated position
            # embeddings (Qwen3VLVisionModel.forward; reshape(seq_len, -1) is a no-op).
            pre(vis.blocks[0], lambda m, i: self.put("vision.pos_embed", i[0]))
        for bi, blk in enumerate(vis.blocks):
            p = f"vision.blk.{bi}."

            def enter(m, i, bi=bi):
                self.block = bi
            pre(blk, enter)
            fwd(blk.norm1, lambda m, i, o, p=p: self.put(p + "norm1", o))
            a = blk.attn

            def qkv(m, i, o, p=p, a=a):
                N = o.shape[0]
                q, k, v = o.reshape(N, 3, a.num_heads, -1).permute(1, 0, 2, 3).unbind(0)
                self.put(p + "q", q)
                self.put(p + "k", k)
                self.put(p + "v", v)
            fwd(a.qkv, qkv)
            pre(a.proj, lambda m, i, p=p: self.put(p + "attn_ctx", i[0]))
            fwd(a.proj, lambda m, i, o, p=p: self.put(p + "attn_out", o))
            pre(blk.norm2, lambda m, i, p=p: self.put(p + "mlp_inp", i[0]))
            fwd(blk.norm2, lambda m, i, o, p=p: self.put(p + "norm2", o))
            fc1, fc2 = (blk.mlp.fc1, blk.mlp.fc2) if hasattr(blk.mlp, "fc1") else (blk.mlp.linear_fc1,
                                                                                   blk.mlp.linear_fc2)
            fwd(fc1, lambda m, i, o, p=p: self.put(p + "mlp_fc1", o))
            pre(fc2, lambda m, i, p=p: self.put(p + "mlp_act", i[0]))
            fwd(fc2, lambda m, i, o, p=p: self.put(p + "mlp_out", o))
            fwd(blk, lambda m, i, o, p=p: self.put(p + "out", o))
        merger_norm = vis.merger.ln_q if hasattr(vis.merger, "ln_q") else vis.merger.norm
        if qwen3:
            assert not vis.merger.use_postshuffle_norm
        fwd(merger_norm, lambda m, i, o: self.put("vision.merger_norm", o))
        fwd(vis.merger, lambda m, i, o: self.put("vision.merger", o))
        for j, dm in enumerate(getattr(vis, "deepstack_merger_list", [])):
            fwd(dm, lambda m, i, o, j=j: self.put(f"vision.deepstack.{j}", o))
        lm = self.model.model.language_model

        def lm_enter(m, args, kwargs):
            # The LM's input: embed with the image rows replaced (prefill).
            if "vision.merger" in self.rec and "inputs_embeds" not in self.rec:
                self.put("inputs_embeds", kwargs["inputs_embeds"], drop_batch=True)
        self.handles.append(lm.register_forward_pre_hook(lm_enter, with_kwargs=True))

        def rope_enter(m, i):
            pos = i[1]  # [3, 1, T]
            assert pos.ndim == 3 and pos.shape[:2] == (3, 1), pos.shape
            assert "positions" not in self.lm.rec
            self.lm.rec["positions"] = pos[:, 0].numpy().astype(np.int64).copy()
        pre(lm.rotary_emb, rope_enter)

        # apply_rotary_pos_emb_vision: q, k [N, Hv, Dv] after the 2-D rotary.
        self.orig_rope_vision = self.modeling.apply_rotary_pos_emb_vision
        orig_rv = self.orig_rope_vision

        def rope_vision(q, k, cos, sin):
            qe, ke = orig_rv(q, k, cos, sin)
            self.put(f"vision.blk.{self.block}.q_rope", qe)
            self.put(f"vision.blk.{self.block}.k_rope", ke)
            return qe, ke
        self.modeling.apply_rotary_pos_emb_vision = rope_vision

        # The module's eager attention serves the vision tower and the LM:
        # vision calls go to HF's function (record_hf's wrapper, installed
        # first, expects LM layers), LM calls to record_hf's wrapper; the
        # weights returned are HF's attention probabilities.
        lm_eager = self.modeling.eager_attention_forward
        hf_eager = self.lm.orig_eager
        self.orig_eager = lm_eager
        vcls = self.vision_attn_cls

        def eager(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
            if isinstance(module, vcls):
                assert attention_mask is None and not module.is_causal and kwargs.get("is_causal") is False
                out, w = hf_eager(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                  **kwargs)
                N = query.shape[2]
                assert w.shape == (1, module.num_heads, N, N), "the vision attention ran in chunks"
                self.put(f"vision.blk.{self.block}.attn_probs", w, drop_batch=True)
                return out, w
            out, w = lm_eager(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
            self.lm.put(f"blk.{self.lm.layer}.attn_probs", w)
            return out, w
        self.modeling.eager_attention_forward = eager

        if hasattr(lm, "_deepstack_process"):
            self.orig_deepstack = lm._deepstack_process
            orig_ds = self.orig_deepstack

            def deepstack(hidden_states, visual_pos_masks, visual_embeds):
                out = orig_ds(hidden_states, visual_pos_masks, visual_embeds)
                self.lm.put(f"blk.{self.lm.layer}.deepstack", out)
                return out
            lm._deepstack_process = deepstack

    def remove(self):
        for h in self.handles:
            h.remove()
        self.handles = []
        if self.orig_rope_vision is not None:
            self.modeling.apply_rotary_pos_emb_vision = self.orig_rope_vision
        if self.orig_eager is not None:
            self.modeling.eager_attention_forward = self.orig_eager
        if self.orig_deepstack is not None:
            del self.model.model.language_model._deepstack_process  # back to the class's method


def images_only(proc_cls):
    """The family's processor class, unchanged but for accepting no video
    processor: transformers' video processors need torchvision, which the
    recorders do not install (images only; the processor's __call__ touches
    the video processor only when videos are given)."""
    class ImagesOnly(proc_cls):
        def check_argument_for_proper_class(self, argument_name, argument):
            if argument_name == "video_processor" and argument is None:
                return None
            return super().check_argument_for_proper_class(argument_name, argument)
    ImagesOnly.__name__ = proc_cls.__name__
    return ImagesOnly


def processor_settings(ip):
    return {"class": type(ip).__name__, "do_resize": bool(ip.do_resize), "resample": int(ip.resample),
            "size": {"shortest_edge": int(ip.size["shortest_edge"]), "longest_edge": int(ip.size["longest_edge"])},
            "do_rescale": bool(ip.do_rescale), "rescale_factor": float(ip.rescale_factor),
            "do_normalize": bool(ip.do_normalize), "image_mean": [float(x) for x in ip.image_mean],
            "image_std": [float(x) for x in ip.image_std], "do_convert_rgb": bool(ip.do_convert_rgb),
            "patch_size": int(ip.patch_size), "temporal_patch_size": int(ip.temporal_patch_size),
            "merge_size": int(ip.merge_size)}


def std_line(rec):
    """Per-stage-group standard deviations (a sanity print: nothing
    saturated, nothing vanishing)."""
    out = {}
    for k, v in rec.items():
        if v.dtype == np.int64 or k.endswith("pixels"):
            continue
        g = k.split(".")[-1] if "blk." in k else k
        out.setdefault(g, []).append(float(v.astype(np.float64).std()))
    return {g: round(float(np.mean(s)), 3) for g, s in sorted(out.items())}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("out_file")
    ap.add_argument("--prompt", required=True, help=f"text with the placeholder {PLACEHOLDER} once")
    ap.add_argument("--image", required=True, help="the PNG (RGB)")
    ap.add_argument("--chat", action="store_true", help="render with the chat template (one user message)")
    ap.add_argument("--decode-steps", type=int, default=4)
    ap.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    args = ap.parse_args()
    if args.prompt.count(PLACEHOLDER) != 1:
        ap.error(f"--prompt must hold {PLACEHOLDER} exactly once")
    if args.decode_steps < 0:
        ap.error("--decode-steps must be >= 0")
    args.tokens_from = None  # for record_hf.build_provenance
    record_hf.make_deterministic()
    transformers.utils.logging.disable_progress_bar()

    with open(os.path.join(args.model, "config.json")) as f:
        cfg_file = json.load(f)
    mt = cfg_file["model_type"]
    if mt not in FAMILIES:
        sys.exit(f"record_vlm.py: model_type {mt!r} is not one of {sorted(FAMILIES)}")
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
        patched = to_float64_vlm(model, modeling)
        guard = F32Guard()
        GUARD[0] = guard
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
    r = record_hf.Recorder(shim)
    r.guard = guard
    r.install()
    v = VisionRecorder(model, modeling, r, guard)
    v.install()
    tcfg = cfg.text_config
    n_layers = tcfg.num_hidden_layers
    n_ds = len(getattr(cfg.vision_config, "deepstack_visual_indexes", []) or [])
    depth = cfg.vision_config.depth
    dims = record_hf.config_dims(tcfg)
    H_, KV_, D_, E_ = dims[:4]
    vc = cfg.vision_config
    Ev = vc.embed_dim if mt == "qwen2_vl" else vc.hidden_size
    Hv = vc.num_heads
    Fv = int(vc.embed_dim * vc.mlp_ratio) if mt == "qwen2_vl" else vc.intermediate_size
    lm_expected = golden_io.all_stages(stage_family, n_layers) + ["tokens", "positions"]
    out, steps, greedy_ids = {}, [], []
    att_rows = {"prefill": [], "decode": []}
    vision_rows = []
    stds = {}
    fed = list(prompt_ids)
    x = ids
    past, pos = None, 0
    model.model.rope_deltas = None
    try:
        with torch.no_grad():
            for si in range(args.decode_steps + 1):
                step = "prefill" if si == 0 else f"decode{si}"
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
                # LM stages (record_hf's Recorder + the attention probabilities).
                assert np.array_equal(r.rec["logits"], res.logits[0].to(torch.float32).numpy())
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
                    if val.dtype != np.int64:
                        assert np.isfinite(val).all(), f"{step}/{k} is not finite"
                    out[f"{step}/{k}"] = val
                for li in range(n_layers):
                    att_rows["prefill" if si == 0 else "decode"] += record_hf.attention_rows(
                        r.rec[f"blk.{li}.attn_probs"], np.arange(pos, pos + T))
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
                        if val.dtype != np.int64:
                            assert np.isfinite(val).all(), f"prefill/{k} is not finite"
                        out[f"prefill/{k}"] = val
                    for bi in range(depth):
                        pr = v.rec[f"vision.blk.{bi}.attn_probs"].astype(np.float64)  # [Hv,N,N]
                        for h in range(Hv):
                            mx = pr[h].max(-1)
                            ent = -(pr[h] * np.log(np.clip(pr[h], 1e-300, 1))).sum(-1) / np.log(N)
                            vision_rows += list(zip(mx, mx * N, ent))
                    stds = std_line({**v.rec, **r.rec})
                else:
                    # Decode: text position + rope delta, the same in all 3 rows.
                    assert (positions == positions[0:1]).all(), positions
                greedy = int(res.logits[0, -1].argmax())
                greedy_ids.append(greedy)
                log(f"{step}: {T} token(s), positions t {positions[0].min()}..{positions[0].max()}, "
                    f"greedy {greedy}")
                fed.append(greedy)
                pos += T
                x = torch.tensor([[greedy]], dtype=torch.int64)
                last_logits = res.logits[0, -1].to(torch.float64).numpy().copy()
    finally:
        v.remove()
        r.remove()
    rope_deltas = int(model.model.rope_deltas.reshape(-1)[0])
    for si, step in enumerate(steps[1:], start=1):
        p = out[f"{step}/positions"]
        assert p.shape == (3, 1) and int(p[0, 0]) == len(prompt_ids) + si - 1 + rope_deltas, (step, p, rope_deltas)

    # KV-cache cross-check: one forward over prompt + fed tokens.
    full = torch.tensor([fed[:-1]], dtype=torch.int64)
    mm_full = torch.cat([mm_types, torch.zeros((1, full.shape[1] - mm_types.shape[1]), dtype=mm_types.dtype)], 1)
    model.model.rope_deltas = None
    with torch.no_grad(), guard or contextlib.nullcontext():
        lf = model(input_ids=full, pixel_values=pixel_in, image_grid_thw=grid, mm_token_type_ids=mm_full,
                   use_cache=False).logits[0, -1].to(torch.float64).numpy()
    cache_vs_full = float(np.abs(lf - last_logits).max())
    assert cache_vs_full < 1e-3, cache_vs_full
    if guard is not None:
        assert not guard.bad, f"float64 run: ops produced other float dtypes: {dict(guard.bad)}"
    # HF's own greedy generation on the same inputs must pick the same ids.
    model.model.rope_deltas = None
    with torch.no_grad():
        gen = model.generate(input_ids=ids, attention_mask=inputs["attention_mask"], pixel_values=pixel_in,
                             image_grid_thw=grid, mm_token_type_ids=mm_types, do_sample=False,
                             max_new_tokens=args.decode_steps + 1, min_new_tokens=args.decode_steps + 1,
                             eos_token_id=None, pad_token_id=tok.pad_token_id)
    gen_ids = gen[0, len(prompt_ids):].tolist()
    assert gen_ids == greedy_ids, f"generate() picked {gen_ids}, the recording {greedy_ids}"

    # ---- provenance ---------------------------------------------------------
    prompt = {"text": args.prompt, "token_ids": prompt_ids}
    if args.chat:
        prompt = {"text": args.prompt, "chat": True, "rendered": text, "token_ids": prompt_ids}
    source = {"kind": "hf", "sharded": False,
              "files": {"model.safetensors": sha256_file(os.path.join(args.model, "model.safetensors"))},
              "tokenizer_sha256": sha256_file(os.path.join(args.model, "tokenizer.json"))}
    prov = record_hf.build_provenance(args, prompt, cfg_file, greedy_ids, steps, cache_vs_full, source, None, None)
    prov["recorder"] = RECORDER
    prov["versions"]["pillow"] = PIL.__version__
    prov["image"] = {"file": os.path.basename(args.image), "sha256": sha256_file(args.image), "size": [H, W]}
    prov["preprocessor_sha256"] = sha256_file(os.path.join(args.model, "preprocessor_config.json"))
    prov["processor"] = processor_settings(ip)
    prov["grid_thw"] = grid[0].tolist()
    prov["rope_deltas"] = rope_deltas
    prov["generate_ids"] = gen_ids
    if patched is not None:
        prov["float64"] = patched
    metadata = {"format": FORMAT, "provenance": json.dumps(prov, sort_keys=True, separators=(",", ":"))}
    os.makedirs(os.path.dirname(os.path.abspath(args.out_file)), exist_ok=True)
    tmp = args.out_file + ".tmp"
    save_deterministic(out, metadata, tmp)
    os.replace(tmp, args.out_file)
    log(f"wrote {args.out_file}: {len(out)} tensors, {os.path.getsize(args.out_file)} bytes")
    va = np.array(vision_rows)
    print(json.dumps({
        "out": args.out_file, "tensors": len(out), "bytes": os.path.getsize(args.out_file),
        "sha256": sha256_file(args.out_file), "grid_thw": grid[0].tolist(), "prompt_tokens": len(prompt_ids),
        "greedy_ids": greedy_ids, "greedy_text": tok.decode(greedy_ids), "rope_deltas": rope_deltas,
        "cache_vs_full_max_abs_diff": cache_vs_full, "dtype": args.dtype,
        "logits_absmax": round(float(max(np.abs(out[f"{s}/logits"]).max() for s in steps)), 4),
        "last_logits_top2_gap": [round(float(np.sort(out[f"{s}/logits"][-1])[-1] - np.sort(out[f"{s}/logits"][-1])[-2]), 4)
                                 for s in steps],
        "lm_attention": {"prefill_rows": record_hf.attention_summary(att_rows["prefill"]),
                         "decode_rows": record_hf.attention_summary(att_rows["decode"]) if att_rows["decode"] else None},
        "vision_attention": {"rows": len(va), "row_max_x_n_mean": round(float(va[:, 1].mean()), 2),
                             "row_max_x_n_median": round(float(np.median(va[:, 1])), 2),
                             "row_max_mean": round(float(va[:, 0].mean()), 4),
                             "normalized_entropy_mean": round(float(va[:, 2].mean()), 3),
                             "rows_max_above_0.9": int((va[:, 0] > 0.9).sum())},
        "prefill_std": stds,
    }))


if __name__ == "__main__":
    sys.exit(main())
