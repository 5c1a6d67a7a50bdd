"""llama.cpp's graph, stage by stage: which node of the pinned llama.cpp's
graph is which canonical stage, and how its data becomes the canonical
layout (canonical()).

record_llamacpp.py and record_llamacpp_vlm.py record the llama.cpp goldens
with it, and engine_llamacpp.py taps an engine under test with it: one
definition of what each stage is in llama.cpp. The graph's nodes come from
llamacpp_lib.NodeRecorder (every node's name, op, shape, op_params and, for
F32 nodes, a copy of its data). docs/recorders.md ("llama.cpp's graph,
node-name map") describes the map for each architecture.
"""
import re

import numpy as np

import golden_io

# ---- the node-name map (llama.cpp as vendored by llama-cpp-python 0.3.36) --
# canonical stage -> (node name, op, selector). `{L}` is the layer. A name
# occurs several times in one graph (Qcur-L: MUL_MAT, [ADD bias,] RESHAPE,
# ROPE); the op picks the one meant. Selectors:
#   "last"       the last node with this name and op (a name/op pair is
#                unique except where noted)
#   "after"      the first node with this op after the last node called
#                `name`, whose own name must be one of AFTER_NAMES[stage]:
#                o_proj's output is unnamed in the Qwen2 graph (the MUL_MAT
#                right after kqv_out-L; Llama names it attn_out-L), and the
#                Phi-3 graph leaves the residual after attention unnamed.
#   "split:P/N"  piece P of N of the node's last dimension, in the sizes of
#                SPLITS[stage kind]: Phi-3's fused projections. q, k, v are
#                the first H*D, next KV*D and last KV*D features of wqkv-L
#                (build_qkv's views); gate and up are the first and second
#                F features of ffn_up-L (ggml_swiglu: silu(first half) *
#                second half, as HF's Phi3MLP `gate, up = x.chunk(2)`).
# Layout transforms (by stage): numpy shape is ggml `ne` reversed, reshaped to
# the canonical shape; attn_probs is sliced from the padded KV length to the
# real S (the sliced-off columns must be exactly 0); q/k/q_rope/k_rope are
# un-permuted for architectures in QK_PERMUTED.
# attn_scores: llama.cpp never materialises the scaled scores. The graph
# computes kq-L = k·q (MUL_MAT, unscaled) and hands it to
# ggml_soft_max_ext(kq, mask, kq_scale, max_bias), which scales, adds the
# mask and normalises in one op. So the recorder takes kq-L, slices it from
# the padded KV length to S like attn_probs, multiplies it in float32 by the
# kq_scale that SOFT_MAX node carries (op_params[0], as the op does: x*scale
# in float32, then + mask), and sets the entries the causal mask removes
# (key position > query position) to exactly 0. Phi-3's graph scales Q by
# 1/sqrt(D) (a SCALE node) before kq and passes kq_scale 1; either way the
# product of the two scales is asserted to be 1/sqrt(D) (max_bias 0: no
# ALiBi).
NODE_MAP = {
    "embed": ("embd", "GET_ROWS", "last"),
    "blk.{L}.attn_norm": ("attn_norm-{L}", "MUL", "last"),
    "blk.{L}.q": ("Qcur-{L}", "RESHAPE", "last"),    # [T,H,D], after the bias add if any
    "blk.{L}.k": ("Kcur-{L}", "RESHAPE", "last"),
    "blk.{L}.v": ("Vcur-{L}", "RESHAPE", "last"),
    "blk.{L}.q_rope": ("Qcur-{L}", "ROPE", "last"),
    "blk.{L}.k_rope": ("Kcur-{L}", "ROPE", "last"),
    "blk.{L}.attn_scores": ("kq-{L}", "MUL_MAT", "last"),           # [H,T,n_kv padded], unscaled
    "blk.{L}.attn_probs": ("kq_soft_max-{L}", "SOFT_MAX", "last"),  # [H,T,n_kv padded]
    "blk.{L}.attn_ctx": ("kqv_out-{L}", "CONT", "last"),            # [T,H*D]
    "blk.{L}.attn_out": ("kqv_out-{L}", "MUL_MAT", "after"),
    "blk.{L}.ffn_inp": ("ffn_inp-{L}", "ADD", "last"),
    "blk.{L}.ffn_norm": ("ffn_norm-{L}", "MUL", "last"),
    "blk.{L}.ffn_gate": ("ffn_gate-{L}", "MUL_MAT", "last"),
    "blk.{L}.ffn_up": ("ffn_up-{L}", "MUL_MAT", "last"),
    "blk.{L}.ffn_act": ("ffn_swiglu-{L}", "SWIGLU", "last"),       # silu(gate)*up, one op
    "blk.{L}.ffn_out": ("ffn_out-{L}", "MUL_MAT", "last"),
    "blk.{L}.out": ("l_out-{L}", "ADD", "last"),
    "output_norm": ("result_norm", "MUL", "last"),
    "logits": ("result_output", "MUL_MAT", "last"),
}
# Per-architecture differences from NODE_MAP.
ARCH_NODE_MAP = {
    # Qwen3: build_norm(Qcur, attn_q_norm) = RMS_NORM then MUL by the weight,
    # named after the MUL; the RESHAPE named Qcur-L is still the projection.
    "qwen3": {
        "blk.{L}.q_norm": ("Qcur_normed-{L}", "MUL", "last"),
        "blk.{L}.k_norm": ("Kcur_normed-{L}", "MUL", "last"),
    },
    # Gemma 3 (llama.cpp's models/gemma3.cpp): the embeddings times sqrt(n_embd) are
    # `inp_scaled` (a SCALE of embd); per-head q/k norms as Qwen3; the norm
    # of the attention output is attn_post_norm-L (MUL), the residual after
    # attention sa_out-L, the gated GELU one GEGLU op (ffn_geglu-L: the tanh
    # GELU of the gate times up) and the norm of the FFN output
    # ffn_post_norm-L (MUL), before l_out-L adds the residual. Q is scaled by
    # f_attention_scale after RoPE, in an unnamed SCALE node (see
    # kq_scale_of), and the softmax gets kq_scale 1.
    "gemma3": {
        "embed": ("inp_scaled", "SCALE", "last"),
        "blk.{L}.q_norm": ("Qcur_normed-{L}", "MUL", "last"),
        "blk.{L}.k_norm": ("Kcur_normed-{L}", "MUL", "last"),
        "blk.{L}.attn_post_norm": ("attn_post_norm-{L}", "MUL", "last"),
        "blk.{L}.ffn_inp": ("sa_out-{L}", "ADD", "last"),
        "blk.{L}.ffn_act": ("ffn_geglu-{L}", "GEGLU", "last"),
        "blk.{L}.ffn_post_norm": ("ffn_post_norm-{L}", "MUL", "last"),
    },
    # Phi-3: fused projections (Qcur/Kcur/Vcur before RoPE are only views of
    # wqkv-L, which the recorder does not copy), an unnamed residual add.
    "phi3": {
        "blk.{L}.q": ("wqkv-{L}", "MUL_MAT", "split:0/3"),
        "blk.{L}.k": ("wqkv-{L}", "MUL_MAT", "split:1/3"),
        "blk.{L}.v": ("wqkv-{L}", "MUL_MAT", "split:2/3"),
        "blk.{L}.ffn_inp": ("kqv_out-{L}", "ADD", "after"),
        "blk.{L}.ffn_gate": ("ffn_up-{L}", "MUL_MAT", "split:0/2"),
        "blk.{L}.ffn_up": ("ffn_up-{L}", "MUL_MAT", "split:1/2"),
    },
}
# Mixture-of-experts layers (issue 38): llm_graph_context::build_moe_ffn (vendor/llama.cpp/src/llama-graph.cpp of the
# pinned llama.cpp) names the router's MUL_MAT ffn_moe_logits-L, the softmax gating's SOFT_MAX
# ffn_moe_probs-L, the ARGSORT of the selection scores (descending) ffn_moe_argsort-L, whose VIEW of the
# first k columns is ffn_moe_topk-L (an I32 view the callback does not copy: the recorder reads the
# ARGSORT, selector "topk", and keeps its first k columns), the chosen probabilities (GET_ROWS)
# ffn_moe_weights-L, renormalised (norm_w: DIV by the clamped sum) ffn_moe_weights_norm-L, and the ADD of
# the k weighted experts ffn_moe_out-L. The llama graph (Mixtral, models/llama.cpp) and qwen3moe
# (models/qwen3moe.cpp) add ffn_moe_out-L to the residual, so it is ffn_out as well (their ADD named
# ffn_out-L is the residual sum); qwen2moe (models/qwen2moe.cpp) gates the shared expert
# (ffn_shexp_out-L, a MUL by ffn_shexp_gate-L = silu(g) / g, its sigmoid) and adds it: ffn_out-L (ADD).
MOE_NODE_MAP = {
    "blk.{L}.ffn_moe_logits": ("ffn_moe_logits-{L}", "MUL_MAT", "last"),
    "blk.{L}.ffn_moe_probs": ("ffn_moe_probs-{L}", "SOFT_MAX", "last"),
    "blk.{L}.ffn_moe_topk": ("ffn_moe_argsort-{L}", "ARGSORT", "topk"),
    "blk.{L}.ffn_moe_weights": ("ffn_moe_weights_norm-{L}", "DIV", "last"),
    "blk.{L}.ffn_moe_out": ("ffn_moe_out-{L}", "ADD", "last"),
    "blk.{L}.ffn_out": ("ffn_moe_out-{L}", "ADD", "last"),
}
ARCH_MOE_NODE_MAP = {
    # DeepSeek-V3 (sigmoid gating, exp_probs_b): the selection scores are sigmoid + bias
    # (ffn_moe_probs_biased-L, ADD; ffn_moe_probs-L is the unbiased SIGMOID), the group limit masks them
    # (ffn_moe_probs_masked-L) before the ARGSORT; the weights are the unbiased probabilities of the
    # chosen, renormalised, then times expert_weights_scale (ffn_moe_weights_scaled-L, SCALE); the shared
    # expert is build_ffn's output ffn_shexp-L (MUL_MAT), added to the routed sum in ffn_out-L (ADD).
    "deepseek2": {
        "blk.{L}.ffn_moe_probs": ("ffn_moe_probs_biased-{L}", "ADD", "last"),
        "blk.{L}.ffn_moe_weights": ("ffn_moe_weights_scaled-{L}", "SCALE", "last"),
        "blk.{L}.ffn_shexp_out": ("ffn_shexp-{L}", "MUL_MAT", "last"),
        "blk.{L}.ffn_out": ("ffn_out-{L}", "ADD", "last"),
    },
    # gpt-oss (gating SOFTMAX_WEIGHT): the router's bias is added (ffn_moe_logits_biased-L), and the
    # "probs" are that very tensor, so cb renames it ffn_moe_probs-L: the ADD is both stages; the weights
    # are the softmax over the k chosen, named on its reshape (ffn_moe_weights_softmax-L, RESHAPE).
    "gpt-oss": {
        "blk.{L}.ffn_moe_logits": ("ffn_moe_probs-{L}", "ADD", "last"),
        "blk.{L}.ffn_moe_probs": ("ffn_moe_probs-{L}", "ADD", "last"),
        "blk.{L}.ffn_moe_weights": ("ffn_moe_weights_softmax-{L}", "RESHAPE", "last"),
    },
    # norm_topk_prob false: the chosen probabilities as they are (no DIV, no SCALE: w_scale 0).
    "qwen2moe": {
        "blk.{L}.ffn_moe_weights": ("ffn_moe_weights-{L}", "GET_ROWS", "last"),
        "blk.{L}.ffn_shexp_out": ("ffn_shexp_out-{L}", "MUL", "last"),
        "blk.{L}.ffn_out": ("ffn_out-{L}", "ADD", "last"),
    },
}
# Qwen3-MoE's attention is Qwen3's (per-head q/k norms).
ARCH_NODE_MAP["qwen3moe"] = ARCH_NODE_MAP["qwen3"]
# gpt-oss (models/openai-moe.cpp): o_proj's bias is added and the sum named attn_out-L (ADD); the
# norm before the MoE is attn_post_norm-L (HF's post_attention_layernorm).
ARCH_NODE_MAP["gpt-oss"] = {
    "blk.{L}.attn_out": ("attn_out-{L}", "ADD", "last"),
    "blk.{L}.ffn_norm": ("attn_post_norm-{L}", "MUL", "last"),
}
# DeepSeek-V3 (models/deepseek2.cpp, multi-head latent attention with the absorption optimisation, as
# every GGUF of the pinned converter has it: attn_k_b / attn_v_b, key_length_mla): q-L (RESHAPE) is
# q_b_proj's output per head; only its RoPE dims are rotated, q_pe-L (ROPE), in llama.cpp's interleaved
# pair layout (rope type NORM on DeepSeek's interleaved weights); HF's rope_interleave returns them
# de-interleaved (the rotated even features, then the odd ones), so q_rope (selector "mla_q_rope") is q's
# qk_nope dims then q_pe-L's features 0, 2, 4, ..., 1, 3, 5, .... kq-L multiplies the latent cache by the
# absorbed q: HF's scores, computed by another rule.
ARCH_NODE_MAP["deepseek2"] = {
    "blk.{L}.q": ("q-{L}", "RESHAPE", "last"),
    "blk.{L}.q_rope": ("q_pe-{L}", "ROPE", "mla_q_rope"),
}
# Stages an architecture's graph never computes: left out of its llama.cpp golden (record_llamacpp.py,
# provenance `absent_stages`, with these reasons).
ABSENT_STAGES = {
    "deepseek2": {
        "k": "MLA with absorption: the per-head keys are never formed; kq-L multiplies the latent cache "
             "(kv_cmpr, k_pe) by q_nope absorbed through attn_k_b (q_nope_absorbed-L)",
        "v": "MLA with absorption: the values stay latent (Vcur = kv_cmpr); attn_v_b is applied after the "
             "attention (kqv_mla-L)",
        "k_rope": "MLA with absorption: only the shared RoPE'd k_pe-L exists, never k_nope per head",
    },
}
# The names an "after" node may carry: ggml calls an unnamed node
# "node_<index>" (Qwen2's o_proj output), Llama's graph names it attn_out-L.
AFTER_NAMES = {
    "attn_out": (r"node_\d+", r"attn_out-{L}"),
    "ffn_inp": (r"node_\d+", r"ffn_inp-{L}"),
}
# general.architecture values whose converter permutes Q/K weight rows
# (LlamaModel.permute in vendor/llama.cpp/conversion/llama.py) and whose
# graph uses the interleaved-pair ("NORM") RoPE on them.
QK_PERMUTED = {"llama"}
ROPE_TYPE = {"llama": 0, "qwen2": 2, "qwen3": 2, "phi3": 2, "gemma3": 2,  # LLAMA_ROPE_TYPE_NORM, _NEOX
             "qwen2moe": 2, "qwen3moe": 2, "gpt-oss": 2, "deepseek2": 0}
