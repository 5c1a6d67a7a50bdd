#!/usr/bin/env python3
"""Build a tiny random-weight model (Qwen2, Llama, Qwen3, Phi-3, Gemma 3 or a MoE) the goldens are recorded from.

usage: make_model.py OUT_DIR [--family qwen2|llama|qwen3|phi3|gemma3
                              |llama3|yarn|longrope|linear|dynamic|swa
                              |mixtral|qwen2_moe|qwen3_moe|gpt_oss|deepseek_v3]
                             [--initializer-range R]

Writes a complete HF model folder into OUT_DIR: config.json,
generation_config.json, model.safetensors, tokenizer.json,
tokenizer_config.json. Everything is built offline and deterministically:
the same pinned packages (requirements.txt) give byte-identical files.

Architecture: Qwen2, hidden 64, FFN 128, 2 layers, 4 query heads sharing
2 KV heads (GQA group of 2), head_dim 16, vocab 512, untied LM head, QKV
biases, RMSNorm eps 1e-6, RoPE theta 10000, float32, 1024 positions (every
family; 256 before the long-prompt specs needed more). Small enough that the
model and its goldens stay well under 2 MB, yet every code path a real Qwen2
takes (GQA, biases, untied head, NEOX RoPE) is exercised.

--family llama (goldens/llama-tiny/): Llama, hidden 96, FFN 128, 2 layers,
6 query heads sharing 2 KV heads (GQA group of 3), head_dim 16, vocab 512,
TIED embeddings (no lm_head weight saved), no biases at all, RMSNorm eps
1e-5, RoPE theta 500000, float32; tokenizer as for Qwen2 but with Llama 3's
pre-tokenizer regex (digits in groups of up to 3). It covers what the Qwen2
model does not: tied head, no biases, a GQA group of 3, another RoPE base,
and the Q/K row permutation llama.cpp's converter applies to Llama models.

--family qwen3 (goldens/qwen3-tiny/): Qwen3, hidden 64, FFN 128, 2 layers,
4 query heads sharing 2 KV heads, head_dim 32 (explicit, NOT hidden/heads =
16: an engine that derives D from hidden/heads fails), vocab 512, per-head
RMSNorm of q and k before RoPE (q_norm / k_norm, weights randomised like every
norm), no biases, tied embeddings (as Qwen3-0.6B), RMSNorm eps 1e-6, RoPE
theta 1000000, float32; tokenizer as for Qwen2.

--family phi3 (goldens/phi3-tiny/): Phi-3 as Phi-3-mini-4k-instruct builds
it: fused qkv_proj and gate_up_proj, hidden_act silu, no rope scaling
(rope_type default, partial_rotary_factor 1), sliding_window null, untied
LM head, no biases, RMSNorm eps 1e-5, RoPE theta 10000; hidden 64, FFN 128,
2 layers, 4 heads. One deliberate difference from Phi-3-mini: 2 KV heads
(GQA) instead of 4, so the q, k and v pieces of the fused projection have
different sizes and a wrong split cannot pass by shape. Config fields that
had to be set: original_max_position_embeddings (llama.cpp's converter reads
it unconditionally; = max_position_embeddings 1024, so no scaling), bos_token_id
None. The LM head's rows are equal in pairs (row 2j+1 := row 2j, bit for bit,
after the random init): every logit pair ties exactly, so every greedy pick is
a tie that HF's argmax and llama.cpp's greedy sampler both break towards the
lower (even) index; an engine that breaks ties otherwise picks odd ids. Tokenizer: byte-level BPE with Llama 3's pre-tokenizer (the real
Phi-3 uses SentencePiece; the tokenizer is not what this model tests).

--family gemma3 (goldens/gemma3-tiny/): Gemma 3's text model
(Gemma3ForCausalLM, model_type gemma3_text, GGUF architecture gemma3):
hidden 64, FFN 128, 6 layers, 4 query heads sharing 2 KV heads, head_dim 32
(explicit, NOT hidden/heads = 16), vocab 512, no biases, tied embeddings (as
every Gemma 3), RMSNorm eps 1e-6, gated GELU FFN (hidden_activation
gelu_pytorch_tanh), per-head q_norm/k_norm before RoPE, post-attention and
post-FFN norms (four norms per layer), embeddings scaled by sqrt(hidden) = 8,
no soft-capping (attn_logit_softcapping and final_logit_softcapping null),
no rope scaling, 1024 positions. Attention scale query_pre_attn_scalar^-0.5
with query_pre_attn_scalar = head_dim = 32: llama.cpp's gemma3 graph uses
1/sqrt(head_dim) for every model size but the 27B, so only this value lets
HF and llama.cpp agree. Sliding-window attention: sliding_window 4 (small on
purpose, so the window masks keys inside the default prompt of 8 tokens and
in every decode step) and Gemma 3's layer pattern of 6: layers 0-4
sliding_attention, layer 5 full_attention (the pattern llama.cpp assumes for
gemma3 when the GGUF carries no sliding_window_pattern, which its converter
does not write for Gemma 3). RoPE theta per layer type (transformers 5's
rope_parameters keyed by layer type): 1e6 on full_attention layers (the
GGUF's rope.freq_base), 1e4 on sliding ones (rope.freq_base_swa). Gemma's
RMSNorm scales by (1 + w), and HF initialises w to 0; here every norm weight
is drawn N(0, 0.1) around 0 (not around 1 as for the other families), so
the effective scale is 1 + w ~ 1 +- 0.1 and an engine that multiplies by w
alone (forgetting the + 1) or by 1 + (1 + w) fails by a factor ~10 or ~2.
llama.cpp's converter adds the 1 when writing the GGUF (convert_gguf.py
asserts it), so the GGUF holds 1 + w. Tokenizer: byte-level BPE with Qwen2's
pre-tokenizer (llama.cpp "qwen2") and specials <eos>, <start_of_turn>,
<end_of_turn>, no BOS (the real Gemma 3 uses SentencePiece and prepends
<bos>; the converter's Gemma3 path takes a tokenizer.json BPE vocabulary as
it is when there is no tokenizer.model, so no converter patch is needed for
the vocabulary, only the pre-tokenizer name). The BPE vocabulary has exactly
512 entries (asserted): the converter trims token_embd to the tokenizer's
size for Gemma 3, and that trim must be a no-op.

--family llama3|yarn|longrope|linear|dynamic|swa (issue 37, the
long-context models): llama, qwen2, phi3, llama, llama and qwen2 as above
(same dims, tokenizer, seeds and initializer range; phi3's paired LM head
too) with only the config changed: a RoPE scaling or Qwen2's sliding
window. The overrides, and the check that transformers reads the written
config.json as intended, are in long_context_families.py; the tokenizer's
model_max_length follows the variant's max_position_embeddings.

--family mixtral|qwen2_moe|qwen3_moe|gpt_oss|deepseek_v3 (issue 38, the
mixture-of-experts models): configs, router weights and check_written() in
moe_families.py (tokenizer of llama for mixtral, qwen2 for the others;
initializer range 0.15).
"""
import argparse
import hashlib
import json
import os
import sys

