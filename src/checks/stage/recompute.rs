//! What the recompute invariants (`residual`, `rms_norm`, `swiglu`,
//! `linear`) share: an engine's
//! stage compared element by element with the same function recomputed in
//! f64 from the engine's own captured inputs, each element within its own
//! allowance (derived in each check's module). They need no golden and
//! inherit nothing from upstream: whatever drift the inputs carry, the stage
//! must be its function of them, so a bug shows at the stage that has it.

use crate::checks::verdict::Verdict;
use crate::stage::Stage;
use crate::tensor::Tensor;

/// The element that misses its allowance by the greatest factor.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Worst {
    pub index: usize,
    pub got: f32,
    pub want: f64,
    pub err: f64,
    pub allowed: f64,
}

/// A running comparison of an engine's elements with their recomputation.
#[derive(Clone, Debug, Default)]
pub struct Tally {
    pub n: usize,
    pub bad: usize,
    pub max_abs: f64,
    /// Greatest error / allowance over every element (≤ 1 when all pass).
    pub max_ratio: f64,
    pub worst: Option<Worst>,
}

impl Tally {
    pub fn add(&mut self, index: usize, got: f32, want: f64, allowed: f64) {
        // NaN (in the stage or an input) is an infinite error: it fails.
        let err = match (got as f64 - want).abs() {
            e if e.is_nan() => f64::INFINITY,
            e => e,
        };
        let ratio = err / allowed;
        self.n += 1;
        self.max_abs = self.max_abs.max(err);
        self.max_ratio = self.max_ratio.max(ratio);
        if err > allowed {
            self.bad += 1;
            if self.worst.is_none_or(|w| ratio > w.err / w.allowed) {
                self.worst = Some(Worst {
                    index,
                    got,
                    want,
                    err,
                    allowed,
                });
            }
        }
    }
}

/// How a recompute check words its verdict.
pub struct Wording<'a> {
    /// What the stage must be, e.g. `silu(gate)·up`.
    pub what: &'a str,
    /// The allowance's parameters, e.g. `u 4.9e-4`.
    pub within: &'a str,
    /// The likely causes a failure names.
    pub hint: &'a str,
}

impl Tally {
    /// The verdict on stage `y`: a pass saying `what` held at every element,
    /// or a failure with the count and the worst element, its value and the
    /// recomputation (`recomputed` words it, e.g. with its inputs), both
    /// errors and the allowance; with the `max_abs` and `violations` metrics.
    pub fn verdict(&self, y: &Tensor, stage: Stage, w: Wording, recomputed: impl FnOnce(&Worst) -> String) -> Verdict {
        let v = match self.worst {
            None => Verdict::pass(format!(
                "{stage} = {} at all {} elements (max |Δ| {:.2e}, {:.2} of the allowance; {})",
                w.what, self.n, self.max_abs, self.max_ratio, w.within
            )),
            Some(wst) => Verdict::fail(format!(
                "{} of {} elements of {stage} are not {} within the allowance ({}); worst at index {:?}: {stage} = {:e}, {} (|Δ| {:.2e}, {:.1}× the allowed {:.2e}): {}",
                self.bad,
                self.n,
                w.what,
                w.within,
                y.unravel(wst.index),
                wst.got,
                recomputed(&wst),
                wst.err,
                wst.err / wst.allowed,
                wst.allowed,
                w.hint
            )),
        };
        v.metric("max_abs", self.max_abs).metric("violations", self.bad as f64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_worst_is_the_greatest_miss_relative_to_its_allowance_and_nan_fails() {
        let mut t = Tally::default();
        t.add(0, 1.0, 1.0, 1e-6);
        t.add(1, 2.0, 1.0, 10.0); // within
        t.add(2, 1.1, 1.0, 1e-3); // misses by 100x
        t.add(3, 3.0, 1.0, 1.0); // misses by 2x, larger |Δ|
        assert_eq!((t.n, t.bad), (4, 2));
        assert_eq!(t.worst.unwrap().index, 2);
        assert_eq!(t.max_abs, 2.0);
        t.add(4, f32::NAN, 1.0, 1.0);
        assert_eq!((t.bad, t.worst.unwrap().index), (3, 4));
    }
}
