//! `finite`: no NaN and no ±Inf in the capture.

use std::sync::Arc;

use serde::de::{Deserialize, Deserializer};

use crate::checks::facts::Facts;
use crate::checks::family::Family;
use crate::checks::invariants;
use crate::checks::kind::{At, Kind, RuleEnv, StageCheck, StageRule};
use crate::checks::params::Empty;
use crate::checks::verdict::Verdict;
use crate::stage::Stage;

#[derive(Clone, Debug, PartialEq)]
pub struct Finite;

impl Kind for Finite {
    const NAME: &'static str = "finite";
    const PARAMS: &'static str = "none";
    const ABOUT: &'static str = "no NaN and no ±Inf in the capture; the message counts each kind and names the first";
    fn bare() -> Self {
        Finite
    }
    fn parse<'de, D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        Empty::deserialize(d).map(|_| Finite)
    }
}

impl StageRule for Finite {
    fn kind(&self) -> &'static str {
        Self::NAME
    }
    fn expand(&self, _: Stage, _: &RuleEnv) -> Result<Vec<Arc<dyn StageCheck>>, String> {
        Ok(vec![Arc::new(Finite)])
    }
}

impl StageCheck for Finite {
    fn id(&self) -> String {
        Self::NAME.into()
    }
    fn family(&self) -> Family {
        Family::Invariant
    }
    fn judge(&self, _: &Facts, at: &At) -> Verdict {
        match at.capture() {
            Ok(t) => invariants::finite(t),
            Err(v) => v,
        }
    }
}
