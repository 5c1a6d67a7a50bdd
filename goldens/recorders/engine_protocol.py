"""What the third-party engines under test share: touchstone's subprocess
protocol, version 1 (docs/testing-your-engine.md), served on stdin/stdout by
examples/protocol/protocol_v1.py's loop, the one the reference numpy engines
serve with too.

engine_hf.py (HF transformers) and engine_llamacpp.py (libllama) are
engines under test built from the golden recorders: they import the
recorders' hooks (record_hf.Recorder) and node map (record_llamacpp.NODE_MAP)
so that an engine's captures are exactly what the goldens call a stage. Each
subclasses `Engine` below with `load_model` and `forward_run`; this module
parses and checks the requests (the same refusals for both) and writes the
run file; protocol_v1.serve keeps the protocol's stdout clean (the real
stdout is kept for protocol lines only; fd 1 and sys.stdout point at stderr,
so anything a library prints from Python or from C -- libllama, ggml, torch
-- lands in the log), answers a refused request with {"ok": false, "error":
...} and a bug with an internal error, and keeps serving.
"""
import json
import math
import os
import sys
import time

import numpy as np

# The protocol loop shared with the reference engines of examples/protocol/.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                "examples", "protocol"))
from protocol_v1 import (OUT_FORMAT, PROTOCOL, Dispatcher, EngineError, int_list, logger,  # noqa: E402,F401
                         serve)


def parse_sampling(s):
    """None for greedy, else {temperature, top_k (None: off), top_p (None:
    off)}; HF's switches: top_k 0 and top_p 1.0 turn a filter off, and a
    temperature <= 0 is greedy."""
    if s == "greedy" or s is None:
        return None
    if not isinstance(s, dict):
        raise EngineError(f'sampling must be "greedy" or {{"temperature":T,"top_k":K|null,"top_p":P|null}}, '
                          f"not {s!r}")
    extra = set(s) - {"temperature", "top_k", "top_p"}
    if extra:
        raise EngineError(f"sampling has unknown field(s) {sorted(extra)}")
    t = s.get("temperature", 1.0)
    k = s.get("top_k")
    p = s.get("top_p")
    if not isinstance(t, (int, float)) or isinstance(t, bool) or not math.isfinite(t):
        raise EngineError(f"sampling.temperature must be a finite number, not {t!r}")
    if k is not None and (not isinstance(k, int) or isinstance(k, bool) or k < 0):
        raise EngineError(f"sampling.top_k must be a non-negative integer or null, not {k!r}")
    if p is not None and (not isinstance(p, (int, float)) or isinstance(p, bool) or not 0.0 < p <= 1.0):
        raise EngineError(f"sampling.top_p must be a number in (0, 1] or null, not {p!r}")
    if t <= 0.0:
        return None
    return {"temperature": float(t), "top_k": k if k else None,
            "top_p": None if p is None or p >= 1.0 else float(p)}


class Run:
    """One checked `run` request."""

    def __init__(self, req, vocab, known, absent):
        """`known`: every stage of the model (sample_probs included);
        `absent`: canonical stages this architecture does not have (tapped,
        they are skipped, as the protocol allows)."""
        prompt = int_list(req.get("prompt"), "prompt")
        if not prompt:
            raise EngineError("prompt is empty (a prefill needs at least one token)")
        n = req.get("decode_steps", 0)
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise EngineError(f"decode_steps must be a non-negative integer, not {n!r}")
        seed = req.get("seed", 0)
        if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2 ** 64:
            raise EngineError(f"seed must be an integer in [0, 2^64), not {seed!r}")
        forced = req.get("forced")
        if forced is not None:
            forced = int_list(forced, "forced")
            if len(forced) < n:
                raise EngineError(f"forced has {len(forced)} token(s) for {n} decode step(s)")
        for t in prompt + (forced or [])[:n]:
            if not 0 <= t < vocab:
                raise EngineError(f"token id {t} is outside the vocabulary (0..{vocab - 1})")
        taps = req.get("taps") or []
        if not isinstance(taps, list) or not all(isinstance(s, str) for s in taps):
            raise EngineError("taps must be a list of stage names")
        bad = [s for s in taps if s not in known and s not in absent]
        if bad:
            raise EngineError(f"unknown stage(s) for this model: {', '.join(bad[:5])}")
        out = req.get("out")
        if not isinstance(out, str) or not out:
            raise EngineError("run needs `out`, the path of the safetensors file to write")
        self.prompt, self.decode_steps, self.seed, self.forced, self.out = prompt, n, seed, forced, out
        self.sampling = parse_sampling(req.get("sampling", "greedy"))
        self.skipped = sorted(set(taps) & set(absent))
        self.taps = set(taps) - set(absent)
        if self.sampling is None:
            # sample_probs exists only under random sampling.
            self.taps.discard("sample_probs")

    def feed(self, si, sampled):
        """The token decode step si + 1 is fed: the forced one, or the one
        sampled after step si."""
        return self.forced[si] if self.forced is not None else sampled


