//! The floor at the attention stages, recomputed exactly (in f64) from the
//! operands X itself produced, against the same recomputation from the
//! oracle's:
//!
//! - `attn_scores` s_ij = scale·q_i·k_j: inherited |s(q_X, K_X) − s(q_O, K_O)|
//!   over every visible key j of the cache (the keys of every step so far);
//!   own c·((u_acc·√D + 2·u_kv)·A_ij + u_store·|s_ij|) with
//!   A_ij = scale·Σ_d |q_id·k_jd|. Attention logits are small differences of
//!   large products (Qwen's q/k carry biases of hundreds): an error
//!   relative to q and k is an error relative to A, which |s| can be a
//!   hundredth of, so neither term may scale with |s| alone. A coarser KV
//!   cache rounds k once, and the kernel rounds q to the cache's type to
//!   multiply with it (ggml converts the f32 operand to f16): 2·u_kv·A;
//! - `attn_probs`: inherited |softmax(s_X) − softmax(s_O)| per row over the
//!   visible keys (and the head's sink logit, gpt-oss, whose entry is
//!   dropped), both from the recorded scores; own c·p_j·(u_acc·(√S +
//!   |s_j − max|) + u_store) (the sum's roundings, the exponent's argument
//!   rounded, the result stored);
//! - `attn_ctx` c_i = Σ_j p_ij·v_j: inherited |Σ p_X·V_X − Σ p_O·V_O|, own
//!   c·((u_acc·√S + 2·u_kv)·Σ_j p_ij·|v_j| + u_store·|c_i|).
//!
//! Each recomputation of the oracle's own stage from its recorded operands is
//! checked against its recorded stage first: where they differ (another
//! convention of scale or mask than the one computed here) the floor is not
//! computed this way and the caller estimates, saying so.

use super::{Floor, FloorAt, Source};
use crate::arithmetic::U_ACC;
use crate::stage::{BlockStage, Stage, Step};
use crate::tensor::Tensor;

pub(super) fn floor<'s>(at: &FloorAt, stage: Stage, x: &Source<'s>, want: Option<&[usize]>) -> Option<Floor> {
    match stage {
        Stage::Block(l, BlockStage::AttnScores) => scores(at, l, x, want),
        Stage::Block(l, BlockStage::AttnProbs) => probs(at, l, x, want),
        Stage::Block(l, BlockStage::AttnCtx) => ctx(at, l, x, want),
        _ => None,
    }
}

/// The cache a step's attention reads: `stage` (k_rope or v, [T, KV, D]) of
/// every step up to `upto`, every row, stacked as [S, KV·D]. None unless
/// every step holds every row.
fn cache<'t>(
    at: &FloorAt,
    get: &dyn Fn(Step, Stage) -> Option<&'t Tensor>,
    stage: Stage,
    upto: Step,
) -> Option<Vec<f32>> {
    let mut out = Vec::new();
    for step in Step::sequence(upto.index()) {
        let t = get(step, stage)?;
        if t.shape().first() != Some(&at.facts.step_dims(step).0) {
            return None;
        }
        out.extend_from_slice(t.data());
    }
    Some(out)
}

/// Whether key position j is visible to a query at position p in layer l
/// (causal, within the layer's sliding window if it has one).
fn visible(at: &FloorAt, l: usize, p: usize, j: usize) -> bool {
    j <= p && at.facts.config.window_of(l).is_none_or(|w| p - j < w)
}

/// The query position of each judged row (the step's rows `want`, or all).
fn query_positions(at: &FloorAt, want: Option<&[usize]>) -> Vec<usize> {
    let (t, s) = at.facts.step_dims(at.step);
    let rows: Vec<usize> = want.map_or_else(|| (0..t).collect(), <[usize]>::to_vec);
    rows.iter().map(|r| s - t + r).collect()
}

/// `Some(())` when `recomputed` matches `recorded` within 1e-4 of the
/// magnitude the recomputation sums (`scale`).
fn agrees(recomputed: f64, recorded: f32, scale: f64, worst: &mut f64) {
    let d = (recomputed - recorded as f64).abs() / scale.max(f64::MIN_POSITIVE);
    *worst = worst.max(d);
}

/// The largest own, inherited and summed terms over the judged elements.
#[derive(Default)]
struct Terms {
    own: f64,
    inh: f64,
    total: f64,
}

impl Terms {
    fn add(&mut self, own: f64, inh: f64) {
        self.own = self.own.max(own);
        self.inh = self.inh.max(inh);
        self.total = self.total.max(own + inh);
    }