# HF model_type -> GGUF general.architecture, where they differ (Mixtral converts to llama).
HF_MODEL_TYPE_ARCH = {"gemma3_text": "gemma3", "mixtral": "llama", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe",
                      "gpt_oss": "gpt-oss", "deepseek_v3": "deepseek2"}
# Architectures whose graph scales Q after RoPE in an unnamed SCALE node
# (gemma3.cpp: Qcur = ggml_scale(Qcur, f_attention_scale) after cb(Qcur,
# "Qcur")) and passes kq_scale 1 to the softmax.
Q_SCALE_AFTER_ROPE = {"gemma3"}


def node_map(arch, layout=None):
    """stage template -> (node, op, selector) for one architecture, in the
    canonical execution order. `layout`: a MoE model's golden_io.moe_layout;
    a stage whose node differs between its dense and MoE layers (ffn_out)
    is then listed per layer (a concrete stage, no {L})."""
    m = dict(NODE_MAP, **ARCH_NODE_MAP.get(arch, {}))
    moe = dict(MOE_NODE_MAP, **ARCH_MOE_NODE_MAP.get(arch, {})) if layout is not None else {}
    absent = ABSENT_STAGES.get(arch, {})
    order = ["embed"] + [f"blk.{{L}}.{s}" for s in golden_io.block_stage_union(arch, layout) if s not in absent] + \
        ["output_norm", "logits"]
    missing = [s for s in order if s not in m and s not in moe]
    assert not missing, f"no node for {missing} in the {arch} map"
    out = []
    for s in order:
        if s in moe and s in m:
            for L, kind in enumerate(layout):
                name, op, sel = moe[s] if kind != "dense" else m[s]
                out.append((s.format(L=L), name.format(L=L), op, sel))
        else:
            out.append((s, *(moe.get(s) or m[s])))
    return out


