//! f64 dot products of f32 vectors, for the `linear` check's recomputation:
//! each product of two f32s is exact in f64, and the sums are f64, so the
//! recomputed projection is off by a few f64 ulps, 2^-29 of the f32
//! roundings its allowance is made of. This is the check's whole cost (a
//! 0.5B model's LM head is 136M products per token row), so the sums keep
//! independent partial sums (a single running sum is bound by the add's
//! latency), in AVX2 where the CPU has it (`crate::isa`). The order of summation differs between the variants
//! by those f64 ulps only.

use crate::isa::Isa;

const LANES: usize = 8;

/// `(Σ w_j·x_j, Σ |w_j·x_j|)` in f64.
pub fn dot_and_abs(w: &[f32], x: &[f32]) -> (f64, f64) {
    debug_assert_eq!(w.len(), x.len());
    match Isa::best() {
        // SAFETY: `best` is one of `available`: the CPU has AVX2 (every
        // AVX-512 CPU `available` lists has it too).
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 | Isa::Avx2 => unsafe { avx2::dot_and_abs(w, x) },
        Isa::Baseline => dot_and_abs_lanes(w, x),
    }
}

/// `Σ |w_j|·v_j` in f64.
pub fn abs_dot(w: &[f32], v: &[f64]) -> f64 {
    debug_assert_eq!(w.len(), v.len());
    match Isa::best() {
        // SAFETY: as in `dot_and_abs`.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 | Isa::Avx2 => unsafe { avx2::abs_dot(w, v) },
        Isa::Baseline => abs_dot_lanes(w, v),
    }
}

/// `Σ w_j·v_j` in f64: a weight row times an f64 vector (an input's error,
/// the scaled policy's floor carries through a projection).
pub fn dot_f64(w: &[f32], v: &[f64]) -> f64 {
    debug_assert_eq!(w.len(), v.len());
    match Isa::best() {
        // SAFETY: as in `dot_and_abs`.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 | Isa::Avx2 => unsafe { avx2::dot_f64(w, v) },
        Isa::Baseline => dot_f64_lanes(w, v),
    }
}

