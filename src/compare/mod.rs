//! The comparator behind every golden check: one fused, parallel pass over an
//! actual/expected pair that yields everything a failure message needs (NaN/Inf
//! screen, allclose mismatch count, greatest absolute and relative difference
//! with their multi-index and *both* values, NMSE, cosine, max ULP distance).
//! torch's `assert_close` prints indices but not the values there, and
//! llama.cpp's test-backend-ops prints one NMSE; we print all of it, once.
//!
//! Determinism: data is cut into fixed-size chunks, each chunk is folded on its
//! own (in SIMD lanes, `fold`), and the per-chunk partials are combined
//! sequentially in chunk order. The result (sums included) is therefore
//! bit-identical whatever the thread count, and whatever the instruction set.

use std::collections::BTreeMap;
use std::fmt;

use rayon::prelude::*;

use crate::tensor::{DType, Tensor};
use fold::Partial;

mod fold;

/// Elements per chunk. Fixed (not derived from the thread count) so that the
/// f64 summation order, and hence every metric, never depends on the machine.
const CHUNK: usize = 1 << 14;

/// The allclose rule `|a - e| <= atol + rtol * |e|`.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize)]
pub struct Tolerance {
    pub atol: f64,
    pub rtol: f64,
}

impl Tolerance {
    pub fn new(atol: f64, rtol: f64) -> Tolerance {
        Tolerance { atol, rtol }
    }

    /// `torch.testing.assert_close` defaults, so a failure here means the same as
    /// a failure there. rtol tracks each format's rounding unit (f32 eps 1.2e-7,
    /// f16 eps 9.8e-4, bf16 eps 7.8e-3): roughly ten f32 roundings, one f16
    /// rounding, two bf16 roundings. atol 1e-5 keeps values near zero (where
    /// rtol·|e| vanishes) from failing on noise.
    pub fn default_for(dtype: DType) -> Tolerance {
        match dtype {
            DType::F32 => Tolerance::new(1e-5, 1.3e-6),
            DType::F16 => Tolerance::new(1e-5, 1e-3),
            DType::BF16 => Tolerance::new(1e-5, 1.6e-2),
        }
    }

    /// Default for a pair: a comparison is only as exact as its coarser side.
    pub fn for_pair(actual: &Tensor, expected: &Tensor) -> Tolerance {
        Tolerance::default_for(actual.dtype().coarser(expected.dtype()))
    }
}

/// A position in the tensor and the two values found there.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct At {
    pub index: Vec<usize>,
    pub actual: f32,
    pub expected: f32,
}

#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct Comparison {
    pub shape: Vec<usize>,
    pub numel: usize,
    pub tol: Tolerance,
    pub nan_actual: usize,
    pub inf_actual: usize,
    pub nan_expected: usize,
    pub inf_expected: usize,
    /// Lowest index where actual or expected is NaN or ±Inf.
    pub first_non_finite: Option<At>,
    /// Elements breaking the allclose rule. A non-finite value on either side is
    /// a mismatch, except the same infinity on both sides (bit-equal); NaN never
    /// matches, not even NaN.
    pub mismatched: usize,
    /// Greatest |a-e| over pairs where both are finite; ties go to the lowest index.
    pub max_abs: Option<(f64, At)>,
    /// Greatest |a-e|/|e| over finite pairs with e != 0; ties go to the lowest index.
    pub max_rel: Option<(f64, At)>,
    /// Greatest distance in f32 ULPs over finite pairs (+0 and -0 are 0 apart).
    pub max_ulp: u64,
    /// Σ(a-e)²/Σe² over finite pairs; 0/0 = 0, x/0 = inf.
    pub nmse: f64,
    /// a·e/(|a||e|) over finite pairs; two zero vectors give 1, one gives 0.
    pub cosine: f64,
}

#[derive(Debug, Clone, PartialEq)]
pub struct ShapeMismatch {
    pub actual: Vec<usize>,
    pub expected: Vec<usize>,
}