class LeanNodes:
    """A lean capture's choice of nodes (llamacpp_lib.NodeRecorder's
    `keep`): the nodes of the stages in `want`, by the map's name and op,
    and for an "after" selector the first node of its op after each node of
    its name (a node pick() may choose, at most a few more). One per step:
    wants() follows the graph's order."""

    def __init__(self, arch, n_layer, want, table=None, layout=None):
        self.pairs, self.after, self.armed = set(), {}, set()
        for stage, name, op, sel in (node_map(arch, layout) if table is None else table):
            for L in (range(n_layer) if "{L}" in stage else [None]):
                if stage.format(L=L) in want:
                    if sel == "after":
                        self.after[name.format(L=L)] = op
                    else:
                        self.pairs.add((name.format(L=L), op))
                    if sel == "mla_q_rope":  # q_rope is assembled from q as well
                        self.pairs.add((f"q-{L}", "RESHAPE"))

    def wants(self, name, op):
        hit = (name, op) in self.pairs or op in self.armed
        self.armed.discard(op)
        if name in self.after:
            self.armed.add(self.after[name])
        return hit


def computable(step_nodes, arch, n_layer, stages, layout=None):
    """The stages of `stages` whose node holds data (a lean capture: the
    stored ones, and any whose node was not finite)."""
    out = set()
    for stage, name, op, sel in node_map(arch, layout):
        for L in (range(n_layer) if "{L}" in stage else [None]):
            st = stage.format(L=L)
            if st in stages and pick(step_nodes, name.format(L=L), op, sel, st, L)["data"] is not None:
                out.add(st)
    return out


