//! The scaled policy's floor at one stage: the error a correct
//! implementation of a given arithmetic can reach there, judged for one
//! source X (an engine's captures or a reference) against the oracle O.
//!
//! floor = own + inherited:
//!
//! - **own**: what the stage's own arithmetic rounds, `c·M·(u_acc·√K +
//!   u_store)` (K terms summed in f32, the result stored once; M = max|O|),
//!   plus `c·M·u_w` where the stage reads stored weights (16-bit storage
//!   rounds each weight once: a dot product's error from it is about u_w·M),
//!   plus, where activations are quantised before a matmul, `c·M·ρ_q` with
//!   ρ_q the relative RMS error that quantising the oracle's own input in
//!   the declared blocks causes (computed, not assumed), plus one KV-cache
//!   rounding where k or v are read from a coarser cache, plus at ffn_act
//!   two roundings (its input and its result) of a gate activation
//!   evaluated coarser than storage (`Arithmetic::act`: llama.cpp's CPU GELU
//!   reads an f16 table at an f16 input).
//! - **inherited**: what X's errors at the stage's direct inputs become at
//!   the stage, to first order, from X's own measured errors there (so a
//!   stage is judged on what it adds, and a bug fails where it is):
//!   - residual adds: |Δa_j| + |Δb_j| per element;
//!   - RMSNorm y = w·x/rms(x): Δy_j = (y_j/x_j)·Δx_j − y_j·Δrms/rms, with
//!     y_j/x_j read off the oracle's input and output and Δrms/rms ≤
//!     ‖Δx‖/‖x‖ per row — exact to first order, no weights needed;
//!   - RoPE rotates pairs: |Δy| ≤ √2·max|Δx|, plus the angle's rounding u·P;
//!   - scores q·k: (e_q/M_q + e_k/M_k)·M;
//!   - softmax: |Δp_j| ≤ p_j(|Δs_j| + Σp_k|Δs_k|) ≤ 2·M·e_scores;
//!   - sample_probs = softmax(l/T) over the kept tokens: 2·M·e_logits/T,
//!     e_logits over the step's last logits row;
//!   - attn_ctx = Σ p_j v_j: Σ|Δp_j| ≤ 2·e_scores, so 2·e_scores·M_v + e_v;
//!   - SwiGLU act = silu(g)·u: 1.1·|Δg_j|·|u_j| + |g_j|·|Δu_j| (|silu'| ≤ 1.1,
//!     |silu(g)| ≤ |g|; GeGLU's gelu_tanh: |gelu'| ≤ 1.13, |gelu(g)| ≤ |g|);
//!   - matmuls y = W·x: X's relative error at x times M, times the map's
//!     conditioning on this input, `gain = max(1, ρ_ref(y)/ρ_ref(x))`
//!     measured from an f32 reference's own rounding errors at the same
//!     stages (the same map applied to a perturbation of the same random
//!     kind; 1 when there is none). Without W a matmul's transfer cannot be
//!     derived from the tensors alone: this measures it instead of assuming.
//!
//! A direct input the oracle (or X) did not record is replaced by the
//! nearest recorded residual stream upstream (`blk.{i}.out`, `embed`),
//! transferred relatively with its measured gain. Validated on every stage
//! of all 24 layers of the real Qwen2.5-0.5B at prefill and decode4 for HF
//! at f32, bf16 and f16 and llama.cpp with 8-bit activations: the measured
//! table is in docs/tolerances.md.

use super::facts::Facts;
use crate::arithmetic::{Activations, Arithmetic, U_ACC};
use crate::golden::GoldenSet;
mod vision;

use crate::stage::{BlockStage, Stage, Step, VisionStage};
use crate::tensor::Tensor;
use vision::{vision_inputs, vision_reduction_len};

/// A floor and how it was formed.
#[derive(Clone, Debug, PartialEq)]
pub struct Floor {
    pub own: f64,
    pub inherited: f64,
    /// For messages: the terms, e.g. `own 2.1e-5 (K 896, M 7.8) + inherited 4.3e-5 from blk.0.ffn_norm (gain 3.5)`.
    pub how: String,
}

