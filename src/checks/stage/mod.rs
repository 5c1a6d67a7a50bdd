//! Stage checks: what must hold at one (step, stage). The table below is the
//! whole vocabulary; each kind's file holds its parameters, how it expands at
//! a stage, and its judge.

super::registry::table!(StageRule;
    finite::Finite,
    shape::Shape,
    softmax_rows::SoftmaxRows,
    causal::Causal,
    rope::Rope,
    golden::Golden,
    references_agree::ReferencesAgree,
    residual::Residual,
    rms_norm::RmsNorm,
    swiglu::Swiglu,
    linear::Linear,
    sampler::Sampler,
    image_tokens::ImageTokens,
    fusion::Fusion,
    mrope::Mrope,
    bidirectional::Bidirectional,
    feature_select::FeatureSelect,
    packing::Packing,
    activation::ActivationRule,
    routing::RoutingRule,
    experts::Experts,
);

// The golden check at one stage, which `greedy_tokens` asks for the logits' allowance.
pub use golden::{GoldenCheck, SUSPECT_REFERENCE};

mod golden_routes;
mod recompute;
