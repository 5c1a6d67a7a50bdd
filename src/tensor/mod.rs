//! Host tensors. Values are held as f32 whatever they were stored as: every
//! comparison and invariant is computed in f32/f64, and `dtype` remembers the
//! storage precision because it decides the default tolerance.

pub mod io;
pub mod stats;

use std::fmt;
use std::sync::Arc;

use memmap2::Mmap;

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize)]
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
    /// The largest finite value the format holds: a value past it (by more
    /// than half a step) rounds to infinity when stored.
    pub fn max_finite(self) -> f64 {
        match self {
            DType::F32 => f32::MAX as f64,
            DType::F16 => 65504.0,
            DType::BF16 => 3.3895313892515355e38,
        }
    }

    pub fn unit_roundoff(self) -> f64 {
        match self {
            DType::F32 => 2f64.powi(-24),
            DType::F16 => 2f64.powi(-11),
            DType::BF16 => 2f64.powi(-8),
        }
    }

    /// The greatest absolute error of one rounding into the dtype's
    /// subnormal range (half its smallest subnormal), where the relative
    /// bound |fl(x) − x| ≤ u·|x| no longer holds.
    pub fn subnormal_error(self) -> f64 {
        match self {
            DType::F32 => 2f64.powi(-150),
            DType::F16 => 2f64.powi(-25),
            DType::BF16 => 2f64.powi(-134),
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
    data: Storage,
}

/// Where a tensor's f32 values live: in an owned vector, or in place in a
/// read-only memory map of the file they were read from. Mapping is what lets
/// a 2 GB f32 model or a pair of 256 MiB goldens be used without a second
/// copy (the pages are the file's own page cache); anything that needs a
/// conversion (16-bit, quantised, big-endian, misaligned) is owned.
#[derive(Clone)]
enum Storage {
    Owned(Vec<f32>),
    Mapped(MappedF32),
}

/// `len` f32 values at byte `offset` of a shared map, checked at construction
/// to be in bounds and 4-byte aligned, so viewing them as `&[f32]` is sound.
#[derive(Clone)]
struct MappedF32 {
    map: Arc<Mmap>,
    offset: usize,
    len: usize,
}

impl Storage {
    fn as_slice(&self) -> &[f32] {
        match self {
            Storage::Owned(v) => v,
            // SAFETY: `Tensor::mapped` checked that offset..offset+4·len lies in
            // the map and that the address is 4-aligned; every bit pattern is a
            // valid f32; the map is read-only and kept alive by the Arc.
            Storage::Mapped(m) => unsafe {
                std::slice::from_raw_parts(m.map.as_ptr().add(m.offset).cast::<f32>(), m.len)
            },
        }
    }
}

impl PartialEq for Storage {
    fn eq(&self, other: &Storage) -> bool {
        self.as_slice() == other.as_slice()
    }
}

impl fmt::Debug for Storage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Storage::Owned(v) => v.fmt(f),
            Storage::Mapped(m) => write!(f, "<{} f32 mapped at byte {}>", m.len, m.offset),
        }
    }
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
            data: Storage::Owned(data),
        }
    }

    /// An f32 tensor read in place from `map`: the `shape`'s values as
    /// little-endian f32 starting at byte `offset`. None when the values are not
    /// 4-byte aligned in memory, run past the map, or the host is big-endian;
    /// the caller then converts into an owned tensor.
    pub fn mapped(shape: Vec<usize>, map: Arc<Mmap>, offset: usize) -> Option<Tensor> {
        let len = shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d))?;
        let end = len.checked_mul(4)?.checked_add(offset)?;
        let aligned = (map.as_ptr() as usize).checked_add(offset)? % std::mem::align_of::<f32>() == 0;
        if end > map.len() || !aligned || cfg!(target_endian = "big") {
            return None;
        }
        Some(Tensor {
            shape,
            dtype: DType::F32,
            data: Storage::Mapped(MappedF32 { map, offset, len }),
        })
    }

    /// Rows `first..first + rows` of a 2-D tensor, sharing a mapped tensor's
    /// map rather than copying it (a fused projection's pieces).
    pub fn rows(&self, first: usize, rows: usize) -> Tensor {
        assert_eq!(self.shape.len(), 2, "rows of a {}-D tensor", self.shape.len());
        let cols = self.shape[1];
        assert!(first + rows <= self.shape[0], "rows {first}+{rows} of {:?}", self.shape);
        let data = match &self.data {
            Storage::Mapped(m) => Storage::Mapped(MappedF32 {
                map: m.map.clone(),
                offset: m.offset + 4 * first * cols,
                len: rows * cols,
            }),
            Storage::Owned(v) => Storage::Owned(v[first * cols..(first + rows) * cols].to_vec()),
        };
        Tensor {
            shape: vec![rows, cols],
            dtype: self.dtype,
            data,
        }
    }

    /// Whether the values are read in place from a file's memory map.
    pub fn is_mapped(&self) -> bool {
        matches!(self.data, Storage::Mapped(_))
    }

    /// The sub-tensor holding indices `rows` (ascending, in range) of `axis`,
    /// the other axes whole; the dtype kept.
    pub fn select_rows(&self, axis: usize, rows: &[usize]) -> Tensor {
        let (outer, n, inner) = (
            self.shape[..axis].iter().product::<usize>(),
            self.shape[axis],
            self.shape[axis + 1..].iter().product::<usize>(),
        );
        let mut data = Vec::with_capacity(outer * rows.len() * inner);
        for o in 0..outer {
            for &r in rows {
                let at = (o * n + r) * inner;
                data.extend_from_slice(&self.data()[at..at + inner]);
            }
        }
        let mut shape = self.shape.clone();
        shape[axis] = rows.len();
        Tensor::new(shape, data).with_dtype(self.dtype)
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
        self.data.as_slice()
    }
    /// The values, writable: a mapped tensor is copied into an owned one first
    /// (the map is read-only and shared).
    pub fn data_mut(&mut self) -> &mut [f32] {
        if let Storage::Mapped(_) = self.data {
            self.data = Storage::Owned(self.data.as_slice().to_vec());
        }
        match &mut self.data {
            Storage::Owned(v) => v,
            Storage::Mapped(_) => unreachable!("converted to owned above"),
        }
    }
    /// The values as a vector (a copy for a mapped tensor).
    pub fn into_data(self) -> Vec<f32> {
        match self.data {
            Storage::Owned(v) => v,
            Storage::Mapped(m) => Storage::Mapped(m).as_slice().to_vec(),
        }
    }
    pub fn numel(&self) -> usize {
        self.data().len()
    }

    /// Same values, new shape with the same element count.
    pub fn reshaped(mut self, shape: Vec<usize>) -> Tensor {
        assert_eq!(shape.iter().product::<usize>(), self.numel());
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

    fn mapped_file(values: &[f32], pad: usize) -> (tempfile::NamedTempFile, Arc<Mmap>) {
        use std::io::Write;
        let mut f = tempfile::NamedTempFile::new().unwrap();
        f.write_all(&vec![0u8; pad]).unwrap();
        for v in values {
            f.write_all(&v.to_le_bytes()).unwrap();
        }
        f.flush().unwrap();
        // SAFETY: a private temp file nobody else writes.
        let map = Arc::new(unsafe { Mmap::map(f.as_file()) }.unwrap());
        (f, map)
    }

    #[test]
    fn a_mapped_tensor_reads_in_place_and_copies_only_on_write() {
        let vals: Vec<f32> = (0..12).map(|i| i as f32 * 0.5 - 1.0).collect();
        let (_f, map) = mapped_file(&vals, 8);
        let t = Tensor::mapped(vec![3, 4], map.clone(), 8).expect("aligned and in bounds");
        assert!(t.is_mapped());
        assert_eq!(t.data(), &vals[..]);
        assert_eq!(t.data().as_ptr() as usize, map.as_ptr() as usize + 8, "no copy");
        assert_eq!(t, Tensor::new(vec![3, 4], vals.clone()), "equality is by value");
        // Rows of a mapped tensor share the map.
        let r = t.rows(1, 2);
        assert!(r.is_mapped());
        assert_eq!(r.shape(), [2, 4]);
        assert_eq!(r.data(), &vals[4..12]);
        // Writing copies; the map and other views are untouched.
        let mut w = t.clone();
        w.data_mut()[0] = 42.0;
        assert!(!w.is_mapped());
        assert_eq!(t.data()[0], vals[0]);
        assert_eq!(w.clone().into_data()[..2], [42.0, vals[1]]);
        assert_eq!(r.into_data(), vals[4..12].to_vec());
    }

    #[test]
    fn a_misaligned_or_short_map_is_refused() {
        // Maps start on a page boundary, so byte 2 is not 4-aligned.
        let (_f, map) = mapped_file(&[1.0, 2.0, 3.0], 2);
        assert!(Tensor::mapped(vec![3], map.clone(), 2).is_none(), "misaligned");
        let (_g, map) = mapped_file(&[1.0, 2.0, 3.0], 4);
        assert!(Tensor::mapped(vec![3], map.clone(), 4).is_some());
        assert!(Tensor::mapped(vec![4], map.clone(), 4).is_none(), "past the end");
        assert!(
            Tensor::mapped(vec![usize::MAX, 2], map, 0).is_none(),
            "overflowing shape"
        );
    }
}
