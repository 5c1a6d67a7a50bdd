//! `greedy_tokens`: greedy decoding from the prompt picks the tokens a golden
//! source's reference picked (its provenance's `greedy_ids`).
//!
//! A pick that differs is a near-tie, not an engine failure, when the
//! engine's own logits prefer its pick by a margin its allowed error could
//! produce: with the scaled policy, each logit of the engine at that step is
//! within A of the exact (float64 oracle) value, A the allowance the golden
//! check at `<step>/logits` derives (and that check must pass), so the exact
//! margin is at least m − 2A; when m ≤ 2A the exact answer may pick the
//! golden's token, and the engine cannot be faulted for its own. A pick that
//! is not the argmax of the engine's own logits is never excused, nor is an
//! exact tie (m = 0, common once logits are stored in bf16) broken other than
//! to the lowest index, the rule HF and llama.cpp follow. Up to the differing step the engine was fed the golden's tokens, so
//! its logits there are comparable; the tokens after it are not judged.

use std::sync::Arc;

use serde::de::{Deserialize, Deserializer};

use super::run_engine;
use crate::checks::facts::Facts;
use crate::checks::kind::{Kind, Located, RuleEnv, RunCheck, RunRule};
use crate::checks::params::StrOrMap;
use crate::checks::verdict::Verdict;
use crate::checks::floor;
use crate::checks::kind::{At, StageCheck};
use crate::checks::stage::GoldenCheck;
use crate::engine::{Engine, RunOutput, RunRequest, TapSet};
use crate::stage::{Stage, Step};
use crate::sampling::Sampling;

/// The rule as written: `greedy_tokens` (the spec's only source), `{greedy_tokens: hf}`
/// or `{greedy_tokens: {source: hf}}`.
#[derive(Clone, Debug, PartialEq)]
pub struct GreedyTokens {
    pub source: Option<String>,
}

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct Params {
    source: Option<String>,
}

impl Kind for GreedyTokens {
    const NAME: &'static str = "greedy_tokens";
    const PARAMS: &'static str = "a source name; none: the only declared source";
    const ABOUT: &'static str = "free-running greedy decoding picks the golden source's tokens";
    fn bare() -> Self {
        GreedyTokens { source: None }
    }
    fn parse<'de, D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        Ok(GreedyTokens {
            source: match Option::<StrOrMap<Params>>::deserialize(d)? {
                None => None,
                Some(StrOrMap::Str(s)) => Some(s),
                Some(StrOrMap::Map(p)) => p.source,
            },
        })
    }
}

impl RunRule for GreedyTokens {
    fn kind(&self) -> &'static str {
        Self::NAME
    }
    fn validate(&self, env: &RuleEnv) -> Result<(), Located> {
        match &self.source {
            Some(s) => env.require_source("greedy_tokens check", s),
            None if env.goldens.len() != 1 => Err(Located {
                needle: Self::NAME.into(),
                msg: format!(
                    "greedy_tokens needs `source:` when the spec declares {} golden sources",
                    env.goldens.len()
                ),
            }),
            None => Ok(()),
        }
    }
    /// Without a source, the spec's only one.
    fn expand(&self, env: &RuleEnv) -> Arc<dyn RunCheck> {
        Arc::new(GreedyTokens {
            source: self.source.clone().or_else(|| env.goldens.first().cloned()),
        })
    }
}

impl RunCheck for GreedyTokens {
    fn id(&self) -> String {
        match &self.source {
            Some(s) => format!("{}:{s}", Self::NAME),
            None => Self::NAME.into(),
        }
    }
    fn evaluate(&self, facts: &Facts, engine: &dyn Engine) -> Verdict {
        let result = match &self.source {
            Some(s) => evaluate(facts, engine, s),
            None => Err("greedy_tokens needs a golden source and the spec declares none".into()),
        };
        result.unwrap_or_else(|e| Verdict::fail(format!("the engine failed: {e}")))
    }
}

