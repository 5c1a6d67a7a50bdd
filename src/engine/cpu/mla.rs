//! The CPU engine's multi-head latent attention (`model::mla`): q, k and v
//! from the latents, RoPE on each head's last `rope` dims, and the padding
//! that lets the one attention kernel serve value heads narrower than the
//! q/k heads.
//!
//! Arithmetic: every projection's output and every RMSNorm's is stored
//! (rounded to storage) as in plain attention; splitting and concatenating
//! copy. Values are padded with zeros to the q/k head width before the
//! cache and the attention (each context element is Σ p·v over its own
//! column: a zero column changes no other), and the context cut back to
//! `v_head_dim` per head.

use crate::error::Result;
use crate::model::config::ModelConfig;
use crate::model::mla::Mla;
use crate::model::Weights;
use crate::tensor::DType;

use super::linear::Linear;
use super::mutants::{Mutant, Mutants};
use super::ops::{rmsnorm_over, Rope};

/// A block's latent-attention weights (HF names under `….self_attn`).
#[derive(Clone, Debug)]
pub struct LatentWeights {
    /// `q_a_proj` `[q_lora_rank, E]` and `q_a_layernorm` `[q_lora_rank]`.
    pub q_a: Option<(Linear, Vec<f32>)>,
    /// `q_b_proj` `[H·Dqk, q_lora_rank]`, or `q_proj` `[H·Dqk, E]`.
    pub q: Linear,
    /// `kv_a_proj_with_mqa` `[kv_lora_rank + rope, E]`.
    pub kv_a: Linear,
    /// `kv_a_layernorm` `[kv_lora_rank]`.
    pub kv_a_norm: Vec<f32>,
    /// `kv_b_proj` `[H·(nope + v_head_dim), kv_lora_rank]`.
    pub kv_b: Linear,
}

impl LatentWeights {
    pub(crate) fn load(ws: &mut Weights, cfg: &ModelConfig, m: &Mla, block: &str) -> Result<LatentWeights> {
        let p = format!("{block}.self_attn");
        let (e, h) = (cfg.hidden, cfg.heads);
        let qd = h * m.qk_head_dim();
        let (q_a, q) = match m.q_lora_rank {
            Some(r) => (
                Some((
                    Linear::load(ws, &format!("{p}.q_a_proj"), r, e)?,
                    ws.take(&format!("{p}.q_a_layernorm.weight"), &[r])?.into_data(),
                )),
                Linear::load(ws, &format!("{p}.q_b_proj"), qd, r)?,
            ),
            None => (None, Linear::load(ws, &format!("{p}.q_proj"), qd, e)?),
        };
        Ok(LatentWeights {
            q_a,
            q,
            kv_a: Linear::load(ws, &format!("{p}.kv_a_proj_with_mqa"), m.kv_lora_rank + m.rope, e)?,
            kv_a_norm: ws.take(&format!("{p}.kv_a_layernorm.weight"), &[m.kv_lora_rank])?.into_data(),
            kv_b: Linear::load(ws, &format!("{p}.kv_b_proj"), h * (m.nope + m.v_head_dim), m.kv_lora_rank)?,
        })
    }

    /// Every tensor under its HF name (`p` = `….self_attn`).
    pub(crate) fn visit(&self, p: &str, f: &mut crate::engine::WeightVisitor) {
        let lin = super::linear::visit_linear;
        match &self.q_a {
            Some((a, n)) => {
                lin(f, &format!("{p}.q_a_proj"), a);
                f(&format!("{p}.q_a_layernorm.weight"), &[n.len()], n);
                lin(f, &format!("{p}.q_b_proj"), &self.q);
            }
            None => lin(f, &format!("{p}.q_proj"), &self.q),
        }
        lin(f, &format!("{p}.kv_a_proj_with_mqa"), &self.kv_a);
        f(&format!("{p}.kv_a_layernorm.weight"), &[self.kv_a_norm.len()], &self.kv_a_norm);
        lin(f, &format!("{p}.kv_b_proj"), &self.kv_b);
    }

    pub(crate) fn linears_mut(&mut self) -> Vec<&mut Linear> {
        let mut v = vec![&mut self.q, &mut self.kv_a, &mut self.kv_b];
        if let Some((a, _)) = &mut self.q_a {
            v.push(a);
        }
        v
    }

