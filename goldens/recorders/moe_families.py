"""The tiny mixture-of-experts families (issue 38): their configs, their routers' weights, and the check
that transformers reads the written model as intended.

make_model.py --family mixtral|qwen2_moe|qwen3_moe|gpt_oss|deepseek_v3 builds them with this module: the
config keywords (`CONFIGS`, each faithful in every routing parameter), the model class, the tokenizer
(`TOKENIZER_OF`: the pre-tokenizer and specials of an existing tiny family), randomise_routing() (the router
weights, and gpt-oss's router and expert biases and attention sinks: drawn from their own generator,
ROUTER_SEEDS, at a scale that makes the routing decisive and varied) and check_written(), which
reads config.json back with transformers (every routing parameter asserted), reloads the saved model with
the eager experts implementation and asserts it is the model built, weight for weight, and reads the saved
per-expert tensors' gate/up order.

Mixtral's routers have twin rows (TWIN_ROUTER_ROWS): row 1 of every layer's router is row 0 copied after
the seeded draw, so experts 0 and 1 score exactly alike for every token (their MLPs stay different). Where
the pair straddles the k-th/(k+1)-th boundary (the twins the 2nd best, top-2) only one can be chosen:
touchstone's rule is the lower id, expert 0, so an engine that breaks ties to the higher id is caught. The
seed search (search_router_seeds, routing_quality, topk_gaps) counts the twins as one score.

No small real MoE model is reachable from the package registries (no model hub here), so these random
models are the MoE references. Dims as the other tiny models: hidden 64, heads 4 on 2 KV heads, head_dim
16, vocab 512, 8 routed experts of intermediate 32, top-2 (the families' own fields below).

transformers 5 keeps each layer's experts fused (`mlp.experts.gate_up_proj` [E, 2F, H], gate rows first,
then up; `down_proj` [E, H, F]) but save_pretrained writes the checkpoint layout the family was released
with (its conversion mapping reversed): Mixtral `block_sparse_moe.experts.{e}.w1/w3/w2.weight` (gate, up,
down), Qwen2/3-MoE `mlp.experts.{e}.gate_proj/up_proj/down_proj.weight`. check_written() asserts the
saved per-expert matrices are the fused ones split in that order. gpt-oss's checkpoint is fused as held
(`mlp.experts.gate_up_proj` [E, H, 2F], x @ W, gate the even columns and up the odd ones, its bias
[E, 2F] alike; `down_proj` [E, F, H] and its bias [E, H]), asserted bit for bit.
"""
import math
import os

import torch

