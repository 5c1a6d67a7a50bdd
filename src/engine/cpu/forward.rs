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

use std::borrow::Cow;

use crate::stage::{BlockStage as B, Stage};

use super::attention::{attend, AttnShape};
use super::kv_cache::KvCache;
use super::layers::{Ffn, Linear, ModelWeights, Qkv};
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

/// One sequence's share of a forward pass: its tokens (already checked <
/// vocab) at positions `pos0..pos0+T`, and where its taps go. A batched step
/// runs several, each with its own KV cache in the `KvStore`; a plain run is
/// a batch of one.
pub struct Seg<'a> {
    pub tokens: &'a [u32],
    pub pos0: usize,
    pub tap: Tap<'a>,
}

/// Where a forward pass keeps keys (after RoPE) and values, `[S, KV, D]` per
/// (sequence of the batch, layer): one run's contiguous cache, or the serving
/// state's paged pool.
pub trait KvStore {
    /// Appends sequence `seg`'s step keys and values (`[T, KV, D]`) at `layer`.
    fn append(&mut self, seg: usize, layer: usize, k: &[f32], v: &[f32]);
    /// The keys and values `seg`'s attention reads at `layer` (every position
    /// it holds, this step's included). `neighbour`: the planted
    /// neighbouring-sequence bug of tests (read its first block instead).
    fn read(&self, seg: usize, layer: usize, neighbour: Option<usize>) -> (Cow<'_, [f32]>, Cow<'_, [f32]>);
    /// The value row in the slot after the sequence's last position, when
    /// that slot exists in memory the sequence holds (a paged block with room
    /// left): what a kernel reading one slot past the sequence reads.
    fn slot_past(&self, seg: usize, layer: usize) -> Option<Vec<f32>> {
        let _ = (seg, layer);
        None
    }
    /// The planted "written one slot off" bug of tests.
    fn swap_last_two(&mut self, seg: usize, layer: usize);
}

impl KvStore for KvCache {
    fn append(&mut self, seg: usize, layer: usize, k: &[f32], v: &[f32]) {
        debug_assert_eq!(seg, 0, "a run's cache holds one sequence");
        self.layers[layer].append(k, v);
    }
    fn read(&self, _: usize, layer: usize, _: Option<usize>) -> (Cow<'_, [f32]>, Cow<'_, [f32]>) {
        let lc = &self.layers[layer];
        (Cow::Borrowed(lc.keys()), Cow::Borrowed(lc.values()))
    }
    fn swap_last_two(&mut self, _: usize, layer: usize) {
        self.layers[layer].swap_last_two();
    }
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
    tap: Tap,
    mm: Option<&Multimodal>,
) -> Vec<f32> {
    debug_assert_eq!(cache.len(), pos0, "cache out of step with positions");
    let mut segs = [Seg { tokens, pos0, tap }];
    forward_batch(cfg, w, ropes, &mut segs, cache, mm)
        .pop()
        .expect("one sequence")
}

/// Layer `l`'s RoPE table of `tables` (the planted local-base bug of tests).
fn layer_rope(tables: &LayerRopes, l: usize, mx: super::mutants::Mutants) -> &super::ops::Rope {
    if mx.is(Mutant::LocalRopeGlobalBase) {
        &tables.global
    } else {
        tables.of(l)
    }
}

/// The row range of each sequence in the batch's concatenated rows.
fn row_ranges(segs: &[Seg]) -> Vec<std::ops::Range<usize>> {
    let mut r0 = 0;
    segs.iter()
        .map(|s| {
            let r = r0..r0 + s.tokens.len();
            r0 = r.end;
            r
        })
        .collect()
}

/// Captures each sequence's rows of `data` (rows of `width` floats; the
/// stage's shape is `[T, dims…]`).
fn tap_rows(segs: &mut [Seg], rows: &[std::ops::Range<usize>], s: Stage, dims: &[usize], data: &[f32]) {
    if !segs[0].tap.wants(s) {
        return;
    }
    let width: usize = dims.iter().product();
    for (seg, r) in segs.iter_mut().zip(rows) {
        let mut shape = vec![r.len()];
        shape.extend_from_slice(dims);
        seg.tap.copy(s, &shape, &data[r.start * width..r.end * width]);
    }
}

