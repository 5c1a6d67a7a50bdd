//! `feature_select`: LLaVA's projector input is one of the tower's hidden
//! states, `vision_feature_layer` (−2: the output of the last block but one;
//! 0: `pre_layrnorm`'s), with each tower image's CLS row dropped under the
//! `default` strategy — a copy, so `vision.features` must equal the engine's
//! own capture of that stage, row for row, bit for bit. The last layer's
//! features, or CLS kept, fail here before the projector mixes them.

use std::sync::Arc;

use serde::de::{Deserialize, Deserializer};

use crate::checks::facts::Facts;
use crate::checks::family::{Family, Metric};
use crate::checks::kind::{At, Kind, RuleEnv, StageCheck, StageRule};
use crate::checks::params::Empty;
use crate::checks::verdict::Verdict;
use crate::model::llava::Select;
use crate::stage::{Stage, Step, VBlock, VisionStage};

/// The hidden state the features copy (None until a plan knows the model).
#[derive(Clone, Debug, PartialEq)]
pub struct FeatureSelect(Option<Stage>);

impl Kind for FeatureSelect {
    const NAME: &'static str = "feature_select";
    const PARAMS: &'static str = "none";
    const ABOUT: &'static str = "vision.features only (LLaVA): the hidden state vision_feature_layer names, each \
                                 image's CLS row dropped under the default strategy, bit for bit";
    fn bare() -> Self {
        FeatureSelect(None)
    }
    fn parse<'de, D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        Empty::deserialize(d).map(|_| FeatureSelect(None))
    }
}

impl StageRule for FeatureSelect {
    fn kind(&self) -> &'static str {
        Self::NAME
    }
    fn expand(&self, stage: Stage, env: &RuleEnv) -> Result<Vec<Arc<dyn StageCheck>>, String> {
        if stage != Stage::Vision(VisionStage::Features) {
            return Err(format!("`feature_select` applies to vision.features, not `{stage}`"));
        }
        Ok(vec![Arc::new(FeatureSelect(env.llava_feature_layer.map(hidden_state)))])
    }
}

/// The stage holding hidden state `i` (0: `pre_layrnorm`'s output; i: block
/// i − 1's).
pub fn hidden_state(i: usize) -> Stage {
    match i {
        0 => Stage::Vision(VisionStage::PreNorm),
        i => Stage::Vision(VisionStage::Block(i - 1, VBlock::Out)),
    }
}

impl StageCheck for FeatureSelect {
    fn id(&self) -> String {
        Self::NAME.into()
    }
    fn family(&self) -> Family {
        Family::Invariant
    }
    fn metric(&self) -> Option<Metric> {
        Some(Metric::MaxAbs)
    }
    fn reads(&self, stage: Stage) -> Vec<Stage> {
        std::iter::once(stage).chain(self.0).collect()
    }
    fn planned(&self, step: Step, _: Stage, facts: &Facts) -> bool {
        step == Step::Prefill && facts.image.is_some() && facts.config.llava().is_some()
    }
    fn judge(&self, facts: &Facts, at: &At) -> Verdict {
        let Some(lc) = facts.config.llava() else {
            return Verdict::not_applicable("not a LLaVA model");
        };
        let source = hidden_state(lc.feature_layer);
        let (feats, hidden) = match (at.capture(), at.capture_of(source)) {
            (Ok(a), Ok(b)) => (a, b),
            (Err(v), _) | (_, Err(v)) => return v,
        };
        let (n, ev) = (lc.tower.patches(), lc.tower.hidden);
        let rows = n + 1;
        let images = hidden.shape().first().copied().unwrap_or(0) / rows;
        let skip = usize::from(lc.select == Select::Default);
        let want: Vec<f32> = hidden
            .data()
            .chunks_exact(rows * ev)
            .flat_map(|img| img[skip * ev..].iter().copied())
            .collect();
        let what = format!(
            "hidden state {} ({source}){}",
            lc.feature_layer,
            if skip == 1 { " without each image's CLS row" } else { "" }
        );
        if feats.shape() != [images * (rows - skip), ev] {
            return Verdict::fail(format!(
                "vision.features has shape {:?}; {what} of {images} image(s) is [{}, {ev}]",
                feats.shape(),
                images * (rows - skip)
            ));
        }
        let mut first = None;
        let mut worst = 0.0f64;
        for (i, (a, b)) in feats.data().iter().zip(&want).enumerate() {
            if a.to_bits() != b.to_bits() {
                first.get_or_insert(i);
                worst = worst.max((a - b).abs() as f64);
            }
        }
        match first {
            None => Verdict::pass(format!("vision.features is {what}, bit for bit")).metric("max_abs", 0.0),
            Some(i) => Verdict::fail(format!(
                "vision.features differs from {what}: first at row {} (image {}, {} {}), max |Δ| {worst:.3e}",
                i / ev,
                i / ev / (rows - skip),
                feats.data()[i],
                want[i]
            ))
            .metric("max_abs", worst),
        }
    }
}
