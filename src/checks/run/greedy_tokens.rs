//! `greedy_tokens`: greedy decoding from the prompt picks the tokens a golden
//! source's reference picked (its provenance's `greedy_ids`).

use std::sync::Arc;

use serde::de::{Deserialize, Deserializer};

use super::run_engine;
use crate::checks::facts::Facts;
use crate::checks::kind::{Kind, Located, RuleEnv, RunCheck, RunRule};
use crate::checks::params::StrOrMap;
use crate::checks::verdict::Verdict;
use crate::engine::{Engine, RunRequest, TapSet};
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
    let expected = golden.greedy_ids().map_err(|e| e.to_string())?;
    if golden.prompt() != facts.prompt {
        return Ok(Verdict::fail(format!(
            "the run's prompt {:?} is not the prompt golden `{source}` was recorded with {:?}",
            facts.prompt,
            golden.prompt()
        )));
    }
    let out = run_engine(
        engine,
        &RunRequest {
            prompt: facts.prompt.to_vec(),
            decode_steps: expected.len().saturating_sub(1),
            sampling: Sampling::Greedy,
            seed: facts.seed,
            forced: None,
        },
        &TapSet::none(),
    )?;
    match out.sampled.iter().zip(&expected).position(|(a, b)| a != b) {
        Some(i) => Ok(Verdict::fail(format!(
            "greedy token {i} differs: engine {} vs golden `{source}` {} (engine {:?}, golden {:?})",
            out.sampled[i], expected[i], out.sampled, expected
        ))
        .metric("first_mismatch", i as f64)),
        None => Ok(Verdict::pass(format!(
            "{} greedy tokens equal golden `{source}`: {:?}",
            expected.len(),
            expected
        ))
        .metric("tokens", expected.len() as f64)),
    }
}