# The routers' generator (make_model.py: WEIGHT_SEED 0 drives HF's own init, BIAS_NORM_SEED 1 the biases
# and norms): router matrices (and gpt-oss's biases and sinks) are redrawn from their own, so their scale
# can change without moving any other weight. Top-k does not depend on the routers' scale, only on their
# directions, and the residual stream has a mean over the prompt (|mean| ~ 0.6 of the spread around it) that
# favours some experts: a draw may leave an expert unchosen by the whole prompt. The seed of each family is
# the first from 2 (search_router_seeds(), `python moe_families.py FAMILY`) for which every expert of every
# layer is chosen in the prefill of the 30 prompt ids (regen.sh's LONG_TOKENS) and every token's k-th and
# (k+1)-th selection scores differ by at least 1% of the k-th (MIN_RELATIVE_MARGIN; DeepSeek-V3's group
# scores too, the topk_group-th and the next).
#
# Twin router rows: family -> (a, b), b's row a copy of a's (made after the draw, so every other row is
# the draw's). Every token's scores of a and b are then equal bit for bit: where the pair straddles the
# k-th/(k+1)-th boundary (a "boundary tie") exactly one is chosen, the lower id by touchstone's rule, and an
# engine that breaks the tie to the higher id routes to b's (different) MLP. The search counts the twins as
# one score (topk_gaps): the gaps between it and its neighbours must be decisive (the 1% above). It also
# asks for a boundary tie in every MoE layer's prefill, and that HF's router take the lower twin at every
# boundary tie of the prefill and the 4 greedy decode steps: HF's torch.topk does not promise the lower id
# (on the CPU, with k * 64 > n, std::nth_element: equal scores in no set order; the pair, both chosen,
# comes out [1, 0], and at the boundary it takes expert 1 at a little over half the ties, 8 of 10 with seed 4),
# so only such a seed gives HF goldens that agree with the rule, the oracle (moe_hooks.top_k: a stable
# sort) and llama.cpp (its argsort: std::sort of 0..n-1, an insertion sort for n <= 16, stable). Mixtral's
# seed is 434 (6, the seed before the twins, leaves expert 4 unused in layer 1 and has no tie in layer 0).
TWIN_ROUTER_ROWS = {"mixtral": (0, 1)}
ROUTER_SEEDS = {"mixtral": 434, "qwen2_moe": 4, "qwen3_moe": 3, "gpt_oss": 2, "deepseek_v3": 2}
MIN_RELATIVE_MARGIN = 0.01
# Std of the router matrices. ffn_norm's output has |x| ~ sqrt(64) = 8, so a router row of std s gives
# logits of std ~ 8 s: 0.4 makes them ~3, a decisive softmax whose top-2 varies from token to token
# (record_hf.py asserts every expert is chosen over each prefill and reports the smallest top-k margin).
ROUTER_STD = 0.4
# DeepSeek-V3 scores with a sigmoid, which logits of std 3 would saturate (scores near 1 differ by little):
# std 0.15 gives logits of std ~1.2, scores spread over about 0.2 .. 0.8; its e_score_correction_bias
# (zero in HF's init) is drawn N(0, 0.1^2), enough to change choices.
ROUTER_STD_OF = {"deepseek_v3": 0.15}
CORRECTION_BIAS_STD = 0.1
COMMON = dict(vocab_size=512, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              hidden_act="silu", rms_norm_eps=1e-6, bos_token_id=None, attention_dropout=0.0,
              output_router_logits=False, max_position_embeddings=1024, dtype="float32")
N_EXPERTS, TOP_K, EXPERT_FFN = 8, 2, 32
DROP = "(not passed)"  # a COMMON keyword a family leaves to its config class (DeepSeek-V3's head_dim)