impl fmt::Display for ShapeMismatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "shape mismatch: actual {:?} vs expected {:?}",
            self.actual, self.expected
        )
    }
}

impl std::error::Error for ShapeMismatch {}

/// Distance between two finite f32 values in units in the last place: the
/// number of representable floats between them. Meaningless for NaN.
pub fn ulp_distance(a: f32, b: f32) -> u64 {
    // Map the sign-magnitude bit pattern onto a monotone integer line.
    fn key(x: f32) -> i64 {
        let bits = x.to_bits();
        let mag = (bits & 0x7fff_ffff) as i64;
        if bits >> 31 == 1 {
            -mag
        } else {
            mag
        }
    }
    (key(a) - key(b)).unsigned_abs()
}

/// Compares `actual` with `expected` element by element. A shape difference is
/// an `Err`: no metric is meaningful then, and the caller says so.
pub fn compare(actual: &Tensor, expected: &Tensor, tol: Tolerance) -> Result<Comparison, ShapeMismatch> {
    compare_chunked(actual, expected, tol, CHUNK, true)
}

fn compare_chunked(
    actual: &Tensor,
    expected: &Tensor,
    tol: Tolerance,
    chunk: usize,
    parallel: bool,
) -> Result<Comparison, ShapeMismatch> {
    if actual.shape() != expected.shape() {
        return Err(ShapeMismatch {
            actual: actual.shape().to_vec(),
            expected: expected.shape().to_vec(),
        });
    }
    let (a, e) = (actual.data(), expected.data());
    let scan = |(c, (a, e)): (usize, (&[f32], &[f32]))| fold::scan(a, e, c * chunk, tol);
    // Collecting keeps chunk order; the sequential fold below fixes the sum order.
    let partials: Vec<Partial> = if parallel {
        a.par_chunks(chunk)
            .zip(e.par_chunks(chunk))
            .enumerate()
            .map(scan)
            .collect()
    } else {
        a.chunks(chunk).zip(e.chunks(chunk)).enumerate().map(scan).collect()
    };
    let p = partials.into_iter().fold(Partial::default(), Partial::merge);

    let at = |i: usize| At {
        index: actual.unravel(i),
        actual: a[i],
        expected: e[i],
    };
    let nmse = if p.sum_e2 > 0.0 {
        p.sum_d2 / p.sum_e2
    } else if p.sum_d2 == 0.0 {
        0.0
    } else {
        f64::INFINITY
    };
    let cosine = match (p.sum_a2 > 0.0, p.sum_e2 > 0.0) {
        (false, false) => 1.0,
        (true, true) => (p.sum_ae / (p.sum_a2 * p.sum_e2).sqrt()).clamp(-1.0, 1.0),
        _ => 0.0,
    };
    Ok(Comparison {
        shape: actual.shape().to_vec(),
        numel: a.len(),
        tol,
        nan_actual: p.nan_a,
        inf_actual: p.inf_a,
        nan_expected: p.nan_e,
        inf_expected: p.inf_e,
        first_non_finite: p.first_nf.map(at),
        mismatched: p.mismatched,
        max_abs: p.max_abs.map(|(d, i)| (d, at(i))),
        max_rel: p.max_rel.map(|(r, i)| (r, at(i))),
        max_ulp: p.max_ulp,
        nmse,
        cosine,
    })
}

/// Short scientific notation for metrics ("3.1e-6"); exact zero stays "0".
pub(crate) fn sci(x: f64) -> String {
    if x == 0.0 {
        "0".into()
    } else if x.is_finite() {
        format!("{x:.1e}")
    } else {
        format!("{x}")
    }
}

/// A tensor value: shortest round-trip form, scientific when very small or large.
fn val(x: f32) -> String {
    let m = x.abs();
    if x == 0.0 || !x.is_finite() || (1e-4..1e6).contains(&m) {
        format!("{x}")
    } else {
        format!("{x:e}")
    }
}

fn percent(k: usize, n: usize) -> String {
    let p = if n == 0 { 0.0 } else { 100.0 * k as f64 / n as f64 };
    if k == 0 || p >= 0.01 {
        format!("{p:.2}%")
    } else {
        format!("{p:.1e}%")
    }
}

