//! The floor's view of a vision-language model's tower: how many terms each
//! vision stage sums (its own rounding) and which stages it is computed from
//! (what it inherits), as `reduction_len` and `inputs` give them for the
//! language model.

use crate::stage::{Stage, VBlock, VisionStage};

/// `reduction_len` of a vision stage; `n` stands for the image's patch count
/// at the attention (the caller's `s`).
pub(super) fn vision_reduction_len(cfg: &crate::model::ModelConfig, v: VisionStage, n: usize) -> usize {
    let Some(vc) = &cfg.vision else { return 1 };
    let m2 = vc.merge * vc.merge;
    match v {
        VisionStage::Pixels => 1,
        VisionStage::PatchEmbed | VisionStage::PosEmbed => vc.patch_width(),
        VisionStage::MergerNorm | VisionStage::PreNorm => vc.hidden,
        // LLaVA: the features copy a block's output (its fc2 sums Fv; the
        // pre_layrnorm's Ev), the projector's linears sum Ev then E, its
        // GELU inherits linear_1's, and the packed rows copy linear_2's.
        VisionStage::Features => match vc.llava.as_ref().map(|l| l.feature_layer) {
            Some(0) => vc.hidden,
            _ => vc.ffn,
        },
        VisionStage::ProjFc1 | VisionStage::ProjAct => vc.hidden,
        VisionStage::Projector => vc.out_hidden,
        VisionStage::Merger if vc.llava.is_some() => vc.out_hidden,
        VisionStage::Merger | VisionStage::Deepstack(_) => m2 * vc.hidden,
        VisionStage::Block(_, b) => match b {
            VBlock::Norm1 | VBlock::Norm2 | VBlock::Q | VBlock::K | VBlock::V | VBlock::QRope | VBlock::KRope => {
                vc.hidden
            }
            VBlock::AttnProbs | VBlock::AttnCtx => n,
            VBlock::AttnOut | VBlock::MlpInp | VBlock::MlpFc1 | VBlock::MlpAct => vc.hidden,
            VBlock::MlpOut | VBlock::Out => vc.ffn,
        },
    }
}

/// The inputs of a vision stage (the block's residual stream enters from
/// the previous block's `out`, or the (position-)embedded patches).
pub(super) fn vision_inputs(cfg: &crate::model::ModelConfig, v: VisionStage) -> Vec<Stage> {
    let vs = Stage::Vision;
    let Some(vc) = &cfg.vision else { return vec![] };
    let embedded = if vc.llava.is_some() {
        VisionStage::PreNorm
    } else if vc.pos_embeds.is_some() {
        VisionStage::PosEmbed
    } else {
        VisionStage::PatchEmbed
    };
    let resid = |i: usize| {
        if i == 0 {
            vs(embedded)
        } else {
            vs(VisionStage::Block(i - 1, VBlock::Out))
        }
    };
    let last = vs(if vc.depth == 0 {
        embedded
    } else {
        VisionStage::Block(vc.depth - 1, VBlock::Out)
    });
    match v {
        VisionStage::Pixels => vec![],
        VisionStage::PatchEmbed => vec![vs(VisionStage::Pixels)],
        VisionStage::PosEmbed => vec![vs(VisionStage::PatchEmbed)],
        VisionStage::MergerNorm => vec![last],
        VisionStage::PreNorm => vec![vs(VisionStage::PosEmbed)],
        // hidden_states[i]: pre_layrnorm's output for i = 0, else block i − 1's.
        VisionStage::Features => match vc.llava.as_ref().map(|l| l.feature_layer) {
            Some(0) | None => vec![vs(VisionStage::PreNorm)],
            Some(i) => vec![resid(i)],
        },
        VisionStage::ProjFc1 => vec![vs(VisionStage::Features)],
        VisionStage::ProjAct => vec![vs(VisionStage::ProjFc1)],
        VisionStage::Projector => vec![vs(VisionStage::ProjAct)],
        VisionStage::Merger if vc.llava.is_some() => vec![vs(VisionStage::Projector)],
        VisionStage::Merger => vec![vs(VisionStage::MergerNorm)],
        VisionStage::Deepstack(j) => match vc.deepstack.get(j) {
            Some(&b) => vec![vs(VisionStage::Block(b, VBlock::Out))],
            None => vec![],
        },
        VisionStage::Block(i, b) => {
            let s = |b| vs(VisionStage::Block(i, b));
            match b {
                VBlock::Norm1 => vec![resid(i)],
                VBlock::Q | VBlock::K | VBlock::V => vec![s(VBlock::Norm1)],
                VBlock::QRope => vec![s(VBlock::Q)],
                VBlock::KRope => vec![s(VBlock::K)],
                VBlock::AttnProbs if vc.llava.is_some() => vec![s(VBlock::Q), s(VBlock::K)],
                VBlock::AttnProbs => vec![s(VBlock::QRope), s(VBlock::KRope)],
                VBlock::AttnCtx => vec![s(VBlock::AttnProbs), s(VBlock::V)],
                VBlock::AttnOut => vec![s(VBlock::AttnCtx)],
                VBlock::MlpInp => vec![resid(i), s(VBlock::AttnOut)],
                VBlock::Norm2 => vec![s(VBlock::MlpInp)],
                VBlock::MlpFc1 => vec![s(VBlock::Norm2)],
                VBlock::MlpAct => vec![s(VBlock::MlpFc1)],
                VBlock::MlpOut => vec![s(VBlock::MlpAct)],
                VBlock::Out => vec![s(VBlock::MlpInp), s(VBlock::MlpOut)],
            }
        }
    }
}
