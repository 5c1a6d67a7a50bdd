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
