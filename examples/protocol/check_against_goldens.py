#!/usr/bin/env python3
"""Self-check of numpy_engine.py against touchstone's committed HF goldens,
through the subprocess protocol (numpy and the standard library only).

usage: check_against_goldens.py [--goldens DIR] [--engine CMD] [--bug-engine CMD]
                                [--only NAME] [--quick] [-v]

For each golden it starts the engine as touchstone would (one process per
golden), sends `load` (the golden's model folder), then `run` with the
golden's prompt (`prefill/tokens`), its decode tokens forced
(`decode{n}/tokens`), every stage the golden holds tapped, and its sampling
(greedy, or the provenance's `sampling` for the sampling golden), then
`shutdown`, and compares every golden tensor with the engine's output:
shape, max|Δ| and the spec's f32 tolerance |a-e| <= 1e-5 + 1.3e-6|e|. Where an
f64 oracle is committed it prints max|engine - oracle| beside HF's own
max|hf - oracle|. Goldens:

  qwen2-tiny, llama-tiny, qwen3-tiny, phi3-tiny   hf.safetensors (all stages)
  qwen2-tiny long                                 long-hf.safetensors (348 tokens)
  qwen2-tiny sampling                             sampling-hf.safetensors (sample_probs)
  qwen2-tiny at f16 and bf16 storage              hf.safetensors, the 16-bit specs'
                                                  tolerances; every stored stage must
                                                  be representable in the dtype

Then run-level checks on qwen2-tiny (determinism of random sampling: 3 runs
of one seed bitwise equal, another seed other tokens; KV cache: the last
decode step's logits against one prefill over the same tokens; free-running
greedy tokens against the golden's), the protocol's refusals (protocol 2,
storage f8, an unknown op, run before load, an unknown stage, a bad JSON
line: all ok:false while the engine keeps serving), and the planted bug:
numpy_engine_rope_bug.py on qwen2-tiny must first fail at
decode1/blk.0.q_rope.

Exit 0 when everything held, 1 otherwise. --quick skips the long prompt.
"""
import argparse
import json
import os
import shlex
import struct
import subprocess
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ATOL, RTOL = 1.0e-5, 1.3e-6

# --------------------------------------------------------------------------
# safetensors reader (independent of the engine's own)
# --------------------------------------------------------------------------
DT = {"F32": "<f4", "F64": "<f8", "F16": "<f2", "I64": "<i8", "I32": "<i4", "U8": "u1"}


def load_st(path):
    with open(path, "rb") as f:
        raw = f.read()
    n = struct.unpack("<Q", raw[:8])[0]
    hdr = json.loads(raw[8:8 + n])
    meta = hdr.pop("__metadata__", {}) or {}
    base = 8 + n
    out = {}
    for k, v in hdr.items():
        b, e = v["data_offsets"]
        out[k] = np.frombuffer(raw[base + b:base + e], dtype=DT[v["dtype"]]).reshape(v["shape"])
    return out, meta


# --------------------------------------------------------------------------
# the engine, driven through the protocol
# --------------------------------------------------------------------------
class Proc:
    """One engine process. request() sends one JSON line and reads one back."""

    def __init__(self, cmd, transcript=None):
        self.cmd = cmd
        self.err = tempfile.TemporaryFile()
        self.p = subprocess.Popen(shlex.split(cmd), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=self.err, cwd=HERE)
        self.transcript = transcript

    def request(self, obj=None, raw=None):
        line = raw if raw is not None else json.dumps(obj, separators=(",", ":"))
        self.p.stdin.write((line + "\n").encode())
        self.p.stdin.flush()
        resp = self.p.stdout.readline()
        if not resp:
            raise RuntimeError(f"engine closed stdout after {line[:200]}\n--- engine log ---\n{self.log()}")
        if self.transcript is not None:
            self.transcript.append((line, resp.decode().rstrip("\n")))
        return json.loads(resp)

    def ok(self, obj):
        r = self.request(obj)
        if r.get("ok") is not True:
            raise RuntimeError(f"{obj.get('op')} failed: {r}\n--- engine log ---\n{self.log()}")
        return r

    def log(self):
        self.err.seek(0)
        return self.err.read().decode(errors="replace")

    def close(self):
        r = self.request({"op": "shutdown"})
        assert r == {"ok": True}, r
        self.p.stdin.close()
        rc = self.p.wait(timeout=30)
        assert rc == 0, f"engine exited {rc} after shutdown"
        extra = self.p.stdout.read()
        assert not extra, f"engine wrote after its shutdown answer: {extra[:200]!r}"


