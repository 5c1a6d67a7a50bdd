//! Where a step's tapped tensors go: the one path by which the CPU engine's
//! forward pass and its vision tower write captures, asking the `TapSet`
//! before copying anything (an untapped run pays for no copies), each capture
//! tagged with the run's storage dtype.

use crate::engine::{Captures, TapSet};
use crate::stage::{Stage, Step};
use crate::tensor::{DType, Tensor};

use super::mutants::Mutants;

/// Where a step's tapped tensors go.
pub struct Tap<'a> {
    pub taps: &'a TapSet,
    pub step: Step,
    pub caps: &'a mut Captures,
    /// The run's storage dtype: every capture is tagged with it (see `tag`).
    pub dtype: DType,
    /// Planted bugs (test builds only).
    pub mutants: Mutants,
}

impl Tap<'_> {
    pub(super) fn wants(&self, s: Stage) -> bool {
        self.taps.contains(s)
    }
    /// Captures a copy of `data` if `s` is tapped.
    pub(super) fn copy(&mut self, s: Stage, shape: &[usize], data: &[f32]) {
        if self.wants(s) {
            self.keep(s, shape, data.to_vec());
        }
    }
    /// Captures `data` itself (no copy) if `s` is tapped.
    pub(super) fn keep(&mut self, s: Stage, shape: &[usize], data: Vec<f32>) {
        if self.wants(s) {
            let t = self.tag(Tensor::new(shape.to_vec(), data));
            self.caps.insert(self.step, s, t);
        }
    }
    /// Every capture of a run carries the run's storage dtype, attn_probs
    /// included although its values are f32: a capture's dtype is the
    /// precision of the run that produced it (its inputs were rounded to
    /// storage), and the runner's golden tolerance lookup (`runner::tolerance`,
    /// by the coarser dtype of the two sides, then the spec's `tolerance:`
    /// table) picks the storage dtype's tolerance from it.
    fn tag(&self, t: Tensor) -> Tensor {
        t.with_dtype(self.dtype)
    }
}
