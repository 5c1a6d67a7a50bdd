//! The scaled policy's floor at one stage: the error a correct
//! implementation of a given arithmetic can reach there, judged for one
//! source X (an engine's captures or a reference) against the oracle O.
//!
//! floor = own + inherited, element by element where the stage is computed
//! from operands the floor can read, the largest over the judged elements:
//!
//! - **matmuls** (`q`/`k`/`v`, `attn_out`, `ffn_gate`/`ffn_up`/`ffn_out`,
//!   `logits`; `matmul`): with W the model file's weight, inherited is
//!   |W·Δx| exactly (Δx = X's error at the input: a linear map carries it
//!   exactly), and own is c·((u_acc·√K + u_w)·Σ|W·x| + u_store·|y| + q8),
//!   Σ|W·x| = Σ_j |W_ij·x_j| the magnitude the dot product's roundings scale
//!   with (not |y|, which cancellation makes small), q8 = |W·(Q(x) − x)| the
//!   effect of quantising the oracle's own input in the declared blocks,
//!   each block at its own largest magnitude;
//! - **attention** (`attention`): the scores, probabilities and context
//!   recomputed exactly from X's own q, keys, values and scores at every
//!   position (the keys and values of every step so far: the cache) against
//!   the same from the oracle's; own from Σ|q·k| and Σ p·|v|, the KV cache's
//!   roundings included;
//! - **elementwise stages** (`elementwise`): residual adds |Δa_j| + |Δb_j|;
//!   RMSNorm |y_j/x_j|·|Δx_j| + |y_j|·‖Δx‖/‖x‖ per row (exact to first order);
//!   RoPE √2·max|Δx| plus the f32 angle's u·P; SwiGLU
//!   1.13·|Δg_j|·|u_j| + |g_j|·|Δu_j|; own c·M·(u_acc·√K + u_store) (+ u_w
//!   where a stored weight is read, + the coarser activation's two roundings
//!   at ffn_act);
//! - anything else, or where an operand was not recorded: the relative
//!   error of the nearest recorded inputs carried to the stage times the
//!   map's measured gain (`estimated`): the only estimate, said so in `how`.
//!
//! Every term follows X's own measured errors, so a 16-bit engine's floor at
//! the last layer follows what its own storage did through every layer
//! before it, and a stage is judged on what it adds: a bug fails where it is.
//! Validated on every stage of every layer of the real models (docs/tolerances.md).

mod attention;
mod elementwise;
mod graph;
mod matmul;
pub mod q8;
mod vision;

use std::borrow::Cow;

use super::facts::Facts;
use crate::arithmetic::{Activations, Arithmetic, U_ACC};
use crate::golden::GoldenSet;
use crate::stage::{BlockStage, Stage, Step, VisionStage};
use crate::tensor::Tensor;

pub use graph::{cache_stage, floor_reads, inputs, matmul_input, reduction_len};

/// A floor and how it was formed.
#[derive(Clone, Debug, PartialEq)]
pub struct Floor {
    /// The largest own term over the judged elements…
    pub own: f64,
    /// …the largest inherited term…
    pub inherited: f64,
    /// …and the largest sum of both at one element (at most own + inherited).
    pub total: f64,
    /// For messages: the terms, e.g. `own 2.1e-5 (K 896, M 7.8) + inherited 4.3e-5 from blk.0.ffn_norm`.
    pub how: String,
}

impl Floor {
    pub fn total(&self) -> f64 {
        self.total
    }

    /// A floor whose two terms add at their largest elements.
    fn summed(own: f64, inherited: f64, how: String) -> Floor {
        Floor {
            own,
            inherited,
            total: own + inherited,
            how,
        }
    }
}

/// Where a floor is computed.
pub struct FloorAt<'a> {
    pub facts: &'a Facts<'a>,
    pub oracle: &'a GoldenSet,
    pub step: Step,
    pub arith: Arithmetic,
    /// The constant c.
    pub c: f64,
    /// An f32 reference other than the judged source (the estimated maps' gains).
    pub gain_ref: Option<&'a GoldenSet>,
}

/// A source's tensors as the floor reads them: (step, stage) → tensor.
pub type Source<'s> = dyn Fn(Step, Stage) -> Option<&'s Tensor> + 's;

fn max_abs(t: &Tensor) -> f64 {
    t.data()
        .iter()
        .filter(|x| x.is_finite())
        .fold(0.0f64, |m, x| m.max(x.abs() as f64))
}

/// |a − b| element by element (a non-finite `a` is an infinite error).
fn abs_diffs(a: &Tensor, b: &Tensor) -> Vec<f64> {
    a.data()
        .iter()
        .zip(b.data())
        .map(|(a, b)| {
            if a.is_finite() {
                (*a as f64 - *b as f64).abs()
            } else {
                f64::INFINITY
            }
        })
        .collect()
}