def stage_order(n_layers, qwen3):
    blk = ["attn_norm", "q", "k", "v"] + (["q_norm", "k_norm"] if qwen3 else []) + [
        "q_rope", "k_rope", "attn_scores", "attn_probs", "attn_ctx", "attn_out", "ffn_inp", "ffn_norm",
        "ffn_gate", "ffn_up", "ffn_act", "ffn_out", "out"]
    return ["embed"] + [f"blk.{i}.{s}" for i in range(n_layers) for s in blk] + [
        "output_norm", "logits", "sample_probs"]


class Golden:
    def __init__(self, path):
        self.path = path
        self.t, meta = load_st(path)
        self.prov = json.loads(meta["provenance"])
        self.steps = self.prov["steps"]
        self.prompt = [int(x) for x in self.t["prefill/tokens"]]
        self.forced = [int(self.t[f"{s}/tokens"][0]) for s in self.steps[1:]]
        cfg = self.prov["model_config"]
        self.order = stage_order(cfg["num_hidden_layers"], cfg["model_type"] == "qwen3")
        self.keys = [k for k in self.t if not k.endswith(("/tokens", "/positions"))]
        self.logits_last = (self.prov.get("record") or {}).get("logits") == "last"
        self.taps = sorted({k.split("/", 1)[1] for k in self.keys}, key=self.order.index)

    def exec_order(self, keys):
        return sorted(keys, key=lambda k: (self.steps.index(k.split("/")[0]),
                                           self.order.index(k.split("/", 1)[1])))

    def sampling(self):
        s = self.prov.get("sampling")
        if not s:
            return "greedy"
        return {"temperature": s["temperature"], "top_k": s["top_k"] or None,
                "top_p": s["top_p"] if s["top_p"] < 1.0 else None}


def run_engine(cmd, model, golden, out, storage="f32", transcript=None, sampling=None, seed=1234):
    p = Proc(cmd, transcript)
    try:
        p.ok({"op": "load", "protocol": 1, "model": model, "storage": storage})
        p.ok({"op": "run", "prompt": golden.prompt, "decode_steps": len(golden.forced),
              "sampling": sampling or golden.sampling(), "seed": seed, "forced": golden.forced,
              "taps": golden.taps, "out": out})
        p.close()
    except Exception:
        p.p.kill()
        raise
    return load_st(out)[0]


def compare(golden, got, tol, oracle=None, verbose=False, storage=None):
    """Rows (key, shape ok, max|Δ|, pass, engine-oracle, hf-oracle) in execution order."""
    rows = []
    for k in golden.exec_order(golden.keys):
        e = golden.t[k].astype(np.float64)
        if k not in got:
            rows.append((k, False, float("inf"), False, None, None, "missing"))
            continue
        a = got[k].astype(np.float64)
        if k.endswith("/logits") and golden.logits_last and a.shape != e.shape:
            a = a[-1:]  # a `record: {logits: last}` golden holds the last row only
        if a.shape != e.shape:
            rows.append((k, False, float("inf"), False, None, None, f"shape {a.shape} != {e.shape}"))
            continue
        stage = k.split("/", 1)[1]
        atol, rtol = tol(stage)
        d = np.abs(a - e)
        ok = bool(np.isfinite(a).all() and (d <= atol + rtol * np.abs(e)).all())
        note = ""
        if storage is not None and not stage.endswith(("attn_scores", "attn_probs", "sample_probs")):
            # Every stored stage must hold values of the storage dtype.
            name, rnd = storage
            if not np.array_equal(rnd(got[k]), got[k]):
                ok, note = False, f"not representable in {name}"
        eo = ho = None
        if oracle is not None and k in oracle:
            o = oracle[k].astype(np.float64)
            eo, ho = float(np.abs(a - o).max()), float(np.abs(e - o).max())
        rows.append((k, True, float(d.max()) if d.size else 0.0, ok, eo, ho, note))
    return rows


