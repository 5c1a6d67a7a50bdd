//! The floor's view of a model's graph: how many terms each stage sums (the
//! reduction its own rounding accumulates over) and which stages it is
//! computed from (what it inherits), for the language model and, through
//! `vision`, a VLM's tower.

use super::vision::{vision_inputs, vision_reduction_len};
use crate::stage::{BlockStage, Stage, VisionStage};

/// The number of terms summed to produce one element of `stage`: the
/// dimension whose rounding errors accumulate there. `s` is the step's KV
/// length. Stages that copy or rotate inherit the reduction of their input.
pub fn reduction_len(cfg: &crate::model::ModelConfig, stage: Stage, s: usize) -> usize {
    let e = cfg.hidden;
    match stage {
        Stage::Vision(v) => vision_reduction_len(cfg, v, s),
        Stage::Embed | Stage::InputsEmbeds | Stage::Positions => 1,
        Stage::OutputNorm | Stage::Logits => e,
        Stage::SampleProbs => cfg.vocab,
        Stage::Block(_, b) => match b {
            BlockStage::AttnNorm | BlockStage::FfnNorm | BlockStage::AttnPostNorm | BlockStage::FfnPostNorm => e,
            BlockStage::Q | BlockStage::K | BlockStage::V => e,
            BlockStage::QNorm | BlockStage::KNorm => cfg.head_dim,
            BlockStage::QRope | BlockStage::KRope => e,
            BlockStage::AttnScores => cfg.head_dim,
            BlockStage::AttnProbs | BlockStage::AttnCtx => s,
            BlockStage::AttnOut | BlockStage::FfnInp => cfg.heads * cfg.v_head_dim(),
            BlockStage::FfnGate | BlockStage::FfnUp | BlockStage::FfnAct => e,
            BlockStage::FfnOut | BlockStage::Out => match cfg.moe.as_ref() {
                // A routed layer's ffn_out adds the routed and shared sums.
                Some(m) if stage.layer().is_some_and(|l| m.is_sparse(l)) && b == BlockStage::FfnOut => 2,
                _ => cfg.ffn,
            },
            BlockStage::Deepstack => 1,
            BlockStage::FfnMoeLogits => e,
            BlockStage::FfnMoeProbs => cfg.moe.as_ref().map_or(1, |m| m.routing.experts),
            BlockStage::FfnMoeTopk => 1,
            BlockStage::FfnMoeWeights => cfg.moe.as_ref().map_or(1, |m| m.routing.top_k),
            // Each expert's down projection, then the weighted sum over the k.
            BlockStage::FfnMoeOut => cfg.moe.as_ref().map_or(1, |m| m.expert_ffn + m.routing.top_k),
            BlockStage::FfnShexpOut => cfg.moe.as_ref().and_then(|m| m.shared_ffn).unwrap_or(1),
        },
    }
}

/// The stages whose values a stage is computed from (the residual stream
/// entering block l is `blk.{l-1}.out`, or `embed` for block 0).
pub fn inputs(cfg: &crate::model::ModelConfig, stage: Stage) -> Vec<Stage> {
    use BlockStage::*;
    // A VLM's block 0 reads the fused embeddings, and a layer followed by a
    // deepstack add hands on its result.
    let deep = cfg.vision.as_ref().map_or(0, |v| v.deepstack.len());
    let resid = |l: usize| match l {
        0 if cfg.vision.is_some() => Stage::InputsEmbeds,
        0 => Stage::Embed,
        l if l - 1 < deep => Stage::Block(l - 1, Deepstack),
        l => Stage::Block(l - 1, Out),
    };
    match stage {
        Stage::Vision(v) => vision_inputs(cfg, v),
        Stage::Embed | Stage::Positions => vec![],
        Stage::InputsEmbeds => {
            let mut v = vec![Stage::Embed];
            if cfg.vision.is_some() {
                v.push(Stage::Vision(VisionStage::Merger));
            }
            v
        }
        Stage::SampleProbs => vec![Stage::Logits],
        Stage::OutputNorm => vec![resid(cfg.layers)],
        Stage::Logits => vec![Stage::OutputNorm],
        Stage::Block(l, b) => {
            let s = |b| Stage::Block(l, b);
            match b {
                AttnNorm => vec![resid(l)],
                Q | K | V => vec![s(AttnNorm)],
                QNorm => vec![s(Q)],
                KNorm => vec![s(K)],
                QRope => vec![s(if cfg.qk_norm { QNorm } else { Q })],
                KRope => vec![s(if cfg.qk_norm { KNorm } else { K })],
                AttnScores => vec![s(QRope), s(KRope)],
                AttnProbs => vec![s(AttnScores)],
                AttnCtx => vec![s(AttnScores), s(V)],
                AttnOut => vec![s(AttnCtx)],
                AttnPostNorm => vec![s(AttnOut)],
                FfnInp => vec![resid(l), s(if cfg.post_norms { AttnPostNorm } else { AttnOut })],
                FfnNorm => vec![s(FfnInp)],
                FfnGate | FfnUp => vec![s(FfnNorm)],
                FfnAct => vec![s(FfnGate), s(FfnUp)],
                FfnOut if cfg.moe.as_ref().is_some_and(|m| m.is_sparse(l)) => {
                    let mut v = vec![s(FfnMoeOut)];
                    if cfg.moe.as_ref().is_some_and(|m| m.shared_ffn.is_some()) {
                        v.push(s(FfnShexpOut));
                    }
                    v
                }
                FfnOut => vec![s(FfnAct)],
                FfnMoeLogits | FfnShexpOut => vec![s(FfnNorm)],
                FfnMoeProbs => vec![s(FfnMoeLogits)],
                FfnMoeTopk | FfnMoeWeights => vec![s(FfnMoeProbs)],
                FfnMoeOut => vec![s(FfnNorm), s(FfnMoeWeights)],
                FfnPostNorm => vec![s(FfnOut)],
                Out => vec![s(FfnInp), s(if cfg.post_norms { FfnPostNorm } else { FfnOut })],
                Deepstack => {
                    let mut v = vec![s(Out)];
                    if l < deep {
                        v.push(Stage::Vision(VisionStage::Deepstack(l)));
                    }
                    v
                }
            }
        }
    }
}

