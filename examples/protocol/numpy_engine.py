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
      -> {"ok":true,"engine":"numpy-ref",
          "batches":{"block_size":16,"invariant":false,"poison":false,"max_batch":64}}
         (with --ranks R > 1, also "ranks": R)
    model: an HF folder (config.json and model.safetensors, or a sharded
    model.safetensors.index.json with its shards; tokenizer files are not
    read: the protocol speaks token ids). storage: "f32", "f16" or "bf16".
    Refused (ok:false, naming the problem): a protocol other than 1, another
    storage, an architecture other than qwen2/llama/qwen3/phi3, a config field
    this engine does not implement (RoPE scaling of any kind, a
    partial_rotary_factor != 1, an activation other than SiLU, soft-capping,
    mlp_bias, pretraining_tp > 1, scaled embeddings/residuals/logits, a layer
    type other than full attention), a tensor missing from the file, a tensor
    of the wrong shape, or a tensor in the file that no layer uses; with
    --ranks R, a model whose num_attention_heads, num_key_value_heads or
    intermediate_size is not divisible by R. A second load replaces the
    first model. "batches" declares run_batch (below): block_size 16 (the
    size touchstone tests prefix hits around; this cache is not paged);
    invariant false, because numpy's BLAS may round a row differently when a
    GEMM has another number of rows and a softmax sums over another number
    of keys (a chunk, a prefix hit), so a sequence's numbers may differ in
    the last bits from its plain run's; poison false, because this engine
    keeps no memory between steps that a poison could reveal (every array
    is fresh, nothing is read that was not written), so it has no poison
    hook; max_batch 64.

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

  {"op":"run_batch","seqs":[{"prompt":[ids],"decode_steps":N,"sampling":...,
     "seed":S,"forced":null,"chunks":null|[c1,c2,...],
     "prefix":null|{"from":i,"len":L},"out":"/abs/seq-i.safetensors"}, ...],
   "taps":[...],"poison":null}
      -> {"ok":true,"memory_bytes":B}
    Each sequence is what a `run` request with its prompt, decode_steps,
    sampling, seed and forced computes (its own Sampler and seed), written
    to its own `out` in run's format. The sequences run in index order, each
    cache kept until the batch ends. chunks: the prefill as forward passes
    of those sizes, in order, through the KV cache; the prefill tensors are
    the chunks' rows joined (row stages concatenated; attn_scores/attn_probs
    [H,T,T] with each chunk's [H,Tc,Sc] block at its rows and keys 0..Sc,
    every other entry 0), and the prefill's token is sampled once, from the
    last chunk's last row. prefix: the sequence starts from a copy of the
    first L positions of sequence `from`'s KV cache (every layer's keys after
    RoPE and values) and computes positions L..T-1 only (in `chunks`, which
    then sum to T-L, if given): its prefill tensors cover those rows, row
    stages [T-L,...] and attn_scores/attn_probs [H,T-L,T]. memory_bytes: the
    bytes of the numpy arrays the engine holds after the batch (the model's
    arrays; no cache is kept). Refused, naming the sequence, before anything
    runs: no sequences or more than max_batch, a sequence a `run` would
    refuse (empty prompt, bad ids, forced too short, ...) or without `out`,
    two sequences with one `out`, chunks not positive or not summing to the
    positions the sequence computes, a prefix not from an earlier sequence,
    of fewer than 1 positions, not shorter than its prompt, longer than
    sequence `from`'s prompt, or whose tokens differ from sequence `from`'s,
    an unknown stage, and any poison ("nan"/"huge": no poison hook; another
    value: unknown).

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