/// One forward pass over a batch of sequences (a prefill, a chunk of one, or
/// decode steps, of different lengths in one step): every row-wise operation
/// (norms, projections, RoPE, residual adds, the LM head) runs once over the
/// rows of all sequences, attention per sequence over its own cache. A row's
/// arithmetic never depends on the other rows (`matmul`'s canonical dot
/// product), so a sequence gets the same bits alone or in any batch.
/// Returns each sequence's last row of logits. `mm` (a VLM step) only with a
/// batch of one.
pub fn forward_batch(
    cfg: &ModelConfig,
    w: &ModelWeights,
    ropes: &LayerRopes,
    segs: &mut [Seg],
    cache: &mut dyn KvStore,
    mm: Option<&Multimodal>,
) -> Vec<Vec<f32>> {
    assert!(mm.is_none() || segs.len() == 1, "a VLM step runs one sequence");
    let rows = row_ranges(segs);
    let t = rows.last().map_or(0, |r| r.end);
    let (e, v) = (cfg.hidden, cfg.vocab);
    let (h, kv, d, f) = (cfg.heads, cfg.kv_heads, cfg.head_dim, cfg.ffn);
    let dv = cfg.v_head_dim();
    let mx = segs[0].tap.mutants;
    let sd = segs[0].tap.dtype;
    let shape = AttnShape {
        causal: true,
        heads: h,
        kv_heads: kv,
        head_dim: d,
        scale: cfg.attn_scale,
        window: None,
        mutants: mx,
        batch_pad: 0,
        sinks: None,
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
    // The positions RoPE rotates at (the planted RoPE position bugs of tests).
    let rope_positions: Vec<usize> = segs
        .iter()
        .flat_map(|s| {
            let (pos0, n) = (s.pos0, s.tokens.len());
            (pos0..pos0 + n).map(move |p| {
                if mx.is(Mutant::RopeTableWrapping) {
                    p % 24
                } else if mx.is(Mutant::RopePositionFrozenInDecode) {
                    // The step-relative index: right for the prefill, 0 in decode.
                    p - pos0
                } else if mx.is(Mutant::ChunkRopeOffsetDropped) && p == pos0 && pos0 > 0 && n > 1 {
                    // A later prefill chunk's first row rotated at 0.
                    0
                } else {
                    p
                }
            })
        })
        .collect();
    // The storage dtype's rounding (the identity for f32).
    let stored = |mut y: Vec<f32>| {
        sd.round_slice(&mut y);
        y
    };

    // The gather of rounded embedding rows is already in storage; Gemma's
    // scale (an f32 product, as HF's) is stored again.
    let mut x = Vec::with_capacity(t * e);
    for &tok in segs.iter().flat_map(|s| s.tokens) {
        x.extend_from_slice(&w.embed.data()[tok as usize * e..][..e]);
    }
    if let Some(scale) = cfg.embed_scale.filter(|_| !mx.is(Mutant::EmbedNotScaled)) {
        x.iter_mut().for_each(|v| *v *= scale);
        sd.round_slice(&mut x);
    }
    tap_rows(segs, &rows, Stage::Embed, &[e], &x);
    // The image-pad rows, in order: where the image features go.
    let tokens = segs[0].tokens;
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
        let tap = &mut segs[0].tap;
        tap.copy(Stage::InputsEmbeds, &[t, e], &x);
        if cfg.mrope.is_some() {
            let p: Vec<f32> = m.positions.iter().flat_map(|a| a.iter().map(|&v| v as f32)).collect();
            tap.keep(Stage::Positions, &[3, t], p);
        }
    }
    // Each sequence's own tables where they depend on how far its pass
    // reaches (dynamic NTK, LongRoPE: HF's seq_len = last position + 1).
    let pass_ropes: Vec<Option<LayerRopes>> = segs
        .iter()
        .map(|s| {
            let seq_len = s.pos0 + s.tokens.len();
            match super::mutants::planted_pass_table(mx, cfg, seq_len) {
                Some(r) => Some(ropes.replaced(r)),
                None => ropes.for_pass(seq_len),
            }
        })
        .collect();
    // The longest cache a sequence of this step attends over: what a batched
    // kernel pads to (only the planted padded-softmax bug reads it).
    let longest = segs.iter().map(|s| s.pos0 + s.tokens.len()).max().unwrap_or(0);

    for (l, b) in w.blocks.iter().enumerate() {
        let st = |s: B| Stage::Block(l, s);
        let hn = stored(rmsnorm(&x, e, &b.attn_norm, cfg.rms_eps));
        tap_rows(segs, &rows, st(B::AttnNorm), &[e], &hn);

        let no_bias = mx.is(Mutant::QkvBiasDropped);
        let (mut q, mut k, vv) = match &b.qkv {
            Qkv::Split { q, k, v } => {
                let [q, k, v] = Linear::forward_many([q, k, v], &hn, t, sd, !no_bias);
                (q, k, v)
            }
            Qkv::Latent(m) => super::mla::project(cfg, m, &hn, t, sd),
        };
        tap_rows(segs, &rows, st(B::Q), &[h, d], &q);
        tap_rows(segs, &rows, st(B::K), &[kv, d], &k);
        tap_rows(segs, &rows, st(B::V), &[kv, dv], &vv);
        // Latent attention's values, padded to the cache's head width.
        let vv = match &cfg.mla {
            Some(_) => super::mla::pad_values(&vv, kv, dv, d),
            None => vv,
        };
        // Qwen3: RMSNorm over each head's D values (rows of D), before RoPE.
        if let (Some(qn), Some(kn)) = (&b.q_norm, &b.k_norm) {
            if !mx.is(Mutant::SkipQkNorm) {
                q = stored(rmsnorm(&q, d, qn, cfg.rms_eps));
                k = stored(rmsnorm(&k, d, kn, cfg.rms_eps));
            }
            tap_rows(segs, &rows, st(B::QNorm), &[h, d], &q);
            tap_rows(segs, &rows, st(B::KNorm), &[kv, d], &k);
        }
        match (mm, &axes) {
            (Some(m), Some(axes)) => {
                let rope = layer_rope(ropes, l, mx);
                rope.apply_axes(&mut q, h, &m.positions, axes);
                rope.apply_axes(&mut k, kv, &m.positions, axes);
            }
            _ => {
                for (r, own) in rows.iter().zip(&pass_ropes) {
                    let rope = layer_rope(own.as_ref().unwrap_or(ropes), l, mx);
                    let p = &rope_positions[r.clone()];
                    let (qs, ks) = (&mut q[r.start * h * d..r.end * h * d], &mut k[r.start * kv * d..r.end * kv * d]);
                    match &cfg.mla {
                        Some(m) => {
                            super::mla::rotate(m, rope, qs, h, p, mx);
                            super::mla::rotate(m, rope, ks, kv, p, mx);
                        }
                        None => {
                            rope.apply(qs, h, p);
                            rope.apply(ks, kv, p);
                        }
                    }
                }
            }
        }
        sd.round_slice(&mut q);
        sd.round_slice(&mut k);
        tap_rows(segs, &rows, st(B::QRope), &[h, d], &q);
        tap_rows(segs, &rows, st(B::KRope), &[kv, d], &k);

        let keep_scores = segs[0].tap.wants(st(B::AttnScores));
        let untapped = !(keep_scores || segs[0].tap.wants(st(B::AttnProbs)));
        let mut ctx = Vec::with_capacity(t * h * d);
        let n_segs = segs.len();
        for (i, (seg, r)) in segs.iter_mut().zip(&rows).enumerate() {
            let n = r.len();
            cache.append(
                i,
                l,
                &k[r.start * kv * d..r.end * kv * d],
                &vv[r.start * kv * d..r.end * kv * d],
            );
            if mx.is(Mutant::KvWrittenOneSlotOff) && n == 1 {
                cache.swap_last_two(i, l);
            }
            let neighbour = (mx.is(Mutant::DecodeReadsNeighbourKv) && n == 1 && n_segs > 1).then(|| (i + 1) % n_segs);
            let (keys, values) = cache.read(i, l, neighbour);
            let s = keys.len() / (kv * d);
            let shape = AttnShape {
                causal: true,
                window: cfg.window_of(l),
                scale: if untapped && mx.is(Mutant::UntappedAttnScale) {
                    1.0 / d as f64
                } else {
                    shape.scale
                },
                batch_pad: if mx.is(Mutant::SoftmaxOverPaddedLength) {
                    longest
                } else {
                    0
                },
                sinks: b.sinks.as_deref(),
                ..shape
            };
            let att = attend(
                &q[r.start * h * d..r.end * h * d],
                n,
                seg.pos0,
                &keys,
                &values,
                shape,
                keep_scores,
            );
            // Scores and probabilities stay f32 (not rounded); the context is stored.
            if let Some(scores) = att.scores {
                seg.tap.keep(st(B::AttnScores), &[h, n, s], scores);
            }
            seg.tap.keep(st(B::AttnProbs), &[h, n, s], att.probs);
            let mut c = att.ctx;
            if mx.is(Mutant::ReadsOneSlotPast) {
                // The p·v loop runs one slot long with p = 0 there: harmless
                // on finite memory, NaN on poisoned memory (0·NaN).
                if let Some(past) = cache.slot_past(i, l) {
                    for row in c.chunks_exact_mut(h * d) {
                        for (hh, head) in row.chunks_exact_mut(d).enumerate() {
                            let kvh = shape.kv_head(hh);
                            head.iter_mut()
                                .zip(&past[kvh * d..][..d])
                                .for_each(|(c, v)| *c += 0.0 * v);
                        }
                    }
                }
            }
            ctx.extend_from_slice(&c);
        }
        let ctx = match &cfg.mla {
            Some(_) => super::mla::cut_context(&stored(ctx), dv, d),
            None => stored(ctx),
        };
        tap_rows(segs, &rows, st(B::AttnCtx), &[h * dv], &ctx);
        let attn_out = if mx.is(Mutant::OProjHeadShareOff) {
            // The last head's ctx (hence its share of o_proj) 1e-3 too large.
            let mut c = ctx.clone();
            for row in c.chunks_exact_mut(h * dv) {
                row[(h - 1) * dv..].iter_mut().for_each(|v| *v *= 1.001);
            }
            b.o.forward(&c, t, sd)
        } else {
            b.o.forward(&ctx, t, sd)
        };
        tap_rows(segs, &rows, st(B::AttnOut), &[e], &attn_out);
        // Gemma: the branch is normed before the residual add.
        let attn_out = match &b.attn_post_norm {
            Some(n) => {
                let y = stored(rmsnorm(&attn_out, e, n, cfg.rms_eps));
                tap_rows(segs, &rows, st(B::AttnPostNorm), &[e], &y);
                y
            }
            None => attn_out,
        };

        let ffn_inp = if mx.is(Mutant::ResidualMissing) {
            attn_out.clone()
        } else {
            stored(add(&x, &attn_out))
        };
        tap_rows(segs, &rows, st(B::FfnInp), &[e], &ffn_inp);
        let hn = stored(rmsnorm(&ffn_inp, e, &b.ffn_norm, cfg.rms_eps));
        tap_rows(segs, &rows, st(B::FfnNorm), &[e], &hn);
        let ffn_out = match &b.ffn {
            Ffn::Dense(m) => {
                let [gate, up] = Linear::forward_many([&m.gate, &m.up], &hn, t, sd, true);
                tap_rows(segs, &rows, st(B::FfnGate), &[f], &gate);
                tap_rows(segs, &rows, st(B::FfnUp), &[f], &up);
                let act = if mx.is(Mutant::SiluOnUp) {
                    stored(act_mul(cfg.act, &up, &gate))
                } else {
                    stored(act_mul(cfg.act, &gate, &up))
                };
                tap_rows(segs, &rows, st(B::FfnAct), &[f], &act);
                m.down.forward(&act, t, sd)
            }
            Ffn::Moe(m) => {
                let o = super::moe::forward(cfg, m, &hn, t, sd, mx);
                let (n, k) = (o.logits.len() / t.max(1), o.topk.len() / t.max(1));
                tap_rows(segs, &rows, st(B::FfnMoeLogits), &[n], &o.logits);
                tap_rows(segs, &rows, st(B::FfnMoeProbs), &[n], &o.probs);
                tap_rows(segs, &rows, st(B::FfnMoeTopk), &[k], &o.topk);
                tap_rows(segs, &rows, st(B::FfnMoeWeights), &[k], &o.weights);
                tap_rows(segs, &rows, st(B::FfnMoeOut), &[e], &o.routed);
                if let Some(s) = &o.shared {
                    tap_rows(segs, &rows, st(B::FfnShexpOut), &[e], s);
                }
                o.out
            }
        };
        tap_rows(segs, &rows, st(B::FfnOut), &[e], &ffn_out);
        let ffn_out = match &b.ffn_post_norm {
            Some(n) => {
                let y = stored(rmsnorm(&ffn_out, e, n, cfg.rms_eps));
                tap_rows(segs, &rows, st(B::FfnPostNorm), &[e], &y);
                y
            }
            None => ffn_out,
        };
        x = stored(add(&ffn_inp, &ffn_out));
        tap_rows(segs, &rows, st(B::Out), &[e], &x);
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
            segs[0].tap.copy(st(B::Deepstack), &[t, e], &x);
        }
    }

    // Only sampling needs a row per sequence when neither tail stage is
    // tapped: norm and project those rows alone (the vocab projection
    // dominates small models).
    let all_rows = segs[0].tap.wants(Stage::OutputNorm) || segs[0].tap.wants(Stage::Logits);
    let tail: Vec<usize> = if all_rows {
        (0..t).collect()
    } else {
        rows.iter().map(|r| r.end - 1).collect()
    };
    let x_tail: Vec<f32> = if all_rows {
        x
    } else {
        tail.iter().flat_map(|&r| x[r * e..][..e].iter().copied()).collect()
    };
    let xn = stored(rmsnorm(&x_tail, e, &w.norm, cfg.rms_eps));
    if all_rows {
        tap_rows(segs, &rows, Stage::OutputNorm, &[e], &xn);
    }
    // The LM head over every row only when the logits are tapped.
    let head_rows: Vec<usize> = if segs[0].tap.wants(Stage::Logits) {
        (0..tail.len()).collect()
    } else {
        rows.iter()
            .map(|r| tail.iter().position(|&x| x == r.end - 1).expect("a tail row"))
            .collect()
    };
    let head_in: Vec<f32> = if head_rows.len() == tail.len() {
        xn
    } else {
        head_rows
            .iter()
            .flat_map(|&r| xn[r * e..][..e].iter().copied())
            .collect()
    };
    let n_head = head_in.len() / e;
    let logits = match &w.lm_head {
        Some(lin) if !mx.is(Mutant::LmHeadTiedWhenUntied) => lin.forward(&head_in, n_head, sd),
        _ => {
            let head_in = super::layers::matmul_input(&head_in, e, w.tied_head_q8);
            stored(matmul_wt(&head_in, n_head, e, w.embed.data(), v))
        }
    };
    // Sampling reads the stored (rounded) logits: each sequence's last row.
    let lasts: Vec<Vec<f32>> = rows
        .iter()
        .enumerate()
        .map(|(i, r)| {
            let at = if n_head == t { r.end - 1 } else { i };
            logits[at * v..][..v].to_vec()
        })
        .collect();
    if n_head == t {
        match segs {
            // A run alone: the buffer itself is the capture (no copy).
            [seg] => seg.tap.keep(Stage::Logits, &[t, v], logits),
            _ => tap_rows(segs, &rows, Stage::Logits, &[v], &logits),
        }
    }
    lasts
}
