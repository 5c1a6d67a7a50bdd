//! `routing`: a routed layer's choice recomputed from the engine's own
//! captures, at each routing stage (`model::moe`), needing no golden:
//!
//! - `ffn_moe_probs`: the selection scores are the config's function of the
//!   captured router logits (softmax, or sigmoid plus the file's correction
//!   bias, or the logits), element by element in f64;
//! - `ffn_moe_topk`: each row's ids are distinct, ascending, in range, and
//!   exactly the top-k of the captured selection scores among the experts of
//!   the `topk_group` best groups; equal scores go to the lower id (llama.cpp's
//!   order); a different choice is accepted only where the k-th and
//!   (k+1)-th scores are within the scores' allowance (a near-tie, told like
//!   a greedy one). The expert-load histogram (summing to T·k) is reported;
//! - `ffn_moe_weights`: the weights are the unbiased scores at the chosen ids
//!   (recomputed from the logits: the correction bias chooses, it never
//!   weighs), normalised (or a softmax over the k) and scaled as configured.
//!
//! Allowances (u32 = 2^-24, u the storage's unit roundoff, x the logits):
//! the engine may form scores from its logits before they were stored (a
//! fused kernel), each off by u·|x|: softmax's relative change is then at
//! most 2·u·max|x| (|Δp_j| ≤ p_j(|Δx_j| + Σ p_k|Δx_k|)), sigmoid's
//! σ(1 − σ)·u·|x|; f32 arithmetic adds, relative to p_j, the subtraction
//! and exp of x_j and of the largest term of the sum ((|x − m| + 2)·u32 each),
//! the n-term sum (n·u32) and the division (u32); the stored bias u·|b|.
//! The weights add the k-term normalising sum, its division and the scale
//! (k + 2)·u32 to their scores' relative allowance, and one storage rounding
//! (an engine may hold weights in its storage type, as HF's Qwen-MoE does).

use std::sync::Arc;

use serde::de::{Deserialize, Deserializer};

use super::recompute::{Tally, Wording};
use crate::checks::facts::Facts;
use crate::checks::family::{Family, Metric};
use crate::checks::kind::{At, Kind, RuleEnv, StageCheck, StageRule};
use crate::checks::params::Empty;
use crate::checks::scaled::{storage_unit, U_F32};
use crate::checks::verdict::Verdict;
use crate::model::moe::{self, Routing, Scores};
use crate::stage::{BlockStage, Stage};
use crate::tensor::Tensor;

#[derive(Clone, Debug, PartialEq)]
pub struct RoutingRule;

impl Kind for RoutingRule {
    const NAME: &'static str = "routing";
    const PARAMS: &'static str = "none";
    const ABOUT: &'static str = "blk.*.ffn_moe_probs, ffn_moe_topk, ffn_moe_weights of a routed layer: the scores \
                                 are the config's function of the router logits, the ids the top-k of the scores \
                                 (groups, ties to the lower id; near-ties told), the weights the unbiased scores \
                                 there, normalised and scaled as configured";
    fn bare() -> Self {
        RoutingRule
    }
    fn parse<'de, D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        Empty::deserialize(d).map(|_| RoutingRule)
    }
}

impl StageRule for RoutingRule {
    fn kind(&self) -> &'static str {
        Self::NAME
    }
    fn expand(&self, stage: Stage, _: &RuleEnv) -> Result<Vec<Arc<dyn StageCheck>>, String> {
        match stage {
            Stage::Block(l, b @ (BlockStage::FfnMoeProbs | BlockStage::FfnMoeTopk | BlockStage::FfnMoeWeights)) => {
                Ok(vec![Arc::new(RoutingCheck { layer: l, what: b })])
            }
            _ => Err(format!(
                "`routing` applies to blk.*.ffn_moe_probs, ffn_moe_topk and ffn_moe_weights, not `{stage}`"
            )),
        }
    }
}

/// The check at one layer's routing stage.
#[derive(Clone, Debug, PartialEq)]
pub struct RoutingCheck {
    pub layer: usize,
    pub what: BlockStage,
}

impl RoutingCheck {
    fn st(&self, b: BlockStage) -> Stage {
        Stage::Block(self.layer, b)
    }
}

/// The per-element allowance of the selection scores of one row, relative
/// to each score (see the module comment), and the absolute bias term.
fn score_rel(r: &Routing, x: &[f64], u: f64) -> f64 {
    let n = x.len() as f64;
    let m = x.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let spread = x.iter().map(|v| (v - m).abs()).fold(0.0f64, f64::max);
    let xmax = x.iter().map(|v| v.abs()).fold(0.0f64, f64::max);
    match r.scores {
        Scores::Softmax => 2.0 * u * xmax + (2.0 * (spread + 2.0) + n + 1.0) * U_F32,
        Scores::Sigmoid => u * xmax + (xmax + 4.0) * U_F32,
        Scores::TopkSoftmax => u,
    }
}

fn row(t: &Tensor, r: usize) -> Vec<f64> {
    let w = t.shape()[1];
    t.data()[r * w..][..w].iter().map(|&v| v as f64).collect()
}

