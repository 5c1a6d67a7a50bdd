//! One forward pass (a prefill or a decode step) of the Llama/Qwen2 decoder,
//! written as straight-line code in the canonical stage order so that each tap
//! sits exactly where the stage table (docs/stages-and-checks.md) says it is. Tapping goes through
//! `Tap`, which asks the `TapSet` before copying anything: an untapped run pays
//! for no copies, and the final norm and LM head run on the last row only.
//!
//! Storage: with f16/bf16 storage (`Tap::dtype`) every stage output is rounded
//! to that type where the CUDA engine stores it, and all arithmetic stays f32:
//! norms, projections (GEMM output rounded, then again after the bias add),
//! RoPE, attention context, SiLU·up and both residual adds are rounded; the
//! attention probabilities are not (the attention kernel keeps them in f32).
//! The KV cache therefore holds the rounded k_rope and v, and sampling reads
//! the rounded logits. With f32 storage every rounding is the identity.

use crate::stage::{BlockStage as B, Stage};

use super::attention::{attend, AttnShape};
use super::kv_cache::KvCache;
use super::layers::{Linear, ModelWeights};
use super::matmul::matmul_wt;
use super::mutants::Mutant;
use super::ops::{act_mul, add, rmsnorm_over, LayerRopes};
pub use super::tap::Tap;
use crate::model::ModelConfig;

/// A vision-language model's share of a step: the image features to fuse
/// (prefill) and the step's M-RoPE positions.
pub struct Multimodal<'a> {
    pub features: Option<&'a super::vision::ImageFeatures>,
    /// `[3][T]` (t, h, w) positions of the step's tokens.
    pub positions: [Vec<i64>; 3],
    pub image_token: u32,
}