impl<'a> FloorAt<'a> {
    fn o(&self, s: Stage) -> Option<&'a Tensor> {
        self.oracle.get(self.step, s)
    }

    /// The inputs of `stage` at this step: a decode step has no image, so a
    /// VLM's fused embeddings are the token embeddings alone there.
    pub(super) fn inputs(&self, stage: Stage) -> Vec<Stage> {
        let mut v = inputs(self.facts.config, stage);
        if self.step != Step::Prefill {
            v.retain(|s| !matches!(s, Stage::Vision(_)));
        }
        v
    }

    /// The token rows a floor at `judged` is computed on: the rows the
    /// references kept of it (the last one of a last-row golden's logits),
    /// None for every row.
    pub(super) fn judged_rows(&self, judged: Stage) -> Option<Vec<usize>> {
        let t = self.facts.step_dims(self.step).0;
        let last_only = judged == Stage::Logits && self.o(judged).is_some_and(|o| o.shape().first() == Some(&1));
        if last_only && t > 1 {
            return Some(vec![t - 1]);
        }
        self.facts.rows_at(self.step, judged).map(<[usize]>::to_vec)
    }

    /// `t`, a tensor of stage `s` at this step, on the token rows `want`
    /// (None: every row), whichever rows it holds: every row of the step (an
    /// engine's capture, a golden's auxiliary recording) or the rows the
    /// references kept of `s`. None where it holds neither or lacks a row.
    pub(super) fn view<'t>(&self, t: &'t Tensor, s: Stage, want: Option<&[usize]>) -> Option<Cow<'t, Tensor>> {
        let Some(axis) = s.row_axis() else {
            return Some(Cow::Borrowed(t));
        };
        let n = self.facts.step_dims(self.step).0;
        let len = *t.shape().get(axis)?;
        let held: Vec<usize> = if len == n {
            (0..n).collect()
        } else if s == Stage::Logits && len == 1 {
            vec![n - 1]
        } else {
            let r = self.facts.rows_at(self.step, s)?;
            if r.len() != len {
                return None;
            }
            r.to_vec()
        };
        let Some(want) = want else {
            return (len == n).then_some(Cow::Borrowed(t));
        };
        let idx: Vec<usize> = want
            .iter()
            .map(|w| held.iter().position(|h| h == w))
            .collect::<Option<_>>()?;
        if idx.len() == len && idx.iter().enumerate().all(|(i, j)| i == *j) {
            Some(Cow::Borrowed(t))
        } else {
            Some(Cow::Owned(t.select_rows(axis, &idx)))
        }
    }

    /// X's and the oracle's tensors of `s` at this step on the rows `want`,
    /// of one shape.
    pub(super) fn pair<'s>(
        &self,
        x: &Source<'s>,
        s: Stage,
        want: Option<&[usize]>,
    ) -> Option<(Cow<'s, Tensor>, Cow<'a, Tensor>)> {
        let xt = self.view(x(self.step, s)?, s, want)?;
        let ot = self.view(self.o(s)?, s, want)?;
        (xt.shape() == ot.shape()).then_some((xt, ot))
    }

    /// Per-element |X − O| at `s` on the rows `want`.
    fn diffs<'s>(&self, x: &Source<'s>, s: Stage, want: Option<&[usize]>) -> Option<Vec<f64>> {
        let (xt, ot) = self.pair(x, s, want)?;
        Some(abs_diffs(&xt, &ot))
    }

    /// max|X − O| at `s` on the rows `want`.
    fn err<'s>(&self, x: &Source<'s>, s: Stage, want: Option<&[usize]>) -> Option<f64> {
        self.diffs(x, s, want).map(|d| d.into_iter().fold(0.0f64, f64::max))
    }

    /// `e` relative to the oracle's magnitude at `s` on the rows `want`.
    fn rel(&self, e: f64, s: Stage, want: Option<&[usize]>) -> Option<f64> {
        let v = self.view(self.o(s)?, s, want)?;
        let m = max_abs(&v);
        (m > 0.0).then(|| e / m)
    }

    /// The map's conditioning from `from` to `to`, from the gain reference.
    fn gain(&self, from: Stage, to: Stage, want: Option<&[usize]>) -> f64 {
        let Some(g) = self.gain_ref else { return 1.0 };
        let src = |st: Step, s: Stage| g.get(st, s);
        let e = |s: Stage| self.err(&src, s, want).and_then(|e| self.rel(e, s, want));
        match (e(to), e(from)) {
            (Some(t), Some(f)) if f > 0.0 && t.is_finite() => (t / f).max(1.0),
            _ => 1.0,
        }
    }

    /// What the stage's own arithmetic rounds, relative to M (the KV term
    /// of attn_ctx is taken relative to v's magnitude, which bounds ctx's).
    fn own_rel(&self, stage: Stage, notes: &mut Vec<String>) -> f64 {
        let cfg = self.facts.config;
        let a = self.arith;
        let s = self.facts.step_dims(self.step).1;
        let k = reduction_len(cfg, stage, s);
        let mut own = self.c * (U_ACC * (k as f64).sqrt() + a.u_store());
        notes.push(format!("K {k}"));
        let reads_weights = (matmul_input(stage).is_some() && !graph::is_moe_sum(cfg, stage))
            || matches!(
                stage,
                Stage::Embed
                    | Stage::OutputNorm
                    | Stage::Block(
                        _,
                        BlockStage::AttnNorm
                            | BlockStage::FfnNorm
                            | BlockStage::QNorm
                            | BlockStage::KNorm
                            | BlockStage::AttnPostNorm
                            | BlockStage::FfnPostNorm
                    )
            );
        if reads_weights {
            own += self.c * a.u_weight();
        }
        let projection_input = matmul_input(stage).filter(|_| !graph::is_moe_sum(cfg, stage));
        if let (Some(input), Activations::Q8 { block }) = (projection_input, a.activations) {
            let rho = self
                .o(input)
                .map_or(q8::q8_rel_error_bound(block), |t| q8::q8_rel_error(t, block));
            own += self.c * rho;
            notes.push(format!("q8 ρ {rho:.2e}"));
        }
        // Pixels read coarser than storage (ggml's f16 im2col): each input of
        // the patch embedding's dot products is off by u_patch relatively.
        if stage == Stage::Vision(VisionStage::PatchEmbed) && a.u_patch() > 0.0 {
            own += self.c * a.u_patch();
            notes.push(format!("patch input {}", a.patch));
        }
        if let Stage::Block(_, b) = stage {
            match b {
                // y = x₁·cos − x₂·sin evaluated at the storage's precision (HF
                // at bf16 holds cos and sin in bf16 and rounds each product and
                // the sum): two roundings of each of two products of a pair of
                // norm ≤ √2·M, and one of the sum, beyond the one storing
                // already counts: 2√2·u_store·M; plus the f32 angle's u·P.
                BlockStage::QRope | BlockStage::KRope => {
                    let p = s.saturating_sub(1) as f64;
                    own += self.c * (U_ACC * p + 2.0 * 2f64.sqrt() * a.u_store());
                    notes.push(format!("rotation at {} and angle u·P, P {p}", a.storage));
                }
                // The cache's rounding of k (v), and of the operand a kernel
                // converts to the cache's type to multiply with it (ggml
                // rounds q and the probabilities to f16 for an f16 cache).
                BlockStage::AttnScores | BlockStage::AttnCtx => own += self.c * 2.0 * a.u_kv(),
                // An activation evaluated coarser than storage rounds its input
                // (|g·act'(g)| ≤ 1.13·|g|) and its result once each.
                BlockStage::FfnAct if a.u_act() > 0.0 => {
                    own += self.c * 2.13 * a.u_act();
                    notes.push(format!("act {}", a.act));
                }
                _ => {}
            }
        }
        own
    }

    /// The floor of X at `stage` (M = max|O| there, the caller's view).
    pub fn floor<'s>(&self, stage: Stage, m: f64, x: &Source<'s>) -> Floor {
        let want = self.judged_rows(stage);
        let want = want.as_deref();
        if let Some(f) = matmul::floor(self, stage, x, want) {
            return f;
        }
        if let Some(f) = attention::floor(self, stage, x, want) {
            return f;
        }
        let mut notes = vec![format!("M {m:.3e}")];
        let own = m * self.own_rel(stage, &mut notes);
        let (inherited, from) = match self.direct(stage, m, x, want) {
            Some(v) => v,
            None => self.estimated(stage, m, x, want),
        };
        Floor::summed(
            own,
            inherited,
            format!(
                "own {own:.2e} ({}) + inherited {inherited:.2e} ({from})",
                notes.join(", ")
            ),
        )
    }

    /// Inherited from the direct inputs, when X and O hold them all.
    fn direct<'s>(&self, stage: Stage, m: f64, x: &Source<'s>, want: Option<&[usize]>) -> Option<(f64, String)> {
        use BlockStage::*;
        let cfg = self.facts.config;
        let ins = self.inputs(stage);
        if ins.is_empty() {
            return Some((0.0, "no input".into()));
        }
        let named = |v: f64| {
            Some((
                v,
                format!(
                    "from {}",
                    ins.iter().map(|s| s.to_string()).collect::<Vec<_>>().join(", ")
                ),
            ))
        };
        if graph::is_moe_sum(cfg, stage) {
            return match ins[..] {
                [a, b] => self.residual(x, a, b, want).and_then(named),
                _ => named(self.err(x, ins[0], want)?),
            };
        }
        if let Some(input) = matmul_input(stage) {
            // No weight at hand (`matmul` answered first where there is one):
            // the relative input error times the map's measured gain.
            let rel = self.rel(self.err(x, input, want)?, input, want)?;
            let g = self.gain(input, stage, want);
            return Some((rel * m * g, format!("from {input}: relative {rel:.2e}, gain {g:.2}")));
        }
        match stage {
            Stage::OutputNorm => self.norm(stage, ins[0], x, cfg.hidden, want).and_then(named),
            Stage::SampleProbs => {
                // softmax(l/T) over the kept tokens, from the step's last
                // logits row: |Δp_j| ≤ p_j(|Δl_j| + Σ_k p_k|Δl_k|)/T ≤ 2·M·e/T.
                let crate::sampling::Sampling::Random { temperature, .. } = *self.facts.sampling else {
                    return None;
                };
                let d = self.diffs(x, Stage::Logits, None)?;
                let last = d.get(d.len().checked_sub(cfg.vocab)?..)?;
                let e = last.iter().fold(0.0f64, |a, b| a.max(*b));
                (temperature > 0.0).then_some(())?;
                named(2.0 * m * e / temperature as f64)
            }
            Stage::Block(l, b) => {
                let s = |b| Stage::Block(l, b);
                match b {
                    AttnNorm | FfnNorm | AttnPostNorm | FfnPostNorm => {
                        self.norm(stage, ins[0], x, cfg.hidden, want).and_then(named)
                    }
                    QNorm | KNorm => self.norm(stage, ins[0], x, cfg.head_dim, want).and_then(named),
                    QRope | KRope => named(2f64.sqrt() * self.err(x, ins[0], want)?),
                    AttnScores => {
                        let rq = self.rel(self.err(x, ins[0], want)?, ins[0], want)?;
                        let rk = self.rel(self.err(x, ins[1], want)?, ins[1], want)?;
                        Some((
                            (rq + rk) * m,
                            "estimated from q/k's relative errors: no key cache recorded".into(),
                        ))
                    }
                    AttnProbs => named(2.0 * m * self.err(x, s(AttnScores), want)?),
                    AttnCtx => {
                        let ov = self.view(self.o(s(V))?, s(V), want)?;
                        let mv = max_abs(&ov);
                        Some((
                            2.0 * self.err(x, s(AttnScores), want)? * mv + self.err(x, s(V), want)?,
                            "estimated from the scores and v: no value cache recorded".into(),
                        ))
                    }
                    FfnInp | Out => self.residual(x, ins[0], ins[1], want).and_then(named),
                    FfnAct => self.swiglu(x, l, want).and_then(named),
                    _ => None,
                }
            }
            _ => None,
        }
    }

    /// Inherited where X or O lacks a direct input: each input's relative
    /// error, measured where both hold it, else estimated as its own
    /// relative rounding plus the largest estimate among its inputs (down to
    /// `embed`), carried relatively (times the measured gain where there is
    /// one) to this stage.
    fn estimated<'s>(&self, stage: Stage, m: f64, x: &Source<'s>, want: Option<&[usize]>) -> (f64, String) {
        let mut memo = std::collections::HashMap::new();
        let ins = self.inputs(stage);
        let worst = ins
            .iter()
            .map(|i| (self.rel_est(*i, x, want, &mut memo) * self.gain(*i, stage, want), *i))
            .fold(
                (0.0f64, None),
                |(w, at), (v, i)| if v > w { (v, Some(i)) } else { (w, at) },
            );
        let how = match worst.1 {
            Some(i) => format!("estimated through {i}, not recorded: relative {:.2e}", worst.0),
            None => "no input".into(),
        };
        (worst.0 * m, how)
    }

    fn rel_est<'s>(
        &self,
        s: Stage,
        x: &Source<'s>,
        want: Option<&[usize]>,
        memo: &mut std::collections::HashMap<Stage, f64>,
    ) -> f64 {
        if let Some(v) = memo.get(&s) {
            return *v;
        }
        let v = match self.err(x, s, want).and_then(|e| self.rel(e, s, want)) {
            Some(r) => r,
            None => {
                let own = self.own_rel(s, &mut Vec::new());
                let up = self
                    .inputs(s)
                    .into_iter()
                    .map(|i| self.rel_est(i, x, want, memo))
                    .fold(0.0f64, f64::max);
                own + up
            }
        };
        memo.insert(s, v);
        v
    }
}

/// A golden's tensors as the floor reads them.
pub fn of_golden<'g>(g: &'g GoldenSet) -> impl Fn(Step, Stage) -> Option<&'g Tensor> + 'g {
    move |st, s| g.get(st, s)
}