impl StageCheck for RoutingCheck {
    fn id(&self) -> String {
        RoutingRule::NAME.into()
    }
    fn family(&self) -> Family {
        Family::Invariant
    }
    fn metric(&self) -> Option<Metric> {
        Some(Metric::MaxAbs)
    }
    fn reads(&self, stage: Stage) -> Vec<Stage> {
        use BlockStage::*;
        match self.what {
            FfnMoeProbs => vec![stage, self.st(FfnMoeLogits)],
            FfnMoeTopk => vec![stage, self.st(FfnMoeLogits), self.st(FfnMoeProbs)],
            _ => vec![stage, self.st(FfnMoeLogits), self.st(FfnMoeTopk)],
        }
    }
    fn judge(&self, facts: &Facts, at: &At) -> Verdict {
        let Some(m) = facts.config.moe.as_ref().filter(|m| m.is_sparse(self.layer)) else {
            return Verdict::fail(format!("{}: layer {} does not route", at.stage, self.layer));
        };
        let logits = match at.capture_of(self.st(BlockStage::FfnMoeLogits)) {
            Ok(t) => t,
            Err(v) => return v,
        };
        let u = storage_unit(logits.dtype().coarser(facts.storage));
        let bias = match m.routing.correction_bias {
            true => {
                let name = format!("model.layers.{}.mlp.gate.e_score_correction_bias", self.layer);
                match facts.file.tensor(&name) {
                    Ok(b) => Some(b.data().iter().map(|&v| v as f64).collect::<Vec<f64>>()),
                    Err(e) => return Verdict::fail(format!("cannot read `{name}` from the model file: {e}")),
                }
            }
            false => None,
        };
        let ctx = Ctx {
            r: &m.routing,
            logits,
            bias: bias.as_deref(),
            u,
        };
        match self.what {
            BlockStage::FfnMoeProbs => at.capture().map_or_else(|v| v, |y| ctx.probs(y, at.stage)),
            BlockStage::FfnMoeTopk => match (at.capture(), at.capture_of(self.st(BlockStage::FfnMoeProbs))) {
                (Ok(ids), Ok(sel)) => ctx.topk(ids, sel, at.stage),
                (Err(v), _) | (_, Err(v)) => v,
            },
            _ => match (at.capture(), at.capture_of(self.st(BlockStage::FfnMoeTopk))) {
                (Ok(w), Ok(ids)) => ctx.weights(w, ids, at.stage),
                (Err(v), _) | (_, Err(v)) => v,
            },
        }
    }
}

struct Ctx<'a> {
    r: &'a Routing,
    logits: &'a Tensor,
    bias: Option<&'a [f64]>,
    u: f64,
}

