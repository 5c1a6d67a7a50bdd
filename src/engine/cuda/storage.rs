//! The storage types of the CUDA engine: f32, or f16/bf16 with f32 arithmetic
//! in every kernel (and f32 accumulation in cuBLAS). One type parameter of the
//! engine picks the kernels (`rmsnorm_` + suffix), the host conversions of the
//! weights, and the guard sentinel. Pure host code: tested without a GPU.

use cudarc::driver::{DeviceRepr, ValidAsZeroBits};

use crate::tensor::DType;

pub trait Storage:
    DeviceRepr + ValidAsZeroBits + super::emu::EmuType + Copy + Default + Unpin + Send + Sync + 'static
{
    const DTYPE: DType;
    /// Suffix of the kernels for this type (`rmsnorm_bf16`).
    const SUFFIX: &'static str;
    /// The guard sentinel as this type's bits: a signalling NaN, which no
    /// kernel computes (their NaNs are quiet) and no weight holds (the host
    /// conversions quiet NaNs too), so finding it means "never written".
    const SENTINEL_BITS: u32;
    /// Round to nearest even (what the kernels' `from_f32` does).
    fn from_f32(x: f32) -> Self;
    fn to_f32(self) -> f32;
    fn bits(self) -> u32;
}

impl Storage for f32 {
    const DTYPE: DType = DType::F32;
    const SUFFIX: &'static str = "f32";
    const SENTINEL_BITS: u32 = 0x7fba_d5ed;
    fn from_f32(x: f32) -> f32 {
        x
    }
    fn to_f32(self) -> f32 {
        self
    }
    fn bits(self) -> u32 {
        self.to_bits()
    }
}

impl Storage for half::f16 {
    const DTYPE: DType = DType::F16;
    const SUFFIX: &'static str = "f16";
    // Exponent all ones, quiet bit (0x0200) clear, payload 0x15e.
    const SENTINEL_BITS: u32 = 0x7d5e;
    fn from_f32(x: f32) -> half::f16 {
        half::f16::from_f32(x)
    }
    fn to_f32(self) -> f32 {
        half::f16::to_f32(self)
    }
    fn bits(self) -> u32 {
        self.to_bits() as u32
    }
}

impl Storage for half::bf16 {
    const DTYPE: DType = DType::BF16;
    const SUFFIX: &'static str = "bf16";
    // Exponent all ones, quiet bit (0x0040) clear, payload 0x15.
    const SENTINEL_BITS: u32 = 0x7f95;
    fn from_f32(x: f32) -> half::bf16 {
        half::bf16::from_f32(x)
    }
    fn to_f32(self) -> f32 {
        half::bf16::to_f32(self)
    }
    fn bits(self) -> u32 {
        self.to_bits() as u32
    }
}

/// The value a sentinel's bits decode to (for messages).
pub fn decode<S: Storage>(bits: u32) -> f32 {
    match S::DTYPE {
        DType::F32 => f32::from_bits(bits),
        DType::F16 => half::f16::from_bits(bits as u16).to_f32(),
        DType::BF16 => half::bf16::from_bits(bits as u16).to_f32(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sentinel_is_a_signalling_nan<S: Storage>() {
        let v = decode::<S>(S::SENTINEL_BITS);
        assert!(v.is_nan(), "{}", S::SUFFIX);
        // Conversions never produce it: NaNs come out quiet.
        for x in [
            f32::NAN,
            -f32::NAN,
            f32::from_bits(0x7f80_0001),
            f32::from_bits(S::SENTINEL_BITS << 16),
        ] {
            assert_ne!(S::from_f32(x).bits(), S::SENTINEL_BITS, "{}: {x:?}", S::SUFFIX);
        }
        // Round trip of representable values, rounding of others.
        assert_eq!(S::from_f32(1.5).to_f32(), 1.5);
        assert_eq!(S::from_f32(-0.0).bits(), S::from_f32(-0.0).bits());
    }

    #[test]
    fn sentinels() {
        sentinel_is_a_signalling_nan::<f32>();
        sentinel_is_a_signalling_nan::<half::f16>();
        sentinel_is_a_signalling_nan::<half::bf16>();
        // The f32 sentinel is not the canonical quiet NaN the kernels compute.
        assert_ne!(<f32 as Storage>::SENTINEL_BITS, f32::NAN.to_bits());
    }

    #[test]
    fn rounding_is_nearest_even() {
        // 1 + 2^-8 is halfway between two bf16 values: ties to even (1.0).
        assert_eq!(half::bf16::from_f32(1.0 + 1.0 / 256.0).to_f32(), 1.0);
        assert_eq!(
            <half::bf16 as Storage>::from_f32(1.0 + 3.0 / 256.0).to_f32(),
            1.0 + 4.0 / 256.0
        );
        assert_eq!(<half::f16 as Storage>::from_f32(1.0 + 1.0 / 2048.0).to_f32(), 1.0);
    }
}
