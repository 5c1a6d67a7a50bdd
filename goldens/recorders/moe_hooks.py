"""The mixture-of-experts stages of an HF forward: hooks that record them, the routing arithmetic they are
checked against, and the float64 routers of the oracle.

hf_hooks.Recorder.install() calls install() for every layer whose MLP has `experts` (moe_families.py's
models). A MoE layer's stages, key `<step>/blk.N.<stage>` (golden_io.block_stages):

  ffn_moe_logits  [T, n_expert]  the router's output, ffn_norm . W_router^T (+ router bias: gpt-oss)
  ffn_moe_probs   [T, n_expert]  the scores top-k is taken over: softmax(logits) (Mixtral, Qwen2/3-MoE),
                                 the logits themselves (gpt-oss), sigmoid(logits) + e_score_correction_bias
                                 before the group limit (DeepSeek-V3)
  ffn_moe_topk    [T, k]         the chosen expert ids as float32, descending score, equal scores in
                                 ascending id (torch.topk's order where nothing ties)
  ffn_moe_weights [T, k]         each chosen expert's weight, same order (renormalised where the family does;
                                 gpt-oss: softmax over the k chosen logits)
  ffn_moe_out     [T, E]         the routed sum, sum_j weight_j expert_j(x): the experts module's output
  ffn_shexp_out   [T, E]         the shared expert's output after its gate, sigmoid(shared_expert_gate(x)) *
                                 shared_expert(x) (Qwen2-MoE), shared_experts(x) (DeepSeek-V3); absent
                                 without a shared expert
  ffn_out         [T, E]         the MLP block's output, what the layer adds to the residual

The router module returns (logits, weights, ids); the hook recomputes the scores from the logits with the
router's own ops (route(): the same kernels in the same order, so bit for bit in float32) and asserts that
top-k of them gives the router's ids and weights exactly, and (Qwen2-MoE, DeepSeek-V3) that ffn_out is
ffn_moe_out + ffn_shexp_out bit for bit. DeepSeek-V3's router takes an unsorted top-k: the recorded ids and
weights are put in descending selection score (descending()). The experts run as transformers' eager loop
(hf_model.load passes experts_implementation="eager"; asserted in install()).

For the float64 oracle (oracle_f64.to_float64 calls to_float64()), each router's forward is replaced by
the same formulas in float64: transformers' routers compute in float32 whatever the model's dtype
(Mixtral's `router_logits.float()`, Qwen's softmax `dtype=torch.float`, DeepSeek-V3's linear in
`torch.float32`), which the oracle's dispatch guard would count. Selection, weights and experts are then
float64 throughout.

Exact ties (mixtral-tiny's twin router rows, moe_families.TWIN_ROUTER_ROWS): touchstone's rule gives equal
selection scores to the lower expert id. torch.topk on the CPU does not promise it: with k * 64 > n it
takes std::nth_element, which leaves equal scores in no set order (8 experts, top-2, random rows with
experts 0 and 1 equal: the pair, when both chosen, comes out [1, 0], and at the k-th/(k+1)-th boundary
expert 1 is taken a little over half the time). So the oracle's routers take top-k by a stable
descending sort (top_k(): equal scores in ascending id, the same values as torch.topk's where nothing
ties; DeepSeek-V3's unsorted top-k as HF's, it has no ties), HF's are recorded as they chose, and
ffn_moe_topk/ffn_moe_weights put equal scores in ascending id (descending(); the slot order of equal
scores changes nothing in HF's sum, which runs in expert-id order).

Stats (Recorder.moe_stats, record_hf.py's provenance `moe`): per layer the smallest margin between the
k-th and (k+1)-th selection score over every token and step (where it was, and both scores), and over
the prefill how many times each expert was chosen (the experts never chosen are named; check_moe_goldens.py
fails on any), and for DeepSeek-V3 the smallest margin between the topk_group-th and the next group score.
"""
import torch
import torch.nn.functional as F


def kind_of(router):
    """The routing rule of a router module, by class name."""
    name = type(router).__name__
    for prefix, kind in (("Mixtral", "mixtral"), ("Qwen2Moe", "qwen2_moe"), ("Qwen3Moe", "qwen3_moe"),
                         ("GptOss", "gpt_oss"), ("DeepseekV3", "deepseek_v3")):
        if name.startswith(prefix):
            return kind
    raise AssertionError(f"no routing rule for {name}")


def top_k(scores, k, lower_id_ties):
    """(values, ids) of the k largest of each row, descending: torch.topk (HF's op), or with
    `lower_id_ties` a stable descending sort's first k (equal scores in ascending id: the oracle)."""
    if not lower_id_ties:
        return torch.topk(scores, k, dim=-1)
    values, ids = torch.sort(scores, dim=-1, descending=True, stable=True)
    return values[..., :k], ids[..., :k]