def write_run(path, tensors, tokens, engine):
    """The run file: `<step>/<stage>` float32 tensors and `tokens` int64."""
    from safetensors.numpy import save_file
    out = {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in tensors.items()}
    out["tokens"] = np.array(tokens, dtype=np.int64)
    tmp = path + ".tmp"
    save_file(out, tmp, metadata={"format": OUT_FORMAT, "engine": engine})
    os.replace(tmp, path)


class Engine(Dispatcher):
    """A protocol engine: subclasses set `name` and implement
    `load_model(req, storage) -> answer dict`, `run_checked(Run) -> (tensors,
    tokens)`, `vocab`, `known_stages`, `absent_stages`, and optionally
    `tokenize(text, chat)`."""

    name = "engine"
    ops = ("load", "run", "tokenize", "shutdown")

    def __init__(self, log):
        self.log = log
        self.loaded = False

    def load(self, req):
        proto = req.get("protocol")
        if proto != PROTOCOL:
            raise EngineError(f"unsupported protocol version {proto!r}: this engine speaks protocol {PROTOCOL}")
        model = req.get("model")
        if not isinstance(model, str) or not model:
            raise EngineError("load needs `model`, the path of the model (an HF folder or a .gguf file)")
        if not os.path.exists(model):
            raise EngineError(f"model {model} does not exist")
        storage = req.get("storage", "f32")
        self.loaded = False
        # A vision-language model (an HF folder whose config has a vision
        # tower): these engines run text decoders only, so they say so once
        # (`"images": false`, touchstone then skips a VLM spec with the
        # reason) instead of failing to load or running the prompt without
        # its image.
        why = vision_model(model)
        if why is not None:
            self.log(f"{model}: {why}; answering images: false")
            return {"ok": True, "engine": self.name, "images": False, "why": why}
        t0 = time.monotonic()
        answer = self.load_model(model, storage)
        self.loaded = True
        self.log(f"loaded {model} ({time.monotonic() - t0:.1f} s): {json.dumps(answer)}")
        return dict({"ok": True, "engine": self.name}, **answer)

    def run(self, req):
        if not self.loaded:
            raise EngineError("run before load: send a load request first")
        r = Run(req, self.vocab, self.known_stages, self.absent_stages)
        if r.skipped:
            self.log(f"{', '.join(r.skipped)}: tapped, but this model has no such stage: not written")
        t0 = time.monotonic()
        tensors, tokens = self.run_checked(r)
        write_run(r.out, tensors, tokens, self.name)
        self.log(f"run: {len(r.prompt)} prompt token(s), {r.decode_steps} decode step(s), "
                 f"{'greedy' if r.sampling is None else r.sampling}, seed {r.seed}, "
                 f"{'forced' if r.forced is not None else 'free'}, {len(r.taps)} tap(s) -> tokens {tokens} "
                 f"({time.monotonic() - t0:.2f} s)")
        return {"ok": True}

    def tokenize_req(self, req):
        if not self.loaded:
            raise EngineError("tokenize before load: send a load request first")
        text = req.get("text")
        if not isinstance(text, str):
            raise EngineError("tokenize needs `text`, a string")
        chat = req.get("chat", False)
        if not isinstance(chat, bool):
            raise EngineError("tokenize's `chat` must be true or false")
        return {"ok": True, "ids": [int(t) for t in self.tokenize(text, chat)]}

    def tokenize(self, text, chat):
        raise EngineError("this engine has no tokenizer")


def vision_model(model):
    """Why `model` is a vision-language model these text engines do not run
    (its config.json has a `vision_config`), or None."""
    cfg = os.path.join(model, "config.json")
    if not os.path.isdir(model) or not os.path.exists(cfg):
        return None
    with open(cfg) as f:
        c = json.load(f)
    if "vision_config" not in c:
        return None
    return (f"{c.get('model_type', 'the model')} is a vision-language model; this engine runs text decoders "
            "only (no vision tower, no image in its run requests)")
