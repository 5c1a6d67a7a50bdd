//! The verdict of `next_token` on one prompt: the engine's next-token
//! distributions at every position against the oracle's, beside the
//! references' of the engine's own arithmetic.
//!
//! Three rules, each an allowance derived as the scaled policy derives a
//! stage's (`checks::scaled`): the engine may be `factor` times as far from
//! the exact answer as the references of its arithmetic are, or as the
//! rounding floor, whichever is larger.
//!
//! - **Margins**: e = the largest error, over positions, of any logit margin
//!   between two of the oracle's top-K tokens (`dist::margin_error`; a
//!   logit error, linear like a stage's max|E − O|). Allowed
//!   A = factor · max(r, 2δ): r the references' largest, δ the LM head's
//!   own rounding c·M·(u·√E + u_store + u_w) on logits of magnitude M (two
//!   logits per margin).
//! - **KL**: the largest KL(oracle ‖ engine) over positions, coarsened to the
//!   oracle's top K (`dist::kl_top_k`). KL is quadratic in a small logit
//!   error (½·Var_p(Δz) to second order, at most δ²/2 for errors within
//!   ±δ), so an engine `factor` times as far as the references has a KL up
//!   to factor² times theirs: allowed factor² · max(KL_r, δ²/2).
//! - **Top-1 and top-k**: where the engine's most likely token is not the
//!   oracle's, the oracle's own margin between the two must be within A (a
//!   near-tie the allowed error could flip); each of the oracle's top k
//!   tokens that leads the oracle's (k+1)-th by more than A must be in the
//!   engine's top k. Agreement and overlap rates are reported as measured.

use super::dist::{kl_top_k, margin_error, top_ids};
use super::set::PromptRec;

/// One source's next-token distributions over one prompt, beside the oracle's.
#[derive(Clone, Debug, Default)]
pub struct Measured {
    /// Per position: KL(oracle ‖ source) on the oracle's top K.
    pub kl: Vec<f64>,
    /// Per position: the largest margin error over the oracle's top K.
    pub margin: Vec<f64>,
    /// Per position: the source's top k ids (its top-1 first).
    pub top: Vec<Vec<u32>>,
    /// Per position: the source's log-probability of the oracle's top-1.
    pub lp_oracle_top1: Vec<f64>,
}

impl Measured {
    /// The engine's, from its full log-probability rows.
    pub fn of_rows(oracle: &PromptRec, rows: &[Vec<f64>], k: usize) -> Measured {
        let mut m = Measured::default();
        for (t, lp) in rows.iter().enumerate() {
            let at: Vec<f64> = oracle.top_ids[t].iter().map(|&i| lp[i as usize]).collect();
            m.push(&oracle.top_logprobs[t], &at, top_ids(lp, k));
        }
        m
    }

    /// A reference's, from its recorded `at_oracle` and own top ids.
    pub fn of_reference(oracle: &PromptRec, r: &PromptRec, k: usize) -> Measured {
        let at = r.at_oracle.as_ref().expect("a reference holds at_oracle (checked on load)");
        let mut m = Measured::default();
        for t in 0..oracle.tokens.len() {
            m.push(&oracle.top_logprobs[t], &at[t], r.top_ids[t].iter().take(k).copied().collect());
        }
        m
    }

    fn push(&mut self, lp_o: &[f64], at: &[f64], top: Vec<u32>) {
        self.kl.push(kl_top_k(lp_o, at));
        self.margin.push(margin_error(lp_o, at));
        self.lp_oracle_top1.push(at[0]);
        self.top.push(top);
    }

    /// (value, position) of the largest of `v`.
    pub fn worst(v: &[f64]) -> (f64, usize) {
        v.iter()
            .enumerate()
            .fold((f64::NEG_INFINITY, 0), |(m, at), (i, &x)| if x > m || x.is_nan() { (x, i) } else { (m, at) })
    }

    /// Positions whose top-1 is the oracle's, as a fraction.
    pub fn top1_rate(&self, oracle: &PromptRec) -> f64 {
        let n = self.top.len().max(1);
        let same = self.top.iter().zip(&oracle.top_ids).filter(|(a, o)| a.first() == o.first()).count();
        same as f64 / n as f64
    }

    /// The mean share of the oracle's top k in the source's top k.
    pub fn overlap(&self, oracle: &PromptRec, k: usize) -> f64 {
        let n = self.top.len().max(1);
        let sum: f64 = self
            .top
            .iter()
            .zip(&oracle.top_ids)
            .map(|(a, o)| o[..k].iter().filter(|i| a.contains(i)).count() as f64 / k as f64)
            .sum();
        sum / n as f64
    }
}

/// The allowances on one prompt.
#[derive(Clone, Copy, Debug)]
pub struct Allowance {
    /// On any margin between two of the oracle's top-K logits.
    pub margin: f64,
    pub kl: f64,
    /// The parts, for the message.
    pub r_margin: f64,
    pub r_kl: f64,
    pub delta: f64,
}

impl Allowance {
    pub fn new(factor: f64, peers: &[&Measured], delta: f64) -> Allowance {
        let r_margin = peers.iter().flat_map(|m| m.margin.iter().copied()).fold(0.0, f64::max);
        let r_kl = peers.iter().flat_map(|m| m.kl.iter().copied()).fold(0.0, f64::max);
        Allowance {
            margin: factor * r_margin.max(2.0 * delta),
            kl: factor * factor * r_kl.max(delta * delta / 2.0),
            r_margin,
            r_kl,
            delta,
        }
    }
}

