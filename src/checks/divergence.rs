//! Where a run first went wrong, decided from outcomes alone (so it is
//! unit-tested on synthetic ones): the **first divergence** is the earliest
//! (step, stage), in execution order, where a golden check failed while the
//! references there are within their own allowance; every later failure is
//! **downstream** of it. Where a `references_agree` fails, the golden is
//! **suspect**: failures there are marked so and never make the first
//! divergence (with one reference and no oracle there is no such check, and a
//! moved golden is the first divergence). The references' spread at a stage
//! is the **budget** golden outcomes are shown beside.

use std::collections::{BTreeMap, BTreeSet};

use super::family::Family;
use super::verdict::Status;
use crate::stage::{Stage, Step};

/// What triage needs of one outcome.
#[derive(Clone, Copy, Debug)]
pub struct Mark<'a> {
    pub at: Option<(Step, Stage)>,
    pub family: &'a Family,
    pub status: Status,
    /// The check's name in ids: the tie-break between suspects at one stage.
    pub check: &'a str,
    /// Whether it measured numbers (has metrics): a failure that measured
    /// none (a tapped stage the engine did not write) is never the first
    /// divergence, which is reserved for numbers that differ.
    pub measured: bool,
}

/// The triage of a run's outcomes, index for index.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Triage {
    /// A failure at a (step, stage) where the golden is suspect.
    pub suspect: Vec<bool>,
    /// The outcome that is the first divergence.
    pub first: Option<usize>,
    /// For failures after the first divergence: its (step, stage).
    pub downstream: Vec<Option<(Step, Stage)>>,
    /// The earliest failing `references_agree` (its index).
    pub suspect_golden: Option<usize>,
}

pub fn triage(marks: &[Mark]) -> Triage {
    let failed = |m: &Mark| m.status == Status::Fail;
    let suspect_at: BTreeSet<(Step, Stage)> = marks
        .iter()
        .filter(|m| failed(m) && m.family.is_references_agree())
        .filter_map(|m| m.at)
        .collect();
    let suspect: Vec<bool> = marks
        .iter()
        .map(|m| {
            failed(m)
                && (m.family.is_golden() || m.family.is_references_agree())
                && m.at.is_some_and(|a| suspect_at.contains(&a))
        })
        .collect();
    let suspect_golden = marks
        .iter()
        .enumerate()
        .filter(|(_, m)| failed(m) && m.family.is_references_agree())
        .filter_map(|(i, m)| m.at.map(|at| (at, m.check, i)))
        .min()
        .map(|(_, _, i)| i);
    let first = marks
        .iter()
        .enumerate()
        .filter(|(i, m)| failed(m) && m.family.is_golden() && !suspect[*i] && m.measured)
        .filter_map(|(i, m)| m.at.map(|at| (at, i)))
        .min();
    let downstream = marks
        .iter()
        .enumerate()
        .map(|(i, m)| match first {
            Some((at, _)) if failed(m) && !suspect[i] && m.at.is_some_and(|a| a > at) => Some(at),
            _ => None,
        })
        .collect();
    Triage {
        suspect,
        first: first.map(|(_, i)| i),
        downstream,
        suspect_golden,
    }
}

