"""ci/bench.sh's summary: medians over the rounds, ratios, checks that the
peers computed the same thing, and the table. Pure functions of the run
records (no processes here), so they can be tested on recorded runs."""
import math
import statistics


def median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def ratio(a, b):
    return a / b if a is not None and b else None


def spread(xs):
    xs = [x for x in xs if x is not None]
    return {"median": median(xs), "min": min(xs) if xs else None, "max": max(xs) if xs else None, "n": len(xs)}


def first_difference(ours, theirs):
    """None when the id lists are equal, else the first step where they
    differ (0 = the token picked after the prefill)."""
    if ours is None or theirs is None:
        return "unknown"
    for i, (a, b) in enumerate(zip(ours, theirs)):
        if a != b:
            return i
    return None if len(ours) == len(theirs) else min(len(ours), len(theirs))


def metrics_disagreement(ref, other, rel=1e-9):
    """The comparator metrics on which `other` differs from `ref`: counts,
    indices and maxima exactly (the same data in the same float64
    arithmetic), sums (nmse, cosine) to `rel`, since each peer adds them up
    in its own order."""
    if ref is None or other is None:
        return ["missing"]
    bad = [k for k in ("numel", "mismatched", "non_finite", "max_ulp") if ref.get(k) != other.get(k)]
    for k in ("max_abs", "max_rel"):
        if ref.get(k) != other.get(k):
            bad.append(k)
    for k in ("nmse", "cosine"):
        a, b = ref.get(k), other.get(k)
        if a is None or b is None or abs(a - b) > rel * max(abs(a), abs(b), 1e-300):
            bad.append(k)
    return bad


# A measurement during which other processes took more than this share of
# the CPUs is "contended": left out of the medians whenever the same peer has
# uncontended ones (spinning worker threads collapse under contention, so one
# such sample says more about the neighbours than about the peer).
QUIET = 0.05


def quiet(r):
    return r["others_frac"] is None or r["others_frac"] <= QUIET


