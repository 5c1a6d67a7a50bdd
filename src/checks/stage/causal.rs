//! `causal`: attention probabilities put exactly 0 on future positions.
//! Planned only at the prefill: a single-token step has no future positions,
//! so the check would look at nothing there (never a vacuous pass).

use std::sync::Arc;

use serde::de::{Deserialize, Deserializer};

use crate::checks::facts::Facts;
use crate::checks::family::{Family, Metric};
use crate::checks::invariants;
use crate::checks::kind::{At, Kind, RuleEnv, StageCheck, StageRule};
use crate::checks::params::Empty;
use crate::checks::verdict::Verdict;
use crate::stage::{BlockStage, Stage, Step};

#[derive(Clone, Debug, PartialEq)]
pub struct Causal;

impl Kind for Causal {
    const NAME: &'static str = "causal";
    const PARAMS: &'static str = "none";
    const ABOUT: &'static str = "blk.*.attn_probs only: entries on future positions, and on a sliding-window layer keys older than the window, are exactly 0 (planned at the prefill, and at every step of a sliding-window layer)";
    fn bare() -> Self {
        Causal
    }
    fn parse<'de, D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        Empty::deserialize(d).map(|_| Causal)
    }
}

impl StageRule for Causal {
    fn kind(&self) -> &'static str {
        Self::NAME
    }
    fn expand(&self, stage: Stage, _: &RuleEnv) -> Result<Vec<Arc<dyn StageCheck>>, String> {
        if !matches!(stage, Stage::Block(_, BlockStage::AttnProbs)) {
            return Err(format!("`causal` applies to blk.*.attn_probs, not `{stage}`"));
        }
        Ok(vec![Arc::new(Causal)])
    }
}

impl StageCheck for Causal {
    fn id(&self) -> String {
        Self::NAME.into()
    }
    fn family(&self) -> Family {
        Family::Invariant
    }
    fn metric(&self) -> Option<Metric> {
        Some(Metric::FutureMaxAbs)
    }
    /// The prefill, and every step of a sliding-window layer (a decode row
    /// has keys older than its window once the cache outgrows it).
    fn planned(&self, step: Step, stage: Stage, facts: &Facts) -> bool {
        step == Step::Prefill || stage.layer().is_some_and(|l| facts.config.window_of(l).is_some())
    }
    fn judge(&self, facts: &Facts, at: &At) -> Verdict {
        let window = at.stage.layer().and_then(|l| facts.config.window_of(l));
        match at.capture() {
            Ok(t) => invariants::causal_window(t, at.positions(), window),
            Err(v) => v,
        }
    }
}
