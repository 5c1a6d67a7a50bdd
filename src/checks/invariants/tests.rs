//! Tests of `invariants`: every check must pass on good data and fail, with a
//! useful message, on data crafted to break it.

use super::*;
use crate::checks::Status;

fn t(shape: &[usize], data: Vec<f32>) -> Tensor {
    Tensor::new(shape.to_vec(), data)
}
/// Deterministic values in [-1, 1) (xorshift; no RNG crate needed).
fn noise(n: usize, mut s: u64) -> Vec<f32> {
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        })
        .collect()
}
/// Causal softmax of random logits: [H, T, S] with query row t at positions[t].
fn causal_probs(h: usize, positions: &[usize], s: usize) -> Tensor {
    let tt = positions.len();
    let logits = noise(h * tt * s, 7);
    let mut out = vec![0.0f32; h * tt * s];
    for r in 0..h * tt {
        let p = positions[r % tt];
        let row = &logits[r * s..][..=p];
        let m = row.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
        let z: f32 = row.iter().map(|x| (x - m).exp()).sum();
        for (j, x) in row.iter().enumerate() {
            out[r * s + j] = (x - m).exp() / z;
        }
    }
    t(&[h, tt, s], out)
}
/// Reference RoPE (θ_j = pos · 10000^(-2j/D)), computed in f64.
fn reference_rope(x: &Tensor, positions: &[usize], style: RopeStyle) -> Tensor {
    let &[tt, n, d] = x.shape() else { panic!() };
    let mut out = x.data().to_vec();
    for (r, &p) in positions.iter().enumerate().take(tt) {
        for hh in 0..n {
            let base = (r * n + hh) * d;
            for j in 0..d / 2 {
                let ang = p as f64 * 10000f64.powf(-2.0 * j as f64 / d as f64);
                let (sin, cos) = ang.sin_cos();
                let (i0, i1) = style.pair(j, d);
                let (x0, x1) = (x.data()[base + i0] as f64, x.data()[base + i1] as f64);
                out[base + i0] = (x0 * cos - x1 * sin) as f32;
                out[base + i1] = (x1 * cos + x0 * sin) as f32;
            }
        }
    }
    t(x.shape(), out)
}

#[test]
fn finite_passes_clean_and_names_nan_and_inf() {
    let good = t(&[2, 3], noise(6, 1));
    let v = finite(&good);
    assert!(v.passed(), "{}", v.message);
    assert_eq!(v.message, "all 6 values finite");

    let mut bad = good.clone();
    bad.data_mut()[4] = f32::NAN;
    let v = finite(&bad);
    assert!(v.failed());
    assert_eq!(v.metrics["nan"], 1.0);
    assert!(v.message.contains("first at index [1, 1] (NaN)"), "{}", v.message);

    bad.data_mut()[1] = f32::INFINITY;
    bad.data_mut()[5] = f32::NEG_INFINITY;
    let v = finite(&bad);
    assert!(v.failed());
    assert_eq!(
        (v.metrics["pos_inf"], v.metrics["neg_inf"], v.metrics["non_finite"]),
        (1.0, 1.0, 3.0)
    );
    assert!(
        v.message
            .starts_with("3 of 6 values non-finite (1 NaN, 1 +Inf, 1 -Inf); first at index [0, 1] (inf)"),
        "{}",
        v.message
    );
}

#[test]
fn shape_reports_both_shapes() {
    let x = t(&[2, 3], vec![0.0; 6]);
    assert!(shape(&x, &[2, 3]).passed());
    let v = shape(&x, &[3, 2]);
    assert!(v.failed());
    assert_eq!(v.message, "shape mismatch: actual [2, 3] vs expected [3, 2]");
    assert!(shape(&x, &[2, 3, 1]).failed());
}

#[test]
fn softmax_rows_pass_on_real_softmax() {
    let p = causal_probs(2, &[0, 1, 2, 3], 4);
    let v = softmax_rows(&p, 1e-6);
    assert!(v.passed(), "{}", v.message);
    assert!(
        v.message.starts_with("all 8 rows of 4 sum to 1 within"),
        "{}",
        v.message
    );
    assert!(v.metrics["max_row_err"] <= 1e-6);
    // One-hot row at 1 + 1 ulp: reciprocal-multiply rounding, not a bug.
    assert!(softmax_rows(&t(&[1, 2], vec![1.000_000_1, 0.0]), 1e-6).passed());
}