# family -> (HF config class name, model class name, keyword arguments besides COMMON, eos, pad, range).
CONFIGS = {
    # Mixtral: softmax over all 8 experts, top-2, the two renormalised (always, no flag); no shared
    # expert; the experts' width is `intermediate_size`.
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(
        intermediate_size=EXPERT_FFN, num_hidden_layers=2, num_local_experts=N_EXPERTS,
        num_experts_per_tok=TOP_K, router_jitter_noise=0.0, router_aux_loss_coef=0.001,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, sliding_window=None,
        tie_word_embeddings=False, rms_norm_eps=1e-5)),
    # Qwen2-MoE (Qwen1.5-MoE): softmax over all, top-2 NOT renormalised (norm_topk_prob false), plus a
    # shared expert (width 64) scaled by sigmoid(shared_expert_gate(x)); every layer sparse; QKV biases.
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(
        intermediate_size=128, moe_intermediate_size=EXPERT_FFN, shared_expert_intermediate_size=64,
        num_hidden_layers=2, num_experts=N_EXPERTS, num_experts_per_tok=TOP_K, norm_topk_prob=False,
        decoder_sparse_step=1, mlp_only_layers=[], qkv_bias=True, use_sliding_window=False,
        sliding_window=None, max_window_layers=2, router_aux_loss_coef=0.001,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, tie_word_embeddings=False)),
    # Qwen3-MoE: softmax over all, top-2 renormalised (norm_topk_prob true), no shared expert, Qwen3's
    # per-head q/k RMSNorm, no biases; every layer sparse.
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        intermediate_size=128, moe_intermediate_size=EXPERT_FFN, num_hidden_layers=2,
        num_experts=N_EXPERTS, num_experts_per_tok=TOP_K, norm_topk_prob=True, decoder_sparse_step=1,
        mlp_only_layers=[], attention_bias=False, use_sliding_window=False, sliding_window=None,
        router_aux_loss_coef=0.001, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        tie_word_embeddings=False)),
    # gpt-oss: router with a bias, top-2 of the logits themselves, then softmax over the 2; experts with
    # biases, gate_up interleaved (gate = even columns), SwiGLU clamped (alpha 1.702, limit 7); attention
    # with biases and per-head sinks; layers alternate sliding (window 8) and full; YaRN as gpt-oss has it
    # (factor 32, beta 32/1, truncate false) over 32 original positions (1024 = 32 x 32), on theta 5e5 so
    # that the correction range [0, 0.99] rounds to llama.cpp's [0, 1] without changing the ramp (pair 0
    # extrapolated, pairs 1-7 interpolated in both; gpt-oss's 150000 would give HF [0, 1.09], llama.cpp [0, 2]).
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", dict(
        intermediate_size=EXPERT_FFN, num_hidden_layers=2, num_local_experts=N_EXPERTS,
        num_experts_per_tok=TOP_K, swiglu_alpha=1.702, swiglu_limit=7.0, attention_bias=True,
        sliding_window=8, layer_types=["sliding_attention", "full_attention"], router_aux_loss_coef=0.001,
        rope_parameters={"rope_type": "yarn", "rope_theta": 500000.0, "factor": 32.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 32},
        tie_word_embeddings=False, rms_norm_eps=1e-5)),
    # DeepSeek-V3: MLA attention (q_lora_rank 32, kv_lora_rank 32, per-head q/k of 16 + 8 RoPE dims, v of
    # 16; rope_interleave as DeepSeek), layer 0 a dense MLP (first_k_dense_replace 1, intermediate 64),
    # layers 1-2 MoE: sigmoid scores, + e_score_correction_bias to choose, only the topk_group 2 of
    # n_group 4 groups (of 2 experts) with the largest sum of their two best biased scores, top-3 of
    # those; weights the unbiased scores of the chosen, renormalised (norm_topk_prob) and times
    # routed_scaling_factor 2.5; one shared expert (intermediate 32, no gate). scoring_func and
    # topk_method are DeepSeek-V3's own config.json keys (transformers ignores them; llama.cpp's converter
    # reads scoring_func for its gating function, softmax without it).
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(
        num_key_value_heads=4, head_dim=DROP, intermediate_size=64, moe_intermediate_size=EXPERT_FFN,
        num_hidden_layers=3, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
        v_head_dim=16, n_routed_experts=N_EXPERTS, n_shared_experts=1, num_experts_per_tok=3, n_group=4,
        topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True, first_k_dense_replace=1,
        rope_interleave=True, attention_bias=False, scoring_func="sigmoid", topk_method="noaux_tc",
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, tie_word_embeddings=False)),
}
# The pre-tokenizer and specials of an existing tiny family (make_model.py's FAMILIES): Mixtral's GGUF
# architecture is llama (Llama 3's regex, "llama-bpe"), the Qwen MoEs take Qwen2's.
TOKENIZER_OF = {"mixtral": "llama", "qwen2_moe": "qwen2", "qwen3_moe": "qwen2", "gpt_oss": "qwen2",
                "deepseek_v3": "qwen2"}
TIED = {f: c[2]["tie_word_embeddings"] for f, c in CONFIGS.items()}
# The routing parameters check_written() asserts, per family, as config.json reads back.
ROUTING_KEYS = {
    "mixtral": ["num_local_experts", "num_experts_per_tok", "router_jitter_noise", "intermediate_size",
                "sliding_window"],
    "qwen2_moe": ["num_experts", "num_experts_per_tok", "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers",
                  "moe_intermediate_size", "shared_expert_intermediate_size", "qkv_bias", "use_sliding_window"],
    "qwen3_moe": ["num_experts", "num_experts_per_tok", "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers",
                  "moe_intermediate_size", "attention_bias", "use_sliding_window", "sliding_window"],
    "gpt_oss": ["num_local_experts", "num_experts_per_tok", "intermediate_size", "swiglu_alpha", "swiglu_limit",
                "attention_bias", "sliding_window", "layer_types", "rope_parameters"],
    "deepseek_v3": ["n_routed_experts", "n_shared_experts", "num_experts_per_tok", "n_group", "topk_group",
                    "routed_scaling_factor", "norm_topk_prob", "first_k_dense_replace", "moe_intermediate_size",
                    "intermediate_size", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                    "v_head_dim", "rope_interleave", "scoring_func", "topk_method", "num_key_value_heads"],
}
# Stds of gpt-oss's other routing and attention parameters (HF initialises the expert biases at zero and
# the router bias and sinks N(0, initializer_range^2)): redrawn from the routers' generator.
GPT_OSS_STD = {"router_bias": 0.5, "expert_bias": 0.1, "sinks": 1.0}


