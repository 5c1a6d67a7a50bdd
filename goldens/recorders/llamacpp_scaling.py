"""What llama.cpp was given for a scaled RoPE or a sliding window, as
record_llamacpp.py writes it into a golden's provenance.

llama.cpp does not follow an HF config in everything, and the llama.cpp
golden records what llama.cpp does, never a correction towards HF. For the
pinned llama.cpp (llama-cpp-python 0.3.36's vendor/llama.cpp):

- dynamic NTK: the converter writes no scaling for `rope_type: dynamic`
  (conversion/base.py set_gguf_parameters: "HunYuan, handled in model
  class"), so llama.cpp ropes with the plain table at every length;
- YaRN: the GGUF carries type, factor and original context, not HF's
  `truncate`; ggml_rope_yarn_corr_dims (ggml/src/ggml.c) always floors the
  low and ceils the high correction dimension;
- LongRoPE (Phi-3): the converter writes rope_factors_long/short and
  rope.scaling.attn_factor, no scaling type (llama.cpp's default "linear",
  factor 1); llama_model::get_rope_factors picks long or short by the
  context's n_ctx_seq against rope.scaling.original_context_length, once
  per context, not by the pass length (and llama_context pads n_ctx to a
  multiple of 256);
- Llama 3: the converter folds the bands into a rope_freqs tensor of
  per-pair divisors;
- Qwen2's sliding window: the converter writes no sliding_window for qwen2
  and llama_model_qwen2 builds full attention (build_attn_inp_kv).

A spec's `config:` override (record_llamacpp.py --config-override) is not
in the GGUF: override_context() gives llama.cpp its RoPE through the
context parameters (llama_context_params; llama-context.cpp turns them into
the cparams every ROPE of the graph gets), computed from the merged HF
config the HF golden records, and refuses (exit 2) what they cannot say.
YaRN: rope_scaling_type YARN, rope_freq_scale 1/factor, yarn_orig_ctx
original_max_position_embeddings, yarn_ext_factor 1, yarn_beta_fast and
yarn_beta_slow HF's (32 and 1 unless given). yarn_attn_factor is not given:
with ext_factor != 0 llama_context overwrites it with get_mscale(factor) /
(1 + 0.1 ln factor) (times the GGUF's rope.scaling.attn_factor, refused
unless 1), and ggml's rope_yarn multiplies cos/sin by it times
1 + 0.1 ln(1/freq_scale): 0.1 ln(factor) + 1, HF's attention factor.
Linear: rope_scaling_type LINEAR, rope_freq_scale 1/factor. rope_theta:
rope_freq_base. check_override() asserts the graph's ROPE op_params are
what was given and that the frequencies and magnitude they make (ggml's
formulas, in float64) are HF's (rope_scaling_f64.inv_freq_f64 of the
merged config) within float32 rounding.

rope_provenance(): the GGUF keys (rope.*, context_length), the context
(n_ctx, n_ctx_seq, n_ctx_train, rope_freq_scale_train), and from the graph
every ROPE's parameters (ggml_rope_impl's op_params: n_dims, mode,
n_ctx_orig, freq_base, freq_scale, ext_factor, attn_factor, beta_fast,
beta_slow) and frequency-factor tensor, asserted the same for Q and K of
every layer and in every step, with YaRN's correction dims and magnitude
scale as ggml computes them. sliding_window_entry(): the HF window, the
GGUF key, llama_model_n_swa and whether the window is applied.
"""
import ctypes
import json
import math
import types

import numpy as np

import config_override

F32 = np.float32


def rope_scaled(hf_cfg):
    """Whether the HF config has one (not per-layer-type) scaled RoPE."""
    rp = hf_cfg.get("rope_parameters") or {}
    return "rope_theta" in rp and rp.get("rope_type", "default") != "default"


def _value(text):
    for conv in (int, float):
        try:
            return conv(text)
        except ValueError:
            pass
    return text


def gguf_keys(lc, model, arch):
    """The GGUF metadata llama.cpp read about positions: {key: value} for
    `<arch>.context_length`, `<arch>.rope.*` and `<arch>.attention.sliding_window*`."""
    out = {}
    buf = ctypes.create_string_buffer(4096)
    for i in range(lc.llama_model_meta_count(model)):
        if lc.llama_model_meta_key_by_index(model, i, buf, len(buf)) < 0:
            continue
        key = buf.value.decode()
        if key == f"{arch}.context_length" or key.startswith((f"{arch}.rope.", f"{arch}.attention.sliding_window")):
            assert lc.llama_model_meta_val_str_by_index(model, i, buf, len(buf)) >= 0, key
            out[key] = _value(buf.value.decode())
    return dict(sorted(out.items()))