#[test]
fn softmax_rows_fail_on_unnormalised_row() {
    let mut p = causal_probs(2, &[0, 1, 2, 3], 4);
    for x in &mut p.data_mut()[6 * 4..7 * 4] {
        *x *= 1.01; // row [h, t] = [1, 2]
    }
    let v = softmax_rows(&p, 1e-6);
    assert!(v.failed());
    assert_eq!(v.metrics["bad_rows"], 1.0);
    assert_eq!(v.metrics["out_of_range"], 0.0);
    assert!(
        v.message
            .starts_with("1 of 8 rows are not distributions (tol 1e-6): worst row [1, 2] sums to 1.01"),
        "{}",
        v.message
    );
}

#[test]
fn softmax_rows_fail_on_out_of_range_entries_even_when_sums_are_1() {
    let v = softmax_rows(&t(&[2, 3], vec![0.2, 0.3, 0.5, 0.5, 0.7, -0.2]), 1e-6);
    assert!(v.failed());
    assert_eq!((v.metrics["bad_rows"], v.metrics["out_of_range"]), (1.0, 1.0));
    assert!(
        v.message
            .contains("1 entries outside [0, 1], first at index [1, 2]: -0.2"),
        "{}",
        v.message
    );

    let v = softmax_rows(&t(&[1, 3], vec![0.0, 1.5, -0.5]), 1e-6);
    assert!(v.failed());
    assert_eq!(v.metrics["out_of_range"], 2.0);
    assert!(v.message.contains("first at index [0, 1]: 1.5"), "{}", v.message);

    let v = softmax_rows(&t(&[1, 2], vec![f32::NAN, 1.0]), 1e-6);
    assert!(v.failed() && v.message.contains("NaN"), "{}", v.message);
    assert!(softmax_rows(&t(&[], vec![1.0]), 1e-6).failed());
    assert_eq!(softmax_rows(&t(&[0, 4], vec![]), 1e-6).status, Status::Skip);
}

#[test]
fn causal_passes_prefill_and_chunked_decode() {
    let v = causal(&causal_probs(2, &[0, 1, 2, 3], 4), &[0, 1, 2, 3]);
    assert!(v.passed(), "{}", v.message);
    assert_eq!(v.metrics["future_entries"], 12.0); // 2 heads x (3+2+1+0)
                                                   // Two new tokens against a cache of 5: row 0 (position 3) must not see position 4.
    let v = causal(&causal_probs(2, &[3, 4], 5), &[3, 4]);
    assert!(v.passed(), "{}", v.message);
    assert_eq!(v.metrics["future_entries"], 2.0);
    // Single-token decode: nothing lies in the future, and we say so rather than pass.
    let v = causal(&causal_probs(2, &[4], 5), &[4]);
    assert_eq!(v.status, Status::Skip);
    assert!(v.message.contains("not applicable"), "{}", v.message);
}

#[test]
fn causal_fails_on_future_probability() {
    let mut p = causal_probs(2, &[0, 1, 2, 3], 4);
    p.data_mut()[(4 + 1) * 4 + 3] = 0.125; // [h, t, s] = [1, 1, 3]
    let v = causal(&p, &[0, 1, 2, 3]);
    assert!(v.failed());
    assert_eq!(v.metrics["future_nonzero"], 1.0);
    assert!(
        v.message
            .contains("first at [h, t, s] = [1, 1, 3] (query row 1 is at position 1): 0.125"),
        "{}",
        v.message
    );
    assert!(!v.message.contains("off by one"));

    // Decode-like rows checked at the wrong (prefill) positions: off by one.
    let p = causal_probs(1, &[1, 2, 3], 4);
    let v = causal(&p, &[0, 1, 2]);
    assert!(v.failed());
    assert_eq!(v.metrics["future_nonzero"], 3.0);
    assert!(v.message.contains("mask off by one"), "{}", v.message);
}

#[test]
fn causal_rejects_bad_arguments() {
    let p = causal_probs(1, &[0, 1], 2);
    assert!(causal(&t(&[2, 2], vec![0.0; 4]), &[0, 1])
        .message
        .contains("must be [H, T, S], got shape [2, 2]"));
    let v = causal(&p, &[0]);
    assert!(
        v.failed() && v.message.contains("1 positions given for T = 2"),
        "{}",
        v.message
    );
    let v = causal(&p, &[0, 2]);
    assert!(
        v.failed() && v.message.contains("query row 1 is at position 2, outside the S = 2"),
        "{}",
        v.message
    );
}

