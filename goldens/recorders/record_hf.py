#!/usr/bin/env python3
"""Record golden tensors for every canonical stage with HF transformers.

usage: record_hf.py MODEL OUT_FILE [--prompt TEXT [--chat] | --prompt-tokens ID,...] [--decode-steps N]
                    [--steps STEP,...] [--stages PATTERN,...] [--logits all|last]
                    [--stages-at STEP=PATTERN,...] [--rows ROW,...]
                    [--dtype float32|float64|bfloat16|float16]
                    [--tokens-from GOLDEN] [--sample-probs TEMPERATURE,TOP_K,TOP_P]

MODEL is an HF folder (config.json, tokenizer files and either one
`model.safetensors` or a sharded `model.safetensors.index.json` with its
shards) or a `.gguf` file, which transformers' own GGUF loader dequantises to
float32 (tokenizer and config from the GGUF too). Runs it (PyTorch, CPU,
float32, eager attention, one thread, deterministic algorithms, no TF32) on
the prompt as one prefill pass followed by N greedy decode steps that reuse
the KV cache, and writes the canonical stages of the steps into ONE
safetensors file, OUT_FILE.

--chat renders the prompt with the tokenizer's chat template as one user
message with add_generation_prompt=True. --prompt-tokens ID,... feeds those
token ids exactly as given, untokenised (provenance `prompt.given: tokens`). --steps, --stages and --logits last
store a subset (a real model's full goldens are gigabytes): every step still
runs, `tokens` and `positions` are stored for every step (teacher forcing
needs them), and the provenance says what was stored (`record`).
--stages-at STEP=PATTERN[,PATTERN] (repeatable) stores those stages at that
one step as well (provenance `record.stages_at: {STEP: [PATTERN, ...]}`):
e.g. the [H,T,S] attn_scores of a long prompt's decode step, whose prefill
scores would not fit in a committed file. --rows 0,-1 keeps those token
rows of every stored stage (provenance `record.rows: {STEP: [ROW, ...]}`):
every stage of several layers of a real model then fits a committed file.

--dtype float64 records an f64 ORACLE: every operation of the forward runs
in float64 on the float32 weights widened exactly (a GGUF's dequantised ones
included). The model is not converted as a whole: the embedding, final
norm and LM head are widened once (block by block, their float32 freed),
and each decoder layer holds float64 copies of its weights only while it
runs, activations and the KV cache being float64 throughout (oracle_f64.py:
the peak is within 2x the float32 model, printed as the `memory:` line).
Three places of HF's code compute in float32 whatever the model's dtype, and
are replaced for this run by the same formulas in float64: the
RoPE cos/sin tables (`position_ids.float() * inv_freq` in float32; here
inv_freq = 1/theta^(2i/d) and the angles in float64, rope_type `default`
only), RMSNorm (casts its input to float32; here the same ops in float64, for
q_norm/k_norm too) and the eager attention softmax (`dtype=torch.float32`;
here float64). The attention mask is built in the embeddings' dtype (min
float64 for masked entries), which the softmax turns into exact 0. A dispatch-level
guard asserts that no operation of any forward produced a tensor of another
floating dtype. Gemma 3 has its own versions of two of them, replaced the
same way: Gemma3RMSNorm (x * rsqrt(mean(x^2) + eps) * (1 + w), in float64;
1 + w is exact there) and Gemma3RotaryEmbedding, whose forward takes a
layer_type and has one table per layer type (inv_freq from that type's
rope_theta in float64: 1e6 full_attention, 1e4 sliding_attention for
gemma3-tiny; both asserted against HF's float32 tables). Each stored tensor is the float64 value rounded ONCE to
float32 (round to nearest: a relative error of at most u/2 = 2^-25, far below
the float32 arithmetic error the oracle measures). Provenance: as a float32
recording but `"dtype": "float64"` (`source` stays `hf`). The default,
float32, is the HF golden.

--dtype bfloat16 / float16 records a 16-bit reference, as a GPU user runs
the model: the same float32 weights (a GGUF's dequantised ones) cast to the
dtype after loading, and HF's own code as it is, float32 islands included
(RMSNorm and the attention softmax compute in float32 and cast back, the
RoPE tables are float32 cast to the dtype). Provenance `"dtype"` says which:
touchstone judges a 16-bit engine against the references of its dtype.

--tokens-from GOLDEN feeds exactly that golden's token ids (its
`prefill/tokens`, then `decodeN/tokens` one by one) instead of this run's own
greedy picks: a 16-bit reference whose greedy pick differs from the f32
golden's at a near-tie is still fed the same tokens (teacher forcing), so
every reference and the oracle see identical inputs. The prompt and the
decode steps are the golden's (--prompt, --chat and --decode-steps must be
left out); `greedy_ids` still records this run's own picks, and provenance
`tokens_from` the golden's sha256.

--sample-probs TEMPERATURE,TOP_K,TOP_P (e.g. 0.7,40,0.9; TOP_K 0 and TOP_P
1.0 switch that filter off) adds the stage `sample_probs` [1,V] at every
step: the last row of the logits through HF's own logits processors, in the
order and under the conditions of GenerationMixin._get_logits_processor of
the pinned transformers (TemperatureLogitsWarper if the temperature is not
1.0, then TopKLogitsWarper if TOP_K is not 0, then TopPLogitsWarper if
TOP_P < 1.0; min_tokens_to_keep 1; the list is built by that very method and
its classes asserted), then softmax in the logits' dtype (float32; float64
with --dtype float64). Tokens the filters remove are exactly 0. Provenance:
`sampling: {temperature, top_k, top_p}` and `sampling_processors` (the class
names in order). The tokens fed stay the greedy ones.

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
  blk.{i}.ffn_out        [T,E]     down_proj output
  blk.{i}.ffn_post_norm  [T,E]     Gemma 3 only: post_feedforward_layernorm
                                   output (the norm of ffn_out)
  blk.{i}.out            [T,E]     residual stream after the block
  output_norm            [T,E]     final norm output
  logits                 [T,V]     ([1,V], the last row, with --logits last)
  sample_probs           [1,V]     with --sample-probs only: the sampling
                                   distribution of the last row (see above)

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

Sliding-window models (Gemma 3; a layer slides when config.layer_types says
sliding_attention): the canonical [H,T,S] has S = every position so far,
but HF's default cache for such a config (DynamicCache(config=...)) keeps
only the last sliding_window - 1 positions of a sliding layer, so its
decode-step attentions would be narrower. The recorder passes a plain
DynamicCache() instead (every layer keeps every position: asserted after
each step, and the attention tap asserts S keys); HF's mask still applies
the window (asserted as above). The same steps are then run again through
HF's own trimmed cache (its trimming asserted) and every step's last logits
row must agree with the recording (provenance
`sliding_cache_vs_full_cache_max_abs_diff`, asserted < 1e-3; about 2e-6 in
float32), as must the usual one-pass recompute (`cache_vs_full`).

If the LM head's rows are equal in pairs (row 2j+1 == row 2j bit for bit:
phi3-tiny, see make_model.py), every logit pair must tie bit for bit and
every greedy id (argmax: the lowest index of a tie) must be even; asserted.

`__metadata__` holds `format` = touchstone-golden/1 and `provenance`, a
compact sorted-key JSON string (see build_provenance). The output contains
nothing that varies between runs or machines (no time, host or path), so a
rerun with the pinned packages is byte-for-byte identical.
"""
import argparse
import contextlib
import importlib
import json
import os
import platform
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np
import safetensors
import tokenizers
import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache, GenerationConfig

