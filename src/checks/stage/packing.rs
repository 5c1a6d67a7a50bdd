//! `packing`: LLaVA's image-token rows are the projector's rows laid out by
//! the model's geometry, copies all: LLaVA-1.5's are `vision.projector`
//! itself; LLaVA-NeXT's are the base image's rows, then each row of the tile
//! grid that `unpad_image` keeps, its kept columns left to right, followed by
//! `image_newline` (the model file's, at the engine's storage precision):
//! `model::llava::packed_rows` for the image's size. Judged bit for bit on
//! the engine's own captures, so a missing newline, the unpadding rounded
//! the other way or a row dropped fails at `vision.merger`, with the first
//! row that differs and what it should have been.

use std::sync::Arc;

use serde::de::{Deserialize, Deserializer};

use crate::checks::facts::Facts;
use crate::checks::family::{Family, Metric};
use crate::checks::kind::{At, Kind, RuleEnv, StageCheck, StageRule};
use crate::checks::params::Empty;
use crate::checks::verdict::Verdict;
use crate::model::llava::{packed_rows, LlavaConfig, Packed};
use crate::stage::{Stage, Step, VisionStage};

#[derive(Clone, Debug, PartialEq)]
pub struct Packing;

impl Kind for Packing {
    const NAME: &'static str = "packing";
    const PARAMS: &'static str = "none";
    const ABOUT: &'static str = "vision.merger only (LLaVA): the projector's rows in the image-token order (NeXT: base \
                                 image, the unpadded tile grid row by row, image_newline after each), bit for bit";
    fn bare() -> Self {
        Packing
    }
    fn parse<'de, D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        Empty::deserialize(d).map(|_| Packing)
    }
}

impl StageRule for Packing {
    fn kind(&self) -> &'static str {
        Self::NAME
    }
    fn expand(&self, stage: Stage, _: &RuleEnv) -> Result<Vec<Arc<dyn StageCheck>>, String> {
        if stage != Stage::Vision(VisionStage::Merger) {
            return Err(format!("`packing` applies to vision.merger, not `{stage}`"));
        }
        Ok(vec![Arc::new(Packing)])
    }
}

/// What each image-token row should copy (a projector row; None:
/// `image_newline`) for an image of `size`, with a label for messages.
fn expected(lc: &LlavaConfig, size: Option<(usize, usize)>, projector_rows: usize) -> Result<Vec<(Option<usize>, String)>, String> {
    if lc.pinpoints.is_none() {
        return Ok((0..projector_rows).map(|r| (Some(r), format!("projector row {r}"))).collect());
    }
    let (h, w) = size.ok_or("LLaVA-NeXT's packing needs the image's size (H, W)")?;
    Ok(packed_rows(lc, h, w)?
        .into_iter()
        .map(|p| {
            let label = match p {
                Packed::Base(i) => format!("base image row {i}"),
                Packed::Grid { r, c, row } => format!("grid patch ({r}, {c}) = projector row {row}"),
                Packed::Newline => "image_newline".to_string(),
            };
            (p.projector_row(), label)
        })
        .collect())
}

impl StageCheck for Packing {
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
        vec![stage, Stage::Vision(VisionStage::Projector)]
    }
    fn planned(&self, step: Step, _: Stage, facts: &Facts) -> bool {
        step == Step::Prefill && facts.image.is_some() && facts.config.llava().is_some()
    }
    fn judge(&self, facts: &Facts, at: &At) -> Verdict {
        let (Some(lc), Some(img)) = (facts.config.llava(), facts.image) else {
            return Verdict::not_applicable("not a LLaVA run with an image");
        };
        let (merger, proj) = match (at.capture(), at.capture_of(Stage::Vision(VisionStage::Projector))) {
            (Ok(a), Ok(b)) => (a, b),
            (Err(v), _) | (_, Err(v)) => return v,
        };
        let e = facts.config.hidden;
        let want = match expected(lc, img.size, proj.shape().first().copied().unwrap_or(0)) {
            Ok(w) => w,
            Err(m) => return Verdict::fail(m),
        };
        let newline: Vec<f32> = match lc.pinpoints {
            None => Vec::new(),
            Some(_) => match facts.file.tensor("image_newline") {
                Ok(t) => {
                    let mut v = t.data().to_vec();
                    facts.storage.round_slice(&mut v);
                    v
                }
                Err(m) => return Verdict::fail(format!("image_newline: {m}")),
            },
        };
        let got_rows = merger.shape().first().copied().unwrap_or(0);
        if merger.shape().get(1) != Some(&e) || got_rows != want.len() {
            return Verdict::fail(format!(
                "vision.merger has shape {:?}; the packing gives [{}, {e}] ({} rows of which {} image_newline)",
                merger.shape(),
                want.len(),
                want.len(),
                want.iter().filter(|(w, _)| w.is_none()).count()
            ));
        }
        let mut first: Option<String> = None;
        let mut wrong = 0usize;
        let mut worst = 0.0f64;
        for (r, (w, label)) in want.iter().enumerate() {
            let expect: &[f32] = match w {
                Some(i) if (i + 1) * e <= proj.numel() => &proj.data()[i * e..][..e],
                Some(i) => return Verdict::fail(format!("row {r} should copy projector row {i}, which is past its {} rows", proj.numel() / e)),
                None => &newline,
            };
            let got = &merger.data()[r * e..][..e];
            if got.iter().zip(expect).any(|(a, b)| a.to_bits() != b.to_bits()) {
                wrong += 1;
                let d = got.iter().zip(expect).fold(0.0f64, |m, (a, b)| m.max((a - b).abs() as f64));
                worst = worst.max(d);
                first.get_or_insert_with(|| format!("row {r} should be {label} (max |Δ| {d:.3e})"));
            }
        }
        match first {
            None => Verdict::pass(format!("{} rows are the projector's in the image-token order, bit for bit", want.len()))
                .metric("max_abs", 0.0),
            Some(f) => Verdict::fail(format!("{wrong} of {} image-token rows misplaced; first: {f}", want.len()))
                .metric("max_abs", worst),
        }
    }
}