impl Floor {
    pub fn total(&self) -> f64 {
        self.own + self.inherited
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
    /// An f32 reference other than the judged source (the maps' gains).
    pub gain_ref: Option<&'a GoldenSet>,
}

type Source<'s> = dyn Fn(Stage) -> Option<&'s Tensor> + 's;

/// The number of terms summed to produce one element of `stage`: the
/// dimension whose rounding errors accumulate there. `s` is the step's KV
/// length. Stages that copy or rotate inherit the reduction of their input.
pub fn reduction_len(cfg: &crate::model::ModelConfig, stage: Stage, s: usize) -> usize {
    let e = cfg.hidden;
    match stage {
        Stage::Vision(v) => vision_reduction_len(cfg, v, s),
        Stage::Embed | Stage::InputsEmbeds | Stage::Positions => 1,
        Stage::OutputNorm | Stage::Logits => e,
        Stage::SampleProbs => cfg.vocab,
        Stage::Block(_, b) => match b {
            BlockStage::AttnNorm | BlockStage::FfnNorm | BlockStage::AttnPostNorm | BlockStage::FfnPostNorm => e,
            BlockStage::Q | BlockStage::K | BlockStage::V => e,
            BlockStage::QNorm | BlockStage::KNorm => cfg.head_dim,
            BlockStage::QRope | BlockStage::KRope => e,
            BlockStage::AttnScores => cfg.head_dim,
            BlockStage::AttnProbs | BlockStage::AttnCtx => s,
            BlockStage::AttnOut | BlockStage::FfnInp => cfg.heads * cfg.head_dim,
            BlockStage::FfnGate | BlockStage::FfnUp | BlockStage::FfnAct => e,
            BlockStage::FfnOut | BlockStage::Out => cfg.ffn,
            BlockStage::Deepstack => 1,
        },
    }
}

/// The stages whose values a stage is computed from (the residual stream
/// entering block l is `blk.{l-1}.out`, or `embed` for block 0).
pub fn inputs(cfg: &crate::model::ModelConfig, stage: Stage) -> Vec<Stage> {
    use BlockStage::*;
    // A VLM's block 0 reads the fused embeddings, and a layer followed by a
    // deepstack add hands on its result.
    let deep = cfg.vision.as_ref().map_or(0, |v| v.deepstack.len());
    let resid = |l: usize| match l {
        0 if cfg.vision.is_some() => Stage::InputsEmbeds,
        0 => Stage::Embed,
        l if l - 1 < deep => Stage::Block(l - 1, Deepstack),
        l => Stage::Block(l - 1, Out),
    };
    match stage {
        Stage::Vision(v) => vision_inputs(cfg, v),
        Stage::Embed | Stage::Positions => vec![],
        Stage::InputsEmbeds => {
            let mut v = vec![Stage::Embed];
            if cfg.vision.is_some() {
                v.push(Stage::Vision(VisionStage::Merger));
            }
            v
        }
        Stage::SampleProbs => vec![Stage::Logits],
        Stage::OutputNorm => vec![resid(cfg.layers)],
        Stage::Logits => vec![Stage::OutputNorm],
        Stage::Block(l, b) => {
            let s = |b| Stage::Block(l, b);
            match b {
                AttnNorm => vec![resid(l)],
                Q | K | V => vec![s(AttnNorm)],
                QNorm => vec![s(Q)],
                KNorm => vec![s(K)],
                QRope => vec![s(if cfg.qk_norm { QNorm } else { Q })],
                KRope => vec![s(if cfg.qk_norm { KNorm } else { K })],
                AttnScores => vec![s(QRope), s(KRope)],
                AttnProbs => vec![s(AttnScores)],
                AttnCtx => vec![s(AttnScores), s(V)],
                AttnOut => vec![s(AttnCtx)],
                AttnPostNorm => vec![s(AttnOut)],
                FfnInp => vec![resid(l), s(if cfg.post_norms { AttnPostNorm } else { AttnOut })],
                FfnNorm => vec![s(FfnInp)],
                FfnGate | FfnUp => vec![s(FfnNorm)],
                FfnAct => vec![s(FfnGate), s(FfnUp)],
                FfnOut => vec![s(FfnAct)],
                FfnPostNorm => vec![s(FfnOut)],
                Out => vec![s(FfnInp), s(if cfg.post_norms { FfnPostNorm } else { FfnOut })],
                Deepstack => {
                    let mut v = vec![s(Out)];
                    if l < deep {
                        v.push(Stage::Vision(VisionStage::Deepstack(l)));
                    }
                    v
                }
            }
        }
    }
}

/// A bound on |act'| over the reals (and |act(g)| ≤ |g| for both): SiLU's
/// derivative peaks at 1.0998; GELU-tanh's at 1.1289 (x ≈ 2.4).
fn act_slope_bound(act: crate::model::config::Activation) -> f64 {
    match act {
        crate::model::config::Activation::Silu => 1.1,
        crate::model::config::Activation::GeluTanh => 1.13,
    }
}

/// Matmul stages and the stage they multiply.
fn matmul_input(stage: Stage) -> Option<Stage> {
    use BlockStage::*;
    match stage {
        Stage::Logits => Some(Stage::OutputNorm),
        Stage::Block(l, Q | K | V) => Some(Stage::Block(l, AttnNorm)),
        Stage::Block(l, AttnOut) => Some(Stage::Block(l, AttnCtx)),
        Stage::Block(l, FfnGate | FfnUp) => Some(Stage::Block(l, FfnNorm)),
        Stage::Block(l, FfnOut) => Some(Stage::Block(l, FfnAct)),
        _ => None,
    }
}

fn max_abs(t: &Tensor) -> f64 {
    t.data()
        .iter()
        .filter(|x| x.is_finite())
        .fold(0.0f64, |m, x| m.max(x.abs() as f64))
}

/// The relative RMS error of quantising `x` to 8 bits in blocks of `block`
/// along its rows (round to nearest, one scale amax/127 per block), as
/// llama.cpp's Q8_0/Q8_K do before a quantised matmul.
pub fn q8_rel_error(x: &Tensor, block: usize) -> f64 {
    let row = *x.shape().last().unwrap_or(&1);
    let (mut err, mut sig) = (0.0f64, 0.0f64);
    for r in x.data().chunks(row.max(1)) {
        for b in r.chunks(block) {
            let amax = b.iter().fold(0.0f64, |m, v| m.max(v.abs() as f64));
            if amax == 0.0 {
                continue;
            }
            let d = amax / 127.0;
            for v in b {
                let v = *v as f64;
                let q = (v / d).round() * d;
                err += (q - v) * (q - v);
                sig += v * v;
            }
        }
    }
    if sig > 0.0 {
        (err / sig).sqrt()
    } else {
        0.0
    }
}

/// The worst case of `q8_rel_error` for one block: all its energy in one
/// value (used when the oracle did not record the matmul's input).
fn q8_rel_error_bound(block: usize) -> f64 {
    (block as f64).sqrt() / (127.0 * 12f64.sqrt())
}

impl<'a> FloorAt<'a> {
    fn o(&self, s: Stage) -> Option<&'a Tensor> {
        self.oracle.get(self.step, s)
    }

