#!/usr/bin/env python3
"""numpy-ref: a reference engine for touchstone's subprocess protocol, version 1.

    touchstone run SPEC --engine "exec:python3 examples/protocol/numpy_engine.py"

A decoder-only transformer (Qwen2, Llama, Qwen3, Phi-3) in numpy, float32
arithmetic like HF transformers' eager attention on the CPU. It needs numpy
and the Python standard library only: safetensors files are read and written
here (an 8-byte little-endian header length, a JSON header, then the raw
tensor bytes), and neither `safetensors` nor `torch` is imported.

The protocol as this engine implements it
-----------------------------------------
touchstone starts the command once per spec and keeps it running. Requests
come one JSON object per line on stdin; each gets exactly one JSON object on
one line on stdout, flushed at once. stdout carries nothing else (anything
the program would print goes to stderr, which is the engine's log: touchstone
keeps it and shows it when something fails). Every response has "ok": true,
or "ok": false with "error": a sentence saying what was wrong. A request
that fails leaves the engine running and able to take the next one; a line
that is not a JSON object is answered with ok:false too.

  {"op":"load","protocol":1,"model":"/abs/dir","storage":"f32"}
      -> {"ok":true,"engine":"numpy-ref"}
    model: an HF folder (config.json and model.safetensors, or a sharded
    model.safetensors.index.json with its shards; tokenizer files are not
    read: the protocol speaks token ids). storage: "f32", "f16" or "bf16".
    Refused (ok:false, naming the problem): a protocol other than 1, another
    storage, an architecture other than qwen2/llama/qwen3/phi3, a config field
    this engine does not implement (RoPE scaling of any kind, a
    partial_rotary_factor != 1, an activation other than SiLU, soft-capping,
    mlp_bias, pretraining_tp > 1, scaled embeddings/residuals/logits, a layer
    type other than full attention), a tensor missing from the file, a tensor
    of the wrong shape, or a tensor in the file that no layer uses. A second
    load replaces the first model.

  {"op":"run","prompt":[ids],"decode_steps":N,"sampling":"greedy",
   "seed":S,"forced":null,"taps":["embed","blk.0.q",...],"out":"/abs/f.safetensors"}
      -> {"ok":true}
    sampling: "greedy" (argmax, the lowest index on ties) or
    {"temperature":T,"top_k":K|null,"top_p":P|null}. seed: an integer.
    forced: null, or a list of at least N token ids. Runs the prompt as one
    prefill step (positions 0..T-1), then N one-token decode steps using a KV
    cache; decode step n is fed forced[n-1] when forced is given, else the
    token sampled after the step before. Writes `out`, a safetensors file with
      <step>/<stage>  float32, canonical layout, for every step (prefill,
                      decode1, ..., decodeN) and every tapped stage
      tokens          int64 [1+N], the token sampled after each step (from
                      the last row of that step's logits; sampled even where
                      the next step is fed a forced token)
    and its __metadata__ {"format":"touchstone-engine-out/1","engine":...}.
    Only tapped stages are written. An unknown stage name, or a layer the
    model does not have, is an error; q_norm/k_norm tapped on a model other
    than Qwen3 (which alone has them) are skipped, not written. The
    file is written to out + ".tmp" and renamed into place, so a failed run
    never leaves a half-written file at `out`.

  {"op":"shutdown"} -> {"ok":true}, then exit 0. End of stdin: exit 0 too.

Canonical stages (T tokens in the step, S KV positions after it, H heads, KV
kv heads, D head dim, E hidden, F FFN width, V vocab; row-major, no batch
dim): embed [T,E]; blk.{i}.attn_norm [T,E]; blk.{i}.q [T,H,D], .k/.v
[T,KV,D] (bias included, before RoPE; Phi-3: the pieces of qkv_proj's
output, q then k then v); blk.{i}.q_norm/.k_norm (Qwen3 only, per-head
RMSNorm, before RoPE); blk.{i}.q_rope [T,H,D], .k_rope [T,KV,D];
blk.{i}.attn_scores [H,T,S] (q_rope.k_rope^T / sqrt(D), the softmax input,
causally masked entries exactly 0); blk.{i}.attn_probs [H,T,S] (masked
entries exactly 0); blk.{i}.attn_ctx [T,H*D]; blk.{i}.attn_out [T,E];
blk.{i}.ffn_inp [T,E]; blk.{i}.ffn_norm [T,E]; blk.{i}.ffn_gate/.ffn_up
[T,F] (Phi-3: the halves of gate_up_proj's output, gate first);
blk.{i}.ffn_act [T,F]; blk.{i}.ffn_out [T,E]; blk.{i}.out [T,E];
output_norm [T,E]; logits [T,V]; sample_probs [1,V].

sample_probs exists only with random sampling (with greedy sampling it is
not written even when tapped, and the log says so): the distribution the
step's token is drawn from, i.e. the softmax of the last row's logits / T
after top-k (keep the k largest, ties broken by the lower index) and then
top-p (keep the smallest prefix, in descending order, whose mass reaches p,
renormalised); 0 for removed tokens. This is HF's TemperatureLogitsWarper ->
TopKLogitsWarper -> TopPLogitsWarper order. A temperature <= 0 is greedy
(sample_probs one-hot at the argmax). The probabilities are computed in
float64 and stored as float32. The draw: numpy's default_rng(seed), one
uniform u = rng.random() per step taken before anything else, then the first
token (in descending order) at which the running mass exceeds u. Same seed,
same tokens; another seed, other tokens.

Arithmetic (float32 throughout, as HF's eager forward): RMSNorm is
w * (x * 1/sqrt(mean(x^2) + eps)); RoPE is neox style (rotate halves) with
inv_freq = 1/theta^(2j/D) and angle = position * inv_freq in float32 and
cos/sin of that float32 angle correctly rounded; scores are (q.k^T) times
the float32 scale D^-0.5; softmax subtracts the row max and multiplies by
1/sum; query head h reads KV head h // (H/KV); silu(g) = g / (1 + exp(-g)).

Storage "f16"/"bf16" emulates an engine that holds weights and stage outputs
in that type and computes in float32, with touchstone's CPU engine's
rounding points: every weight is rounded once at load (round to nearest
even, kept as float32), and every stage output right after it is computed:
norms, projections (the GEMM output, and again after a bias add), q_norm /
k_norm, RoPE, the attention context, silu*up, both residual adds and the
logits. attn_scores and attn_probs stay float32 (not rounded). The KV cache
therefore holds the rounded k_rope and v, and sampling reads the rounded
logits. With "f32" nothing is rounded.

Options: --threads N sets the BLAS thread count (default 1: results then do
not depend on the machine's core count). For tests: --bug rope-decode
leaves RoPE out of every decode step (the prefill is right), the planted bug
numpy_engine_rope_bug.py runs.

Modules beside it: protocol_v1.py (the JSON-lines loop every Python engine
of this repository serves with), safetensors_np.py (the file format by
hand), numpy_model.py (the model and its arithmetic), numpy_sampling.py.
"""
import os
import sys


