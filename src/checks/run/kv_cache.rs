//! `kv_cache`: incremental decode (prefill, then one token at a time through
//! the KV cache) gives the logits of one full recompute over the same tokens.
//! A stale, misplaced or short cache shows here even when every prefill
//! stage is right.

use std::sync::Arc;

use serde::de::{Deserialize, Deserializer};

use super::run_engine;
use crate::checks::facts::Facts;
use crate::checks::family::Metric;
use crate::checks::kind::{Count, Kind, Limit, RuleEnv, RunCheck, RunRule};
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
    };
    let incremental = run_engine(engine, &greedy(facts.prompt.to_vec(), steps), &taps)?;
    // The tokens decode steps were fed, then one prefill over all of them.
    let mut all = facts.prompt.to_vec();
    all.extend(&incremental.sampled[..steps]);
    let full = run_engine(engine, &greedy(all, 0), &taps)?;
    let full_logits = full
        .captures
        .get(Step::Prefill, Stage::Logits)
        .ok_or("no logits from the full recompute")?;
    let v = facts.config.vocab;
    let p = facts.prompt.len();
    let tol = Tolerance {
        atol: k.atol,
        rtol: k.rtol,
    };
    let mut worst: Option<(f64, Step)> = None;
    for step in Step::sequence(steps) {
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
                 (rows {start}..{}):\n{}",
                start + rows,
                c.explain()
            ))
            .metric("max_abs", max_abs));
        }
        if worst.is_none_or(|(w, _)| max_abs > w) {
            worst = Some((max_abs, step));
        }
    }
    let (w, at) = worst.expect("at least the prefill step");
    Ok(Verdict::pass(format!(
        "incremental logits over {steps} decode steps equal a full recompute within atol {} rtol {}; worst max|Δ| \
         {w:.2e} at {at}",
        k.atol, k.rtol
    ))
    .metric("max_abs", w))
}
