//! The scaled policy row by row at a residual add (`ffn_inp`, `out`): each
//! token row's error against its own allowance, from the row floors of
//! `checks::floor` (`FloorAt::row_floors`).
//!
//! Why: the stage-wide judgement compares the largest error anywhere with an
//! allowance scaled by the largest magnitude anywhere. On a real model the
//! residual stream's first token carries outlier features hundreds of times
//! larger than every other row's, so a 1e-3 change of a later row — a
//! golden recorded wrong at one position, a kernel that mishandles the last
//! row — stays under the first token's allowance. A sum is formed element by
//! element, so each row's floor is derived from that row alone; a correct
//! implementation meets every row's, and a change of one row must.

use std::borrow::Cow;

use super::facts::Facts;
use super::measure::{floor_at, sci};
use super::scaled;
use crate::arithmetic::Arithmetic;
use crate::compare::{compare, Tolerance};
use crate::golden::GoldenSet;
use crate::stage::{Stage, Step};
use crate::tensor::Tensor;

/// The row whose error is the largest multiple of its allowance.
#[derive(Clone, Debug, PartialEq)]
pub struct RowJudgement {
    /// The token position of the row (the step's row)…
    pub position: usize,
    /// …and its index in the recorded view judged.
    pub index: usize,
    /// max|X − O| over the row.
    pub error: f64,
    /// The largest error of the reference class over the row (engine checks).
    pub reference_error: Option<f64>,
    pub floor: f64,
    /// `factor · max(reference_error, floor)`.
    pub allowed: f64,
}

impl RowJudgement {
    pub fn passed(&self) -> bool {
        self.error <= self.allowed
    }

    /// The sentence a failing verdict adds.
    pub fn explain(&self, factor: f64) -> String {
        let base = match self.reference_error {
            Some(r) => format!("max(reference {}, row floor {})", sci(r), sci(self.floor)),
            None => format!("row floor {}", sci(self.floor)),
        };
        format!(
            "token row {}: error {} > allowed {} = {factor} × {base}",
            self.position,
            sci(self.error),
            sci(self.allowed)
        )
    }

    /// Metrics for the report (only a failing row adds them).
    pub fn metrics(&self) -> Vec<(&'static str, f64)> {
        vec![
            ("row", self.position as f64),
            ("row_error", self.error),
            ("row_floor", self.floor),
            ("row_allowed", self.allowed),
        ]
    }
}

/// What a row judgement reads: the judged tensor and the oracle's, on the
/// recorded rows, and (for an engine) the references it is measured by.
pub struct RowInputs<'t> {
    pub judged: &'t Tensor,
    pub oracle_view: &'t Tensor,
    pub peers: Vec<Peer<'t>>,
}

/// A reference an engine's rows are measured by, with each row's own
/// allowance (factor × its row floor) where it has row floors: a row it
/// misses does not widen the engine's allowance for that row.
pub struct Peer<'t> {
    pub tensor: Cow<'t, Tensor>,
    pub row_allowed: Option<Vec<f64>>,
}

/// The worst row of `inputs` at (step, stage), X's tensors read through `x`
/// (its row floors come from its own errors at the stage's inputs). None
/// where the stage has no row floors (see `FloorAt::row_floors`).
#[allow(clippy::too_many_arguments)]
pub fn worst_row<'s>(
    facts: &Facts,
    oracle: &GoldenSet,
    step: Step,
    stage: Stage,
    arith: Arithmetic,
    judged: Option<&str>,
    x: &super::floor::Source<'s>,
    inputs: &RowInputs,
) -> Option<RowJudgement> {
    let floors = floor_at(facts, oracle, step, arith, judged).row_floors(stage, x)?;
    let rows = floors.len();
    let len = inputs.judged.data().len();
    if rows == 0 || !len.is_multiple_of(rows) || inputs.oracle_view.data().len() != len {
        return None;
    }
    let n = len / rows;
    let row_error = |t: &Tensor, i: usize| -> Option<f64> {
        let (a, o) = (
            t.data().get(i * n..(i + 1) * n)?,
            &inputs.oracle_view.data()[i * n..(i + 1) * n],
        );
        Some(a.iter().zip(o).fold(0.0f64, |m, (a, o)| {
            let d = if a.is_finite() {
                (*a as f64 - *o as f64).abs()
            } else {
                f64::INFINITY
            };
            m.max(d)
        }))
    };
    let positions = facts.rows_at(step, stage).filter(|r| r.len() == rows);
    let factor = facts.scaled.factor;
    let judged_rows = (0..rows).filter_map(|i| {
        let error = row_error(inputs.judged, i)?;
        let reference_error = (!inputs.peers.is_empty()).then(|| {
            inputs
                .peers
                .iter()
                .filter(|p| p.tensor.data().len() == len)
                .filter_map(|p| {
                    let e = row_error(&p.tensor, i)?;
                    let within = p.row_allowed.as_ref().and_then(|a| a.get(i)).is_none_or(|a| e <= *a);
                    within.then_some(e)
                })
                .fold(0.0f64, f64::max)
        });
        let floor = floors[i];
        Some(RowJudgement {
            position: positions.map_or(i, |r| r[i]),
            index: i,
            error,
            reference_error,
            floor,
            allowed: factor * reference_error.unwrap_or(0.0).max(floor),
        })
    });
    let ratio = |j: &RowJudgement| scaled::ratio(j.error, j.allowed);
    judged_rows.max_by(|a, b| ratio(a).total_cmp(&ratio(b)))
}

/// The comparator's account of the judged row against the oracle's at the
/// row's allowance (count, worst element with both values, NMSE, cosine).
pub fn row_comparison(judged: &Tensor, oracle_view: &Tensor, row: &RowJudgement) -> Option<String> {
    let len = judged.data().len();
    let rows = *judged.shape().first()?;
    if rows == 0 || !len.is_multiple_of(rows) || oracle_view.data().len() != len {
        return None;
    }
    let n = len / rows;
    let take = |t: &Tensor| Tensor::new(vec![1, n], t.data()[row.index * n..(row.index + 1) * n].to_vec());
    let c = compare(&take(judged), &take(oracle_view), Tolerance::new(row.allowed, 0.0)).ok()?;
    Some(c.explain())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failing_row_names_its_position_and_allowance() {
        let j = RowJudgement {
            position: 18,
            index: 1,
            error: 2e-3,
            reference_error: Some(1e-5),
            floor: 3e-5,
            allowed: 1.2e-4,
        };
        assert!(!j.passed());
        let m = j.explain(4.0);
        assert!(
            m.contains("token row 18") && m.contains("2.00e-3") && m.contains("1.20e-4"),
            "{m}"
        );
        assert!(RowJudgement { error: 1e-4, ..j }.passed());
    }
}