def _rope_params(node):
    ints = np.frombuffer(node["op_params"], dtype=np.int32)
    fl = np.frombuffer(node["op_params"], dtype=np.float32)
    ff = node["freq_factors"]
    return {
        "n_dims": int(ints[1]), "mode": int(ints[2]), "n_ctx_orig": int(ints[4]),
        "freq_base": float(fl[5]), "freq_scale": float(fl[6]), "ext_factor": float(fl[7]),
        "attn_factor": float(fl[8]), "beta_fast": float(fl[9]), "beta_slow": float(fl[10]),
        "freq_factors": None if ff is None else {"tensor": ff[0], "values": [float(x) for x in ff[1].ravel()]},
    }


def rope_graph(nodes, n_layer, step):
    """The parameters every ROPE of Q and K in one step's graph was given
    (asserted equal across layers: one scaling for the model)."""
    seen = None
    for L in range(n_layer):
        for name in (f"Qcur-{L}", f"Kcur-{L}"):
            hits = [n for n in nodes if n["name"] == name and n["op"] == "ROPE"]
            assert len(hits) == 1, f"{step}: {len(hits)} ROPE nodes {name}"
            p = _rope_params(hits[0])
            assert seen is None or p == seen, f"{step}: {name} ropes with {p}, another with {seen}"
            seen = p
    return seen


def yarn_corr_dims(p):
    """ggml_rope_yarn_corr_dims (ggml/src/ggml.c) in float32: floor of the
    beta_fast dimension, ceil of the beta_slow one, clamped to [0, n_dims - 1]."""
    def corr_dim(n_rot):
        return F32(p["n_dims"]) * np.log(F32(p["n_ctx_orig"]) / (F32(n_rot) * F32(2) * F32(np.pi)), dtype=F32) \
            / (F32(2) * np.log(F32(p["freq_base"]), dtype=F32))
    lo = np.floor(corr_dim(p["beta_fast"]))
    hi = np.ceil(corr_dim(p["beta_slow"]))
    return [float(max(F32(0), lo)), float(min(F32(p["n_dims"] - 1), hi))]


def rope_provenance(hf_cfg, keys, context, steps_params):
    """Provenance `rope_scaling` of a scaled model's llama.cpp golden.
    `steps_params`: {step: rope_graph(...)}; asserted the same in every
    step (llama.cpp has no per-pass table)."""
    first = next(iter(steps_params.values()))
    for step, p in steps_params.items():
        assert p == first, f"{step}: RoPE parameters {p} differ from the first step's {first}"
    graph = dict(first)
    if graph["ext_factor"] != 0.0:
        # rope_yarn (ggml-cpu/ops.cpp): ramp between the corr dims, and
        # cos/sin times attn_factor * (1 + 0.1 ln(1 / freq_scale)).
        graph["yarn_corr_dims"] = yarn_corr_dims(graph)
        graph["yarn_mscale"] = float(F32(graph["attn_factor"]) *
                                     (F32(1) + F32(0.1) * np.log(F32(1) / F32(graph["freq_scale"]), dtype=F32)))
    arch_type = [v for k, v in keys.items() if k.endswith(".rope.scaling.type")]
    ff = graph["freq_factors"]
    entry = {
        "hf": {"rope_parameters": hf_cfg["rope_parameters"],
               "max_position_embeddings": hf_cfg["max_position_embeddings"]},
        "gguf": keys,
        "rope_scaling_type": arch_type[0] if arch_type else "linear (no rope.scaling.type in the GGUF: llama.cpp's "
                                                              "default, freq_scale from rope.scaling.factor or 1)",
        "context": context,
        "graph": graph,
        "per_pass_tables": False,
    }
    if ff is not None and ff["tensor"].startswith("rope_factors_"):
        # llama_model::get_rope_factors: long iff n_ctx_seq > n_ctx_orig_yarn.
        entry["longrope_factors"] = {"used": ff["tensor"].split("_")[2].split(".")[0],
                                     "n_ctx_seq": context["n_ctx_seq"], "n_ctx_orig_yarn": graph["n_ctx_orig"]}
    return entry


