#!/usr/bin/env python3
"""llama.cpp, the peer of `touchstone bench engine`: libllama through the
pinned llama-cpp-python sdist's ctypes bindings (as the recorders load them:
llamacpp_lib.py), on a GGUF, with the same token ids and the same JSON lines.

usage: peer_llamacpp.py GGUF --tokens IDS --decode N --threads T
                        [--reps R] [--warmup W] [--lib-dir DIR]

Per repetition: clear the KV cache, decode the prompt as ONE batch with
logits for the last token only (llama.cpp's default, and what touchstone's
untapped run computes), pick the argmax, then N single-token decode steps
each followed by its argmax. Prefill time covers the batch and its argmax;
decode time the N steps. One untimed warm-up (prefill + 1 step) first.

Settings are llama.cpp's defaults (its best on this machine) except what the
comparison fixes: n_threads = n_threads_batch = T, CPU only, a context of
prompt + decode positions, n_batch = n_ubatch = the prompt length (one
physical batch). mmap stays on (the default): load time is the mapping and
RSS counts the file pages the run touched. --lib-dir picks the build
(default: build_llamacpp.py --native, the benchmark's; the goldens'
portable build is in build-X.Y.Z/bin); llama_print_system_info() is
reported so the output says which CPU features the build used.
"""
import ctypes
import os
import sys
import time

import numpy as np

sys.dont_write_bytecode = True
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from common import (  # noqa: E402
    RECORDERS, emit, engine_peer_args, engine_peer_parser, median, model_file_bytes, peak_rss_bytes, timed_reps)

sys.path.insert(0, RECORDERS)
import build_llamacpp  # noqa: E402
from llamacpp_lib import load_bindings  # noqa: E402


def main():
    ap = engine_peer_parser(__doc__, "gguf", "the F32 GGUF")
    ap.add_argument("--lib-dir", default=None, help="folder with libllama.so (default: the --native build)")
    args, tokens = engine_peer_args(ap)

    cache = build_llamacpp.DEFAULT_CACHE
    if args.lib_dir is None:
        found = build_llamacpp.find_built(cache, native=True)
        if not found:
            sys.exit("peer_llamacpp.py: no native libllama; build it with "
                     "`goldens/recorders/build_llamacpp.py --native`")
        args.lib_dir = found[0]
    lc, _ggml = load_bindings(build_llamacpp.source_dir(cache), args.lib_dir)

    quiet = lc.llama_log_callback(lambda level, text, ud: None)
    lc.llama_log_set(quiet, None)
    t0 = time.perf_counter()
    lc.llama_backend_init()
    mparams = lc.llama_model_default_params()
    mparams.n_gpu_layers = 0
    model = lc.llama_model_load_from_file(args.gguf.encode(), mparams)
    if not model:
        sys.exit(f"peer_llamacpp.py: libllama could not load {args.gguf}")
    n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(model))
    if max(tokens) >= n_vocab:
        sys.exit(f"peer_llamacpp.py: token id {max(tokens)} is outside the vocabulary of {n_vocab}")
    n_prompt = len(tokens)
    cparams = lc.llama_context_default_params()
    cparams.n_ctx = n_prompt + args.decode
    cparams.n_batch = n_prompt
    cparams.n_ubatch = n_prompt
    cparams.n_seq_max = 1
    cparams.n_threads = args.threads
    cparams.n_threads_batch = args.threads
    ctx = lc.llama_init_from_model(model, cparams)
    if not ctx:
        sys.exit("peer_llamacpp.py: context init failed")
    load_s = time.perf_counter() - t0
    mem = lc.llama_get_memory(ctx)
    batch = lc.llama_batch_init(n_prompt, 0, 1)

    def step(ids, pos0):
        """Decode `ids` at pos0.. with logits for the last one; its argmax."""
        batch.n_tokens = len(ids)
        for i, t in enumerate(ids):
            batch.token[i] = t
            batch.pos[i] = pos0 + i
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = 0
            batch.logits[i] = int(i == len(ids) - 1)
        rc = lc.llama_decode(ctx, batch)
        if rc != 0:
            sys.exit(f"peer_llamacpp.py: llama_decode returned {rc}")
        logits = np.ctypeslib.as_array(lc.llama_get_logits_ith(ctx, -1), shape=(n_vocab,))
        return int(logits.argmax())

    def generate(n_decode):
        """(prefill seconds, decode seconds, generated ids) from an empty cache."""
        lc.llama_memory_clear(mem, True)
        t = time.perf_counter()
        out = [step(tokens, 0)]
        prefill_s = time.perf_counter() - t
        t = time.perf_counter()
        for i in range(n_decode):
            out.append(step([out[-1]], n_prompt + i))
        return prefill_s, time.perf_counter() - t, out

    try:
        pre, dec, generated = timed_reps("llama.cpp", generate, n_prompt, args)
        system_info = lc.llama_print_system_info().decode().strip()
        n_params = lc.llama_model_n_params(model)
    finally:
        lc.llama_batch_free(batch)
        lc.llama_free(ctx)
        lc.llama_model_free(model)
    peak = peak_rss_bytes()
    size = model_file_bytes(args.gguf)
    stamp = os.path.join(os.path.dirname(args.lib_dir.rstrip("/")), "touchstone-build.json")
    build = {}
    if os.path.isfile(stamp):
        import json
        with open(stamp) as f:
            build = {k: v for k, v in json.load(f).items() if k in ("flags", "llama_cpp_commit", "compiler")}
    emit({"bench": "engine", "engine": "llama.cpp", "summary": True, "model": args.gguf, "threads": args.threads,
          "reps": args.reps, "warmup": args.warmup, "prompt_tokens": n_prompt, "decode_steps": args.decode,
          "prompt": tokens, "generated": generated, "load_s": load_s, "peak_rss_bytes": peak, "model_bytes": size,
          "rss_over_model": peak / size if peak and size else None, "n_params": n_params,
          "prefill_tok_s_median": median(pre), "decode_tok_s_median": median(dec),
          "lib_dir": args.lib_dir, "build": build, "system_info": system_info,
          "settings": {"n_ctx": n_prompt + args.decode, "n_batch": n_prompt, "n_ubatch": n_prompt,
                       "flash_attn": "llama.cpp default (auto)", "kv_cache": "llama.cpp default (f16)",
                       "mmap": True, "logits": "last token of each step"}},
         f"llama.cpp: median prefill {median(pre):.2f} tok/s, decode {median(dec):.2f} tok/s; load {load_s:.2f} s; "
         f"peak RSS {peak / 1e9 if peak else float('nan'):.2f} GB; {system_info}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
