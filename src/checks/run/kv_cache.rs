//! `kv_cache`: incremental decode (prefill, then one token at a time through
//! the KV cache) gives the logits of one full recompute over the same tokens.
//! A stale, misplaced or short cache shows here even when every prefill
//! stage is right.
//!
//! `atol`/`rtol` are written for the spec's storage arithmetic (e.g. f32's
//! 16·u·√E·M). An engine that declares another arithmetic (8-bit
//! activations, an f16 KV cache: llama.cpp's defaults) rounds the two paths
//! differently by design: llama.cpp's decode-time flash-attention kernel
//! rounds q and the attention sum to f16 and its prefill kernel does not, and
//! once an input differs in one bit, 8-bit quantisation of the next matmul's
//! input rounds some values the other way. Its allowance is then derived from
//! its arithmetic (`allowance`), never the f32 number: each path may be as
//! far from the exact logits as the scaled policy lets that arithmetic be,
//! `factor · r` with r the error of the spec's references of that same
//! arithmetic against the oracle at the logits, so the paths may differ by
//! twice that; with no such reference, the spec's allowance at the unit
//! roundoff of the coarsest rounding the paths can apply differently (the
//! KV cache's) instead of f32's.

use std::sync::Arc;

use serde::de::{Deserialize, Deserializer};

use super::run_engine;
use crate::checks::facts::Facts;
use crate::checks::family::Metric;
use crate::arithmetic::Arithmetic;
use crate::checks::kind::{Count, Kind, Limit, RuleEnv, RunCheck, RunRule};
use crate::checks::{measure, scaled};
use crate::checks::params::tol_value;
use crate::checks::verdict::Verdict;
use crate::compare::{compare, Tolerance};
use crate::engine::{Engine, RunRequest, TapSet};
use crate::sampling::Sampling;
use crate::stage::{Stage, Step};
use crate::tensor::Tensor;

#[derive(Clone, Debug, PartialEq, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KvCache {
    #[serde(default = "default_atol", deserialize_with = "tol_value")]
    pub atol: f64,
    #[serde(default, deserialize_with = "tol_value")]
    pub rtol: f64,
    /// Decode steps to generate (default: the prompt's decode_steps).
    pub decode_steps: Option<usize>,
}

fn default_atol() -> f64 {
    1e-5
}

impl Kind for KvCache {
    const NAME: &'static str = "kv_cache";
    const PARAMS: &'static str = "atol (1e-5), rtol (0), decode_steps (the prompt's)";
    const ABOUT: &'static str = "incremental decode gives the logits of one full recompute over the same tokens";
    fn bare() -> Self {
        KvCache {
            atol: default_atol(),
            rtol: 0.0,
            decode_steps: None,
        }
    }
    fn parse<'de, D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        Ok(Option::<KvCache>::deserialize(d)?.unwrap_or_else(Self::bare))
    }
}

impl RunRule for KvCache {
    fn kind(&self) -> &'static str {
        Self::NAME
    }
    fn counts(&self) -> Vec<Count> {
        self.decode_steps
            .map(|n| Count {
                key: "decode_steps",
                what: "kv_cache.decode_steps",
                n,
                limit: Limit::DecodeSteps,
            })
            .into_iter()
            .collect()
    }
    fn expand(&self, _: &RuleEnv) -> Arc<dyn RunCheck> {
        Arc::new(self.clone())
    }
}

impl RunCheck for KvCache {
    fn id(&self) -> String {
        Self::NAME.into()
    }
    fn metric(&self) -> Option<Metric> {
        Some(Metric::MaxAbs)
    }
    fn steps(&self, decode_steps: usize) -> Option<(&'static str, usize)> {
        Some((
            "the prompt plus kv_cache.decode_steps",
            self.decode_steps.unwrap_or(decode_steps),
        ))
    }
    fn reruns(&self) -> bool {
        true
    }
    fn evaluate(&self, facts: &Facts, engine: &dyn Engine) -> Verdict {
        evaluate(self, facts, engine).unwrap_or_else(|e| Verdict::fail(format!("the engine failed: {e}")))
    }
}