# Never reach the Hub: everything here is built locally, and a network lookup
# could only make the result depend on something outside the repository.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch
import transformers
sys.dont_write_bytecode = True  # no __pycache__ in the repository
import long_context_families  # noqa: E402  (the long-context families' config overrides)
import moe_families  # noqa: E402  (the mixture-of-experts families)
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import (Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM, Phi3Config,
                          Phi3ForCausalLM, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM, Qwen3Config,
                          Qwen3ForCausalLM)

VOCAB = 512
# Context length of every tiny model (config max_position_embeddings, hence
# the GGUF's context_length; the tokenizer's model_max_length). 1024 leaves
# room for long-prompt specs of a few hundred tokens (was 256). The default
# RoPE does not depend on it, so the weights and activations do not either.
MAX_POSITIONS = 1024
# Families whose LM head rows are made equal in pairs (row 2j+1 := row 2j,
# bit for bit), so that every logit pair ties exactly and every greedy pick
# is a tie between two tokens: argmax in HF and llama.cpp's greedy pick take
# the lowest index, so every greedy id is even (checked by both recorders).
# Needs an untied head (a tied one would change the embeddings too): phi3.
# (qwen3-tiny has a tied head, as Qwen3-0.6B; qwen2-tiny's untied head is
# left alone because the default spec and its f16/bf16 variants use it.)
PAIR_TIED_HEAD = {"phi3"}

