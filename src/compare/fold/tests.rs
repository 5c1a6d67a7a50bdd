//! The lane fold against a straightforward scalar fold of the same chunk, on
//! every instruction set this CPU runs: every count, maximum, index and ULP
//! distance must be equal, the sums equal up to their rounding (they are
//! added in another order), and the variants bit-identical to each other.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::*;
use crate::compare::ulp_distance;

const F32: Tolerance = Tolerance {
    atol: 1e-5,
    rtol: 1.3e-6,
};

/// The comparator's definition, one pair at a time in index order: what the
/// fold computed before it was vectorised.
fn reference(a: &[f32], e: &[f32], base: usize, tol: Tolerance) -> Partial {
    let mut p = Partial::default();
    for (i, (&x, &y)) in a.iter().zip(e).enumerate() {
        let idx = base + i;
        if !(x.is_finite() && y.is_finite()) {
            p.nan_a += x.is_nan() as usize;
            p.inf_a += x.is_infinite() as usize;
            p.nan_e += y.is_nan() as usize;
            p.inf_e += y.is_infinite() as usize;
            p.first_nf.get_or_insert(idx);
            p.mismatched += (x != y) as usize;
            continue;
        }
        let (xd, yd) = (x as f64, y as f64);
        let d = (xd - yd).abs();
        p.mismatched += (d > tol.atol + tol.rtol * yd.abs()) as usize;
        keep_max(&mut p.max_abs, Some((d, idx)));
        if y != 0.0 {
            keep_max(&mut p.max_rel, Some((d / yd.abs(), idx)));
        }
        p.max_ulp = p.max_ulp.max(ulp_distance(x, y));
        p.sum_d2 += d * d;
        p.sum_e2 += yd * yd;
        p.sum_a2 += xd * xd;
        p.sum_ae += xd * yd;
    }
    p
}

/// Σ|term| for each sum, the scale of its rounding error.
fn magnitudes(a: &[f32], e: &[f32]) -> [f64; 4] {
    let mut m = [0.0; 4];
    for (&x, &y) in a.iter().zip(e) {
        if x.is_finite() && y.is_finite() {
            let (xd, yd) = (x as f64, y as f64);
            m[0] += (xd - yd) * (xd - yd);
            m[1] += yd * yd;
            m[2] += xd * xd;
            m[3] += (xd * yd).abs();
        }
    }
    m
}

/// Checks every variant's fold of `a`/`e` (at flat offset `base`) against the
/// reference, and the variants against each other; returns the fold.
fn check_at(a: &[f32], e: &[f32], base: usize, tol: Tolerance) -> Partial {
    let want = reference(a, e, base, tol);
    let mags = magnitudes(a, e);
    let isas = Isa::available();
    // SAFETY: every variant comes from `available`.
    let first = unsafe { scan_on(isas[0], a, e, base, tol) };
    for isa in isas {
        // SAFETY: as above.
        let got = unsafe { scan_on(isa, a, e, base, tol) };
        assert_eq!(got, first, "{isa:?} differs from {:?}", Isa::available()[0]);
        let exact = |p: &Partial| {
            (
                p.nan_a,
                p.inf_a,
                p.nan_e,
                p.inf_e,
                p.first_nf,
                p.mismatched,
                p.max_abs,
                p.max_rel,
                p.max_ulp,
            )
        };
        assert_eq!(exact(&got), exact(&want), "{isa:?}, n {}", a.len());
        // Recursive summation of n terms errs by at most (n-1)·u·Σ|term|.
        let bound = |m: f64| a.len() as f64 * f64::EPSILON * m;
        let sums = [
            (got.sum_d2, want.sum_d2),
            (got.sum_e2, want.sum_e2),
            (got.sum_a2, want.sum_a2),
            (got.sum_ae, want.sum_ae),
        ];
        for (k, ((g, w), m)) in sums.into_iter().zip(mags).enumerate() {
            assert!((g - w).abs() <= bound(m), "{isa:?}: sum {k}: {g} vs {w}");
        }
    }
    first
}