def _threads_from_argv(argv):
    for i, a in enumerate(argv):
        if a == "--threads" and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith("--threads="):
            return a.split("=", 1)[1]
    return "1"


# BLAS reads these when numpy is first imported.
_THREADS = _threads_from_argv(sys.argv[1:])
for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, _THREADS)

import argparse  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

sys.dont_write_bytecode = True  # leave no __pycache__ beside the examples
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from numpy_model import STORAGE, Model, stage_names  # noqa: E402
from numpy_sampling import Sampler, parse_sampling  # noqa: E402
from protocol_v1 import PROTOCOL, Dispatcher, EngineError, int_list, logger, serve as serve_lines  # noqa: E402
from safetensors_np import write_safetensors  # noqa: E402

ENGINE = "numpy-ref"
F32 = np.float32


class Engine(Dispatcher):
    name = ENGINE
    ops = ("load", "run", "shutdown")
    rope_in_decode = True  # the planted bug (numpy_engine_rope_bug.py) turns this off

    def __init__(self, log):
        self.log = log
        self.model = None

    def load(self, req):
        proto = req.get("protocol")
        if proto != PROTOCOL:
            raise EngineError(f"unsupported protocol version {proto!r}: this engine speaks protocol {PROTOCOL}")
        storage = req.get("storage", "f32")
        if storage not in STORAGE:
            raise EngineError(f"unsupported storage {storage!r}: this engine supports f32, f16 and bf16")
        folder = req.get("model")
        if not isinstance(folder, str) or not folder:
            raise EngineError("load needs `model`, the path of an HF model folder")
        if not os.path.isdir(folder):
            raise EngineError(f"model {folder!r} is not a folder (this engine reads HF folders: "
                              "config.json + model.safetensors)")
        t0 = time.monotonic()
        self.model = None
        m = Model(folder, storage)
        self.model = m
        self.log(f"loaded {folder}: {m.type}, {m.L} layers, E {m.E}, H {m.H}, KV {m.KV}, D {m.D}, "
                 f"F {m.F}, V {m.V}, theta {m.theta:g}, storage {storage} ({time.monotonic() - t0:.2f}s)")
        return {"ok": True, "engine": self.name}

    def run(self, req):
        m = self.model
        if m is None:
            raise EngineError("run before load: send a load request first")
        prompt = int_list(req.get("prompt"), "prompt")
        if not prompt:
            raise EngineError("prompt is empty")
        n = req.get("decode_steps", 0)
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise EngineError(f"decode_steps must be a non-negative integer, not {n!r}")
        sampling = parse_sampling(req.get("sampling", "greedy"))
        seed = req.get("seed", 0)
        if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
            raise EngineError(f"seed must be a non-negative integer, not {seed!r}")
        forced = req.get("forced")
        if forced is not None:
            forced = int_list(forced, "forced")
            if len(forced) < n:
                raise EngineError(f"forced has {len(forced)} token(s) for {n} decode step(s)")
        for t in prompt + (forced or [])[:n]:
            if not 0 <= t < m.V:
                raise EngineError(f"token id {t} is outside the vocabulary (0..{m.V - 1})")
        total = len(prompt) + n
        if total > m.max_pos:
            raise EngineError(f"prompt + decode steps = {total} positions, more than the model's "
                              f"max_position_embeddings {m.max_pos}")
        taps = req.get("taps") or []
        if not isinstance(taps, list) or not all(isinstance(s, str) for s in taps):
            raise EngineError("taps must be a list of stage names")
        known = set(stage_names(m.type, m.L))
        # q_norm/k_norm are canonical stages that only Qwen3 has: tapped on
        # another architecture they are skipped (not written), like
        # sample_probs under greedy sampling. Any other name is an error.
        absent = set(stage_names("qwen3", m.L)) - known
        bad = [s for s in taps if s not in known and s not in absent]
        if bad:
            raise EngineError(f"unknown stage(s) for a {m.L}-layer {m.type} model: {', '.join(bad[:5])}")
        skipped = sorted(set(taps) & absent)
        if skipped:
            self.log(f"{', '.join(skipped)}: tapped, but a {m.type} model has no such stage: not written")
        taps = set(taps) - absent
        out = req.get("out")
        if not isinstance(out, str) or not out:
            raise EngineError("run needs `out`, the path of the safetensors file to write")
        if "sample_probs" in taps and sampling is None:
            self.log("sample_probs is tapped but sampling is greedy: no sample_probs is written")

        t0 = time.monotonic()
        cache = [[np.zeros((0, m.KV, m.D), F32), np.zeros((0, m.KV, m.D), F32)] for _ in range(m.L)]
        sampler = Sampler(sampling, seed, m.V)
        tensors, tokens = {}, []
        feed, pos = list(prompt), 0
        for si in range(n + 1):
            step = "prefill" if si == 0 else f"decode{si}"

            def put(stage, a, step=step):
                tensors[f"{step}/{stage}"] = np.array(a, dtype=F32, copy=True)
            with np.errstate(divide="ignore", invalid="ignore"):
                row = m.forward(feed, pos, cache, taps, put, rope_on=si == 0 or self.rope_in_decode)
            tok, dist = sampler(row)
            if dist is not None and "sample_probs" in taps:
                put("sample_probs", dist)
            tokens.append(tok)
            pos += len(feed)
            if si < n:
                feed = [forced[si] if forced is not None else tok]
        tensors["tokens"] = np.array(tokens, dtype=np.int64)
        write_safetensors(out, tensors, {"format": "touchstone-engine-out/1", "engine": self.name})
        self.log(f"run: {len(prompt)} prompt token(s), {n} decode step(s), "
                 f"{'greedy' if sampling is None else sampling}, seed {seed}, "
                 f"{'forced' if forced is not None else 'free'}, {len(taps)} tap(s) -> tokens {tokens} "
                 f"({time.monotonic() - t0:.2f}s, {out})")
        return {"ok": True}


def serve(engine_cls, argv=None):
    ap = argparse.ArgumentParser(description="numpy reference engine for touchstone's subprocess "
                                             "protocol (JSON lines on stdin/stdout; see the module docstring)")
    ap.add_argument("--threads", default="1", help="BLAS threads (default 1)")
    ap.add_argument("--bug", choices=["rope-decode"], help="plant a bug (for tests)")
    args = ap.parse_args(argv)
    log = logger(engine_cls.name)
    engine = engine_cls(log)
    if args.bug == "rope-decode":
        engine.rope_in_decode = False
        engine.name += "+rope-decode-bug"
    log(f"protocol {PROTOCOL}, numpy {np.__version__}, pid {os.getpid()}; waiting for requests on stdin")
    # The protocol owns the real stdout; anything else printed goes to the log.
    return serve_lines(engine, log)


if __name__ == "__main__":
    sys.exit(serve(Engine))