# Seeds, recorded in the goldens' provenance (record_hf.py imports SEEDS).
# WEIGHT_SEED drives HF's own initialisation of every weight matrix;
# BIAS_NORM_SEED drives a separate generator for biases and norm weights, so
# changing how those are randomised never shifts the weight matrices.
WEIGHT_SEED = 0
BIAS_NORM_SEED = 1
SEEDS = {"weights": WEIGHT_SEED, "biases_and_norms": BIAS_NORM_SEED}

# Std of HF's normal initialisation of every Linear and the embedding.
# Chosen by measurement: record_hf.py prints attention statistics, and the
# sweep over 0.02 .. 0.3 is in docs/recorders.md (Measured). Each attention row is compared with
# its own uniform value 1/n_keys (causal row t sees t+1 keys; comparing with
# 1/S instead flatters: HF's default 0.02 then "scores" 3.3x while being
# uniform to within 4%). Default prompt (14 tokens) + 3 decode steps, mean of
# row max x n_keys over prefill rows / decode rows:
#   0.02 (HF default): 1.04x / 1.05x, normalised entropy 1.00: flat, so a
#        broken mask, scale or softmax would barely move the goldens.
#   0.10 (the lab's value): 1.9x / 2.3x, entropy 0.93 / 0.95: still mild.
#   0.15 (chosen): 3.6x / 4.8x (medians 3.1x / 4.5x), entropy 0.72 / 0.79,
#        3 of 128 rows with max > 0.9; |logits| <= 4.8 and finite; KV cache
#        vs full recompute 4.1e-6.
#   0.20: 4.9x / 8.7x but 25 of 128 rows above 0.9 (up to 0.996): near
#        one-hot rows hide errors in all the other scores of the row.
# 0.15 is clearly non-uniform (>= 3x) yet stays away from saturation.
INITIALIZER_RANGE = 0.15
# The Llama model's value, chosen the same way (sweep in docs/recorders.md).
INITIALIZER_RANGE_LLAMA = 0.12
# Qwen3 and Phi-3 have qwen2-tiny's hidden size 64, so its value. (Qwen3's
# q_norm/k_norm rescale q and k to unit RMS anyway, so there the attention
# sharpness depends on the norm weights and head_dim rather than on this.)
# Gemma 3: hidden 64 as well, and qwen2-tiny's value, by measurement too
# (make_model.py --family gemma3 --initializer-range R, record_hf.py's
# attention summary; each row against its own 1/n_keys, n_keys at most the
# window of 4 on the sliding layers). Gemma normalises q and k per head
# (q_norm/k_norm) and both sublayer outputs (the post norms), so the
# attention does not depend on R at all: row max x n_keys 1.98-2.09 prefill,
# 2.09-2.23 decode, entropy 0.81-0.84, for every R in 0.02 .. 0.3 (layer 5,
# full attention over up to 17 keys: 2.5-2.6x). R sets the FFN's operating
# point and the logits instead; gate pre-activation std / max|gate| /
# max|logit| over the default prompt:
#   0.02: 0.16 / 0.66 / 0.6: GELU nearly linear there, tanh-vs-erf GELU and
#         table errors barely show.
#   0.15 (chosen): 1.2 / 4.5 / 5.3: the curved part of the GELU, far from
#         ggml's |x| >= 10 shortcut; KV cache vs full recompute 2.5e-6.
#   0.30: 2.4 / 9.4 / 14.5: gates near that shortcut, peaked logits.
INITIALIZER_RANGE_GEMMA3 = 0.15
INITIALIZER_RANGE_BY_FAMILY = {"qwen2": INITIALIZER_RANGE, "llama": INITIALIZER_RANGE_LLAMA,
                               "qwen3": INITIALIZER_RANGE, "phi3": INITIALIZER_RANGE,
                               "gemma3": INITIALIZER_RANGE_GEMMA3}