Tensor parallelism: --ranks R (default 1) computes as R Megatron-style
tensor-parallel ranks would, and writes per-rank tensors where a sharded
engine holds them. Rank r holds query heads [r*H/R, (r+1)*H/R), KV heads
[r*KV/R, (r+1)*KV/R) (its query heads read exactly these) and FFN columns
[r*F/R, (r+1)*F/R). Per rank: q/k/v (the rows of q_proj/k_proj/v_proj for
its heads, bias included: column-parallel), q_norm/k_norm, RoPE, its own KV
cache, attention and attn_ctx; then o_proj row-parallel: its ctx columns
times its slice of o_proj's input columns, a full-shape partial sum; and
ffn_gate, ffn_up, ffn_act on its columns, then down_proj row-parallel the
same way. The all-reduce adds the partial sums in rank order (float32);
then the o_proj bias, if any, is added once. Everything else (embed, norms,
residual adds, output_norm, logits, sampling) is computed once. Storage
rounding (f16/bf16) where the one-rank engine rounds the same stage, and at
the reduce: each rank's q/k/v (after the GEMM and after the bias add),
q_norm/k_norm, RoPE and attn_ctx outputs, ffn_gate/ffn_up/ffn_act; each
partial sum after its GEMM (before the all-reduce); the running sum after
each add (one add for R = 2), and again after the bias add. With R = 1 the
sum is the GEMM itself and nothing changes. Tensors a rank holds are
written only per rank, never unsuffixed (touchstone joins them):
  <step>/<stage>@rank<r>:axis=<a>:offset=<o>   rank r's slice of the
      canonical tensor along axis a from offset o, every other dim full:
      q, q_norm, q_rope [T,H,D] and k, v, k_norm, k_rope [T,KV,D]: axis 1
      (offset in heads); attn_scores, attn_probs [H,T,S]: axis 0;
      attn_ctx [T,H*D]: axis 1, offset r*(H/R)*D; ffn_gate, ffn_up,
      ffn_act [T,F]: axis 1
  <step>/<stage>@rank<r>:partial   rank r's full-shape partial sum of
      attn_out and ffn_out [T,E]; a bias (if any) is added to rank 0's
      alone, so that the partial sums add up to the stage.

Options: --threads N sets the BLAS thread count (default 1: results then do
not depend on the machine's core count). --ranks R as above. For tests:
--bug rope-decode leaves RoPE out of every decode step (the prefill is
right), the planted bug numpy_engine_rope_bug.py runs; --bug shard-offset
(with --ranks 2 or more) names rank 1's shards with an offset one unit (one
head, one ctx column, one FFN column) less than theirs, so that they
overlap rank 0's; the data is unchanged. Either bug is named in the load
answer's "engine" (numpy-ref+rope-decode-bug, numpy-ref+shard-offset-bug).

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
# What the load answer declares about run_batch. invariant: false, because
# numpy's BLAS may round a row differently when a GEMM has another number of
# rows (a chunk, a batch); poison: false, because no memory outlives a step
# here (every array is fresh), so there is nothing a poison could reveal.
BATCHES = {"block_size": 16, "invariant": False, "poison": False, "max_batch": 64}
POISONS = ("nan", "huge")


class Job:
    """One sequence to run: a `run` request's fields, checked, plus how its
    prefill is served (chunk sizes; a prefix copied from an earlier sequence)."""

    def __init__(self, prompt, n, sampling, seed, forced):
        self.prompt, self.n, self.sampling, self.seed, self.forced = prompt, n, sampling, seed, forced
        self.out = None
        self.chunks = None
        self.prefix = None  # (from, len)

    @property
    def reused(self):
        return 0 if self.prefix is None else self.prefix[1]

    def chunk_sizes(self):
        return self.chunks or [len(self.prompt) - self.reused]


def _is_int(v):
    return isinstance(v, int) and not isinstance(v, bool)


def _is_attention(name):
    """[H, T, S] stages (rows on axis 1), per-rank names included."""
    return name.split("@")[0].endswith((".attn_scores", ".attn_probs"))


