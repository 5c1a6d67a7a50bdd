//! The emulated device behind the seam: the host GEMM against the CPU
//! engine's `Linear::forward` at each storage type (through the seam, with
//! the cuBLAS arguments `launch::linear_gemm` gives, views at offsets as the
//! tied head and the last-row logits use), and the copies and views the
//! engine relies on.

use super::*;
use crate::engine::cpu::layers::Linear;
use crate::engine::cuda::launch;
use half::{bf16, f16};

use crate::engine::cuda::emu::tests::data;

/// `y = x·wᵀ` through `Dev::gemm` on the emulated device, x read from a view
/// starting `pad` elements into its buffer (as `ov.slice(..)` in the engine).
fn emulated_linear<T: Storage>(x: &[T], rows: usize, w: &[T], in_f: usize, out_f: usize, pad: usize) -> Vec<T>
where
    CudaBlas: Gemm<T>,
{
    let dev = Dev::emu();
    let mut xs = vec![T::from_f32(7.0); pad];
    xs.extend_from_slice(x);
    let xb = dev.upload("x", &xs).unwrap();
    let wb = dev.upload("w", w).unwrap();
    // y between two sentinel elements: the GEMM writes exactly rows·out.
    let mut yb = dev.upload("y", &vec![T::from_f32(-5.0); rows * out_f + 2]).unwrap();
    let g = launch::linear_gemm(rows, in_f, out_f);
    dev.gemm(g, wb.view(..), xb.view(pad..), &mut yb.view_mut(1..1 + rows * out_f))
        .unwrap();
    let y = dev.download(yb.view(..)).unwrap();
    assert_eq!(y[0].to_f32(), -5.0, "written before y");
    assert_eq!(y[rows * out_f + 1].to_f32(), -5.0, "written past y");
    y[1..1 + rows * out_f].to_vec()
}

fn gemm_matches_linear_forward<T: Storage>()
where
    CudaBlas: Gemm<T>,
{
    // (rows, in, out): a decode row, a prefill, non-square and odd shapes, and
    // one above the CPU engine's 1M multiply-add threshold (its threaded path).
    for (i, &(rows, in_f, out_f)) in [(1, 64, 96), (6, 64, 96), (5, 37, 11), (3, 640, 600), (7, 128, 1)]
        .iter()
        .enumerate()
    {
        let xs: Vec<T> = data(rows * in_f, 10 + i as u64, 1.0)
            .into_iter()
            .map(T::from_f32)
            .collect();
        let ws: Vec<T> = data(out_f * in_f, 20 + i as u64, 0.5)
            .into_iter()
            .map(T::from_f32)
            .collect();
        let lin = Linear {
            w: crate::tensor::Tensor::new(vec![out_f, in_f], ws.iter().map(|v| v.to_f32()).collect()),
            bias: None,
            out_f,
            in_f,
            q8_block: None,
        };
        let xw: Vec<f32> = xs.iter().map(|v| v.to_f32()).collect();
        let want = lin.forward(&xw, rows, T::DTYPE);
        for pad in [0, 3] {
            let got = emulated_linear(&xs, rows, &ws, in_f, out_f, pad);
            assert_eq!(got.len(), want.len());
            // Both are f32 sums of the same products rounded once to T: equal up
            // to the summation order of two GEMM layouts, i.e. a few f32 ulps of
            // the dot product (the bound below), then one rounding to T.
            for (j, (g, w)) in got.iter().zip(&want).enumerate() {
                let (r, o) = (j / out_f, j % out_f);
                let abs: f32 = (0..in_f)
                    .map(|p| (xw[r * in_f + p] * lin.w.data()[o * in_f + p]).abs())
                    .sum();
                let f32_bound = in_f as f32 * f32::EPSILON * abs;
                let t_ulp = match T::DTYPE {
                    crate::tensor::DType::F32 => 0.0,
                    crate::tensor::DType::F16 => w.abs().max(6.1e-5) * 2f32.powi(-10),
                    crate::tensor::DType::BF16 => w.abs() * 2f32.powi(-7),
                };
                let err = (g.to_f32() - w).abs();
                assert!(
                    err <= f32_bound + t_ulp,
                    "{} shape ({rows},{in_f},{out_f}) pad {pad}: y[{r},{o}] = {} emulated, {w} CPU (bound {})",
                    T::SUFFIX,
                    g.to_f32(),
                    f32_bound + t_ulp
                );
            }
        }
    }
}