INITIALIZER_RANGE_BY_FAMILY.update({f: INITIALIZER_RANGE for f in moe_families.CONFIGS})

# Byte-level BPE with exactly Qwen2's pre-tokenizer regex. This is the
# pipeline transformers' Qwen2 tokenizer uses and llama.cpp calls "qwen2",
# so HF, tokenizer.json readers and llama.cpp all tokenize identically.
QWEN2_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Llama 3's pre-tokenizer (llama.cpp calls it "llama-bpe"): as Qwen2's but
# numbers split into groups of up to 3 digits.
LLAMA3_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
LLAMA_SPECIALS = ["<|end_of_text|>", "<|begin_of_text|>", "<|eot_id|>"]
# Phi-3's specials (the first is EOS/pad, as in Phi-3-mini's config). <unk>,
# <s> and </s> are required, not decoration: llama.cpp sets attributes on
# them by name (token_to_id.at) for any model whose general.name contains
# "phi3", and fails to load the vocabulary ("unordered_map::at") without them.
PHI3_SPECIALS = ["<|endoftext|>", "<unk>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|end|>"]
# Gemma's names for end of sequence and the chat turns (no <bos>: as for every
# tiny model, no BOS is added; see the module docstring).
GEMMA3_SPECIALS = ["<eos>", "<start_of_turn>", "<end_of_turn>"]

# Per family: pre-tokenizer regex, special tokens (the first is EOS/pad).
FAMILIES = {
    "qwen2": (QWEN2_PRETOKENIZE_REGEX, SPECIALS),
    "llama": (LLAMA3_PRETOKENIZE_REGEX, LLAMA_SPECIALS),
    "qwen3": (QWEN2_PRETOKENIZE_REGEX, SPECIALS),
    "phi3": (LLAMA3_PRETOKENIZE_REGEX, PHI3_SPECIALS),
    "gemma3": (QWEN2_PRETOKENIZE_REGEX, GEMMA3_SPECIALS),
}
FAMILIES.update({f: FAMILIES[t] for f, t in moe_families.TOKENIZER_OF.items()})
# Gemma 3's sliding-window layout (see the module docstring).
GEMMA3_LAYERS = 6
GEMMA3_SLIDING_WINDOW = 4
GEMMA3_LAYER_TYPES = ["sliding_attention"] * 5 + ["full_attention"]
# Families whose RMSNorm scales by (1 + w): their norm weights are drawn
# around 0 instead of around 1.
ONE_PLUS_W_NORM = {"gemma3"}

# A few KB of text written for this purpose: no downloads, and the corpus is
# part of the source so the trained merges are reproducible.
CORPUS_LINES = [
    "The quick brown fox jumps over the lazy dog near the river bank.",
    "A tiny model with random weights is still a deterministic function.",
    "Golden tensors let an inference engine check every stage of a forward pass.",
    "Embedding, normalization, attention, feed forward, and logits are compared in order.",
    "Rotary position embeddings rotate pairs of query and key features by an angle.",
    "The key value cache keeps past keys and values so decoding is incremental.",
    "Softmax turns attention scores into probabilities that sum to one.",
    "Residual connections add the sublayer output back to the stream.",
    "RMS normalization divides by the root mean square and scales by a weight.",
    "SiLU gates the up projection before the down projection in the MLP.",
    "Rust code reads safetensors files and compares them with a tolerance.",
    "Numbers like 0 1 2 3 4 5 6 7 8 9 10 42 100 1024 appear in text too.",
    "Punctuation: commas, periods. Questions? Exclamations! Colons: and semicolons;",
    "def forward(self, x): return self.down(self.act(self.gate(x)) * self.up(x))",
    "fn main() { let x = vec![1, 2, 3]; println!(\"{:?}\", x); }",
    "Hello world! Hello model! Hello tokenizer! Hello golden file!",
    "In the beginning there was a seed, and the seed was zero.",
    "Every layer reads the residual stream and writes an update to it.",
    "Grouped query attention shares each key value head among several query heads.",
    "Prefill processes the whole prompt; decode processes one token at a time.",
]


