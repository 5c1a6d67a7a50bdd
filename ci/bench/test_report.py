#!/usr/bin/env python3
"""Tests of the bench summary's pure parts (no peers run):
`python3 ci/bench/test_report.py` (the standard library is enough)."""
import os
import sys
import unittest

sys.dont_write_bytecode = True
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import report  # noqa: E402


def run(group, name, records, rnd=1, error=None, wall=1.0, rss=1 << 30):
    return {"round": rnd, "group": group, "name": name, "records": records, "error": error, "wall_s": wall,
            "peak_rss_bytes": rss, "others_frac": 0.0, "cmd": [name]}


class Formatting(unittest.TestCase):
    def test_numbers_keep_three_figures_without_exponents(self):
        self.assertEqual(report.num(84.04), "84.0")
        self.assertEqual(report.num(3.0213), "3.02")
        self.assertEqual(report.num(0.04123), "0.0412")
        self.assertEqual(report.num(9.996), "10.0")
        self.assertEqual(report.num(None), "-")

    def test_range_shows_median_then_extremes(self):
        self.assertEqual(report.rng(report.spread([3.0, 1.0, 2.0])), "2.00 [1.00-3.00]")
        self.assertEqual(report.rng(report.spread([2.5])), "2.50")
        self.assertEqual(report.rng(report.spread([])), "-")

    def test_ratio_of_nothing_is_absent(self):
        self.assertIsNone(report.ratio(None, 2.0))
        self.assertIsNone(report.ratio(1.0, 0))
        self.assertEqual(report.times(report.ratio(3.0, 2.0)), "1.50x")


class Agreement(unittest.TestCase):
    def test_first_difference_counts_from_the_prefill_token(self):
        self.assertIsNone(report.first_difference([1, 2, 3], [1, 2, 3]))
        self.assertEqual(report.first_difference([1, 2, 3], [1, 5, 3]), 1)
        self.assertEqual(report.first_difference([1, 2], [1, 2, 3]), 2)

    def test_metrics_sums_may_differ_in_the_last_bits_counts_may_not(self):
        ref = {"numel": 4, "mismatched": 1, "non_finite": 0, "max_ulp": 7, "nmse": 1e-10, "cosine": 0.99,
               "max_abs": {"value": 1e-5, "index": 2}, "max_rel": {"value": 3.0, "index": 1}}
        self.assertEqual(report.metrics_disagreement(ref, dict(ref, nmse=1e-10 * (1 + 1e-12))), [])
        self.assertEqual(report.metrics_disagreement(ref, dict(ref, mismatched=2)), ["mismatched"])
        self.assertEqual(report.metrics_disagreement(ref, dict(ref, max_abs={"value": 1e-5, "index": 3})),
                         ["max_abs"])


class Summary(unittest.TestCase):
    def test_medians_ratios_and_the_bandwidth_limit(self):
        meta = {"prompt": [17], "model": {"weight_bytes_f32": 2e9}}
        bw = lambda g, r: run("bandwidth", "bandwidth", [{"summary": True, "best_gb_s": g}], r)  # noqa: E731

        def eng(name, p, d, r):
            return run("engine", name, [{"rep": 1, "prefill_tok_s": p, "decode_tok_s": d},
                                        {"summary": True, "prompt": [17], "generated": [4, 5], "load_s": 1.0,
                                         "model_bytes": 2e9, "weight_bytes": 2e9}], r)
        runs = [bw(30.0, 1), eng("touchstone", 80.0, 3.0, 1), eng("llama.cpp", 240.0, 12.0, 1),
                bw(32.0, 2), eng("touchstone", 90.0, 3.2, 2), eng("llama.cpp", 230.0, 13.0, 2),
                run("engine", "llama.cpp", [], 3, error="exit status 1: boom")]
        s = report.summarise(runs, meta)
        self.assertEqual(s["bandwidth_gb_s"]["median"], 31.0)
        self.assertAlmostEqual(s["decode_limit_tok_s"], 15.5)
        ts, lc = s["engines"]["touchstone"], s["engines"]["llama.cpp"]
        self.assertEqual(ts["decode_tok_s"]["median"], 3.1)
        self.assertAlmostEqual(lc["touchstone_over_peer"]["decode"], 3.1 / 12.5)
        self.assertAlmostEqual(ts["decode_fraction_of_limit"], 0.2)
        self.assertAlmostEqual(ts["decode_read_gb_s"], 6.2)
        self.assertIsNone(lc["greedy_first_difference"])
        self.assertEqual([f["name"] for f in s["failures"]], ["llama.cpp"])
        text = report.render(s, dict(meta, started="t", commit="c", cpu="cpu", cores=2, rounds=2, threads=2,
                                     seconds=1.0, prompt_tokens=1, decode_steps=1, bandwidth_mib=1024,
                                     compare_mib=256, skipped={}, model={"name": "m", "params": 1,
                                                                          "weight_bytes_f32": 2e9}))
        self.assertIn("FAILED round 3 engine llama.cpp", text)
        self.assertIn("llama.cpp prefill 0.36x, decode 0.25x", text)

    def test_contended_measurements_leave_the_median_when_quiet_ones_exist(self):
        def eng(d, others, r):
            x = run("engine", "touchstone", [{"rep": 1, "prefill_tok_s": 1.0, "decode_tok_s": d},
                                             {"summary": True, "prompt": [17], "generated": [1]}], r)
            x["others_frac"] = others
            return x
        meta = {"prompt": [17], "model": {}}
        s = report.summarise([eng(10.0, 0.0, 1), eng(1.0, 0.5, 2), eng(12.0, 0.01, 3)], meta)
        self.assertEqual(s["engines"]["touchstone"]["decode_tok_s"]["median"], 11.0)
        self.assertEqual(report.rounds(s["engines"]["touchstone"]["runs"]), "2/3")
        self.assertEqual([(c["round"], c["name"]) for c in s["contended"]], [(2, "touchstone")])
        s = report.summarise([eng(1.0, 0.5, 1), eng(3.0, 0.4, 2)], meta)
        self.assertEqual(s["engines"]["touchstone"]["decode_tok_s"]["median"], 2.0)
        self.assertEqual(report.rounds(s["engines"]["touchstone"]["runs"]), "2/2!")


if __name__ == "__main__":
    unittest.main()