    /// max|X − O| at `s`, where both hold it at the same shape.
    fn err<'s>(&self, x: &Source<'s>, s: Stage) -> Option<f64> {
        self.diffs(x, s).map(|d| d.into_iter().fold(0.0f64, f64::max))
    }

    /// Per-element |X − O| at `s`.
    fn diffs<'s>(&self, x: &Source<'s>, s: Stage) -> Option<Vec<f64>> {
        // An engine's capture holds every token row; the references may hold
        // some (`record.rows`): compared on theirs.
        let xt = self.facts.on_recorded_rows(x(s)?, self.step, s);
        let ot = self.facts.on_recorded_rows(self.o(s)?, self.step, s);
        (xt.shape() == ot.shape()).then(|| {
            xt.data()
                .iter()
                .zip(ot.data())
                .map(|(a, b)| {
                    if a.is_finite() {
                        (*a as f64 - *b as f64).abs()
                    } else {
                        f64::INFINITY
                    }
                })
                .collect()
        })
    }

    fn rel(&self, e: f64, s: Stage) -> Option<f64> {
        let m = max_abs(self.o(s)?);
        (m > 0.0).then(|| e / m)
    }

    /// The map's conditioning from `from` to `to`, from the gain reference.
    fn gain(&self, from: Stage, to: Stage) -> f64 {
        let Some(g) = self.gain_ref else { return 1.0 };
        let src = |s: Stage| g.get(self.step, s);
        let e = |s: Stage| self.err(&src, s).and_then(|e| self.rel(e, s));
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
        let reads_weights = matmul_input(stage).is_some()
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
        if let (Some(input), Activations::Q8 { block }) = (matmul_input(stage), a.activations) {
            let rho = self
                .o(input)
                .map_or(q8_rel_error_bound(block), |t| q8_rel_error(t, block));
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
                BlockStage::QRope | BlockStage::KRope => {
                    let p = s.saturating_sub(1) as f64;
                    own += self.c * U_ACC * p;
                    notes.push(format!("angle u·P, P {p}"));
                }
                BlockStage::AttnScores | BlockStage::AttnCtx => own += self.c * a.u_kv(),
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
        let mut notes = vec![format!("M {m:.3e}")];
        let own = m * self.own_rel(stage, &mut notes);
        let (inherited, from) = match self.direct(stage, m, x) {
            Some(v) => v,
            None => self.estimated(stage, m, x),
        };
        Floor {
            own,
            inherited,
            how: format!(
                "own {own:.2e} ({}) + inherited {inherited:.2e} ({from})",
                notes.join(", ")
            ),
        }
    }

    /// Inherited from the direct inputs, when X and O hold them all.
    fn direct<'s>(&self, stage: Stage, m: f64, x: &Source<'s>) -> Option<(f64, String)> {
        use BlockStage::*;
        let cfg = self.facts.config;
        let ins = inputs(cfg, stage);
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
        if let Some(input) = matmul_input(stage) {
            let rel = self.rel(self.err(x, input)?, input)?;
            let g = self.gain(input, stage);
            return Some((rel * m * g, format!("from {input}: relative {rel:.2e}, gain {g:.2}")));
        }
        match stage {
            Stage::OutputNorm => self.norm(stage, ins[0], x, cfg.hidden).and_then(named),
            Stage::SampleProbs => {
                // softmax(l/T) over the kept tokens, from the step's last
                // logits row: |Δp_j| ≤ p_j(|Δl_j| + Σ_k p_k|Δl_k|)/T ≤ 2·M·e/T.
                let crate::sampling::Sampling::Random { temperature, .. } = *self.facts.sampling else {
                    return None;
                };
                let d = self.diffs(x, Stage::Logits)?;
                let last = d.get(d.len().checked_sub(cfg.vocab)?..)?;
                let e = last.iter().fold(0.0f64, |a, b| a.max(*b));
                (temperature > 0.0).then_some(())?;
                named(2.0 * m * e / temperature as f64)
            }
            Stage::Block(l, b) => {
                let s = |b| Stage::Block(l, b);
                match b {
                    AttnNorm | FfnNorm | AttnPostNorm | FfnPostNorm => {
                        self.norm(stage, ins[0], x, cfg.hidden).and_then(named)
                    }
                    QNorm | KNorm => self.norm(stage, ins[0], x, cfg.head_dim).and_then(named),
                    QRope | KRope => named(2f64.sqrt() * self.err(x, ins[0])?),
                    AttnScores => {
                        let rq = self.rel(self.err(x, ins[0])?, ins[0])?;
                        let rk = self.rel(self.err(x, ins[1])?, ins[1])?;
                        named((rq + rk) * m)
                    }
                    AttnProbs => named(2.0 * m * self.err(x, s(AttnScores))?),
                    AttnCtx => {
                        let mv = max_abs(self.o(s(V))?);
                        named(2.0 * self.err(x, s(AttnScores))? * mv + self.err(x, s(V))?)
                    }
                    FfnInp | Out => {
                        let (a, b) = (self.diffs(x, ins[0])?, self.diffs(x, ins[1])?);
                        (a.len() == b.len()).then_some(())?;
                        named(a.iter().zip(&b).fold(0.0f64, |m, (p, q)| m.max(p + q)))
                    }
                    FfnAct => {
                        let act_slope = act_slope_bound(cfg.act);
                        let (dg, du) = (self.diffs(x, s(FfnGate))?, self.diffs(x, s(FfnUp))?);
                        let (g, u) = (self.o(s(FfnGate))?, self.o(s(FfnUp))?);
                        (dg.len() == du.len() && g.data().len() == dg.len() && u.data().len() == dg.len())
                            .then_some(())?;
                        let v = (0..dg.len()).fold(0.0f64, |mx, j| {
                            let (gj, uj) = (g.data()[j].abs() as f64, u.data()[j].abs() as f64);
                            mx.max(act_slope * dg[j] * uj + gj * du[j])
                        });
                        named(v)
                    }
                    _ => None,
                }
            }
            _ => None,
        }
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
    /// under that row's own floor. Rows of the recorded view, in order;
    /// None at other stages or where an input is missing or misshapen.
    pub fn row_floors<'s>(&self, stage: Stage, x: &Source<'s>) -> Option<Vec<f64>> {
        let Stage::Block(_, BlockStage::FfnInp | BlockStage::Out) = stage else {
            return None;
        };
        let ins = inputs(self.facts.config, stage);
        let (da, db) = (self.diffs(x, ins[0])?, self.diffs(x, ins[1])?);
        let view = |s: Stage| self.o(s).map(|t| self.facts.on_recorded_rows(t, self.step, s));
        let (oa, ob) = (view(ins[0])?, view(ins[1])?);
        let (n, len) = (self.facts.config.hidden, da.len());
        if n == 0 || len % n != 0 || db.len() != len || oa.data().len() != len || ob.data().len() != len {
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

    /// RMSNorm's first-order transfer, rows of `n` values:
    /// |Δy_j| ≤ |y_j/x_j|·|Δx_j| + |y_j|·‖Δx‖/‖x‖, the ratio y_j/x_j and the
    /// norms read off the oracle (where x_j = 0, y_j = 0 and the term is 0).
    fn norm<'s>(&self, stage: Stage, input: Stage, x: &Source<'s>, n: usize) -> Option<f64> {
        let (yo, xo) = (self.o(stage)?, self.o(input)?);
        let dx = self.diffs(x, input)?;
        let n_all = xo.data().len();
        if yo.data().len() != n_all || dx.len() != n_all || n == 0 || n_all % n != 0 {
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

    /// Inherited where X or O lacks a direct input: each input's relative
    /// error, measured where both hold it, else estimated as its own
    /// relative rounding plus the largest estimate among its inputs (down to
    /// `embed`), carried relatively (times the measured gain where there is
    /// one) to this stage.
    fn estimated<'s>(&self, stage: Stage, m: f64, x: &Source<'s>) -> (f64, String) {
        let mut memo = std::collections::HashMap::new();
        let ins = inputs(self.facts.config, stage);
        let worst = ins
            .iter()
            .map(|i| (self.rel_est(*i, x, &mut memo) * self.gain(*i, stage), *i))
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

    fn rel_est<'s>(&self, s: Stage, x: &Source<'s>, memo: &mut std::collections::HashMap<Stage, f64>) -> f64 {
        if let Some(v) = memo.get(&s) {
            return *v;
        }
        let v = match self.err(x, s).and_then(|e| self.rel(e, s)) {
            Some(r) => r,
            None => {
                let own = self.own_rel(s, &mut Vec::new());
                let up = inputs(self.facts.config, s)
                    .into_iter()
                    .map(|i| self.rel_est(i, x, memo))
                    .fold(0.0f64, f64::max);
                own + up
            }
        };
        memo.insert(s, v);
        v
    }
}

/// A source's tensors at one step, as the floor reads them.
pub fn of_golden<'g>(g: &'g GoldenSet, step: Step) -> impl Fn(Stage) -> Option<&'g Tensor> + 'g {
    move |s| g.get(step, s)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn q8_error_is_half_a_step_of_the_block_maximum() {
        // One block of equal values quantises exactly.
        let x = Tensor::new(vec![1, 32], vec![0.5; 32]);
        assert_eq!(q8_rel_error(&x, 32), 0.0);
        // A ramp: errors up to amax/254, relative RMS well under the bound.
        let x = Tensor::new(vec![1, 32], (0..32).map(|i| i as f32 * 0.0137).collect());
        let r = q8_rel_error(&x, 32);
        assert!(r > 0.0 && r < q8_rel_error_bound(32), "{r}");
        // An outlier makes the rest of its block coarse.
        let mut v = vec![0.01f32; 32];
        v[0] = 10.0;
        assert!(q8_rel_error(&Tensor::new(vec![1, 32], v), 32) > r);
    }
}