def corpus():
    """~5 KB: the lines above four times, alternately lower-cased so that the
    merges cover both cases."""
    out = []
    for i in range(4):
        for j, line in enumerate(CORPUS_LINES):
            out.append(line if (i + j) % 2 == 0 else line.lower())
    return out


def build_tokenizer(regex=QWEN2_PRETOKENIZE_REGEX, specials=SPECIALS):
    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        min_frequency=2,
        special_tokens=specials,
        # All 256 byte symbols, so any input text is encodable without <unk>.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    return tok


def _config(cls, over, **kw):
    """A config of `cls` from a builder's keywords, `over` (a long-context
    family's overrides, long_context_families.py) replacing some."""
    kw.update(over or {})
    return cls(**kw)


def build_config(eos_id, initializer_range, over=None):
    return _config(Qwen2Config, over,
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        hidden_act="silu",
        max_position_embeddings=MAX_POSITIONS,
        # transformers 5 keeps RoPE settings in `rope_parameters` (config.json
        # gets `rope_parameters.rope_theta`, not a top-level `rope_theta`).
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        use_sliding_window=False,
        bos_token_id=None,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
        initializer_range=initializer_range,
        # transformers 5 renamed `torch_dtype` to `dtype`.
        dtype="float32",
    )


def build_llama_config(eos_id, initializer_range, over=None):
    return _config(LlamaConfig, over,
        vocab_size=VOCAB,
        hidden_size=96,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=16,
        hidden_act="silu",
        max_position_embeddings=MAX_POSITIONS,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        attention_bias=False,
        mlp_bias=False,
        bos_token_id=None,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
        initializer_range=initializer_range,
        dtype="float32",
    )


def build_qwen3_config(eos_id, initializer_range, over=None):
    return _config(Qwen3Config, over,
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        hidden_act="silu",
        max_position_embeddings=MAX_POSITIONS,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        attention_bias=False,
        use_sliding_window=False,
        sliding_window=None,
        bos_token_id=None,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
        initializer_range=initializer_range,
        dtype="float32",
    )


def build_phi3_config(eos_id, initializer_range, over=None):
    return _config(Phi3Config, over,
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        hidden_act="silu",
        max_position_embeddings=MAX_POSITIONS,
        original_max_position_embeddings=MAX_POSITIONS,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 1.0},
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        sliding_window=None,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attention_dropout=0.0,
        bos_token_id=None,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
        initializer_range=initializer_range,
        dtype="float32",
    )


