//! Causal grouped-query attention of one step's queries over the KV cache, as
//! HF's eager attention computes it: `softmax(q·kᵀ · D^-0.5 + causal_mask) · v`
//! with the softmax in f32 (max subtracted, then multiplied by 1/sum like
//! torch's CPU kernel); with attention sinks (gpt-oss) each head's sink
//! logit joins every row's softmax and is dropped after it. Heads run in parallel on rayon; each head's arithmetic
//! is independent of the others, so results are bitwise deterministic.

use matrixmultiply::sgemm;
use rayon::prelude::*;

use super::mutants::{Mutant, Mutants};

/// Head counts and widths of one attention call.
#[derive(Clone, Copy, Debug)]
pub struct AttnShape<'a> {
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    /// The scale of q·kᵀ (`ModelConfig::attn_scale`).
    pub scale: f64,
    /// A local layer's sliding window: query at p sees keys p − window < j ≤ p.
    pub window: Option<usize>,
    /// Key j is visible to query row t only if j ≤ pos0 + t (a decoder);
    /// false: every key is visible (a vision tower, bidirectional).
    pub causal: bool,
    /// Planted bugs (test builds only).
    pub mutants: Mutants,
    /// The key count a batched kernel pads every sequence to (the longest
    /// of the step): only the planted padded-softmax bug reads it.
    pub batch_pad: usize,
    /// Per query head, its sink logit (gpt-oss's `self_attn.sinks`), which
    /// joins the softmax's max and sum but has no value: a row then sums to
    /// less than 1. None: no sinks.
    pub sinks: Option<&'a [f32]>,
}

impl AttnShape<'_> {
    /// The KV head query head `h` reads (HF's `repeat_kv`: consecutive groups
    /// of H/KV query heads share one KV head).
    pub fn kv_head(&self, h: usize) -> usize {
        if self.mutants.is(Mutant::GqaModulo) {
            return h % self.kv_heads;
        }
        h / (self.heads / self.kv_heads)
    }
}

/// Attention results of one step.
pub struct Attended {
    /// `[T, H·D]`: probs·V, the input of the output projection.
    pub ctx: Vec<f32>,
    /// `[H, T, S]`: the softmax (the working buffer itself, so capturing it is
    /// a move, not a copy).
    pub probs: Vec<f32>,
    /// `[H, T, S]`: the scaled scores the softmax was applied to (masked
    /// entries 0), when asked for; copying them costs a pass over `probs`.
    pub scores: Option<Vec<f32>>,
}

