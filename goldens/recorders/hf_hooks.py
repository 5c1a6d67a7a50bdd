"""The hooks that tap every canonical stage of an HF transformers forward.

record_hf.py records the stage goldens with them, record_vlm.py the language
model of a vision-language model, and engine_hf.py taps an engine under test
with them: one definition of what each stage is. Recorder.install()
puts forward hooks on the modules and wraps the modeling module's
apply_rotary_pos_emb and eager_attention_forward for the duration of the
run (remove() undoes all of it); every hook copies its stage of the current
step into `rec` as float32 numpy (the one rounding of a float64 run).

Keys are `<step>/<stage>` with steps `prefill`, `decode1`, ..., `decodeN`
(the vocabulary of src/stage/mod.rs). Row-major, batch dimension dropped;
T = tokens fed in this step, S = KV positions after this step, H heads,
KV kv heads, D head dim, E hidden, F FFN width, V vocab:

  tokens                 [T]       int64, the ids fed in this step
  positions              [T]       int64, their positions
  embed                  [T,E]     embed_tokens output (Gemma 3: times its
                                   sqrt(hidden) scale, the output of
                                   Gemma3TextScaledWordEmbedding)
  blk.{i}.attn_norm      [T,E]     input_layernorm output
  blk.{i}.q              [T,H,D]   q_proj output (bias included), before RoPE
  blk.{i}.k / .v         [T,KV,D]  k_proj / v_proj outputs, before RoPE
  blk.{i}.q_norm         [T,H,D]   Qwen3, Gemma 3: per-head RMSNorm of q, before RoPE
  blk.{i}.k_norm         [T,KV,D]  Qwen3, Gemma 3: per-head RMSNorm of k, before RoPE
  blk.{i}.q_rope         [T,H,D]   q after RoPE
  blk.{i}.k_rope         [T,KV,D]  k after RoPE (this step's positions only)
  blk.{i}.attn_scores    [H,T,S]   the softmax input before the mask:
                                   q_rope . k_rope^T * scaling (1/sqrt(D);
                                   Gemma 3: query_pre_attn_scalar^-0.5),
                                   query head h against KV head h // (H/KV),
                                   for this step's T queries and all S keys;
                                   entries the mask removes (key position >
                                   query position, and on a sliding-window
                                   layer query - key >= sliding_window) are
                                   exactly 0
  blk.{i}.attn_probs     [H,T,S]   softmax output, masked entries are 0
  blk.{i}.attn_ctx       [T,H*D]   attention context, the input of o_proj
  blk.{i}.attn_out       [T,E]     o_proj output
  blk.{i}.attn_post_norm [T,E]     Gemma 3 only: post_attention_layernorm
                                   output (the norm of attn_out)
  blk.{i}.ffn_inp        [T,E]     residual after attention
  blk.{i}.ffn_norm       [T,E]     post_attention_layernorm output (Gemma 3:
                                   pre_feedforward_layernorm output)
  blk.{i}.ffn_gate / .ffn_up [T,F] gate_proj / up_proj outputs
  blk.{i}.ffn_act        [T,F]     silu(gate) * up, the input of down_proj
                                   (Gemma 3: gelu_tanh(gate) * up)
  blk.{i}.ffn_out        [T,E]     down_proj output (a MoE layer: the MLP
                                   block's output, routed + shared expert)
  blk.{i}.ffn_moe_*      a mixture-of-experts layer has ffn_moe_logits,
                         ffn_moe_probs, ffn_moe_topk, ffn_moe_weights,
                         ffn_moe_out (and ffn_shexp_out) in place of
                         ffn_gate/ffn_up/ffn_act: moe_hooks.py
  blk.{i}.ffn_post_norm  [T,E]     Gemma 3 only: post_feedforward_layernorm
                                   output (the norm of ffn_out)
  blk.{i}.out            [T,E]     residual stream after the block
  output_norm            [T,E]     final norm output
  logits                 [T,V]     ([1,V], the last row, with --logits last)
  sample_probs           [1,V]     with --sample-probs only: the sampling
                                   distribution of the last row (see above)

DeepSeek-V3's multi-head latent attention: D is the q/k head (qk_nope +
qk_rope dims), v and attn_ctx have v_head_dim per head, KV = H: q is
q_b_proj's output per head (before RoPE), k the per-head key before RoPE
(k_nope from kv_b_proj, then the shared qk_rope dims of kv_a_proj_with_mqa),
v the per-head value; q_rope / k_rope the attention's query and key (only
the qk_rope dims rotated, as HF's rope_interleave lays them out: the rotated
even features, then the odd ones). The per-head k and v exist only inside
the attention (expanded from the latent cache over all S positions): the
tap takes this step's T rows.

For Phi-3 (fused qkv_proj and gate_up_proj) q, k, v are the split pieces of
qkv_proj's output (the first H*D features, then KV*D, then KV*D, as
Phi3Attention slices them) and ffn_gate / ffn_up the two halves of
gate_up_proj's output (gate first: Phi3MLP's `chunk(2)`).

attn_scores is tapped inside HF's eager attention: the module-level
`eager_attention_forward` of the modeling module is wrapped, and the wrapper
computes `torch.matmul(query, repeat_kv(key).transpose(2, 3)) * scaling` with
the very tensors and ops HF's function uses (attn_weights after the scaling,
before the mask is added), then asserts that softmax(scores + HF's mask)
reproduces HF's attention weights bit for bit and that HF's mask removes
exactly the entries it zeroes (the causal ones, and on a sliding-window
layer those `sliding_window` or more positions back: HF's
sliding_window_overlay keeps kv_idx > q_idx - sliding_window).

Lean capture (Recorder.lean, record_hf.py with a subset): a stage the step
does not store is only checked for finiteness (after the rounding to
float32) and held as an empty STANDIN, or whole when it is not finite (the
overflow watch describes it); attn_probs is taken in the attention tap
layer by layer instead of from output_attentions (which holds every
layer's [H,T,S] at once: 24 x 690 MB for a 2480-token prompt of Qwen2.5
0.5B in float64), and `--logits last` keeps the last row only. A stored
stage is the same array either way.
"""
import importlib

