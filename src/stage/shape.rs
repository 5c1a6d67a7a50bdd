//! The canonical shape of every stage (docs/stages-and-checks.md): what an
//! engine owes each tapped stage, what the `shape` check expects, and how
//! dumps and protocol output are validated. Row-major, no batch dimension.

use super::{BlockStage, Stage, VBlock, VisionStage};
use crate::model::{ImageDims, ModelConfig, VisionConfig};

/// The canonical shape of `stage` for a step of `t` tokens after which the KV
/// cache holds `s` positions; a vision stage's for the image of `grid` (None
/// for a vision stage of a text model or a run without an image: an empty
/// shape, which no tensor has).
pub fn canonical_shape(c: &ModelConfig, stage: Stage, t: usize, s: usize, image: Option<ImageDims>) -> Vec<usize> {
    match stage {
        Stage::Vision(v) => match (c.vision.as_ref(), image) {
            (Some(vc), Some(im)) if vc.llava.is_some() => llava_shape(vc, v, im),
            (Some(vc), Some(ImageDims { grid: g, .. })) => {
                let n = g.patches();
                let (ev, hv, dv) = (vc.hidden, vc.heads, vc.head_dim());
                match v {
                    VisionStage::Pixels => vec![n, vc.patch_width()],
                    VisionStage::Merger | VisionStage::Deepstack(_) => vec![g.tokens(vc.merge), vc.out_hidden],
                    VisionStage::PatchEmbed | VisionStage::PosEmbed | VisionStage::MergerNorm => vec![n, ev],
                    // LLaVA's stages: no Qwen-VL tower has them.
                    VisionStage::PreNorm
                    | VisionStage::Features
                    | VisionStage::ProjFc1
                    | VisionStage::ProjAct
                    | VisionStage::Projector => Vec::new(),
                    VisionStage::Block(_, b) => match b {
                        VBlock::Q | VBlock::K | VBlock::V | VBlock::QRope | VBlock::KRope => vec![n, hv, dv],
                        VBlock::AttnProbs => vec![hv, n, n],
                        VBlock::AttnCtx => vec![n, hv * dv],
                        VBlock::MlpFc1 | VBlock::MlpAct => vec![n, vc.ffn],
                        VBlock::Norm1
                        | VBlock::AttnOut
                        | VBlock::MlpInp
                        | VBlock::Norm2
                        | VBlock::MlpOut
                        | VBlock::Out => {
                            vec![n, ev]
                        }
                    },
                }
            }
            _ => Vec::new(),
        },
        Stage::Positions => vec![3, t],
        Stage::Embed | Stage::InputsEmbeds | Stage::OutputNorm => vec![t, c.hidden],
        Stage::Logits => vec![t, c.vocab],
        Stage::SampleProbs => vec![1, c.vocab],
        Stage::Block(_, b) => match b {
            BlockStage::Q | BlockStage::QNorm | BlockStage::QRope => vec![t, c.heads, c.head_dim],
            BlockStage::K | BlockStage::KNorm | BlockStage::KRope => vec![t, c.kv_heads, c.head_dim],
            BlockStage::V => vec![t, c.kv_heads, c.v_head_dim()],
            BlockStage::AttnScores | BlockStage::AttnProbs => vec![c.heads, t, s],
            BlockStage::AttnCtx => vec![t, c.heads * c.v_head_dim()],
            BlockStage::FfnGate | BlockStage::FfnUp | BlockStage::FfnAct => vec![t, c.ffn],
            BlockStage::FfnMoeLogits | BlockStage::FfnMoeProbs => {
                vec![t, c.moe.as_ref().map_or(0, |m| m.routing.experts)]
            }
            BlockStage::FfnMoeTopk | BlockStage::FfnMoeWeights => {
                vec![t, c.moe.as_ref().map_or(0, |m| m.routing.top_k)]
            }
            BlockStage::AttnNorm
            | BlockStage::AttnOut
            | BlockStage::AttnPostNorm
            | BlockStage::FfnPostNorm
            | BlockStage::FfnInp
            | BlockStage::FfnNorm
            | BlockStage::FfnOut
            | BlockStage::FfnMoeOut
            | BlockStage::FfnShexpOut
            | BlockStage::Out
            | BlockStage::Deepstack => vec![t, c.hidden],
        },
    }
}

/// A LLaVA vision stage's shape: P tower images (`grid.t`) of N patches,
/// R = N + 1 rows each with CLS, stacked image by image; the merger's M rows
/// are `VisionConfig::image_tokens` (empty when they cannot be counted).
fn llava_shape(vc: &VisionConfig, v: VisionStage, im: ImageDims) -> Vec<usize> {
    let Some(lc) = &vc.llava else { return Vec::new() };
    let (p, n) = (im.grid.t, lc.tower.patches());
    let (pr, pf) = (p * (n + 1), p * lc.rows_per_image());
    let (ev, hv, e) = (vc.hidden, vc.heads, vc.out_hidden);
    let s = lc.tower.image_size;
    match v {
        VisionStage::Pixels => vec![p, 3, s, s],
        VisionStage::PatchEmbed => vec![p * n, ev],
        VisionStage::PosEmbed | VisionStage::PreNorm => vec![pr, ev],
        VisionStage::Block(_, b) => match b {
            VBlock::Q | VBlock::K | VBlock::V => vec![pr, hv, ev / hv],
            VBlock::AttnProbs => vec![p * hv, n + 1, n + 1],
            VBlock::MlpFc1 | VBlock::MlpAct => vec![pr, vc.ffn],
            VBlock::QRope | VBlock::KRope => Vec::new(),
            _ => vec![pr, ev],
        },
        VisionStage::Features => vec![pf, ev],
        VisionStage::ProjFc1 | VisionStage::ProjAct | VisionStage::Projector => vec![pf, e],
        VisionStage::Merger => match vc.image_tokens(im.grid, im.size) {
            Ok(m) => vec![m, e],
            Err(_) => Vec::new(),
        },
        VisionStage::MergerNorm | VisionStage::Deepstack(_) => Vec::new(),
    }
}
