//! Inherited terms of the stages computed element by element (or row by
//! row) from their inputs, derived to first order from X's own measured
//! errors there: residual adds, RMSNorm, the gated activation, and the row
//! floors of a residual add.

use super::graph::act_slope_bound;
use super::{abs_diffs, FloorAt, Source};
use crate::stage::{BlockStage, Stage};

impl<'a> FloorAt<'a> {
    /// A residual add a + b: max_j |Δa_j| + |Δb_j|.
    pub(super) fn residual<'s>(&self, x: &Source<'s>, a: Stage, b: Stage, want: Option<&[usize]>) -> Option<f64> {
        let (da, db) = (self.diffs(x, a, want)?, self.diffs(x, b, want)?);
        (da.len() == db.len()).then(|| da.iter().zip(&db).fold(0.0f64, |m, (p, q)| m.max(p + q)))
    }

    /// SwiGLU/GeGLU act = act(g)·u: |act'| bounded, |act(g)| ≤ |g|, so
    /// |Δ| ≤ slope·|Δg_j|·|u_j| + |g_j|·|Δu_j|.
    pub(super) fn swiglu<'s>(&self, x: &Source<'s>, l: usize, want: Option<&[usize]>) -> Option<f64> {
        let s = |b| Stage::Block(l, b);
        let slope = act_slope_bound(self.facts.config.act);
        let (xg, og) = self.pair(x, s(BlockStage::FfnGate), want)?;
        let (xu, ou) = self.pair(x, s(BlockStage::FfnUp), want)?;
        if og.data().len() != ou.data().len() {
            return None;
        }
        let (dg, du) = (abs_diffs(&xg, &og), abs_diffs(&xu, &ou));
        Some((0..dg.len()).fold(0.0f64, |mx, j| {
            let (gj, uj) = (og.data()[j].abs() as f64, ou.data()[j].abs() as f64);
            mx.max(slope * dg[j] * uj + gj * du[j])
        }))
    }

    /// RMSNorm's first-order transfer, rows of `n` values:
    /// |Δy_j| ≤ |y_j/x_j|·|Δx_j| + |y_j|·‖Δx‖/‖x‖, the ratio y_j/x_j and the
    /// norms read off the oracle (where x_j = 0, y_j = 0 and the term is 0).
    pub(super) fn norm<'s>(
        &self,
        stage: Stage,
        input: Stage,
        x: &Source<'s>,
        n: usize,
        want: Option<&[usize]>,
    ) -> Option<f64> {
        let yo = self.view(self.o(stage)?, stage, want)?;
        let (xi, xo) = self.pair(x, input, want)?;
        let dx = abs_diffs(&xi, &xo);
        let n_all = xo.data().len();
        if yo.data().len() != n_all || n == 0 || n_all % n != 0 {
            return None;
        }
        let mut worst = 0.0f64;
        for ((yr, xr), dr) in yo.data().chunks(n).zip(xo.data().chunks(n)).zip(dx.chunks(n)) {
            let xn = xr.iter().map(|v| (*v as f64).powi(2)).sum::<f64>().sqrt();
            let dn = dr.iter().map(|v| v * v).sum::<f64>().sqrt();
            let rel = if xn > 0.0 { dn / xn } else { 0.0 };
            for j in 0..n {
                let (y, xv) = (yr[j] as f64, xr[j] as f64);
                let ratio = if xv != 0.0 { (y / xv).abs() } else { 0.0 };
                worst = worst.max(ratio * dr[j] + y.abs() * rel);
            }
        }
        Some(worst)
    }

    /// One floor per token row at a residual add (`ffn_inp`, `out`), where X
    /// and O hold both inputs A and B: row t's floor is
    /// `own_rel·M_t + max_{j∈t}(|ΔA_j| + |ΔB_j|)` with
    /// `M_t = max_{j∈t}(|A_j| + |B_j|)` over the oracle's inputs. A sum is
    /// formed element by element, so row t's error is what row t's inputs
    /// carry plus its own roundings — |ΔA_j| + |ΔB_j| + u·(|A_j| + |B_j|)
    /// for the oracle's stored inputs and u_store·|A_j + B_j| for the sum,
    /// both within `own_rel·M_t` — and nothing of another row reaches it.
    /// The stage-wide floor takes M over every row, which on a real model is
    /// the first token's outlier features (hundreds of times the other
    /// rows'): a change confined to a quiet row hides under it, but not
    /// under that row's own floor. Rows of the judged view, in order; None
    /// at other stages or where an input is missing or misshapen.
    pub fn row_floors<'s>(&self, stage: Stage, x: &Source<'s>) -> Option<Vec<f64>> {
        let Stage::Block(_, BlockStage::FfnInp | BlockStage::Out) = stage else {
            return None;
        };
        let want = self.judged_rows(stage);
        let want = want.as_deref();
        let ins = self.inputs(stage);
        let (xa, oa) = self.pair(x, ins[0], want)?;
        let (xb, ob) = self.pair(x, ins[1], want)?;
        let (da, db) = (abs_diffs(&xa, &oa), abs_diffs(&xb, &ob));
        let (n, len) = (self.facts.config.hidden, da.len());
        if n == 0 || len % n != 0 || db.len() != len {
            return None;
        }
        let own = self.own_rel(stage, &mut Vec::new());
        let rows = (0..len / n).map(|t| {
            let r = t * n..(t + 1) * n;
            let (a, b) = (&oa.data()[r.clone()], &ob.data()[r.clone()]);
            let m = a
                .iter()
                .zip(b)
                .fold(0.0f64, |m, (a, b)| m.max((*a as f64).abs() + (*b as f64).abs()));
            let inherited = da[r.clone()].iter().zip(&db[r]).fold(0.0f64, |m, (a, b)| m.max(a + b));
            own * m + inherited
        });
        Some(rows.collect())
    }
}
