#!/usr/bin/env python3
"""A random-weights model at the shape of Qwen2.5-0.5B, float32, for ci/bench.sh.

usage: make_bench_model.py OUT_DIR

Writes an HF folder (config.json, model.safetensors, a tokenizer) and
OUT_DIR/bench-model.json (parameter count, f32 bytes, the seed and the sha256
of this script, which ci/bench.sh compares to decide whether a cached model is
still the one this script makes). The GGUF is made from the folder by
goldens/recorders/convert_gguf.py, llama.cpp's own converter.

Shape and settings as Qwen2.5-0.5B's config.json: hidden 896, 24 layers, 14
heads / 2 KV heads (head_dim 64), FFN 4864, vocab 151936, tied embeddings,
QKV biases, RoPE theta 1e6, RMSNorm eps 1e-6, 32768 positions, no sliding
window in use. 494,032,768 parameters: 1.98 GB in f32.

Weights: transformers' own initialisation (normal, std initializer_range
0.02, Qwen2.5's value) from torch.manual_seed(0); biases and norm weights,
which HF initialises to 0 and 1, get small seeded noise like the tiny models'
(make_model.py), so no engine can skip them as no-ops. Activations stay
finite and the logits are not flat (both checked here on a short prompt).

Tokenizer: not needed to run (every peer is fed token ids), but llama.cpp's
converter writes a vocabulary into the GGUF. It is the tiny qwen2 model's
byte-level BPE (make_model.py's, 512 entries, Qwen2's pre-tokenizer); the
converter pads the GGUF vocabulary to the config's 151936 with [PAD] entries.
"""
import hashlib
import json
import os
import sys

sys.dont_write_bytecode = True
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from common import RECORDERS  # noqa: E402

sys.path.insert(0, RECORDERS)

SEED = 0
BIAS_NORM_SEED = 1
CONFIG = dict(
    vocab_size=151936,
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    hidden_act="silu",
    max_position_embeddings=32768,
    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    use_sliding_window=False,
    sliding_window=32768,
    max_window_layers=21,
    initializer_range=0.02,
    bos_token_id=151643,
    eos_token_id=151643,
    dtype="float32",
)
PARAMS = 494_032_768


def script_sha256():
    with open(os.path.abspath(__file__), "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def main():
    if len(sys.argv) != 2 or sys.argv[1].startswith("-"):
        sys.exit(__doc__.split("\n\n")[1])
    out = os.path.abspath(sys.argv[1])
    import torch
    import transformers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    import make_model as tiny  # goldens/recorders/make_model.py

    os.makedirs(out, exist_ok=True)
    transformers.utils.logging.disable_progress_bar()
    tok = tiny.build_tokenizer(tiny.QWEN2_PRETOKENIZE_REGEX, tiny.SPECIALS)
    eos = tiny.SPECIALS[0]
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos, pad_token=eos, bos_token=None,
                            unk_token=None, model_max_length=CONFIG["max_position_embeddings"]).save_pretrained(out)

    torch.manual_seed(SEED)
    model = Qwen2ForCausalLM(Qwen2Config(**CONFIG)).to(torch.float32).eval()
    g = torch.Generator().manual_seed(BIAS_NORM_SEED)
    with torch.no_grad():
        for name, p in model.named_parameters():  # fixed module order
            if name.endswith(".bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
            elif "norm" in name:
                p.copy_(1.0 + torch.randn(p.shape, generator=g) * 0.02)
    n_params = sum(p.numel() for p in model.parameters())  # the tied matrix once
    assert n_params == PARAMS, f"{n_params} parameters, Qwen2.5-0.5B has {PARAMS}"
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr(), "LM head not tied"
    assert model.model.layers[0].self_attn.q_proj.bias is not None, "no QKV bias"
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([[17, 7936, 15855, 23774]])).logits[0, -1]
    assert torch.isfinite(logits).all(), "non-finite logits"
    top2 = logits.topk(2).values
    print(f"make_bench_model.py: logits std {logits.std():.3f}, top-2 gap {float(top2[0] - top2[1]):.4f}", file=sys.stderr)
    model.save_pretrained(out, safe_serialization=True)
    info = {"params": n_params, "weight_bytes_f32": 4 * n_params, "seed": SEED, "bias_norm_seed": BIAS_NORM_SEED,
            "config": CONFIG, "script_sha256": script_sha256(),
            "versions": {"torch": torch.__version__, "transformers": transformers.__version__}}
    with open(os.path.join(out, "bench-model.json"), "w") as f:
        json.dump(info, f, indent=1, sort_keys=True)
    print(json.dumps(info, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
