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

import numpy as np

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