fn qk(tt: usize) -> Tensor {
    t(&[tt, 2, 8], noise(tt * 16, 99))
}

#[test]
fn rope_passes_a_correct_rotation_in_both_styles() {
    let x = qk(4);
    for style in [RopeStyle::Neox, RopeStyle::Interleaved] {
        let v = rope(
            &x,
            &reference_rope(&x, &[0, 1, 2, 3], style),
            &[0, 1, 2, 3],
            style,
            1e-5,
            10000.0,
        );
        assert!(v.passed(), "{}", v.message);
        assert_eq!((v.metrics["pos0_rows"], v.metrics["rotated_checked"]), (1.0, 6.0));
        assert!(
            v.message.contains("(1) identity at position 0: max |Δ| 0 over 1 rows"),
            "{}",
            v.message
        );
    }
    // Decode step: no position 0, so (1) is reported as not applicable.
    let x = qk(1);
    let v = rope(
        &x,
        &reference_rope(&x, &[7], RopeStyle::Neox),
        &[7],
        RopeStyle::Neox,
        1e-5,
        10000.0,
    );
    assert!(v.passed(), "{}", v.message);
    assert!(
        v.message.contains("not applicable, no row at position 0"),
        "{}",
        v.message
    );
}

#[test]
fn rope_fails_when_output_is_not_rotated() {
    let x = qk(4);
    let v = rope(&x, &x, &[0, 1, 2, 3], RopeStyle::Neox, 1e-5, 10000.0);
    assert!(v.failed());
    assert_eq!(v.metrics["unrotated"], 6.0);
    assert!(v.message.contains("(2) not rotated: 6 of 6 vectors"), "{}", v.message);
    assert!(
        v.message.contains("first [t, head] = [1, 0] at position 1"),
        "{}",
        v.message
    );
    // The same decode step with a stale (unrotated) output.
    let x = qk(1);
    let v = rope(&x, &x, &[5], RopeStyle::Neox, 1e-5, 10000.0);
    assert!(
        v.failed() && v.message.contains("(1) identity at position 0: not applicable"),
        "{}",
        v.message
    );
}

#[test]
fn rope_fails_when_norm_changes() {
    let x = qk(4);
    let mut y = reference_rope(&x, &[0, 1, 2, 3], RopeStyle::Neox);
    y.data_mut()[16..].iter_mut().for_each(|v| *v *= 1.01); // rows at positions > 0
    let v = rope(&x, &y, &[0, 1, 2, 3], RopeStyle::Neox, 1e-5, 10000.0);
    assert!(v.failed());
    assert!(v.message.contains("(3) pair norm not preserved"), "{}", v.message);
    assert!(v.message.contains("first [t, head, pair] = [1, 0, 0]"), "{}", v.message);
    assert_eq!(v.metrics["identity_violations"], 0.0);
    assert!(v.metrics["max_norm_err"] > 5e-3);
}

#[test]
fn rope_detects_wrong_pairing() {
    let x = qk(4);
    let y = reference_rope(&x, &[0, 1, 2, 3], RopeStyle::Interleaved);
    let v = rope(&x, &y, &[0, 1, 2, 3], RopeStyle::Neox, 1e-5, 10000.0);
    assert!(v.failed(), "{}", v.message);
    assert!(v.metrics["norm_violations"] > 0.0);
    assert_eq!((v.metrics["identity_violations"], v.metrics["unrotated"]), (0.0, 0.0));
    assert!(v.message.contains("wrong pairing"), "{}", v.message);
}

#[test]
fn rope_fails_when_position_0_is_changed() {
    let x = qk(4);
    let mut y = reference_rope(&x, &[0, 1, 2, 3], RopeStyle::Neox);
    y.data_mut()[8 + 5] += 0.01; // row 0, head 1, dim 5 = neox pair 1 (dims 1, 5)
    let v = rope(&x, &y, &[0, 1, 2, 3], RopeStyle::Neox, 1e-5, 10000.0);
    assert!(v.failed());
    assert_eq!(v.metrics["identity_violations"], 1.0);
    assert!(
        v.message.contains("(1) not the identity at position 0"),
        "{}",
        v.message
    );
    assert!(
        v.message
            .contains("[t, head, pair] = [0, 1, 1] (dims 1, 5, position 0)"),
        "{}",
        v.message
    );
}

