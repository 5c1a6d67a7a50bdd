//! `sampler`: the distribution a random draw samples from (`sample_probs`) is
//! the spec's temperature, top-k and top-p applied to the engine's own
//! logits of that step (their last row), recomputed in f64. A temperature
//! applied wrongly, a nucleus cut at the wrong mass, a top-k off by one or a
//! distribution left unnormalised shows at `sample_probs` itself, whatever
//! the logits' distance from the references.
//!
//! What is allowed, with ε_j = u·|l_j| + one subnormal rounding for each
//! logit (u the unit roundoff of the logits' dtype or the storage's, the
//! coarser: the sampler may have seen logits wider than the capture), and
//! τ = max ε_j / T over the kept tokens:
//! - the kept set: a kept token's logit is never below a removed one's by
//!   more than their ε (ties and near-ties may go either way); no more than
//!   top_k tokens; with top_p, the kept mass reaches p and the set less its
//!   least token does not, each within the masses' own perturbation
//!   e^{2τ} − 1 (a log-probability moves by at most 2τ) plus the f32 sum;
//! - each kept probability: within r_i·(e^{2τ} − 1 + (|K| + 8)·u32 + u) of
//!   the recomputed r_i (softmax over the kept set; the f32 exp, sum and
//!   division, and the value stored at the storage dtype) plus one
//!   subnormal rounding; removed tokens exactly 0.
//!
//! Derived from the arithmetic, no factor: a temperature of T²/2 instead of
//! T moves the top probability by ~0.2 on the tiny model, far outside it.

use std::sync::Arc;

use serde::de::{Deserialize, Deserializer};

use super::recompute::Tally;
use crate::checks::facts::Facts;
use crate::checks::kind::{At, Kind, RuleEnv, StageCheck, StageRule};
use crate::checks::params::Empty;
use crate::checks::scaled::{storage_unit, U_F32};
use crate::checks::verdict::Verdict;
use crate::checks::Family;
use crate::sampling::Sampling;
use crate::stage::Stage;
use crate::tensor::DType;

#[derive(Clone, Debug, PartialEq)]
pub struct Sampler;

impl Kind for Sampler {
    const NAME: &'static str = "sampler";
    const PARAMS: &'static str = "none";
    const ABOUT: &'static str = "sample_probs only: the distribution drawn from is the spec's temperature, top-k and \
                                 top-p applied to the engine's own logits of the step, within their roundings";
    fn bare() -> Self {
        Sampler
    }
    fn parse<'de, D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        Empty::deserialize(d).map(|_| Sampler)
    }
}