    pub(crate) fn round_to(&mut self, storage: DType) {
        storage.round_slice(&mut self.kv_a_norm);
        if let Some((_, n)) = &mut self.q_a {
            storage.round_slice(n);
        }
    }
}

/// RMSNorm of `width`-wide rows with weight `w`, stored.
fn norm(x: &[f32], width: usize, w: &[f32], eps: f64, sd: DType) -> Vec<f32> {
    let mut y = rmsnorm_over(x, width, w, eps, width);
    sd.round_slice(&mut y);
    y
}

/// q `[T, H, Dqk]`, k `[T, H, Dqk]` (before RoPE) and v `[T, H, Dv]` from
/// `hn` (`[T, E]`, the stored attn_norm).
pub fn project(cfg: &ModelConfig, w: &LatentWeights, hn: &[f32], t: usize, sd: DType) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let m = cfg.mla.as_ref().expect("latent attention has an MLA config");
    let (h, d, dv, r) = (cfg.heads, cfg.head_dim, m.v_head_dim, m.kv_lora_rank);
    let q = match &w.q_a {
        Some((a, n)) => {
            let qa = a.forward(hn, t, sd);
            let qa = norm(&qa, a.out_f, n, cfg.rms_eps, sd);
            w.q.forward(&qa, t, sd)
        }
        None => w.q.forward(hn, t, sd),
    };
    let kva = w.kv_a.forward(hn, t, sd);
    let lat: Vec<f32> = kva.chunks_exact(r + m.rope).flat_map(|row| row[..r].iter().copied()).collect();
    let lat = norm(&lat, r, &w.kv_a_norm, cfg.rms_eps, sd);
    let kvb = w.kv_b.forward(&lat, t, sd);
    let mut k = Vec::with_capacity(t * h * d);
    let mut v = Vec::with_capacity(t * h * dv);
    for (row, kv_row) in kvb.chunks_exact(h * (m.nope + dv)).enumerate() {
        let pe = &kva[row * (r + m.rope) + r..][..m.rope];
        for head in kv_row.chunks_exact(m.nope + dv) {
            k.extend_from_slice(&head[..m.nope]);
            k.extend_from_slice(pe);
            v.extend_from_slice(&head[m.nope..]);
        }
    }
    (q, k, v)
}

/// Rotates the RoPE part (each head's last `rope` dims) of `x` `[T, heads,
/// Dqk]` at `positions`: interleaved pairs in, de-interleaved out (HF's
/// `apply_rotary_pos_emb_interleave`), or rotate-half. The planted bug
/// rotates the first `rope` dims instead (the no-RoPE part).
pub fn rotate(m: &Mla, rope: &Rope, x: &mut [f32], heads: usize, positions: &[usize], mx: Mutants) {
    let d = m.qk_head_dim();
    let half = m.rope / 2;
    let at = if mx.is(Mutant::MlaRopeWrongPart) { 0 } else { m.nope };
    for (row, &pos) in x.chunks_exact_mut(heads * d).zip(positions) {
        let (cos, sin) = rope.cos_sin(pos);
        for head in row.chunks_exact_mut(d) {
            let part = &mut head[at..at + m.rope];
            let old = part.to_vec();
            for j in 0..half {
                let (a, b) = if m.interleave {
                    (old[2 * j], old[2 * j + 1])
                } else {
                    (old[j], old[j + half])
                };
                part[j] = a * cos[j] - b * sin[j];
                part[j + half] = b * cos[j] + a * sin[j];
            }
        }
    }
}

/// v `[T, H, Dv]` padded with zeros to `[T, H, Dqk]` (the cache's width).
pub fn pad_values(v: &[f32], heads: usize, dv: usize, d: usize) -> Vec<f32> {
    let rows = v.len() / (heads * dv).max(1);
    let mut out = vec![0.0f32; rows * heads * d];
    for (o, i) in out.chunks_exact_mut(d).zip(v.chunks_exact(dv)) {
        o[..dv].copy_from_slice(i);
    }
    out
}

/// A context `[T, H·Dqk]` cut to `[T, H·Dv]`.
pub fn cut_context(ctx: &[f32], dv: usize, d: usize) -> Vec<f32> {
    ctx.chunks_exact(d).flat_map(|h| h[..dv].iter().copied()).collect()
}