fn evaluate(k: &KvCache, facts: &Facts, engine: &dyn Engine) -> Result<Verdict, String> {
    let steps = k.decode_steps.unwrap_or(facts.decode_steps).max(1);
    let taps: TapSet = [Stage::Logits].into_iter().collect();
    let greedy = |prompt: Vec<u32>, decode_steps| RunRequest {
        prompt,
        decode_steps,
        sampling: Sampling::Greedy,
        seed: facts.seed,
        forced: None,
        image: facts.image.cloned(),
    };
    let incremental = run_engine(engine, &greedy(facts.prompt.to_vec(), steps), &taps)?;
    // Where the RoPE table depends on the pass's length (dynamic NTK,
    // LongRoPE), HF rotates each pass with its own length's table and never
    // re-rotates cached keys: incremental decode equals a recompute only
    // while every pass so far used the table of the recompute's length.
    let p = facts.prompt.len();
    let (compared, beyond) = comparable_steps(facts, steps);
    // The tokens decode steps were fed, then one prefill over all of them.
    let mut all = facts.prompt.to_vec();
    all.extend(&incremental.sampled[..compared]);
    let full = run_engine(engine, &greedy(all, 0), &taps)?;
    let full_logits = full
        .captures
        .get(Step::Prefill, Stage::Logits)
        .ok_or("no logits from the full recompute")?;
    let v = facts.config.vocab;
    let (tol, basis) = allowance(k, facts);
    let mut worst: Option<(f64, Step)> = None;
    for step in Step::sequence(compared) {
        let inc = incremental
            .captures
            .get(step, Stage::Logits)
            .ok_or_else(|| format!("no logits at {step}"))?;
        let (start, rows) = match step {
            Step::Prefill => (0, p),
            Step::Decode(n) => (p + n - 1, 1),
        };
        let reference = Tensor::new(
            vec![rows, v],
            full_logits.data()[start * v..(start + rows) * v].to_vec(),
        );
        let c = compare(inc, &reference, tol).map_err(|e| format!("{step}: {e}"))?;
        let max_abs = c.max_abs.as_ref().map_or(0.0, |m| m.0);
        if !c.passed() {
            return Ok(Verdict::fail(format!(
                "incremental decode differs from a full recompute over prompt + {steps} generated tokens at {step} \
                 (rows {start}..{}){basis}:\n{}",
                start + rows,
                c.explain()
            ))
            .metric("max_abs", max_abs)
            .metric("atol", tol.atol));
        }
        if worst.is_none_or(|(w, _)| max_abs > w) {
            worst = Some((max_abs, step));
        }
    }
    let (w, at) = worst.expect("at least the prefill step");
    Ok(Verdict::pass(format!(
        "incremental logits over {compared} decode steps equal a full recompute within atol {} rtol {}{basis}; worst \
         max|Δ| {w:.2e} at {at}{}",
        fmt_tol(tol.atol, k.atol),
        fmt_tol(tol.rtol, k.rtol),
        beyond.map(|b| format!("; {b}")).unwrap_or_default()
    ))
    .metric("max_abs", w)
    .metric("atol", tol.atol))
}

/// How many decode steps a recompute can be compared with, and why the rest
/// are not: a length-dependent RoPE table (HF's `dynamic_rope_update`)
/// changes once a pass reaches past its boundary, and the keys cached before
/// keep the rotation of the pass that computed them.
fn comparable_steps(facts: &Facts, steps: usize) -> (usize, Option<String>) {
    let Some(sc) = facts.config.rope_scaling.as_ref().filter(|s| s.switch_after().is_some()) else {
        return (steps, None);
    };
    let p = facts.prompt.len();
    let key0 = sc.table_key(p);
    let same = (1..=steps).take_while(|&n| sc.table_key(p + n) == key0).count();
    if same == steps {
        return (steps, None);
    }
    let b = sc.switch_after().expect("filtered");
    let first = same + 1;
    (
        same,
        Some(format!(
            "decode{first}..decode{steps} not compared: from decode{first} (a pass of {} positions, past {b}) HF's {} \
             rotates each pass with the table of its own length and never re-rotates the keys already cached, so \
             incremental decode and a recompute differ there by design (HF's own `dynamic_rope_update`); those steps \
             are judged by the goldens, which HF recorded incrementally",
            p + first,
            sc.name()
        )),
    )
}

/// The spec's number as written; a derived one to 3 digits.
fn fmt_tol(x: f64, spec: f64) -> String {
    if x == spec {
        format!("{x}")
    } else {
        format!("{x:.3e}")
    }
}

/// The tolerance for the engine, and for the message how it was derived
/// (empty for the spec's own numbers). See the module comment.
fn allowance(k: &KvCache, facts: &Facts) -> (Tolerance, String) {
    allowance_of(k.atol, k.rtol, facts)
}

