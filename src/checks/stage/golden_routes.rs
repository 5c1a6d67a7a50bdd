//! The golden check where routing decides (`model::moe`): the route is a set
//! of experts, not a value, so `ffn_moe_topk` is compared by set, and a
//! different set is correct only at a near-tie. A near-tie never gives a
//! false failure and never hides a wrong route:
//!
//! - at `ffn_moe_topk`, a row whose experts differ from the golden's passes
//!   only where the reference's (the oracle's, else the golden's own) score
//!   of every expert the engine left out exceeds the lowest it chose by no
//!   more than twice the engine's own score error on that row (|X − O| of
//!   `ffn_moe_probs`, which the probs' golden check bounds) plus the scores'
//!   f32 arithmetic: either choice is then within what a correct engine
//!   computes; anything else fails there, naming both routes and the gap;
//! - once the engine routed a token otherwise than the golden, every later
//!   stage of that golden (the same step from that layer's weights on, and
//!   the layers above it and the head at every later step) follows another
//!   computation: it is not compared
//!   (not applicable, naming the route), and the golden-free checks
//!   (`routing`, `experts`, the recomputes) judge those stages with the
//!   experts the engine chose.

use crate::checks::facts::Facts;
use crate::checks::verdict::Verdict;
use crate::golden::GoldenSet;
use crate::stage::{BlockStage, Stage, Step};
use crate::tensor::Tensor;

fn ids_of(t: &Tensor, r: usize, k: usize) -> Vec<i64> {
    let mut v: Vec<i64> = t.data()[r * k..][..k].iter().map(|&x| x as i64).collect();
    v.sort_unstable();
    v
}

/// A row whose experts differ: (row, the engine's ids, the golden's ids).
type Differ = (usize, Vec<i64>, Vec<i64>);

/// The rows of a step's `ffn_moe_topk` where the engine's experts differ
/// from the golden's (None where either lacks it or the shapes differ).
fn differing(actual: &Tensor, expected: &Tensor) -> Option<Vec<Differ>> {
    if actual.shape() != expected.shape() || actual.shape().len() != 2 {
        return None;
    }
    let (t, k) = (actual.shape()[0], actual.shape()[1]);
    Some(
        (0..t)
            .map(|r| (r, ids_of(actual, r, k), ids_of(expected, r, k)))
            .filter(|(_, a, e)| a != e)
            .collect(),
    )
}

