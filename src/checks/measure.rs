//! How a tensor is measured against a reference, shared by the golden and
//! references_agree checks: which tolerance applies (per-check override, the
//! spec's per-dtype table, the built-in default), the last-row view of
//! logits for a last-row golden, and the scaled policy's inputs at a stage
//! (the oracle's tensor, its reduction length and magnitudes) and output
//! (a verdict carrying the judgement's numbers).

use std::borrow::Cow;

use super::facts::Facts;
use super::floor::{Floor, FloorAt};
use super::params::TolOverride;
use super::scaled::{self, Judgement, Policy};
use super::verdict::Verdict;
use crate::arithmetic::Arithmetic;
use crate::compare::{Comparison, Tolerance};
use crate::golden::GoldenSet;
use crate::stage::{Stage, Step};
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

/// The oracle's tensor at (step, stage) (its last row when `like` is a
/// last-row logits tensor) and its magnitude M = max|O|.
pub fn oracle_at<'a>(
    oracle: &'a GoldenSet,
    step: Step,
    stage: Stage,
    like: &Tensor,
) -> Result<(Cow<'a, Tensor>, f64), String> {
    let o = oracle
        .get(step, stage)
        .ok_or_else(|| format!("the oracle ({}) has no tensor `{step}/{stage}`", oracle.path.display()))?;
    let like_last = like.shape().first() == Some(&1) && stage == Stage::Logits;
    let o = last_row_if(o, like, stage, like_last);
    let m = scaled::max_abs_value(&o);
    Ok((o, m))
}

/// A golden source's arithmetic: the spec's `scaled.arithmetic`, else what
/// its provenance states, else f32 (a provenance that cannot be read is an
/// error, never a silent f32).
pub fn source_arithmetic(facts: &Facts, source: &str) -> Result<Arithmetic, String> {
    if let Some(a) = facts.scaled.arithmetic.get(source) {
        return Ok(*a);
    }
    let Some(g) = facts.source(source) else {
        return Ok(Arithmetic::F32);
    };
    Arithmetic::of_provenance(&g.provenance)
        .map(|a| a.unwrap_or(Arithmetic::F32))
        .map_err(|e| format!("golden `{source}` ({}): {e}", g.path.display()))
}

/// The floor of a source judged in arithmetic `arith` at (step, stage), its
/// tensors read through `x`; `judged` names it when it is a golden (it is
/// then never its own gain reference).
#[allow(clippy::too_many_arguments)]
pub fn floor_of<'s>(
    facts: &Facts,
    oracle: &GoldenSet,
    step: Step,
    stage: Stage,
    m: f64,
    arith: Arithmetic,
    judged: Option<&str>,
    x: &super::floor::Source<'s>,
) -> Floor {
    let compute = || floor_at(facts, oracle, step, arith, judged).floor(stage, m, x);
    // A source's floor is the same in every check that asks for it: the
    // engine's in one run (the run's memo), a golden's in every run of the
    // plan (it reads the goldens and the model file alone).
    let (memo, key) = match judged {
        Some(name) => (
            facts.shared,
            format!(
                "floor {name} {step} {stage} {arith} {} {}",
                m.to_bits(),
                facts.goldens_key()
            ),
        ),
        None => (
            facts.memo,
            format!("floor \0engine {step} {stage} {arith} {}", m.to_bits()),
        ),
    };
    match memo {
        Some(memo) => memo.get_or(key, compute),
        None => compute(),
    }
}

/// Where a source judged in arithmetic `arith` has its floors computed; its
/// gain reference is an f32 golden other than itself.
pub fn floor_at<'a>(
    facts: &'a Facts<'a>,
    oracle: &'a GoldenSet,
    step: Step,
    arith: Arithmetic,
    judged: Option<&str>,
) -> FloorAt<'a> {
    let gain_ref = facts
        .goldens
        .iter()
        .filter(|(n, _)| Some(n.as_str()) != judged)
        .find(|(n, _)| source_arithmetic(facts, n).is_ok_and(|a| a == Arithmetic::F32))
        .map(|(_, g)| g.as_ref());
    FloorAt {
        facts,
        oracle,
        step,
        arith,
        c: facts.scaled.floor,
        gain_ref,
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