def summarise(runs, meta):
    ok = [r for r in runs if not r["error"]]
    used = {}

    def by(group, name=None):
        """The successful runs of a peer: the uncontended ones when there are any."""
        rs = [r for r in ok if r["group"] == group and (name is None or r["name"] == name)]
        calm = [r for r in rs if quiet(r)]
        used[(group, name)] = {"used": len(calm or rs), "of": len(rs), "contended_included": not calm and bool(rs)}
        return calm or rs
    summ = lambda r: next((x for x in r["records"] if x.get("summary")), None)  # noqa: E731
    reps = lambda r: [x for x in r["records"] if "rep" in x and not x.get("summary")]  # noqa: E731

    bw = [summ(r)["best_gb_s"] for r in by("bandwidth") if summ(r)]
    bandwidth = spread(bw)
    bandwidth["runs"] = used[("bandwidth", None)]
    out = {"bandwidth_gb_s": bandwidth, "engines": {}, "compare": {}, "whole": {}, "failures": [],
           "others_frac": spread([r["others_frac"] for r in runs])}
    out["failures"] = [{"round": r["round"], "name": r["name"], "group": r["group"], "error": r["error"]}
                       for r in runs if r["error"]]
    out["contended"] = [{"round": r["round"], "name": r["name"], "group": r["group"], "others_frac": r["others_frac"]}
                        for r in ok if not quiet(r)]

    names = []
    for r in runs:
        if r["group"] == "engine" and r["name"] not in names:
            names.append(r["name"])
    ts_generated = None
    weight_bytes = meta["model"].get("weight_bytes_f32")
    for name in names:
        rs = by("engine", name)
        sums = [summ(r) for r in rs if summ(r)]
        e = {"prefill_tok_s": spread([x["prefill_tok_s"] for r in rs for x in reps(r)]),
             "decode_tok_s": spread([x["decode_tok_s"] for r in rs for x in reps(r)]),
             "load_s": spread([s.get("load_s") for s in sums]),
             "peak_rss_bytes": spread([r["peak_rss_bytes"] for r in rs]),
             "model_bytes": sums[0].get("model_bytes") if sums else None,
             "generated": sums[0].get("generated") if sums else None,
             "prompt_ok": all(s.get("prompt") == meta["prompt"] for s in sums),
             "runs": used[("engine", name)]}
        e["rss_over_model"] = ratio(e["peak_rss_bytes"]["median"], e["model_bytes"])
        if sums:
            s = sums[0]
            e["detail"] = {k: s[k] for k in ("system_info", "build", "lib_dir", "settings", "versions", "config")
                           if k in s}
        if name == "touchstone" and sums:
            ts_generated = e["generated"]
            weight_bytes = sums[0].get("weight_bytes") or weight_bytes
        out["engines"][name] = e
    out["weight_bytes"] = weight_bytes
    limit = (bandwidth["median"] * 1e9 / weight_bytes) if bandwidth["median"] and weight_bytes else None
    out["decode_limit_tok_s"] = limit
    ts = out["engines"].get("touchstone")
    for name, e in out["engines"].items():
        e["decode_fraction_of_limit"] = ratio(e["decode_tok_s"]["median"], limit)
        # The read rate decode achieved: independent of the bandwidth figure,
        # which drifts on a shared host (30-59 GB/s between rounds here).
        e["decode_read_gb_s"] = (e["decode_tok_s"]["median"] * weight_bytes / 1e9
                                 if e["decode_tok_s"]["median"] and weight_bytes else None)
        e["greedy_first_difference"] = first_difference(ts_generated, e["generated"]) if ts else "unknown"
        if ts and name != "touchstone":
            e["touchstone_over_peer"] = {
                "prefill": ratio(ts["prefill_tok_s"]["median"], e["prefill_tok_s"]["median"]),
                "decode": ratio(ts["decode_tok_s"]["median"], e["decode_tok_s"]["median"])}

    ref_metrics = None
    for name in ("touchstone", "numpy", "torch"):
        rs = by("compare", name)
        if not rs and not any(r["group"] == "compare" and r["name"] == name for r in runs):
            continue
        sums = [summ(r) for r in rs if summ(r)]
        c = {"gb_s": spread([x["gb_s"] for r in rs for x in reps(r)]),
             "metrics": sums[0].get("metrics") if sums else None,
             "in_process_bandwidth_gb_s": spread([s.get("bandwidth_gb_s") for s in sums]),
             "version": sums[0].get("version") if sums else None, "runs": used[("compare", name)]}
        c["fraction_of_bandwidth"] = ratio(c["gb_s"]["median"], bandwidth["median"])
        if name == "touchstone":
            ref_metrics = c["metrics"]
        out["compare"][name] = c
    for name, c in out["compare"].items():
        if name != "touchstone" and "touchstone" in out["compare"]:
            c["metrics_differ"] = metrics_disagreement(ref_metrics, c["metrics"])
            c["touchstone_over_peer"] = ratio(out["compare"]["touchstone"]["gb_s"]["median"], c["gb_s"]["median"])

    for r in runs:
        if r["group"] == "whole" and r["name"] not in out["whole"]:
            rs = by("whole", r["name"])
            out["whole"][r["name"]] = {"wall_s": spread([x["wall_s"] for x in rs]),
                                       "peak_rss_bytes": spread([x["peak_rss_bytes"] for x in rs]),
                                       "cmd": r["cmd"], "runs": used[("whole", r["name"])]}
    wn = list(out["whole"])
    if len(wn) == 2:
        out["whole"][wn[1]]["peer_over_touchstone"] = ratio(out["whole"][wn[1]]["wall_s"]["median"],
                                                            out["whole"][wn[0]]["wall_s"]["median"])
    return out


# ---- text ------------------------------------------------------------------