impl Ctx<'_> {
    fn rows(&self) -> usize {
        self.logits.shape()[0]
    }

    /// Row `r`'s recomputed selection scores and their absolute allowances.
    fn scores(&self, r: usize) -> (Vec<f64>, Vec<f64>) {
        let x = row(self.logits, r);
        let rel = score_rel(self.r, &x, self.u);
        let s = moe::selection_scores(self.r, &x, self.bias);
        let raw = moe::unbiased_scores(self.r.scores, &x);
        let allow = raw
            .iter()
            .enumerate()
            .map(|(j, p)| p.abs() * rel + self.bias.map_or(0.0, |b| self.u * b[j].abs()) + 1e-30)
            .collect();
        (s, allow)
    }

    fn probs(&self, y: &Tensor, stage: Stage) -> Verdict {
        if y.shape() != self.logits.shape() {
            return Verdict::fail(format!("{stage} has shape {:?}, the router logits {:?}", y.shape(), self.logits.shape()));
        }
        let n = self.r.experts;
        let mut tally = Tally::default();
        for r in 0..self.rows() {
            let (s, allow) = self.scores(r);
            for j in 0..n {
                tally.add(r * n + j, y.data()[r * n + j], s[j], allow[j]);
            }
        }
        let what = match self.r.scores {
            Scores::Softmax => "softmax(ffn_moe_logits)",
            Scores::Sigmoid if self.bias.is_some() => "sigmoid(ffn_moe_logits) + e_score_correction_bias",
            Scores::Sigmoid => "sigmoid(ffn_moe_logits)",
            Scores::TopkSoftmax => "ffn_moe_logits (top-k is taken over the logits)",
        };
        tally.verdict(
            y,
            stage,
            Wording {
                what,
                within: &format!("u {:.1e}", self.u),
                hint: "are the scores a softmax over every expert, a sigmoid, with the correction bias added (to choose only)?",
            },
            |w| format!("recomputed {:e}", w.want),
        )
    }

    fn topk(&self, ids: &Tensor, sel: &Tensor, stage: Stage) -> Verdict {
        let (n, k, t) = (self.r.experts, self.r.top_k, self.rows());
        if ids.shape() != [t, k] || sel.shape() != [t, n] {
            return Verdict::fail(format!(
                "{stage} has shape {:?} and the scores {:?}; expected [{t}, {k}] and [{t}, {n}]",
                ids.shape(),
                sel.shape()
            ));
        }
        let mut load = vec![0usize; n];
        let mut ties = Vec::new();
        for r in 0..t {
            let got = row(ids, r);
            let valid = got.iter().all(|&v| v >= 0.0 && v < n as f64 && v.fract() == 0.0)
                && got.windows(2).all(|p| p[0] < p[1]);
            if !valid {
                return Verdict::fail(format!(
                    "{stage} row {r}: {got:?} are not {k} distinct expert ids in 0..{n}, ascending"
                ));
            }
            let got: Vec<usize> = got.iter().map(|&v| v as usize).collect();
            got.iter().for_each(|&j| load[j] += 1);
            let s = row(sel, r);
            if let Some((g, tg)) = self.r.groups {
                let per = n / g;
                let mut used: Vec<usize> = got.iter().map(|j| j / per).collect();
                used.dedup();
                if used.len() > tg {
                    return Verdict::fail(format!(
                        "{stage} row {r}: experts {got:?} come from groups {used:?}, more than topk_group {tg} \
                         (n_group {g}): is the group-limited routing applied?"
                    ));
                }
            }
            let want = moe::select(self.r, &s, &s).ids;
            if got == want {
                continue;
            }
            // Outside the eligible groups, or below an expert it left out by
            // more than the scores' allowance: a wrong route. Within it: a
            // near-tie, either choice correct.
            let ok = moe::eligible(self.r, &s);
            if let Some(&j) = got.iter().find(|&&j| !ok[j]) {
                return Verdict::fail(format!(
                    "{stage} row {r}: expert {j} is chosen but its group is not among the topk_group best \
                     (chosen {got:?}, the top-k of the eligible scores {want:?})"
                ));
            }
            let (_, allow) = self.scores(r);
            let lo = *got.iter().filter(|j| !want.contains(j)).min_by(|a, b| s[**a].total_cmp(&s[**b])).expect("differ");
            let hi = *want.iter().filter(|j| !got.contains(j)).max_by(|a, b| s[**a].total_cmp(&s[**b])).expect("differ");
            if s[lo] == s[hi] {
                return Verdict::fail(format!(
                    "{stage} row {r}: experts {lo} and {hi} have equal scores {:e} and the tie went to {lo}: ties \
                     go to the lower expert id (touchstone's rule, llama.cpp's order), so {} is chosen (chosen {got:?}, expected {want:?})",
                    s[lo],
                    lo.min(hi)
                ));
            }
            let gap = s[hi] - s[lo];
            if gap > allow[lo] + allow[hi] {
                return Verdict::fail(format!(
                    "{stage} row {r}: chose {got:?} but the top-{k} of its own scores is {want:?}: expert {hi} \
                     scores {:e}, above chosen {lo} at {:e} by {gap:.2e}, more than the scores' allowance {:.2e} \
                     (not a near-tie)",
                    s[hi],
                    s[lo],
                    allow[lo] + allow[hi]
                ));
            }
            ties.push(format!("row {r}: {lo} for {hi} (gap {gap:.1e})"));
        }
        let near = match ties.is_empty() {
            true => String::new(),
            false => format!("; near-ties (either choice correct): {}", ties.join(", ")),
        };
        Verdict::pass(format!(
            "{stage}: every row's {k} ids are the top-{k} of its scores{}; expert load {load:?} (sum {} = T·k){near}",
            if self.r.groups.is_some() { " within its best groups" } else { "" },
            load.iter().sum::<usize>()
        ))
        .metric("near_ties", ties.len() as f64)
    }

    fn weights(&self, w: &Tensor, ids: &Tensor, stage: Stage) -> Verdict {
        let (k, t) = (self.r.top_k, self.rows());
        if w.shape() != [t, k] || ids.shape() != [t, k] {
            return Verdict::fail(format!("{stage} has shape {:?}, expected [{t}, {k}]", w.shape()));
        }
        let mut tally = Tally::default();
        for r in 0..t {
            let x = row(self.logits, r);
            let chosen: Vec<usize> = row(ids, r).iter().map(|&v| (v.max(0.0) as usize).min(self.r.experts - 1)).collect();
            let raw = moe::unbiased_scores(self.r.scores, &x);
            let want = moe::weights_at(self.r, &raw, &chosen);
            let rel = score_rel(self.r, &x, self.u) * 2.0 + (k as f64 + 2.0) * U_F32 + self.u;
            for c in 0..k {
                tally.add(r * k + c, w.data()[r * k + c], want[c], want[c].abs() * rel + 1e-30);
            }
        }
        let mut what = String::from("the unbiased scores at the chosen ids");
        if self.r.scores == Scores::TopkSoftmax {
            what.push_str(", a softmax over the k");
        } else if self.r.norm_topk {
            what.push_str(", divided by their sum");
        }
        if self.r.scaling != 1.0 {
            what.push_str(&format!(", times routed_scaling_factor {}", self.r.scaling));
        }
        tally.verdict(
            w,
            stage,
            Wording {
                what: &what,
                within: &format!("u {:.1e}", self.u),
                hint: "renormalised when norm_topk_prob says so, over all experts' softmax, without the correction bias, \
                       times routed_scaling_factor?",
            },
            |x| format!("recomputed {:e}", x.want),
        )
    }
}