impl StageRule for Sampler {
    fn kind(&self) -> &'static str {
        Self::NAME
    }
    fn expand(&self, stage: Stage, _: &RuleEnv) -> Result<Vec<Arc<dyn StageCheck>>, String> {
        match stage {
            Stage::SampleProbs => Ok(vec![Arc::new(SamplerCheck)]),
            _ => Err(format!("`sampler` applies to sample_probs, not `{stage}`")),
        }
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct SamplerCheck;

impl StageCheck for SamplerCheck {
    fn id(&self) -> String {
        Sampler::NAME.into()
    }
    fn family(&self) -> Family {
        Family::Invariant
    }
    fn reads(&self, stage: Stage) -> Vec<Stage> {
        vec![stage, Stage::Logits]
    }
    fn judge(&self, facts: &Facts, at: &At) -> Verdict {
        let (p, l) = match (at.capture(), at.capture_of(Stage::Logits)) {
            (Ok(p), Ok(l)) => (p, l),
            (Err(v), _) | (_, Err(v)) => return v,
        };
        let v = facts.config.vocab;
        if p.numel() != v || l.numel() % v != 0 || l.numel() == 0 {
            return Verdict::fail(format!(
                "sampler: sample_probs has shape {:?} and logits {:?}; both need rows of the vocabulary ({v})",
                p.shape(),
                l.shape()
            ));
        }
        let last = &l.data()[l.numel() - v..];
        let d = l.dtype().coarser(facts.storage);
        judge(p.data(), last, facts.sampling, d)
    }
}

/// `probs` is `sampling` of `logits` within the allowance (module comment).
fn judge(probs: &[f32], logits: &[f32], sampling: &Sampling, d: DType) -> Verdict {
    let Sampling::Random {
        temperature,
        top_k,
        top_p,
    } = *sampling
    else {
        return Verdict::skip("greedy sampling draws from no distribution");
    };
    if let Some(i) = probs.iter().position(|q| !(q.is_finite() && *q >= 0.0)) {
        return Verdict::fail(format!("sample_probs[{i}] is {}: not a probability", probs[i]));
    }
    let (u, eta) = (storage_unit(d), d.subnormal_error());
    let t = temperature as f64;
    // Candidates by logit, descending (ties by index), as the draw orders them.
    let mut order: Vec<usize> = (0..logits.len()).filter(|&i| logits[i].is_finite()).collect();
    order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
    let kept: Vec<usize> = order.iter().copied().filter(|&i| probs[i] > 0.0).collect();
    if kept.is_empty() {
        return Verdict::fail("sample_probs keeps no token (all zero)");
    }
    if let Some(i) = (0..probs.len()).find(|&i| probs[i] > 0.0 && !logits[i].is_finite()) {
        return Verdict::fail(format!("sample_probs keeps token {i}, whose logit is {}", logits[i]));
    }
    let lf = |i: usize| logits[i] as f64;
    let eps = |i: usize| u * lf(i).abs() + eta;
    if t <= 0.0 {
        let top = order[0];
        return Verdict::check(
            kept == [top] && probs[top] == 1.0,
            format!("temperature {t}: all mass on the argmax, token {top}"),
        );
    }
    // The kept set: no removed token clearly above a kept one.
    let lowest = kept.iter().map(|&i| (lf(i) + eps(i), i)).fold((f64::INFINITY, 0), |m, x| if x.0 < m.0 { x } else { m });
    if let Some(&j) = order.iter().find(|&&j| probs[j] == 0.0 && lf(j) - eps(j) > lowest.0) {
        return Verdict::fail(format!(
            "sample_probs removes token {j} (logit {}) but keeps token {} (logit {}): the kept set is not the top of \
             the logits (a sort or a top-k/top-p cut on the wrong order?)",
            logits[j], lowest.1, logits[lowest.1]
        ));
    }
    if let Some(k) = top_k.filter(|&k| kept.len() > k.max(1)) {
        return Verdict::fail(format!("sample_probs keeps {} tokens with top_k {k}", kept.len()));
    }
    let tau = kept.iter().map(|&i| eps(i)).fold(0.0, f64::max) / t;
    let spread = (2.0 * tau).exp() - 1.0;
    let max = lf(order[0]);
    let weight = |i: usize| ((lf(i) - max) / t).exp();
    if let Some(pp) = top_p {
        // Masses after temperature and top-k, before the nucleus.
        let cands = &order[..top_k.map_or(order.len(), |k| k.max(1).min(order.len()))];
        let z: f64 = cands.iter().map(|&i| weight(i)).sum();
        let mass: f64 = kept.iter().map(|&i| weight(i)).sum::<f64>() / z;
        let least = kept.iter().map(|&i| weight(i)).fold(f64::INFINITY, f64::min) / z;
        let slack = spread + (cands.len() as f64 + 8.0) * U_F32;
        let pp = pp as f64;
        if mass < pp - slack || (kept.len() > 1 && mass - least >= pp + slack) {
            return Verdict::fail(format!(
                "sample_probs keeps {} tokens holding mass {mass:.6} of softmax(logits/{t}) after top-k; top_p {pp} \
                 keeps the smallest prefix reaching it (without its least token: {:.6}; slack {slack:.1e}): the \
                 nucleus is cut at the wrong mass, or the temperature is wrong",
                kept.len(),
                mass - least
            ));
        }
    }
    let z: f64 = kept.iter().map(|&i| weight(i)).sum();
    let rel = spread + (kept.len() as f64 + 8.0) * U_F32 + u;
    let mut tally = Tally::default();
    for &i in &kept {
        let want = weight(i) / z;
        tally.add(i, probs[i], want, rel * want + eta);
    }
    match tally.worst {
        None => Verdict::pass(format!(
            "sample_probs = T {t}, top_k {top_k:?}, top_p {top_p:?} of the step's logits: {} kept, max |Δ| {:.2e} \
             ({:.2} of the allowance)",
            kept.len(),
            tally.max_abs,
            tally.max_ratio
        )),
        Some(w) => Verdict::fail(format!(
            "{} of {} kept probabilities are not softmax(logits/{t}) over the kept set within the allowance (rel \
             {rel:.1e}); worst token {}: {:e}, recomputed {:e} (|Δ| {:.2e}): the temperature applied wrongly, or \
             the kept set not renormalised?",
            tally.bad,
            tally.n,
            w.index,
            w.got,
            w.want,
            w.err
        ))
        .metric("max_abs", tally.max_abs),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sampling::distribution;

    fn logits() -> Vec<f32> {
        (0..300).map(|i| ((i * 7919 % 1009) as f32 / 1009.0 - 0.5) * 9.0).collect()
    }

    fn random(temperature: f32, top_k: Option<usize>, top_p: Option<f32>) -> Sampling {
        Sampling::Random {
            temperature,
            top_k,
            top_p,
        }
    }

    #[test]
    fn the_shared_sampler_passes_at_every_storage_and_a_misapplied_temperature_fails() {
        for d in [DType::F32, DType::F16, DType::BF16] {
            let l: Vec<f32> = logits().iter().map(|x| d.round(*x)).collect();
            for s in [random(0.7, Some(40), Some(0.9)), random(1.0, None, None), random(0.3, Some(5), None), random(1.3, None, Some(0.5))] {
                let p = distribution(&s, &l).unwrap();
                let v = judge(&p, &l, &s, d);
                assert!(v.passed(), "{d} {s:?}: {}", v.message);
                // The same settings with T²/2: the draw's distribution is another.
                let Sampling::Random { temperature, top_k, top_p } = s else { unreachable!() };
                let wrong = distribution(&random(temperature * temperature / 2.0, top_k, top_p), &l).unwrap();
                assert!(judge(&wrong, &l, &s, d).failed(), "{d} {s:?}");
            }
        }
    }

    #[test]
    fn a_wrong_cut_or_an_unnormalised_distribution_fails_naming_it() {
        let l = logits();
        let s = random(0.7, Some(40), Some(0.9));
        let p = distribution(&s, &l).unwrap();
        // The nucleus one token short.
        let mut short = p.clone();
        let least = (0..p.len()).filter(|&i| p[i] > 0.0).min_by(|&a, &b| p[a].total_cmp(&p[b])).unwrap();
        short[least] = 0.0;
        let v = judge(&short, &l, &s, DType::F32);
        assert!(v.failed() && v.message.contains("cut at the wrong mass"), "{}", v.message);
        // Kept mass not renormalised to 1.
        let half: Vec<f32> = p.iter().map(|q| q * 0.9).collect();
        let v = judge(&half, &l, &s, DType::F32);
        assert!(v.failed() && v.message.contains("not renormalised"), "{}", v.message);
        // The top token dropped, a lower one kept.
        let mut swapped = p.clone();
        let top = (0..l.len()).max_by(|&a, &b| l[a].total_cmp(&l[b])).unwrap();
        swapped[top] = 0.0;
        let v = judge(&swapped, &l, &s, DType::F32);
        assert!(v.failed() && v.message.contains("not the top of the logits"), "{}", v.message);
        assert!(judge(&vec![f32::NAN; l.len()], &l, &s, DType::F32).failed());
    }
}
