"""The long-context tiny families (issue 37: RoPE scaling and sliding windows).

make_model.py --family llama3|yarn|longrope|linear|dynamic|swa builds them:
each is an existing tiny family (the `base`: its dims, tokenizer, seeds,
initializer range, tied or paired LM head) with a config that differs only
in its RoPE scaling or its sliding window. This module holds what differs
(`VARIANTS`: the config keyword overrides) and check_written(), which reads
the written config.json back through transformers and asserts that HF reads
the scaling or window as intended, so a key transformers would silently
ignore or standardise away fails the build instead of the goldens.

  llama3   llama, rope_theta 10000 (so the 8 pairs of head_dim 16 fall in
           all three Llama-3 bands with original_max_position_embeddings
           32: pair 0's wavelength 6.28 < 32/4 is high-frequency (kept),
           pair 1's 19.9 is in the smoothing band, pairs 2-7 (>= 62.8 >
           32) are divided by the factor 8); 256 positions.
  yarn     qwen2, YaRN factor 4 over original_max_position_embeddings 32,
           truncate false (HF then uses the real-valued correction range;
           llama.cpp's ggml_rope_yarn_corr_dims always floors/ceils it);
           128 positions, so the attention factor is 0.1 ln 4 + 1.
  longrope phi3, LongRoPE with distinct short (1.0 .. 1.3) and long (1.0 ..
           8.0) factors per pair, original_max_position_embeddings 32 kept
           top-level as Phi-3 does (HF's standardize_rope_params copies it
           into rope_parameters), 128 positions: HF picks the long factors
           for a forward whose max(position_ids) + 1 > 32, the short ones
           otherwise; attention factor sqrt(1 + ln 4 / ln 32).
  linear   llama, rope_theta 10000, linear factor 2 (positions / 2); 256
           positions.
  dynamic  llama, rope_theta 10000, dynamic NTK factor 2 over 32 positions:
           HF rebuilds inv_freq when a forward's max(position_ids) + 1
           exceeds the largest length seen, and never re-rotates cached keys.
  swa      qwen2 with use_sliding_window, sliding_window 8, max_window_layers
           1: HF derives layer_types [full_attention, sliding_attention], so
           layer 1 sees the last 8 positions only (the default 1024
           positions, default RoPE).

The goldens of these models (docs: goldens/recorders/README.md) are
recorded on 30 prompt token ids and 4 decode steps, so the passes reach
lengths 31 .. 34 and straddle 32, the boundary of every scaling above.
"""
import copy
import math

