//! `softmax_rows` where attention has sinks (gpt-oss): each row of
//! probabilities is a softmax over its visible scores and the head's sink
//! logit, with the sink's entry dropped (see `checks::stage::softmax_rows`).

use crate::checks::Verdict;
use crate::compare::sci;
use crate::tensor::Tensor;

/// Rows of `probs` [H, T, S] with `scores` [H, T, S] (the softmax's inputs)
/// and `sinks` [H]: entries in [0, 1 + tol], and Σp + p_j·e^(σ_h − s_j) = 1
/// within `tol` + share·u_sink·|σ_h|, j the row's largest entry, u_sink the
/// unit roundoff of the type the engine may hold the sinks in (its storage:
/// a sink rounded there moves the share by that much). A row whose entries
/// are all 0 holds nothing but its sink (share 1), which exp's underflow can
/// give.
pub fn softmax_rows_with_sinks(probs: &Tensor, scores: &Tensor, sinks: &[f32], tol: f64, u_sink: f64) -> Verdict {
    let &[h, t, s] = probs.shape() else {
        return Verdict::fail(format!("softmax_rows: expected [H, T, S], got {:?}", probs.shape()));
    };
    if s == 0 || h * t == 0 {
        return Verdict::skip(format!("softmax_rows: no rows to check (shape {:?})", probs.shape()));
    }
    let (mut bad_rows, mut out_of_range) = (0usize, 0usize);
    // (|Σ + sink − 1|, head, row, Σ, sink share); ties keep the first.
    let mut worst = (f64::NEG_INFINITY, 0usize, 0usize, 0.0f64, 0.0f64);
    let mut least_sink = f64::INFINITY;
    for (r, (row, srow)) in probs.data().chunks(s).zip(scores.data().chunks(s)).enumerate() {
        let head = r / t;
        let mut ok = true;
        let (mut sum, mut top) = (0.0f64, None::<usize>);
        for (j, &p) in row.iter().enumerate() {
            // Written so that NaN fails too.
            if !(p >= 0.0 && (p as f64) <= 1.0 + tol) {
                out_of_range += 1;
                ok = false;
            }
            sum += p as f64;
            if p > 0.0 && top.is_none_or(|k| p > row[k]) {
                top = Some(j);
            }
        }
        let share = match top {
            Some(j) => row[j] as f64 * (sinks[head] as f64 - srow[j] as f64).exp(),
            None => 1.0,
        };
        least_sink = least_sink.min(share);
        let err = (sum + share - 1.0).abs();
        let err = if err.is_nan() { f64::INFINITY } else { err };
        ok &= err <= tol + share * u_sink * (sinks[head] as f64).abs();
        bad_rows += usize::from(!ok);
        if err > worst.0 {
            worst = (err, head, r % t, sum, share);
        }
    }
    let rows = h * t;
    let (max_err, wh, wr, wsum, wshare) = worst;
    let v = if bad_rows == 0 {
        Verdict::pass(format!(
            "all {rows} rows of {s} and their sink's share sum to 1 within {} (tol {tol:e}, sinks held to u {u_sink:.1e}; \
             the least sink share {}); entries in [0, 1]",
            sci(max_err),
            sci(least_sink)
        ))
    } else {
        let mut msg = format!(
            "{bad_rows} of {rows} rows are not a softmax with the head's sink (tol {tol:e}, sinks held to u {u_sink:.1e}): worst row [{wh}, {wr}] sums to \
             {} and its sink's share p_j·e^(sink − s_j) is {} (Σ + share − 1 = {}): is the sink logit in the softmax's \
             max and sum?",
            wsum as f32,
            wshare as f32,
            sci(max_err)
        );
        if out_of_range > 0 {
            msg += &format!("; {out_of_range} entries outside [0, 1]");
        }
        Verdict::fail(msg)
    };
    v.metric("rows", rows as f64)
        .metric("bad_rows", bad_rows as f64)
        .metric("max_row_err", max_err)
        .metric("out_of_range", out_of_range as f64)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One head, rows over 3 keys with sink σ: the softmax of [s, σ] without σ's entry.
    fn rows(scores: &[[f32; 3]], sink: f32, with_sink: bool) -> (Tensor, Tensor) {
        let mut p = Vec::new();
        for s in scores {
            let m = s.iter().cloned().fold(sink, f32::max);
            let e: Vec<f64> = s.iter().map(|x| ((x - m) as f64).exp()).collect();
            let z: f64 = e.iter().sum::<f64>() + if with_sink { ((sink - m) as f64).exp() } else { 0.0 };
            p.extend(e.iter().map(|x| (x / z) as f32));
        }
        let n = scores.len();
        let s: Vec<f32> = scores.iter().flatten().copied().collect();
        (Tensor::new(vec![1, n, 3], p), Tensor::new(vec![1, n, 3], s))
    }

    #[test]
    fn a_sink_softmax_passes_and_one_without_its_sink_fails() {
        let sc = [[0.5, -1.0, 2.0], [3.0, 0.0, -2.0]];
        let (p, s) = rows(&sc, 1.5, true);
        let v = softmax_rows_with_sinks(&p, &s, &[1.5], 1e-5, 0.0);
        assert!(v.passed(), "{}", v.message);
        let (p, s) = rows(&sc, 1.5, false);
        let v = softmax_rows_with_sinks(&p, &s, &[1.5], 1e-5, 0.0);
        assert!(v.failed(), "{}", v.message);
        assert!(v.message.contains("sink"), "{}", v.message);
        // The wrong sink value fails too.
        let (p, s) = rows(&sc, 1.5, true);
        assert!(softmax_rows_with_sinks(&p, &s, &[0.5], 1e-5, 0.0).failed());
    }
}