def print_rows(rows, verbose):
    """Per stage (all steps together) max|Δ|; with -v every (step, stage)."""
    if verbose:
        for k, shp, d, ok, eo, ho, note in rows:
            extra = "" if eo is None else f"  eng↔oracle {eo:.2e}  hf↔oracle {ho:.2e}"
            print(f"    {k:32s} {'pass' if ok else 'FAIL'}  max|Δ| {d:.2e}{extra} {note}")
        return
    per = {}
    for k, shp, d, ok, eo, ho, note in rows:
        st = k.split("/", 1)[1]
        s = per.setdefault(st, [0.0, True, None, None, ""])
        s[0] = max(s[0], d)
        s[1] = s[1] and ok
        if eo is not None:
            s[2] = max(s[2] or 0.0, eo)
            s[3] = max(s[3] or 0.0, ho)
        s[4] = s[4] or note
    print(f"    {'stage':22s} {'result':6s} {'max|Δ| hf':>10s} {'eng↔oracle':>11s} {'hf↔oracle':>10s}")
    for st, (d, ok, eo, ho, note) in per.items():
        o = f" {eo:11.2e} {ho:10.2e}" if eo is not None else ""
        print(f"    {st:22s} {'pass' if ok else 'FAIL':6s} {d:10.2e}{o} {note}")


def f32_tol(stage):
    return ATOL, RTOL


def f16_tol(stage):
    # specs/qwen2-tiny-f16.yaml
    s = stage.split(".")[-1]
    if stage == "embed":
        return 0.0, 1.0e-3
    return {"attn_probs": 0.004, "ffn_inp": 0.03, "ffn_gate": 0.03, "ffn_act": 0.03, "ffn_out": 0.03,
            "out": 0.05, "logits": 0.03}.get(s, 0.02), 9.765625e-4


def bf16_tol(stage):
    # specs/qwen2-tiny-bf16.yaml
    s = stage.split(".")[-1]
    if stage == "embed":
        return 0.0, 8.0e-3
    return {"attn_probs": 0.03, "ffn_act": 0.3, "ffn_out": 0.4, "out": 0.4,
            "logits": 0.3}.get(s, 0.2), 7.8125e-3