def pick(nodes, name, op, sel, stage, layer):
    if sel in ("last", "topk", "mla_q_rope") or sel.startswith("split:"):
        hits = [n for n in nodes if n["name"] == name and n["op"] == op]
        assert hits, f"no node {name} with op {op}"
        return hits[-1]
    assert sel == "after", sel
    named = [i for i, n in enumerate(nodes) if n["name"] == name]
    assert named, f"no node {name}"
    allowed = [a.format(L=layer) for a in AFTER_NAMES[stage.split(".")[-1]]]
    for n in nodes[named[-1] + 1:]:
        if n["op"] == op:
            assert any(re.fullmatch(a, n["name"]) for a in allowed), \
                f"node after {name} is {n['name']!r}, expected one of {allowed}"
            return n
    raise AssertionError(f"no {op} after {name}")


def split_piece(a, sel, stage, dims):
    """Piece P/N of a fused projection's output [T, sum(sizes)] (see NODE_MAP)."""
    H, KV, D, E, F, V, _ = dims
    p, n = (int(x) for x in sel[len("split:"):].split("/"))
    sizes = [H * D, KV * D, KV * D] if n == 3 else [F, F]
    a = a.reshape(-1, a.shape[-1])
    assert a.shape[-1] == sum(sizes), f"{stage}: fused node has {a.shape[-1]} features, expected {sizes}"
    lo = sum(sizes[:p])
    return a[:, lo:lo + sizes[p]]


