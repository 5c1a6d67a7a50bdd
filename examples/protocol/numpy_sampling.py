"""numpy-ref's sampling: greedy argmax (the lowest index of a tie, NaN never
wins) and seeded random sampling with temperature, top-k and top-p in HF's
order (numpy_engine.py's docstring has the rules), and the request's
`sampling` field parsed.
"""
import math

import numpy as np

from protocol_v1 import EngineError

F32 = np.float32


def argmax(row):
    """The lowest index of the maximum (NaN never wins)."""
    r = np.where(np.isnan(row), -np.inf, row)
    return int(np.argmax(r))


def sample_distribution(row, temperature, top_k, top_p):
    """(order, probs): the tokens a draw chooses from, in descending logit
    order (ties by index), and their probabilities (float64, sum 1):
    temperature, then top-k, then top-p, renormalised."""
    row = np.asarray(row, dtype=np.float64)
    idx = np.flatnonzero(np.isfinite(row))
    if idx.size == 0:
        return np.array([argmax(row)]), np.array([1.0])
    idx = idx[np.lexsort((idx, -row[idx]))]  # descending logit, ties by lower index
    if top_k is not None:
        idx = idx[:max(int(top_k), 1)]
    z = (row[idx] - row[idx[0]]) / float(temperature)
    pr = np.exp(z)
    pr /= pr.sum()
    if top_p is not None:
        c = np.cumsum(pr)
        hit = np.flatnonzero(c >= float(top_p))
        keep = int(hit[0]) + 1 if hit.size else pr.size
        idx, pr = idx[:keep], pr[:keep]
        pr = pr / pr.sum()
    return idx, pr


def parse_sampling(s):
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
    if p is not None and (not isinstance(p, (int, float)) or isinstance(p, bool) or not 0.0 <= p <= 1.0):
        raise EngineError(f"sampling.top_p must be a number in [0, 1] or null, not {p!r}")
    # HF's switches: top_k 0 and top_p 1.0 turn that filter off.
    return {"temperature": float(t), "top_k": k if k else None,
            "top_p": None if p is None or p >= 1.0 else float(p)}


class Sampler:
    def __init__(self, sampling, seed, vocab):
        self.sampling = sampling
        self.vocab = vocab
        self.rng = np.random.default_rng(seed)

    def __call__(self, row):
        """(token, sample_probs [1,V] float32 or None for greedy)."""
        s = self.sampling
        if s is None:
            return argmax(row), None
        u = self.rng.random()  # one draw per step, taken first
        dist = np.zeros((1, self.vocab), dtype=F32)
        if s["temperature"] <= 0.0:
            tok = argmax(row)
            dist[0, tok] = 1.0
            return tok, dist
        idx, pr = sample_distribution(row, s["temperature"], s["top_k"], s["top_p"])
        dist[0, idx] = pr.astype(F32)
        c = np.cumsum(pr)
        n = int(np.searchsorted(c, u, side="right"))
        tok = int(idx[min(n, idx.size - 1)])
        return tok, dist
