//! Invariants: properties a single capture must have whatever the reference
//! says (finite values, the declared shape, softmax rows that are
//! distributions, causal zeros, RoPE as a norm-preserving rotation). They need
//! no golden, so they catch the classic hand-written-engine bugs ("do the
//! attention weights sum to 1?", "did RoPE change Q?") even before goldens
//! exist, and they localise a bug that a golden diff only shows downstream.
//!
//! Every function is pure and returns a `Verdict` whose message says where
//! (multi-index) and which values, so a failure can be acted on without a debugger.

use crate::checks::Verdict;
use crate::compare::sci;
use crate::stage::RopeStyle;
use crate::tensor::Tensor;

mod sinks;
pub use sinks::softmax_rows_with_sinks;

/// Row-major multi-index of `flat` within `shape` (for row indices of a prefix shape).
fn unravel(shape: &[usize], mut flat: usize) -> Vec<usize> {
    let mut idx = vec![0; shape.len()];
    for (d, &n) in shape.iter().enumerate().rev() {
        if n > 0 {
            idx[d] = flat % n;
            flat /= n;
        }
    }
    idx
}

/// Positions for messages: a prefill's `0..=511` rather than 512 numbers.
fn describe_positions(p: &[usize]) -> String {
    match p {
        [] => "[]".into(),
        [one] => format!("[{one}]"),
        _ if p.windows(2).all(|w| w[1] == w[0] + 1) => format!("{}..={}", p[0], p[p.len() - 1]),
        _ if p.len() <= 8 => format!("{p:?}"),
        _ => format!("{:?}... ({} rows)", &p[..8], p.len()),
    }
}

/// No NaN and no ±Inf. Counts each kind and names the first offender.
pub fn finite(t: &Tensor) -> Verdict {
    let (mut nan, mut pos_inf, mut neg_inf, mut first) = (0usize, 0usize, 0usize, None);
    for (i, &x) in t.data().iter().enumerate() {
        if x.is_finite() {
            continue;
        }
        if x.is_nan() {
            nan += 1;
        } else if x > 0.0 {
            pos_inf += 1;
        } else {
            neg_inf += 1;
        }
        first.get_or_insert((i, x));
    }
    let bad = nan + pos_inf + neg_inf;
    let v = match first {
        None => Verdict::pass(format!("all {} values finite", t.numel())),
        Some((i, x)) => Verdict::fail(format!(
            "{bad} of {} values non-finite ({nan} NaN, {pos_inf} +Inf, {neg_inf} -Inf); first at index {:?} ({x})",
            t.numel(),
            t.unravel(i)
        )),
    };
    v.metric("non_finite", bad as f64)
        .metric("nan", nan as f64)
        .metric("pos_inf", pos_inf as f64)
        .metric("neg_inf", neg_inf as f64)
}

/// The capture has exactly the shape the stage table promises.
pub fn shape(t: &Tensor, expected: &[usize]) -> Verdict {
    let v = if t.shape() == expected {
        Verdict::pass(format!("shape {expected:?}"))
    } else {
        Verdict::fail(format!(
            "shape mismatch: actual {:?} vs expected {expected:?}",
            t.shape()
        ))
    };
    v.metric("rank", t.shape().len() as f64)
}