ROPE_THETA = 10000.0
ORIGINAL_MAX = 32
HEAD_DIM = 16  # every base family here (llama, qwen2, phi3)
SHORT_FACTOR = [round(1.0 + 0.3 * j / (HEAD_DIM // 2 - 1), 4) for j in range(HEAD_DIM // 2)]
LONG_FACTOR = [float(1 + j) for j in range(HEAD_DIM // 2)]
SWA_WINDOW = 8

# family -> base family and the config keyword overrides of make_model.py's
# builder for that base.
VARIANTS = {
    "llama3": ("llama", {
        "max_position_embeddings": 256,
        "rope_parameters": {"rope_type": "llama3", "rope_theta": ROPE_THETA, "factor": 8.0, "low_freq_factor": 1.0,
                            "high_freq_factor": 4.0, "original_max_position_embeddings": ORIGINAL_MAX},
    }),
    "yarn": ("qwen2", {
        "max_position_embeddings": 128,
        "rope_parameters": {"rope_type": "yarn", "rope_theta": ROPE_THETA, "factor": 4.0,
                            "original_max_position_embeddings": ORIGINAL_MAX, "truncate": False},
    }),
    "longrope": ("phi3", {
        "max_position_embeddings": 128,
        "original_max_position_embeddings": ORIGINAL_MAX,
        "rope_parameters": {"rope_type": "longrope", "rope_theta": ROPE_THETA, "partial_rotary_factor": 1.0,
                            "short_factor": SHORT_FACTOR, "long_factor": LONG_FACTOR},
    }),
    "linear": ("llama", {
        "max_position_embeddings": 256,
        "rope_parameters": {"rope_type": "linear", "rope_theta": ROPE_THETA, "factor": 2.0},
    }),
    "dynamic": ("llama", {
        "max_position_embeddings": ORIGINAL_MAX,
        "rope_parameters": {"rope_type": "dynamic", "rope_theta": ROPE_THETA, "factor": 2.0},
    }),
    "swa": ("qwen2", {
        "use_sliding_window": True,
        "sliding_window": SWA_WINDOW,
        "max_window_layers": 1,
    }),
}


def base_of(family):
    """The existing family a long-context family varies (itself otherwise)."""
    return VARIANTS[family][0] if family in VARIANTS else family


def overrides(family):
    """make_model.py builder keyword overrides of `family` ({} for a base family)."""
    if family not in VARIANTS:
        return {}
    over = VARIANTS[family][1]
    # Fresh copies: transformers standardises rope_parameters in place.
    return {k: (dict(v) if isinstance(v, dict) else v) for k, v in over.items()}


def check_written(family, out_dir, model):
    """Reads OUT_DIR/config.json back through transformers (AutoConfig and a
    fresh rotary embedding of the model's own class) and asserts that HF reads
    the scaling or the window as intended; returns a short summary."""
    import torch
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    cfg = AutoConfig.from_pretrained(out_dir)
    rp = cfg.rope_parameters
    want = overrides(family)
    assert cfg.max_position_embeddings == want.get("max_position_embeddings", cfg.max_position_embeddings)
    rot = type(model.model.rotary_emb)(cfg)
    inv, att = rot.inv_freq.to(torch.float64), float(rot.attention_scaling)
    default = 1.0 / (rp["rope_theta"] ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float64) / HEAD_DIM))
    close = lambda a, b: bool(torch.allclose(a, b, rtol=1e-6, atol=0))  # noqa: E731
    if family == "swa":
        assert rp["rope_type"] == "default" and cfg.sliding_window == SWA_WINDOW, (rp, cfg.sliding_window)
        assert list(cfg.layer_types) == ["full_attention", "sliding_attention"], cfg.layer_types
        got = [layer.self_attn.sliding_window for layer in model.model.layers]
        assert got == [None, SWA_WINDOW], got
        return {"layer_types": list(cfg.layer_types), "sliding_window": cfg.sliding_window}
    for k, v in want["rope_parameters"].items():
        assert rp.get(k) == v, f"{family}: rope_parameters[{k!r}] reads {rp.get(k)!r}, expected {v!r}"
    assert rot.rope_type == rp["rope_type"] == family, (rot.rope_type, rp)
    if family == "llama3":
        wavelen = 2 * math.pi / default
        assert wavelen[0] < ORIGINAL_MAX / 4 < wavelen[1] < ORIGINAL_MAX < wavelen[2], wavelen
        assert close(inv[:1], default[:1]) and close(inv[2:], default[2:] / 8.0), inv
        assert default[1] / 8.0 < inv[1] < default[1], inv
        assert att == 1.0
    elif family == "yarn":
        assert att == 0.1 * math.log(4.0) + 1.0, att
        # truncate false is read: the truncated range would give other frequencies.
        cut = copy.deepcopy(cfg)
        cut.rope_parameters["truncate"] = True
        assert not close(ROPE_INIT_FUNCTIONS["yarn"](cut, "cpu")[0].to(torch.float64), inv), "truncate is ignored"
    elif family == "longrope":
        # Phi-3 keeps original_max_position_embeddings top-level; HF's
        # standardize_rope_params copies it into rope_parameters.
        assert cfg.original_max_position_embeddings == ORIGINAL_MAX == rp["original_max_position_embeddings"]
        assert abs(att - math.sqrt(1 + math.log(4.0) / math.log(ORIGINAL_MAX))) < 1e-12, att
        short = torch.tensor(SHORT_FACTOR, dtype=torch.float64)
        assert close(inv, default / short), "the init table is not the short one"
        long_inv = ROPE_INIT_FUNCTIONS["longrope"](cfg, "cpu", seq_len=ORIGINAL_MAX + 1)[0].to(torch.float64)
        assert close(long_inv, default / torch.tensor(LONG_FACTOR, dtype=torch.float64)), "no long table past 32"
    elif family == "linear":
        assert close(inv, default / 2.0) and att == 1.0, inv
    elif family == "dynamic":
        assert close(inv, default) and att == 1.0, "dynamic NTK changes the table below max_position_embeddings"
        grown = ROPE_INIT_FUNCTIONS["dynamic"](cfg, "cpu", seq_len=torch.tensor(ORIGINAL_MAX + 1))[0]
        assert not close(grown.to(torch.float64), default), "dynamic NTK does not grow past 32 positions"
    return {"rope_parameters": rp, "attention_scaling": att}
