//! How a tensor is measured against a reference, shared by the golden and
//! references_agree checks: which tolerance applies (per-check override, the
//! spec's per-dtype table, the built-in default), the last-row view of
//! logits for a last-row golden, and the scaled policy's inputs at a stage
//! (the oracle's tensor, its reduction length and magnitudes) and output
//! (a verdict carrying the judgement's numbers).

use std::borrow::Cow;

use super::facts::Facts;
use super::params::TolOverride;
use super::scaled::{self, FloorModel, Judgement, Policy};
use super::verdict::Verdict;
use crate::compare::{Comparison, Tolerance};
use crate::golden::GoldenSet;
use crate::stage::{BlockStage, Stage, Step};
use crate::tensor::Tensor;

/// The tolerance for comparing `actual` with `expected`: per-check overrides,
/// else the spec's per-dtype table, else the built-in default for the dtype.
pub fn tolerance(facts: &Facts, actual: &Tensor, expected: &Tensor, over: TolOverride) -> Tolerance {
    let dtype = actual.dtype().coarser(expected.dtype());
    let base = facts
        .tolerance
        .get(&dtype)
        .map(|t| Tolerance::new(t.atol, t.rtol))
        .unwrap_or_else(|| Tolerance::default_for(dtype));
    Tolerance::new(over.atol.unwrap_or(base.atol), over.rtol.unwrap_or(base.rtol))
}

/// Logits against a last-row golden (`record.logits: last`, shape `[1, V]`):
/// the last row of `t`, which is what the golden recorded. Anything else is
/// compared as it is (so a wrong shape still fails the shape comparison).
pub fn last_row_if<'a>(t: &'a Tensor, other: &Tensor, stage: Stage, other_is_last_row: bool) -> Cow<'a, Tensor> {
    let (ts, os) = (t.shape(), other.shape());
    if other_is_last_row
        && stage == Stage::Logits
        && ts.len() == 2
        && os.len() == 2
        && os[0] == 1
        && ts[0] > 1
        && ts[1] == os[1]
    {
        let v = ts[1];
        let row = t.data()[(ts[0] - 1) * v..].to_vec();
        Cow::Owned(Tensor::new(vec![1, v], row).with_dtype(t.dtype()))
    } else {
        Cow::Borrowed(t)
    }
}

/// The scaled policy's inputs at (step, stage): the oracle tensor (last row
/// when `like` is a last-row logits tensor) and its floor model.
pub fn oracle_at<'a>(
    facts: &Facts,
    oracle: &'a GoldenSet,
    step: Step,
    stage: Stage,
    like: &Tensor,
) -> Result<(Cow<'a, Tensor>, FloorModel), String> {
    let o = oracle
        .get(step, stage)
        .ok_or_else(|| format!("the oracle ({}) has no tensor `{step}/{stage}`", oracle.path.display()))?;
    let like_last = like.shape().first() == Some(&1) && stage == Stage::Logits;
    let o = last_row_if(o, like, stage, like_last);
    let m = scaled::max_abs_value(&o);
    Ok((o, floor_model(facts, oracle, step, stage, m)))
}

/// The floor model of (step, stage): its reduction length and magnitude, and
/// for attn_probs the oracle's score magnitude at the same step (when the
/// oracle recorded the scores), for q_rope/k_rope the step's last position.
pub fn floor_model(facts: &Facts, oracle: &GoldenSet, step: Step, stage: Stage, m: f64) -> FloorModel {
    let k = scaled::reduction_len(facts.config, stage, facts.step_dims(step).1);
    let softmax_input = match stage {
        Stage::Block(l, BlockStage::AttnProbs) => oracle
            .get(step, Stage::Block(l, BlockStage::AttnScores))
            .map(|s| (facts.config.head_dim, scaled::max_abs_value(s))),
        _ => None,
    };
    let rope_position = match stage {
        Stage::Block(_, BlockStage::QRope | BlockStage::KRope) => Some(facts.step_dims(step).1.saturating_sub(1)),
        _ => None,
    };
    FloorModel {
        k,
        m,
        softmax_input,
        rope_position,
    }
}

/// The spec's `scaled:` as a policy.
pub fn policy(facts: &Facts) -> Policy {
    Policy {
        factor: facts.scaled.factor,
        floor: facts.scaled.floor,
    }
}

/// A scaled check's verdict: the comparator's metrics at the allowance plus
/// the judgement's (error, floor, allowed, factor, ratio).
pub fn scaled_verdict(ok: bool, message: String, c: &Comparison, j: &Judgement) -> Verdict {
    let mut v = Verdict::check(ok, message);
    v.metrics = c.metrics();
    for (name, value) in j.metrics() {
        v.metrics.insert(name.to_string(), value);
    }
    v
}

/// A comparison's verdict with its metrics.
pub fn compared(ok: bool, message: String, c: &Comparison) -> Verdict {
    let mut v = Verdict::check(ok, message);
    v.metrics = c.metrics();
    v
}

/// `1.23e-5`, `0`, `inf`: errors in messages.
pub fn sci(x: f64) -> String {
    if x == 0.0 {
        "0".into()
    } else if x.is_finite() {
        format!("{x:.2e}")
    } else {
        format!("{x}")
    }
}

/// A ratio to three decimals, `inf` past every bound.
pub fn ratio_text(r: f64) -> String {
    if r.is_finite() {
        format!("{r:.3}")
    } else {
        "inf".into()
    }
}