def builder(family):
    """make_model.py's BUILDERS entry: (build(eos_id, initializer_range, over), model class)."""
    import transformers
    cfg_name, model_name, kw, = CONFIGS[family]

    def build(eos_id, initializer_range, over=None):
        args = {k: v for k, v in dict(COMMON, **kw).items() if v is not DROP}
        args.update(over or {})
        args.update(eos_token_id=eos_id, pad_token_id=eos_id, initializer_range=initializer_range)
        return getattr(transformers, cfg_name)(**args)
    return build, getattr(transformers, model_name)


def routers(model):
    """(layer index, router module) of every MoE layer, in order."""
    out = []
    for li, layer in enumerate(model.model.layers):
        mlp = layer.mlp
        r = getattr(mlp, "gate", None) if not hasattr(mlp, "router") else mlp.router
        if r is not None and hasattr(mlp, "experts"):
            out.append((li, r))
    return out


def randomise_routing(model, family, seed=None):
    """Redraws every router matrix N(0, ROUTER_STD^2) from the family's ROUTER_SEEDS generator (`seed`:
    another, for the search) (HF initialises them N(0, initializer_range^2), some classes at zero)."""
    g = torch.Generator().manual_seed(ROUTER_SEEDS[family] if seed is None else seed)
    rs = routers(model)
    assert rs, f"{family}: no MoE layer"
    with torch.no_grad():
        for li, r in rs:
            r.weight.copy_(torch.randn(r.weight.shape, generator=g) * ROUTER_STD_OF.get(family, ROUTER_STD))
            if family == "deepseek_v3":
                b = r.e_score_correction_bias
                b.copy_(torch.randn(b.shape, generator=g) * CORRECTION_BIAS_STD)
            if family == "gpt_oss":
                layer = model.model.layers[li]
                r.bias.copy_(torch.randn(r.bias.shape, generator=g) * GPT_OSS_STD["router_bias"])
                for p in (layer.mlp.experts.gate_up_proj_bias, layer.mlp.experts.down_proj_bias):
                    p.copy_(torch.randn(p.shape, generator=g) * GPT_OSS_STD["expert_bias"])
                a = layer.self_attn.sinks
                a.copy_(torch.randn(a.shape, generator=g) * GPT_OSS_STD["sinks"])
            if family in TWIN_ROUTER_ROWS:  # after the draw: the other rows stay the draw's
                a, b = TWIN_ROUTER_ROWS[family]
                r.weight[b] = r.weight[a]
    return len(rs)


def _want(family):
    """config.json's expected value of each routing key (the builder's keywords)."""
    kw = dict(COMMON, **CONFIGS[family][2])
    return {k: kw[k] for k in ROUTING_KEYS[family]}


