//! MoE checkpoints in one layout. The engines and the checks read a routed
//! layer's weights under per-expert HF names:
//!
//! - `model.layers.N.mlp.gate.weight` `[n_experts, E]`: the router;
//! - `model.layers.N.mlp.experts.J.{gate,up}_proj.weight` `[F, E]` and
//!   `…down_proj.weight` `[E, F]`: expert J;
//! - `model.layers.N.mlp.shared_expert.{gate,up,down}_proj.weight` and
//!   `model.layers.N.mlp.shared_expert_gate.weight` `[1, E]` (Qwen2-MoE).
//!
//! Published checkpoints store these names (Qwen-MoE) or Mixtral's
//! `block_sparse_moe.gate` / `experts.J.w1, w3, w2` (gate, up, down);
//! transformers 5 saves each layer's experts fused, `mlp.experts.gate_up_proj`
//! `[n, 2F, E]` (per expert its gate rows, then its up rows:
//! `linear(x, gate_up_proj[j]).chunk(2)`) and `mlp.experts.down_proj`
//! `[n, E, F]`. Both are mapped here; splitting copies no value (rows of the
//! file's map), so every layout computes the same model.

use std::collections::BTreeMap;

use crate::tensor::Tensor;

/// The per-expert name of piece `proj` (`gate_proj`, `up_proj`, `down_proj`)
/// of expert `j` under layer prefix `p` (`model.layers.N.mlp`).
pub fn expert_weight(p: &str, j: usize, proj: &str) -> String {
    format!("{p}.experts.{j}.{proj}.weight")
}

/// `tensors` with every MoE tensor under its per-expert name. A fused
/// tensor whose shape does not fit the config is an error naming it.
pub fn canonicalise(
    cfg: &super::ModelConfig,
    tensors: BTreeMap<String, Tensor>,
) -> Result<BTreeMap<String, Tensor>, String> {
    let Some(moe) = &cfg.moe else {
        return Ok(tensors);
    };
    let (n, f, e) = (moe.routing.experts, moe.expert_ffn, cfg.hidden);
    let mut out = BTreeMap::new();
    for (name, t) in tensors {
        if let Some(p) = name.strip_suffix(".experts.gate_up_proj") {
            let want = [n, 2 * f, e];
            if t.shape() != want {
                return Err(format!("`{name}` has shape {:?}, expected {want:?} (experts, 2·F gate then up rows, E)", t.shape()));
            }
            let flat = t.reshaped(vec![n * 2 * f, e]);
            for j in 0..n {
                out.insert(expert_weight(p, j, "gate_proj"), flat.rows(j * 2 * f, f));
                out.insert(expert_weight(p, j, "up_proj"), flat.rows(j * 2 * f + f, f));
            }
        } else if let Some(p) = name.strip_suffix(".experts.down_proj") {
            let want = [n, e, f];
            if t.shape() != want {
                return Err(format!("`{name}` has shape {:?}, expected {want:?} (experts, E, F)", t.shape()));
            }
            let flat = t.reshaped(vec![n * e, f]);
            for j in 0..n {
                out.insert(expert_weight(p, j, "down_proj"), flat.rows(j * e, e));
            }
        } else {
            // DeepSeek's shared experts under the one shared-expert name.
            let name = name.replace(".mlp.shared_experts.", ".mlp.shared_expert.");
            out.insert(mixtral_legacy(&name), t);
        }
    }
    Ok(out)
}

/// Mixtral's published names in the per-expert layout.
fn mixtral_legacy(name: &str) -> String {
    let Some((layer, rest)) = name.split_once(".block_sparse_moe.") else {
        return name.to_string();
    };
    let rest = rest
        .replace(".w1.weight", ".gate_proj.weight")
        .replace(".w3.weight", ".up_proj.weight")
        .replace(".w2.weight", ".down_proj.weight");
    format!("{layer}.mlp.{rest}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mixtral_names_and_fused_experts_map_to_per_expert_names() {
        assert_eq!(
            mixtral_legacy("model.layers.3.block_sparse_moe.experts.7.w3.weight"),
            "model.layers.3.mlp.experts.7.up_proj.weight"
        );
        assert_eq!(
            mixtral_legacy("model.layers.3.block_sparse_moe.gate.weight"),
            "model.layers.3.mlp.gate.weight"
        );
        assert_eq!(mixtral_legacy("model.norm.weight"), "model.norm.weight");
    }
}
