"""The hooks that tap every vision and fusion stage of a vision-language
model (Qwen2-VL, Qwen3-VL; LLaVA-1.5 and LLaVA-NeXT: LlavaVisionRecorder) in
HF transformers, for record_vlm.py.

VisionRecorder copies the vision tower's stages (prefill only), the LM's
input after fusion (`inputs_embeds`), the M-RoPE positions HF's rotary
embedding receives and Qwen3-VL's deepstack adds; the LM's own stages are
hf_hooks.Recorder's (the module's eager attention serves both the tower and
the LM: vision calls go to HF's function, LM calls to the LM recorder's
wrapper). vision_shape() is the vision stages' layouts (golden_io.py has
their names; record_vlm.py's docstring lists both); images_only() and
processor_settings() the processor as the recorder builds and records it.
"""
import importlib

import numpy as np
import torch

from oracle_f64 import allowed


def vision_shape(stage, N, M, Ev, Hv, Dv, Fv, E, C):
    name = stage.split(".")[-1]
    if stage.startswith("vision.deepstack.") or stage == "vision.merger":
        return (M, E)
    return {"pixels": (N, C), "grid": (1, 3), "q": (N, Hv, Dv), "k": (N, Hv, Dv), "v": (N, Hv, Dv),
            "q_rope": (N, Hv, Dv), "k_rope": (N, Hv, Dv), "attn_probs": (Hv, N, N), "attn_ctx": (N, Hv * Dv),
            "mlp_fc1": (N, Fv), "mlp_act": (N, Fv)}.get(name, (N, Ev))


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