/// A rule broken at one position.
#[derive(Clone, Debug, PartialEq)]
pub enum Breach {
    Kl { t: usize, kl: f64 },
    Margin { t: usize, e: f64 },
    /// The engine's top-1 `got` over the oracle's `want`, the oracle's margin
    /// between them (a lower bound when `got` is outside its top K).
    Top1 { t: usize, got: u32, want: u32, margin: f64, bound: bool },
    /// An oracle top-k token clear of the (k+1)-th by `lead` is missing.
    TopK { t: usize, missing: u32, lead: f64 },
}

/// Every breach of the engine on one prompt, first the worst KL and margin.
pub fn breaches(oracle: &PromptRec, e: &Measured, a: &Allowance, k: usize) -> Vec<Breach> {
    let mut out = Vec::new();
    let (kl, t) = Measured::worst(&e.kl);
    if !(kl <= a.kl) {
        out.push(Breach::Kl { t, kl });
    }
    let (m, t) = Measured::worst(&e.margin);
    if !(m <= a.margin) {
        out.push(Breach::Margin { t, e: m });
    }
    for t in 0..e.top.len() {
        let (ids, lps) = (&oracle.top_ids[t], &oracle.top_logprobs[t]);
        let got = e.top[t][0];
        if got != ids[0] {
            let (margin, bound) = match ids.iter().position(|&i| i == got) {
                Some(j) => (lps[0] - lps[j], false),
                None => (lps[0] - lps[lps.len() - 1], true),
            };
            if margin > a.margin {
                out.push(Breach::Top1 { t, got, want: ids[0], margin, bound });
            }
        }
        for j in 0..k {
            let lead = lps[j] - lps[k];
            if lead > a.margin && !e.top[t].contains(&ids[j]) {
                out.push(Breach::TopK { t, missing: ids[j], lead });
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::super::dist::log_softmax;
    use super::*;

    fn oracle(rows: &[Vec<f32>], k: usize) -> PromptRec {
        let lps: Vec<Vec<f64>> = rows.iter().map(|r| log_softmax(r)).collect();
        let ids: Vec<Vec<u32>> = lps.iter().map(|l| top_ids(l, k)).collect();
        PromptRec {
            name: "p".into(),
            tokens: vec![1; rows.len()],
            top_logprobs: ids.iter().zip(&lps).map(|(i, l)| i.iter().map(|&j| l[j as usize]).collect()).collect(),
            top_ids: ids,
            at_oracle: None,
            logit_max: vec![3.0; rows.len()],
        }
    }

    fn rows(z: &[Vec<f32>]) -> Vec<Vec<f64>> {
        z.iter().map(|r| log_softmax(r)).collect()
    }

    #[test]
    fn an_engine_as_close_as_its_peer_passes_and_a_far_one_breaks_kl_and_margins() {
        let z = vec![vec![3.0f32, 1.0, 0.5, -1.0, 0.0, 2.0]; 3];
        let o = oracle(&z, 4);
        let near: Vec<Vec<f32>> = z.iter().map(|r| r.iter().map(|x| x + 1e-4 * x).collect()).collect();
        let peer = Measured::of_rows(&o, &rows(&near), 2);
        let a = Allowance::new(4.0, &[&peer], 1e-7);
        let same = Measured::of_rows(&o, &rows(&near), 2);
        assert!(breaches(&o, &same, &a, 2).is_empty());
        let mut far = near.clone();
        far[1][5] += 0.05;
        let e = Measured::of_rows(&o, &rows(&far), 2);
        let b = breaches(&o, &e, &a, 2);
        assert!(b.iter().any(|x| matches!(x, Breach::Kl { t: 1, .. })), "{b:?}");
        assert!(b.iter().any(|x| matches!(x, Breach::Margin { t: 1, .. })), "{b:?}");
    }

    #[test]
    fn a_flipped_near_tie_is_excused_and_a_clear_flip_is_not() {
        let z = vec![vec![2.0f32, 1.999, 0.0, -1.0]];
        let o = oracle(&z, 3);
        let flipped = vec![vec![1.999f32, 2.0, 0.0, -1.0]];
        let e = Measured::of_rows(&o, &rows(&flipped), 1);
        let wide = Allowance { margin: 0.01, kl: 1.0, r_margin: 0.0, r_kl: 0.0, delta: 0.0 };
        assert!(breaches(&o, &e, &wide, 1).is_empty());
        let tight = Allowance { margin: 1e-4, ..wide };
        let b = breaches(&o, &e, &tight, 1);
        assert!(b.iter().any(|x| matches!(x, Breach::Top1 { got: 1, want: 0, bound: false, .. })), "{b:?}");
    }

    #[test]
    fn a_clear_top_k_token_must_be_kept() {
        let z = vec![vec![3.0f32, 2.0, 1.0, -5.0, -6.0]];
        let o = oracle(&z, 4);
        let dropped = vec![vec![3.0f32, 2.0, -7.0, -5.0, -6.0]];
        let e = Measured::of_rows(&o, &rows(&dropped), 3);
        let a = Allowance { margin: 0.1, kl: 10.0, r_margin: 0.0, r_kl: 0.0, delta: 0.0 };
        let b = breaches(&o, &e, &a, 3);
        assert!(b.iter().any(|x| matches!(x, Breach::TopK { missing: 2, .. })), "{b:?}");
        assert!((e.overlap(&o, 3) - 2.0 / 3.0).abs() < 1e-12);
        assert_eq!(e.top1_rate(&o), 1.0);
    }
}
