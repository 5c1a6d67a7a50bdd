//! The floor at a projection stage y = W·x (+ b), from the model file's
//! weight W (as `linear` reads it) and the operands, element by element:
//!
//! - inherited: |W_i·Δx| with Δx = X's error at the input on the judged
//!   rows. A linear map carries an input error exactly, so this is what a
//!   correct implementation fed X's own input gives, to the last bit of f64;
//!   no gain is measured and none assumed;
//! - own: c·((u_acc·√K + u_w)·S_i + u_store·|y_i| + q8_i), with
//!   S_i = Σ_j |W_ij·x_j| plus |b_i| over the oracle's input. A dot product's roundings scale with
//!   S_i, not with |y_i|: where the terms cancel (a large bias against the
//!   product, attention logits of hundreds summing to a few) |y_i| would ask
//!   for less than any correct f32 or 16-bit sum can reach. u_w is the stored
//!   weight's rounding (16-bit storage), q8_i = |W_i·(Q(x) − x)| the effect of
//!   quantising the oracle's input to 8 bits in the declared blocks, each
//!   block at its own largest magnitude (an outlier row loses its small
//!   entries; a quiet row does not), and u_kv·|y| at k/v where a coarser cache
//!   holds them.
//!
//! The oracle-only terms are computed once per plan (`Facts::shared`).

use std::sync::Arc;

use rayon::prelude::*;

use super::{q8, reduction_len, Floor, FloorAt, Source};
use crate::arithmetic::{Activations, U_ACC};
use crate::checks::exact_dot::{dot_and_abs, dot_f64};
use crate::checks::projection::{projection, weight_and_bias};
use crate::stage::{BlockStage, Stage};
use crate::tensor::Tensor;

/// What the oracle alone sets at a projection, per element of the judged
/// rows (row-major `[row][output]`).
#[derive(Debug)]
pub struct MatmulTerms {
    /// S_i = Σ_j |W_ij·x_j| + |b_i| over the oracle's input.
    abs: Vec<f64>,
    /// |W_i·(Q(x) − x)|: empty without 8-bit activations.
    q8: Vec<f64>,
    /// The weight's HF name (for messages).
    weight: String,
}

/// The floor at a projection stage, or None where the stage is not one, the
/// weight cannot be read, or X or the oracle lacks the input on the judged
/// rows (the caller then estimates).
pub(super) fn floor<'s>(at: &FloorAt, stage: Stage, x: &Source<'s>, want: Option<&[usize]>) -> Option<Floor> {
    let (input, wname) = projection(stage)?;
    let (xi, xo) = at.pair(x, input, want)?;
    let yo = at.view(at.o(stage)?, stage, want)?;
    let block = match at.arith.activations {
        Activations::Q8 { block } => block,
        Activations::Exact => 0,
    };
    let compute = || terms(at, &wname, &xo, &yo, block).map(Arc::new);
    // Oracle-only: the same in every run of the plan, for these rows.
    let terms = match at.facts.shared {
        Some(memo) => memo.get_or(
            format!(
                "matmul terms {} {stage} {block} {want:?} {}",
                at.step,
                at.facts.goldens_key()
            ),
            compute,
        )?,
        None => compute()?,
    };
    let (w, _, _) = weight_and_bias(at.facts, &wname).ok()?;
    let n = w.shape()[1];
    let out = w.shape()[0];
    let rows = xo.numel() / n;
    if terms.abs.len() != rows * out || yo.numel() != rows * out {
        return None;
    }
    let dx: Vec<f64> = xi
        .data()
        .iter()
        .zip(xo.data())
        .map(|(a, b)| {
            if a.is_finite() {
                *a as f64 - *b as f64
            } else {
                f64::INFINITY
            }
        })
        .collect();
    // |W_i·Δx_r|, weight rows in parallel (each against every judged row).
    let inherited: Vec<Vec<f64>> = w
        .data()
        .par_chunks_exact(n)
        .map(|wr| (0..rows).map(|r| dot_f64(wr, &dx[r * n..(r + 1) * n]).abs()).collect())
        .collect();
    let ar = at.arith;
    let k = reduction_len(at.facts.config, stage, at.facts.step_dims(at.step).1);
    let per_abs = U_ACC * (k as f64).sqrt() + ar.u_weight();
    let kv = matches!(stage, Stage::Block(_, BlockStage::K | BlockStage::V));
    let per_y = ar.u_store() + if kv { ar.u_kv() } else { 0.0 };
    let (mut own, mut inh, mut total, mut s_max, mut q_max) = (0.0f64, 0.0f64, 0.0f64, 0.0f64, 0.0f64);
    for r in 0..rows {
        for (i, inh_i) in inherited.iter().enumerate() {
            let e = r * out + i;
            let q = terms.q8.get(e).copied().unwrap_or(0.0);
            let o = at.c * (per_abs * terms.abs[e] + per_y * (yo.data()[e] as f64).abs() + q);
            let h = inh_i[r];
            own = own.max(o);
            inh = inh.max(h);
            total = total.max(o + h);
            s_max = s_max.max(terms.abs[e]);
            q_max = q_max.max(q);
        }
    }
    let q8 = if block > 0 {
        format!(", q8 effect ≤ {q_max:.2e}")
    } else {
        String::new()
    };
    Some(Floor {
        own,
        inherited: inh,
        total,
        how: format!(
            "own ≤ {own:.2e} (K {k}, Σ|W·x| ≤ {s_max:.3e}{q8}) + inherited ≤ {inh:.2e} (|W·Δx| from {input}, \
             `{}` exact)",
            terms.weight
        ),
    })
}

/// The oracle-only terms of one projection on the judged rows.
fn terms(at: &FloorAt, wname: &str, xo: &Tensor, yo: &Tensor, block: usize) -> Option<MatmulTerms> {
    let (w, b, name) = weight_and_bias(at.facts, wname).ok()?;
    let [out, n] = *w.shape() else { return None };
    if n == 0
        || !xo.numel().is_multiple_of(n)
        || yo.numel() != xo.numel() / n * out
        || b.as_ref().is_some_and(|b| b.numel() != out)
    {
        return None;
    }
    let rows = xo.numel() / n;
    let xd = xo.data();
    let qerr = (block > 0).then(|| q8::q8_error(xd, n, block));
    let per_w: Vec<(Vec<f64>, Vec<f64>)> = w
        .data()
        .par_chunks_exact(n)
        .enumerate()
        .map(|(i, wr)| {
            let bi = b.as_ref().map_or(0.0, |b| b.data()[i] as f64).abs();
            let abs = (0..rows)
                .map(|r| dot_and_abs(wr, &xd[r * n..(r + 1) * n]).1 + bi)
                .collect();
            let q = match &qerr {
                Some(qe) => (0..rows).map(|r| dot_f64(wr, &qe[r * n..(r + 1) * n]).abs()).collect(),
                None => Vec::new(),
            };
            (abs, q)
        })
        .collect();
    let mut abs = vec![0.0; rows * out];
    let mut q8v = if block > 0 { vec![0.0; rows * out] } else { Vec::new() };
    for (i, (a, q)) in per_w.into_iter().enumerate() {
        for r in 0..rows {
            abs[r * out + i] = a[r];
            if let Some(v) = q.get(r) {
                q8v[r * out + i] = *v;
            }
        }
    }
    Some(MatmulTerms {
        abs,
        q8: q8v,
        weight: name,
    })
}