def llava_vision_shape(stage, P, N, Ev, Hv, Fv, E, M, side):
    """The layout of a LLaVA vision stage (record_vlm.py's docstring): P
    tower images (LLaVA-1.5: 1; NeXT: the base image and the tiles), N
    patches each, R = N + 1 rows with the CLS row, stacked image by image."""
    R, name = N + 1, stage.split(".")[-1]
    return {"pixels": (P, 3, side, side), "patch_embed": (P * N, Ev), "features": (P * N, Ev),
            "proj_fc1": (P * N, E), "proj_act": (P * N, E), "projector": (P * N, E), "merger": (M, E),
            "q": (P * R, Hv, Ev // Hv), "k": (P * R, Hv, Ev // Hv), "v": (P * R, Hv, Ev // Hv),
            "attn_probs": (P * Hv, R, R), "mlp_fc1": (P * R, Fv), "mlp_act": (P * R, Fv)}.get(name, (P * R, Ev))


class LlavaVisionRecorder:
    """Forward hooks and wrappers that copy every stage of LLaVA's CLIP tower,
    its projector and the packed image rows (prefill only), the LM's input
    after fusion and the positions HF's rotary embedding receives. The tower
    runs its P images as a batch: every [P, rows, ...] tensor is stored
    [P * rows, ...] (image p's rows p * rows ..), attn_probs [P, Hv, R, R] as
    [P * Hv, R, R] (image p's head h at p * Hv + h). The tower's eager
    attention is modeling_clip's, the LM's modeling_llama's (wrapped by
    hf_hooks.Recorder first): two functions, each wrapped here."""

    def __init__(self, model, lm_recorder, guard):
        self.model, self.lm, self.guard = model, lm_recorder, guard
        self.rec = {}
        self.handles = []
        self.block = None
        self.clip = importlib.import_module(type(model.model.vision_tower).__module__)
        self.llama = lm_recorder.modeling
        assert self.clip is not self.llama, "the tower and the LM share a modeling module"
        self.orig_clip_eager = self.orig_lm_eager = None

    def put(self, name, t, stack=True):
        """Store `t` ([P, rows, ...] -> [P * rows, ...] when `stack`)."""
        assert name not in self.rec, f"{name} recorded twice"
        with allowed(self.guard):
            x = t.detach()
            if stack:
                x = x.reshape(-1, *x.shape[2:])
            self.rec[name] = x.to(torch.float32).contiguous().numpy().copy()

    def install(self):
        m = self.model.model
        tower, mp, lm = m.vision_tower, m.multi_modal_projector, m.language_model
        fwd = lambda mod, fn: self.handles.append(mod.register_forward_hook(fn))
        pre = lambda mod, fn: self.handles.append(mod.register_forward_pre_hook(fn))
        emb = tower.embeddings
        # The Conv2d's [P, Ev, g, g] in patch order: flatten(2).transpose(1, 2), as CLIPVisionEmbeddings.
        fwd(emb.patch_embedding, lambda mod, i, o: self.put("vision.patch_embed", o.flatten(2).transpose(1, 2)))
        fwd(emb, lambda mod, i, o: self.put("vision.pos_embed", o))  # cat(class, patches) + positions
        fwd(tower.pre_layrnorm, lambda mod, i, o: self.put("vision.pre_norm", o))
        for bi, layer in enumerate(tower.encoder.layers):
            p = f"vision.blk.{bi}."

            def enter(mod, i, bi=bi):
                self.block = bi
            pre(layer, enter)
            fwd(layer.layer_norm1, lambda mod, i, o, p=p: self.put(p + "norm1", o))
            a = layer.self_attn
            for which in ("q", "k", "v"):
                # [P, R, Ev] -> [P, R, Hv, Dv]: q_proj's output, bias included, not scaled.
                fwd(getattr(a, f"{which}_proj"), lambda mod, i, o, p=p, w=which, a=a: self.put(
                    p + w, o.view(*o.shape[:2], a.num_heads, a.head_dim)))
            pre(a.out_proj, lambda mod, i, p=p: self.put(p + "attn_ctx", i[0]))
            fwd(a.out_proj, lambda mod, i, o, p=p: self.put(p + "attn_out", o))
            pre(layer.layer_norm2, lambda mod, i, p=p: self.put(p + "mlp_inp", i[0]))
            fwd(layer.layer_norm2, lambda mod, i, o, p=p: self.put(p + "norm2", o))
            fwd(layer.mlp.fc1, lambda mod, i, o, p=p: self.put(p + "mlp_fc1", o))
            pre(layer.mlp.fc2, lambda mod, i, p=p: self.put(p + "mlp_act", i[0]))
            fwd(layer.mlp.fc2, lambda mod, i, o, p=p: self.put(p + "mlp_out", o))
            fwd(layer, lambda mod, i, o, p=p: self.put(p + "out", o[0] if isinstance(o, tuple) else o))
        # The projector's input is hidden_states[vision_feature_layer] without its CLS row.
        pre(mp, lambda mod, i: self.put("vision.features", i[0]))
        fwd(mp.linear_1, lambda mod, i, o: self.put("vision.proj_fc1", o))
        pre(mp.linear_2, lambda mod, i: self.put("vision.proj_act", i[0]))
        fwd(mp.linear_2, lambda mod, i, o: self.put("vision.projector", o))
        # The image rows in the order they replace the <image> tokens (LLaVA-1.5:
        # the projector's rows; NeXT: pack_image_features' sequence), as the
        # model hands them to get_placeholder_mask before its masked_scatter.
        orig_mask = m.get_placeholder_mask

        def placeholder_mask(input_ids, inputs_embeds, image_features):
            self.put("vision.merger", image_features, stack=False)
            return orig_mask(input_ids, inputs_embeds=inputs_embeds, image_features=image_features)
        m.get_placeholder_mask = placeholder_mask

        def lm_enter(mod, args, kwargs):
            if "vision.merger" in self.rec and "inputs_embeds" not in self.rec:
                t = kwargs["inputs_embeds"]
                assert t.shape[0] == 1
                self.put("inputs_embeds", t[0], stack=False)
        self.handles.append(lm.register_forward_pre_hook(lm_enter, with_kwargs=True))

        def rope_enter(mod, args, kwargs):
            pos = kwargs["position_ids"] if "position_ids" in kwargs else args[1]  # [1, T]
            assert pos.ndim == 2 and pos.shape[0] == 1 and "positions" not in self.lm.rec, pos.shape
            self.lm.rec["positions"] = pos[0].numpy().astype(np.int64).copy()
        self.handles.append(lm.rotary_emb.register_forward_pre_hook(rope_enter, with_kwargs=True))

        self.orig_clip_eager = clip_eager = self.clip.eager_attention_forward

        def vision_eager(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
            # Bidirectional, no mask, scaling head_dim^-0.5 on the unscaled q.
            assert attention_mask is None and not module.is_causal and scaling == module.head_dim ** -0.5
            out, w = clip_eager(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
            assert w.shape[1:] == (module.num_heads, query.shape[2], query.shape[2]), w.shape
            self.put(f"vision.blk.{self.block}.attn_probs", w)  # [P, Hv, R, R] -> [P * Hv, R, R]
            return out, w
        self.clip.eager_attention_forward = vision_eager
        # The LM: hf_hooks.Recorder's wrapper (scores), then its probabilities.
        self.orig_lm_eager = lm_eager = self.llama.eager_attention_forward

        def text_eager(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
            out, w = lm_eager(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
            self.lm.put(f"blk.{self.lm.layer}.attn_probs", w)
            return out, w
        self.llama.eager_attention_forward = text_eager

    def remove(self):
        for h in self.handles:
            h.remove()
        self.handles = []
        if "get_placeholder_mask" in vars(self.model.model):
            del self.model.model.get_placeholder_mask  # back to the class's method
        if self.orig_clip_eager is not None:
            self.clip.eager_attention_forward = self.orig_clip_eager
        if self.orig_lm_eager is not None:
            self.llama.eager_attention_forward = self.orig_lm_eager
