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
//!
//! gpt-oss (`Moe::interleaved`) stores its router as `mlp.router` (with a
//! bias) and its experts transposed, `x·W`: `mlp.experts.gate_up_proj`
//! `[n, E, 2F]` with gate in the even columns and up in the odd ones
//! (`gate_up[..., ::2]`, `[..., 1::2]`), `gate_up_proj_bias` `[n, 2F]`
//! likewise, `down_proj` `[n, F, E]` and `down_proj_bias` `[n, E]`. Those
//! are transposed into the per-expert `[out, in]` weights and biases (a
//! copy: the file's columns are not rows).

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
    if moe.interleaved {
        return interleaved(tensors, n, f, e);
    }
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

/// gpt-oss's layout (see the module comment) under per-expert names.
fn interleaved(tensors: BTreeMap<String, Tensor>, n: usize, f: usize, e: usize) -> Result<BTreeMap<String, Tensor>, String> {
    let check = |name: &str, t: &Tensor, want: &[usize], what: &str| {
        if t.shape() != want {
            return Err(format!("`{name}` has shape {:?}, expected {want:?} ({what})", t.shape()));
        }
        Ok(())
    };
    // Column `c0 + step·i` of each row of the [rows, cols] matrix `m`, as
    // the rows of a new [count, rows] one (its transpose).
    let columns = |m: &[f32], rows: usize, cols: usize, c0: usize, step: usize, count: usize| {
        let mut out = Vec::with_capacity(rows * count);
        for i in 0..count {
            out.extend((0..rows).map(|r| m[r * cols + c0 + step * i]));
        }
        out
    };
    let mut out = BTreeMap::new();
    for (name, t) in tensors {
        let dtype = t.dtype();
        let mut put = |k: String, shape: Vec<usize>, data: Vec<f32>| {
            out.insert(k, Tensor::new(shape, data).with_dtype(dtype));
        };
        if let Some(p) = name.strip_suffix(".experts.gate_up_proj") {
            check(&name, &t, &[n, e, 2 * f], "experts, E, 2·F gate and up interleaved")?;
            for j in 0..n {
                let m = &t.data()[j * e * 2 * f..][..e * 2 * f];
                put(expert_weight(p, j, "gate_proj"), vec![f, e], columns(m, e, 2 * f, 0, 2, f));
                put(expert_weight(p, j, "up_proj"), vec![f, e], columns(m, e, 2 * f, 1, 2, f));
            }
        } else if let Some(p) = name.strip_suffix(".experts.gate_up_proj_bias") {
            check(&name, &t, &[n, 2 * f], "experts, 2·F gate and up interleaved")?;
            for j in 0..n {
                let b = &t.data()[j * 2 * f..][..2 * f];
                put(format!("{p}.experts.{j}.gate_proj.bias"), vec![f], b.iter().step_by(2).copied().collect());
                put(format!("{p}.experts.{j}.up_proj.bias"), vec![f], b.iter().skip(1).step_by(2).copied().collect());
            }
        } else if let Some(p) = name.strip_suffix(".experts.down_proj") {
            check(&name, &t, &[n, f, e], "experts, F, E")?;
            for j in 0..n {
                let m = &t.data()[j * f * e..][..f * e];
                put(expert_weight(p, j, "down_proj"), vec![e, f], columns(m, f, e, 0, 1, e));
            }
        } else if let Some(p) = name.strip_suffix(".experts.down_proj_bias") {
            check(&name, &t, &[n, e], "experts, E")?;
            for j in 0..n {
                put(format!("{p}.experts.{j}.down_proj.bias"), vec![e], t.data()[j * e..][..e].to_vec());
            }
        } else {
            let name = name.replace(".mlp.router.", ".mlp.gate.");
            out.insert(name, t);
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

    #[test]
    fn gpt_oss_experts_are_transposed_and_deinterleaved() {
        // One expert, E = 2, F = 2: x·W with columns [g0, u0, g1, u1].
        let (n, f, e) = (1, 2, 2);
        let w = Tensor::new(vec![n, e, 2 * f], vec![1., 2., 3., 4., 5., 6., 7., 8.]);
        let b = Tensor::new(vec![n, 2 * f], vec![10., 20., 30., 40.]);
        let d = Tensor::new(vec![n, f, e], vec![1., 2., 3., 4.]);
        let mut m = BTreeMap::new();
        m.insert("l.mlp.experts.gate_up_proj".to_string(), w);
        m.insert("l.mlp.experts.gate_up_proj_bias".to_string(), b);
        m.insert("l.mlp.experts.down_proj".to_string(), d);
        m.insert("l.mlp.router.bias".to_string(), Tensor::new(vec![1], vec![0.5]));
        let out = interleaved(m, n, f, e).unwrap();
        // gate_proj [F, E]: row i is column 2i of x·W's matrix.
        assert_eq!(out["l.mlp.experts.0.gate_proj.weight"].data(), &[1., 5., 3., 7.]);
        assert_eq!(out["l.mlp.experts.0.up_proj.weight"].data(), &[2., 6., 4., 8.]);
        assert_eq!(out["l.mlp.experts.0.gate_proj.bias"].data(), &[10., 30.]);
        assert_eq!(out["l.mlp.experts.0.up_proj.bias"].data(), &[20., 40.]);
        assert_eq!(out["l.mlp.experts.0.down_proj.weight"].data(), &[1., 3., 2., 4.]);
        assert!(out.contains_key("l.mlp.gate.bias"));
        let bad = BTreeMap::from([("l.mlp.experts.down_proj".to_string(), Tensor::new(vec![2, 2], vec![0.; 4]))]);
        assert!(interleaved(bad, n, f, e).unwrap_err().contains("expected [1, 2, 2]"));
    }
}
