//! `softmax_rows`: every row over the last dimension is a distribution
//! (entries in [0, 1], summing to 1 within `tol`).

use std::sync::Arc;

use serde::de::{Deserialize, Deserializer};

use crate::checks::facts::Facts;
use crate::checks::family::{Family, Metric};
use crate::checks::invariants;
use crate::checks::kind::{At, Kind, RuleEnv, StageCheck, StageRule};
use crate::checks::params::tol_value;
use crate::checks::verdict::Verdict;
use crate::stage::Stage;

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
    fn expand(&self, _: Stage, _: &RuleEnv) -> Result<Vec<Arc<dyn StageCheck>>, String> {
        Ok(vec![Arc::new(self.clone())])
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