# Import the sibling script without leaving a __pycache__ in the repository.
sys.dont_write_bytecode = True
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_model import SEEDS  # noqa: E402  (the seeds live with the model builder)
import golden_io  # noqa: E402  (shared with record_llamacpp.py)
from golden_io import FORMAT, progress, save_deterministic, sha256_file  # noqa: E402
# The float64 oracle, streamed layer by layer (record_next_token.py uses it too).
import oracle_f64  # noqa: E402
from oracle_f64 import F32Guard, allowed, to_float64  # noqa: E402,F401
# Loading within the model's size: GGUF dequantised in blocks, aligned copies.
from hf_loading import fresh_weights, lean_gguf_loading  # noqa: E402

RECORDER = "goldens/recorders/record_hf.py"
DEFAULT_PROMPT = "Golden tensors check every stage."


def log(msg):
    progress("record_hf.py", msg)


def make_deterministic():
    # One thread: a different thread count may change the reduction order
    # inside matmuls and therefore the last bits of every tensor.
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    # TF32 only matters on a GPU, but pin it off so a CUDA rerun cannot
    # silently record 10-bit-mantissa matmuls.
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")


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

    def put(self, name, t):
        """Store `t`, which still has its batch dimension of 1. Index it away
        rather than squeeze(): squeeze would also drop T = 1 in decode steps."""
        assert name not in self.rec, f"stage {name} recorded twice in one step"
        assert t.shape[0] == 1, f"{name}: expected batch 1, got shape {tuple(t.shape)}"
        # Copy so that later in-place ops in the model cannot alias the record.
        # For a float64 run this is the one rounding to float32.
        with allowed(self.guard):
            self.rec[name] = t[0].detach().to(torch.float32).contiguous().numpy().copy()

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
                    log(f"{self.step}: layer {li + 1}/{n_layers}")
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
                        with allowed(self.guard):
                            as_is = tuple(x.shape[1:]) == proj.shape and np.array_equal(
                                x[0].detach().to(torch.float32).numpy(), proj)
                            if not as_is:
                                x, y = x.transpose(1, 2), y.transpose(1, 2)
                                assert tuple(x.shape[1:]) == proj.shape and np.array_equal(
                                    x[0].detach().to(torch.float32).numpy(), proj), \
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
            if hasattr(mlp, "gate_up_proj"):
                # Phi-3: Phi3MLP does `gate, up = gate_up_proj(x).chunk(2)`.
                def gate_up(mod, i, o, p=p):
                    gate, up = o.chunk(2, dim=-1)
                    self.put(p + "ffn_gate", gate)
                    self.put(p + "ffn_up", up)
                fwd(mlp.gate_up_proj, gate_up)
            else:
                fwd(mlp.gate_proj, lambda mod, i, o, p=p: self.put(p + "ffn_gate", o))
                fwd(mlp.up_proj, lambda mod, i, o, p=p: self.put(p + "ffn_up", o))
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
                again = torch.nn.functional.softmax(scores + attention_mask, dim=-1, dtype=torch.float32)
            else:
                assert not masked.any(), "no attention mask, but the step has future positions"
                again = torch.nn.functional.softmax(scores, dim=-1, dtype=torch.float32)
            assert torch.equal(again.to(query.dtype), weights), "recomputed attention differs from HF's"
            self.put(f"blk.{self.layer}.attn_scores", scores.masked_fill(masked, 0.0))
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
        "intermediate_size", "vocab_size", "num_hidden_layers")})


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


