#!/usr/bin/env python3
"""HF transformers, the peer of `touchstone bench engine`: the same HF model
folder, float32, the same token ids and the same JSON lines.

usage: peer_hf.py MODEL_DIR --tokens IDS --decode N --threads T [--reps R] [--warmup W]

torch.set_num_threads(T); under torch.inference_mode() (no autograd at
all). Per repetition: one forward of the prompt with a fresh KV cache
(DynamicCache) and logits_to_keep=1 (the last row, as generate() asks for
and as llama.cpp and touchstone compute), its argmax, then N single-token
forwards with the cache, each followed by its argmax. Attention is
transformers' default implementation (recorded). One untimed warm-up
(prefill + 1 step) first.
"""
import os
import sys
import time

sys.dont_write_bytecode = True
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from common import emit, engine_peer_args, engine_peer_parser, median, model_file_bytes, peak_rss_bytes, timed_reps  # noqa: E402,E501


def main():
    args, tokens = engine_peer_args(engine_peer_parser(__doc__, "model_dir", "the HF model folder"))

    import torch
    import transformers
    from transformers import AutoModelForCausalLM, DynamicCache

    torch.set_num_threads(args.threads)
    transformers.utils.logging.disable_progress_bar()
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32).eval()
    load_s = time.perf_counter() - t0
    vocab = model.config.vocab_size
    if max(tokens) >= vocab:
        sys.exit(f"peer_hf.py: token id {max(tokens)} is outside the vocabulary of {vocab}")
    n_prompt = len(tokens)
    ids = torch.tensor([tokens], dtype=torch.long)

    def generate(n_decode):
        """(prefill seconds, decode seconds, generated ids) from an empty cache."""
        cache = DynamicCache(config=model.config)
        t = time.perf_counter()
        out = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        nxt = out.logits[0, -1].argmax()
        gen = [int(nxt)]
        prefill_s = time.perf_counter() - t
        t = time.perf_counter()
        for _ in range(n_decode):
            out = model(input_ids=nxt.view(1, 1), past_key_values=out.past_key_values, use_cache=True,
                        logits_to_keep=1)
            nxt = out.logits[0, -1].argmax()
            gen.append(int(nxt))
        return prefill_s, time.perf_counter() - t, gen

    with torch.inference_mode():
        pre, dec, generated = timed_reps("hf", generate, n_prompt, args)
    peak = peak_rss_bytes()
    size = model_file_bytes(args.model_dir)
    emit({"bench": "engine", "engine": "hf", "summary": True, "model": args.model_dir, "threads": args.threads,
          "reps": args.reps, "warmup": args.warmup, "prompt_tokens": n_prompt, "decode_steps": args.decode,
          "prompt": tokens, "generated": generated, "load_s": load_s, "peak_rss_bytes": peak, "model_bytes": size,
          "rss_over_model": peak / size if peak and size else None,
          "n_params": sum(p.numel() for p in model.parameters()),
          "prefill_tok_s_median": median(pre), "decode_tok_s_median": median(dec),
          "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
          "settings": {"dtype": "float32", "attn_implementation": model.config._attn_implementation,
                       "torch_threads": torch.get_num_threads(), "logits_to_keep": 1,
                       "cpu_capability": torch.backends.cpu.get_cpu_capability()}},
         f"hf: median prefill {median(pre):.2f} tok/s, decode {median(dec):.2f} tok/s; load {load_s:.2f} s; "
         f"peak RSS {peak / 1e9 if peak else float('nan'):.2f} GB; attention {model.config._attn_implementation}, "
         f"torch CPU capability {torch.backends.cpu.get_cpu_capability()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