/// The golden check at `ffn_moe_topk`: the same experts in every row, or a
/// near-tie (see the module comment).
pub fn judge_ids(facts: &Facts, at_probs: Option<&Tensor>, step: Step, stage: Stage, actual: &Tensor, golden: &GoldenSet) -> Verdict {
    let source = &golden.source;
    let Some(expected) = golden.get(step, stage) else {
        return Verdict::fail(format!("golden `{source}` has no tensor `{step}/{stage}`"));
    };
    let Some(rows) = differing(actual, expected) else {
        return Verdict::fail(format!(
            "{stage} has shape {:?}, golden `{source}` {:?}",
            actual.shape(),
            expected.shape()
        ));
    };
    let t = actual.shape()[0];
    if rows.is_empty() {
        return Verdict::pass(format!("the same experts as golden `{source}` in all {t} rows")).metric("max_abs", 0.0);
    }
    let probs_stage = match stage {
        Stage::Block(l, _) => Stage::Block(l, BlockStage::FfnMoeProbs),
        _ => stage,
    };
    // The reference's scores: the oracle's where there is one.
    let reference = facts
        .oracle
        .and_then(|o| o.get(step, probs_stage))
        .or_else(|| golden.get(step, probs_stage));
    let mut ties = Vec::new();
    for (r, got, want) in &rows {
        let (Some(refp), Some(xp)) = (reference, at_probs) else {
            return Verdict::fail(format!(
                "{stage} row {r}: experts {got:?}, golden `{source}` {want:?}; neither the reference's nor the \
                 engine's ffn_moe_probs is at hand to tell a near-tie"
            ));
        };
        let n = refp.shape()[1];
        let rp: Vec<f64> = refp.data()[r * n..][..n].iter().map(|&v| v as f64).collect();
        let err = xp.data()[r * n..][..n]
            .iter()
            .zip(&rp)
            .map(|(a, b)| (*a as f64 - b).abs())
            .fold(0.0f64, f64::max);
        let valid = |v: &[i64]| v.iter().all(|&j| j >= 0 && (j as usize) < n);
        if !valid(got) {
            return Verdict::fail(format!("{stage} row {r}: expert ids {got:?} out of 0..{n}"));
        }
        let scale = rp.iter().map(|v| v.abs()).fold(0.0f64, f64::max);
        let allowed = 2.0 * err + 8.0 * (n as f64) * crate::checks::scaled::U_F32 * scale;
        // Group-limited routing: the groups the engine drew from must be
        // the reference's best or within a group score's allowance of them
        // (a group scores two experts: twice the error on each side); the
        // experts are then compared within those groups.
        let groups = facts.config.moe.as_ref().and_then(|m| m.routing.groups);
        let mut want = want.clone();
        let mut group_note = String::new();
        if let Some((g, tg)) = groups.filter(|(g, _)| n.is_multiple_of(*g)) {
            let per = n / g;
            let gs: Vec<f64> = rp
                .chunks(per)
                .map(|c| {
                    let mut v = c.to_vec();
                    v.sort_by(|a, b| b.total_cmp(a));
                    v[0] + v.get(1).copied().unwrap_or(0.0)
                })
                .collect();
            let best = crate::model::moe::top_indices(&gs, tg);
            let mut used: Vec<usize> = got.iter().map(|&j| j as usize / per).collect();
            used.dedup();
            let cut = gs[best[tg - 1]];
            let g_allowed = 2.0 * allowed;
            if let Some(&gu) = used.iter().filter(|u| !best.contains(u)).find(|&&u| cut - gs[u] > g_allowed) {
                return Verdict::fail(format!(
                    "{step}/{stage} row {r}: the engine routed to experts {got:?} (group {gu} among them), golden \
                     `{source}` to {want:?}: the reference scores group {gu} {:.3e} below its {tg}-th best, more than \
                     a group score's allowance {g_allowed:.2e}: a wrong group, not a near-tie",
                    cut - gs[gu]
                ));
            }
            if used.iter().any(|u| !best.contains(u)) {
                // The engine's groups, then the reference's best to fill topk_group.
                let mut eligible = used.clone();
                eligible.extend(best.iter().filter(|b| !used.contains(b)).take(tg.saturating_sub(used.len())));
                let masked: Vec<f64> = (0..n)
                    .map(|j| if eligible.contains(&(j / per)) { rp[j] } else { f64::NEG_INFINITY })
                    .collect();
                let mut alt: Vec<i64> = crate::model::moe::top_indices(&masked, got.len()).iter().map(|&j| j as i64).collect();
                alt.sort_unstable();
                group_note = format!(", groups {used:?} within {g_allowed:.1e} of the best");
                want = alt;
            }
        }
        let lo = got.iter().filter(|j| !want.contains(j)).map(|&j| rp[j as usize]).fold(f64::INFINITY, f64::min);
        let hi = want.iter().filter(|j| !got.contains(j)).map(|&j| rp[j as usize]).fold(f64::NEG_INFINITY, f64::max);
        let gap = if got == &want { 0.0 } else { hi - lo };
        if gap > allowed {
            return Verdict::fail(format!(
                "{step}/{stage} row {r}: the engine routed to experts {got:?}, golden `{source}` to {want:?}: the \
                 reference scores the expert it left out {gap:.3e} above the one it took, more than the engine's \
                 score error allows ({allowed:.2e} = 2 × its |Δ| {err:.2e} on the row + f32): a wrong route, not a \
                 near-tie"
            ))
            .metric("max_abs", gap);
        }
        ties.push(format!("row {r}: {got:?} (gap {gap:.1e} ≤ {allowed:.1e}{group_note})"));
    }
    Verdict::pass(format!(
        "the same experts as golden `{source}` in {} of {t} rows; near-ties, either choice correct (later stages \
         of this golden follow the golden's route and are not compared): {}",
        t - rows.len(),
        ties.join(", ")
    ))
    .metric("near_ties", rows.len() as f64)
}

/// Where the engine first routed otherwise than golden `g` before (step,
/// stage) in execution order: the reason its later stages are not compared.
/// `routed` is the judged side's tensors: an engine's captures, or another
/// reference.
pub fn rerouted_before<'t>(
    routed: &dyn Fn(Step, Stage) -> Option<&'t Tensor>,
    g: &GoldenSet,
    step: Step,
    stage: Stage,
) -> Option<String> {
    g.keys()
        .copied()
        .take_while(|&k| k < (step, stage))
        .filter(|&(st, at)| match at {
            // The flipped token's later stages at its own step; at later
            // steps only the layers above (their keys and values at that
            // row differ) and the head: a layer at or below it reads
            // nothing the flip changed.
            Stage::Block(l, BlockStage::FfnMoeTopk) => {
                st == step || stage > Stage::Block(l, BlockStage::Deepstack)
            }
            _ => false,
        })
        .find_map(|(st, at)| {
            let rows = differing(routed(st, at)?, g.get(st, at)?)?;
            let (r, got, want) = rows.first()?;
            Some(format!(
                "row {r} of {st}/{at} was routed to experts {got:?} where golden `{}` took {want:?} (a near-tie, \
                 judged there): from there the two follow different computations, and the golden-free checks judge \
                 the engine's",
                g.source
            ))
        })
}