def bf16_round(x):
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    r = ((u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000).astype(np.uint32)
    return r.view(np.float32)


def f16_round(x):
    return np.asarray(x, dtype=np.float32).astype(np.float16).astype(np.float32)


# --------------------------------------------------------------------------
def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    default_goldens = os.path.normpath(os.path.join(HERE, "..", "..", "goldens"))
    ap.add_argument("--goldens", default=default_goldens)
    ap.add_argument("--engine", default=f"{shlex.quote(sys.executable)} numpy_engine.py")
    ap.add_argument("--bug-engine", default=f"{shlex.quote(sys.executable)} numpy_engine_rope_bug.py")
    ap.add_argument("--only", help="run only the cases whose name contains this")
    ap.add_argument("--quick", action="store_true", help="skip the 348-token golden")
    ap.add_argument("--transcript", help="write the protocol exchange of the qwen2-tiny case here (JSON lines)")
    ap.add_argument("-v", "--verbose", action="store_true", help="one row per (step, stage)")
    args = ap.parse_args()
    G = args.goldens
    tmp = tempfile.mkdtemp(prefix="numpy-engine-check-")
    failures = []
    summary = []

    def case(name):
        return args.only is None or args.only in name

    def golden_case(name, model, gfile, oracle_file=None, storage="f32", tol=f32_tol, rep=None,
                    transcript=None):
        if not case(name):
            return
        print(f"== {name}: {os.path.relpath(gfile, G)} (storage {storage})")
        g = Golden(gfile)
        t0 = time.monotonic()
        got = run_engine(args.engine, model, g, os.path.join(tmp, name.replace(" ", "_") + ".safetensors"),
                         storage, transcript)
        oracle = load_st(oracle_file)[0] if oracle_file and os.path.exists(oracle_file) else None
        rows = compare(g, got, tol, oracle, args.verbose, rep)
        print_rows(rows, args.verbose)
        toks = [int(x) for x in got["tokens"]]
        want = g.prov["greedy_ids"]
        tok_note = "" if storage != "f32" or g.prov.get("sampling") else \
            ("tokens = golden greedy_ids" if toks == want else f"TOKENS {toks} != golden {want}")
        if tok_note.startswith("TOKENS"):
            failures.append(f"{name}: {tok_note}")
        bad = [r for r in rows if not r[3]]
        worst = max(rows, key=lambda r: r[2])
        print(f"    {len(rows)} tensors, {len(rows) - len(bad)} pass; worst max|Δ| {worst[2]:.2e} at {worst[0]}; "
              f"{tok_note}; {time.monotonic() - t0:.1f}s")
        if bad:
            failures.append(f"{name}: {len(bad)} tensor(s) fail, first {bad[0][0]} (max|Δ| {bad[0][2]:.2e}"
                            f"{', ' + bad[0][6] if bad[0][6] else ''})")
        summary.append((name, storage, len(rows), len(bad), worst[2], worst[0],
                        max((r[4] for r in rows if r[4] is not None), default=None),
                        max((r[5] for r in rows if r[5] is not None), default=None)))

    transcript = []
    for m in ["qwen2-tiny", "llama-tiny", "qwen3-tiny", "phi3-tiny"]:
        d = os.path.join(G, m)
        golden_case(m, os.path.join(d, "model"), os.path.join(d, "hf.safetensors"),
                    os.path.join(d, "oracle.safetensors"), transcript=transcript if m == "qwen2-tiny" else None)
    q = os.path.join(G, "qwen2-tiny")
    if not args.quick:
        golden_case("qwen2-tiny long", os.path.join(q, "model"), os.path.join(q, "long-hf.safetensors"),
                    os.path.join(q, "long-oracle.safetensors"))
    golden_case("qwen2-tiny sampling", os.path.join(q, "model"), os.path.join(q, "sampling-hf.safetensors"))
    golden_case("qwen2-tiny f16", os.path.join(q, "model"), os.path.join(q, "hf.safetensors"),
                storage="f16", tol=f16_tol, rep=("float16", f16_round))
    golden_case("qwen2-tiny bf16", os.path.join(q, "model"), os.path.join(q, "hf.safetensors"),
                storage="bf16", tol=bf16_tol, rep=("bfloat16", bf16_round))
    if args.transcript and transcript:
        with open(args.transcript, "w") as f:
            for req, resp in transcript:
                f.write(req + "\n" + resp + "\n")

    # ---- run-level checks ------------------------------------------------
    if case("run checks"):
        print("== run checks on qwen2-tiny")
        model = os.path.join(q, "model")
        g = Golden(os.path.join(q, "hf.safetensors"))
        p = Proc(args.engine)
        p.ok({"op": "load", "protocol": 1, "model": model, "storage": "f32"})
        rnd = {"temperature": 1.0, "top_k": 50, "top_p": 0.95}

        def run(seed, sampling, n, prompt=None, forced=None, taps=("logits",), name="r"):
            out = os.path.join(tmp, f"{name}.safetensors")
            p.ok({"op": "run", "prompt": prompt or g.prompt, "decode_steps": n, "sampling": sampling,
                  "seed": seed, "forced": forced, "taps": list(taps), "out": out})
            with open(out, "rb") as f:
                raw = f.read()
            return load_st(out)[0], raw

        runs = [run(1234, rnd, 8, taps=("logits", "sample_probs"), name=f"det{i}") for i in range(3)]
        same = all(r[1] == runs[0][1] for r in runs)
        toks = [int(x) for x in runs[0][0]["tokens"]]
        other = [int(x) for x in run(1235, rnd, 8, name="det_other")[0]["tokens"]]
        ok = same and other != toks
        print(f"    determinism: 3 runs of seed 1234 {'byte-identical' if same else 'DIFFER'} (tokens {toks}); "
              f"seed 1235 gives {other}: {'pass' if ok else 'FAIL'}")
        if not ok:
            failures.append("determinism")
        # KV cache: incremental (4 free greedy steps) vs one prefill over prompt + fed tokens.
        inc, _ = run(0, "greedy", 4, name="kv_inc")
        fed = [int(x) for x in inc["tokens"]][:4]
        full, _ = run(0, "greedy", 0, prompt=g.prompt + fed, name="kv_full")
        d = float(np.abs(inc["decode4/logits"][-1].astype(np.float64) - full["prefill/logits"][-1]).max())
        ok = d <= 1e-5
        print(f"    kv_cache: decode4 logits vs one prefill over prompt + {fed}: max|Δ| {d:.2e}: "
              f"{'pass' if ok else 'FAIL'}")
        if not ok:
            failures.append("kv_cache")
        free, _ = run(0, "greedy", len(g.forced), name="greedy_free")
        ft = [int(x) for x in free["tokens"]]
        ok = ft == g.prov["greedy_ids"]
        print(f"    greedy_tokens: free-running {ft} vs golden {g.prov['greedy_ids']}: {'pass' if ok else 'FAIL'}")
        if not ok:
            failures.append("greedy_tokens")
        # q_norm/k_norm tapped on a non-Qwen3 model: skipped (touchstone's
        # determinism check taps every canonical stage), the rest written.
        sk, _ = run(0, "greedy", 1, taps=("blk.0.q_norm", "blk.1.k_norm", "embed"), name="skip")
        ok = sorted(k for k in sk if k != "tokens") == ["decode1/embed", "prefill/embed"]
        print(f"    q_norm/k_norm tapped on qwen2: skipped, embed written: {'pass' if ok else 'FAIL'}")
        if not ok:
            failures.append("q_norm/k_norm skipping")
        # Refusals: each is ok:false with a message, and the engine keeps serving.
        bad_reqs = [
            ("protocol 2", {"op": "load", "protocol": 2, "model": model, "storage": "f32"}),
            ("storage f8", {"op": "load", "protocol": 1, "model": model, "storage": "f8"}),
            ("unknown op", {"op": "frobnicate"}),
            ("unknown stage", {"op": "run", "prompt": [1, 2], "decode_steps": 0, "sampling": "greedy",
                               "seed": 0, "forced": None, "taps": ["blk.9.q"], "out": os.path.join(tmp, "x")}),
            ("token out of vocab", {"op": "run", "prompt": [1, 99999], "decode_steps": 0, "sampling": "greedy",
                                    "seed": 0, "forced": None, "taps": [], "out": os.path.join(tmp, "x")}),
            ("bad JSON", None),
        ]
        all_ok = True
        for what, req in bad_reqs:
            r = p.request(req, raw="{not json" if req is None else None)
            good = r.get("ok") is False and isinstance(r.get("error"), str) and r["error"]
            all_ok &= bool(good)
            print(f"    refuses {what:18s} -> {json.dumps(r)[:150]}")
        q3 = Proc(args.engine)
        r = q3.request({"op": "run", "prompt": [1], "decode_steps": 0, "sampling": "greedy", "seed": 0,
                        "forced": None, "taps": [], "out": os.path.join(tmp, "x")})
        print(f"    refuses {'run before load':18s} -> {json.dumps(r)}")
        all_ok &= r.get("ok") is False
        q3.close()
        # Still serving after all that?
        again, _ = run(0, "greedy", len(g.forced), name="after")
        all_ok &= [int(x) for x in again["tokens"]] == g.prov["greedy_ids"]
        p.close()
        # EOF on stdin: exit 0.
        q4 = Proc(args.engine)
        q4.p.stdin.close()
        rc = q4.p.wait(timeout=30)
        all_ok &= rc == 0
        print(f"    EOF on stdin -> exit {rc}; still serving after the refusals: {'pass' if all_ok else 'FAIL'}")
        if not all_ok:
            failures.append("protocol refusals")

    # ---- the planted bug -------------------------------------------------
    if case("rope bug"):
        print("== numpy_engine_rope_bug.py on qwen2-tiny (RoPE skipped in decode steps)")
        g = Golden(os.path.join(q, "hf.safetensors"))
        got = run_engine(args.bug_engine, os.path.join(q, "model"), g, os.path.join(tmp, "bug.safetensors"))
        rows = compare(g, got, f32_tol)
        bad = [r for r in rows if not r[3]]
        first = bad[0][0] if bad else None
        print(f"    {len(bad)} of {len(rows)} tensors fail; first failing (execution order): {first} "
              f"(max|Δ| {bad[0][2]:.2e})" if bad else "    nothing fails")
        for r in bad[:6]:
            print(f"      {r[0]:32s} max|Δ| {r[2]:.2e}")
        ok = first == "decode1/blk.0.q_rope"
        print(f"    expected first failure decode1/blk.0.q_rope: {'pass' if ok else 'FAIL'}")
        if not ok:
            failures.append(f"rope bug: first failure {first}, expected decode1/blk.0.q_rope")

    if summary:
        print("\n== summary (worst max|Δ| against the HF golden, over every step and stage)")
        print(f"    {'case':22s} {'storage':7s} {'tensors':>7s} {'fail':>4s} {'worst max|Δ|':>12s}  "
              f"{'at':32s} {'eng↔oracle':>10s} {'hf↔oracle':>10s}")
        for name, st, n, nb, w, at, eo, ho in summary:
            o = f"{eo:10.2e} {ho:10.2e}" if eo is not None else f"{'-':>10s} {'-':>10s}"
            print(f"    {name:22s} {st:7s} {n:7d} {nb:4d} {w:12.2e}  {at:32s} {o}")
    print()
    if failures:
        print("FAILED:")
        for f in failures:
            print("  - " + f)
        return 1
    print("all checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