/// Every row over the last dim is a distribution: finite entries in [0, 1] and
/// |Σ - 1| <= tol. The upper bound is 1 + tol, not 1: engines that multiply by
/// a reciprocal (`e * (1/s)`) legitimately give 1 + 1 ulp for a one-hot row,
/// such as the first row of causal attention. Negative values have no such
/// excuse (exp is never negative), so 0 is a hard bound.
pub fn softmax_rows(probs: &Tensor, tol: f64) -> Verdict {
    let shape = probs.shape();
    let Some((&n, lead)) = shape.split_last() else {
        return Verdict::fail("softmax_rows: a scalar (shape []) has no rows");
    };
    let rows: usize = lead.iter().product();
    if rows == 0 {
        return Verdict::skip(format!("softmax_rows: no rows to check (shape {shape:?})"));
    }
    if n == 0 {
        return Verdict::fail(format!(
            "softmax_rows: rows are empty (shape {shape:?}); an empty row cannot sum to 1"
        ));
    }
    let (mut bad_rows, mut out_of_range, mut first_oor) = (0usize, 0usize, None);
    let mut worst = (f64::NEG_INFINITY, 0usize, 0.0f64); // (|Σ-1|, row, Σ); ties keep the lowest row
    for (r, row) in probs.data().chunks(n).enumerate() {
        let mut sum = 0.0f64;
        let mut ok = true;
        for (j, &p) in row.iter().enumerate() {
            sum += p as f64;
            // Written so that NaN fails too.
            if !(p >= 0.0 && (p as f64) <= 1.0 + tol) {
                out_of_range += 1;
                ok = false;
                first_oor.get_or_insert((r * n + j, p));
            }
        }
        let err = (sum - 1.0).abs();
        let err = if err.is_nan() { f64::INFINITY } else { err };
        ok &= err <= tol;
        bad_rows += !ok as usize;
        if err > worst.0 {
            worst = (err, r, sum);
        }
    }
    let (max_err, worst_row, worst_sum) = worst;
    let v = if bad_rows == 0 {
        Verdict::pass(format!(
            "all {rows} rows of {n} sum to 1 within {} (tol {tol:e}); entries in [0, 1]",
            sci(max_err)
        ))
    } else {
        let mut msg = format!(
            "{bad_rows} of {rows} rows are not distributions (tol {tol:e}): worst row {:?} sums to {} (|Σ-1| = {})",
            unravel(lead, worst_row),
            worst_sum as f32, // f32 digits: the f64 tail is only the inputs' rounding
            sci(max_err)
        );
        if let Some((i, p)) = first_oor {
            msg += &format!(
                "; {out_of_range} entries outside [0, 1], first at index {:?}: {p}",
                probs.unravel(i)
            );
        }
        Verdict::fail(msg)
    };
    v.metric("rows", rows as f64)
        .metric("bad_rows", bad_rows as f64)
        .metric("max_row_err", max_err)
        .metric("out_of_range", out_of_range as f64)
}

/// Attention probabilities [H, T, S] put exactly 0 on the future: entry
/// (h, t, s) with s > positions[t] (the query row's absolute position). Exactly
/// 0, not "small": a masked logit is -inf and exp(-inf) is 0 in every format, so
/// anything else means the mask is missing or misplaced.
pub fn causal(probs: &Tensor, positions: &[usize]) -> Verdict {
    causal_window(probs, positions, None)
}

