//! `y = x·wᵀ`, the one product every projection of the CPU engine goes through,
//! as register-tiled dot products (the scheme of llamafile's tinyBLAS).
//!
//! Why hand-written rather than a GEMM crate: every element of `y` must be the
//! same bits whether its row is computed alone (a decode step) or inside a
//! batch (the prefill, a full recompute for the KV-cache check), on any number
//! of threads. `matrixmultiply` and `gemm` choose packing and micro-kernels by
//! shape, so a row's summation order depends on `m`; and for one row they
//! still pack the whole weight matrix on every call, which made decode 8×
//! slower than reading the weights once (issue 14). A dot-product kernel reads
//! each weight row straight from its (memory-mapped) place, once per row tile
//! of `x`, so decode streams the weights at memory speed. `ci/bench.sh` and
//! the `gemm-candidates` bench crate compare it with both crates.
//!
//! The summation order of one element, `dot(x_i, w_j)` over `k` (the
//! definition every code path below computes exactly):
//! 1. 16 lanes, each starting at +0; chunk `c` adds `x[16c+l]·w[16c+l]` to lane
//!    `l` with one fused multiply-add; the last chunk is zero-padded.
//! 2. the lanes are folded pairwise: `l + (l+8)`, then `+4`, `+2`, `+1`.
//!
//! The AVX-512 path holds the 16 lanes in one register, the AVX2 path in two,
//! the portable path in an array (`f32::mul_add` is the same correctly
//! rounded FMA), so every path gives identical bits.

use rayon::prelude::*;

/// Lanes of the canonical dot product (one AVX-512 register of f32).
const LANES: usize = 16;

/// The fewest weight rows per rayon task: small enough that the k/v
/// projections of a 0.5B model (128 rows) still split over two cores.
const MIN_COLS_PER_TASK: usize = 32;
/// Tasks per thread for a large `n` (the LM head): enough to balance load,
/// few enough that scheduling is noise. The split never changes a result.
const TASKS_PER_THREAD: usize = 8;

/// `y[m,n] = x[m,k] · wᵀ`, `w` `[n,k]` row-major (HF `Linear` layout).
pub fn matmul_wt(x: &[f32], m: usize, k: usize, w: &[f32], n: usize) -> Vec<f32> {
    matmul_wt_many(x, m, k, &[(w, n)]).pop().expect("one product")
}

/// `x · wᵀ` for several weight matrices at once (q, k, v; gate, up), each
/// `(w [n,k], n)`: one parallel loop over the column blocks of all of them, so
/// a decode step waits for its threads once per group instead of once per
/// matrix (each wait is a wake-up of a sleeping worker). Every element is the
/// same bits as `matmul_wt` gives it alone.
pub fn matmul_wt_many(x: &[f32], m: usize, k: usize, ws: &[(&[f32], usize)]) -> Vec<Vec<f32>> {
    assert_eq!(x.len(), m * k, "matmul_wt: x is not [m,k]");
    let mut ys: Vec<Vec<f32>> = ws
        .iter()
        .map(|&(w, n)| {
            assert_eq!(w.len(), n * k, "matmul_wt: w is not [n,k]");
            vec![0.0f32; m * n]
        })
        .collect();
    let total: usize = ws.iter().map(|&(_, n)| n).sum();
    if m == 0 || total == 0 {
        return ys;
    }
    let kernel = Kernel::detect();
    let per_task = (total / (rayon::current_num_threads() * TASKS_PER_THREAD))
        .max(MIN_COLS_PER_TASK)
        .next_multiple_of(RN_WIDE);
    // (matrix, first column, end column) of every task, in order.
    let tasks: Vec<(usize, usize, usize)> = ws
        .iter()
        .enumerate()
        .flat_map(|(i, &(_, n))| (0..n.div_ceil(per_task)).map(move |b| (i, b * per_task, ((b + 1) * per_task).min(n))))
        .collect();
    let outs: Vec<SendPtr> = ys.iter_mut().map(|y| SendPtr(y.as_mut_ptr())).collect();
    let task = |&(i, j0, j1): &(usize, usize, usize)| {
        let (w, n) = ws[i];
        // SAFETY: each task writes only columns j0..j1 of every row of its
        // matrix's output (disjoint across tasks); the outputs outlive the loop.
        unsafe { columns(kernel, x, m, k, w, n, j0, j1, &outs[i]) };
    };
    // Below ~256K multiply-adds handing work to another thread costs more
    // than it saves; the result is the same bits either way.
    if m * total * k < (1 << 18) || tasks.len() == 1 {
        tasks.iter().for_each(task);
    } else {
        tasks.par_iter().for_each(task);
    }
    ys
}