def sliding_window_entry(hf_cfg, arch, gguf_window, n_swa, windows):
    """Provenance `sliding_window` of a model whose HF config slides where
    llama.cpp does not (or otherwise than HF)."""
    return {
        "hf": {"sliding_window": hf_cfg.get("sliding_window"), "layer_types": hf_cfg.get("layer_types"),
               "use_sliding_window": hf_cfg.get("use_sliding_window"),
               "max_window_layers": hf_cfg.get("max_window_layers")},
        "gguf": {f"{arch}.attention.sliding_window": None if gguf_window is None else _value(gguf_window)},
        "llama_model_n_swa": n_swa,
        "applied": any(w is not None for w in windows),
        "windows": windows,
    }


# llama.h's enum llama_rope_scaling_type, by HF rope_type.
SCALING_TYPE = {"default": ("LLAMA_ROPE_SCALING_TYPE_NONE", 0), "linear": ("LLAMA_ROPE_SCALING_TYPE_LINEAR", 1),
                "yarn": ("LLAMA_ROPE_SCALING_TYPE_YARN", 2)}
# The RoPE entries each type can be given through the context parameters.
EXPRESSIBLE = {"default": {"rope_type", "rope_theta"}, "linear": {"rope_type", "rope_theta", "factor"},
               "yarn": {"rope_type", "rope_theta", "factor", "original_max_position_embeddings", "beta_fast",
                        "beta_slow", "truncate", "attention_factor"}}


def hf_rope(hf_cfg):
    """The merged HF config's RoPE parameters, transformers 5's form
    (rope_theta inside, `type` as `rope_type`)."""
    rp = dict(hf_cfg.get("rope_parameters") or hf_cfg.get("rope_scaling") or {})
    if "type" in rp:
        rp.setdefault("rope_type", rp.pop("type"))
    rp.setdefault("rope_theta", hf_cfg.get("rope_theta", 10000.0))
    rp.setdefault("rope_type", "default")
    return rp


def yarn_factor(rp, hf_cfg):
    return float(rp.get("factor") or hf_cfg["max_position_embeddings"] / rp["original_max_position_embeddings"])


def override_context(lc, cparams, hf_cfg, over, keys, arch):
    """Sets `cparams` (llama_context_params) so that llama.cpp ropes as the
    merged HF config `hf_cfg` says for the override `over`; returns what it
    was given ({param: value}). Exits 2 with the reason for an override
    llama.cpp's context parameters cannot express."""
    def refuse(msg):
        config_override.fail("record_llamacpp.py", f"{json.dumps(over, sort_keys=True)}: {msg}")
    bad = [k for k in sorted(over) if k not in config_override.GGUF_KEYS]
    if bad:
        refuse(f"llama.cpp's context parameters cannot express `{bad[0]}` (only rope_scaling, rope_parameters and "
               "max_position_embeddings reach a GGUF that runs as it is)")
    rp = hf_rope(hf_cfg)
    kind = rp["rope_type"]
    if kind not in SCALING_TYPE:
        refuse(f"rope_type {kind!r} has no llama.cpp context parameter (llama.cpp gives none for dynamic NTK; "
               "LongRoPE's factors and Llama 3's rope_freqs are GGUF tensors)")
    set_ = set(config_override.rope_entries(over))
    extra = sorted(set_ - EXPRESSIBLE[kind])
    if extra:
        refuse(f"{kind} with {extra}: not expressible through llama.cpp's context parameters")
    for k in ("scaling.attn_factor", "scaling.yarn_log_multiplier"):
        v = keys.get(f"{arch}.rope.{k}")
        if v is not None and float(v) not in (0.0, 1.0) and kind != "default":
            refuse(f"the GGUF's {arch}.rope.{k} = {v} would change llama.cpp's attention factor")
    given = {}
    if "rope_theta" in set_:
        cparams.rope_freq_base = float(rp["rope_theta"])
        given["rope_freq_base"] = cparams.rope_freq_base
    name, value = SCALING_TYPE[kind]
    if set_ - {"rope_theta"}:
        cparams.rope_scaling_type = value
        given["rope_scaling_type"] = name
    if kind == "linear":
        cparams.rope_freq_scale = 1.0 / float(rp["factor"])
        given["rope_freq_scale"] = cparams.rope_freq_scale
    if kind == "yarn":
        if rp.get("truncate", True) is not True:
            refuse("YaRN with truncate false: ggml_rope_yarn_corr_dims always floors and ceils the correction range")
        factor = yarn_factor(rp, hf_cfg)
        if factor < 1:
            refuse(f"YaRN factor {factor} < 1")
        att = 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0
        if rp.get("attention_factor") is not None and abs(float(rp["attention_factor"]) - att) > 1e-7 * att:
            refuse(f"YaRN attention_factor {rp['attention_factor']}: llama.cpp always makes it 0.1 ln(factor) + 1 "
                   f"= {att:.9g}")
        cparams.rope_freq_scale = 1.0 / factor
        cparams.yarn_orig_ctx = int(rp["original_max_position_embeddings"])
        cparams.yarn_ext_factor = 1.0
        cparams.yarn_beta_fast = float(rp.get("beta_fast") or 32)
        cparams.yarn_beta_slow = float(rp.get("beta_slow") or 1)
        given.update(rope_freq_scale=cparams.rope_freq_scale, yarn_orig_ctx=cparams.yarn_orig_ctx,
                     yarn_ext_factor=cparams.yarn_ext_factor, yarn_beta_fast=cparams.yarn_beta_fast,
                     yarn_beta_slow=cparams.yarn_beta_slow,
                     yarn_attn_factor="not given (-1): llama_context sets get_mscale(factor) / (1 + 0.1 ln factor)")
    return given