/// `causal` on a sliding-window layer too: with `window` w, a query at p
/// sees keys p − w < j ≤ p (HF's `sliding_window_overlay`), so the entries
/// j ≤ p − w are exactly 0 as well; they are counted apart, and offenders
/// all at j = p − w are told as a window one position too wide.
pub fn causal_window(probs: &Tensor, positions: &[usize], window: Option<usize>) -> Verdict {
    let &[h, t, s] = probs.shape() else {
        return Verdict::fail(format!(
            "causal: attention probabilities must be [H, T, S], got shape {:?}",
            probs.shape()
        ));
    };
    if positions.len() != t {
        return Verdict::fail(format!(
            "causal: {} positions given for T = {t} query rows (shape {:?})",
            positions.len(),
            probs.shape()
        ));
    }
    if let Some((row, &p)) = positions.iter().enumerate().find(|(_, &p)| p >= s) {
        return Verdict::fail(format!(
            "causal: query row {row} is at position {p}, outside the S = {s} cache positions (shape {:?})",
            probs.shape()
        ));
    }
    // Keys 0..first(p) are outside the window of a query at p.
    let first = |p: usize| window.map_or(0, |w| (p + 1).saturating_sub(w));
    let future = h * positions.iter().map(|&p| s - 1 - p).sum::<usize>();
    let old = h * positions.iter().map(|&p| first(p)).sum::<usize>();
    let masked = future + old;
    let where_ = match window {
        Some(w) => format!("positions {}, S = {s}, sliding window {w}", describe_positions(positions)),
        None => format!("positions {}, S = {s}", describe_positions(positions)),
    };
    if masked == 0 {
        // Honest about vacuity: a decode row sees the whole cache, nothing to test.
        return Verdict::skip(format!(
            "causal: not applicable: every query row is at the last cache position and sees every key ({where_}), \
             so no entry is masked"
        ))
        .metric("future_entries", 0.0);
    }
    let data = probs.data();
    let (mut nonzero, mut next_only, mut first_bad, mut max_abs) = (0usize, 0usize, None, 0.0f32);
    let (mut old_nonzero, mut edge_only, mut old_first) = (0usize, 0usize, None);
    for hh in 0..h {
        for (tt, &p) in positions.iter().enumerate() {
            let row = &data[(hh * t + tt) * s..][..s];
            for (ss, &x) in row.iter().enumerate().skip(p + 1) {
                if x != 0.0 {
                    nonzero += 1;
                    next_only += (ss == p + 1) as usize;
                    first_bad.get_or_insert((hh, tt, ss, x, p));
                    max_abs = max_abs.max(x.abs());
                }
            }
            let f = first(p);
            for (ss, &x) in row.iter().enumerate().take(f) {
                if x != 0.0 {
                    old_nonzero += 1;
                    edge_only += (ss + 1 == f) as usize;
                    old_first.get_or_insert((hh, tt, ss, x, p));
                    max_abs = max_abs.max(x.abs());
                }
            }
        }
    }
    let mut fails = Vec::new();
    if let Some((hh, tt, ss, x, p)) = first_bad {
        let mut msg = format!(
            "{nonzero} of {future} future entries are not 0 ({where_}); first at [h, t, s] = [{hh}, {tt}, {ss}] \
             (query row {tt} is at position {p}): {x}; largest |prob| {max_abs}"
        );
        if next_only == nonzero {
            msg += "; all offenders are at s = position + 1: is the mask off by one?";
        }
        fails.push(msg);
    }
    if let (Some((hh, tt, ss, x, p)), Some(w)) = (old_first, window) {
        let mut msg = format!(
            "{old_nonzero} of {old} entries older than the sliding window are not 0 ({where_}): a query at p sees \
             keys p - {w} < j <= p; first at [h, t, s] = [{hh}, {tt}, {ss}] (query row {tt} is at position {p}): {x}"
        );
        if edge_only == old_nonzero {
            msg += &format!("; all offenders are at s = position - {w}: is the window one position too wide?");
        }
        fails.push(msg);
    }
    let v = if fails.is_empty() {
        match window {
            Some(_) => Verdict::pass(format!(
                "all {future} future entries and {old} entries older than the window are exactly 0 over {h} heads \
                 x {t} rows ({where_})"
            )),
            None => Verdict::pass(format!(
                "all {future} future entries are exactly 0 over {h} heads x {t} rows ({where_})"
            )),
        }
    } else {
        Verdict::fail(fails.join("\n"))
    };
    v.metric("future_entries", masked as f64)
        .metric("future_nonzero", (nonzero + old_nonzero) as f64)
        .metric("future_max_abs", max_abs as f64)
}

/// RoPE is a rotation of each dim pair by position·θ_j. Without knowing θ (base,
/// scaling) we can still demand what every rotation satisfies: (1) at position
/// 0 it is the identity; (2) at positions > 0 it changes the vector (catches
/// "RoPE not applied"); (3) it preserves every pair's norm, which also catches
/// the wrong pairing (Neox vs interleaved) and scaling bugs.
/// `input`/`output` are [T, N, D]; positions[t] is the absolute position of row t.
///
/// Storage rounding. An engine storing stage outputs in f16/bf16 computes the
/// rotation in f32 and rounds it to storage, so the output is the exact
/// rotation r of the input times (1 + δ) per element with |δ| ≤ u, the unit
/// roundoff of the output's dtype (2^-24 f32, 2^-11 f16, 2^-8 bf16). Hence
/// (1) at position 0, |y − x| ≤ tol + u·|x| per element, and (3) a pair's norm
/// moves by at most ‖y − r‖ ≤ u·‖r‖ = u·‖x‖ on top of the f32 error:
/// |‖y‖ − ‖x‖| ≤ tol·max(‖x‖, 1) + u·‖x‖. This is a bound on rounding to the
/// stored type, not a loosening: it grants exactly one rounding of each output
/// value and nothing else, and for f32 storage it adds only 2^-24 relative. A
/// wrong angle, a scale or a wrong pairing changes norms or values by far more.
///
/// (4) The angle: every pair must be the input pair turned by
/// `position · theta^(-2j/D)` (pair j, the model's `theta`), so a wrong base,
/// a position that is off, frozen or wraps is caught wherever the run goes,
/// not only where goldens were recorded. Allowed residual per pair:
/// tol·max(‖x‖, 1) + (u + 4·2^-24 + angle·2^-22)·‖x‖ — one rounding to
/// storage, the f32 cos/sin and products, and the f32 angle itself (HF and
/// llama.cpp form `inv_freq·pos` in f32: its relative error is ~2^-23, which
/// at position 300 is ~1e-4 of a radian on the fastest pair). A wrong angle
/// moves the pair by ~|Δangle|·‖x‖, orders of magnitude more.
pub fn rope(input: &Tensor, output: &Tensor, positions: &[usize], style: RopeStyle, tol: f64, theta: f64) -> Verdict {
    let d = input.shape().last().copied().unwrap_or(0);
    rope_with(input, output, positions, style, tol, &RopeFormula::plain(theta, d))
}

