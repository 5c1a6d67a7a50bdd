//! Tests of the comparator: exact agreement, located single errors with both
//! values, the NaN/Inf screen, and a reduction that ignores the thread count.

use super::*;

fn t(shape: &[usize], data: Vec<f32>) -> Tensor {
    Tensor::new(shape.to_vec(), data)
}
fn ramp(n: usize) -> Vec<f32> {
    (0..n).map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.01).collect()
}
const F32: Tolerance = Tolerance {
    atol: 1e-5,
    rtol: 1.3e-6,
};

#[test]
fn identical_tensors_pass_exactly() {
    let a = t(&[4, 8], ramp(32));
    let c = compare(&a, &a.clone(), F32).unwrap();
    assert!(c.passed());
    assert_eq!((c.mismatched, c.max_ulp, c.nmse, c.cosine), (0, 0, 0.0, 1.0));
    assert_eq!(c.max_abs.as_ref().unwrap().0, 0.0);
    assert_eq!(
        c.max_abs.as_ref().unwrap().1.index,
        vec![0, 0],
        "ties go to the lowest index"
    );
    assert_eq!(c.metrics()["mismatched"], 0.0);
}

#[test]
fn single_perturbed_element_is_located_with_both_values() {
    let e = t(&[3, 4, 5], ramp(60));
    let mut a = e.clone();
    let flat = 2 * 20 + 5 + 3; // [2, 1, 3]
    a.data_mut()[flat] += 0.01;
    let c = compare(&a, &e, F32).unwrap();
    assert!(!c.passed());
    assert_eq!(c.mismatched, 1);
    let (d, at) = c.max_abs.clone().unwrap();
    assert_eq!(at.index, vec![2, 1, 3]);
    assert_eq!((at.actual, at.expected), (a.data()[flat], e.data()[flat]));
    assert!((d - 0.01).abs() < 1e-6);
    let text = c.explain();
    assert!(text.contains("Mismatched elements: 1 / 60 (1.67%)"), "{text}");
    assert!(text.contains("at index [2, 1, 3]"), "{text}");
    assert!(
        text.contains(&format!("actual {}, expected {}", at.actual, at.expected)),
        "{text}"
    );
    assert!(c.summary().contains("at [2, 1, 3]"), "{}", c.summary());
    assert!(c.nmse > 0.0 && c.cosine < 1.0);
}

#[test]
fn relative_difference_is_found_where_expected_is_small() {
    // Abs diff is largest at [0] (within rtol there), rel diff at [1].
    let e = t(&[3], vec![1000.0, 1e-3, 0.0]);
    let a = t(&[3], vec![1000.0005, 1.1e-3, 0.0]);
    let c = compare(&a, &e, Tolerance::new(1e-5, 1e-6)).unwrap();
    assert_eq!(c.max_abs.as_ref().unwrap().1.index, vec![0]);
    let (r, at) = c.max_rel.clone().unwrap();
    assert_eq!(at.index, vec![1]);
    assert!((r - 0.1).abs() < 1e-4, "{r}");
    // [0]: 4.9e-4 > 1e-5 + 1e-3 ⇒ no; [1]: 1e-4 > 1e-5 ⇒ yes.
    assert_eq!(c.mismatched, 1);
    assert!(
        c.explain()
            .contains("Greatest relative difference: 1.0e-1 at index [1]"),
        "{}",
        c.explain()
    );
}

#[test]
fn nan_on_either_side_is_screened_first_and_counted() {
    let e = t(&[2, 2], vec![0.25, f32::NAN, 1.0, 2.0]);
    let a = t(&[2, 2], vec![f32::NAN, f32::NAN, f32::NAN, 2.0]);
    let c = compare(&a, &e, F32).unwrap();
    assert!(!c.passed());
    assert_eq!(
        (c.nan_actual, c.nan_expected, c.inf_actual, c.inf_expected),
        (3, 1, 0, 0)
    );
    assert_eq!(c.mismatched, 3, "NaN never matches, not even NaN");
    let first = c.first_non_finite.clone().unwrap();
    assert_eq!(first.index, vec![0, 0]);
    assert!(first.actual.is_nan() && first.expected == 0.25);
    let text = c.explain();
    assert!(
        text.starts_with(
            "actual has 3 NaN, 0 Inf; expected has 1 NaN, 0 Inf; first at index [0, 0] (actual NaN, expected 0.25)"
        ),
        "{text}"
    );
    // Only [1, 1] is a finite pair: the aggregate metrics come from it alone.
    assert_eq!(c.max_abs.unwrap().1.index, vec![1, 1]);
    assert_eq!(c.nmse, 0.0);

    let c = compare(&e, &t(&[2, 2], vec![0.25, 0.5, 1.0, 2.0]), F32).unwrap();
    assert_eq!((c.nan_actual, c.nan_expected), (1, 0));
    assert_eq!(c.first_non_finite.unwrap().index, vec![0, 1]);
}