def check_written(family, out_dir, model):
    """Reads OUT_DIR/config.json back with transformers and asserts every routing parameter; reloads the
    saved model (experts implementation eager) and asserts each tensor is the built model's; asserts the
    saved per-expert matrices split the fused gate_up_proj gate first. Returns a short summary."""
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM
    cfg = AutoConfig.from_pretrained(out_dir)
    assert cfg.model_type == family, (cfg.model_type, family)
    for k, v in _want(family).items():
        got = getattr(cfg, k)
        assert got == v and type(got) is type(v), f"{family}: config.json's {k} reads {got!r}, expected {v!r}"
    n_layers = cfg.num_hidden_layers
    again = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32, experts_implementation="eager")
    assert again.config._experts_implementation == "eager"
    mine, theirs = model.state_dict(), again.state_dict()
    assert sorted(mine) == sorted(theirs), sorted(set(mine) ^ set(theirs))
    for k in mine:
        assert torch.equal(mine[k], theirs[k]), f"{family}: {k} differs after save and reload"
    if family == "deepseek_v3":  # MLA: RoPE on the qk_rope_head_dim trailing dims of each q/k head
        assert cfg.head_dim == cfg.qk_rope_head_dim == 8 and cfg.qk_head_dim == 24, (cfg.head_dim, cfg.qk_head_dim)
        assert again.model.rotary_emb.inv_freq.shape == (4,), again.model.rotary_emb.inv_freq.shape
    sparse = [li for li, _ in routers(again)]
    dense = CONFIGS[family][2].get("first_k_dense_replace", 0)
    assert sparse == list(range(dense, n_layers)), f"{family}: MoE layers {sparse}"
    if family == "gpt_oss":
        # The YaRN table: pair 0 extrapolated (the plain frequency), pairs 1-7 interpolated (/ 32), in HF
        # (correction range [0, 0.99]) as in llama.cpp (its floor/ceil [0, 1]); attention factor 0.1 ln 32 + 1.
        rot = type(again.model.rotary_emb)(cfg)
        rp = cfg.rope_parameters
        plain = 1.0 / rp["rope_theta"] ** (torch.arange(0, 16, 2, dtype=torch.float64) / 16)
        want = torch.cat([plain[:1], plain[1:] / rp["factor"]])
        assert torch.allclose(rot.inv_freq.to(torch.float64), want, rtol=1e-6, atol=0), rot.inv_freq
        assert abs(rot.attention_scaling - (0.1 * math.log(32.0) + 1.0)) < 1e-12, rot.attention_scaling
        return {"routing": _want(family), "experts_implementation": "eager", "router_std": ROUTER_STD,
                "router_seed": ROUTER_SEEDS[family], "other_stds": GPT_OSS_STD,
                "saved_layout": _check_fused(out_dir, model, n_layers)}
    # The saved layout: per expert, gate (w1 / gate_proj) = gate_up_proj[e, :F], up (w3 / up_proj) =
    # gate_up_proj[e, F:], down (w2 / down_proj) = down_proj[e].
    names = {"mixtral": ("block_sparse_moe.experts.{e}.w1", "block_sparse_moe.experts.{e}.w3",
                         "block_sparse_moe.experts.{e}.w2")}.get(
        family, ("mlp.experts.{e}.gate_proj", "mlp.experts.{e}.up_proj", "mlp.experts.{e}.down_proj"))
    saved = {}
    with safe_open(os.path.join(out_dir, "model.safetensors"), "pt") as f:
        keys = list(f.keys())
        for li in sparse:
            ex = model.model.layers[li].mlp.experts
            F = ex.gate_up_proj.shape[1] // 2
            for e in range(ex.gate_up_proj.shape[0]):
                gate, up, down = (f.get_tensor(f"model.layers.{li}.{n.format(e=e)}.weight") for n in names)
                assert torch.equal(gate, ex.gate_up_proj[e, :F]) and torch.equal(up, ex.gate_up_proj[e, F:]), \
                    f"{family}: layer {li} expert {e}: the saved gate/up are not gate_up_proj's halves in order"
                assert torch.equal(down, ex.down_proj[e]), f"{family}: layer {li} expert {e}: down"
        saved = {k: list(f.get_slice(k).get_shape()) for k in keys}
        if family in TWIN_ROUTER_ROWS:  # the twins: equal router rows bit for bit, different experts
            a, b = TWIN_ROUTER_ROWS[family]
            for li in sparse:
                w = f.get_tensor(f"model.layers.{li}.block_sparse_moe.gate.weight")
                assert torch.equal(w[a], w[b]), f"{family}: layer {li}: router rows {a} and {b} differ"
                assert all(not torch.equal(w[a], w[e]) for e in range(w.shape[0]) if e not in (a, b)), li
                for n in names:
                    ea, eb = (f.get_tensor(f"model.layers.{li}.{n.format(e=e)}.weight") for e in (a, b))
                    assert not torch.equal(ea, eb), f"{family}: layer {li}: experts {a} and {b} share {n}"
    r0 = routers(model)[0][1]
    return {"routing": _want(family), "experts_implementation": "eager",
            "router_std": ROUTER_STD_OF.get(family, ROUTER_STD), "router_seed": ROUTER_SEEDS[family],
            "router_weight_std": round(float(r0.weight.detach().std()), 4),
            "saved_tensors": len(saved), "saved_layout": [n + ".weight" for n in names],
            **({"twin_router_rows": list(TWIN_ROUTER_ROWS[family])} if family in TWIN_ROUTER_ROWS else {})}