/// A bound on |act'| over the reals (and |act(g)| ≤ |g| for both): SiLU's
/// derivative peaks at 1.0998; GELU-tanh's at 1.1289 (x ≈ 2.4); the clamped
/// SwiGLU's gate part g·σ(αg) has SiLU's slope in αg (the clamp's is ≤ 1).
pub(super) fn act_slope_bound(act: crate::model::config::Activation) -> f64 {
    match act {
        crate::model::config::Activation::Silu | crate::model::config::Activation::ClampedSwiglu { .. } => 1.1,
        crate::model::config::Activation::GeluTanh => 1.13,
    }
}

/// Whether `stage` is a routed layer's `ffn_out`: the sum of the routed and
/// shared experts' outputs, not the dense MLP's down projection.
pub fn is_moe_sum(cfg: &crate::model::ModelConfig, stage: Stage) -> bool {
    matches!(stage, Stage::Block(l, BlockStage::FfnOut) if cfg.moe.as_ref().is_some_and(|m| m.is_sparse(l)))
}

/// Matmul stages and the stage they multiply (a routed layer's `ffn_out`,
/// `is_moe_sum`, is not one: callers that know the model ask that first).
pub fn matmul_input(stage: Stage) -> Option<Stage> {
    use BlockStage::*;
    match stage {
        Stage::Logits => Some(Stage::OutputNorm),
        Stage::Block(l, Q | K | V) => Some(Stage::Block(l, AttnNorm)),
        Stage::Block(l, AttnOut) => Some(Stage::Block(l, AttnCtx)),
        Stage::Block(l, FfnGate | FfnUp) => Some(Stage::Block(l, FfnNorm)),
        Stage::Block(l, FfnOut) => Some(Stage::Block(l, FfnAct)),
        Stage::Block(l, FfnMoeLogits) => Some(Stage::Block(l, FfnNorm)),
        _ => None,
    }
}

/// The KV-cache stage an attention stage reads at every position so far
/// (keys for the scores, values for the context): its floor recomputes the
/// stage from them (`attention`), so they are read at every step up to the
/// judged one, every row.
pub fn cache_stage(stage: Stage) -> Option<Stage> {
    match stage {
        Stage::Block(l, BlockStage::AttnScores) => Some(Stage::Block(l, BlockStage::KRope)),
        Stage::Block(l, BlockStage::AttnCtx) => Some(Stage::Block(l, BlockStage::V)),
        _ => None,
    }
}

/// Every stage a floor at `stage` reads besides the stage itself: its
/// direct inputs and, at an attention stage, the cache it reads. What the
/// runner taps for a golden check and what `goldens regen` records beside a
/// compact recording (`record.aux`), so no floor is estimated through a stage
/// nobody kept.
pub fn floor_reads(cfg: &crate::model::ModelConfig, stage: Stage) -> Vec<Stage> {
    let mut v = inputs(cfg, stage);
    // The probabilities' floor reads the scores; the context's the
    // probabilities (its own input is the scores, by the chain rule).
    if let Stage::Block(l, BlockStage::AttnCtx) = stage {
        v.push(Stage::Block(l, BlockStage::AttnProbs));
    }
    if let Some(c) = cache_stage(stage) {
        if !v.contains(&c) {
            v.push(c);
        }
    }
    v
}