/// The error budget per (step, stage): the greatest distance between the
/// references there (`max_abs` of every `references_agree` at it). An engine
/// error well inside it is noise, one far outside it is a bug.
pub fn budgets<'a>(
    outcomes: impl IntoIterator<Item = (Option<(Step, Stage)>, &'a Family, Option<f64>)>,
) -> BTreeMap<(Step, Stage), f64> {
    let mut budget: BTreeMap<(Step, Stage), f64> = BTreeMap::new();
    for (at, family, max_abs) in outcomes {
        if let (true, Some(at), Some(v)) = (family.is_references_agree(), at, max_abs) {
            let e = budget.entry(at).or_insert(0.0);
            *e = e.max(v);
        }
    }
    budget
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::stage::BlockStage;

    fn golden() -> Family {
        Family::Golden { source: "hf".into() }
    }
    fn agree() -> Family {
        Family::ReferencesAgree {
            base: "oracle".into(),
            other: "hf".into(),
        }
    }
    fn mark<'a>(step: Step, stage: Stage, family: &'a Family, status: Status) -> Mark<'a> {
        Mark {
            at: Some((step, stage)),
            family,
            status,
            check: "c",
            measured: true,
        }
    }

    #[test]
    fn first_divergence_is_the_earliest_failing_golden_and_later_failures_are_downstream() {
        let (q0, q1) = (Stage::Block(0, BlockStage::Q), Stage::Block(1, BlockStage::Q));
        let (g, inv) = (golden(), Family::Invariant);
        let t = triage(&[
            mark(Step::Decode(2), Stage::Logits, &g, Status::Fail),
            mark(Step::Decode(1), q1, &inv, Status::Fail),
            mark(Step::Decode(1), q1, &g, Status::Fail),
            mark(Step::Decode(1), q0, &g, Status::Pass),
            mark(Step::Prefill, Stage::Logits, &inv, Status::Fail),
        ]);
        assert_eq!(t.first, Some(2));
        assert_eq!(t.downstream[0], Some((Step::Decode(1), q1)));
        // An invariant failing at the same stage is not downstream; one before it neither.
        assert_eq!(t.downstream[1], None);
        assert_eq!(t.downstream[4], None);
        assert_eq!(t.suspect, vec![false; 5]);
        assert_eq!(t.suspect_golden, None);
    }

    #[test]
    fn a_failing_golden_where_the_references_disagree_is_suspect_not_the_first_divergence() {
        let (g, a) = (golden(), agree());
        let q = Stage::Block(0, BlockStage::Q);
        let t = triage(&[
            mark(Step::Prefill, q, &g, Status::Fail),
            mark(Step::Prefill, q, &a, Status::Fail),
            mark(Step::Decode(1), Stage::Logits, &g, Status::Fail),
        ]);
        assert_eq!(t.suspect, vec![true, true, false]);
        assert_eq!(t.suspect_golden, Some(1));
        // The next failing golden outside the suspect stage is the first divergence.
        assert_eq!(t.first, Some(2));
        assert_eq!(t.downstream, vec![None, None, None]);
    }

    #[test]
    fn only_failures_count_and_invariants_are_never_the_first_divergence() {
        let (g, a, inv) = (golden(), agree(), Family::Invariant);
        let q = Stage::Block(0, BlockStage::Q);
        let t = triage(&[
            mark(Step::Prefill, q, &inv, Status::Fail),
            mark(Step::Prefill, q, &a, Status::Pass),
            mark(Step::Prefill, q, &g, Status::Skip),
        ]);
        assert_eq!((t.first, t.suspect_golden), (None, None));
        assert_eq!(t.suspect, vec![false; 3]);
        // A run check (no stage) is never first, never downstream.
        let r = Family::Run;
        let t = triage(&[
            Mark {
                at: None,
                family: &r,
                status: Status::Fail,
                check: "kv_cache",
                measured: true,
            },
            mark(Step::Prefill, q, &g, Status::Fail),
        ]);
        assert_eq!(t.first, Some(1));
        assert_eq!(t.downstream[0], None);
    }

    #[test]
    fn the_budget_is_the_largest_reference_distance_at_each_stage() {
        let (g, a) = (golden(), agree());
        let at = (Step::Prefill, Stage::Block(0, BlockStage::Q));
        let q = Some(at);
        let b = budgets([
            (q, &a, Some(1e-6)),
            (q, &a, Some(3e-6)),
            (q, &g, Some(1.0)),
            (None, &a, Some(9.0)),
        ]);
        assert_eq!(b.len(), 1);
        assert_eq!(b[&at], 3e-6);
    }
}