def build_provenance(args, prompt, cfg_dict, greedy_ids, steps, cache_vs_full, source, record, sampling):
    prov = {
        "source": "hf",
        "recorder": RECORDER,
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "tokenizers": tokenizers.__version__,
            "safetensors": safetensors.__version__,
            "numpy": np.__version__,
        },
        "prompt": prompt,
        "greedy_ids": greedy_ids,
        "decode_steps": args.decode_steps,
        "steps": steps,
        "model_config": cfg_dict,
        "seeds": SEEDS,  # make_model.py's; they describe the tiny models only
        "attn_implementation": "eager",
        "dtype": args.dtype,
        "tf32": False,
        "torch_threads": torch.get_num_threads(),
        "cache_vs_full_max_abs_diff": cache_vs_full,
    }
    # What identifies the weights, by format (src/golden/provenance/mod.rs reads these
    # for its stale-golden check). The keys of a single-file HF folder are the
    # ones every golden had before GGUF and sharded inputs were supported, so
    # those goldens stay byte-identical.
    if source["kind"] == "gguf":
        import gguf  # transformers' GGUF loader needs it; pinned in requirements.txt
        prov["versions"]["gguf"] = gguf.__version__ if hasattr(gguf, "__version__") else _dist_version("gguf")
        prov["versions"]["accelerate"] = _dist_version("accelerate")
        prov["gguf_sha256"] = source["sha256"]
        prov["model"] = {k: source[k] for k in ("format", "file", "sha256", "general_name", "architecture",
                                                 "file_type")}
    elif source["sharded"]:
        prov["model"] = {"format": "safetensors-sharded", "files": source["files"]}
        prov["tokenizer_sha256"] = source["tokenizer_sha256"]
    else:
        prov["model_sha256"] = source["files"]["model.safetensors"]
        prov["tokenizer_sha256"] = source["tokenizer_sha256"]
    if record is not None:
        prov["record"] = record
    if sampling is not None:
        prov["sampling"] = sampling["params"]
        prov["sampling_processors"] = sampling["processors"]
    if args.tokens_from is not None:
        prov["tokens_from"] = {"sha256": sha256_file(args.tokens_from)}
    return prov


def read_tokens(path, ap):
    """The token ids a golden fed at each step, its steps and its prompt."""
    from safetensors import safe_open
    if not os.path.isfile(path):
        ap.error(f"--tokens-from {path} does not exist")
    with safe_open(path, "np") as f:
        meta = f.metadata() or {}
        if meta.get("format") != FORMAT:
            ap.error(f"--tokens-from {path} is not a {FORMAT} file (format {meta.get('format')!r})")
        prov = json.loads(meta["provenance"])
        tokens = {s: [int(x) for x in f.get_tensor(f"{s}/tokens")] for s in prov["steps"]}
    return {"steps": prov["steps"], "tokens": tokens, "prompt": prov["prompt"]}


def _dist_version(name):
    from importlib.metadata import version
    return version(name)