def _check_fused(out_dir, model, n_layers):
    """gpt-oss's checkpoint keeps the experts fused as transformers holds them: gate_up_proj [E, H, 2F]
    (x @ W; gate = the even columns, up = the odd ones), gate_up_proj_bias [E, 2F] (same interleave),
    down_proj [E, F, H], down_proj_bias [E, H]; asserted bit for bit."""
    from safetensors import safe_open
    with safe_open(os.path.join(out_dir, "model.safetensors"), "pt") as f:
        for li in range(n_layers):
            ex = model.model.layers[li].mlp.experts
            for n in ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias"):
                assert torch.equal(f.get_tensor(f"model.layers.{li}.mlp.experts.{n}"), getattr(ex, n)), (li, n)
    return ["mlp.experts.gate_up_proj [E, H, 2F] interleaved (gate even, up odd)", "mlp.experts.gate_up_proj_bias",
            "mlp.experts.down_proj [E, F, H]", "mlp.experts.down_proj_bias"]


def topk_gaps(sel, k, twins=None):
    """The k-th vs (k+1)-th gap of each row of selection scores `sel` [T, n] (numpy float64), the twins
    (a, b) counted as one score that fills two slots: where they straddle the boundary (a "boundary tie",
    the k-th and (k+1)-th scores the twins' equal ones) the gaps between the twins and the scores either side
    of them count instead. Returns per row (the score above, the score below, relative gap (above - below) /
    |above|, boundary tie); the smallest relative gap is the row's. The twins' scores must be equal."""
    import numpy as np
    a, b = twins if twins else (None, None)
    out = []
    for row in np.asarray(sel, dtype=np.float64):
        if twins:
            assert row[a] == row[b], f"twin scores differ: {row[a]!r} vs {row[b]!r}"
        units = sorted(((float(v), 2 if e == a else 1) for e, v in enumerate(row) if e != b), key=lambda u: -u[0])
        cum, j = 0, 0
        for j, (_, c) in enumerate(units):
            cum += c
            if cum >= k:
                break
        tie = cum > k  # the twins fill the k-th and (k+1)-th slots
        pairs = [(j - 1, j), (j, j + 1)] if tie else [(j, j + 1)]
        gaps = [(units[h][0], units[l][0], (units[h][0] - units[l][0]) / abs(units[h][0]))
                for h, l in pairs if h >= 0 and l < len(units)]
        out.append(min(gaps, key=lambda g: g[2]) + (tie,))
    return out