    /// The floor, where the oracle's recomputation matched its recording.
    fn floor(self, worst: f64, how: impl FnOnce(f64, f64) -> String) -> Option<Floor> {
        (worst <= TRUST).then(|| Floor {
            own: self.own,
            inherited: self.inh,
            total: self.total,
            how: how(self.own, self.inh),
        })
    }
}

/// |x − y|, infinite where the source's value is not finite.
fn gap(x: f64, y: f64) -> f64 {
    if x.is_finite() {
        (x - y).abs()
    } else {
        f64::INFINITY
    }
}

/// The oracle's recomputation is trusted up to this relative disagreement
/// with its recorded stage (f32 storage of the operands: ~1e-7).
const TRUST: f64 = 1e-4;

fn scores<'s>(at: &FloorAt, l: usize, x: &Source<'s>, want: Option<&[usize]>) -> Option<Floor> {
    let cfg = at.facts.config;
    let (q, k, stage) = (
        Stage::Block(l, BlockStage::QRope),
        Stage::Block(l, BlockStage::KRope),
        Stage::Block(l, BlockStage::AttnScores),
    );
    let (xq, oq) = at.pair(x, q, want)?;
    let so = at.view(at.o(stage)?, stage, want)?;
    let oracle = |st: Step, s: Stage| at.oracle.get(st, s);
    let (kx, ko) = (cache(at, x, k, at.step)?, cache(at, &oracle, k, at.step)?);
    let (h_n, d, kv) = (cfg.heads, cfg.head_dim, cfg.kv_heads);
    let pos = query_positions(at, want);
    let (r_n, s_n) = (pos.len(), at.facts.step_dims(at.step).1);
    if xq.numel() != r_n * h_n * d || so.numel() != h_n * r_n * s_n || ko.len() != s_n * kv * d || kx.len() != ko.len()
    {
        return None;
    }
    let (scale, group, a) = (cfg.attn_scale, h_n / kv, at.arith);
    let per_a = U_ACC * (d as f64).sqrt() + 2.0 * a.u_kv();
    let (mut t, mut a_max, mut worst) = (Terms::default(), 0.0f64, 0.0f64);
    for h in 0..h_n {
        let g = h / group;
        for (r, &p) in pos.iter().enumerate() {
            let (qx, qo) = (
                &xq.data()[(r * h_n + h) * d..][..d],
                &oq.data()[(r * h_n + h) * d..][..d],
            );
            for j in (0..s_n).filter(|&j| visible(at, l, p, j)) {
                let (kxj, koj) = (&kx[(j * kv + g) * d..][..d], &ko[(j * kv + g) * d..][..d]);
                let (mut sx, mut s0, mut aa) = (0.0f64, 0.0f64, 0.0f64);
                for i in 0..d {
                    sx += qx[i] as f64 * kxj[i] as f64;
                    let t = qo[i] as f64 * koj[i] as f64;
                    s0 += t;
                    aa += t.abs();
                }
                let (sx, s0, aa) = (sx * scale, s0 * scale, aa * scale);
                let rec = so.data()[(h * r_n + r) * s_n + j];
                agrees(s0, rec, aa, &mut worst);
                t.add(at.c * (per_a * aa + a.u_store() * (rec as f64).abs()), gap(sx, s0));
                a_max = a_max.max(aa);
            }
        }
    }
    t.floor(worst, |own, inh| {
        format!(
            "own ≤ {own:.2e} (D {d}, Σ|q·k| ≤ {a_max:.3e}) + inherited ≤ {inh:.2e} (recomputed from {q} and {s_n} \
             keys of {k}, exact)"
        )
    })
}

/// softmax over the visible entries of one scores row and the sink logit
/// where the model has one (its entry dropped), in f64 (masked: 0).
fn softmax(row: &[f32], vis: &[bool], sink: Option<f64>) -> Vec<f64> {
    let m = row
        .iter()
        .zip(vis)
        .filter(|(_, v)| **v)
        .fold(sink.unwrap_or(f64::NEG_INFINITY), |m, (s, _)| m.max(*s as f64));
    let e: Vec<f64> = row
        .iter()
        .zip(vis)
        .map(|(s, v)| if *v { (*s as f64 - m).exp() } else { 0.0 })
        .collect();
    let z: f64 = e.iter().sum::<f64>() + sink.map_or(0.0, |s| (s - m).exp());
    e.into_iter().map(|v| v / z).collect()
}