/// A raw output pointer shared by tasks writing disjoint columns.
struct SendPtr(*mut f32);
// SAFETY: only used by `matmul_wt_many`, whose tasks write disjoint columns.
unsafe impl Sync for SendPtr {}
unsafe impl Send for SendPtr {}

/// Which implementation of the canonical dot product this CPU runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kernel {
    Avx512,
    Avx2,
    Portable,
}

impl Kernel {
    /// The fastest the CPU supports (detected once by std, then cached).
    pub fn detect() -> Kernel {
        #[cfg(target_arch = "x86_64")]
        {
            if is_x86_feature_detected!("avx512f") {
                return Kernel::Avx512;
            }
            if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
                return Kernel::Avx2;
            }
        }
        Kernel::Portable
    }
}

/// Columns `j0..j1` of `y`: weight-row tiles in the outer loop, so each tile
/// of `w` is read from memory once and meets every row tile of `x` while it is
/// in cache (x itself, at most a prefill's rows, stays in L2).
///
/// SAFETY: `out` points at `y` `[m,n]`; the caller gives disjoint column ranges
/// to concurrent calls.
#[allow(clippy::too_many_arguments)]
unsafe fn columns(
    kernel: Kernel,
    x: &[f32],
    m: usize,
    k: usize,
    w: &[f32],
    n: usize,
    j0: usize,
    j1: usize,
    out: &SendPtr,
) {
    // One or two rows (decode) are bound by reading the weights: 8 weight rows
    // per tile keep more loads in flight; a batch reuses each weight vector
    // over 4 rows of x instead.
    let wide = m <= 2;
    let rn_max = if wide { RN_WIDE } else { RN };
    let mut j = j0;
    while j < j1 {
        let rn = (j1 - j).min(rn_max);
        let mut i = 0;
        while i < m {
            let rm = (m - i).min(RM);
            let mut tile = [[0.0f32; RN_WIDE]; RM];
            // The first row tile to meet these weight rows asks for the next
            // weight tile: rows of w are short (896 values) and a tile reads
            // several at once, too many short streams for the hardware
            // prefetcher to pick up (measured: 0.67× → 0.98× of `gemm`'s
            // one-stream GEMV at the 0.5B model's 896-wide rows).
            let pf = if i == 0 { rn * k } else { 0 };
            tile_dispatch(
                kernel,
                &x[i * k..(i + rm) * k],
                rm,
                &w[j * k..(j + rn) * k],
                rn,
                k,
                pf,
                &mut tile,
            );
            for (r, row) in tile.iter().enumerate().take(rm) {
                for (c, &v) in row.iter().enumerate().take(rn) {
                    *out.0.add((i + r) * n + j + c) = v;
                }
            }
            i += rm;
        }
        j += rn;
    }
}

/// Rows of `x` and of `w` per register tile: 4×4 = 16 accumulators (of 32
/// AVX-512 registers), each weight vector loaded once per 4 rows of `x`.
const RM: usize = 4;
const RN: usize = 4;
/// Weight rows per tile when `x` has one or two rows.
const RN_WIDE: usize = 8;

/// One tile with the tile size as constants, so the inner loops unroll and
/// the accumulators live in registers.
/// `pf`: prefetch the weights this many values past the ones being read (0:
/// none); a hint only, never a read, so it may point past the matrix.
#[allow(clippy::too_many_arguments)]
fn tile_dispatch(
    kernel: Kernel,
    x: &[f32],
    rm: usize,
    w: &[f32],
    rn: usize,
    k: usize,
    pf: usize,
    out: &mut [[f32; RN_WIDE]; RM],
) {
    macro_rules! go {
        ($m:literal, $n:literal) => {{
            let xs: [&[f32]; $m] = std::array::from_fn(|r| &x[r * k..(r + 1) * k]);
            let ws: [&[f32]; $n] = std::array::from_fn(|c| &w[c * k..(c + 1) * k]);
            let t = tile::<$m, $n>(kernel, xs, ws, k, pf);
            for r in 0..$m {
                out[r][..$n].copy_from_slice(&t[r]);
            }
        }};
    }
    match (rm, rn) {
        (1, 8) => go!(1, 8),
        (2, 8) => go!(2, 8),
        (1, 5..=7) | (2, 5..=7) => {
            // The remainder of a wide tile: as 4 + the rest.
            tile_dispatch(kernel, x, rm, &w[..4 * k], 4, k, pf, out);
            let mut rest = [[0.0f32; RN_WIDE]; RM];
            tile_dispatch(kernel, x, rm, &w[4 * k..], rn - 4, k, pf, &mut rest);
            for r in 0..rm {
                out[r][4..rn].copy_from_slice(&rest[r][..rn - 4]);
            }
        }
        (4, 4) => go!(4, 4),
        (4, 3) => go!(4, 3),
        (4, 2) => go!(4, 2),
        (4, 1) => go!(4, 1),
        (3, 4) => go!(3, 4),
        (3, 3) => go!(3, 3),
        (3, 2) => go!(3, 2),
        (3, 1) => go!(3, 1),
        (2, 4) => go!(2, 4),
        (2, 3) => go!(2, 3),
        (2, 2) => go!(2, 2),
        (2, 1) => go!(2, 1),
        (1, 4) => go!(1, 4),
        (1, 3) => go!(1, 3),
        (1, 2) => go!(1, 2),
        (1, 1) => go!(1, 1),
        _ => unreachable!("tiles are at most {RM}×{RN} or 2×{RN_WIDE}"),
    }
}

