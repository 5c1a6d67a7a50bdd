//! Host tensors. Values are held as f32 whatever they were stored as: every
//! comparison and invariant is computed in f32/f64, and `dtype` remembers the
//! storage precision because it decides the default tolerance.

use std::fmt;

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum DType {
    #[default]
    F32,
    F16,
    BF16,
}

impl DType {
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
        }
    }
    pub fn parse(s: &str) -> Option<DType> {
        match s {
            "f32" => Some(DType::F32),
            "f16" => Some(DType::F16),
            "bf16" => Some(DType::BF16),
            _ => None,
        }
    }
    /// Rounds `x` to this dtype (round to nearest, ties to even, as the GPU's
    /// conversions do) and widens it back to f32. The identity for f32.
    #[inline]
    pub fn round(self, x: f32) -> f32 {
        match self {
            DType::F32 => x,
            DType::F16 => half::f16::from_f32(x).to_f32(),
            DType::BF16 => half::bf16::from_f32(x).to_f32(),
        }
    }

    /// `round` on every value in place; for f32 it touches nothing.
    pub fn round_slice(self, xs: &mut [f32]) {
        if self != DType::F32 {
            xs.iter_mut().for_each(|x| *x = self.round(*x));
        }
    }

    /// Whether `x` is exactly representable in this dtype (rounding leaves its
    /// bits unchanged; NaN never is, so callers screen it first).
    pub fn represents(self, x: f32) -> bool {
        self.round(x).to_bits() == x.to_bits()
    }

    /// The unit roundoff u = 2^-p of round-to-nearest with p significand bits
    /// (implicit bit included): a rounded value is within u·|x| of x (normal range).
    pub fn unit_roundoff(self) -> f64 {
        match self {
            DType::F32 => 2f64.powi(-24),
            DType::F16 => 2f64.powi(-11),
            DType::BF16 => 2f64.powi(-8),
        }
    }

    /// The less precise of two dtypes (by mantissa bits): a comparison is only as
    /// exact as its coarsest side.
    pub fn coarser(self, other: DType) -> DType {
        fn bits(d: DType) -> u8 {
            match d {
                DType::F32 => 23,
                DType::F16 => 10,
                DType::BF16 => 7,
            }
        }
        if bits(self) <= bits(other) {
            self
        } else {
            other
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct Tensor {
    shape: Vec<usize>,
    dtype: DType,
    data: Vec<f32>,
}

impl Tensor {
    /// Builds an f32 tensor. Panics if `data.len()` is not the product of `shape`:
    /// that is a bug in the caller, never a property of user input (loaders check
    /// sizes themselves and return errors).
    pub fn new(shape: Vec<usize>, data: Vec<f32>) -> Tensor {
        assert_eq!(
            shape.iter().product::<usize>(),
            data.len(),
            "tensor shape {shape:?} does not match {} values",
            data.len()
        );
        Tensor {
            shape,
            dtype: DType::F32,
            data,
        }
    }

    pub fn with_dtype(mut self, dtype: DType) -> Tensor {
        self.dtype = dtype;
        self
    }

    pub fn set_dtype(&mut self, dtype: DType) {
        self.dtype = dtype;
    }

    pub fn shape(&self) -> &[usize] {
        &self.shape
    }
    pub fn dtype(&self) -> DType {
        self.dtype
    }
    pub fn data(&self) -> &[f32] {
        &self.data
    }
    pub fn data_mut(&mut self) -> &mut [f32] {
        &mut self.data
    }
    pub fn into_data(self) -> Vec<f32> {
        self.data
    }
    pub fn numel(&self) -> usize {
        self.data.len()
    }

    /// Same values, new shape with the same element count.
    pub fn reshaped(mut self, shape: Vec<usize>) -> Tensor {
        assert_eq!(shape.iter().product::<usize>(), self.data.len());
        self.shape = shape;
        self
    }

    /// Multi-index of a flat (row-major) offset, for messages like "at [0, 3, 7]".
    pub fn unravel(&self, mut flat: usize) -> Vec<usize> {
        let mut idx = vec![0; self.shape.len()];
        for (d, &n) in self.shape.iter().enumerate().rev() {
            if n > 0 {
                idx[d] = flat % n;
                flat /= n;
            }
        }
        idx
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rounding_is_nearest_even_and_the_identity_for_f32() {
        let x = 1.0f32 + 3.0 * 2f32.powi(-12); // not representable in f16/bf16
        assert_eq!(DType::F32.round(x).to_bits(), x.to_bits());
        // bf16 keeps 8 significand bits: 1 + 2^-8 is a tie, and goes to even (1).
        assert_eq!(DType::BF16.round(1.0 + 2f32.powi(-8)), 1.0);
        assert_eq!(DType::BF16.round(1.0 + 3.0 * 2f32.powi(-8)), 1.0 + 2f32.powi(-6));
        // f16 keeps 11: 1 + 2^-11 is a tie, 1 + 3·2^-11 rounds up to 1 + 2^-9.
        assert_eq!(DType::F16.round(1.0 + 2f32.powi(-11)), 1.0);
        assert_eq!(DType::F16.round(1.0 + 3.0 * 2f32.powi(-11)), 1.0 + 2f32.powi(-9));
        for d in [DType::F32, DType::F16, DType::BF16] {
            let r = d.round(x);
            assert!(d.represents(r), "{d}: a rounded value is representable");
            assert!(((r - x).abs() as f64) <= d.unit_roundoff() * x.abs() as f64, "{d}");
        }
        assert!(!DType::BF16.represents(x) && !DType::F16.represents(x));
        let mut v = vec![x, -x, 0.0];
        DType::F32.round_slice(&mut v);
        assert_eq!(v, [x, -x, 0.0]);
        DType::BF16.round_slice(&mut v);
        assert_eq!(v, [1.0, -1.0, 0.0]);
        assert_eq!(
            [DType::F32, DType::F16, DType::BF16].map(DType::unit_roundoff),
            [2f64.powi(-24), 2f64.powi(-11), 2f64.powi(-8)]
        );
    }
}