fn probs<'s>(at: &FloorAt, l: usize, x: &Source<'s>, want: Option<&[usize]>) -> Option<Floor> {
    let cfg = at.facts.config;
    let (scores, stage) = (
        Stage::Block(l, BlockStage::AttnScores),
        Stage::Block(l, BlockStage::AttnProbs),
    );
    let (xs, os) = at.pair(x, scores, want)?;
    let op = at.view(at.o(stage)?, stage, want)?;
    let pos = query_positions(at, want);
    let (h_n, r_n, s_n) = (cfg.heads, pos.len(), at.facts.step_dims(at.step).1);
    if os.numel() != h_n * r_n * s_n || op.numel() != os.numel() {
        return None;
    }
    let a = at.arith;
    // gpt-oss's sink logits, as the model file holds them.
    let sinks = match cfg.attn_sinks {
        true => Some(
            at.facts
                .file
                .tensor(&format!("model.layers.{l}.self_attn.sinks"))
                .ok()
                .filter(|s| s.numel() == h_n)?,
        ),
        false => None,
    };
    let (mut t, mut worst) = (Terms::default(), 0.0f64);
    for h in 0..h_n {
        let sink = sinks.as_ref().map(|s| s.data()[h] as f64);
        for (r, &p) in pos.iter().enumerate() {
            let at_row = (h * r_n + r) * s_n;
            let vis: Vec<bool> = (0..s_n).map(|j| visible(at, l, p, j)).collect();
            let (sx, so) = (&xs.data()[at_row..][..s_n], &os.data()[at_row..][..s_n]);
            let (px, po) = (softmax(sx, &vis, sink), softmax(so, &vis, sink));
            let m = so
                .iter()
                .zip(&vis)
                .filter(|(_, v)| **v)
                .fold(f64::NEG_INFINITY, |m, (s, _)| m.max(*s as f64));
            for j in (0..s_n).filter(|&j| vis[j]) {
                let rec = op.data()[at_row + j] as f64;
                agrees(po[j], rec as f32, 1.0, &mut worst);
                let arg = (so[j] as f64 - m).abs();
                t.add(
                    at.c * po[j] * (U_ACC * ((s_n as f64).sqrt() + arg) + a.u_store()),
                    gap(px[j], po[j]),
                );
            }
        }
    }
    t.floor(worst, |own, inh| {
        format!("own ≤ {own:.2e} (S {s_n}) + inherited ≤ {inh:.2e} (softmax of {scores} recomputed, exact)")
    })
}

fn ctx<'s>(at: &FloorAt, l: usize, x: &Source<'s>, want: Option<&[usize]>) -> Option<Floor> {
    let cfg = at.facts.config;
    let (probs, v, stage) = (
        Stage::Block(l, BlockStage::AttnProbs),
        Stage::Block(l, BlockStage::V),
        Stage::Block(l, BlockStage::AttnCtx),
    );
    let (xp, op) = at.pair(x, probs, want)?;
    let oc = at.view(at.o(stage)?, stage, want)?;
    let oracle = |st: Step, s: Stage| at.oracle.get(st, s);
    let (vx, vo) = (cache(at, x, v, at.step)?, cache(at, &oracle, v, at.step)?);
    let (h_n, d, kv) = (cfg.heads, cfg.head_dim, cfg.kv_heads);
    let pos = query_positions(at, want);
    let (r_n, s_n) = (pos.len(), at.facts.step_dims(at.step).1);
    if op.numel() != h_n * r_n * s_n || oc.numel() != r_n * h_n * d || vo.len() != s_n * kv * d || vx.len() != vo.len()
    {
        return None;
    }
    let (group, a) = (h_n / kv, at.arith);
    let per_a = U_ACC * (s_n as f64).sqrt() + 2.0 * a.u_kv();
    let (mut t, mut a_max, mut worst) = (Terms::default(), 0.0f64, 0.0f64);
    for h in 0..h_n {
        let g = h / group;
        for r in 0..r_n {
            let at_row = (h * r_n + r) * s_n;
            let (px, po) = (&xp.data()[at_row..][..s_n], &op.data()[at_row..][..s_n]);
            for i in 0..d {
                let (mut cx, mut c0, mut aa) = (0.0f64, 0.0f64, 0.0f64);
                for j in 0..s_n {
                    let (vxj, voj) = (vx[(j * kv + g) * d + i] as f64, vo[(j * kv + g) * d + i] as f64);
                    cx += px[j] as f64 * vxj;
                    c0 += po[j] as f64 * voj;
                    aa += (po[j] as f64 * voj).abs();
                }
                let rec = oc.data()[(r * h_n + h) * d + i];
                agrees(c0, rec, aa, &mut worst);
                t.add(at.c * (per_a * aa + a.u_store() * (rec as f64).abs()), gap(cx, c0));
                a_max = a_max.max(aa);
            }
        }
    }
    t.floor(worst, |own, inh| {
        format!(
            "own ≤ {own:.2e} (S {s_n}, Σp·|v| ≤ {a_max:.3e}) + inherited ≤ {inh:.2e} (recomputed from {probs} and \
             {s_n} values of {v}, exact)"
        )
    })
}