/// `t[r][c] = dot(xs[r], ws[c])` in the canonical order, every slice `k` long.
fn tile<const M: usize, const N: usize>(
    kernel: Kernel,
    xs: [&[f32]; M],
    ws: [&[f32]; N],
    k: usize,
    pf: usize,
) -> [[f32; N]; M] {
    match kernel {
        // SAFETY: `Kernel::detect` found the features these functions enable.
        #[cfg(target_arch = "x86_64")]
        Kernel::Avx512 => unsafe { x86::tile_avx512::<M, N>(xs, ws, k, pf) },
        #[cfg(target_arch = "x86_64")]
        Kernel::Avx2 => unsafe { x86::tile_avx2::<M, N>(xs, ws, k, pf) },
        _ => tile_portable::<M, N>(xs, ws, k),
    }
}

/// The canonical order spelled out: the definition the SIMD paths must equal.
pub fn tile_portable<const M: usize, const N: usize>(xs: [&[f32]; M], ws: [&[f32]; N], k: usize) -> [[f32; N]; M] {
    let mut out = [[0.0f32; N]; M];
    for (r, x) in xs.iter().enumerate() {
        for (c, w) in ws.iter().enumerate() {
            out[r][c] = dot_portable(&x[..k], &w[..k]);
        }
    }
    out
}

/// One element in the canonical order.
pub fn dot_portable(x: &[f32], w: &[f32]) -> f32 {
    let mut acc = [0.0f32; LANES];
    let chunks = x.len().div_ceil(LANES);
    for c in 0..chunks {
        for (l, a) in acc.iter_mut().enumerate() {
            let i = c * LANES + l;
            // The zero padding of the last chunk: fma(0, 0, a) as the SIMD
            // paths' masked loads do (it turns a -0 lane into +0).
            let (xv, wv) = if i < x.len() { (x[i], w[i]) } else { (0.0, 0.0) };
            *a = xv.mul_add(wv, *a);
        }
    }
    fold16(acc)
}

