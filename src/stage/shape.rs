//! The canonical shape of every stage (docs/stages-and-checks.md): what an
//! engine owes each tapped stage, what the `shape` check expects, and how
//! dumps and protocol output are validated. Row-major, no batch dimension.

use super::{BlockStage, Stage};
use crate::model::ModelConfig;

/// The canonical shape of `stage` for a step of `t` tokens after which the KV
/// cache holds `s` positions.
pub fn canonical_shape(c: &ModelConfig, stage: Stage, t: usize, s: usize) -> Vec<usize> {
    match stage {
        Stage::Embed | Stage::OutputNorm => vec![t, c.hidden],
        Stage::Logits => vec![t, c.vocab],
        Stage::SampleProbs => vec![1, c.vocab],
        Stage::Block(_, b) => match b {
            BlockStage::Q | BlockStage::QNorm | BlockStage::QRope => vec![t, c.heads, c.head_dim],
            BlockStage::K | BlockStage::KNorm | BlockStage::V | BlockStage::KRope => {
                vec![t, c.kv_heads, c.head_dim]
            }
            BlockStage::AttnScores | BlockStage::AttnProbs => vec![c.heads, t, s],
            BlockStage::AttnCtx => vec![t, c.heads * c.head_dim],
            BlockStage::FfnGate | BlockStage::FfnUp | BlockStage::FfnAct => vec![t, c.ffn],
            BlockStage::AttnNorm
            | BlockStage::AttnOut
            | BlockStage::AttnPostNorm
            | BlockStage::FfnPostNorm
            | BlockStage::FfnInp
            | BlockStage::FfnNorm
            | BlockStage::FfnOut
            | BlockStage::Out => vec![t, c.hidden],
        },
    }
}
