//! `image_tokens`: a vision-language model's image-token count is one number
//! three ways — the prompt's `<|image_pad|>` (`<image>`) tokens, the merger's
//! rows, and the count the geometry gives (Qwen-VL: the grid's t·h·w /
//! merge²; LLaVA-1.5: the tower's N; LLaVA-NeXT: its packed rows for the
//! image's size, `VisionConfig::image_tokens`). A merge size off, a processor that expands the
//! placeholder wrongly, or a merger that drops rows breaks the equality
//! (HF raises "Image features and image tokens do not match" here).

use std::sync::Arc;

use serde::de::{Deserialize, Deserializer};

use crate::checks::facts::Facts;
use crate::checks::family::Family;
use crate::checks::kind::{At, Kind, RuleEnv, StageCheck, StageRule};
use crate::checks::params::Empty;
use crate::checks::verdict::Verdict;
use crate::stage::{Stage, Step, VisionStage};

#[derive(Clone, Debug, PartialEq)]
pub struct ImageTokens;

impl Kind for ImageTokens {
    const NAME: &'static str = "image_tokens";
    const PARAMS: &'static str = "none";
    const ABOUT: &'static str = "vision.merger only: the prompt's image-pad tokens, the merger's rows and the grid's \
                                 t·h·w/merge² are the same number";
    fn bare() -> Self {
        ImageTokens
    }
    fn parse<'de, D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        Empty::deserialize(d).map(|_| ImageTokens)
    }
}

impl StageRule for ImageTokens {
    fn kind(&self) -> &'static str {
        Self::NAME
    }
    fn expand(&self, stage: Stage, _: &RuleEnv) -> Result<Vec<Arc<dyn StageCheck>>, String> {
        if stage != Stage::Vision(VisionStage::Merger) {
            return Err(format!("`image_tokens` applies to vision.merger, not `{stage}`"));
        }
        Ok(vec![Arc::new(ImageTokens)])
    }
}

impl StageCheck for ImageTokens {
    fn id(&self) -> String {
        Self::NAME.into()
    }
    fn family(&self) -> Family {
        Family::Invariant
    }
    fn planned(&self, step: Step, _: Stage, facts: &Facts) -> bool {
        step == Step::Prefill && facts.image.is_some()
    }
    fn judge(&self, facts: &Facts, at: &At) -> Verdict {
        let (Some(vc), Some(img)) = (&facts.config.vision, facts.image) else {
            return Verdict::not_applicable("the run has no image");
        };
        let t = match at.capture() {
            Ok(t) => t,
            Err(v) => return v,
        };
        let pads = facts.prompt.iter().filter(|&&x| x == vc.image_token).count();
        let rows = t.shape().first().copied().unwrap_or(0);
        let g = img.grid;
        let (want, from) = match (&vc.llava, vc.image_tokens(g, img.size)) {
            (_, Err(m)) => return Verdict::fail(format!("the image's token count cannot be known: {m}")),
            (None, Ok(n)) => (n, format!("grid {g} / merge {}² = {n}", vc.merge)),
            (Some(lc), Ok(n)) => match (&lc.pinpoints, img.size) {
                (Some(_), Some((h, w))) => (n, format!("LLaVA-NeXT's packing of a {h}×{w} image = {n}")),
                _ => (n, format!("{} feature rows of the one tower image", n)),
            },
        };
        let msg = format!("{pads} image-pad token(s) in the prompt, {rows} merger row(s), {from}");
        Verdict::check(pads == rows && rows == want, msg)
            .metric("pads", pads as f64)
            .metric("rows", rows as f64)
            .metric("grid_tokens", want as f64)
    }
}