/// Lanes `l + (l+8)`, then `+4`, `+2`, `+1`.
fn fold16(mut a: [f32; LANES]) -> f32 {
    let mut half = LANES / 2;
    while half > 0 {
        for l in 0..half {
            a[l] += a[l + half];
        }
        half /= 2;
    }
    a[0]
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::LANES;

    /// Lanes 0..r of a 16-lane mask (the zero-padded last chunk).
    fn tail_mask(r: usize) -> u16 {
        ((1u32 << r) - 1) as u16
    }

    // No closures below: a closure inside a `target_feature` function is not
    // guaranteed to get the feature, and an intrinsic that is not inlined is a
    // call per vector.

    #[target_feature(enable = "avx512f")]
    pub unsafe fn tile_avx512<const M: usize, const N: usize>(
        xs: [&[f32]; M],
        ws: [&[f32]; N],
        k: usize,
        pf: usize,
    ) -> [[f32; N]; M] {
        let mut acc = [[_mm512_setzero_ps(); N]; M];
        let mut wv = [_mm512_setzero_ps(); N];
        let full = k / LANES;
        for c in 0..full {
            let o = c * LANES;
            if pf > 0 {
                for w in ws {
                    _mm_prefetch::<_MM_HINT_T1>(w.as_ptr().wrapping_add(o + pf).cast());
                }
            }
            for j in 0..N {
                wv[j] = _mm512_loadu_ps(ws[j].as_ptr().add(o));
            }
            for i in 0..M {
                let xv = _mm512_loadu_ps(xs[i].as_ptr().add(o));
                for j in 0..N {
                    acc[i][j] = _mm512_fmadd_ps(xv, wv[j], acc[i][j]);
                }
            }
        }
        let r = k - full * LANES;
        if r > 0 {
            let o = full * LANES;
            let mask = tail_mask(r);
            for j in 0..N {
                wv[j] = _mm512_maskz_loadu_ps(mask, ws[j].as_ptr().add(o));
            }
            for i in 0..M {
                let xv = _mm512_maskz_loadu_ps(mask, xs[i].as_ptr().add(o));
                for j in 0..N {
                    acc[i][j] = _mm512_fmadd_ps(xv, wv[j], acc[i][j]);
                }
            }
        }
        let mut out = [[0.0f32; N]; M];
        for i in 0..M {
            for j in 0..N {
                let a = acc[i][j];
                let lo = _mm512_castps512_ps256(a);
                let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1));
                out[i][j] = fold8(_mm256_add_ps(lo, hi));
            }
        }
        out
    }

    /// The same order with the 16 lanes in two AVX2 registers (lanes 0..8 and
    /// 8..16), so the first fold is the sum of the two.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn tile_avx2<const M: usize, const N: usize>(
        xs: [&[f32]; M],
        ws: [&[f32]; N],
        k: usize,
        pf: usize,
    ) -> [[f32; N]; M] {
        let mut acc = [[[_mm256_setzero_ps(); N]; M]; 2];
        let mut wv = [_mm256_setzero_ps(); N];
        let full = k / LANES;
        for c in 0..full {
            if pf > 0 {
                for w in ws {
                    _mm_prefetch::<_MM_HINT_T1>(w.as_ptr().wrapping_add(c * LANES + pf).cast());
                }
            }
            for (half, acc) in acc.iter_mut().enumerate() {
                let o = c * LANES + 8 * half;
                for j in 0..N {
                    wv[j] = _mm256_loadu_ps(ws[j].as_ptr().add(o));
                }
                for i in 0..M {
                    let xv = _mm256_loadu_ps(xs[i].as_ptr().add(o));
                    for j in 0..N {
                        acc[i][j] = _mm256_fmadd_ps(xv, wv[j], acc[i][j]);
                    }
                }
            }
        }
        let r = k - full * LANES;
        if r > 0 {
            // The zero-padded last chunk, through a small buffer per row.
            let o = full * LANES;
            let mut buf = [0.0f32; LANES];
            let mut wpad = [[0.0f32; LANES]; N];
            for j in 0..N {
                wpad[j][..r].copy_from_slice(&ws[j][o..k]);
            }
            for i in 0..M {
                buf[..r].copy_from_slice(&xs[i][o..k]);
                for (half, acc) in acc.iter_mut().enumerate() {
                    let xv = _mm256_loadu_ps(buf.as_ptr().add(8 * half));
                    for j in 0..N {
                        let w = _mm256_loadu_ps(wpad[j].as_ptr().add(8 * half));
                        acc[i][j] = _mm256_fmadd_ps(xv, w, acc[i][j]);
                    }
                }
            }
        }
        let mut out = [[0.0f32; N]; M];
        for i in 0..M {
            for j in 0..N {
                out[i][j] = fold8(_mm256_add_ps(acc[0][i][j], acc[1][i][j]));
            }
        }
        out
    }

    /// Lanes `l + (l+4)`, `+2`, `+1` of 8 (the last three folds of `fold16`).
    #[target_feature(enable = "avx")]
    unsafe fn fold8(v: __m256) -> f32 {
        let a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        let b = _mm_add_ps(a, _mm_movehl_ps(a, a));
        let c = _mm_add_ss(b, _mm_shuffle_ps(b, b, 1));
        _mm_cvtss_f32(c)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn data(len: usize, seed: u64) -> Vec<f32> {
        let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        (0..len)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                ((s >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 2.0
            })
            .collect()
    }

    #[test]
    fn every_path_gives_the_canonical_bits() {
        // Lengths around the lane width and the tail, and the model widths.
        for k in [1, 7, 15, 16, 17, 31, 33, 64, 100, 896] {
            let x = data(4 * k, k as u64);
            let w = data(4 * k, 1000 + k as u64);
            let xs: [&[f32]; 4] = std::array::from_fn(|r| &x[r * k..(r + 1) * k]);
            let ws: [&[f32]; 4] = std::array::from_fn(|c| &w[c * k..(c + 1) * k]);
            let want = tile_portable::<4, 4>(xs, ws, k);
            let mut kernels = vec![Kernel::Portable];
            #[cfg(target_arch = "x86_64")]
            {
                if is_x86_feature_detected!("avx512f") {
                    kernels.push(Kernel::Avx512);
                }
                if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
                    kernels.push(Kernel::Avx2);
                }
            }
            let w8 = data(8 * k, 2000 + k as u64);
            let ws8: [&[f32]; 8] = std::array::from_fn(|c| &w8[c * k..(c + 1) * k]);
            let want8 = tile_portable::<1, 8>([xs[0]], ws8, k);
            for kern in kernels {
                let got = tile::<4, 4>(kern, xs, ws, k, 4 * k);
                for r in 0..4 {
                    for c in 0..4 {
                        assert_eq!(got[r][c].to_bits(), want[r][c].to_bits(), "{kern:?} k={k} [{r}][{c}]");
                    }
                }
                let got8 = tile::<1, 8>(kern, [xs[0]], ws8, k, 0);
                assert_eq!(
                    got8[0].map(f32::to_bits),
                    want8[0].map(f32::to_bits),
                    "{kern:?} k={k} wide"
                );
            }
        }
    }

    #[test]
    fn the_canonical_order_is_the_documented_one() {
        // 20 values: chunk 0 fills lanes 0..16, chunk 1 lanes 0..4 (zero-padded).
        let x: Vec<f32> = (0..20).map(|i| 1.0 + i as f32 * 2f32.powi(-20)).collect();
        let w = vec![1.0f32; 20];
        let mut lanes = [0.0f32; 16];
        for (i, v) in x.iter().enumerate() {
            lanes[i % 16] += v;
        }
        let mut a = lanes;
        for half in [8, 4, 2, 1] {
            for l in 0..half {
                a[l] += a[l + half];
            }
        }
        assert_eq!(dot_portable(&x, &w).to_bits(), a[0].to_bits());
    }

    #[test]
    fn matmul_matches_f64_and_a_row_alone_equals_that_row_in_a_batch() {
        for &(m, k, n) in &[(3, 700, 600), (32, 896, 130), (5, 37, 11), (1, 4864, 70), (7, 1, 3)] {
            let x = data(m * k, 1 + m as u64);
            let w = data(n * k, 2 + n as u64);
            let y = matmul_wt(&x, m, k, &w, n);
            for i in 0..m {
                for j in 0..n {
                    let want: f64 = (0..k).map(|p| x[i * k + p] as f64 * w[j * k + p] as f64).sum();
                    let mag: f64 = (0..k).map(|p| (x[i * k + p] as f64 * w[j * k + p] as f64).abs()).sum();
                    // f32 summation over k/16 + 4 terms per element.
                    let bound = mag * f32::EPSILON as f64 * ((k / LANES) as f64 + 5.0);
                    assert!((y[i * n + j] as f64 - want).abs() <= bound, "({m},{k},{n}) [{i},{j}]");
                }
            }
            // Every row alone, and a two-row slice, give the batch's bits.
            for i in 0..m {
                let y1 = matmul_wt(&x[i * k..(i + 1) * k], 1, k, &w, n);
                assert_eq!(bits(&y1), bits(&y[i * n..(i + 1) * n]), "({m},{k},{n}) row {i}");
            }
            if m >= 3 {
                let y2 = matmul_wt(&x[k..3 * k], 2, k, &w, n);
                assert_eq!(bits(&y2), bits(&y[n..3 * n]));
            }
        }
    }

    #[test]
    fn several_matrices_at_once_give_each_one_s_bits() {
        let (m, k) = (3, 200);
        let x = data(m * k, 11);
        let (wa, wb, wc) = (data(500 * k, 12), data(7 * k, 13), data(64 * k, 14));
        let many = matmul_wt_many(&x, m, k, &[(&wa, 500), (&wb, 7), (&wc, 64)]);
        assert_eq!(bits(&many[0]), bits(&matmul_wt(&x, m, k, &wa, 500)));
        assert_eq!(bits(&many[1]), bits(&matmul_wt(&x, m, k, &wb, 7)));
        assert_eq!(bits(&many[2]), bits(&matmul_wt(&x, m, k, &wc, 64)));
    }

    #[test]
    fn the_thread_count_does_not_change_a_bit() {
        let (m, k, n) = (9, 300, 500);
        let x = data(m * k, 5);
        let w = data(n * k, 6);
        let one = rayon::ThreadPoolBuilder::new().num_threads(1).build().unwrap();
        let three = rayon::ThreadPoolBuilder::new().num_threads(3).build().unwrap();
        let a = one.install(|| matmul_wt(&x, m, k, &w, n));
        let b = three.install(|| matmul_wt(&x, m, k, &w, n));
        assert_eq!(bits(&a), bits(&b));
    }

    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|x| x.to_bits()).collect()
    }
}