/// Runs `tokens` (already checked < vocab) at positions `pos0..pos0+T`,
/// appending their keys and values to `cache` (which must hold exactly `pos0`
/// positions). Returns the last row's logits. A VLM's step (`mm`) fuses its
/// image features into the image-pad rows and rotates by M-RoPE positions.
#[allow(clippy::too_many_arguments)]
pub fn forward(
    cfg: &ModelConfig,
    w: &ModelWeights,
    ropes: &LayerRopes,
    tokens: &[u32],
    pos0: usize,
    cache: &mut KvCache,
    tap: &mut Tap,
    mm: Option<&Multimodal>,
) -> Vec<f32> {
    let (t, e, v) = (tokens.len(), cfg.hidden, cfg.vocab);
    let (h, kv, d, f) = (cfg.heads, cfg.kv_heads, cfg.head_dim, cfg.ffn);
    let mx = tap.mutants;
    let shape = AttnShape {
        causal: true,
        heads: h,
        kv_heads: kv,
        head_dim: d,
        scale: cfg.attn_scale,
        window: None,
        mutants: mx,
    };
    // RMSNorm of `width`-wide rows (with the planted norm bugs of tests).
    let rmsnorm = |x: &[f32], width: usize, w: &[f32], eps: f64| {
        let eps = if mx.is(Mutant::RmsEpsWrong) { 1e-5 } else { eps };
        let div = if mx.is(Mutant::RmsLengthWrong) {
            width - 1
        } else {
            width
        };
        // Gemma multiplies by 1 + w, formed in f32 as HF does.
        let plus_one = cfg.norm_plus_one && !mx.is(Mutant::NormWithoutPlusOne);
        let owned;
        let w = if mx.is(Mutant::RmsWeightMissing) {
            owned = vec![1.0f32; width];
            &owned[..]
        } else if plus_one {
            owned = w.iter().map(|w| 1.0 + w).collect();
            &owned[..]
        } else {
            w
        };
        rmsnorm_over(x, width, w, eps, div)
    };
    debug_assert_eq!(cache.len(), pos0, "cache out of step with positions");
    let positions: Vec<usize> = (pos0..pos0 + t).collect();
    // The positions RoPE rotates at (the planted RoPE position bugs of tests).
    let rope_positions: Vec<usize> = positions
        .iter()
        .map(|&p| {
            if mx.is(Mutant::RopeTableWrapping) {
                p % 24
            } else if mx.is(Mutant::RopePositionFrozenInDecode) {
                // The step-relative index: right for the prefill, 0 in decode.
                p - pos0
            } else {
                p
            }
        })
        .collect();
    // The storage dtype and its rounding (the identity for f32).
    let sd = tap.dtype;
    let stored = |mut y: Vec<f32>| {
        sd.round_slice(&mut y);
        y
    };

    // The gather of rounded embedding rows is already in storage; Gemma's
    // scale (an f32 product, as HF's) is stored again.
    let mut x = Vec::with_capacity(t * e);
    for &tok in tokens {
        x.extend_from_slice(&w.embed.data()[tok as usize * e..][..e]);
    }
    if let Some(scale) = cfg.embed_scale.filter(|_| !mx.is(Mutant::EmbedNotScaled)) {
        x.iter_mut().for_each(|v| *v *= scale);
        sd.round_slice(&mut x);
    }
    tap.copy(Stage::Embed, &[t, e], &x);
    // The image-pad rows, in order: where the image features go.
    let pads: Vec<usize> = match mm {
        Some(m) => (0..t).filter(|&i| tokens[i] == m.image_token).collect(),
        None => Vec::new(),
    };
    let axes: Option<Vec<usize>> = cfg.mrope.as_ref().map(|mr| (0..d / 2).map(|j| mr.axis_of(j)).collect());
    if let Some(m) = mm {
        if let Some(f) = m.features {
            // Feature row r replaces image-pad row r (HF's masked_scatter).
            let early = usize::from(mx.is(Mutant::FusionOneRowEarly));
            for (r, &row) in pads.iter().enumerate().take(f.rows) {
                let dst = row.saturating_sub(early);
                x[dst * e..][..e].copy_from_slice(&f.merger[r * e..][..e]);
            }
        }
        tap.copy(Stage::InputsEmbeds, &[t, e], &x);
        let p: Vec<f32> = m.positions.iter().flat_map(|a| a.iter().map(|&v| v as f32)).collect();
        tap.keep(Stage::Positions, &[3, t], p);
    }

    for (l, b) in w.blocks.iter().enumerate() {
        let st = |s: B| Stage::Block(l, s);
        let hn = stored(rmsnorm(&x, e, &b.attn_norm, cfg.rms_eps));
        tap.copy(st(B::AttnNorm), &[t, e], &hn);

        let no_bias = mx.is(Mutant::QkvBiasDropped);
        let [mut q, mut k, vv] = Linear::forward_many([&b.q, &b.k, &b.v], &hn, t, sd, !no_bias);
        tap.copy(st(B::Q), &[t, h, d], &q);
        tap.copy(st(B::K), &[t, kv, d], &k);
        tap.copy(st(B::V), &[t, kv, d], &vv);
        // Qwen3: RMSNorm over each head's D values (rows of D), before RoPE.
        if let (Some(qn), Some(kn)) = (&b.q_norm, &b.k_norm) {
            if !tap.mutants.is(Mutant::SkipQkNorm) {
                q = stored(rmsnorm(&q, d, qn, cfg.rms_eps));
                k = stored(rmsnorm(&k, d, kn, cfg.rms_eps));
            }
            tap.copy(st(B::QNorm), &[t, h, d], &q);
            tap.copy(st(B::KNorm), &[t, kv, d], &k);
        }
        let rope = if mx.is(Mutant::LocalRopeGlobalBase) {
            &ropes.global
        } else {
            ropes.of(l)
        };
        match (mm, &axes) {
            (Some(m), Some(axes)) => {
                rope.apply_axes(&mut q, h, &m.positions, axes);
                rope.apply_axes(&mut k, kv, &m.positions, axes);
            }
            _ => {
                rope.apply(&mut q, h, &rope_positions);
                rope.apply(&mut k, kv, &rope_positions);
            }
        }
        sd.round_slice(&mut q);
        sd.round_slice(&mut k);
        tap.copy(st(B::QRope), &[t, h, d], &q);
        tap.copy(st(B::KRope), &[t, kv, d], &k);

        let lc = &mut cache.layers[l];
        lc.append(&k, &vv);
        if mx.is(Mutant::KvWrittenOneSlotOff) && t == 1 {
            lc.swap_last_two();
        }
        let s = lc.len();
        let untapped = !(tap.wants(st(B::AttnScores)) || tap.wants(st(B::AttnProbs)));
        let shape = AttnShape {
            causal: true,
            window: cfg.window_of(l),
            scale: if untapped && mx.is(Mutant::UntappedAttnScale) {
                1.0 / d as f64
            } else {
                shape.scale
            },
            ..shape
        };
        let att = attend(&q, t, pos0, lc.keys(), lc.values(), shape, tap.wants(st(B::AttnScores)));
        // Scores and probabilities stay f32 (not rounded); the context is stored.
        if let Some(scores) = att.scores {
            tap.keep(st(B::AttnScores), &[h, t, s], scores);
        }
        tap.keep(st(B::AttnProbs), &[h, t, s], att.probs);
        let ctx = stored(att.ctx);
        tap.copy(st(B::AttnCtx), &[t, h * d], &ctx);
        let attn_out = if mx.is(Mutant::OProjHeadShareOff) {
            // The last head's ctx (hence its share of o_proj) 1e-3 too large.
            let mut c = ctx.clone();
            for row in c.chunks_exact_mut(h * d) {
                row[(h - 1) * d..].iter_mut().for_each(|v| *v *= 1.001);
            }
            b.o.forward(&c, t, sd)
        } else {
            b.o.forward(&ctx, t, sd)
        };
        tap.copy(st(B::AttnOut), &[t, e], &attn_out);
        // Gemma: the branch is normed before the residual add.
        let attn_out = match &b.attn_post_norm {
            Some(n) => {
                let y = stored(rmsnorm(&attn_out, e, n, cfg.rms_eps));
                tap.copy(st(B::AttnPostNorm), &[t, e], &y);
                y
            }
            None => attn_out,
        };

        let ffn_inp = if mx.is(Mutant::ResidualMissing) {
            attn_out.clone()
        } else {
            stored(add(&x, &attn_out))
        };
        tap.copy(st(B::FfnInp), &[t, e], &ffn_inp);
        let hn = stored(rmsnorm(&ffn_inp, e, &b.ffn_norm, cfg.rms_eps));
        tap.copy(st(B::FfnNorm), &[t, e], &hn);
        let [gate, up] = Linear::forward_many([&b.gate, &b.up], &hn, t, sd, true);
        tap.copy(st(B::FfnGate), &[t, f], &gate);
        tap.copy(st(B::FfnUp), &[t, f], &up);
        let act = if mx.is(Mutant::SiluOnUp) {
            stored(act_mul(cfg.act, &up, &gate))
        } else {
            stored(act_mul(cfg.act, &gate, &up))
        };
        tap.copy(st(B::FfnAct), &[t, f], &act);
        let ffn_out = b.down.forward(&act, t, sd);
        tap.copy(st(B::FfnOut), &[t, e], &ffn_out);
        let ffn_out = match &b.ffn_post_norm {
            Some(n) => {
                let y = stored(rmsnorm(&ffn_out, e, n, cfg.rms_eps));
                tap.copy(st(B::FfnPostNorm), &[t, e], &y);
                y
            }
            None => ffn_out,
        };
        x = stored(add(&ffn_inp, &ffn_out));
        tap.copy(st(B::Out), &[t, e], &x);
        // Qwen3-VL: deepstack feature l is added to the image rows after layer l.
        // The stage exists at every step of a VLM run (a decode step has no
        // image rows: it equals `out` there).
        let n_deep = cfg.vision.as_ref().map_or(0, |v| v.deepstack.len());
        if mm.is_some() && l < n_deep {
            if let Some(ds) = mm.and_then(|m| m.features).and_then(|f| f.deepstack.get(l)) {
                for (r, &row) in pads.iter().enumerate().take(ds.len() / e) {
                    for (xv, &dv) in x[row * e..][..e].iter_mut().zip(&ds[r * e..][..e]) {
                        *xv = sd.round(*xv + dv);
                    }
                }
            }
            tap.copy(st(B::Deepstack), &[t, e], &x);
        }
    }

    // Only sampling needs a row when neither tail stage is tapped: norm and
    // project the last row alone (the vocab projection dominates small models).
    let all_rows = tap.wants(Stage::OutputNorm) || tap.wants(Stage::Logits);
    let first = if all_rows { 0 } else { t - 1 };
    let xn = stored(rmsnorm(&x[first * e..], e, &w.norm, cfg.rms_eps));
    tap.copy(Stage::OutputNorm, &[t, e], &xn);
    let head_rows = if tap.wants(Stage::Logits) { t } else { 1 };
    let head_in = &xn[xn.len() - head_rows * e..];
    let logits = match &w.lm_head {
        Some(lin) if !mx.is(Mutant::LmHeadTiedWhenUntied) => lin.forward(head_in, head_rows, sd),
        _ => {
            let head_in = super::layers::matmul_input(head_in, e, w.tied_head_q8);
            stored(matmul_wt(&head_in, head_rows, e, w.embed.data(), v))
        }
    };
    // Sampling reads the stored (rounded) logits.
    let last = logits[(head_rows - 1) * v..].to_vec();
    tap.keep(Stage::Logits, &[t, v], logits);
    last
}