/// The sums in AVX2 intrinsics: the compiler does not vectorise the lane
/// loops below (f32→f64 widening with two sums per product), and these are
/// the same operations, 4 f64 lanes at a time, two vectors in flight.
#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    #[target_feature(enable = "avx2,fma")]
    pub fn dot_and_abs(w: &[f32], x: &[f32]) -> (f64, f64) {
        let n = w.len().min(x.len());
        let full = n - n % 8;
        let sign = _mm256_set1_pd(-0.0);
        let (mut a0, mut a1, mut s0, mut s1) = (
            _mm256_setzero_pd(),
            _mm256_setzero_pd(),
            _mm256_setzero_pd(),
            _mm256_setzero_pd(),
        );
        let mut j = 0;
        while j < full {
            // SAFETY: j + 8 <= n, within both slices.
            let (wv, xv) = unsafe { (_mm256_loadu_ps(w.as_ptr().add(j)), _mm256_loadu_ps(x.as_ptr().add(j))) };
            let p0 = _mm256_mul_pd(
                _mm256_cvtps_pd(_mm256_castps256_ps128(wv)),
                _mm256_cvtps_pd(_mm256_castps256_ps128(xv)),
            );
            let p1 = _mm256_mul_pd(
                _mm256_cvtps_pd(_mm256_extractf128_ps::<1>(wv)),
                _mm256_cvtps_pd(_mm256_extractf128_ps::<1>(xv)),
            );
            a0 = _mm256_add_pd(a0, p0);
            a1 = _mm256_add_pd(a1, p1);
            s0 = _mm256_add_pd(s0, _mm256_andnot_pd(sign, p0));
            s1 = _mm256_add_pd(s1, _mm256_andnot_pd(sign, p1));
            j += 8;
        }
        let (mut a, mut s) = (hsum(_mm256_add_pd(a0, a1)), hsum(_mm256_add_pd(s0, s1)));
        for k in full..n {
            let p = w[k] as f64 * x[k] as f64;
            a += p;
            s += p.abs();
        }
        (a, s)
    }

    #[target_feature(enable = "avx2,fma")]
    pub fn abs_dot(w: &[f32], v: &[f64]) -> f64 {
        let n = w.len().min(v.len());
        let full = n - n % 4;
        let sign = _mm256_set1_pd(-0.0);
        let mut acc = _mm256_setzero_pd();
        let mut j = 0;
        while j < full {
            // SAFETY: j + 4 <= n, within both slices.
            let (wv, vv) = unsafe { (_mm_loadu_ps(w.as_ptr().add(j)), _mm256_loadu_pd(v.as_ptr().add(j))) };
            acc = _mm256_add_pd(acc, _mm256_mul_pd(_mm256_andnot_pd(sign, _mm256_cvtps_pd(wv)), vv));
            j += 4;
        }
        let mut a = hsum(acc);
        for k in full..n {
            a += (w[k] as f64).abs() * v[k];
        }
        a
    }

    #[target_feature(enable = "avx2,fma")]
    pub fn dot_f64(w: &[f32], v: &[f64]) -> f64 {
        let n = w.len().min(v.len());
        let full = n - n % 8;
        let (mut a0, mut a1) = (_mm256_setzero_pd(), _mm256_setzero_pd());
        let mut j = 0;
        while j < full {
            // SAFETY: j + 8 <= n, within both slices.
            let (w0, v0, w1, v1) = unsafe {
                (
                    _mm_loadu_ps(w.as_ptr().add(j)),
                    _mm256_loadu_pd(v.as_ptr().add(j)),
                    _mm_loadu_ps(w.as_ptr().add(j + 4)),
                    _mm256_loadu_pd(v.as_ptr().add(j + 4)),
                )
            };
            a0 = _mm256_add_pd(a0, _mm256_mul_pd(_mm256_cvtps_pd(w0), v0));
            a1 = _mm256_add_pd(a1, _mm256_mul_pd(_mm256_cvtps_pd(w1), v1));
            j += 8;
        }
        let mut a = hsum(_mm256_add_pd(a0, a1));
        for k in full..n {
            a += w[k] as f64 * v[k];
        }
        a
    }

    #[target_feature(enable = "avx2,fma")]
    fn hsum(v: __m256d) -> f64 {
        let mut l = [0.0f64; 4];
        // SAFETY: `l` holds 4 f64s.
        unsafe { _mm256_storeu_pd(l.as_mut_ptr(), v) };
        (l[0] + l[1]) + (l[2] + l[3])
    }
}

fn dot_and_abs_lanes(w: &[f32], x: &[f32]) -> (f64, f64) {
    let (mut acc, mut abs) = ([0.0f64; LANES], [0.0f64; LANES]);
    let (wc, xc) = (w.chunks_exact(LANES), x.chunks_exact(LANES));
    let (wt, xt) = (wc.remainder(), xc.remainder());
    for (wl, xl) in wc.zip(xc) {
        // Arrays, so that no index is bounds-checked.
        let (wl, xl): (&[f32; LANES], &[f32; LANES]) = (wl.try_into().expect("exact"), xl.try_into().expect("exact"));
        // Products first, then each sum in its own loop: the shape the
        // compiler turns into one vector operation per line.
        let mut p = [0.0f64; LANES];
        for k in 0..LANES {
            p[k] = wl[k] as f64 * xl[k] as f64;
        }
        for k in 0..LANES {
            acc[k] += p[k];
        }
        for k in 0..LANES {
            abs[k] += p[k].abs();
        }
    }
    let (mut a, mut s) = (acc.iter().sum::<f64>(), abs.iter().sum::<f64>());
    for (&wv, &xv) in wt.iter().zip(xt) {
        let p = wv as f64 * xv as f64;
        a += p;
        s += p.abs();
    }
    (a, s)
}

