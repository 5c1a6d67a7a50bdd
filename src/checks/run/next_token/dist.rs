//! The arithmetic of next-token distributions at one position, in float64:
//! log-softmax of an engine's logits, the KL divergence from the oracle on
//! the oracle's top-K tokens, the spread of logit errors over those tokens,
//! and top-k sets.
//!
//! The goldens keep only the oracle's top-K tokens of each position (the
//! vocabulary is 152k wide; a full row per position would be megabytes), so
//! the divergence is taken between the two distributions coarsened to those
//! K tokens plus one bucket for the rest of the vocabulary. Coarsening never
//! increases a KL divergence (the data-processing inequality), so this is a
//! lower bound of the full KL that is exact whenever the oracle's top K
//! carry all but a negligible mass — and it is computed the same way for
//! the engine and for every reference, so they are compared like for like.

/// `log_softmax` of one logits row, in float64 (the f32 logits widened
/// exactly first).
pub fn log_softmax(row: &[f32]) -> Vec<f64> {
    let max = row.iter().fold(f64::NEG_INFINITY, |m, &x| m.max(x as f64));
    let sum: f64 = row.iter().map(|&x| ((x as f64) - max).exp()).sum();
    let lse = max + sum.ln();
    row.iter().map(|&x| x as f64 - lse).collect()
}

/// 1 − Σ exp(lp_i): the mass outside the given tokens, computed as
/// −expm1(logsumexp) so that a rest of 1e-12 keeps its digits.
pub fn rest_mass(lps: &[f64]) -> f64 {
    let max = lps.iter().fold(f64::NEG_INFINITY, |m, &x| m.max(x));
    if max == f64::NEG_INFINITY {
        return 1.0;
    }
    let lse = max + lps.iter().map(|&x| (x - max).exp()).sum::<f64>().ln();
    (-lse.exp_m1()).max(0.0)
}

/// KL(P‖Q) of the oracle P and a source Q coarsened to the oracle's top-K
/// tokens plus the rest: `lp_p` the oracle's log-probabilities at its top
/// K, `lp_q` the source's at the same tokens, in the same order.
pub fn kl_top_k(lp_p: &[f64], lp_q: &[f64]) -> f64 {
    let mut kl: f64 = lp_p.iter().zip(lp_q).map(|(&p, &q)| p.exp() * (p - q)).sum();
    let (rp, rq) = (rest_mass(lp_p), rest_mass(lp_q));
    if rp > 0.0 {
        // A source that puts no mass outside the oracle's top K while the
        // oracle does diverges without bound; rq = 0 only by underflow.
        kl += rp * (rp.ln() - rq.max(f64::MIN_POSITIVE).ln());
    }
    kl
}

/// The spread of a source's log-probability errors over the oracle's top-K
/// tokens, max − min of (lp_q − lp_p): the normalisation shifts every entry
/// alike, so this is the largest error of any margin between two of those
/// tokens (logit differences, the numbers a greedy or top-k pick compares).
pub fn margin_error(lp_p: &[f64], lp_q: &[f64]) -> f64 {
    let (lo, hi) = lp_p
        .iter()
        .zip(lp_q)
        .map(|(&p, &q)| q - p)
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), d| (lo.min(d), hi.max(d)));
    if lo.is_finite() && hi.is_finite() {
        hi - lo
    } else {
        f64::INFINITY
    }
}

/// The k highest of `lps` as token ids, by descending value, ties to the
/// lower id (the rule HF's and llama.cpp's greedy picks follow).
pub fn top_ids(lps: &[f64], k: usize) -> Vec<u32> {
    let mut idx: Vec<u32> = (0..lps.len() as u32).collect();
    let key = |i: &u32| lps[*i as usize];
    let k = k.min(idx.len());
    if k == 0 {
        return Vec::new();
    }
    let cmp = |a: &u32, b: &u32| key(b).total_cmp(&key(a)).then(a.cmp(b));
    idx.select_nth_unstable_by(k - 1, cmp);
    idx.truncate(k);
    idx.sort_by(cmp);
    idx
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_softmax_normalises() {
        let lp = log_softmax(&[1.0, 2.0, 3.0]);
        let s: f64 = lp.iter().map(|x| x.exp()).sum();
        assert!((s - 1.0).abs() < 1e-15);
        assert!((lp[2] - lp[1] - 1.0).abs() < 1e-15);
    }

    #[test]
    fn kl_is_zero_for_equal_and_matches_the_full_kl_when_top_k_is_everything() {
        let p = log_softmax(&[0.5, 1.5, -1.0, 2.0]);
        assert!(kl_top_k(&p, &p).abs() < 1e-15);
        let q = log_softmax(&[0.6, 1.4, -1.0, 2.1]);
        let full: f64 = p.iter().zip(&q).map(|(a, b)| a.exp() * (a - b)).sum();
        assert!((kl_top_k(&p, &q) - full).abs() < 1e-15);
        // Coarsened to 2 tokens + rest: a lower bound, still positive.
        let k2 = kl_top_k(&p[..2], &q[..2]);
        assert!(k2 > 0.0 && k2 <= full + 1e-15, "{k2} vs {full}");
    }

    #[test]
    fn kl_grows_as_the_square_of_a_small_logit_error() {
        let base = [0.3f32, 1.1, -0.4, 2.0, 0.0];
        let p = log_softmax(&base);
        let kl = |d: f32| {
            let mut z = base;
            z[3] += d;
            kl_top_k(&p, &log_softmax(&z))
        };
        let r = kl(2e-3) / kl(1e-3);
        assert!((r - 4.0).abs() < 0.05, "{r}");
    }

    #[test]
    fn margin_error_ignores_a_common_shift() {
        let p = [-0.1, -2.0, -3.0];
        let q = [-0.3, -2.2, -3.2];
        assert!(margin_error(&p, &q) < 1e-12);
        let q = [-0.3, -2.0, -3.2];
        assert!((margin_error(&p, &q) - 0.2).abs() < 1e-12);
    }

    #[test]
    fn top_ids_break_ties_to_the_lower_id() {
        assert_eq!(top_ids(&[0.0, 1.0, 1.0, 0.5], 3), vec![1, 2, 3]);
        assert_eq!(top_ids(&[0.0, 1.0], 5), vec![1, 0]);
    }

    #[test]
    fn rest_mass_keeps_small_rests() {
        let lps = [(1.0f64 - 1e-12).ln()];
        let r = rest_mass(&lps);
        assert!((r / 1e-12 - 1.0).abs() < 1e-3, "{r}");
        assert_eq!(rest_mass(&[]), 1.0);
    }
}