#[test]
fn rope_skips_zero_vectors_and_rejects_bad_arguments() {
    let mut x = qk(2);
    x.data_mut()[16..24].iter_mut().for_each(|v| *v = 0.0); // row 1, head 0
    let v = rope(
        &x,
        &reference_rope(&x, &[0, 1], RopeStyle::Neox),
        &[0, 1],
        RopeStyle::Neox,
        1e-5,
        10000.0,
    );
    assert!(v.passed(), "{}", v.message);
    assert_eq!((v.metrics["skipped_zero"], v.metrics["rotated_checked"]), (1.0, 1.0));

    let x = qk(2);
    assert!(rope(&x, &qk(1), &[0, 1], RopeStyle::Neox, 1e-5, 10000.0)
        .message
        .contains("input shape [2, 2, 8] vs output shape [1, 2, 8]"));
    let odd = t(&[1, 1, 3], vec![0.0; 3]);
    assert!(rope(&odd, &odd, &[0], RopeStyle::Neox, 1e-5, 10000.0)
        .message
        .contains("D = 3 is odd"));
    assert!(rope(&x, &x, &[0], RopeStyle::Neox, 1e-5, 10000.0)
        .message
        .contains("1 positions given for T = 2"));
    let mut y = x.clone();
    y.data_mut()[3] = f32::NAN;
    let v = rope(&x, &y, &[0, 1], RopeStyle::Neox, 1e-5, 10000.0);
    assert!(
        v.failed() && v.message.contains("output has non-finite value NaN at index [0, 0, 3]"),
        "{}",
        v.message
    );
}

/// `x` rounded to `dtype` and tagged with it, as an engine with that storage captures it.
fn stored(x: &Tensor, dtype: crate::tensor::DType) -> Tensor {
    let mut y = x.clone().with_dtype(dtype);
    dtype.round_slice(y.data_mut());
    y
}

#[test]
fn rope_bound_grants_one_rounding_to_the_captured_dtype() {
    use crate::tensor::DType;
    let positions = [0, 1, 2, 3, 17];
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        let u = dtype.unit_roundoff();
        // An engine with this storage: q stored, rotated in f32, output stored.
        let x = stored(&qk(5), dtype);
        let y = stored(&reference_rope(&x, &positions, RopeStyle::Neox), dtype);
        let v = rope(&x, &y, &positions, RopeStyle::Neox, 1e-5, 10000.0);
        assert!(v.passed(), "{dtype}: {}", v.message);
        assert_eq!(v.metrics["unit_roundoff"], u);
        assert!(v.message.contains(&format!("{dtype} rounding u = 2^")), "{}", v.message);
        // Within one rounding, and for 16-bit storage beyond what tol alone allows.
        assert!(
            v.metrics["max_norm_err"] <= u + 1e-5,
            "{dtype}: {}",
            v.metrics["max_norm_err"]
        );
        if dtype != DType::F32 {
            assert!(v.metrics["max_norm_err"] > 1e-5, "{dtype}: rounding should show");
            // The same values claimed to be f32 get no rounding allowance and fail.
            let v = rope(
                &x,
                &y.clone().with_dtype(DType::F32),
                &positions,
                RopeStyle::Neox,
                1e-5,
                10000.0,
            );
            assert!(v.failed(), "{dtype} values as f32: {}", v.message);
            assert!(v.metrics["norm_violations"] > 0.0);
        }
        if dtype == DType::F32 {
            continue; // at f32, 4u is far below tol: the cases below need 16-bit storage
        }
        // Not a loosening: a scale of 4u (more than one rounding) fails at the dtype...
        let mut scaled = y.clone();
        scaled.data_mut()[16..]
            .iter_mut()
            .for_each(|v| *v *= 1.0 + 4.0 * u as f32); // positions > 0
        let v = rope(&x, &scaled, &positions, RopeStyle::Neox, 1e-5, 10000.0);
        assert!(v.failed(), "{dtype}: {}", v.message);
        assert!(
            v.message.contains("(3) pair norm not preserved") && v.message.contains(&format!("{dtype} storage")),
            "{}",
            v.message
        );
        // ...and so does moving a position-0 value by 4u of itself.
        let mut moved = y.clone();
        let i = moved.data().iter().position(|v| v.abs() > 0.5).unwrap(); // in row 0 (position 0)
        assert!(i < 16);
        moved.data_mut()[i] *= 1.0 + 4.0 * u as f32;
        let v = rope(&x, &moved, &positions, RopeStyle::Neox, 1e-5, 10000.0);
        assert!(v.failed(), "{dtype}: {}", v.message);
        assert_eq!(v.metrics["identity_violations"], 1.0, "{}", v.message);
        assert!(
            v.message.contains("(1) not the identity at position 0")
                && v.message
                    .contains(&format!("tol + u·|x| with u = 2^{}", u.log2() as i32)),
            "{}",
            v.message
        );
    }
}

