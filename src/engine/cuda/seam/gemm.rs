//! cuBLAS on the emulated device: the host GEMM `Dev::Emu` serves the
//! engine's matrix products with, taking the very operand layouts, transposes
//! and leading dimensions of the cuBLAS call, so a wrong layout fails on the
//! emulator exactly as it would on a GPU.
//!
//! Why the CPU engine's `matmul_wt` for the engine's own shape (`y = x·wᵀ`,
//! `launch::linear_gemm`): it reads the weights where they lie, once per row
//! tile, where a general GEMM packs the whole weight matrix on every call —
//! a decode step (one row) then cost a full copy of every weight, and the
//! emulated engine spent most of its time packing (issue 23). Any other
//! layout (a transposed mistake, the tests' variants) takes the general
//! strided GEMM, so a wrong layout is still computed as cuBLAS would.

use std::any::TypeId;
use std::borrow::Cow;

use super::super::launch::GemmShape;
use super::super::storage::Storage;
use crate::engine::cpu::matmul::matmul_wt;

/// `v` as f32: borrowed when `T` is f32 (the weights read in place), widened otherwise.
pub fn as_f32<T: Storage>(v: &[T]) -> Cow<'_, [f32]> {
    if TypeId::of::<T>() == TypeId::of::<f32>() {
        // SAFETY: T is f32 (same type, so same size, alignment and bits).
        Cow::Borrowed(unsafe { std::slice::from_raw_parts(v.as_ptr() as *const f32, v.len()) })
    } else {
        Cow::Owned(v.iter().map(|x| x.to_f32()).collect())
    }
}

/// What cuBLAS computes for `g` (alpha 1, beta 0, column-major, CUBLAS_COMPUTE_32F):
/// `C[i + j·ldc] = Σ_p op(A)[i,p]·op(B)[p,j]` for i < m, j < n, with
/// `op(A)[i,p] = A[p + i·lda]` when transposed, `A[i + p·lda]` when not (B
/// likewise), products and sums in f32, each C element rounded once to `T`.
/// Returns C, `ldc·n` elements (the engine's calls have ldc = m: no row gap).
pub fn emu_gemm<T: Storage>(g: GemmShape, a: &[T], b: &[T]) -> Vec<T> {
    assert_eq!(g.ldc, g.m, "emu_gemm: ldc > m (a row gap) is not used by the engine");
    // Strides (row, column) of op(A) [m,k] and op(B) [k,n] in column-major storage.
    let (rsa, csa) = if g.transa { (g.lda, 1) } else { (1, g.lda) };
    let (rsb, csb) = if g.transb { (g.ldb, 1) } else { (1, g.ldb) };
    let extent = |rows: usize, cols: usize, rs: usize, cs: usize| {
        if rows == 0 || cols == 0 {
            0
        } else {
            (rows - 1) * rs + (cols - 1) * cs + 1
        }
    };
    let (ea, eb) = (extent(g.m, g.k, rsa, csa), extent(g.k, g.n, rsb, csb));
    assert!(
        a.len() >= ea,
        "emu_gemm: A holds {} elements, op(A) needs more",
        a.len()
    );
    assert!(
        b.len() >= eb,
        "emu_gemm: B holds {} elements, op(B) needs more",
        b.len()
    );
    // The engine's shape: A is w [m,k] row-major read transposed, B is x
    // [n,k] row-major, C is y [n,m] row-major: y = x·wᵀ.
    if g.transa && !g.transb && g.lda == g.k && g.ldb == g.k && g.k > 0 {
        let (w, x) = (as_f32(&a[..g.m * g.k]), as_f32(&b[..g.n * g.k]));
        let c = matmul_wt(&x, g.n, g.k, &w, g.m);
        return c.into_iter().map(T::from_f32).collect();
    }
    let (a, b) = (as_f32(&a[..ea]), as_f32(&b[..eb]));
    let mut c = vec![0.0f32; g.ldc * g.n];
    if g.m > 0 && g.n > 0 {
        // SAFETY: every index i·rs + p·cs stays inside A, B (asserted) and C (ldc·n).
        unsafe {
            matrixmultiply::sgemm(
                g.m,
                g.k,
                g.n,
                1.0,
                a.as_ptr(),
                rsa as isize,
                csa as isize,
                b.as_ptr(),
                rsb as isize,
                csb as isize,
                0.0,
                c.as_mut_ptr(),
                1,
                g.ldc as isize,
            );
        }
    }
    c.into_iter().map(T::from_f32).collect()
}