def unpermute_qk(x):
    """Undo LlamaModel.permute on the head dim: llama.cpp's feature 2i+h of
    each head is HF's feature h*D/2+i. [T,H,D] -> [T,H,D]."""
    T, H, D = x.shape
    return np.ascontiguousarray(x.reshape(T, H, D // 2, 2).swapaxes(-1, -2).reshape(T, H, D))


def op_param_f32(node, i):
    """float op_params[i] of a node (ggml stores float parameters bitwise)."""
    return float(np.frombuffer(node["op_params"], dtype=np.float32)[i])


def kq_scale_of(step_nodes, layer, attn):
    """The scale the SOFT_MAX node kq_soft_max-L applies to kq-L; asserts it,
    times any SCALE of Q (Phi-3's named Qcur-L, Gemma 3's unnamed one right
    after the RoPE of Q), is the model's attention scale (attn["scale"]:
    1/sqrt(D), or query_pre_attn_scalar^-0.5 for Gemma 3), and that
    max_bias is 0."""
    sm = pick(step_nodes, f"kq_soft_max-{layer}", "SOFT_MAX", "last", "attn_probs", layer)
    scale, max_bias = op_param_f32(sm, 0), op_param_f32(sm, 1)
    assert max_bias == 0.0, f"layer {layer}: soft_max max_bias {max_bias} (ALiBi is not supported)"
    q_scales = [op_param_f32(n, 0) for n in step_nodes if n["name"] == f"Qcur-{layer}" and n["op"] == "SCALE"]
    if attn["arch"] in Q_SCALE_AFTER_ROPE:
        i = max(j for j, n in enumerate(step_nodes) if n["name"] == f"Qcur-{layer}" and n["op"] == "ROPE")
        sc = step_nodes[i + 1]
        assert sc["op"] == "SCALE" and re.fullmatch(r"node_\d+", sc["name"]), \
            f"layer {layer}: the node after Qcur-{layer} ROPE is {sc['name']} {sc['op']}, not the scale of Q"
        # ... and it is what kq multiplies (through a view and a permute).
        assert any(n["name"] == f"{sc['name']} (view) (permuted)" for n in step_nodes), \
            f"layer {layer}: {sc['name']} does not feed kq-{layer}"
        q_scales.append(op_param_f32(sc, 0))
        assert scale == 1.0, f"layer {layer}: Q is scaled, yet the softmax scales by {scale}"
    total = scale * float(np.prod(q_scales)) if q_scales else scale
    assert abs(total / attn["scale"] - 1.0) < 1e-6, f"layer {layer}: attention scale {total}, not {attn['scale']}"
    return np.float32(scale)


def attention_layout(hf_cfg, arch, dims):
    """What the attention of each layer must be, from the HF config: the
    total scale (query_pre_attn_scalar^-0.5 where the config has one, Gemma
    3; else 1/sqrt(D)), the sliding window of each layer (None: full
    attention; Gemma 3's layer_types) and the RoPE base of each layer (where
    rope_parameters are kept per layer type), else None."""
    n_layer = hf_cfg["num_hidden_layers"]
    qpas = hf_cfg.get("query_pre_attn_scalar")
    scale = float(qpas) ** -0.5 if qpas is not None else 1.0 / np.sqrt(dims[2])
    types_ = hf_cfg.get("layer_types") or ["full_attention"] * n_layer
    assert len(types_) == n_layer and set(types_) <= {"full_attention", "sliding_attention"}, types_
    windows = [hf_cfg["sliding_window"] if t == "sliding_attention" else None for t in types_]
    rp = hf_cfg.get("rope_parameters") or {}
    bases = [float(rp[t]["rope_theta"]) for t in types_] if all(t in rp for t in types_) else None
    return {"arch": arch, "scale": scale, "windows": windows, "rope_bases": bases}


def masked_entries(positions, S, window):
    """[T,S] True where the key is masked for the query: in the future, or,
    on a sliding-window layer, `window` or more positions back (llama.cpp's
    LLAMA_SWA_TYPE_STANDARD: p1 - p0 >= n_swa; HF: kv_idx > q_idx - window
    is kept)."""
    q = np.asarray(positions)[:, None]
    k = np.arange(S)[None, :]
    m = k > q
    if window is not None:
        m |= q - k >= window
    return m


def check_rope_bases(step_nodes, step, attn):
    """Each layer's RoPE of Q and K uses its layer type's base (ggml_rope_ext
    op_params[5], freq_base): Gemma 3's sliding layers 10000, full ones 1e6."""
    if attn["rope_bases"] is None:
        return
    for L, base in enumerate(attn["rope_bases"]):
        for name in (f"Qcur-{L}", f"Kcur-{L}"):
            node = pick(step_nodes, name, "ROPE", "last", "q_rope", L)
            got = op_param_f32(node, 5)
            assert got == np.float32(base), f"{step}: layer {L} {name} RoPE base {got}, HF's layer type has {base}"
            assert op_param_f32(node, 6) == 1.0, f"{step}: layer {L} {name}: freq_scale {op_param_f32(node, 6)}"


def canonical(step_nodes, step, arch, n_layer, T, S, permuted, dims, keep, positions, attn, table=None,
              checked=None, finite=True, layout=None):
    """The stages in `keep` of one step, canonical layout (see NODE_MAP), in
    execution order. `attn`: attention_layout(); `table`: node_map(arch)'s
    list, or another (engine_llamacpp.py's, with flash attention's
    attn_ctx). The checks of the attention's masked entries run on the
    stages in `checked` (default: `keep`), and only where the data is
    finite; `finite` asserts every stage is (the recorders pass False: they
    watch for an overflow themselves, overflow.py)."""
    out = {}
    checked = keep if checked is None else checked
    for stage, name, op, sel in (node_map(arch, layout) if table is None else table):
        for L in (range(n_layer) if "{L}" in stage else [None]):
            st = stage.format(L=L)
            if st not in keep:
                continue
            node = pick(step_nodes, name.format(L=L), op, sel, st, L)
            a = node["data"]
            assert a is not None, f"{step}/{st}: node {node['name']} {op} has no F32 data"
            want = golden_io.expected_shape(st, T, S, dims)
            if sel.startswith("split:"):
                a = split_piece(a, sel, st, dims)
            if sel == "topk":
                # The ARGSORT's ids, descending score: its first k are the choice (ffn_moe_topk-L's view).
                a = a.reshape(-1, dims.n_expert)[:, :dims.top_k].astype(np.float32)
            if sel == "mla_q_rope":
                # q's qk_nope dims, then q_pe's RoPE'd dims de-interleaved (see ARCH_NODE_MAP's deepseek2).
                q = pick(step_nodes, f"q-{L}", "RESHAPE", "last", st, L)["data"]
                assert q is not None, f"{step}/{st}: no data for q-{L}"
                q = q.reshape(T, dims[0], dims[2])
                pe = a.reshape(T, dims[0], -1)
                a = np.concatenate([q[..., :dims[2] - pe.shape[-1]], pe[..., 0::2], pe[..., 1::2]], axis=-1)
            if st.endswith("attn_probs"):
                a = a.reshape(a.shape[-3:])
                assert a.shape[:2] == want[:2] and a.shape[2] >= S, f"{step}/{st}: {a.shape} vs {want}"
                check = st in checked and bool(np.isfinite(a).all())
                tail = a[..., S:]
                assert not check or tail.size == 0 or not tail.any(), \
                    f"{step}/{st}: masked KV cells are not exactly 0"
                a = a[..., :S]
                window = attn["windows"][L]
                if check and any(w is not None for w in attn["windows"]):
                    # Sliding-window model: column j must be position j (a
                    # linear cell layout: swa_full, a fresh cache) and the
                    # layer's window must be HF's. Every masked entry (future,
                    # or outside this layer's window) is exactly 0 ...
                    masked = masked_entries(positions, S, window)
                    assert not a[:, masked].any(), f"{step}/{st}: masked entries (window {window}) are not exactly 0"
                    # ... every entry the mask keeps is > 0 in some head (so
                    # llama.cpp's window is not narrower) ...
                    assert a.any(axis=0)[~masked].all(), f"{step}/{st}: a key inside the window has probability 0"
                    # ... and a full-attention layer attends beyond the window
                    # some sliding layer would have.
                    w = max(x for x in attn["windows"] if x is not None)
                    beyond = ~masked & masked_entries(positions, S, w)
                    if window is None and beyond.any():
                        assert a[:, beyond].any(), f"{step}/{st}: a full-attention layer is windowed"
            if st.endswith("attn_scores"):
                a = a.reshape(a.shape[-3:])
                assert a.shape[:2] == want[:2] and a.shape[2] >= S, f"{step}/{st}: {a.shape} vs {want}"
                # float32 product, as ggml_compute_forward_soft_max_f32 scales.
                a = a[..., :S].astype(np.float32) * kq_scale_of(step_nodes, L, attn)
                masked = masked_entries(positions, S, attn["windows"][L])  # [T,S]
                a = np.where(masked[None], np.float32(0.0), a).astype(np.float32)
            assert a.size == int(np.prod(want)), f"{step}/{st}: {a.shape} cannot be {want}"
            a = np.ascontiguousarray(a.reshape(want), dtype=np.float32)
            if permuted and st.split(".")[-1] in ("q", "k", "q_rope", "k_rope", "q_norm", "k_norm"):
                a = unpermute_qk(a)
            assert not finite or np.isfinite(a).all(), f"{step}/{st} is not finite"
            out[st] = a
    return out