def check_override(graph, given, hf_cfg):
    """Asserts the graph's ROPE parameters (rope_graph's, the same in every
    layer and step) are what override_context gave, and that the per-pair
    frequencies and the cos/sin magnitude ggml computes from them (in
    float64) are HF's for the merged config; returns the measures."""
    import rope_scaling_f64
    f32 = lambda x: float(F32(x))  # noqa: E731  (ggml's op_params are float32)
    rp = hf_rope(hf_cfg)
    kind = rp["rope_type"]
    assert graph["freq_factors"] is None, f"the ROPE has frequency factors {graph['freq_factors']['tensor']}"
    if "rope_freq_base" in given:
        assert graph["freq_base"] == f32(given["rope_freq_base"]), graph
    assert graph["freq_base"] == f32(rp["rope_theta"]), (graph["freq_base"], rp["rope_theta"])
    if kind in ("linear", "yarn"):
        assert graph["freq_scale"] == f32(given["rope_freq_scale"]), (graph["freq_scale"], given)
    else:
        assert graph["freq_scale"] == 1.0, graph
    if kind == "yarn":
        for k, g in (("n_ctx_orig", "yarn_orig_ctx"), ("ext_factor", "yarn_ext_factor"),
                     ("beta_fast", "yarn_beta_fast"), ("beta_slow", "yarn_beta_slow")):
            assert graph[k] == f32(given[g]), f"ROPE {k} {graph[k]}, given {g} {given[g]}"
    else:
        assert graph["ext_factor"] == 0.0, graph
    # ggml's frequencies (ggml_rope_cache_init / rope_yarn), per pair i of n_dims.
    n = graph["n_dims"]
    i = np.arange(n // 2, dtype=np.float64)
    extrap = float(graph["freq_base"]) ** (-2.0 * i / n)
    fs, ext = float(graph["freq_scale"]), float(graph["ext_factor"])
    mscale = float(graph["attn_factor"])
    if ext != 0.0:
        lo, hi = yarn_corr_dims(graph)
        mix = (1 - np.clip((i - lo) / max(0.001, hi - lo), 0, 1)) * ext
        inv = extrap * fs * (1 - mix) + extrap * mix
        mscale *= 1.0 + 0.1 * math.log(1.0 / fs)
    else:
        inv = extrap * fs
    head_dim = hf_cfg.get("head_dim") or hf_cfg["hidden_size"] // hf_cfg["num_attention_heads"]
    cfg = types.SimpleNamespace(rope_parameters=rp, head_dim=head_dim, hidden_size=hf_cfg["hidden_size"],
                                num_attention_heads=hf_cfg["num_attention_heads"],
                                max_position_embeddings=hf_cfg["max_position_embeddings"])
    if kind == "default":
        hf_inv, hf_att = rope_scaling_f64._default(float(rp["rope_theta"]), n).numpy(), 1.0
    else:
        t, hf_att = rope_scaling_f64.inv_freq_f64(cfg)
        hf_inv = t.numpy()
    assert hf_inv.shape == inv.shape, (hf_inv.shape, inv.shape)
    rel = float(np.max(np.abs(inv - hf_inv) / hf_inv))
    att_rel = abs(mscale - hf_att) / hf_att
    assert rel < 1e-6, f"llama.cpp's RoPE frequencies are {rel:.3g} (relative) from HF's {kind}"
    assert att_rel < 1e-6, f"llama.cpp's cos/sin magnitude {mscale} is not HF's attention factor {hf_att}"
    return {"inv_freq_max_rel_diff_from_hf": rel, "magnitude": mscale, "hf_attention_factor": hf_att,
            "magnitude_rel_diff_from_hf": att_rel}