def join_chunks(parts):
    """One prefill capture from its chunks' captures ({name: array} each):
    rows concatenated; an attention chunk [H, Tc, Sc] placed at its rows and
    keys 0..Sc of [H, sum Tc, S of the last chunk], every other entry 0 (the
    keys a row cannot see, as the canonical tensor has them)."""
    if len(parts) == 1:
        return parts[0]
    out = {}
    for name in parts[0]:
        pieces = [p[name] for p in parts]
        if _is_attention(name):
            rows = sum(a.shape[1] for a in pieces)
            full = np.zeros((pieces[0].shape[0], rows, pieces[-1].shape[2]), F32)
            r = 0
            for a in pieces:
                full[:, r:r + a.shape[1], :a.shape[2]] = a
                r += a.shape[1]
            out[name] = full
        else:
            out[name] = np.concatenate(pieces, axis=0)
    return out


class Engine(Dispatcher):
    name = ENGINE
    ops = ("load", "run", "run_batch", "shutdown")
    rope_in_decode = True  # the planted bug (numpy_engine_rope_bug.py) turns this off
    ranks = 1  # --ranks R: compute as R tensor-parallel ranks (numpy_model.Model)
    shard_offset_skew = 0  # --bug shard-offset: -1, added to rank 1's shard offsets
    declares_batches = True  # --v1-only: no "batches" in the load answer (an engine before batches)

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
        m = Model(folder, storage, self.ranks)
        self.model = m
        self.log(f"loaded {folder}: {m.type}, {m.L} layers, E {m.E}, H {m.H}, KV {m.KV}, D {m.D}, "
                 f"F {m.F}, V {m.V}, theta {m.theta:g}, storage {storage}"
                 f"{f', {m.ranks} ranks' if m.ranks > 1 else ''} ({time.monotonic() - t0:.2f}s)")
        answer = {"ok": True, "engine": self.name}
        if self.declares_batches:
            answer["batches"] = dict(BATCHES)
        if self.ranks > 1:
            answer["ranks"] = self.ranks
        return answer

    # -- requests ------------------------------------------------------------
    def run(self, req):
        m = self._loaded("run")
        job = self._parse_job(req)
        taps = self._parse_taps(req.get("taps"))
        job.out = self._parse_out(req, "run")
        if "sample_probs" in taps and job.sampling is None:
            self.log("sample_probs is tapped but sampling is greedy: no sample_probs is written")
        t0 = time.monotonic()
        tensors, tokens = self._generate(job, taps, m.new_cache())
        self._write(job.out, tensors, tokens)
        self.log(f"run: {len(job.prompt)} prompt token(s), {job.n} decode step(s), "
                 f"{'greedy' if job.sampling is None else job.sampling}, seed {job.seed}, "
                 f"{'forced' if job.forced is not None else 'free'}, {len(taps)} tap(s) -> tokens {tokens} "
                 f"({time.monotonic() - t0:.2f}s, {job.out})")
        return {"ok": True}

    def run_batch(self, req):
        m = self._loaded("run_batch")
        jobs, taps = self._parse_batch(req)
        t0 = time.monotonic()
        caches = []  # every sequence's cache, kept until the batch ends (prefix hits read them)
        for i, job in enumerate(jobs):
            if job.prefix is None:
                cache = m.new_cache()
            else:
                cache = m.cache_prefix(caches[job.prefix[0]], job.prefix[1])
            tensors, tokens = self._generate(job, taps, cache)
            self._write(job.out, tensors, tokens)
            caches.append(cache)
            how = f", chunks {job.chunks}" if job.chunks else ""
            how += f", prefix {job.prefix[1]} from sequence {job.prefix[0]}" if job.prefix else ""
            self.log(f"run_batch: sequence {i}: {len(job.prompt)} prompt token(s){how}, {job.n} decode "
                     f"step(s) -> tokens {tokens} ({job.out})")
        caches.clear()
        memory = m.nbytes(caches)
        self.log(f"run_batch: {len(jobs)} sequence(s), {len(taps)} tap(s), {memory} bytes held after it "
                 f"({time.monotonic() - t0:.2f}s)")
        return {"ok": True, "memory_bytes": memory}

    # -- checking requests ---------------------------------------------------
    def _loaded(self, op):
        if self.model is None:
            raise EngineError(f"{op} before load: send a load request first")
        return self.model

    def _parse_job(self, req):
        """A run request's prompt, decode_steps, sampling, seed and forced, checked."""
        m = self.model
        prompt = int_list(req.get("prompt"), "prompt")
        if not prompt:
            raise EngineError("prompt is empty")
        n = req.get("decode_steps", 0)
        if not _is_int(n) or n < 0:
            raise EngineError(f"decode_steps must be a non-negative integer, not {n!r}")
        sampling = parse_sampling(req.get("sampling", "greedy"))
        seed = req.get("seed", 0)
        if not _is_int(seed) or seed < 0:
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
        return Job(prompt, n, sampling, seed, forced)

    def _parse_taps(self, taps):
        m = self.model
        taps = taps or []
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
        return set(taps) - absent

    @staticmethod
    def _parse_out(req, op):
        out = req.get("out")
        if not isinstance(out, str) or not out:
            raise EngineError(f"{op} needs `out`, the path of the safetensors file to write")
        return out

    def _parse_batch(self, req):
        """(jobs, taps) of a run_batch request, every sequence checked before
        any runs (so a refused batch writes nothing)."""
        seqs = req.get("seqs")
        if not isinstance(seqs, list):
            raise EngineError("run_batch needs `seqs`, a list of sequence objects")
        if not seqs:
            raise EngineError("the batch has no sequences")
        if len(seqs) > BATCHES["max_batch"]:
            raise EngineError(f"the batch has {len(seqs)} sequences; the engine takes at most "
                              f"{BATCHES['max_batch']}")
        poison = req.get("poison")
        if poison is not None and poison not in POISONS:
            raise EngineError(f"unknown poison {poison!r}: it must be null, \"nan\" or \"huge\"")
        if poison is not None:
            raise EngineError(f"poisoned memory ({poison!r}) was asked for, but the engine declares no "
                              "poison hook (its load answer says \"poison\": false)")
        taps = self._parse_taps(req.get("taps"))
        jobs, outs = [], {}
        for i, seq in enumerate(seqs):
            try:
                jobs.append(self._parse_seq(seq, i, jobs))
            except EngineError as e:
                raise EngineError(f"sequence {i}: {e}") from None
            j = outs.setdefault(jobs[-1].out, i)
            if j != i:
                raise EngineError(f"sequences {j} and {i} have the same out file {jobs[-1].out!r}")
        if "sample_probs" in taps and all(j.sampling is None for j in jobs):
            self.log("sample_probs is tapped but every sequence samples greedily: no sample_probs is written")
        return jobs, taps

    def _parse_seq(self, seq, i, earlier):
        if not isinstance(seq, dict):
            raise EngineError("a sequence must be a JSON object")
        job = self._parse_job(seq)
        job.out = self._parse_out(seq, "a sequence")
        prefix = seq.get("prefix")
        if prefix is not None:
            job.prefix = self._parse_prefix(prefix, job, i, earlier)
        chunks = seq.get("chunks")
        if chunks is not None:
            rest = len(job.prompt) - job.reused
            if (not isinstance(chunks, list) or not chunks or not all(_is_int(c) and c > 0 for c in chunks)
                    or sum(chunks) != rest):
                raise EngineError(f"prefill chunks {chunks!r} must be positive and sum to the {rest} prompt "
                                  "positions it computes")
            job.chunks = list(chunks)
        return job

    @staticmethod
    def _parse_prefix(prefix, job, i, earlier):
        if not isinstance(prefix, dict) or not _is_int(prefix.get("from")) or not _is_int(prefix.get("len")):
            raise EngineError(f"prefix must be null or {{\"from\": i, \"len\": L}} with integers, not {prefix!r}")
        src, n = prefix["from"], prefix["len"]
        if not 0 <= src < i:
            raise EngineError(f"its prefix comes from sequence {src}, which is not an earlier sequence")
        theirs = earlier[src].prompt
        if n < 1 or n >= len(job.prompt) or n > len(theirs):
            raise EngineError(f"a prefix of {n} positions must be at least 1, shorter than its prompt "
                              f"({len(job.prompt)}) and no longer than sequence {src}'s ({len(theirs)})")
        if theirs[:n] != job.prompt[:n]:
            raise EngineError(f"its first {n} prompt tokens differ from sequence {src}'s")
        return (src, n)

    # -- running -------------------------------------------------------------
    def _generate(self, job, taps, cache):
        """(tensors, tokens) of one sequence: its prefill (in chunks, after
        the positions its cache already holds), then its decode steps."""
        m = self.model
        sampler = Sampler(job.sampling, job.seed, m.V)
        tensors, tokens = {}, []
        pos = job.reused
        feeds = []
        for c in job.chunk_sizes():
            feeds.append(job.prompt[pos:pos + c])
            pos += c
        pos = job.reused
        for si in range(job.n + 1):
            step = "prefill" if si == 0 else f"decode{si}"
            parts = []
            for feed in feeds:
                got = {}
                with np.errstate(divide="ignore", invalid="ignore"):
                    row = m.forward(feed, pos, cache, taps, self._putter(got),
                                    rope_on=si == 0 or self.rope_in_decode)
                parts.append(got)
                pos += len(feed)
            got = join_chunks(parts)
            # One token per step: a chunked prefill samples once, from its last row.
            tok, dist = sampler(row)
            if dist is not None and "sample_probs" in taps:
                got["sample_probs"] = np.array(dist, dtype=F32, copy=True)
            tensors.update((f"{step}/{name}", a) for name, a in got.items())
            tokens.append(tok)
            if si < job.n:
                feeds = [[job.forced[si] if job.forced is not None else tok]]
        return tensors, tokens

    def _putter(self, got):
        def put(name, a):
            got[self._misname(name)] = np.array(a, dtype=F32, copy=True)
        return put

    def _misname(self, name):
        """The planted bug --bug shard-offset: rank 1's shards named one unit
        of their axis early, so that they overlap rank 0's."""
        if not self.shard_offset_skew or "@rank1:axis=" not in name:
            return name
        head, off = name.rsplit(":offset=", 1)
        return f"{head}:offset={int(off) + self.shard_offset_skew}"

    def _write(self, out, tensors, tokens):
        tensors["tokens"] = np.array(tokens, dtype=np.int64)
        write_safetensors(out, tensors, {"format": "touchstone-engine-out/1", "engine": self.name})