/// The allowance of two paths that round the same arithmetic differently
/// (see the module comment), from the spec's `atol`/`rtol` for its storage:
/// also what the serving checks allow an engine that is not batch-invariant.
pub(super) fn allowance_of(atol: f64, rtol: f64, facts: &Facts) -> (Tolerance, String) {
    let k = KvCache {
        atol,
        rtol,
        decode_steps: None,
    };
    let spec = Tolerance {
        atol: k.atol,
        rtol: k.rtol,
    };
    let arith = facts.arithmetic;
    let plain = Arithmetic::of_storage(facts.storage);
    if arith == plain {
        return (spec, String::new());
    }
    let factor = facts.scaled.factor;
    if let Some((r, source)) = peer_error(facts) {
        let atol = k.atol.max(2.0 * factor * r);
        return (
            Tolerance { atol, rtol: k.rtol },
            format!(
                " (the engine's arithmetic {arith}: 2 × factor {factor} × {r:.3e}, the error of golden `{source}` of \
                 that arithmetic against the oracle at the logits; the spec's atol is for {plain})"
            ),
        );
    }
    if arith.kv != facts.storage && !arith.quantises() {
        let ratio = arith.kv.unit_roundoff() / facts.storage.unit_roundoff();
        return (
            Tolerance {
                atol: k.atol * ratio,
                rtol: k.rtol * ratio,
            },
            format!(
                " (the engine's arithmetic {arith}: the spec's allowance for {plain} at the {} KV cache's unit \
                 roundoff, × {ratio})",
                arith.kv
            ),
        );
    }
    (
        spec,
        format!(
            " (the spec's allowance for {plain}: the engine computes in {arith}, and no golden of that arithmetic \
             with an oracle says how far it may be from the exact logits)"
        ),
    )
}

/// The largest error against the oracle at the logits (any recorded step)
/// of a golden whose arithmetic is the engine's, and its name.
fn peer_error(facts: &Facts) -> Option<(f64, String)> {
    let oracle = facts.oracle?;
    let mut worst: Option<(f64, String)> = None;
    for (name, g) in facts.goldens {
        if measure::source_arithmetic(facts, name).ok() != Some(facts.arithmetic) {
            continue;
        }
        for (step, stage) in g.keys().filter(|(_, s)| *s == Stage::Logits) {
            let (Some(r), Some(o)) = (g.get(*step, *stage), oracle.get(*step, *stage)) else {
                continue;
            };
            if let Ok((e, _)) = scaled::max_error(r, o) {
                if e.is_finite() && worst.as_ref().is_none_or(|(w, _)| e > *w) {
                    worst = Some((e, name.clone()));
                }
            }
        }
    }
    worst.filter(|(e, _)| *e > 0.0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::Plan;
    use crate::spec::Spec;
    use crate::tensor::DType;
    use std::path::Path;

    fn plan() -> Plan {
        let spec = Spec::load(&Path::new(env!("CARGO_MANIFEST_DIR")).join("specs/qwen2-tiny.yaml")).unwrap();
        Plan::build(spec, None).unwrap()
    }

    #[test]
    fn the_allowance_follows_the_engines_arithmetic() {
        let plan = plan();
        let k = KvCache::bare();
        let mut facts = plan.facts();
        // Plain f32: the spec's numbers as written.
        let (tol, basis) = allowance(&k, &facts);
        assert_eq!((tol.atol, tol.rtol, basis.as_str()), (k.atol, k.rtol, ""));
        // An f16 KV cache and no golden of that arithmetic: the spec's
        // allowance at f16's unit roundoff.
        let kv16 = Arithmetic {
            kv: DType::F16,
            ..Arithmetic::F32
        };
        facts.arithmetic = kv16;
        let (tol, basis) = allowance(&k, &facts);
        assert_eq!(tol.atol, k.atol * 8192.0);
        assert!(basis.contains("unit roundoff"), "{basis}");
        // A golden of that arithmetic with an oracle: twice its allowance at
        // the logits (factor × its error against the oracle).
        let mut scaled = facts.scaled.clone();
        scaled.arithmetic.insert("llama.cpp".into(), kv16);
        facts.scaled = &scaled;
        let (r, source) = peer_error(&facts).expect("the llama.cpp golden and the oracle have logits");
        assert_eq!(source, "llama.cpp");
        let (tol, basis) = allowance(&k, &facts);
        assert_eq!(tol.atol, k.atol.max(2.0 * scaled.factor * r));
        assert!(basis.contains("golden `llama.cpp`"), "{basis}");
        // Quantised activations with no such golden: nothing to derive from,
        // the spec's numbers, and the message says why.
        facts.arithmetic = Arithmetic {
            activations: crate::arithmetic::Activations::Q8 { block: 256 },
            ..Arithmetic::F32
        };
        let (tol, basis) = allowance(&k, &facts);
        assert_eq!(tol.atol, k.atol);
        assert!(basis.contains("no golden of that arithmetic"), "{basis}");
    }
}