fn abs_dot_lanes(w: &[f32], v: &[f64]) -> f64 {
    let mut acc = [0.0f64; LANES];
    let (wc, vc) = (w.chunks_exact(LANES), v.chunks_exact(LANES));
    let (wt, vt) = (wc.remainder(), vc.remainder());
    for (wl, vl) in wc.zip(vc) {
        let (wl, vl): (&[f32; LANES], &[f64; LANES]) = (wl.try_into().expect("exact"), vl.try_into().expect("exact"));
        for k in 0..LANES {
            acc[k] += (wl[k] as f64).abs() * vl[k];
        }
    }
    let mut a = acc.iter().sum::<f64>();
    for (&wv, &vv) in wt.iter().zip(vt) {
        a += (wv as f64).abs() * vv;
    }
    a
}

fn dot_f64_lanes(w: &[f32], v: &[f64]) -> f64 {
    let mut acc = [0.0f64; LANES];
    let (wc, vc) = (w.chunks_exact(LANES), v.chunks_exact(LANES));
    let (wt, vt) = (wc.remainder(), vc.remainder());
    for (wl, vl) in wc.zip(vc) {
        let (wl, vl): (&[f32; LANES], &[f64; LANES]) = (wl.try_into().expect("exact"), vl.try_into().expect("exact"));
        for k in 0..LANES {
            acc[k] += wl[k] as f64 * vl[k];
        }
    }
    let mut a = acc.iter().sum::<f64>();
    for (&wv, &vv) in wt.iter().zip(vt) {
        a += wv as f64 * vv;
    }
    a
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_variant_agrees_with_a_plain_f64_sum_to_f64_rounding() {
        // 1003 terms: whole lanes and a remainder, mixed signs and scales.
        let w: Vec<f32> = (0..1003).map(|i| ((i * 37 % 101) as f32 - 50.0) * 1.1e-2).collect();
        let x: Vec<f32> = (0..1003).map(|i| ((i * 53 % 89) as f32 - 44.0) * 3.7e1).collect();
        let v: Vec<f64> = x.iter().map(|a| (*a as f64).abs() / 254.0).collect();
        let plain: f64 = w.iter().zip(&x).map(|(a, b)| *a as f64 * *b as f64).sum();
        let plain_abs: f64 = w.iter().zip(&x).map(|(a, b)| (*a as f64 * *b as f64).abs()).sum();
        let plain_q: f64 = w.iter().zip(&v).map(|(a, b)| (*a as f64).abs() * b).sum();
        let signed: Vec<f64> = x.iter().map(|a| *a as f64 / 3.0).collect();
        let plain_d: f64 = w.iter().zip(&signed).map(|(a, b)| *a as f64 * b).sum();
        for isa in Isa::available() {
            // SAFETY: `isa` is one this CPU runs.
            let ((a, s), q, d) = match isa {
                #[cfg(target_arch = "x86_64")]
                Isa::Avx512 | Isa::Avx2 => unsafe {
                    (
                        avx2::dot_and_abs(&w, &x),
                        avx2::abs_dot(&w, &v),
                        avx2::dot_f64(&w, &signed),
                    )
                },
                Isa::Baseline => (
                    dot_and_abs_lanes(&w, &x),
                    abs_dot_lanes(&w, &v),
                    dot_f64_lanes(&w, &signed),
                ),
            };
            assert!(
                (d - plain_d).abs() <= 1e3 * f64::EPSILON * plain_abs,
                "{isa:?}: {d} vs {plain_d}"
            );
            let tol = 1e3 * f64::EPSILON * plain_abs;
            assert!((a - plain).abs() <= tol, "{isa:?}: {a} vs {plain}");
            assert!((s - plain_abs).abs() <= tol, "{isa:?}: {s} vs {plain_abs}");
            assert!(
                (q - plain_q).abs() <= 1e3 * f64::EPSILON * plain_q,
                "{isa:?}: {q} vs {plain_q}"
            );
        }
    }
}