/// Attends `q` (`[T, H, D]`, after RoPE, rows at positions `pos0..pos0+T`) over
/// `keys`/`values` (`[S, KV, D]`, S ≥ pos0+T, keys after RoPE). Key j is visible
/// to query row t iff j ≤ pos0 + t; masked probabilities are exactly 0.
/// With `keep_scores`, the scaled scores (masked entries 0) are returned too.
pub fn attend(
    q: &[f32],
    t: usize,
    pos0: usize,
    keys: &[f32],
    values: &[f32],
    shape: AttnShape,
    keep_scores: bool,
) -> Attended {
    let AttnShape {
        heads,
        kv_heads,
        head_dim: d,
        scale,
        window,
        causal,
        mutants,
        batch_pad,
        sinks,
    } = shape;
    assert!(sinks.is_none_or(|s| s.len() == heads), "attend: one sink per query head");
    let kv_row = kv_heads * d;
    let s = keys.len() / kv_row;
    assert_eq!(q.len(), t * heads * d, "attend: q is not [T,H,D]");
    assert_eq!(values.len(), keys.len(), "attend: keys and values differ in length");
    assert!(!causal || pos0 + t <= s, "attend: queries past the cache");
    // HF's `scaling = head_dim ** -0.5` (Gemma: query_pre_attn_scalar ** -0.5),
    // a Python float rounded to f32 when it multiplies the f32 scores.
    let mut scale = scale as f32;
    if mutants.is(Mutant::AttnScaleOverD) {
        scale = 1.0 / d as f32;
    }

    let mut probs = vec![0.0f32; heads * t * s];
    let mut ctx_heads = vec![0.0f32; heads * t * d];
    // Without `keep_scores`, one unused float per head (rayon's chunks cannot be empty).
    let score_chunk = if keep_scores { t * s } else { 1 };
    let mut scores = vec![0.0f32; heads * score_chunk];
    probs
        .par_chunks_mut(t * s)
        .zip(ctx_heads.par_chunks_mut(t * d))
        .zip(scores.par_chunks_mut(score_chunk))
        .enumerate()
        .for_each(|(h, ((p, c), sc))| {
            let kvh = shape.kv_head(h);
            // SAFETY (both calls): pointers and strides stay inside q
            // ([T,H,D]), keys/values ([S,KV,D]), p ([T,S]) and c ([T,D]),
            // whose lengths are asserted above.
            unsafe {
                // scores[T,S] = q_h[T,D] · k_hᵀ[D,S]
                sgemm(
                    t,
                    d,
                    s,
                    1.0,
                    q.as_ptr().add(h * d),
                    (heads * d) as isize,
                    1,
                    keys.as_ptr().add(kvh * d),
                    1,
                    kv_row as isize,
                    0.0,
                    p.as_mut_ptr(),
                    s as isize,
                    1,
                );
            }
            for (row_i, row) in p.chunks_exact_mut(s).enumerate() {
                let mut visible = if causal { pos0 + row_i + 1 } else { s };
                if mutants.is(Mutant::CausalOffByOne) {
                    visible += 1;
                }
                if mutants.is(Mutant::KvReadShort) {
                    visible = visible.min(32);
                }
                // A local layer sees only the last `window` positions.
                let w = window.map(|w| w + usize::from(mutants.is(Mutant::WindowOneTooWide)));
                let first = w.map_or(0, |w| (pos0 + row_i + 1).saturating_sub(w));
                scale_and_mask(row, first, visible, scale);
                if keep_scores {
                    sc[row_i * s..][..s].copy_from_slice(row);
                }
                // The padded-softmax bug: padding slots (score 0) counted in the sum.
                let padding = if mutants.is(Mutant::SoftmaxOverPaddedLength) {
                    batch_pad.saturating_sub(s)
                } else {
                    0
                };
                let sink = sinks.filter(|_| !mutants.is(Mutant::SinksIgnored)).map(|s| s[h]);
                softmax_visible(row, first, visible, mutants.is(Mutant::SoftmaxUnnormalised), padding, sink);
            }
            unsafe {
                // ctx_h[T,D] = probs_h[T,S] · v_h[S,D]; masked probs are 0.
                sgemm(
                    t,
                    s,
                    d,
                    1.0,
                    p.as_ptr(),
                    s as isize,
                    1,
                    values.as_ptr().add(kvh * d),
                    kv_row as isize,
                    1,
                    0.0,
                    c.as_mut_ptr(),
                    d as isize,
                    1,
                );
            }
        });

    // [H, T, D] -> [T, H·D]
    let mut ctx = vec![0.0f32; t * heads * d];
    for h in 0..heads {
        for r in 0..t {
            ctx[(r * heads + h) * d..][..d].copy_from_slice(&ctx_heads[(h * t + r) * d..][..d]);
        }
    }
    let scores = keep_scores.then_some(scores);
    Attended { ctx, probs, scores }
}

/// Multiplies the raw scores by the attention scale and zeroes everything
/// before `first` and from `visible` on: the `attn_scores` stage.
fn scale_and_mask(row: &mut [f32], first: usize, visible: usize, scale: f32) {
    let (live, masked) = row.split_at_mut(visible.min(row.len()));
    masked.fill(0.0);
    let first = first.min(live.len());
    live[..first].fill(0.0);
    for x in live[first..].iter_mut() {
        *x *= scale;
    }
}