def routing_quality(model, family, tokens, decode_steps=4):
    """The routing of `model` on a prefill of `tokens`: (experts never chosen per layer, smallest relative
    top-k margin (twins counted as one: topk_gaps), boundary ties {(step, layer): rows}, the boundary ties
    where HF's router took the higher twin). With twins, also `decode_steps` greedy steps (KV cache, one
    token each, as record_hf.py runs them) for their ties; the margin and the experts used are the prefill's."""
    import moe_hooks
    got, r_logits, step = {}, {}, ["prefill"]

    def hook(m, i, o, li):
        r_logits[step[0], li] = o[0].detach()
        got[step[0], li] = (moe_hooks.route(m, r_logits[step[0], li]), o[2].detach())
    hs = [r.register_forward_hook(lambda m, i, o, li=li: hook(m, i, o, li)) for li, r in routers(model)]
    twins = TWIN_ROUTER_ROWS.get(family)
    try:
        with torch.no_grad():
            if not twins:
                model(input_ids=torch.tensor([tokens]))
            else:
                x, past, pos = list(tokens), None, 0
                for si in range(decode_steps + 1):
                    step[0] = "prefill" if si == 0 else f"decode{si}"
                    res = model(input_ids=torch.tensor([x]), position_ids=torch.arange(pos, pos + len(x))[None],
                                past_key_values=past, use_cache=True)
                    past, pos, x = res.past_key_values, pos + len(x), [int(res.logits[0, -1].argmax())]
    finally:
        for h in hs:
            h.remove()
    unused, worst, ties, higher = {}, float("inf"), {}, []
    for (st, li), ((_, ids, _, scores), hf_ids) in got.items():
        k = ids.shape[-1]
        gaps = topk_gaps(scores.numpy(), k, twins)
        ties[st, li] = [t for t, g in enumerate(gaps) if g[3]]
        higher += [(st, li, t) for t in ties[st, li] if twins[1] in hf_ids[t].tolist()]
        if st != "prefill":
            continue
        worst = min(worst, min(g[2] for g in gaps))
        if family == "deepseek_v3":  # and the group choice: topk_group-th vs next group score
            r, n = dict(routers(model))[li], scores.shape[-1]
            biased = moe_hooks.route(r, r_logits[st, li])[0].to(torch.float64)
            g = torch.topk(biased.view(-1, r.num_group, n // r.num_group).topk(2, dim=-1)[0].sum(-1),
                           r.topk_group + 1, dim=-1).values
            worst = min(worst, float(((g[:, -2] - g[:, -1]) / g[:, -2].abs()).min()))
        unused[li] = sorted(set(range(scores.shape[-1])) - set(ids.reshape(-1).tolist()))
    return unused, worst, {key: v for key, v in ties.items() if v}, higher


def search_router_seeds(family, first=2, tries=1000):
    """The first router seed from `first` meeting the rule above (see ROUTER_SEEDS): builds the model with
    make_model.py once (in a temporary folder), then redraws its routers per seed (randomise_routing, the
    only part the seed draws). Prints each seed's result; returns the seed."""
    import sys
    import tempfile
    sys.dont_write_bytecode = True
    import make_model
    import moe_families  # (this module as make_model.py imports it, also when run as a script)
    from transformers import AutoModelForCausalLM
    tokens = [(7 * i + 3) % 500 + 1 for i in range(30)]
    moe_families.ROUTER_SEEDS[family] = first
    with tempfile.TemporaryDirectory() as d:
        argv, sys.argv = sys.argv, ["make_model.py", d, "--family", family]
        try:
            make_model.main()
        finally:
            sys.argv = argv
        model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, experts_implementation="eager",
                                                     attn_implementation="eager").eval()
    for seed in range(first, first + tries):
        moe_families.randomise_routing(model, family, seed)
        unused, worst, ties, higher = moe_families.routing_quality(model, family, tokens)
        ok = not any(unused.values()) and worst >= MIN_RELATIVE_MARGIN
        if family in TWIN_ROUTER_ROWS:  # a boundary tie in every MoE layer's prefill; HF took the lower twin
            ok = ok and all(ties.get(("prefill", li)) for li, _ in routers(model)) and not higher
        print(f"{family}: router seed {seed}: unused experts {unused}, smallest relative margin {worst:.4g}"
              + (f", boundary ties {ties}, HF took the higher twin at {higher}" if family in TWIN_ROUTER_ROWS
                 else "") + f"{' <- chosen' if ok else ''}", file=sys.stderr)
        if ok:
            return seed
    raise SystemExit(f"{family}: no router seed in {first} .. {first + tries - 1}")


if __name__ == "__main__":
    import sys
    for fam in sys.argv[1:] or sorted(CONFIGS):
        print(fam, search_router_seeds(fam))