import numpy as np
import torch

import golden_io
import moe_hooks
from golden_io import progress
from oracle_f64 import allowed
from overflow import STANDIN  # what a lean capture holds for a finite stage it does not store


class Recorder:
    """Forward hooks that copy each stage of the current step into `rec`."""

    def __init__(self, model):
        self.model = model
        cfg = model.config
        # The modeling module whose apply_rotary_pos_emb the attention calls:
        # modeling_qwen2 for Qwen2, modeling_llama for Llama, modeling_gemma3
        # for Gemma 3 (whose text model_type, gemma3_text, names no module):
        # the attention class's own module.
        self.modeling = importlib.import_module(type(model.model.layers[0].self_attn).__module__)
        assert self.modeling.__name__.startswith("transformers.models."), self.modeling.__name__
        self.H, self.KV, self.D = config_dims(cfg)[:3]
        # Sliding-window attention (Gemma 3): the window of each layer, None
        # for a full-attention layer.
        self.windows = layer_windows(cfg)
        self.S = None  # KV positions after the step running (set per step)
        self.rec = {}
        self.layer = None  # index of the decoder layer currently running
        self.step = None  # name of the step running (for progress lines)
        self.handles = []
        self.orig_rope = None
        self.orig_eager = None
        self.guard = None  # the F32Guard of a float64 run: put() may round
        # Lean capture (a recording that stores a subset of a long prompt):
        # `lean(stage)` says whether the step stores that stage; the others
        # are only looked at (see put), and the attention probabilities come
        # from the attention tap, one layer at a time, not from every
        # layer's output_attentions at once. `last_row`: stages kept as
        # their last row only (--logits last). None: every stage, whole.
        self.lean = None
        self.last_row = set()
        self.standins = set()  # stages of this step held as STANDIN
        # Qwen3 / Gemma 3 q_norm/k_norm hooks read the stored projections.
        self.qk_norm = hasattr(model.model.layers[0].self_attn, "q_norm")
        self.moe_stats = None  # a MoE model's routing statistics (moe_hooks.Stats)
        self.mla = False  # DeepSeek's multi-head latent attention (install)
        self.k_pe = {}  # MLA: each layer's pre-RoPE shared key dims of the step running
        # Progress lines (one per layer of a model of more than 4 layers).
        self.log = lambda msg: progress("record_hf.py", msg)

    def put(self, name, t):
        """Store `t`, which still has its batch dimension of 1. Index it away
        rather than squeeze(): squeeze would also drop T = 1 in decode steps."""
        assert name not in self.rec, f"stage {name} recorded twice in one step"
        assert t.shape[0] == 1, f"{name}: expected batch 1, got shape {tuple(t.shape)}"
        # Copy so that later in-place ops in the model cannot alias the record.
        # For a float64 run this is the one rounding to float32.
        with allowed(self.guard):
            x = t[0].detach()
            if self.lean is not None and not self.lean(name) and not (
                    self.qk_norm and name.rsplit(".", 1)[-1] in ("q", "k")):
                # Not stored: the overflow watch needs only whether it is
                # finite once rounded to float32 (a non-finite one is kept
                # whole, for the watch to describe), so nothing else is held.
                if all_finite(x, torch.float32):
                    self.rec[name] = STANDIN
                    self.standins.add(name)
                    return
            elif self.lean is not None and name in self.last_row:
                x = x[-1:]
            self.rec[name] = x.to(torch.float32).contiguous().numpy().copy()

    def install(self):
        m = self.model.model
        H, KV, D = self.H, self.KV, self.D
        n_layers = len(m.layers)
        fwd = lambda mod, fn: self.handles.append(mod.register_forward_hook(fn))
        pre = lambda mod, fn: self.handles.append(mod.register_forward_pre_hook(fn))

        fwd(m.embed_tokens, lambda mod, i, o: self.put("embed", o))
        for li, layer in enumerate(m.layers):
            p = f"blk.{li}."

            def enter(mod, i, li=li):
                self.layer = li
                # One line per layer of a real model (24+ layers take seconds
                # each on 2 cores); the tiny models would only add noise.
                if n_layers > 4:
                    self.log(f"{self.step}: layer {li + 1}/{n_layers}")
            pre(layer, enter)
            fwd(layer.input_layernorm, lambda mod, i, o, p=p: self.put(p + "attn_norm", o))
            a = layer.self_attn
            # [1,T,H*D] -> [1,T,H,D]: the canonical per-head layout.
            if hasattr(a, "qkv_proj"):
                # Phi-3: one fused projection; Phi3Attention slices q, k, v
                # out of its output in this order.
                def qkv(mod, i, o, p=p):
                    T = o.shape[1]
                    q, k, v = o.split([H * D, KV * D, KV * D], dim=-1)
                    self.put(p + "q", q.reshape(1, T, H, D))
                    self.put(p + "k", k.reshape(1, T, KV, D))
                    self.put(p + "v", v.reshape(1, T, KV, D))
                fwd(a.qkv_proj, qkv)
            elif hasattr(a, "kv_a_proj_with_mqa"):
                # DeepSeek's multi-head latent attention: q is q_b_proj's output (per head, qk_nope then
                # qk_rope dims, before RoPE); k, v, q_rope and k_rope are taken in the attention tap (the
                # per-head keys and values exist only there, expanded from the latent cache), the
                # pre-RoPE shared key part from kv_a_proj_with_mqa here.
                self.mla = True
                fwd(a.q_b_proj if a.q_b_proj is not None else a.q_proj,
                    lambda mod, i, o, p=p, a=a: self.put(p + "q", o.view(1, o.shape[1], H, a.qk_head_dim)))
                fwd(a.kv_a_proj_with_mqa,
                    lambda mod, i, o, p=p, a=a: self.k_pe.__setitem__(p, o[..., a.kv_lora_rank:]))
            else:
                fwd(a.q_proj, lambda mod, i, o, p=p: self.put(p + "q", o.view(1, o.shape[1], H, D)))
                fwd(a.k_proj, lambda mod, i, o, p=p: self.put(p + "k", o.view(1, o.shape[1], KV, D)))
                fwd(a.v_proj, lambda mod, i, o, p=p: self.put(p + "v", o.view(1, o.shape[1], KV, D)))
            if hasattr(a, "q_norm"):
                # RMSNorm over the head dim. Qwen3 applies it to the [1,T,H,D]
                # view before the transpose (its output is canonical), Gemma 3
                # after it, to [1,H,T,D]: the hook finds which by matching the
                # norm's input with the projection stored just before, bit for
                # bit, and transposes Gemma's output back.
                def qk_norm(which):
                    def hook(mod, i, o, p=p):
                        x, y = i[0], o
                        proj = self.rec[p + which]  # [T,heads,D], already stored
                        # (equal_nan: an overflowed projection is still itself)
                        with allowed(self.guard):
                            as_is = tuple(x.shape[1:]) == proj.shape and np.array_equal(
                                x[0].detach().to(torch.float32).numpy(), proj, equal_nan=True)
                            if not as_is:
                                x, y = x.transpose(1, 2), y.transpose(1, 2)
                                assert tuple(x.shape[1:]) == proj.shape and np.array_equal(
                                    x[0].detach().to(torch.float32).numpy(), proj, equal_nan=True), \
                                    f"{p}{which}_norm: its input is not the {which} projection in either layout"
                        self.put(p + which + "_norm", y)
                    return hook
                fwd(a.q_norm, qk_norm("q"))
                fwd(a.k_norm, qk_norm("k"))
            pre(a.o_proj, lambda mod, i, p=p: self.put(p + "attn_ctx", i[0]))
            fwd(a.o_proj, lambda mod, i, o, p=p: self.put(p + "attn_out", o))
            if hasattr(layer, "pre_feedforward_layernorm"):
                # Gemma 3: post_attention_layernorm normalises the attention
                # output (attn_post_norm), the residual after attention is the
                # input of pre_feedforward_layernorm, whose output feeds the
                # MLP; post_feedforward_layernorm normalises the MLP output.
                fwd(layer.post_attention_layernorm, lambda mod, i, o, p=p: self.put(p + "attn_post_norm", o))
                pre(layer.pre_feedforward_layernorm, lambda mod, i, p=p: self.put(p + "ffn_inp", i[0]))
                fwd(layer.pre_feedforward_layernorm, lambda mod, i, o, p=p: self.put(p + "ffn_norm", o))
                fwd(layer.post_feedforward_layernorm, lambda mod, i, o, p=p: self.put(p + "ffn_post_norm", o))
            else:
                # The residual after attention is not a module output; it is the
                # input of post_attention_layernorm.
                pre(layer.post_attention_layernorm, lambda mod, i, p=p: self.put(p + "ffn_inp", i[0]))
                fwd(layer.post_attention_layernorm, lambda mod, i, o, p=p: self.put(p + "ffn_norm", o))
            mlp = layer.mlp
            if hasattr(mlp, "experts"):
                # A mixture-of-experts layer: router, experts, shared expert (moe_hooks.py).
                moe_hooks.install(self, mlp, p, li, fwd)
            elif hasattr(mlp, "gate_up_proj"):
                # Phi-3: Phi3MLP does `gate, up = gate_up_proj(x).chunk(2)`.
                def gate_up(mod, i, o, p=p):
                    gate, up = o.chunk(2, dim=-1)
                    self.put(p + "ffn_gate", gate)
                    self.put(p + "ffn_up", up)
                fwd(mlp.gate_up_proj, gate_up)
            else:
                fwd(mlp.gate_proj, lambda mod, i, o, p=p: self.put(p + "ffn_gate", o))
                fwd(mlp.up_proj, lambda mod, i, o, p=p: self.put(p + "ffn_up", o))
            if not hasattr(mlp, "experts"):
                # silu(gate)*up is an inline product, observable only as the
                # input of down_proj.
                pre(mlp.down_proj, lambda mod, i, p=p: self.put(p + "ffn_act", i[0]))
                fwd(mlp.down_proj, lambda mod, i, o, p=p: self.put(p + "ffn_out", o))
            # transformers 5 decoder layers return a tensor; 4.x returned a tuple.
            fwd(layer, lambda mod, i, o, p=p: self.put(p + "out", o[0] if isinstance(o, tuple) else o))
        fwd(m.norm, lambda mod, i, o: self.put("output_norm", o))
        fwd(self.model.lm_head, lambda mod, i, o: self.put("logits", o))

        # RoPE is a plain function, not a module, so no hook can see it.
        # Qwen2Attention.forward (LlamaAttention.forward, ...) looks up the
        # module-level name at call time, so wrapping that name captures q/k
        # after rotation.
        self.orig_rope = self.modeling.apply_rotary_pos_emb
        orig = self.orig_rope

        def rope_wrapper(q, k, cos, sin, *args, **kwargs):
            qe, ke = orig(q, k, cos, sin, *args, **kwargs)
            if self.mla:  # (MLA ropes only the qk_rope dims: its q_rope/k_rope come from the tap)
                return qe, ke
            p = f"blk.{self.layer}."
            # HF layout [1,H,T,D] -> canonical [T,H,D] (batch dropped by put).
            self.put(p + "q_rope", qe.transpose(1, 2))
            self.put(p + "k_rope", ke.transpose(1, 2))
            return qe, ke
        self.modeling.apply_rotary_pos_emb = rope_wrapper

        # attn_scores: Qwen2Attention.forward (...) passes the module-level
        # eager_attention_forward as the default of
        # ALL_ATTENTION_FUNCTIONS.get_interface, looked up at call time.
        self.orig_eager = self.modeling.eager_attention_forward
        orig_eager = self.orig_eager
        repeat_kv = self.modeling.repeat_kv

        def eager_wrapper(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
            # By keyword: Gemma 3's eager_attention_forward takes (..., mask,
            # dropout, scaling), Qwen2's and Llama's (..., mask, scaling,
            # dropout); every attention module passes both by keyword.
            out, weights = orig_eager(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                      **kwargs)
            # HF's own first lines: the scaled scores, before the mask.
            key_states = repeat_kv(key, module.num_key_value_groups)
            scores = torch.matmul(query, key_states.transpose(2, 3)) * scaling
            T, S = scores.shape[-2:]
            # Every position so far, the window's past ones too: the cache
            # keeps them all (see main), so column j is position j.
            assert S == self.S, f"layer {self.layer}: {S} keys, expected every position 0..{self.S - 1}"
            # Query row t is at position S - T + t (the cache holds positions
            # 0..S-1); key j is masked when j > that position, and on a
            # sliding-window layer also when it is `window` or more positions
            # back (HF's sliding_window_overlay keeps kv_idx > q_idx - window;
            # llama.cpp's LLAMA_SWA_TYPE_STANDARD masks p1 - p0 >= n_swa).
            window = self.windows[self.layer]
            assert getattr(module, "sliding_window", None) == window == kwargs.get("sliding_window", window), \
                f"layer {self.layer}: sliding window {getattr(module, 'sliding_window', None)}, expected {window}"
            qpos = torch.arange(S - T, S)[:, None]
            masked = torch.arange(S)[None, :] > qpos
            if window is not None:
                masked |= qpos - torch.arange(S)[None, :] >= window
            if attention_mask is not None:
                # HF's mask removes exactly these entries (a large negative
                # value where masked, 0 elsewhere), and softmax(scores + mask)
                # is HF's attention, bit for bit.
                assert attention_mask.shape[-2:] == (T, S), attention_mask.shape
                assert attention_mask.dtype == query.dtype, (attention_mask.dtype, query.dtype)
                assert torch.equal(attention_mask[0, 0] < torch.finfo(query.dtype).min / 2, masked)
                assert not attention_mask[0, 0][~masked].any()
                masked_scores = scores + attention_mask
            else:
                assert not masked.any(), "no attention mask, but the step has future positions"
                masked_scores = scores
            if hasattr(module, "sinks"):
                # gpt-oss: one more logit per head (its sink) joins the softmax,
                # after the row max is subtracted, and is dropped after it.
                sinks = module.sinks.reshape(1, -1, 1, 1).expand(query.shape[0], -1, T, -1)
                comb = torch.cat([masked_scores, sinks], dim=-1)
                comb = comb - comb.max(dim=-1, keepdim=True).values
                again = torch.nn.functional.softmax(comb, dim=-1, dtype=comb.dtype)[..., :-1]
            else:
                again = torch.nn.functional.softmax(masked_scores, dim=-1, dtype=torch.float32)
            # Only on finite data: an overflow (a 16-bit reference's scores past
            # its range) is recorded as data by the recorder (overflow.py), and
            # NaN equals nothing, itself included.
            if all_finite(scores) and all_finite(weights):
                assert torch.equal(again.to(query.dtype), weights), "recomputed attention differs from HF's"
            del again  # (a long prompt's [H,T,S] copies are freed as soon as they are checked)
            if getattr(module, "kv_b_proj", None) is not None:
                # MLA: the tap's query/key/value are the per-head ones (q_rope: q_nope, then the RoPE'd
                # dims; k_rope: k_nope from kv_b_proj, then the shared RoPE'd dims; the last T of S).
                p, nope = f"blk.{self.layer}.", module.qk_nope_head_dim
                kr = key[:, :, -T:].transpose(1, 2)
                pe = self.k_pe.pop(p)[:, :, None, :].expand(-1, -1, kr.shape[2], -1)
                self.put(p + "k", torch.cat([kr[..., :nope], pe], dim=-1))
                self.put(p + "v", value[:, :, -T:].transpose(1, 2))
                self.put(p + "q_rope", query.transpose(1, 2))
                self.put(p + "k_rope", kr)
            self.put(f"blk.{self.layer}.attn_scores", scores.masked_fill_(masked, 0.0))
            if self.lean is not None:
                # Lean capture: this layer's probabilities now (the forward
                # then runs without output_attentions, which would hold every
                # layer's [H,T,S] until it returns).
                del scores
                self.put(f"blk.{self.layer}.attn_probs", weights)
            return out, weights
        self.modeling.eager_attention_forward = eager_wrapper

    def remove(self):
        for h in self.handles:
            h.remove()
        self.handles = []
        if self.orig_rope is not None:
            self.modeling.apply_rotary_pos_emb = self.orig_rope
            self.orig_rope = None
        if self.orig_eager is not None:
            self.modeling.eager_attention_forward = self.orig_eager
            self.orig_eager = None


def all_finite(t, dtype=None, block=1 << 24):
    """Whether every element of `t` (rounded to `dtype` first, if given) is
    finite, a block of elements at a time: torch.isfinite of a whole tensor
    makes an abs() copy and two masks (2.7x a [T,V] logits tensor at once,
    4 GB more for a 2480-token prompt's float64 logits)."""
    flat = t.reshape(-1)
    for a in range(0, flat.numel(), block):
        c = flat[a:a + block]
        if not bool(torch.isfinite(c if dtype is None else c.to(dtype)).all()):
            return False
    return True


def layer_windows(cfg):
    """The sliding window of each layer (None: full attention), from the
    config's layer_types: Gemma 3's sliding_attention layers attend to the
    last `sliding_window` positions (the query's own included)."""
    n = cfg.num_hidden_layers
    types_ = getattr(cfg, "layer_types", None) or ["full_attention"] * n
    assert len(types_) == n and set(types_) <= {"full_attention", "sliding_attention"}, types_
    windows = [cfg.sliding_window if t == "sliding_attention" else None for t in types_]
    assert all(w is None or w >= 1 for w in windows), windows
    return windows


def config_dims(cfg):
    """(H, KV, D, E, F, V, layers) of a transformers config object. Many
    configs (Qwen2.5's among them) have no head_dim: then it is hidden/heads,
    which is what the attention modules compute too."""
    return golden_io.model_dims({k: getattr(cfg, k, None) for k in (
        "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_size",
        "intermediate_size", "vocab_size", "num_hidden_layers", "model_type", "num_experts_per_tok",
        "num_local_experts", "num_experts", "n_routed_experts", "kv_lora_rank", "qk_nope_head_dim",
        "qk_rope_head_dim", "v_head_dim")})


def attention_rows(probs, positions, window=None):
    """Per-row non-uniformity of one layer's softmax output probs [H,T,S]
    (row t sees positions[t]+1 keys, or only the last `window` of them on a
    sliding-window layer). Returns, for every row that sees at least 2 keys
    (a 1-key row is trivially one-hot): its max probability, that max
    divided by the uniform value 1/n_keys, and its entropy divided by
    log(n_keys) (1 = uniform, 0 = one-hot)."""
    out = []
    for t, p in enumerate(positions):
        lo = 0 if window is None else max(0, int(p) + 1 - window)
        n = int(p) + 1 - lo
        if n < 2:
            continue
        rows = probs[:, t, lo:int(p) + 1].astype(np.float64)  # [H,n]; masked keys dropped
        ent = -(rows * np.log(np.clip(rows, 1e-300, 1.0))).sum(-1) / np.log(n)
        for h in range(rows.shape[0]):
            m = rows[h].max()
            out.append((m, m * n, ent[h]))
    return out


def attention_summary(rows):
    a = np.array(rows)
    return {
        "rows": len(a),
        "mean_row_max": round(float(a[:, 0].mean()), 4),
        "row_max_x_uniform_mean": round(float(a[:, 1].mean()), 2),
        "row_max_x_uniform_median": round(float(np.median(a[:, 1])), 2),
        "normalized_entropy_mean": round(float(a[:, 2].mean()), 3),
        "rows_max_above_0.9": int((a[:, 0] > 0.9).sum()),
    }