fn check(a: &[f32], e: &[f32]) -> Partial {
    check_at(a, e, 0, F32)
}

/// Expected values in a realistic spread and actual ones a few ULPs to a few
/// thousandths away, with the occasional larger error.
fn noisy(n: usize, seed: u64) -> (Vec<f32>, Vec<f32>) {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let e: Vec<f32> = (0..n).map(|_| rng.random_range(-3.0f32..3.0)).collect();
    let a = e
        .iter()
        .map(|&y| {
            let r: f32 = rng.random_range(-1.0..1.0);
            if rng.random_bool(0.01) {
                y + r * 1e-3
            } else {
                y * (1.0 + r * 1e-6)
            }
        })
        .collect();
    (a, e)
}

#[test]
fn lengths_around_the_lane_width_and_offsets_match_the_reference() {
    for n in [0, 1, 2, 7, 8, 9, 15, 16, 17, 63, 64, 65, 1000, 16384, 16387] {
        let (a, e) = noisy(n, n as u64);
        let p = check(&a, &e);
        assert_eq!(p.max_abs.is_some(), n > 0);
        check_at(&a, &e, 1 << 40, F32);
    }
}

#[test]
fn non_finite_values_anywhere_are_counted_and_kept_out_of_the_metrics() {
    let (a0, e0) = noisy(37, 7);
    // Positions: first, within the first row, a row boundary, the last full
    // row, and the short last row (which is where padding happens).
    for pos in [0, 3, 8, 31, 32, 36] {
        for (x, y) in [
            (f32::NAN, 1.0),
            (1.0, f32::NAN),
            (f32::NAN, f32::NAN),
            (f32::INFINITY, f32::INFINITY),
            (f32::NEG_INFINITY, f32::INFINITY),
            (f32::INFINITY, 2.0),
            (0.5, f32::NEG_INFINITY),
        ] {
            let (mut a, mut e) = (a0.clone(), e0.clone());
            (a[pos], e[pos]) = (x, y);
            let p = check(&a, &e);
            assert_eq!(p.first_nf, Some(pos), "{x} vs {y} at {pos}");
            assert_ne!(p.max_abs.unwrap().1, pos);
        }
    }
    // Several, on both sides, and a chunk of nothing else.
    let (mut a, mut e) = noisy(100, 8);
    for i in (5..100).step_by(9) {
        a[i] = f32::NAN;
        e[i + 2] = f32::NEG_INFINITY;
    }
    let p = check(&a, &e);
    assert_eq!((p.nan_a, p.inf_e, p.first_nf), (11, 11, Some(5)));
    let nan = vec![f32::NAN; 19];
    let p = check(&nan, &nan);
    assert_eq!((p.mismatched, p.max_abs, p.max_rel, p.sum_e2), (19, None, None, 0.0));
}

#[test]
fn ties_go_to_the_first_index_across_lanes_rows_and_screens() {
    // Every pair 0.25 apart: |a-e| ties everywhere, index 0 wins.
    let e: Vec<f32> = (0..50).map(|i| i as f32).collect();
    let a: Vec<f32> = e.iter().map(|y| y + 0.25).collect();
    let p = check(&a, &e);
    assert_eq!(p.max_abs, Some((0.25, 0)));
    // An actual of zeros: |a-e|/|e| is 1 everywhere but where e is 0.
    let zeros = vec![0.0; 50];
    let p = check(&zeros, &e);
    assert_eq!(p.max_rel, Some((1.0, 1)));
    assert_eq!(p.max_abs, Some((49.0, 49)));
    // The greatest value twice in one row (lanes 5 and 3), then in a later
    // row: the lower lane of the first row wins.
    let e = vec![1.0f32; 40];
    let mut a = e.clone();
    for i in [5, 3, 21] {
        a[i] = 1.5;
    }
    a[1] = 1.25;
    let p = check(&a, &e);
    assert_eq!((p.max_abs, p.max_rel), (Some((0.5, 3)), Some((0.5, 3))));
    // Quotients that differ only in their last bits, screened by a product
    // that is itself rounded: the exact first maximum must still be found.
    let mut rng = ChaCha8Rng::seed_from_u64(9);
    let e: Vec<f32> = (0..4096).map(|_| rng.random_range(0.5f32..2.0)).collect();
    let a: Vec<f32> = e.iter().map(|y| y * 3.0).collect();
    let p = check(&a, &e);
    assert!((p.max_rel.unwrap().0 - 2.0).abs() < 1e-6);
}

