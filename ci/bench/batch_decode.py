#!/usr/bin/env python3
"""Batched decode of 8 sequences on the real 0.5B, in one run: touchstone's
CPU engine batched against the same 8 one by one
(`cargo run --release --example batch_decode`), and llama.cpp's batched
decode (one context with n_seq_max = 8, every decode step one llama_batch of
8 tokens, one per sequence: `n_parallel` 8 as llama.cpp's batched example
runs it) against the same 8 one by one in it, then the ratios side by side.

usage: ci/bench/batch_decode.py [--steps N] [--threads T] [--lib-dir DIR] [--model GGUF]

The prompts are the example's: sequence i has 8 + 4i token ids,
(1000 + 37 i + 11 j) mod V. Decode time is (prefill + N greedy steps) minus
the prefills alone, best of 3, for both engines. llama.cpp runs with its
defaults except the threads (T, default: the machine's cores) and a context
holding all 8 sequences; --lib-dir picks the libllama build (default: the
native one of `goldens/recorders/build_llamacpp.py --native`, else the
portable one the goldens were recorded with, and the output says which).
Needs the recorders' environment ($TOUCHSTONE_CACHE/recorders-venv: numpy)
and a libllama build; the model from `python3 ci/fetch_real_model.py`.
Absolute times are noise on a shared machine: the ratios are the claim.
"""
import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

sys.dont_write_bytecode = True
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from common import RECORDERS, ROOT  # noqa: E402

sys.path.insert(0, RECORDERS)
import build_llamacpp  # noqa: E402
from llamacpp_lib import load_bindings  # noqa: E402

SEQS = 8
MODEL = "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"


def prompts(vocab):
    return [[(1000 + 37 * i + 11 * j) % vocab for j in range(8 + 4 * i)] for i in range(SEQS)]


def touchstone(model, steps):
    """The example's JSON line (it prints one last)."""
    cmd = ["cargo", "run", "--release", "--quiet", "--example", "batch_decode", "--", model, str(steps)]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"batch_decode.py: {' '.join(cmd)} failed:\n{out.stderr}{out.stdout}")
    sys.stderr.write(out.stdout)
    return json.loads(out.stdout.strip().splitlines()[-1])


class LlamaCpp:
    def __init__(self, lib_dir, model, threads, n_ctx):
        self.lc, _ = load_bindings(build_llamacpp.source_dir(build_llamacpp.DEFAULT_CACHE), lib_dir)
        lc = self.lc
        self.quiet = lc.llama_log_callback(lambda level, text, ud: None)
        lc.llama_log_set(self.quiet, None)
        lc.llama_backend_init()
        mp = lc.llama_model_default_params()
        mp.n_gpu_layers = 0
        self.model = lc.llama_model_load_from_file(model.encode(), mp)
        if not self.model:
            sys.exit(f"batch_decode.py: libllama could not load {model}")
        self.vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(self.model))
        cp = lc.llama_context_default_params()
        cp.n_ctx = n_ctx
        cp.n_batch = n_ctx
        cp.n_ubatch = n_ctx
        cp.n_seq_max = SEQS
        cp.n_threads = threads
        cp.n_threads_batch = threads
        self.ctx = lc.llama_init_from_model(self.model, cp)
        if not self.ctx:
            sys.exit("batch_decode.py: context init failed")
        self.mem = lc.llama_get_memory(self.ctx)
        self.batch = lc.llama_batch_init(n_ctx, 0, 1)

    def decode(self, entries):
        """entries: (token, pos, seq, wants logits); the argmax of each wanted row, in order."""
        b, lc = self.batch, self.lc
        b.n_tokens = len(entries)
        for i, (t, p, s, w) in enumerate(entries):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = t, p, 1, int(w)
            b.seq_id[i][0] = s
        if lc.llama_decode(self.ctx, b) != 0:
            sys.exit("batch_decode.py: llama_decode failed")
        picks, k = [], 0
        for i, (_, _, _, w) in enumerate(entries):
            if w:
                row = np.ctypeslib.as_array(lc.llama_get_logits_ith(self.ctx, i), shape=(self.vocab,))
                picks.append(int(row.argmax()))
                k += 1
        return picks

    def run(self, ps, steps, together):
        """(seconds, tokens of each sequence): prefills, then `steps` decode steps."""
        self.lc.llama_memory_clear(self.mem, True)
        t = time.perf_counter()
        groups = [list(range(SEQS))] if together else [[i] for i in range(SEQS)]
        out = {}
        for g in groups:
            # Prefill: every sequence of the group in one batch, the last row of each wanted.
            entries = [(tok, j, i, j == len(ps[i]) - 1) for i in g for j, tok in enumerate(ps[i])]
            for i, pick in zip(g, self.decode(entries)):
                out[i] = [pick]
            for n in range(steps):
                entries = [(out[i][-1], len(ps[i]) + n, i, True) for i in g]
                for i, pick in zip(g, self.decode(entries)):
                    out[i].append(pick)
        return time.perf_counter() - t, [out[i] for i in range(SEQS)]

    def best(self, ps, steps, together):
        times = [self.run(ps, steps, together) for _ in range(3)]
        return min(t for t, _ in times), times[-1][1]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--lib-dir", default=None)
    ap.add_argument("--model", default=None)
    args = ap.parse_args()
    cache = os.environ.get("TOUCHSTONE_CACHE", os.path.expanduser("~/.cache/touchstone"))
    model = args.model or os.path.join(cache, "models", MODEL)
    if not os.path.isfile(model):
        sys.exit(f"batch_decode.py: no model at {model} (python3 ci/fetch_real_model.py fetches it)")
    lib = args.lib_dir
    which = "given"
    if lib is None:
        native = build_llamacpp.find_built(build_llamacpp.DEFAULT_CACHE, native=True)
        portable = build_llamacpp.find_built(build_llamacpp.DEFAULT_CACHE, native=False)
        lib, which = (native[0], "native") if native else (portable[0], "portable") if portable else (None, "")
    if lib is None:
        sys.exit("batch_decode.py: no libllama build (goldens/recorders/build_llamacpp.py [--native])")

    ts = touchstone(model, args.steps)
    n_ctx = sum(8 + 4 * i + args.steps for i in range(SEQS))
    ll = LlamaCpp(lib, model, args.threads, n_ctx)
    ps = prompts(ll.vocab)
    pre_b, _ = ll.best(ps, 0, True)
    pre_1, _ = ll.best(ps, 0, False)
    all_b, tok_b = ll.best(ps, args.steps, True)
    all_1, tok_1 = ll.best(ps, args.steps, False)
    n = SEQS * args.steps
    ll_b, ll_1 = n / max(all_b - pre_b, 1e-9), n / max(all_1 - pre_1, 1e-9)
    print(f"llama.cpp ({which} build {lib}, {args.threads} threads): decode batched {ll_b:.1f} tok/s, "
          f"one by one {ll_1:.1f} tok/s; same tokens both ways: {'yes' if tok_b == tok_1 else 'no'}")
    t_b, t_1 = ts["batched_decode_tok_s"], ts["one_by_one_decode_tok_s"]
    print(f"\n{SEQS} sequences x {args.steps} greedy decode steps on {os.path.basename(model)}, one run:")
    print(f"  touchstone cpu   batched / one by one: {t_b / t_1:.2f}x  ({t_b:.1f} vs {t_1:.1f} tok/s)")
    print(f"  llama.cpp        batched / one by one: {ll_b / ll_1:.2f}x  ({ll_b:.1f} vs {ll_1:.1f} tok/s)")
    print(f"  touchstone batched / llama.cpp batched: {t_b / ll_b:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