#[test]
fn infinities_fail_and_only_identical_infinities_match() {
    let e = t(&[4], vec![f32::INFINITY, f32::INFINITY, 1.0, -1.0]);
    let a = t(&[4], vec![f32::INFINITY, f32::NEG_INFINITY, f32::NEG_INFINITY, -1.0]);
    let c = compare(&a, &e, F32).unwrap();
    assert_eq!((c.inf_actual, c.inf_expected, c.nan_actual), (3, 2, 0));
    assert_eq!(c.mismatched, 2, "[0] is +inf on both sides");
    assert!(!c.passed(), "any non-finite value fails the check");
    assert!(c.explain().starts_with(
        "actual has 0 NaN, 3 Inf; expected has 0 NaN, 2 Inf; first at index [0] (actual inf, expected inf)"
    ));
    assert_eq!(c.metrics()["non_finite"], 5.0);
}

#[test]
fn shape_mismatch_is_an_error() {
    let err = compare(&t(&[2, 3], vec![0.0; 6]), &t(&[3, 2], vec![0.0; 6]), F32).unwrap_err();
    assert_eq!(
        err,
        ShapeMismatch {
            actual: vec![2, 3],
            expected: vec![3, 2]
        }
    );
    assert_eq!(err.to_string(), "shape mismatch: actual [2, 3] vs expected [3, 2]");
}

#[test]
fn zero_vectors_and_empty_tensors() {
    let z = t(&[5], vec![0.0; 5]);
    let c = compare(&z, &z, F32).unwrap();
    assert!(c.passed());
    assert_eq!((c.nmse, c.cosine), (0.0, 1.0));
    assert!(c.max_rel.is_none(), "no expected value is nonzero");

    let a = t(&[5], vec![0.0, 0.0, 1.0, 0.0, 0.0]);
    let c = compare(&a, &z, F32).unwrap();
    assert_eq!((c.nmse, c.cosine), (f64::INFINITY, 0.0));
    assert!(c.explain().contains("n/a (no finite pair with expected != 0)"));

    let empty = t(&[0, 3], vec![]);
    let c = compare(&empty, &empty, F32).unwrap();
    assert!(c.passed() && c.max_abs.is_none());
    assert_eq!(c.summary(), "empty tensor, shape [0, 3]");
}

#[test]
fn parallel_reduction_is_deterministic_and_matches_a_sequential_scan() {
    let n = 1 << 20;
    let e = t(&[1024, 1024], (0..n).map(|i| ((i as f32) * 0.731).sin()).collect());
    let mut a = e.clone();
    for (i, x) in a.data_mut().iter_mut().enumerate() {
        *x += ((i % 977) as f32) * 1e-8;
    }
    a.data_mut()[777_777] += 0.5; // the unique worst element
    let run = |threads| {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
        pool.install(|| compare(&a, &e, F32).unwrap())
    };
    let (one, four) = (run(1), run(4));
    assert_eq!(one, four, "thread count must not change any bit");
    assert_eq!(one, compare_chunked(&a, &e, F32, CHUNK, false).unwrap());
    assert_eq!(one, run(3));

    // A single-chunk scan sums in a different order: the same up to rounding.
    let seq = compare_chunked(&a, &e, F32, n, false).unwrap();
    assert_eq!((one.mismatched, one.max_ulp), (seq.mismatched, seq.max_ulp));
    assert_eq!(one.max_abs, seq.max_abs);
    assert_eq!(one.max_rel, seq.max_rel);
    assert_eq!(one.max_abs.as_ref().unwrap().1.index, vec![759, 561]);
    assert!((one.nmse - seq.nmse).abs() <= 1e-12 * seq.nmse);
    assert!((one.cosine - seq.cosine).abs() <= 1e-12);
}

#[test]
fn tolerance_defaults_follow_torch_per_dtype() {
    assert_eq!(Tolerance::default_for(DType::F32), Tolerance::new(1e-5, 1.3e-6));
    assert_eq!(Tolerance::default_for(DType::F16), Tolerance::new(1e-5, 1e-3));
    assert_eq!(Tolerance::default_for(DType::BF16), Tolerance::new(1e-5, 1.6e-2));
    let a = t(&[1], vec![1.0]);
    let b = t(&[1], vec![1.0]).with_dtype(DType::BF16);
    assert_eq!(Tolerance::for_pair(&a, &b), Tolerance::default_for(DType::BF16));
}

#[test]
fn ulp_distance_counts_representable_floats() {
    let x = 1.0f32;
    assert_eq!(ulp_distance(x, f32::from_bits(x.to_bits() + 1)), 1);
    assert_eq!(ulp_distance(-x, f32::from_bits((-x).to_bits() + 1)), 1);
    assert_eq!(ulp_distance(0.0, -0.0), 0);
    let tiny = f32::from_bits(1);
    assert_eq!(ulp_distance(tiny, -tiny), 2, "across zero");
    let c = compare(
        &t(&[2], vec![1.0, f32::from_bits(x.to_bits() + 3)]),
        &t(&[2], vec![1.0, 1.0]),
        F32,
    )
    .unwrap();
    assert_eq!(c.max_ulp, 3);
    assert!(c.passed());
}