#[test]
fn signed_zeros_denormals_and_extremes_match_the_reference() {
    let tiny = f32::from_bits(1);
    let denormal = f32::MIN_POSITIVE / 8.0;
    let specials = [
        0.0,
        -0.0,
        tiny,
        -tiny,
        denormal,
        -denormal,
        f32::MIN_POSITIVE,
        1.0,
        -1.0,
        f32::MAX,
        -f32::MAX,
        1e-30,
        3.0e38,
    ];
    // Every pair of specials, in one tensor of 169 pairs (not a multiple of W).
    let (a, e): (Vec<f32>, Vec<f32>) = specials
        .iter()
        .flat_map(|&x| specials.iter().map(move |&y| (x, y)))
        .unzip();
    let p = check(&a, &e);
    assert_eq!(p.max_ulp, ulp_distance(f32::MAX, -f32::MAX));
    assert_eq!(p.max_abs.unwrap().0, 2.0 * f32::MAX as f64);

    // +0 against -0: equal, 0 ULPs apart, and -0 is no divisor.
    let p = check(&[0.0, -0.0, 0.0], &[-0.0, 0.0, 0.0]);
    assert_eq!(
        (p.mismatched, p.max_ulp, p.max_rel, p.max_abs),
        (0, 0, None, Some((0.0, 0)))
    );

    // A tensor at denormal scale keeps a meaningful NMSE: its squares are
    // exact in f64 (in f32 they would all be 0).
    let e: Vec<f32> = (1..=100).map(|i| i as f32 * tiny).collect();
    let a: Vec<f32> = e.iter().map(|y| y + tiny).collect();
    let p = check(&a, &e);
    assert!(p.sum_d2 > 0.0 && p.sum_e2 > 0.0);
    assert_eq!(p.sum_d2, 100.0 * (tiny as f64).powi(2));
}

#[test]
fn padding_never_counts_even_under_a_tolerance_nothing_meets() {
    // A negative atol fails every real pair, zeros included: the zeros that
    // pad the last row must not be counted, nor become a maximum.
    let tol = Tolerance::new(-1.0, 0.0);
    for n in [1, 5, 8, 13] {
        let z = vec![0.0f32; n];
        let want = reference(&z, &z, 0, tol);
        assert_eq!(want.mismatched, n);
        check_at(&z, &z, 0, tol);
    }
}

#[test]
fn random_mixtures_of_special_values_match_the_reference() {
    let pool = [
        0.0,
        -0.0,
        f32::from_bits(1),
        f32::MIN_POSITIVE,
        1.0,
        -2.5,
        f32::MAX,
        f32::NAN,
        f32::INFINITY,
        f32::NEG_INFINITY,
    ];
    let mut rng = ChaCha8Rng::seed_from_u64(42);
    for round in 0..300 {
        let n = rng.random_range(0..80);
        let (mut a, mut e) = noisy(n, round);
        for i in 0..n {
            if rng.random_bool(0.1) {
                a[i] = pool[rng.random_range(0..pool.len())];
            }
            if rng.random_bool(0.1) {
                e[i] = pool[rng.random_range(0..pool.len())];
            }
            if rng.random_bool(0.05) {
                a[i] = e[i];
            }
        }
        check_at(&a, &e, rng.random_range(0..1000), F32);
    }
}
