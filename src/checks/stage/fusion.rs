//! `fusion`: a vision-language model's fused embeddings are the text
//! embeddings with exactly the image-pad rows replaced, in order, by the
//! merger's rows — every other row bit-identical to `embed`, every image row
//! bit-identical to its merger row (a copy; HF's `masked_scatter`). Judged
//! on the engine's own captures, so a fusion one row off, or a dropped or
//! duplicated feature row, fails here and not downstream.

use std::sync::Arc;

use serde::de::{Deserialize, Deserializer};

use crate::checks::facts::Facts;
use crate::checks::family::{Family, Metric};
use crate::checks::kind::{At, Kind, RuleEnv, StageCheck, StageRule};
use crate::checks::params::Empty;
use crate::checks::verdict::Verdict;
use crate::stage::{Stage, Step, VisionStage};

#[derive(Clone, Debug, PartialEq)]
pub struct Fusion;

impl Kind for Fusion {
    const NAME: &'static str = "fusion";
    const PARAMS: &'static str = "none";
    const ABOUT: &'static str = "inputs_embeds only: equal to embed on every text row and to the merger's rows, in \
                                 order, on the image-pad rows, bit for bit";
    fn bare() -> Self {
        Fusion
    }
    fn parse<'de, D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        Empty::deserialize(d).map(|_| Fusion)
    }
}

impl StageRule for Fusion {
    fn kind(&self) -> &'static str {
        Self::NAME
    }
    fn expand(&self, stage: Stage, _: &RuleEnv) -> Result<Vec<Arc<dyn StageCheck>>, String> {
        if stage != Stage::InputsEmbeds {
            return Err(format!("`fusion` applies to inputs_embeds, not `{stage}`"));
        }
        Ok(vec![Arc::new(Fusion)])
    }
}

impl StageCheck for Fusion {
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
        vec![stage, Stage::Embed, Stage::Vision(VisionStage::Merger)]
    }
    fn planned(&self, step: Step, _: Stage, facts: &Facts) -> bool {
        step == Step::Prefill && facts.image.is_some()
    }
    fn judge(&self, facts: &Facts, at: &At) -> Verdict {
        let Some(vc) = &facts.config.vision else {
            return Verdict::not_applicable("the model has no vision tower");
        };
        let (fused, embed, merger) = match (
            at.capture(),
            at.capture_of(Stage::Embed),
            at.capture_of(Stage::Vision(VisionStage::Merger)),
        ) {
            (Ok(a), Ok(b), Ok(c)) => (a, b, c),
            (Err(v), _, _) | (_, Err(v), _) | (_, _, Err(v)) => return v,
        };
        let e = facts.config.hidden;
        let t = facts.prompt.len();
        if fused.shape() != [t, e] || embed.shape() != [t, e] || merger.shape().get(1) != Some(&e) {
            return Verdict::fail(format!(
                "shapes: inputs_embeds {:?}, embed {:?}, vision.merger {:?} (expected [{t}, {e}], [{t}, {e}], [M, {e}])",
                fused.shape(),
                embed.shape(),
                merger.shape()
            ));
        }
        let row = |x: &crate::tensor::Tensor, r: usize| x.data()[r * e..][..e].to_vec();
        let diff = |a: &[f32], b: &[f32]| a.iter().zip(b).fold(0.0f64, |m, (x, y)| m.max((x - y).abs() as f64));
        let mut feature = 0;
        let mut wrong: Vec<String> = Vec::new();
        let mut worst = 0.0f64;
        for r in 0..t {
            let is_pad = facts.prompt[r] == vc.image_token;
            let (want, what) = if is_pad && feature < merger.shape()[0] {
                feature += 1;
                (row(merger, feature - 1), format!("image-pad row {r} ≠ merger row {}", feature - 1))
            } else if is_pad {
                if wrong.len() < 4 {
                    wrong.push(format!(
                        "image-pad row {r} has no merger row to hold ({} rows)",
                        merger.shape()[0]
                    ));
                }
                continue;
            } else {
                (row(embed, r), format!("text row {r} (token {}) ≠ embed", facts.prompt[r]))
            };
            let got = row(fused, r);
            if got.iter().zip(&want).any(|(a, b)| a.to_bits() != b.to_bits()) {
                worst = worst.max(diff(&got, &want));
                if wrong.len() < 4 {
                    wrong.push(format!("{what} (max |Δ| {:.3e})", diff(&got, &want)));
                }
            }
        }
        let pads = facts.prompt.iter().filter(|&&x| x == vc.image_token).count();
        if wrong.is_empty() {
            Verdict::pass(format!(
                "{pads} image-pad rows hold the merger's rows in order; the other {} rows equal embed, bit for bit",
                t - pads
            ))
            .metric("max_abs", 0.0)
        } else {
            Verdict::fail(format!("fusion wrong: {}", wrong.join("; "))).metric("max_abs", worst)
        }
    }
}
