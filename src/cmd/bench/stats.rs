//! Summaries of repeated timings. Medians, not means: one repetition slowed
//! by another process (the machine is shared) should not move the result.

/// The median of `xs` (the mean of the two middle values for an even count);
/// `None` for no values or any NaN (a NaN timing is a bug upstream, and
/// sorting around it would give an arbitrary answer).
pub fn median(xs: &[f64]) -> Option<f64> {
    if xs.is_empty() || xs.iter().any(|x| x.is_nan()) {
        return None;
    }
    let mut v = xs.to_vec();
    v.sort_by(f64::total_cmp);
    let n = v.len();
    Some(if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    })
}

/// The largest of `xs`: for bandwidth, where every disturbance only slows a
/// repetition down, the fastest one is the closest to the machine's limit.
pub fn best(xs: &[f64]) -> Option<f64> {
    if xs.iter().any(|x| x.is_nan()) {
        return None;
    }
    xs.iter().copied().reduce(f64::max)
}

/// `count` items in `seconds`, per second; `None` when no time was measured
/// (a zero-length interval would claim an infinite rate).
pub fn rate(count: f64, seconds: f64) -> Option<f64> {
    (seconds > 0.0 && seconds.is_finite()).then(|| count / seconds)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_odd_even_and_unsorted() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), Some(2.0));
        assert_eq!(median(&[4.0, 1.0, 3.0, 2.0]), Some(2.5));
        assert_eq!(median(&[7.5]), Some(7.5));
    }

    #[test]
    fn median_refuses_empty_and_nan() {
        assert_eq!(median(&[]), None);
        assert_eq!(median(&[1.0, f64::NAN, 2.0]), None);
    }

    #[test]
    fn best_is_the_largest() {
        assert_eq!(best(&[20.1, 23.4, 22.0]), Some(23.4));
        assert_eq!(best(&[]), None);
        assert_eq!(best(&[1.0, f64::NAN]), None);
    }

    #[test]
    fn rate_needs_a_positive_interval() {
        assert_eq!(rate(32.0, 0.5), Some(64.0));
        assert_eq!(rate(32.0, 0.0), None);
        assert_eq!(rate(32.0, f64::INFINITY), None);
    }
}