def num(x, digits=3):
    """A measurement to about `digits` significant figures without exponents
    for the sizes that occur (84.0, 3.02, 0.0412, 12345); '-' when absent."""
    if x is None:
        return "-"
    if x == 0:
        return "0"
    x = float(f"{x:.{digits}g}")  # round first, so 9.996 becomes 10.0, not 10.00
    mag = abs(x)
    if mag >= 10 ** (digits - 1):
        return f"{x:.0f}"
    if mag >= 1e-4:
        decimals = digits - 1 - math.floor(math.log10(mag))
        return f"{x:.{decimals}f}"
    return f"{x:.{digits - 1}e}"


def rng(sp, digits=3):
    """'median [min-max]', or the median alone for one sample."""
    if sp["median"] is None:
        return "-"
    if sp["n"] == 1:
        return num(sp["median"], digits)
    return f"{num(sp['median'], digits)} [{num(sp['min'], digits)}-{num(sp['max'], digits)}]"


def pct(x):
    return "-" if x is None else f"{100 * x:.1f}%"


def times(x):
    return "-" if x is None else f"{x:.2f}x"


def gb(b):
    return "-" if b is None else f"{b / 1e9:.2f} GB"


def table(header, rows):
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows)]
    line = lambda cells: "  ".join(str(c).ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    return "\n".join([line(header), line(["-" * w for w in widths])] + [line(r) for r in rows])


def rounds(u):
    """'4/5': measurements in the median / successful ones ('5/5!' when all
    were contended and had to be used)."""
    return f"{u['used']}/{u['of']}" + ("!" if u["contended_included"] else "")


def engine_build(name, e):
    d = e.get("detail", {})
    if name == "touchstone":
        return "CPU engine, cargo --release"
    if name == "llama.cpp":
        flags = d.get("build", {}).get("flags", [])
        native = "native" if "-DGGML_NATIVE=ON" in flags else "portable (GGML_NATIVE=OFF)"
        feats = [f.split("=")[0].strip() for f in d.get("system_info", "").replace("CPU :", "").split("|")
                 if f.strip().endswith("= 1")]
        keep = [f for f in feats if f in ("AVX2", "AVX512", "LLAMAFILE", "OPENMP", "REPACK")]
        return f"{native}: {', '.join(keep)}"
    if name == "hf":
        v, s = d.get("versions", {}), d.get("settings", {})
        return f"torch {v.get('torch', '?').split('+')[0]}, {s.get('attn_implementation', '?')}, {s.get('cpu_capability', '?')}"
    return ""


def render(s, meta):
    out = []
    m = meta["model"]
    out.append(f"touchstone bench  {meta['started']}  commit {meta['commit']}  {meta['cpu']} ({meta['cores']} cores)")
    out.append(f"{meta['rounds']} round(s), interleaved, {meta['threads']} threads for every peer; took {meta['seconds']:.0f} s")
    params = f", {m['params']:,} parameters" if m.get("params") else ""
    out.append(f"model: {m['name']}{params}, f32; prompt {meta['prompt_tokens']} tokens, "
               f"{meta['decode_steps']} greedy decode steps")
    bw = s["bandwidth_gb_s"]
    wb = s["weight_bytes"]
    out.append(f"memory read bandwidth: {rng(bw)} GB/s over {rounds(bw['runs'])} rounds (per round the best of 5 "
               f"passes over {meta['bandwidth_mib']} MiB, {meta['threads']} threads)")
    if s["decode_limit_tok_s"]:
        out.append(f"decode limit: {num(s['decode_limit_tok_s'])} tok/s = bandwidth / {wb / 1e9:.3f} GB of f32 weights "
                   "read per token (the tied LM head counted once)")
    out.append("")
    if s["engines"]:
        out.append("engines: tok/s, median [min-max] over the rounds used; higher is better. decode GB/s: weights "
                   "read per second at the median decode rate; decode/limit: that rate over the decode limit")
        rows = []
        for name, e in s["engines"].items():
            diff = e["greedy_first_difference"]
            same = ("same ids" if diff is None else "-" if diff == "unknown" else f"differ from step {diff}")
            rows.append([name, engine_build(name, e), rounds(e["runs"]), rng(e["prefill_tok_s"]), rng(e["decode_tok_s"]),
                         num(e["decode_read_gb_s"]), pct(e["decode_fraction_of_limit"]), num(e["load_s"]["median"]),
                         gb(e["peak_rss_bytes"]["median"]), times(e["rss_over_model"]),
                         "-" if name == "touchstone" else same])
        out.append(table(["engine", "build", "rounds", "prefill tok/s", "decode tok/s", "decode GB/s", "decode/limit", "load s", "peak RSS",
                          "RSS/model", "greedy ids vs touchstone"], rows))
        peers = [(n, e) for n, e in s["engines"].items() if "touchstone_over_peer" in e]
        if peers:
            out.append("touchstone / peer (tok/s over tok/s: above 1 touchstone is faster): " + "; ".join(
                f"{n} prefill {times(e['touchstone_over_peer']['prefill'])}, decode "
                f"{times(e['touchstone_over_peer']['decode'])}" for n, e in peers))
        out.append("")
    if s["compare"]:
        out.append(f"comparator: GB/s of input read (2 x {meta['compare_mib']} MiB f32), median [min-max] over "
                   "the repetitions (3 per round) of the rounds used; higher is better")
        rows = []
        for name, c in s["compare"].items():
            differ = c.get("metrics_differ")
            agree = "-" if differ is None else ("same metrics" if not differ else "DIFFER: " + ", ".join(differ))
            rows.append([name, rounds(c["runs"]), rng(c["gb_s"]), pct(c["fraction_of_bandwidth"]),
                         times(c.get("touchstone_over_peer")) if name != "touchstone" else "-", agree])
        out.append(table(["impl", "rounds", "GB/s", "of bandwidth", "touchstone/peer", "metrics vs touchstone"], rows))
        out.append("")
    if s["whole"]:
        out.append("whole process (load both .npy, compare, print), wall seconds; lower is better")
        rows = []
        for name, w in s["whole"].items():
            rows.append([name, rounds(w["runs"]), rng(w["wall_s"]), gb(w["peak_rss_bytes"]["median"]),
                         times(w.get("peer_over_touchstone")) if "peer_over_touchstone" in w else "-"])
        out.append(table(["command", "rounds", "wall s", "peak RSS", "peer/touchstone (above 1 touchstone is faster)"], rows))
        out.append("")
    of = s["others_frac"]
    if of["max"] is not None:
        out.append(f"rounds: measurements in the medians / successful ones. Measurements during which other processes "
                   f"took over {QUIET:.0%} of the CPUs are left out when the peer has others (`!`: all were, so all "
                   f"are used). Others' share: median {pct(of['median'])}, at most {pct(of['max'])}.")
        if s["contended"]:
            out.append(f"contended ({len(s['contended'])}; left out wherever the peer had others): " + ", ".join(
                f"r{c['round']} {c['group']}:{c['name']} {pct(c['others_frac'])}" for c in s["contended"]))
    for name, e in s["engines"].items():
        if not e["prompt_ok"]:
            out.append(f"WARNING: {name} reports a prompt other than the driver's token ids: its numbers are not comparable")
    for name, why in meta["skipped"].items():
        out.append(f"skipped {name}: {why}")
    if (meta.get("numpy_whole_process") or "").endswith("peer_compare.py"):
        out.append("numpy whole-process peer: ci/bench/peer_compare.py --once (ci/bench/compare_numpy.py not found)")
    for f in s["failures"]:
        out.append(f"FAILED round {f['round']} {f['group']} {f['name']}: {f['error']}")
    return "\n".join(out)