/// An f32 softmax over the visible prefix of scaled scores, in place, in
/// torch's order: max, exp(x−max), sum, multiply by 1/sum. Masked entries stay
/// exactly 0, as exp(−inf) makes them in HF (its mask adds f32::MIN).
/// A sink logit is one more entry of the max and the sum, last (HF's
/// `cat([scores, sinks])`), whose probability is then dropped.
fn softmax_visible(row: &mut [f32], first: usize, visible: usize, unnormalised: bool, padding: usize, sink: Option<f32>) {
    let n = visible.min(row.len());
    let live = &mut row[first.min(n)..n];
    let mut max = sink.unwrap_or(f32::NEG_INFINITY);
    for x in live.iter() {
        max = max.max(*x);
    }
    let mut sum = 0.0f32;
    for x in live.iter_mut() {
        *x = (*x - max).exp();
        sum += *x;
    }
    if let Some(s) = sink {
        sum += (s - max).exp();
    }
    if padding > 0 {
        sum += padding as f32 * (-max).exp();
    }
    let inv = if unnormalised { 1.0 } else { 1.0 / sum };
    for x in live.iter_mut() {
        *x *= inv;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn data(n: usize, seed: usize) -> Vec<f32> {
        (0..n)
            .map(|i| (((i + seed) * 2654435761usize % 1000) as f32 / 500.0) - 1.0)
            .collect()
    }

    #[test]
    fn probs_rows_sum_to_one_and_future_is_exactly_zero() {
        let shape = AttnShape {
            causal: true,
            heads: 4,
            kv_heads: 2,
            head_dim: 8,
            scale: 8f64.powf(-0.5),
            window: None,
            mutants: Mutants::default(),
            batch_pad: 0,
            sinks: None,
        };
        let (t, s) = (5, 5);
        let q = data(t * 4 * 8, 1);
        let k = data(s * 2 * 8, 2);
        let v = data(s * 2 * 8, 3);
        let a = attend(&q, t, 0, &k, &v, shape, false);
        assert_eq!(a.probs.len(), 4 * t * s);
        for h in 0..4 {
            for r in 0..t {
                let row = &a.probs[(h * t + r) * s..][..s];
                let sum: f32 = row.iter().sum();
                assert!((sum - 1.0).abs() < 1e-6, "head {h} row {r} sums to {sum}");
                assert!(row[..=r].iter().all(|&p| p > 0.0));
                assert!(row[r + 1..].iter().all(|&p| p == 0.0), "row {r} sees the future");
            }
        }
        // Row 0 sees only key 0: its context is exactly v[0] of its KV head.
        assert_eq!(&a.ctx[..8], &v[..8]);
    }

    #[test]
    fn a_sink_joins_the_softmax_and_its_share_is_dropped() {
        let sinks = [0.75f32, -2.0];
        let shape = AttnShape {
            causal: true,
            heads: 2,
            kv_heads: 1,
            head_dim: 4,
            scale: 0.5,
            window: None,
            mutants: Mutants::default(),
            batch_pad: 0,
            sinks: Some(&sinks),
        };
        let (t, s) = (3, 3);
        let a = attend(&data(t * 8, 12), t, 0, &data(s * 4, 13), &data(s * 4, 14), shape, true);
        let scores = a.scores.unwrap();
        for h in 0..2 {
            for r in 0..t {
                let at = (h * t + r) * s;
                // softmax over [visible scores, sink] in f64, the sink's entry dropped.
                let z: f64 = scores[at..at + r + 1].iter().map(|&x| (x as f64).exp()).sum::<f64>()
                    + (sinks[h] as f64).exp();
                for j in 0..=r {
                    let want = (scores[at + j] as f64).exp() / z;
                    assert!((a.probs[at + j] as f64 - want).abs() < 1e-6, "head {h} row {r} key {j}");
                }
                let sum: f32 = a.probs[at..at + s].iter().sum();
                assert!(sum < 1.0 - 1e-3, "head {h} row {r}: the sink takes a share, sum {sum}");
            }
        }
    }

    #[test]
    fn gqa_maps_query_heads_to_their_group() {
        let shape = AttnShape {
            causal: true,
            heads: 6,
            kv_heads: 2,
            head_dim: 4,
            scale: 4f64.powf(-0.5),
            window: None,
            mutants: Mutants::default(),
            batch_pad: 0,
            sinks: None,
        };
        assert_eq!((0..6).map(|h| shape.kv_head(h)).collect::<Vec<_>>(), [0, 0, 0, 1, 1, 1]);
        // One query row at position 0 sees only key 0, so query head h's
        // context must equal the value of its KV head.
        let v: Vec<f32> = (0..8).map(|i| i as f32).collect();
        let a = attend(&data(24, 4), 1, 0, &data(8, 5), &v, shape, false);
        for h in 0..6 {
            let kvh = shape.kv_head(h);
            assert_eq!(&a.ctx[h * 4..h * 4 + 4], &v[kvh * 4..kvh * 4 + 4], "head {h}");
        }
    }

    #[test]
    fn a_window_masks_keys_older_than_it_in_scores_and_probs() {
        let shape = AttnShape {
            causal: true,
            heads: 2,
            kv_heads: 1,
            head_dim: 4,
            scale: 0.5,
            window: Some(2),
            mutants: Mutants::default(),
            batch_pad: 0,
            sinks: None,
        };
        let (t, s) = (4, 4);
        let a = attend(&data(t * 8, 9), t, 0, &data(s * 4, 10), &data(s * 4, 11), shape, true);
        let scores = a.scores.unwrap();
        for h in 0..2 {
            for r in 0..t {
                let row = &a.probs[(h * t + r) * s..][..s];
                let first = (r + 1).saturating_sub(2);
                assert!((row.iter().sum::<f32>() - 1.0).abs() < 1e-6);
                for (j, &p) in row.iter().enumerate() {
                    let seen = (first..=r).contains(&j);
                    assert_eq!(p > 0.0, seen, "head {h} row {r} key {j}");
                    if !seen {
                        assert_eq!(scores[(h * t + r) * s + j], 0.0, "masked score is exactly 0");
                    }
                }
            }
        }
    }

    #[test]
    fn decode_row_equals_last_prefill_row() {
        let shape = AttnShape {
            causal: true,
            heads: 2,
            kv_heads: 1,
            head_dim: 4,
            scale: 4f64.powf(-0.5),
            window: None,
            mutants: Mutants::default(),
            batch_pad: 0,
            sinks: None,
        };
        let (t, s) = (3, 3);
        let q = data(t * 8, 6);
        let (k, v) = (data(s * 4, 7), data(s * 4, 8));
        let full = attend(&q, t, 0, &k, &v, shape, true);
        let last = attend(&q[2 * 8..], 1, 2, &k, &v, shape, true);
        assert_eq!(&last.ctx[..], &full.ctx[2 * 8..]);
        assert_eq!(&last.probs[..s], &full.probs[2 * s..3 * s]);
        let (fs, ls) = (full.scores.unwrap(), last.scores.unwrap());
        assert_eq!(&ls[..s], &fs[2 * s..3 * s]);
        // Row 0 of head 0 sees key 0 only: the rest of its scores are masked to 0.
        assert!(fs[1..s].iter().all(|&x| x == 0.0) && fs[0] != 0.0);
        // Scores are the softmax input: softmax of a row's visible scores is its probs.
        let row = &fs[2 * s..3 * s];
        let m = row.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
        let z: f32 = row.iter().map(|x| (x - m).exp()).sum();
        for (x, p) in row.iter().zip(&full.probs[2 * s..3 * s]) {
            assert!(((x - m).exp() / z - p).abs() < 1e-6);
        }
    }
}