def serve(engine_cls, argv=None):
    ap = argparse.ArgumentParser(description="numpy reference engine for touchstone's subprocess "
                                             "protocol (JSON lines on stdin/stdout; see the module docstring)")
    ap.add_argument("--threads", default="1", help="BLAS threads (default 1)")
    ap.add_argument("--ranks", type=int, default=1,
                    help="compute as R tensor-parallel ranks, writing per-rank tensors (default 1)")
    ap.add_argument("--bug", choices=["rope-decode", "shard-offset"], help="plant a bug (for tests)")
    ap.add_argument("--v1-only", action="store_true",
                    help="declare nothing beyond protocol 1's run (no \"batches\"): an engine written before "
                         "batches, whose serving checks touchstone reports not applicable")
    args = ap.parse_args(argv)
    if args.ranks < 1:
        ap.error(f"--ranks must be at least 1, not {args.ranks}")
    if args.bug == "shard-offset" and args.ranks < 2:
        ap.error("--bug shard-offset needs --ranks 2 or more (one rank writes no shards)")
    log = logger(engine_cls.name)
    engine = engine_cls(log)
    engine.ranks = args.ranks
    engine.declares_batches = not args.v1_only
    if args.bug == "rope-decode":
        engine.rope_in_decode = False
        engine.name += "+rope-decode-bug"
    if args.bug == "shard-offset":
        engine.shard_offset_skew = -1
        engine.name += "+shard-offset-bug"
    log(f"protocol {PROTOCOL}, numpy {np.__version__}, pid {os.getpid()}; waiting for requests on stdin")
    # The protocol owns the real stdout; anything else printed goes to the log.
    return serve_lines(engine, log)


if __name__ == "__main__":
    sys.exit(serve(Engine))