#[test]
fn rope_checks_the_angle_against_theta_and_position() {
    let x = qk(4);
    let y = reference_rope(&x, &[0, 1, 2, 3], RopeStyle::Neox);
    // A rotation by the right angle for another base (the model says 500000).
    let v = rope(&x, &y, &[0, 1, 2, 3], RopeStyle::Neox, 1e-5, 500000.0);
    assert!(v.failed(), "{}", v.message);
    assert!(v.message.contains("(4) wrong rotation angle"), "{}", v.message);
    assert!(v.message.contains("theta 500000"), "{}", v.message);
    assert_eq!((v.metrics["norm_violations"], v.metrics["unrotated"]), (0.0, 0.0));
    // Tables that wrap: rows at positions 30..33 rotated as at 0..3 (the
    // identity row aside, norms and "rotated" all hold; only the angle tells).
    let x = qk(4);
    let y = reference_rope(&x, &[6, 7, 8, 9], RopeStyle::Neox);
    let v = rope(&x, &y, &[30, 31, 32, 33], RopeStyle::Neox, 1e-5, 10000.0);
    assert!(v.failed() && v.metrics["angle_violations"] > 0.0, "{}", v.message);
    assert!(v.message.contains("position 30"), "{}", v.message);
    // The correct rotation at large positions passes (the f32-angle allowance).
    let x = qk(2);
    let y = reference_rope(&x, &[300, 301], RopeStyle::Interleaved);
    let v = rope(&x, &y, &[300, 301], RopeStyle::Interleaved, 1e-5, 10000.0);
    assert!(v.passed(), "{}", v.message);
}

#[test]
fn causal_window_demands_zeros_older_than_the_window() {
    // 1 head, rows at positions 0..4, S = 5, window 2: row p sees p-1, p.
    let mut d = vec![0.0f32; 25];
    for p in 0..5usize {
        let lo = p.saturating_sub(1);
        for j in lo..=p {
            d[p * 5 + j] = 1.0 / (p - lo + 1) as f32;
        }
    }
    let probs = t(&[1, 5, 5], d.clone());
    let v = causal_window(&probs, &[0, 1, 2, 3, 4], Some(2));
    assert!(v.passed(), "{}", v.message);
    assert!(v.message.contains("older than the window"), "{}", v.message);
    // The window one too wide: key p - 2 gets weight.
    let mut wide = d.clone();
    for p in 2..5usize {
        wide[p * 5 + p - 2] = 0.1;
    }
    let v = causal_window(&t(&[1, 5, 5], wide.clone()), &[0, 1, 2, 3, 4], Some(2));
    assert!(v.failed());
    assert!(v.message.contains("3 of 6 entries older than the sliding window"), "{}", v.message);
    assert!(v.message.contains("one position too wide"), "{}", v.message);
    // Without the window the same tensor is causal.
    assert!(causal(&t(&[1, 5, 5], wide), &[0, 1, 2, 3, 4]).passed());
    // A decode row at position 4 over S = 5 has keys 0..=2 outside the window.
    let row = t(&[1, 1, 5], vec![0.0, 0.0, 0.0, 0.5, 0.5]);
    assert!(causal_window(&row, &[4], Some(2)).passed());
    let row = t(&[1, 1, 5], vec![0.2, 0.0, 0.0, 0.4, 0.4]);
    assert!(causal_window(&row, &[4], Some(2)).failed());
}