/// `rope` against a given formula (a scaled RoPE's frequencies and factor).
pub fn rope_with(input: &Tensor, output: &Tensor, positions: &[usize], style: RopeStyle, tol: f64, f: &RopeFormula) -> Verdict {
    let rows: Vec<[usize; 3]> = positions.iter().map(|&p| [p, p, p]).collect();
    let d = input.shape().last().copied().unwrap_or(0);
    rope_axes(input, output, &rows, ["t", "h", "w"], &vec![0; d / 2], style, tol, f)
}

/// What a `rope` stage must equal: each pair turned by position·`inv_freq[j]`
/// (exact, f64) and multiplied by `scale` (a scaling's attention factor, 1
/// otherwise). `freq_rel` bounds how far the reference's own f32 frequencies
/// may be from `inv_freq`, relative (0 for plain θ^(−2j/D), whose f32
/// formation the 2^-22 of the angle already covers); `what` names the
/// formula in messages.
#[derive(Clone, Debug, PartialEq)]
pub struct RopeFormula {
    pub inv_freq: Vec<f64>,
    pub scale: f64,
    pub freq_rel: f64,
    pub what: String,
}

impl RopeFormula {
    /// Plain RoPE: θ^(−2j/D) over D/2 pairs.
    pub fn plain(theta: f64, head_dim: usize) -> RopeFormula {
        RopeFormula {
            inv_freq: (0..head_dim / 2)
                .map(|j| theta.powf(-((2 * j) as f64) / head_dim as f64))
                .collect(),
            scale: 1.0,
            freq_rel: 0.0,
            what: format!("position·theta^(-2j/D), theta {theta}"),
        }
    }
}