def describe_source(path):
    """What MODEL is: an HF folder (single or sharded safetensors) or a GGUF
    file. Exits with a clear message for anything else."""
    if os.path.isfile(path):
        if not path.endswith(".gguf"):
            sys.exit(f"record_hf.py: {path} is a file but not a .gguf; give an HF model folder or a .gguf file")
        from gguf import GGUFReader  # the pinned package transformers reads GGUFs with
        r = GGUFReader(path)

        def field(key):
            f = r.fields.get(key)
            if f is None:
                return None
            v = f.contents()
            return v.decode() if isinstance(v, bytes) else v
        log(f"hashing {path}")
        return {"kind": "gguf", "format": "gguf", "dir": os.path.dirname(os.path.abspath(path)),
                "file": os.path.basename(path), "sha256": sha256_file(path),
                "general_name": field("general.name"), "architecture": field("general.architecture"),
                "file_type": field("general.file_type"), "sharded": False}
    if not os.path.isdir(path):
        sys.exit(f"record_hf.py: model {path} does not exist")
    cfg = os.path.join(path, "config.json")
    if not os.path.isfile(cfg):
        sys.exit(f"record_hf.py: {path} has no config.json (an HF model folder needs one; for a GGUF give the .gguf file)")
    single = os.path.join(path, "model.safetensors")
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(single):
        names, sharded = ["model.safetensors"], False
    elif os.path.isfile(index):
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        missing = [n for n in shards if not os.path.isfile(os.path.join(path, n))]
        if missing:
            sys.exit(f"record_hf.py: {index} names shards that are not in {path}: {missing}")
        names, sharded = ["model.safetensors.index.json"] + shards, True
    else:
        sys.exit(f"record_hf.py: {path} has neither model.safetensors nor model.safetensors.index.json "
                 "(only safetensors weights are supported)")
    tok = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(tok):
        sys.exit(f"record_hf.py: {path} has no tokenizer.json")
    log(f"hashing {len(names)} weight file(s) in {path}")
    # Every weight file is hashed: a sharded model changes when any shard does.
    return {"kind": "hf", "dir": path, "sharded": sharded,
            "files": {n: sha256_file(os.path.join(path, n)) for n in names},
            "tokenizer_sha256": sha256_file(tok)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", help="HF model folder (single or sharded safetensors) or a .gguf file")
    ap.add_argument("out_file")
    ap.add_argument("--prompt", default=DEFAULT_PROMPT)
    ap.add_argument("--prompt-tokens", default=None, metavar="ID,...",
                    help="feed these token ids as the prompt, exactly as given (no tokenizer)")
    ap.add_argument("--chat", action="store_true",
                    help="render the prompt with the tokenizer's chat template (one user message, "
                         "add_generation_prompt=True)")
    ap.add_argument("--decode-steps", type=int, default=3)
    ap.add_argument("--steps", default=None,
                    help="comma-separated steps to store (prefill,decode1,...; default all); every step still runs")
    ap.add_argument("--stages", default="*",
                    help="comma-separated stage patterns to store, as in specs (`blk.*.q`, `blk.0.*`; default `*`)")
    ap.add_argument("--logits", choices=["all", "last"], default="all",
                    help="`last` stores only the last row of each step's logits, shape [1,V]")
    ap.add_argument("--stages-at", action="append", default=[], metavar="STEP=PATTERN[,PATTERN]",
                    help="also store these stages at this one step (repeatable)")
    ap.add_argument("--rows", default=None, metavar="ROW[,ROW]",
                    help="keep only these token rows (negative from the end, e.g. 0,-1) of every stage with a "
                         "token axis (tokens/positions stay whole; --logits last keeps the last row)")
    ap.add_argument("--dtype", choices=["float32", "float64", "bfloat16", "float16"], default="float32",
                    help="float64: the f64 oracle (every op in float64, stored rounded to float32); "
                         "bfloat16/float16: a 16-bit reference (weights cast, HF's own float32 islands)")
    ap.add_argument("--tokens-from", default=None, metavar="GOLDEN",
                    help="feed exactly this golden's token ids at every step (teacher forcing) instead of "
                         "this run's own greedy picks; its prompt and decode steps are used")
    ap.add_argument("--sample-probs", default=None, metavar="TEMPERATURE,TOP_K,TOP_P",
                    help="store `sample_probs` [1,V] at every step: HF's temperature/top-k/top-p "
                         "processors on the last logits row, then softmax (TOP_K 0, TOP_P 1.0: off)")
    args = ap.parse_args()
    sampling = None
    if args.sample_probs is not None:
        try:
            t_, k_, p_ = args.sample_probs.split(",")
            sampling = {"temperature": float(t_), "top_k": int(k_), "top_p": float(p_)}
        except ValueError:
            ap.error(f"--sample-probs {args.sample_probs!r}: expected TEMPERATURE,TOP_K,TOP_P, e.g. 0.7,40,0.9")
        if not (sampling["temperature"] > 0 and sampling["top_k"] >= 0 and 0 < sampling["top_p"] <= 1):
            ap.error(f"--sample-probs {args.sample_probs!r}: need TEMPERATURE > 0, TOP_K >= 0, 0 < TOP_P <= 1")
    extra = ["sample_probs"] if sampling is not None else []
    forced = None
    if args.tokens_from is not None:
        if args.prompt != DEFAULT_PROMPT or args.chat:
            ap.error("--tokens-from takes the prompt from the golden: leave out --prompt and --chat")
        forced = read_tokens(args.tokens_from, ap)
        given = [a for a in sys.argv[1:] if a == "--decode-steps" or a.startswith("--decode-steps=")]
        if given and args.decode_steps != len(forced["steps"]) - 1:
            ap.error(f"--decode-steps {args.decode_steps}, but --tokens-from {args.tokens_from} recorded "
                     f"{len(forced['steps']) - 1}: leave it out")
        args.decode_steps = len(forced["steps"]) - 1
    if args.decode_steps < 0:
        ap.error("--decode-steps must be >= 0")
    if not args.prompt:
        ap.error("--prompt must not be empty")
    given_ids = None
    if args.prompt_tokens is not None:
        if args.prompt != DEFAULT_PROMPT or args.chat or args.tokens_from is not None:
            ap.error("--prompt-tokens is the whole prompt: leave out --prompt, --chat and --tokens-from")
        try:
            given_ids = [int(t) for t in args.prompt_tokens.split(",")]
        except ValueError:
            ap.error(f"--prompt-tokens {args.prompt_tokens!r}: expected comma-separated token ids, e.g. 1,2,3")
        if len(given_ids) < 2 or min(given_ids) < 0:
            ap.error(f"--prompt-tokens {args.prompt_tokens!r}: need at least 2 ids, none negative")
    all_steps = ["prefill"] + [f"decode{i}" for i in range(1, args.decode_steps + 1)]
    try:
        keep_steps = all_steps if args.steps is None else golden_io.parse_steps(args.steps, args.decode_steps)
        rows = None if args.rows is None else golden_io.parse_rows(args.rows)
    except golden_io.SelectionError as e:
        ap.error(str(e))
    if os.path.exists(args.out_file) and os.path.isdir(args.out_file):
        ap.error(f"{args.out_file} is a folder")

    make_deterministic()
    transformers.utils.logging.disable_progress_bar()

    source = describe_source(args.model)
    if source["kind"] == "hf":
        with open(os.path.join(args.model, "config.json")) as f:
            cfg_file = json.load(f)
        try:  # validate the stage patterns before the (slow) weight load
            golden_io.parse_stages(args.stages, cfg_file.get("model_type"), cfg_file["num_hidden_layers"], extra)
            golden_io.parse_stages_at(args.stages_at, cfg_file.get("model_type"), cfg_file["num_hidden_layers"],
                                      args.decode_steps, extra)
        except golden_io.SelectionError as e:
            ap.error(str(e))
        load_dir, load_kw = args.model, {}
    else:
        load_dir, load_kw = source["dir"], {"gguf_file": source["file"]}
        log(f"{source['file']}: {source['architecture']} `{source['general_name']}`, "
            "dequantised to float32 by transformers' GGUF loader")

    log(f"loading {args.model}")
    tok = AutoTokenizer.from_pretrained(load_dir, **load_kw)
    with lean_gguf_loading() if source["kind"] == "gguf" else contextlib.nullcontext():
        model = AutoModelForCausalLM.from_pretrained(
            load_dir, dtype=torch.float32, attn_implementation="eager", **load_kw
        ).eval()
    fresh_weights(model)
    cfg = model.config
    assert model.model.layers[0].self_attn.config._attn_implementation == "eager"
    assert all(p.dtype == torch.float32 for p in model.parameters()), "weights are not all float32"
    model_bytes = oracle_f64.f32_bytes(model)
    log(f"loaded in float32: {model_bytes / oracle_f64.GIB:.2f} GiB, peak RSS so far "
        f"{oracle_f64.peak_rss() / oracle_f64.GIB:.2f} GiB")
    guard, f64_bytes = None, None
    if args.dtype == "float64":
        patched = to_float64(model)
        f64_bytes = model.oracle_f64_bytes
        guard = F32Guard()
        log(f"float64, streamed layer by layer ({patched})")
    elif args.dtype in ("bfloat16", "float16"):
        model.to(getattr(torch, args.dtype))
        assert all(p.dtype == getattr(torch, args.dtype) for p in model.parameters())
        log(f"cast to {args.dtype} (HF's float32 islands kept)")
    n_layers = cfg.num_hidden_layers
    try:
        patterns, keep_stages = golden_io.parse_stages(args.stages, cfg.model_type, n_layers, extra)
        stages_at, stages_at_sets = golden_io.parse_stages_at(args.stages_at, cfg.model_type, n_layers,
                                                              args.decode_steps, extra)
    except golden_io.SelectionError as e:
        ap.error(str(e))
    # An LM head whose rows are equal in pairs (phi3-tiny): every logit pair
    # must tie bit for bit, and argmax (lowest index) must pick even ids.
    W = model.lm_head.weight
    pair_ties = W.shape[0] % 2 == 0 and torch.equal(W[0::2], W[1::2])
    if pair_ties:
        log("the LM head's rows are equal in pairs: checking exact logit ties and even greedy ids")
    procs = None
    if sampling is not None:
        # HF's own list, built by the method generate() uses, for a fresh
        # sampling config: exactly its order and its on/off conditions.
        gc = GenerationConfig(do_sample=True, temperature=sampling["temperature"], top_k=sampling["top_k"],
                              top_p=sampling["top_p"])
        procs = model._get_logits_processor(generation_config=gc, input_ids_seq_length=1, device="cpu")
        from transformers.generation import logits_process as lp
        want = ([lp.TemperatureLogitsWarper] if sampling["temperature"] != 1.0 else []) + \
               ([lp.TopKLogitsWarper] if sampling["top_k"] != 0 else []) + \
               ([lp.TopPLogitsWarper] if sampling["top_p"] < 1.0 else [])
        assert [type(p_) for p_ in procs] == want, f"HF's processors: {[type(p_).__name__ for p_ in procs]}"
        sampling = {"params": sampling, "processors": [type(p_).__name__ for p_ in procs]}
        log(f"sampling processors: {sampling['processors']}")
    log(f"loaded: {cfg.model_type}, {n_layers} layers, hidden {cfg.hidden_size}, vocab {cfg.vocab_size}")

    if forced is not None:
        prompt = dict(forced["prompt"])
        prompt_ids = forced["tokens"]["prefill"]
        text = prompt.get("rendered", prompt.get("text"))
        assert prompt["token_ids"] == prompt_ids
    elif given_ids is not None:
        too_big = [t for t in given_ids if t >= cfg.vocab_size]
        if too_big:
            sys.exit(f"record_hf.py: --prompt-tokens: ids {too_big} are outside the vocabulary of "
                     f"{cfg.vocab_size} tokens")
        prompt_ids = given_ids
        text = None
        prompt = {"given": "tokens", "token_ids": prompt_ids}
    elif args.chat:
        if not getattr(tok, "chat_template", None):
            sys.exit(f"record_hf.py: --chat, but the tokenizer of {args.model} has no chat template")
        text = tok.apply_chat_template([{"role": "user", "content": args.prompt}], tokenize=False,
                                       add_generation_prompt=True)
        # The template writes any BOS itself.
        prompt_ids = tok(text, add_special_tokens=False)["input_ids"]
        prompt = {"text": args.prompt, "chat": True, "rendered": text, "token_ids": prompt_ids}
    else:
        text = args.prompt
        prompt_ids = tok(text, add_special_tokens=True)["input_ids"]
        prompt = {"text": args.prompt, "token_ids": prompt_ids}
    if source["kind"] == "hf" and forced is None and given_ids is None:
        # The tokenizer.json in the folder is what engines read; make sure the
        # transformers wrapper did not tokenize differently from it.
        raw = tokenizers.Tokenizer.from_file(os.path.join(args.model, "tokenizer.json"))
        raw_ids = raw.encode(text, add_special_tokens=not args.chat).ids
        assert raw_ids == prompt_ids, f"AutoTokenizer ({prompt_ids}) and tokenizer.json ({raw_ids}) disagree"
    assert len(prompt_ids) >= 2, "prompt must have at least 2 tokens"
    log(f"prompt: {len(prompt_ids)} tokens; {args.decode_steps} decode step(s)")

    r = Recorder(model)
    r.guard = guard
    r.install()
    out = {}
    steps, greedy_ids = [], []
    x = torch.tensor([prompt_ids], dtype=torch.int64)
    windows = layer_windows(cfg)
    sliding = any(w is not None for w in windows)
    # A sliding-window model (Gemma 3) would get a DynamicCache built from its
    # config, whose sliding layers keep only the last window - 1 positions:
    # attn_scores/attn_probs of those layers would be narrower than S in
    # decode steps. The canonical [H,T,S] has every position, so the cache
    # here is a plain DynamicCache (no config: every layer keeps every
    # position, asserted after each step); HF's sliding-window mask still
    # removes the keys outside the window (asserted in the attention tap),
    # and the logits agree with HF's own trimmed cache (checked below).
    past, pos = (DynamicCache() if sliding else None), 0
    att_rows = {"prefill": [], "decode": []}
    prefill_row_max = []
    logit_absmax = 0.0
    step_tokens = {}  # {step: T}, for the row subset (--rows)
    step_last_logits = []  # last logits row of each step, float64
    dims = config_dims(cfg)
    expected = golden_io.all_stages(cfg.model_type, n_layers, extra) + ["tokens", "positions"]
    fed = list(prompt_ids)  # every token fed so far (the processors' input_ids)
    try:
        with torch.no_grad():
            for si in range(args.decode_steps + 1):
                step = "prefill" if si == 0 else f"decode{si}"
                steps.append(step)
                r.rec.clear()
                r.step = step
                T = x.shape[1]
                log(f"{step}: {T} token(s) at position {pos}")
                positions = torch.arange(pos, pos + T, dtype=torch.int64)
                r.S = pos + T
                with guard or contextlib.nullcontext():
                    res = model(input_ids=x, position_ids=positions[None], past_key_values=past,
                                use_cache=True, output_attentions=True, return_dict=True)
                assert past is None or res.past_key_values is past
                past = res.past_key_values
                if sliding:
                    lens = [layer.keys.shape[-2] for layer in past.layers]
                    assert len(lens) == n_layers and lens == [pos + T] * n_layers and not any(past.is_sliding), \
                        f"{step}: the cache holds {lens} positions per layer, expected all {pos + T}"
                if pair_ties:
                    lg = res.logits[0]
                    assert torch.equal(lg[:, 0::2], lg[:, 1::2]), f"{step}: logit pairs do not tie exactly"
                if procs is not None:
                    with guard or contextlib.nullcontext():
                        scores = procs(torch.tensor([fed], dtype=torch.int64), res.logits[:, -1, :])
                        # As GenerationMixin._sample: softmax of the processed scores.
                        probs = torch.nn.functional.softmax(scores, dim=-1)
                    r.put("sample_probs", probs[None])  # [1,1,V] -> [1,V]
                    sp = r.rec["sample_probs"]
                    assert abs(float(sp.astype(np.float64).sum()) - 1.0) < 1e-5, sp.sum()
                    if sampling["params"]["top_k"]:
                        assert (sp > 0).sum() <= sampling["params"]["top_k"] or pair_ties
                assert len(res.attentions) == n_layers
                for li, a in enumerate(res.attentions):
                    r.put(f"blk.{li}.attn_probs", a)  # [1,H,T,S] -> [H,T,S]
                    probs = r.rec[f"blk.{li}.attn_probs"]
                    att_rows["prefill" if si == 0 else "decode"] += attention_rows(probs, positions.numpy(),
                                                                                   windows[li])
                    if si == 0:
                        prefill_row_max.append(probs.max(axis=-1).mean())
                # The hooked logits must be what the model returned.
                assert np.array_equal(r.rec["logits"], res.logits[0].to(torch.float32).numpy())
                r.rec["tokens"] = x[0].numpy().astype(np.int64)
                r.rec["positions"] = positions.numpy()
                assert sorted(r.rec) == sorted(expected), sorted(set(r.rec) ^ set(expected))
                S = pos + T
                logit_absmax = max(logit_absmax, float(np.abs(r.rec["logits"]).max()))
                for k, v in r.rec.items():
                    assert v.shape == golden_io.expected_shape(k, T, S, dims), f"{step}/{k}: shape {v.shape}"
                    if v.dtype != np.int64:
                        assert np.isfinite(v).all(), f"{step}/{k} is not finite"
                    # tokens/positions of every step: teacher forcing needs them.
                    if k in ("tokens", "positions"):
                        out[f"{step}/{k}"] = v
                    elif golden_io.stored(step, k, keep_steps, keep_stages, stages_at_sets):
                        if k == "logits" and args.logits == "last":
                            v = np.ascontiguousarray(v[-1:])
                        elif rows is not None:
                            v = golden_io.take_rows(k, v, rows, T)
                        out[f"{step}/{k}"] = v
                step_tokens[step] = T
                pos += T
                nxt = int(res.logits[0, -1].argmax())
                if pair_ties:
                    assert nxt % 2 == 0, f"{step}: greedy id {nxt} is odd despite the tied pairs"
                greedy_ids.append(nxt)
                feed = nxt
                if forced is not None and si < args.decode_steps:
                    feed = forced["tokens"][f"decode{si + 1}"][0]
                    if feed != nxt:
                        log(f"{step}: greedy token {nxt}; fed the golden's {feed} (teacher forcing)")
                fed.append(feed)
                log(f"{step}: greedy token {nxt}")
                x = torch.tensor([[feed]], dtype=torch.int64)
                last_logits = res.logits[0, -1].to(torch.float64).numpy().copy()
                step_last_logits.append(last_logits)
    finally:
        r.remove()

    sliding_vs_full_cache = None
    if sliding:
        # The same steps through HF's own cache for this config (sliding
        # layers trimmed to the last window - 1 positions, asserted): the
        # last-row logits of every step must agree with the full cache's
        # (not bit for bit: the softmax sums over different key counts).
        log("sliding-window cross-check: the same steps with HF's own (trimmed) cache")
        own, diffs, p0 = None, [], 0
        with torch.no_grad():
            for si, step in enumerate(steps):
                ids = prompt_ids if si == 0 else [fed[len(prompt_ids) + si - 1]]
                pos_ids = torch.arange(p0, p0 + len(ids), dtype=torch.int64)[None]
                with guard or contextlib.nullcontext():
                    o = model(input_ids=torch.tensor([ids], dtype=torch.int64), position_ids=pos_ids,
                              past_key_values=own, use_cache=True)
                own = o.past_key_values
                p0 += len(ids)
                diffs.append(float(np.abs(o.logits[0, -1].to(torch.float64).numpy() - step_last_logits[si]).max()))
        lens = [layer.keys.shape[-2] for layer in own.layers]
        want = [p0 if w is None else min(p0, w - 1) for w in windows]
        assert lens == want and own.is_sliding == [w is not None for w in windows], \
            f"HF's own cache holds {lens} positions per layer, expected {want}"
        sliding_vs_full_cache = max(diffs)
        assert sliding_vs_full_cache < 1e-3, f"HF's own sliding cache gives other logits: {diffs}"

    # KV-cache cross-check: one forward over prompt + every token fed so far
    # must give (nearly) the same last-row logits as the cached last step.
    log("KV-cache cross-check: one forward over prompt + fed tokens")
    with torch.no_grad():
        full = torch.tensor([fed[:-1]], dtype=torch.int64)
        with guard or contextlib.nullcontext():
            lf = model(input_ids=full).logits[0, -1].to(torch.float64).numpy()
    cache_vs_full = float(np.abs(lf - last_logits).max())
    if guard is not None:
        assert not guard.bad, f"float64 run: ops produced other float dtypes: {dict(guard.bad)}"

    if source["kind"] == "hf":
        # The config exactly as HF saved it next to the weights.
        cfg_dict = cfg_file
    else:
        # No config.json: the config transformers derived from the GGUF
        # metadata, serialised as save_pretrained would write it.
        cfg_dict = json.loads(cfg.to_json_string(use_diff=False))
    record = golden_io.record_section(keep_steps, all_steps, patterns, args.logits, stages_at, rows, step_tokens)
    prov = build_provenance(args, prompt, cfg_dict, greedy_ids, steps, cache_vs_full, source, record, sampling)
    if sliding_vs_full_cache is not None:
        # Sliding-window models only (other goldens keep their provenance).
        prov["sliding_cache_vs_full_cache_max_abs_diff"] = sliding_vs_full_cache
    metadata = {
        "format": FORMAT,
        "provenance": json.dumps(prov, sort_keys=True, separators=(",", ":")),
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out_file)), exist_ok=True)
    # Write to a temporary name and rename, so a failed run never leaves a
    # half-written golden file behind.
    tmp = args.out_file + ".tmp"
    bf16 = []
    if args.dtype in ("bfloat16", "float16"):
        out, bf16 = golden_io.narrow_exact(out, args.dtype)
    save_deterministic(out, metadata, tmp, bf16)
    if os.path.exists(args.out_file):
        # Replacing is what the caller asked for (regen.sh starts from empty
        # folders, goldens regen from a fresh one), but never silently.
        log(f"replacing the existing {args.out_file}")
    os.replace(tmp, args.out_file)
    log(f"wrote {args.out_file}: {len(out)} tensors, {os.path.getsize(args.out_file)} bytes")
    log(oracle_f64.memory_line(model_bytes, f64_bytes))

    # The simple figure: mean row max of the prefill probabilities
    # vs the uniform 1/S (S = prompt length). It flatters: causal row t sees
    # only t+1 keys, so even perfectly uniform rows score well above 1/S.
    # The per-row figures (each row against its own 1/n_keys) are the honest
    # measure and what INITIALIZER_RANGE in make_model.py was chosen on.
    S0 = len(prompt_ids)
    pre_mean_max = float(np.mean(prefill_row_max))
    print(json.dumps({
        "out": args.out_file,
        "tensors": len(out),
        "bytes": os.path.getsize(args.out_file),
        "sha256": sha256_file(args.out_file),
        "prompt_ids": prompt_ids,
        "greedy_ids": greedy_ids,
        "greedy_text": tok.decode(greedy_ids),
        "cache_vs_full_max_abs_diff": cache_vs_full,
        "sliding_cache_vs_full_cache_max_abs_diff": sliding_vs_full_cache,
        "dtype": args.dtype,
        "lm_head_pair_ties": bool(pair_ties),
        "logits_absmax": round(logit_absmax, 4),
        "attention": {
            "prefill_mean_row_max": round(pre_mean_max, 4),
            "prefill_uniform_1_over_S": round(1.0 / S0, 4),
            "prefill_mean_row_max_x_1_over_S": round(pre_mean_max * S0, 2),
            "prefill_rows": attention_summary(att_rows["prefill"]),
            "decode_rows": attention_summary(att_rows["decode"]) if att_rows["decode"] else None,
        },
    }))


if __name__ == "__main__":
    sys.exit(main())
