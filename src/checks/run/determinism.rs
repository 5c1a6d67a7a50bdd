//! `determinism`: runs with the same seed agree bitwise (every capture, every
//! token), and a different seed changes the sampled tokens (the seed reaches
//! the sampler).

use std::sync::Arc;

use serde::de::{Deserialize, Deserializer};

use super::run_engine;
use crate::checks::facts::Facts;
use crate::checks::kind::{Count, Kind, Limit, RuleEnv, RunCheck, RunRule};
use crate::checks::verdict::Verdict;
use crate::engine::{Engine, RunOutput, RunRequest, TapSet};
use crate::sampling::Sampling;

#[derive(Clone, Debug, PartialEq, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Determinism {
    /// Runs with the same seed that must agree bitwise (at least 3).
    #[serde(default = "default_runs")]
    pub runs: usize,
    /// Sampling for these runs; must have temperature > 0 so a different seed
    /// is expected to change the tokens.
    #[serde(default = "default_sampling")]
    pub sampling: Sampling,
    /// Seed of the repeated runs (default: the spec's seed).
    pub seed: Option<u64>,
    /// A second seed that must change the sampled tokens (default: seed + 1).
    pub other_seed: Option<u64>,
    /// Decode steps per run (default 8: enough draws that two seeds differ).
    #[serde(default = "default_steps")]
    pub decode_steps: usize,
}

fn default_runs() -> usize {
    3
}
fn default_steps() -> usize {
    8
}
fn default_sampling() -> Sampling {
    Sampling::Random {
        temperature: 1.0,
        top_k: Some(50),
        top_p: Some(0.95),
    }
}

impl Kind for Determinism {
    const NAME: &'static str = "determinism";
    const PARAMS: &'static str = "runs (3, >= 3), decode_steps (8), sampling (temperature 1.0, top_k 50, top_p 0.95), seed (the spec's), other_seed (seed + 1)";
    const ABOUT: &'static str = "runs with one seed are bitwise identical, and another seed changes the sampled tokens";
    fn bare() -> Self {
        Determinism {
            runs: default_runs(),
            sampling: default_sampling(),
            seed: None,
            other_seed: None,
            decode_steps: default_steps(),
        }
    }
    fn parse<'de, D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        Ok(Option::<Determinism>::deserialize(d)?.unwrap_or_else(Self::bare))
    }
    fn check_params(&self) -> Result<(), String> {
        if self.runs < 3 {
            return Err(format!("determinism needs runs >= 3, got {}", self.runs));
        }
        if !matches!(self.sampling, Sampling::Random { temperature, .. } if temperature > 0.0) {
            return Err(
                "determinism needs sampling with temperature > 0 (greedy cannot show that the seed matters)".into(),
            );
        }
        Ok(())
    }
}

impl RunRule for Determinism {
    fn kind(&self) -> &'static str {
        Self::NAME
    }
    fn counts(&self) -> Vec<Count> {
        vec![
            Count {
                key: "runs",
                what: "determinism.runs",
                n: self.runs,
                limit: Limit::Runs,
            },
            Count {
                key: "decode_steps",
                what: "determinism.decode_steps",
                n: self.decode_steps,
                limit: Limit::DecodeSteps,
            },
        ]
    }
    fn expand(&self, _: &RuleEnv) -> Arc<dyn RunCheck> {
        Arc::new(self.clone())
    }
}

impl RunCheck for Determinism {
    fn id(&self) -> String {
        Self::NAME.into()
    }
    fn steps(&self, _: usize) -> Option<(&'static str, usize)> {
        Some(("the prompt plus determinism.decode_steps", self.decode_steps))
    }
    fn reruns(&self) -> bool {
        true
    }
    fn evaluate(&self, facts: &Facts, engine: &dyn Engine) -> Verdict {
        evaluate(self, facts, engine).unwrap_or_else(|e| Verdict::fail(format!("the engine failed: {e}")))
    }
}

fn evaluate(d: &Determinism, facts: &Facts, engine: &dyn Engine) -> Result<Verdict, String> {
    let seed = d.seed.unwrap_or(facts.seed);
    let other_seed = d.other_seed.unwrap_or(seed.wrapping_add(1));
    let req = |seed| RunRequest {
        prompt: facts.prompt.to_vec(),
        decode_steps: d.decode_steps,
        sampling: d.sampling.clone(),
        seed,
        forced: None,
        image: facts.image.cloned(),
    };
    // Every stage the model has (no q_norm on a model without it) that the
    // engine can tap, so any engine is asked for exactly what it computes.
    let taps = engine
        .capabilities()
        .tappable(facts.config, d.sampling != Sampling::Greedy);
    let first = run_engine(engine, &req(seed), &taps)?;
    for run in 2..=d.runs {
        let again = run_engine(engine, &req(seed), &taps)?;
        if again.sampled != first.sampled {
            return Ok(Verdict::fail(format!(
                "run {run} with seed {seed} sampled {:?}, run 1 sampled {:?}",
                again.sampled, first.sampled
            ))
            .metric("runs", d.runs as f64));
        }
        if let Some(diff) = first_bitwise_difference(&first, &again) {
            return Ok(Verdict::fail(format!(
                "run {run} with seed {seed} is not bitwise identical to run 1: {diff}"
            ))
            .metric("runs", d.runs as f64));
        }
    }
    let other = run_engine(engine, &req(other_seed), &TapSet::none())?;
    if other.sampled == first.sampled {
        return Ok(Verdict::fail(format!(
            "seed {other_seed} sampled the same {} tokens as seed {seed} ({:?}): the seed does not reach the sampler",
            first.sampled.len(),
            first.sampled
        )));
    }
    Ok(Verdict::pass(format!(
        "{} runs with seed {seed} bitwise identical ({} captures, tokens {:?}); seed {other_seed} sampled {:?}",
        d.runs,
        first.captures.len(),
        first.sampled,
        other.sampled
    ))
    .metric("runs", d.runs as f64)
    .metric("captures", first.captures.len() as f64))
}

fn first_bitwise_difference(a: &RunOutput, b: &RunOutput) -> Option<String> {
    for ((key, ta), (_, tb)) in a.captures.iter().zip(b.captures.iter()) {
        if ta.shape() != tb.shape() {
            return Some(format!(
                "{}/{} shape {:?} vs {:?}",
                key.0,
                key.1,
                ta.shape(),
                tb.shape()
            ));
        }
        let differing = ta
            .data()
            .iter()
            .zip(tb.data())
            .filter(|(x, y)| x.to_bits() != y.to_bits())
            .count();
        if let Some(i) = ta
            .data()
            .iter()
            .zip(tb.data())
            .position(|(x, y)| x.to_bits() != y.to_bits())
        {
            return Some(format!(
                "{}/{}: {differing} of {} values differ; first at {:?} ({:e} vs {:e})",
                key.0,
                key.1,
                ta.numel(),
                ta.unravel(i),
                ta.data()[i],
                tb.data()[i]
            ));
        }
    }
    (a.captures.len() != b.captures.len()).then(|| format!("{} vs {} captures", a.captures.len(), b.captures.len()))
}