def route(router, logits):
    """(scores, ids, weights, selection) from router logits [T, n_expert], in the logits' dtype, with the
    ops of the family's router: softmax over every expert (HF: in float32), torch.topk (sorted,
    descending), and Mixtral's always / Qwen's norm_topk_prob renormalisation of the k chosen; gpt-oss:
    top-k of the logits themselves (its router's bias included), softmax over the k; DeepSeek-V3:
    sigmoid, + e_score_correction_bias (`scores`), the groups outside the topk_group best (by the sum of
    their two best) masked with -inf (`selection`, what top-k is over), top-k unsorted as HF takes it,
    weights the unbiased sigmoid of the chosen, / (sum + 1e-20), x routed_scaling_factor. A router marked
    `lower_id_ties` (the oracle's, to_float64) breaks exact ties to the lower id (top_k())."""
    kind = kind_of(router)
    lower = getattr(router, "lower_id_ties", False)
    if kind == "gpt_oss":
        top, ids = top_k(logits, router.top_k, lower)
        return logits, ids, torch.nn.functional.softmax(top, dim=1, dtype=top.dtype), logits
    if kind == "deepseek_v3":
        sig = logits.sigmoid()
        biased = sig + router.e_score_correction_bias
        G, n = router.num_group, router.num_experts
        groups = biased.view(-1, G, n // G).topk(2, dim=-1)[0].sum(dim=-1)
        group_idx = torch.topk(groups, k=router.topk_group, dim=-1, sorted=False)[1]
        mask = torch.zeros_like(groups).scatter_(1, group_idx, 1)
        mask = mask.unsqueeze(-1).expand(-1, G, n // G).reshape(-1, n)
        sel = biased.masked_fill(~mask.bool(), float("-inf"))
        ids = torch.topk(sel, k=router.top_k, dim=-1, sorted=False)[1]
        w = sig.gather(1, ids)
        if router.norm_topk_prob:
            w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
        return biased, ids, w * router.routed_scaling_factor, sel
    scores = torch.nn.functional.softmax(logits, dim=-1, dtype=logits.dtype)
    top, ids = top_k(scores, router.top_k, lower)
    if kind == "mixtral" or router.norm_topk_prob:
        top = top / top.sum(dim=-1, keepdim=True)
    return scores, ids, top, scores


def descending(sel, ids, weights):
    """ids and weights in descending selection score, equal scores in ascending id: the canonical order of
    ffn_moe_topk, which DeepSeek-V3's unsorted top-k does not give, nor torch.topk for equal scores."""
    order = torch.sort(ids, dim=-1, stable=True).indices
    ids, weights = ids.gather(1, order), weights.gather(1, order)
    order = torch.sort(sel.gather(1, ids), dim=-1, descending=True, stable=True).indices
    return ids.gather(1, order), weights.gather(1, order)


def router_of(mlp):
    """The router module of a MoE block (`gate`; gpt-oss `router`), None for a dense MLP."""
    if not hasattr(mlp, "experts"):
        return None
    return mlp.router if hasattr(mlp, "router") else mlp.gate


def router_forward_f64(self, hidden_states):
    """A router's forward in float64 (the oracle): HF's formulas, no float32 island."""
    hidden_states = hidden_states.reshape(-1, self.hidden_dim)
    assert hidden_states.dtype == torch.float64 and self.weight.dtype == torch.float64
    logits = F.linear(hidden_states, self.weight, getattr(self, "bias", None))
    _, ids, weights, _ = route(self, logits)
    return logits, weights, ids


def to_float64(model):
    """Replaces every MoE router's forward by router_forward_f64, exact ties to the lower id; returns how
    many."""
    import types
    n = 0
    for layer in model.model.layers:
        r = router_of(layer.mlp)
        if r is not None:
            kind_of(r)
            r.forward = types.MethodType(router_forward_f64, r)
            r.lower_id_ties = True
            n += 1
    return n


class Stats:
    """The routing statistics of a recording (see the module docstring)."""

    def __init__(self, n_expert):
        self.n_expert = n_expert
        self.margin = {}  # layer -> {"margin", "step", "row", "kth", "next"}
        self.counts = {}  # layer -> per-expert count over the prefill
        self.group_margin = {}  # DeepSeek-V3: layer -> smallest topk_group-th vs next group score margin

    def add(self, step, li, scores, ids, k):
        with torch.no_grad():
            top = torch.topk(scores, k + 1, dim=-1).values.to(torch.float64) if k < scores.shape[-1] else None
            if top is not None:
                gap = top[:, k - 1] - top[:, k]
                row = int(gap.argmin())
                m = float(gap[row])
                if li not in self.margin or m < self.margin[li]["margin"]:
                    self.margin[li] = {"margin": m, "step": step, "row": row, "kth": float(top[row, k - 1]),
                                       "next": float(top[row, k])}
            if step == "prefill":
                c = torch.bincount(ids.reshape(-1), minlength=self.n_expert)
                self.counts[li] = [int(x) for x in c]

    def add_groups(self, step, li, router, biased):
        """DeepSeek-V3: the margin between the topk_group-th and the next group score."""
        with torch.no_grad():
            G, n, k = router.num_group, router.num_experts, router.topk_group
            groups = biased.view(-1, G, n // G).topk(2, dim=-1)[0].sum(dim=-1)
            top = torch.topk(groups, k + 1, dim=-1).values.to(torch.float64)
            gap = top[:, k - 1] - top[:, k]
            row = int(gap.argmin())
            if li not in self.group_margin or float(gap[row]) < self.group_margin[li]["margin"]:
                self.group_margin[li] = {"margin": float(gap[row]), "step": step, "row": row,
                                         "kth": float(top[row, k - 1]), "next": float(top[row, k])}

    def provenance(self):
        out = {"min_topk_margin": {str(li): self.margin[li] for li in sorted(self.margin)},
               "prefill_expert_counts": {str(li): self.counts[li] for li in sorted(self.counts)}}
        if self.group_margin:  # DeepSeek-V3 only
            out["min_group_margin"] = {str(li): self.group_margin[li] for li in sorted(self.group_margin)}
        return out


def install(rec, mlp, p, li, fwd):
    """Forward hooks recording layer `li`'s MoE stages (prefix `p`, "blk.N.") into Recorder `rec`."""
    assert mlp.experts.config._experts_implementation == "eager", \
        f"layer {li}: experts implementation {mlp.experts.config._experts_implementation!r}, not eager"
    router = router_of(mlp)
    kind_of(router)
    if rec.moe_stats is None:
        rec.moe_stats = Stats(router.num_experts)
    shared = hasattr(mlp, "shared_expert") or hasattr(mlp, "shared_experts")
    held = {}

    def on_router(mod, i, o):
        logits, weights, ids = o
        with torch.no_grad():
            scores, ids2, w2, sel = route(mod, logits)
            finite = bool(torch.isfinite(logits).all())
            if finite:
                assert torch.equal(ids2, ids), f"{rec.step} layer {li}: top-k of the recomputed scores differs"
                assert torch.equal(w2.to(weights.dtype), weights), f"{rec.step} layer {li}: the weights differ"
                rec.moe_stats.add(rec.step, li, sel, ids, mod.top_k)
                if kind_of(mod) == "deepseek_v3":
                    rec.moe_stats.add_groups(rec.step, li, mod, scores)
            ids, weights = descending(sel, ids, weights)
        rec.put(p + "ffn_moe_logits", logits[None])
        rec.put(p + "ffn_moe_probs", scores[None])
        rec.put(p + "ffn_moe_topk", ids[None])  # int64; put's rounding to float32 (exact) under allowed
        rec.put(p + "ffn_moe_weights", weights[None])
    fwd(router, on_router)

    def on_experts(mod, i, o):
        held["moe"] = o
        rec.put(p + "ffn_moe_out", o[None])
    fwd(mlp.experts, on_experts)
    if hasattr(mlp, "shared_expert"):  # Qwen2-MoE: gated
        fwd(mlp.shared_expert, lambda mod, i, o: held.__setitem__("shexp", o))
        fwd(mlp.shared_expert_gate, lambda mod, i, o: held.__setitem__("gate", o))
    elif shared:  # DeepSeek-V3: added as it is
        fwd(mlp.shared_experts, lambda mod, i, o: held.__setitem__("shexp", o))

    def on_mlp(mod, i, o):
        o = o[0] if isinstance(o, tuple) else o
        if shared:
            # Qwen2MoeSparseMoeBlock: F.sigmoid(shared_expert_gate(x)) * shared_expert(x), then added;
            # DeepseekV3MoE: experts(x).view(shape) + shared_experts(x).
            with torch.no_grad():
                sh = F.sigmoid(held["gate"]) * held["shexp"] if "gate" in held else held["shexp"]
                if bool(torch.isfinite(o).all()):
                    assert torch.equal(held["moe"].reshape(o.shape) + sh.reshape(o.shape), o), \
                        f"{rec.step} layer {li}: ffn_out is not ffn_moe_out + ffn_shexp_out"
            rec.put(p + "ffn_shexp_out", sh.reshape(o.shape))
        held.clear()
        rec.put(p + "ffn_out", o)
    fwd(mlp, on_mlp)


def provenance(stats, layout, log):
    """record_hf.py's provenance `moe`: the layout, the experts implementation, the smallest top-k margin per
    layer and the prefill's expert counts (the experts never chosen, `unused_prefill_experts`, are logged)."""
    out = {"layout": layout, "experts_implementation": "eager", **stats.provenance()}
    unused = {str(li): [e for e, c in enumerate(cs) if c == 0] for li, cs in sorted(stats.counts.items())}
    out["unused_prefill_experts"] = {li: u for li, u in unused.items() if u}
    if stats.margin:
        li, m = min(stats.margin.items(), key=lambda kv: kv[1]["margin"])
        log(f"MoE: smallest k-th vs (k+1)-th selection score margin {m['margin']:.3g} (layer {li}, {m['step']} "
            f"row {m['row']}: {m['kth']:.9g} vs {m['next']:.9g}); prefill expert counts {stats.counts}; "
            f"experts never chosen in the prefill: {out['unused_prefill_experts'] or 'none'}")
    return out

