//! The projection stages of a block and the model file's weight each one
//! multiplies by: what `linear` recomputes a projection with, and what the
//! scaled policy's floor carries an input's error through (`checks::floor`).

use std::sync::Arc;

use crate::checks::facts::Facts;
use crate::stage::{BlockStage, Stage};
use crate::tensor::Tensor;

/// A projection's weight, its bias if it has one, and the name read.
pub type WeightAndBias = (Arc<Tensor>, Option<Arc<Tensor>>, String);

/// The input stage of a projection stage and its weight's HF name (the
/// bias is the same name ending `.bias`). Logits name the LM head; a tied
/// model's is the embedding (resolved when judged).
pub fn projection(stage: Stage) -> Option<(Stage, String)> {
    use BlockStage::*;
    let p = |l: usize, name: &str| format!("model.layers.{l}.{name}.weight");
    Some(match stage {
        Stage::Block(l, Q) => (Stage::Block(l, AttnNorm), p(l, "self_attn.q_proj")),
        Stage::Block(l, K) => (Stage::Block(l, AttnNorm), p(l, "self_attn.k_proj")),
        Stage::Block(l, V) => (Stage::Block(l, AttnNorm), p(l, "self_attn.v_proj")),
        Stage::Block(l, AttnOut) => (Stage::Block(l, AttnCtx), p(l, "self_attn.o_proj")),
        Stage::Block(l, FfnGate) => (Stage::Block(l, FfnNorm), p(l, "mlp.gate_proj")),
        Stage::Block(l, FfnUp) => (Stage::Block(l, FfnNorm), p(l, "mlp.up_proj")),
        Stage::Block(l, FfnOut) => (Stage::Block(l, FfnAct), p(l, "mlp.down_proj")),
        Stage::Block(l, FfnMoeLogits) => (Stage::Block(l, FfnNorm), p(l, "mlp.gate")),
        Stage::Logits => (Stage::OutputNorm, "lm_head.weight".into()),
        _ => return None,
    })
}

/// The weight and bias of a projection stage as the model file holds them
/// (`projection`'s HF name; a tied model's LM head is its embedding), with
/// the name read: what `linear` recomputes the stage with, and what the
/// scaled policy's floor carries an input's error through (`checks::floor`).
pub fn weight_and_bias(facts: &Facts, weight: &str) -> Result<WeightAndBias, String> {
    let name = match weight {
        "lm_head.weight" if facts.config.tie_embeddings || !facts.file.has("lm_head.weight") => {
            "model.embed_tokens.weight"
        }
        n => n,
    };
    let w = facts.file.tensor(name)?;
    let bias_name = name.strip_suffix(".weight").map(|p| format!("{p}.bias"));
    let b = match bias_name.filter(|b| facts.file.has(b)) {
        Some(b) => Some(facts.file.tensor(&b)?),
        None => None,
    };
    Ok((w, b, name.to_string()))
}
