//! The emulated kernels against the CPU engine (bitwise where the CUDA code
//! claims bitwise parity, within a derived bound where only the summation
//! order differs), at f32, f16 and bf16 storage; and planted kernel bugs,
//! each caught. This file holds the shared helpers and the emulator's own
//! guarantees (signatures, conversions, per-thread shared memory, argument
//! checks); the kernel families have a file each.

mod attention;
mod kernels;
mod parallel;
mod planted;
mod sampling_kernels;
mod vision_kernels;

use super::*;
use crate::engine::cpu::attention::{attend, AttnShape};
use crate::engine::cpu::mutants::Mutants;
use crate::engine::cpu::ops;
use crate::engine::cuda::storage::Storage;
use crate::engine::cuda::{compile, launch, reference};
use crate::sampling;
use half::{bf16, f16};

pub(super) const U: f64 = f32::EPSILON as f64 / 2.0; // unit roundoff of f32

/// Deterministic values in [-scale, scale).
pub(crate) fn data(n: usize, seed: u64, scale: f32) -> Vec<f32> {
    let mut s = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
        })
        .collect()
}

/// Values representable in storage S (what the device holds), widened.
pub(super) fn stored<S: Storage>(x: &[f32]) -> (Vec<S>, Vec<f32>) {
    let s: Vec<S> = x.iter().map(|&v| S::from_f32(v)).collect();
    let w = s.iter().map(|v| v.to_f32()).collect();
    (s, w)
}

pub(super) fn bits_eq<S: Storage>(a: &[S], b: &[S]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.bits() == y.bits())
}

/// Distance in units in the last place of S between two values of S.
pub(super) fn ulps<S: Storage>(a: S, b: S) -> u32 {
    let ord = |v: S| -> i64 {
        let (bits, sign) = match S::DTYPE {
            crate::tensor::DType::F32 => (v.bits() as i64, 1i64 << 31),
            _ => (v.bits() as i64, 1i64 << 15),
        };
        if bits & sign != 0 {
            -(bits & (sign - 1))
        } else {
            bits
        }
    };
    (ord(a) - ord(b)).unsigned_abs() as u32
}

pub(super) fn emu_kernel<S: Storage>(family: &str) -> String {
    format!("{family}_{}", S::SUFFIX)
}

#[test]
fn every_kernel_of_compile_rs_is_emulated_with_a_signature() {
    let names: HashMap<String, String> = kernel_names().into_iter().collect();
    for f in compile::FILES {
        for k in f.kernels {
            let sig = names
                .get(*k)
                .unwrap_or_else(|| panic!("{k} ({}) is not emulated", f.name));
            assert!(!sig.is_empty(), "{k}");
        }
    }
    assert_eq!(
        names["rmsnorm_bf16"],
        "*const bf16, *const bf16, *mut bf16, i32, f32, i32"
    );
    assert_eq!(
        names["attention_decode_f16"],
        "*const f16, *const f16, *const f16, *mut f32, *mut f32, *mut f16, i32, i32, i32, i32, i32, f32, i32, i32, *const f16"
    );
    assert_eq!(
        names["layernorm_f32"],
        "*const f32, *const f32, *const f32, *mut f32, i32, f64"
    );
    for v in [
        "planted_softmax_max",
        "planted_gqa_modulo",
        "planted_window_ignored",
        "planted_rope_pair",
        "planted_oob_store",
        "planted_deadlock",
        "planted_attention_causal_ignored",
        "planted_mrope_one_axis",
    ] {
        assert!(names.keys().any(|k| k.starts_with(&format!("{v}/"))), "{v}");
    }
}

#[test]
fn conversions_round_as_the_device() {
    // f16 -> f32: every f16, exactly as `half` (NaN: quiet, payload kept).
    for h in 0..=u16::MAX {
        let (e, r) = (emu_f16_to_f32(h), f16::from_bits(h).to_f32());
        assert!(e.to_bits() == r.to_bits(), "{h:#06x}: {e:e} vs {r:e}");
    }
    // f32 -> f16: round to nearest even; every exponent and sign with the
    // mantissa patterns around each rounding boundary, plus a stride over all.
    let check = |u: u32| {
        let x = f32::from_bits(u);
        let (e, r) = (emu_f32_to_f16(x), f16::from_f32(x).to_bits());
        if x.is_nan() {
            assert_eq!(e, 0x7fff, "{u:#010x}: NaN is canonical on the device");
        } else {
            assert_eq!(e, r, "{u:#010x} ({x:e})");
        }
    };
    for hi in 0..(1u32 << 19) {
        for lo in [0u32, 1, 0xfff, 0x1000, 0x1001, 0x1fff] {
            check(hi << 13 | lo);
        }
    }
    for u in (0..=u32::MAX).step_by(997) {
        check(u);
    }
}

#[test]
fn launches_on_parallel_threads_have_their_own_shared_memory() {
    // rmsnorm's __shared__ scratch is per block: 4 threads launching at once
    // must each get the single-threaded result.
    let (rows, width) = (16, 256);
    let x = data(rows * width, 20, 1.0);
    let w = data(width, 21, 1.0);
    let one = || {
        let emu = Emu::new();
        let (xb, wb, ob) = (
            emu.upload("x", &x),
            emu.upload("w", &w),
            emu.alloc::<f32>("out", rows * width),
        );
        for _ in 0..10 {
            emu.launch(
                "rmsnorm_f32",
                launch::per_row(rows, width).into(),
                &[
                    xb.arg(),
                    wb.arg(),
                    ob.arg(),
                    (width as i32).into(),
                    1e-5f32.into(),
                    0i32.into(),
                ],
            )
            .unwrap();
        }
        ob.to_vec()
    };
    let want = one();
    let got: Vec<Vec<f32>> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..4).map(|_| s.spawn(one)).collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for g in got {
        assert!(g.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()));
    }
}

#[test]
fn arguments_are_checked_against_the_signature() {
    let emu = Emu::new();
    let (x, o) = (emu.alloc::<f32>("x", 4), emu.alloc::<f16>("o", 4));
    let e = emu
        .launch(
            "add_f32",
            launch::elementwise(4).into(),
            &[x.arg(), x.arg(), o.arg(), 4i64.into()],
        )
        .unwrap_err();
    assert!(
        e.to_string()
            .contains("argument 2 is a f16 buffer, declared `*mut f32`"),
        "{e}"
    );
    let e = emu
        .launch(
            "add_f32",
            launch::elementwise(4).into(),
            &[x.arg(), x.arg(), x.arg(), 4i32.into()],
        )
        .unwrap_err();
    assert!(e.to_string().contains("argument 3 is i32, declared `i64`"), "{e}");
    assert!(matches!(
        emu.launch("nope", launch::argmax().into(), &[]),
        Err(EmuError::UnknownKernel(_))
    ));
}