#[test]
fn emulated_gemm_matches_cpu_linear_f32() {
    gemm_matches_linear_forward::<f32>();
}

#[test]
fn emulated_gemm_matches_cpu_linear_f16() {
    gemm_matches_linear_forward::<f16>();
}

#[test]
fn emulated_gemm_matches_cpu_linear_bf16() {
    gemm_matches_linear_forward::<bf16>();
}

/// A layout mistake (w read untransposed, or the leading dimension of x
/// wrong) is not within the bound: the check above can fail.
#[test]
fn emulated_gemm_sees_a_transposed_layout() {
    let (rows, in_f, out_f) = (4, 8, 8);
    let x = data(rows * in_f, 1, 1.0);
    let w = data(out_f * in_f, 2, 1.0);
    let good = emu_gemm::<f32>(launch::linear_gemm(rows, in_f, out_f), &w, &x);
    let bad = emu_gemm::<f32>(
        GemmShape {
            transa: false,
            ..launch::linear_gemm(rows, in_f, out_f)
        },
        &w,
        &x,
    );
    let want = Linear {
        w: crate::tensor::Tensor::new(vec![out_f, in_f], w.clone()),
        bias: None,
        out_f,
        in_f,
        q8_block: None,
    }
    .forward(&x, rows, crate::tensor::DType::F32);
    let max = |a: &[f32]| a.iter().zip(&want).map(|(p, q)| (p - q).abs()).fold(0.0f32, f32::max);
    assert!(max(&good) < 1e-5, "{}", max(&good));
    assert!(max(&bad) > 0.1, "{}", max(&bad));
}

#[test]
fn copies_and_windows() {
    let dev = Dev::emu();
    let src = dev.upload("src", &[1.0f32, 2.0, 3.0, 4.0, 5.0]).unwrap();
    let mut dst = dev.alloc_zeros::<f32>("dst", 8).unwrap();
    dev.copy(src.view(1..4), &mut dst.view_mut(5..8)).unwrap();
    assert_eq!(
        dev.download(dst.view(..)).unwrap(),
        [0.0, 0.0, 0.0, 0.0, 0.0, 2.0, 3.0, 4.0]
    );
    let v = src.view(1..).slice(2..3);
    assert_eq!(dev.download(v).unwrap(), [4.0]);
    assert_eq!(dev.engine_name(), "cuda-emu");
    let live = dev.memory_in_use().unwrap();
    assert_eq!(live, (5 + 8) * 4);
    drop(dst);
    assert_eq!(dev.memory_in_use().unwrap(), 5 * 4);
}

/// A launch through the seam reaches the emulated kernel with the arguments
/// converted (scalars, pointers, NULL) and the kernel's signature checked.
#[test]
fn launch_through_the_seam_checks_the_signature() {
    let dev = Dev::emu();
    let k = dev.kernel("add_f32").unwrap();
    let a = dev.upload("a", &[1.0f32, 2.0, 3.0]).unwrap();
    let b = dev.upload("b", &[10.0f32, 20.0, 30.0]).unwrap();
    let mut c = dev.alloc::<f32>("c", 3).unwrap();
    // SAFETY: add_f32(a, b, out, n), all 3 long.
    unsafe {
        dev.launch(
            &k,
            launch::elementwise(3),
            &mut [a.arg(), b.arg(), c.arg_mut(), 3i64.into()],
        )
    }
    .unwrap();
    assert_eq!(dev.download(c.view(..)).unwrap(), [11.0, 22.0, 33.0]);
    // n as i32 where the kernel declares a 64-bit count: refused before running.
    let e = unsafe {
        dev.launch(
            &k,
            launch::elementwise(3),
            &mut [a.arg(), b.arg(), c.arg_mut(), 3i32.into()],
        )
    }
    .unwrap_err()
    .to_string();
    assert!(e.contains("add_f32") && e.contains("argument 3"), "{e}");
    assert!(dev.kernel("no_such_kernel").is_err());
}
