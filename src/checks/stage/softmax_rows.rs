//! `softmax_rows`: every row over the last dimension is a distribution
//! (entries in [0, 1], summing to 1 within `tol`).
//!
//! With attention sinks (gpt-oss) a row of `blk.N.attn_probs` is a softmax
//! with one more entry, the head's sink logit σ_h, dropped after it: for any
//! visible key j, the sink's share is p_j·e^(σ_h − s_j) (same denominator),
//! so the row must satisfy Σp + p_j·e^(σ_h − s_j) = 1 within `tol`, j the
//! row's largest probability (its relative error is the smallest), s_j the
//! engine's own `attn_scores`, σ_h read from the model file (held in the
//! engine's storage type: its rounding there is allowed for). A softmax that
//! leaves the sink out sums to 1 and fails by the sink's share.

use std::sync::Arc;

use serde::de::{Deserialize, Deserializer};

use crate::checks::facts::Facts;
use crate::checks::family::{Family, Metric};
use crate::checks::invariants;
use crate::checks::kind::{At, Kind, RuleEnv, StageCheck, StageRule};
use crate::checks::params::tol_value;
use crate::checks::verdict::Verdict;
use crate::stage::{BlockStage, Stage};

#[derive(Clone, Debug, PartialEq, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SoftmaxRows {
    /// Allowed |Σ − 1| per row (default 1e-5).
    #[serde(default = "default_tol", deserialize_with = "tol_value")]
    pub tol: f64,
}

fn default_tol() -> f64 {
    1e-5
}

impl Kind for SoftmaxRows {
    const NAME: &'static str = "softmax_rows";
    const PARAMS: &'static str = "tol (1e-5)";
    const ABOUT: &'static str = "every row over the last dimension is a distribution: entries in [0, 1 + tol], summing to 1 within tol";
    fn bare() -> Self {
        SoftmaxRows { tol: default_tol() }
    }
    fn parse<'de, D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        Ok(Option::<SoftmaxRows>::deserialize(d)?.unwrap_or_else(Self::bare))
    }
}

impl StageRule for SoftmaxRows {
    fn kind(&self) -> &'static str {
        Self::NAME
    }
    fn expand(&self, stage: Stage, env: &RuleEnv) -> Result<Vec<Arc<dyn StageCheck>>, String> {
        match stage {
            Stage::Block(layer, BlockStage::AttnProbs) if env.attn_sinks => {
                Ok(vec![Arc::new(SinkRows { layer, tol: self.tol })])
            }
            _ => Ok(vec![Arc::new(self.clone())]),
        }
    }
}

/// `softmax_rows` at a layer with attention sinks (module comment).
#[derive(Clone, Debug, PartialEq)]
pub struct SinkRows {
    pub layer: usize,
    pub tol: f64,
}

impl StageCheck for SinkRows {
    fn id(&self) -> String {
        SoftmaxRows::NAME.into()
    }
    fn family(&self) -> Family {
        Family::Invariant
    }
    fn metric(&self) -> Option<Metric> {
        Some(Metric::MaxRowErr)
    }
    fn reads(&self, stage: Stage) -> Vec<Stage> {
        vec![stage, Stage::Block(self.layer, BlockStage::AttnScores)]
    }
    fn judge(&self, facts: &Facts, at: &At) -> Verdict {
        let scores_stage = Stage::Block(self.layer, BlockStage::AttnScores);
        let (p, s) = match (at.capture(), at.capture_of(scores_stage)) {
            (Ok(p), Ok(s)) => (p, s),
            (Err(v), _) | (_, Err(v)) => return v,
        };
        let name = format!("model.layers.{}.self_attn.sinks", self.layer);
        let sinks = match facts.file.tensor(&name) {
            Ok(t) => t,
            Err(e) => return Verdict::fail(format!("softmax_rows: cannot read the sinks `{name}`: {e}")),
        };
        let heads = sinks.numel();
        if p.shape() != s.shape() || p.shape().len() != 3 || p.shape()[0] != heads {
            return Verdict::fail(format!(
                "softmax_rows: {} has shape {:?} and {scores_stage} {:?}; expected [heads = {heads}, T, S] both",
                at.stage,
                p.shape(),
                s.shape()
            ));
        }
        // An engine holds its weights, the sinks among them, in its storage
        // type (the `weights` check compares them so).
        let u_sink = match facts.storage {
            crate::tensor::DType::F32 => 0.0,
            d => d.unit_roundoff(),
        };
        invariants::softmax_rows_with_sinks(p, s, sinks.data(), self.tol, u_sink)
    }
}

impl StageCheck for SoftmaxRows {
    fn id(&self) -> String {
        Self::NAME.into()
    }
    fn family(&self) -> Family {
        Family::Invariant
    }
    fn metric(&self) -> Option<Metric> {
        Some(Metric::MaxRowErr)
    }
    fn judge(&self, _: &Facts, at: &At) -> Verdict {
        match at.capture() {
            Ok(t) => invariants::softmax_rows(t, self.tol),
            Err(v) => v,
        }
    }
}