fn evaluate(facts: &Facts, engine: &dyn Engine, source: &str) -> Result<Verdict, String> {
    let golden = facts
        .goldens
        .get(source)
        .ok_or_else(|| format!("golden source `{source}` is not loaded"))?;
    let mut expected = golden.greedy_ids().map_err(|e| e.to_string())?;
    // A reference that follows another rule from a position on
    // (`reference_rules`) is held to its picks from logits before it only:
    // token i comes from the logits at position p − 1 + i.
    let mut cut = String::new();
    if let Some(from) = golden.departs_from() {
        let keep = (from + 1).saturating_sub(facts.prompt.len()).min(expected.len());
        if keep == 0 {
            return Ok(Verdict::not_applicable(format!(
                "golden `{source}` follows another rule from position {from} (`reference_rules`), before any token \
                 it picked"
            )));
        }
        if keep < expected.len() {
            cut = format!(
                " (the first {keep} of {}: `{source}` follows another rule from position {from})",
                expected.len()
            );
            expected.truncate(keep);
        }
    }
    if golden.prompt() != facts.prompt {
        return Ok(Verdict::fail(format!(
            "the run's prompt {:?} is not the prompt golden `{source}` was recorded with {:?}",
            facts.prompt,
            golden.prompt()
        )));
    }
    // The logits and what their allowance reads, to tell a near-tie.
    let taps: TapSet = std::iter::once(Stage::Logits)
        .chain(floor::inputs(facts.config, Stage::Logits))
        .collect();
    let out = run_engine(
        engine,
        &RunRequest {
            prompt: facts.prompt.to_vec(),
            decode_steps: expected.len().saturating_sub(1),
            sampling: Sampling::Greedy,
            seed: facts.seed,
            forced: None,
            image: facts.image.cloned(),
        },
        &taps,
    )?;
    match out.sampled.iter().zip(&expected).position(|(a, b)| a != b) {
        Some(i) => {
            let (e, g) = (out.sampled[i], expected[i]);
            let head = format!(
                "greedy token {i} differs: engine {e} vs golden `{source}` {g} (engine {:?}, golden {:?})",
                out.sampled, expected
            );
            Ok(match near_tie(facts, &out, source, i, e, g) {
                Ok(why) => Verdict::pass(format!(
                    "{i} greedy tokens equal golden `{source}`, then a near-tie: {why} ({head})"
                ))
                .metric("tokens", i as f64)
                .metric("near_tie", 1.0),
                Err(why) => Verdict::fail(format!("{head}: {why}")),
            }
            .metric("first_mismatch", i as f64))
        }
        None => Ok(Verdict::pass(format!(
            "{} greedy tokens equal golden `{source}`: {:?}{cut}",
            expected.len(),
            expected
        ))
        .metric("tokens", expected.len() as f64)),
    }
}

/// Whether the engine's pick `e` over the golden's `g` at greedy token `i`
/// is a near-tie (see the module comment): Ok with the margin and the
/// allowance, or Err saying why it is not, or cannot be told.
fn near_tie(facts: &Facts, out: &RunOutput, source: &str, i: usize, e: u32, g: u32) -> Result<String, String> {
    let step = *Step::sequence(i).last().expect("a sequence has its prefill");
    let logits = out
        .captures
        .get(step, Stage::Logits)
        .ok_or_else(|| format!("the engine did not capture {step}/logits, so its margin is unknown"))?;
    let v = logits.shape().last().copied().unwrap_or(0);
    let row = &logits.data()[logits.numel().saturating_sub(v)..];
    let (le, lg) = match (row.get(e as usize), row.get(g as usize)) {
        (Some(a), Some(b)) => (*a as f64, *b as f64),
        _ => return Err(format!("token {e} or {g} is outside the engine's {v} logits")),
    };
    let m = le - lg;
    if m < 0.0 || (m == 0.0 && e > g) {
        return Err(format!(
            "the engine's own logits {} (logit {le:e} for {e}, {lg:e} for {g}): its pick is not their argmax{}",
            if m == 0.0 { "tie" } else { "prefer the golden's token" },
            if m == 0.0 { " with ties to the lowest index" } else { "" }
        ));
    }
    let check = GoldenCheck {
        source: source.to_string(),
        tol: Default::default(),
    };
    let at = At {
        step,
        stage: Stage::Logits,
        run: Some(out),
    };
    if !check.planned(step, Stage::Logits, facts) {
        return Err(format!(
            "the engine prefers {e} by {m:.3e}, and golden `{source}` records no {step}/logits to derive an \
             allowance from"
        ));
    }
    let v = check.judge(facts, &at);
    let Some(&a) = v.metrics.get("allowed") else {
        return Err(format!(
            "the engine prefers {e} by {m:.3e}; a near-tie is told only under the scaled policy (a float64 oracle \
             that records {step}/logits), which derives the logits' allowance"
        ));
    };
    if v.failed() {
        return Err(format!("the engine's {step}/logits are outside their allowance: {}", v.message));
    }
    if m > 2.0 * a {
        return Err(format!(
            "the engine prefers {e} by {m:.3e}, more than twice the logits' allowance {a:.3e} could make"
        ));
    }
    let how = if m == 0.0 {
        format!("the engine's logits tie {e} with {g} (broken to the lower index)")
    } else {
        format!("the engine prefers {e} over {g} by {m:.3e}")
    };
    Ok(format!(
        "at {step} {how}, within twice the logits' allowance {a:.3e}, so the exact answer may pick either"
    ))
}
