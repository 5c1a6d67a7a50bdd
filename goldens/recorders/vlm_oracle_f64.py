"""The float64 oracle of a vision-language model (record_vlm.py --dtype float64).

The whole (tiny) model is converted to float64: no streaming is needed, and
record_hf.py's streamed oracle equals the whole-model conversion
(docs/goldens.md). HF's float32 islands are replaced for the run by the same
formulas in float64, each checked against HF's own float32 version: the
LM's RMSNorm (q_norm/k_norm too), the LM's M-RoPE tables (inv_freq
1/theta^(2i/d) and angles in float64, then HF's own
recomposition_frequencies), the vision tower's 2-D RoPE tables,
apply_rotary_pos_emb_vision (HF casts q, k, cos, sin to float32), the eager
softmax (dtype=float32 in HF), and Qwen3-VL's bilinear interpolation weights
of the learned position embeddings (HF computes them in float32; here the
same taps, the weights in float64). The caller runs every forward under
oracle_f64.F32Guard and puts it in GUARD[0], where the interpolation patch
finds it.

LLaVA (to_float64_llava): fewer islands. The CLIP tower's LayerNorms,
quick_gelu, the projector's erf GELU and NeXT's packing (integer geometry,
image_newline cast to the features' dtype) all compute in the model's dtype;
only the Llama LM's RoPE table and RMSNorm and the eager softmax (the tower's
and the LM's) ask for float32, and are replaced as for Qwen-VL.
"""
import types

import torch

from oracle_f64 import allowed, rms_forward_f64, rope_default_f64, softmax_float64

GUARD = [None]  # the F32Guard of a float64 run (the interpolation patch reads it)


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
    softmax_float64()
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


def to_float64_llava(model):
    """The float64 oracle of a LLaVA or LLaVA-NeXT model: the whole model in
    float64, the LM's default RoPE table from rope_default_f64 (checked
    against HF's inv_freq), every RMSNorm by rms_forward_f64, softmax in
    float64. Returns what was patched."""
    assert all(p.dtype == torch.float32 for p in model.parameters())
    model.to(torch.float64)
    assert all(p.dtype == torch.float64 for p in model.parameters())
    for mod in model.modules():
        for bname, buf in list(mod._buffers.items()):
            if buf is not None and buf.is_floating_point():
                mod._buffers[bname] = buf.to(torch.float64)
    tc = model.config.text_config
    rot = model.model.language_model.rotary_emb
    inv64 = rope_default_f64(tc)
    assert rot.attention_scaling == 1.0 and rot.inv_freq.shape == inv64.shape
    assert torch.allclose(rot.inv_freq.to(torch.float64), inv64, rtol=1e-6, atol=0), "inv_freq differs from HF's"

    def rope_forward(self, x, position_ids):
        freqs = position_ids[..., None].to(torch.float64) * inv64
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)
    rot.forward = types.MethodType(rope_forward, rot)
    norms = layernorms = 0
    for name, mod in model.named_modules():
        if type(mod).__name__.endswith("RMSNorm"):
            mod.forward = types.MethodType(rms_forward_f64, mod)
            norms += 1
        elif "Norm" in type(mod).__name__:
            assert isinstance(mod, torch.nn.LayerNorm), f"{name}: {type(mod).__name__} has no float64 replacement"
            layernorms += 1
    softmax_float64()
    return {"lm_rope": f"float64 default, theta {tc.rope_parameters['rope_theta']}", "rmsnorm_modules": norms,
            "layernorm_modules": f"{layernorms} (torch's, in float64)", "softmax": "float64"}
