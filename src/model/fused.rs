//! Fused projections split on load, so every engine sees the one Llama layout
//! (q/k/v, gate/up). Phi-3 stores `self_attn.qkv_proj` ([(H + 2·KV)·D, E]:
//! q rows, then k, then v) and `mlp.gate_up_proj` ([2F, E]: gate rows, then
//! up — HF's `Phi3MLP` does `gate, up = gate_up_proj(x).chunk(2, dim=-1)`, and
//! llama.cpp's SwiGLU takes the first half as the gate). Splitting weights is
//! exact (rows are copied), so the split model computes the fused one's values.

use crate::error::{Error, Result};
use crate::model::{ModelConfig, Weights};

/// How a file tensor was split: (piece name, first row, rows). Shared with the
/// `weights` check, which maps the engine's pieces back onto the file.
pub fn pieces(cfg: &ModelConfig, fused_name: &str) -> Option<Vec<(String, usize, usize)>> {
    if cfg.arch != "phi3" {
        return None;
    }
    let (qd, kvd, f) = (cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim, cfg.ffn);
    let prefix = |suffix: &str| fused_name.strip_suffix(suffix).map(str::to_string);
    if let Some(p) = prefix("self_attn.qkv_proj.weight") {
        return Some(vec![
            (format!("{p}self_attn.q_proj.weight"), 0, qd),
            (format!("{p}self_attn.k_proj.weight"), qd, kvd),
            (format!("{p}self_attn.v_proj.weight"), qd + kvd, kvd),
        ]);
    }
    if let Some(p) = prefix("mlp.gate_up_proj.weight") {
        return Some(vec![
            (format!("{p}mlp.gate_proj.weight"), 0, f),
            (format!("{p}mlp.up_proj.weight"), f, f),
        ]);
    }
    None
}

/// Splits every fused tensor of `ws` into its pieces (a no-op for
/// architectures without fused projections). A fused tensor of the wrong
/// height is an error naming it and both heights.
///
/// `k_first` plants a bug for tests (`LoaderBug::SplitKFirst`): a loader that
/// believes the fused rows are k, q, v takes k from the top and q after it.
pub fn split(cfg: &ModelConfig, ws: &mut Weights, k_first: bool) -> Result<()> {
    let fused: Vec<String> = ws
        .names()
        .filter(|n| pieces(cfg, n).is_some())
        .map(str::to_string)
        .collect();
    for name in fused {
        let parts = pieces(cfg, &name).expect("filtered above");
        let height: usize = parts.iter().map(|p| p.2).sum();
        let t = ws.take(&name, &[height, cfg.hidden]).map_err(|e| match e {
            Error::Model { path, msg } => Error::Model {
                path,
                msg: format!(
                    "{msg} (fused: {})",
                    parts.iter().map(|p| p.0.as_str()).collect::<Vec<_>>().join(" + ")
                ),
            },
            other => other,
        })?;
        for (piece, mut first, n) in parts {
            if k_first && piece.ends_with("self_attn.q_proj.weight") {
                first = cfg.kv_heads * cfg.head_dim;
            } else if k_first && piece.ends_with("self_attn.k_proj.weight") {
                first = 0;
            }
            ws.insert(piece, t.rows(first, n));
        }
    }
    Ok(())
}
