//! `shape`: the capture has exactly the canonical shape of its stage
//! (`stage::shape`) at its step.

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
pub struct Shape;

impl Kind for Shape {
    const NAME: &'static str = "shape";
    const PARAMS: &'static str = "none";
    const ABOUT: &'static str = "the capture has exactly its stage's canonical shape at its step";
    fn bare() -> Self {
        Shape
    }
    fn parse<'de, D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        Empty::deserialize(d).map(|_| Shape)
    }
}

impl StageRule for Shape {
    fn kind(&self) -> &'static str {
        Self::NAME
    }
    fn expand(&self, _: Stage, _: &RuleEnv) -> Result<Vec<Arc<dyn StageCheck>>, String> {
        Ok(vec![Arc::new(Shape)])
    }
}

impl StageCheck for Shape {
    fn id(&self) -> String {
        Self::NAME.into()
    }
    fn family(&self) -> Family {
        Family::Invariant
    }
    fn judge(&self, facts: &Facts, at: &At) -> Verdict {
        match at.capture() {
            Ok(t) => invariants::shape(t, &facts.expected_shape(at.step, at.stage)),
            Err(v) => v,
        }
    }
}