/// `rope` with multimodal positions: row t's pair j turns by
/// `positions[t][axes[j]]·inv_freq[j]` (M-RoPE: axes 0 t, 1 h, 2 w,
/// `model::vision::MRope`; a vision tower's 2-D rotary: h then w, each over
/// its own D/4 frequencies). A row is at position 0 when every axis is;
/// `names` name the axes and `theta` the base in messages (an axis named
/// `-` is unused).
#[allow(clippy::too_many_arguments)]
pub fn rope_axes(
    input: &Tensor,
    output: &Tensor,
    positions: &[[usize; 3]],
    names: [&str; 3],
    axes: &[usize],
    style: RopeStyle,
    tol: f64,
    f: &RopeFormula,
) -> Verdict {
    let inv_freq = &f.inv_freq[..];
    let m = f.scale;
    // The attention factor, rounded to f32 and multiplied into cos and sin
    // in f32: two more roundings where it is not 1.
    let extra = if m != 1.0 { 2.0 * 2f64.powi(-24) } else { 0.0 };
    if input.shape() != output.shape() {
        return Verdict::fail(format!(
            "rope: input shape {:?} vs output shape {:?}: both must be the same [T, N, D]",
            input.shape(),
            output.shape()
        ));
    }
    let &[t, n, d] = input.shape() else {
        return Verdict::fail(format!("rope: expected [T, N, D], got shape {:?}", input.shape()));
    };
    if d % 2 != 0 {
        return Verdict::fail(format!("rope: head dim D = {d} is odd; RoPE rotates pairs of dims"));
    }
    if positions.len() != t {
        return Verdict::fail(format!("rope: {} positions given for T = {t} rows", positions.len()));
    }
    if axes.len() != d / 2 || axes.iter().any(|&a| a > 2) || inv_freq.len() != d / 2 {
        return Verdict::fail(format!(
            "rope: {} frequency axes given for D/2 = {} frequencies",
            axes.len(),
            d / 2
        ));
    }
    // The position frequency j of row tt turns by.
    let pos = |tt: usize, j: usize| positions[tt][axes[j]];
    for (name, x) in [("input", input), ("output", output)] {
        if let Some(i) = x.data().iter().position(|v| !v.is_finite()) {
            return Verdict::fail(format!(
                "rope: {name} has non-finite value {} at index {:?}; rotation properties need finite values",
                x.data()[i],
                x.unravel(i)
            ));
        }
    }
    let (a, b) = (input.data(), output.data());
    // The unit roundoff of the stored output (see above).
    let dtype = output.dtype();
    let u = dtype.unit_roundoff();
    let bound_text = format!(
        "bound tol + u·|x| with u = 2^{} ({dtype} storage: the output is the f32 rotation rounded to {dtype})",
        u.log2() as i32
    );
    let pair_text = |tt: usize, hh: usize, j: usize| {
        let (i0, i1) = style.pair(j, d);
        let base = (tt * n + hh) * d;
        format!(
            "[t, head, pair] = [{tt}, {hh}, {j}] (dims {i0}, {i1}, position {}): input ({}, {}) output ({}, {})",
            pos(tt, j),
            a[base + i0],
            a[base + i1],
            b[base + i0],
            b[base + i1]
        )
    };
    let (mut pos0_rows, mut id_bad, mut id_max, mut id_first) = (0usize, 0usize, 0.0f64, None);
    let (mut checked, mut unrotated, mut skipped, mut unrot_first) = (0usize, 0usize, 0usize, None);
    let (mut norm_bad, mut norm_max, mut norm_first) = (0usize, 0.0f64, None);
    let (mut ang_bad, mut ang_max, mut ang_first) = (0usize, 0.0f64, None);
    for (tt, row) in positions.iter().enumerate() {
        let p = row.iter().copied().max().unwrap_or(0);
        pos0_rows += (p == 0) as usize;
        for hh in 0..n {
            let base = (tt * n + hh) * d;
            let (mut vec_diff, mut all_zero) = (0.0f64, true);
            for (j, &freq) in inv_freq.iter().enumerate() {
                let (i0, i1) = style.pair(j, d);
                let (x0, x1) = (a[base + i0] as f64, a[base + i1] as f64);
                let (y0, y1) = (b[base + i0] as f64, b[base + i1] as f64);
                let (nin, nout) = (x0.hypot(x1), y0.hypot(y1));
                let err = (nout - m * nin).abs() / nin.max(1.0);
                norm_max = norm_max.max(err);
                if (nout - m * nin).abs() > tol * nin.max(1.0) + (u + extra) * m * nin {
                    norm_bad += 1;
                    norm_first.get_or_insert((tt, hh, j, nin, nout));
                }
                all_zero &= nin <= tol;
                let angle = pos(tt, j) as f64 * freq;
                let (c, sn) = (angle.cos(), angle.sin());
                let (r0, r1) = (m * (x0 * c - x1 * sn), m * (x1 * c + x0 * sn));
                let resid = (y0 - r0).hypot(y1 - r1);
                let allowed = tol * nin.max(1.0)
                    + (u + extra + 4.0 * 2f64.powi(-24) + angle * (2f64.powi(-22) + f.freq_rel)) * m * nin;
                ang_max = ang_max.max(resid / nin.max(1.0));
                if resid > allowed {
                    ang_bad += 1;
                    ang_first.get_or_insert((tt, hh, j, angle, resid, allowed));
                }
                let diff = (y0 - m * x0).abs().max((y1 - m * x1).abs());
                vec_diff = vec_diff.max(diff);
                let identity_ok = (y0 - m * x0).abs() <= tol + (u + extra) * (m * x0).abs()
                    && (y1 - m * x1).abs() <= tol + (u + extra) * (m * x1).abs();
                if p == 0 && !identity_ok {
                    id_bad += 1;
                    id_first.get_or_insert((tt, hh, j));
                }
            }
            if p == 0 {
                id_max = id_max.max(vec_diff);
            } else if all_zero {
                skipped += 1; // a ~0 vector rotates to ~0: nothing observable
            } else {
                checked += 1;
                if vec_diff <= tol {
                    unrotated += 1;
                    unrot_first.get_or_insert((tt, hh, vec_diff));
                }
            }
        }
    }

    let mut failures = Vec::new();
    if let Some((tt, hh, j)) = id_first {
        failures.push(format!(
            "(1) not the identity at position 0: {id_bad} pairs differ by more than the {bound_text} (max |Δ| {}); first {}",
            sci(id_max),
            pair_text(tt, hh, j)
        ));
    }
    if let Some((tt, hh, diff)) = unrot_first {
        failures.push(format!(
            "(2) not rotated: {unrotated} of {checked} vectors at positions > 0 equal their input within tol; \
             first [t, head] = [{tt}, {hh}] at position {} (max |Δ| {}); e.g. {}",
            match positions[tt] {
                [a, b, c] if a == b && b == c => a.to_string(),
                r => format!(
                    "({})",
                    (0..3)
                        .filter(|&a| names[a] != "-")
                        .map(|a| format!("{} {}", names[a], r[a]))
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            },
            sci(diff),
            pair_text(tt, hh, 0)
        ));
    }
    if let Some((tt, hh, j, nin, nout)) = norm_first {
        failures.push(format!(
            "(3) pair norm not preserved: {norm_bad} pairs beyond tol·max(‖x‖, 1) + u·‖x‖, u = 2^{} \
             (one rounding to {dtype} storage) (max relative change {}); first {} \
             has norm {nin:.6} -> {nout:.6}{}",
            u.log2() as i32,
            sci(norm_max),
            pair_text(tt, hh, j),
            if id_bad == 0 && unrotated == 0 {
                "; wrong pairing (neox vs interleaved) or a scaled output?"
            } else {
                ""
            }
        ));
    }
    if let Some((tt, hh, j, angle, resid, allowed)) = ang_first {
        failures.push(format!(
            "(4) wrong rotation angle: {ang_bad} pairs are not the input turned by {}{}; first {}: expected \
             angle {angle:.6} rad, residual {} > allowed {} (wrong theta or scaling, or a wrong/frozen/wrapped \
             position?)",
            f.what,
            if m != 1.0 { format!(" times {m}") } else { String::new() },
            pair_text(tt, hh, j),
            sci(resid),
            sci(allowed)
        ));
    }
    let identity = if pos0_rows == 0 {
        "(1) identity at position 0: not applicable, no row at position 0 (decode step)".to_string()
    } else {
        format!(
            "(1) identity at position 0: max |Δ| {} over {pos0_rows} rows",
            sci(id_max)
        )
    };
    let head = format!(
        "rope ({}) on {:?}, positions {}, tol {tol:e} + {dtype} rounding u = 2^{}",
        style.name(),
        input.shape(),
        if positions.iter().all(|r| r[0] == r[1] && r[1] == r[2]) {
            describe_positions(&positions.iter().map(|r| r[0]).collect::<Vec<_>>())
        } else {
            let axis = |a: usize| describe_positions(&positions.iter().map(|r| r[a]).collect::<Vec<_>>());
            let shown: Vec<String> = (0..3)
                .filter(|&a| names[a] != "-")
                .map(|a| format!("{} {}", names[a], axis(a)))
                .collect();
            format!("per axis: {}", shown.join(", "))
        },
        u.log2() as i32
    );
    let v = if failures.is_empty() {
        let rotated = if checked == 0 {
            format!("(2) no nonzero vector at a position > 0 to check ({skipped} skipped as ~0)")
        } else {
            format!("(2) all {checked} vectors at positions > 0 rotated ({skipped} skipped as ~0)")
        };
        Verdict::pass(format!(
            "{head}: {identity}; {rotated}; (3) pair norms {} within {} relative; (4) every pair turned by \
             {} (max residual {} of max(‖x‖, 1))",
            if m != 1.0 { format!("times the attention factor {m}") } else { "preserved".into() },
            sci(norm_max),
            f.what,
            sci(ang_max)
        ))
    } else {
        if pos0_rows == 0 {
            failures.push(identity);
        }
        Verdict::fail(format!("{head}:\n{}", failures.join("\n")))
    };
    v.metric("pos0_rows", pos0_rows as f64)
        .metric("pos0_max_abs", id_max)
        .metric("identity_violations", id_bad as f64)
        .metric("rotated_checked", checked as f64)
        .metric("unrotated", unrotated as f64)
        .metric("skipped_zero", skipped as f64)
        .metric("norm_violations", norm_bad as f64)
        .metric("max_norm_err", norm_max)
        .metric("angle_violations", ang_bad as f64)
        .metric("max_angle_residual", ang_max)
        .metric("unit_roundoff", u)
}

#[cfg(test)]
mod tests;