def build_gemma3_config(eos_id, initializer_range, over=None):
    return _config(Gemma3TextConfig, over,
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=GEMMA3_LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        hidden_activation="gelu_pytorch_tanh",
        max_position_embeddings=MAX_POSITIONS,
        # Per layer type, as transformers 5 keeps Gemma 3's two RoPE bases.
        rope_parameters={
            "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        },
        rms_norm_eps=1e-6,
        query_pre_attn_scalar=32,
        sliding_window=GEMMA3_SLIDING_WINDOW,
        layer_types=list(GEMMA3_LAYER_TYPES),
        attn_logit_softcapping=None,
        final_logit_softcapping=None,
        use_bidirectional_attention=False,
        tie_word_embeddings=True,
        attention_bias=False,
        attention_dropout=0.0,
        bos_token_id=None,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
        initializer_range=initializer_range,
        dtype="float32",
    )


BUILDERS = {
    "qwen2": (build_config, Qwen2ForCausalLM),
    "llama": (build_llama_config, LlamaForCausalLM),
    "qwen3": (build_qwen3_config, Qwen3ForCausalLM),
    "phi3": (build_phi3_config, Phi3ForCausalLM),
    "gemma3": (build_gemma3_config, Gemma3ForCausalLM),
}
# Tied LM head per family (asserted, and then lm_head.weight must not be saved).
TIED = {"qwen2": False, "llama": True, "qwen3": True, "phi3": False, "gemma3": True}
BUILDERS.update({f: moe_families.builder(f) for f in moe_families.CONFIGS})
TIED.update(moe_families.TIED)


def sha256(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir")
    ap.add_argument("--family", choices=sorted(FAMILIES) + sorted(long_context_families.VARIANTS), default="qwen2")
    ap.add_argument("--initializer-range", type=float, default=None,
                    help="for the attention sweep only; the committed models use the default "
                         f"({INITIALIZER_RANGE_BY_FAMILY})")
    args = ap.parse_args()
    # A long-context family is its base family with config overrides.
    fam, over = long_context_families.base_of(args.family), long_context_families.overrides(args.family)
    if args.initializer_range is None:
        args.initializer_range = INITIALIZER_RANGE_BY_FAMILY[fam]
    regex, specials = FAMILIES[fam]
    out = args.out_dir
    os.makedirs(out, exist_ok=True)

    # Initialisation draws from the CPU generator only, but pin threads and
    # algorithms anyway so nothing in the build can depend on the machine.
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    transformers.utils.logging.disable_progress_bar()

    tok = build_tokenizer(regex, specials)
    n = tok.get_vocab_size()
    assert n <= VOCAB, f"tokenizer has {n} entries, more than the model's vocab {VOCAB}"
    if args.family == "gemma3":
        # llama.cpp's Gemma3 converter trims token_embd to the tokenizer.json
        # vocabulary plus its added tokens; with a full 512-entry vocabulary
        # that trim keeps every row.
        assert n == VOCAB, f"gemma3: the tokenizer has {n} entries, not {VOCAB}: the converter would trim token_embd"
        # The window must mask keys within the default prompt (14 tokens).
        sys.dont_write_bytecode = True  # no __pycache__ in the repository
        from record_hf import DEFAULT_PROMPT  # noqa: E402  (lazy: record_hf imports this module)
        n_prompt = len(tok.encode(DEFAULT_PROMPT).ids)
        assert n_prompt >= 3 * GEMMA3_SLIDING_WINDOW, f"the default prompt has only {n_prompt} tokens"
    eos = specials[0]
    eos_id = tok.token_to_id(eos)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=eos,
        pad_token=eos,
        bos_token=None,
        unk_token=None,
        model_max_length=over.get("max_position_embeddings", MAX_POSITIONS),
    )
    fast.save_pretrained(out)

    torch.manual_seed(WEIGHT_SEED)
    build, cls = BUILDERS[fam]
    model = cls(build(eos_id, args.initializer_range, over)).to(torch.float32).eval()
    # HF initialises biases to 0 and norm weights to 1, which would let an
    # engine that forgets the bias add or the norm scale pass. Randomise them
    # (small, so the model stays well behaved) with their own generator.
    g = torch.Generator().manual_seed(BIAS_NORM_SEED)
    with torch.no_grad():
        for name, p in model.named_parameters():  # fixed module order
            if name.endswith(".bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
            elif "norm" in name and fam in ONE_PLUS_W_NORM:
                # Gemma: the norm scales by 1 + w, HF starts w at 0.
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
            elif "norm" in name:
                p.copy_(1.0 + torch.randn(p.shape, generator=g) * 0.1)
    if fam in moe_families.CONFIGS:
        moe_families.randomise_routing(model, fam)  # router matrices: their own generator and scale
    # Guard the assumptions the goldens rely on.
    tied = model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert tied == TIED[fam], f"{args.family}: LM head tied={tied}, expected {TIED[fam]}"
    if fam in PAIR_TIED_HEAD:
        assert not tied and VOCAB % 2 == 0
        with torch.no_grad():
            W = model.lm_head.weight
            W[1::2] = W[0::2]
        assert torch.equal(W[1::2], W[0::2])
    if fam in ("qwen2", "qwen2_moe"):
        assert model.model.layers[0].self_attn.q_proj.bias is not None, "Qwen2 has QKV biases"
    elif fam not in moe_families.CONFIGS:
        assert not any(n.endswith(".bias") for n, _ in model.named_parameters()), f"{args.family} has no biases"
    if fam == "qwen3":
        a = model.model.layers[0].self_attn
        assert a.head_dim == 32 != model.config.hidden_size // model.config.num_attention_heads
        assert a.q_norm.weight.shape == (32,) and a.k_norm.weight.shape == (32,)
    if args.family == "gemma3":
        c = model.config
        m = model.model
        a = m.layers[0].self_attn
        assert c.model_type == "gemma3_text" and type(model).__name__ == "Gemma3ForCausalLM"
        assert a.head_dim == 32 != c.hidden_size // c.num_attention_heads
        assert a.scaling == 32 ** -0.5 == a.head_dim ** -0.5, "query_pre_attn_scalar must be head_dim (llama.cpp)"
        assert list(c.layer_types) == GEMMA3_LAYER_TYPES and c.sliding_window == GEMMA3_SLIDING_WINDOW
        assert [l.self_attn.sliding_window for l in m.layers] == [GEMMA3_SLIDING_WINDOW] * 5 + [None]
        assert c.attn_logit_softcapping is None and c.final_logit_softcapping is None
        assert c.hidden_activation == "gelu_pytorch_tanh"
        assert float(m.embed_tokens.embed_scale) == 8.0 == c.hidden_size ** 0.5
        for lt, theta in (("full_attention", 1e6), ("sliding_attention", 1e4)):
            assert c.rope_parameters[lt] == {"rope_type": "default", "rope_theta": theta}, c.rope_parameters
        norms = [(n_, p_) for n_, p_ in model.named_parameters() if "norm" in n_]
        assert len(norms) == 6 * c.num_hidden_layers + 1, [n_ for n_, _ in norms]
        assert all(abs(float(p_.detach().mean())) < 0.1 for _, p_ in norms), "gemma3 norm weights must be drawn around 0"
    if fam == "phi3":
        assert hasattr(model.model.layers[0].self_attn, "qkv_proj") and hasattr(model.model.layers[0].mlp, "gate_up_proj")
    model.save_pretrained(out, safe_serialization=True)
    if tied:
        from safetensors import safe_open
        with safe_open(os.path.join(out, "model.safetensors"), "pt") as f:
            assert "lm_head.weight" not in f.keys(), "tied LM head must not be saved"

    # A long-context family: transformers reads the written config as meant.
    scaling = long_context_families.check_written(args.family, out, model) if args.family != fam else None
    if fam in moe_families.CONFIGS:  # every routing parameter reads back; the saved experts are the model's
        scaling = moe_families.check_written(fam, out, model)
    files = sorted(os.listdir(out))
    if fam in PAIR_TIED_HEAD:
        # The saved head still has its pairs (bit for bit), and they tie the
        # logits exactly: a forward over the corpus's first line.
        from safetensors import safe_open
        with safe_open(os.path.join(out, "model.safetensors"), "pt") as f:
            Ws = f.get_tensor("lm_head.weight")
        assert torch.equal(Ws[1::2], Ws[0::2]), "saved LM head lost its equal row pairs"
        with torch.no_grad():
            ids = torch.tensor([tok.encode(CORPUS_LINES[0]).ids])
            lg = model(input_ids=ids).logits[0]
        assert torch.equal(lg[:, 0::2], lg[:, 1::2]), "logit pairs do not tie exactly"
        assert all(int(i) % 2 == 0 for i in lg.argmax(-1)), "argmax picked an odd id"
    print(json.dumps({
        "out": out,
        "family": args.family,
        "lm_head_pair_tied": fam in PAIR_TIED_HEAD,
        "files": files,
        "tokenizer_vocab": n,
        "initializer_range": args.initializer_range,
        "model_sha256": sha256(os.path.join(out, "model.safetensors")),
        "tokenizer_sha256": sha256(os.path.join(out, "tokenizer.json")),
        "config_sha256": sha256(os.path.join(out, "config.json")),
        **({"base_family": fam, "checked": scaling} if scaling is not None else {}),
    }))


if __name__ == "__main__":
    sys.exit(main())
