//! cuBLAS on the emulated device: the host GEMM `Dev::Emu` serves the
//! engine's matrix products with, taking the very operand layouts, transposes
//! and leading dimensions of the cuBLAS call, so a wrong layout fails on the
//! emulator exactly as it would on a GPU.

use super::super::launch::GemmShape;
use super::super::storage::Storage;

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
    assert!(
        a.len() >= extent(g.m, g.k, rsa, csa),
        "emu_gemm: A holds {} elements, op(A) needs more",
        a.len()
    );
    assert!(
        b.len() >= extent(g.k, g.n, rsb, csb),
        "emu_gemm: B holds {} elements, op(B) needs more",
        b.len()
    );
    let widen = |v: &[T]| -> Vec<f32> { v.iter().map(|x| x.to_f32()).collect() };
    let (a, b) = (widen(a), widen(b));
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
    c.iter().map(|&x| T::from_f32(x)).collect()
}