impl Comparison {
    pub fn non_finite(&self) -> usize {
        self.nan_actual + self.inf_actual + self.nan_expected + self.inf_expected
    }

    pub fn passed(&self) -> bool {
        self.non_finite() == 0 && self.mismatched == 0
    }

    pub fn metrics(&self) -> BTreeMap<String, f64> {
        let frac = if self.numel == 0 {
            0.0
        } else {
            self.mismatched as f64 / self.numel as f64
        };
        let mut m: BTreeMap<String, f64> = [
            ("mismatched", self.mismatched as f64),
            ("mismatched_frac", frac),
            ("nmse", self.nmse),
            ("cosine", self.cosine),
            ("max_ulp", self.max_ulp as f64),
            ("atol", self.tol.atol),
            ("rtol", self.tol.rtol),
            ("non_finite", self.non_finite() as f64),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect();
        // Absent (not 0) when there was no finite pair to measure.
        if let Some((d, _)) = &self.max_abs {
            m.insert("max_abs".into(), *d);
        }
        if let Some((r, _)) = &self.max_rel {
            m.insert("max_rel".into(), *r);
        }
        m
    }

    /// One line for reports and passing checks.
    pub fn summary(&self) -> String {
        if self.numel == 0 {
            return format!("empty tensor, shape {:?}", self.shape);
        }
        let mut s = String::new();
        if let Some(at) = &self.first_non_finite {
            s += &format!(
                "{} non-finite (first at {:?}: actual {}, expected {}), ",
                self.non_finite(),
                at.index,
                val(at.actual),
                val(at.expected)
            );
        }
        if self.mismatched > 0 {
            s += &format!("{}/{} mismatched, ", self.mismatched, self.numel);
        }
        if let Some((d, at)) = &self.max_abs {
            s += &format!("max|Δ| {} at {:?}, ", sci(*d), at.index);
        }
        s + &format!("nmse {}, cos {:.6}", sci(self.nmse), self.cosine)
    }

    /// The multi-line failure text: non-finite screen first, then the allclose
    /// count, the worst elements with both values, and the aggregate metrics.
    pub fn explain(&self) -> String {
        let mut lines = Vec::new();
        if let Some(at) = &self.first_non_finite {
            lines.push(format!(
                "actual has {} NaN, {} Inf; expected has {} NaN, {} Inf; first at index {:?} (actual {}, expected {})",
                self.nan_actual,
                self.inf_actual,
                self.nan_expected,
                self.inf_expected,
                at.index,
                val(at.actual),
                val(at.expected)
            ));
        }
        lines.push(format!(
            "Mismatched elements: {} / {} ({}) under |a-e| <= atol {:e} + rtol {:e}*|e|",
            self.mismatched,
            self.numel,
            percent(self.mismatched, self.numel),
            self.tol.atol,
            self.tol.rtol
        ));
        match &self.max_abs {
            Some((d, at)) => lines.push(format!(
                "Greatest absolute difference: {} at index {:?} (actual {}, expected {}; allowed there {})",
                sci(*d),
                at.index,
                val(at.actual),
                val(at.expected),
                sci(self.tol.atol + self.tol.rtol * (at.expected as f64).abs())
            )),
            None => lines.push("Greatest absolute difference: n/a (no finite pair)".into()),
        }
        match &self.max_rel {
            Some((r, at)) => lines.push(format!(
                "Greatest relative difference: {} at index {:?} (actual {}, expected {})",
                sci(*r),
                at.index,
                val(at.actual),
                val(at.expected)
            )),
            None => lines.push("Greatest relative difference: n/a (no finite pair with expected != 0)".into()),
        }
        lines.push(format!(
            "NMSE {}, cosine {:.7}, max ULP {}",
            sci(self.nmse),
            self.cosine,
            self.max_ulp
        ));
        lines.join("\n")
    }
}

#[cfg(test)]
mod tests;
