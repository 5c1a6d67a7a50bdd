//! `experts`: a routed layer's expert sums recomputed in f64 from the model
//! file and the engine's own captures, needing no golden:
//!
//! - `ffn_moe_out` = Σ_j w_j·down_j(act(gate_j·x)·up_j·x) over the captured
//!   ids j and weights w_j, x the captured `ffn_norm`: an expert computed for
//!   the wrong id, a weight applied twice or dropped, the wrong rows gathered
//!   show here, whatever drift x carries;
//! - `ffn_shexp_out` = σ(shared_expert_gate·x)·MLP_shared(x) (the gate only
//!   where the model has one).
//!
//! The allowance, per output element c, with u the storage's unit roundoff,
//! u_w the stored weights' (0 at f32), γ_n = n·u32/(1 − n·u32) and an expert's
//! intermediates g = W_g·x, p = W_u·x, a = act(g)·p, y = W_d·a:
//! - g_i and p_i: (γ_E + u_w + u)·Σ|W·x| (the GEMM, the weights, an input
//!   wider than captured) + u·|g_i| (stored): δg_i, δp_i;
//! - a_i: 1.13·|p_i|·δg_i + |act(g_i)|·δp_i (act's slope ≤ 1.13) plus its own
//!   f32 arithmetic and storing, (u + 6·u32)·|a_i|: δa_i;
//! - y_c: Σ_i |W_d,ci|·δa_i + (γ_F + u_w + u)·Σ_i |W_d,ci·a_i| + u·|y_c|;
//! - the weighted sum: w_j times the above, u·|w_j·y_c| (a weight held in the
//!   storage type), the k-term f32 sum γ_k·Σ_j|w_j·y_c|, and the output
//!   stored u·|out_c|; the shared gate σ(l) adds 0.25·δl·|y_c| with δl the
//!   gate logit's own (γ_E + u_w + u)·Σ|W·x| + u·|l|.
//! A bound, not an estimate: no safety factor.

use std::sync::Arc;

use serde::de::{Deserialize, Deserializer};

use super::recompute::{Tally, Wording};
use crate::checks::exact_dot::{abs_dot, dot_and_abs, dot_f64};
use crate::checks::facts::Facts;
use crate::checks::family::{Family, Metric};
use crate::checks::kind::{At, Kind, RuleEnv, StageCheck, StageRule};
use crate::checks::params::Empty;
use crate::checks::scaled::{storage_unit, U_F32};
use crate::checks::verdict::Verdict;
use crate::model::config::Activation;
use crate::stage::{BlockStage, Stage};
use crate::tensor::{DType, Tensor};

#[derive(Clone, Debug, PartialEq)]
pub struct Experts;

impl Kind for Experts {
    const NAME: &'static str = "experts";
    const PARAMS: &'static str = "none";
    const ABOUT: &'static str = "blk.*.ffn_moe_out and ffn_shexp_out of a routed layer: Σ weight·expert(ffn_norm) \
                                 over the captured ids and weights, and the shared expert behind its sigmoid gate, \
                                 recomputed from the model file within the roundings of the engine's arithmetic";
    fn bare() -> Self {
        Experts
    }
    fn parse<'de, D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        Empty::deserialize(d).map(|_| Experts)
    }
}

impl StageRule for Experts {
    fn kind(&self) -> &'static str {
        Self::NAME
    }
    fn expand(&self, stage: Stage, _: &RuleEnv) -> Result<Vec<Arc<dyn StageCheck>>, String> {
        match stage {
            Stage::Block(l, b @ (BlockStage::FfnMoeOut | BlockStage::FfnShexpOut)) => {
                Ok(vec![Arc::new(ExpertsCheck { layer: l, what: b })])
            }
            _ => Err(format!("`experts` applies to blk.*.ffn_moe_out and ffn_shexp_out, not `{stage}`")),
        }
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct ExpertsCheck {
    pub layer: usize,
    pub what: BlockStage,
}

/// One MLP's weights as the file holds them (biases: gpt-oss's experts).
struct FileMlp {
    gate: Arc<Tensor>,
    up: Arc<Tensor>,
    down: Arc<Tensor>,
    gate_bias: Option<Arc<Tensor>>,
    up_bias: Option<Arc<Tensor>>,
    down_bias: Option<Arc<Tensor>>,
}

/// The unit roundoffs the allowance uses.
#[derive(Clone, Copy)]
struct Units {
    u: f64,
    u_w: f64,
}

fn gamma(n: usize) -> f64 {
    let nu = n as f64 * U_F32;
    nu / (1.0 - nu)
}

fn act(a: Activation, g: f64) -> f64 {
    match a {
        Activation::Silu => g / (1.0 + (-g).exp()),
        Activation::GeluTanh => {
            let z = (2.0 / std::f64::consts::PI).sqrt() * (g + 0.044715 * g * g * g);
            0.5 * g * (1.0 + z.tanh())
        }
        Activation::ClampedSwiglu { alpha, .. } => g / (1.0 + (-(alpha as f64) * g).exp()),
    }
}

/// The gated activation's operands: gate and up, or the clamped SwiGLU's
/// min(g, limit) and clamp(up, ±limit) + 1 (the clamps are 1-Lipschitz, so
/// an operand's allowance carries over).
fn operands(a: Activation, g: f64, p: f64) -> (f64, f64) {
    match a {
        Activation::ClampedSwiglu { limit, .. } => {
            let l = limit as f64;
            (g.min(l), p.clamp(-l, l) + 1.0)
        }
        _ => (g, p),
    }
}

/// A projection's value and its allowance δ per output (see the module
/// comment), from an input held in f32, plus its bias where it has one.
fn project(w: &Tensor, x: &[f32], un: Units, bias: Option<&[f32]>) -> (Vec<f64>, Vec<f64>) {
    let n = x.len();
    w.data()
        .chunks_exact(n)
        .enumerate()
        .map(|(c, row)| {
            let (y, s) = dot_and_abs(row, x);
            with_bias(y, (gamma(n) + un.u_w + un.u) * s + un.u * y.abs(), bias.map(|b| b[c]), un)
        })
        .unzip()
}

/// A product and its allowance with the bias `b` added: the engines store
/// the product, then the sum (one more rounding, u·|y + b|), and hold the
/// bias in storage (u_w·|b|).
fn with_bias(y: f64, allow: f64, b: Option<f32>, un: Units) -> (f64, f64) {
    match b {
        Some(b) => {
            let z = y + b as f64;
            (z, allow + un.u_w * (b as f64).abs() + un.u * z.abs())
        }
        None => (y, allow),
    }
}

impl FileMlp {
    fn read(facts: &Facts, p: &str) -> Result<FileMlp, String> {
        let t = |n: &str| facts.file.tensor(&format!("{p}.{n}")).map_err(|e| format!("`{p}.{n}`: {e}"));
        let b = |n: &str| match facts.file.has(&format!("{p}.{n}.bias")) {
            true => t(&format!("{n}.bias")).map(Some),
            false => Ok(None),
        };
        Ok(FileMlp {
            gate: t("gate_proj.weight")?,
            up: t("up_proj.weight")?,
            down: t("down_proj.weight")?,
            gate_bias: b("gate_proj")?,
            up_bias: b("up_proj")?,
            down_bias: b("down_proj")?,
        })
    }

    /// y = MLP(x) in f64 and the allowance of each of its elements.
    fn eval(&self, x: &[f32], a: Activation, un: Units) -> (Vec<f64>, Vec<f64>) {
        let (g, dg) = project(&self.gate, x, un, self.gate_bias.as_deref().map(Tensor::data));
        let (p, dp) = project(&self.up, x, un, self.up_bias.as_deref().map(Tensor::data));
        let (g, p): (Vec<f64>, Vec<f64>) = g.iter().zip(&p).map(|(g, p)| operands(a, *g, *p)).unzip();
        let av: Vec<f64> = g.iter().zip(&p).map(|(g, p)| act(a, *g) * p).collect();
        // The clamped SwiGLU's f32 order has two more roundings (α·g, u + 1).
        let own = if matches!(a, Activation::ClampedSwiglu { .. }) { 8.0 } else { 6.0 };
        let da: Vec<f64> = (0..g.len())
            .map(|i| 1.13 * p[i].abs() * dg[i] + act(a, g[i]).abs() * dp[i] + (un.u + own * U_F32) * av[i].abs())
            .collect();
        let f = av.len();
        let av_abs: Vec<f64> = av.iter().map(|v| v.abs()).collect();
        self.down
            .data()
            .chunks_exact(f)
            .enumerate()
            .map(|(c, row)| {
                let y = dot_f64(row, &av);
                let s = abs_dot(row, &av_abs);
                let carried = abs_dot(row, &da);
                let allow = carried + (gamma(f) + un.u_w + un.u) * s + un.u * y.abs();
                with_bias(y, allow, self.down_bias.as_deref().map(|b| b.data()[c]), un)
            })
            .unzip()
    }
}

impl StageCheck for ExpertsCheck {
    fn id(&self) -> String {
        Experts::NAME.into()
    }
    fn family(&self) -> Family {
        Family::Invariant
    }
    fn metric(&self) -> Option<Metric> {
        Some(Metric::MaxAbs)
    }
    fn reads(&self, stage: Stage) -> Vec<Stage> {
        let s = |b| Stage::Block(self.layer, b);
        match self.what {
            BlockStage::FfnMoeOut => vec![stage, s(BlockStage::FfnNorm), s(BlockStage::FfnMoeTopk), s(BlockStage::FfnMoeWeights)],
            _ => vec![stage, s(BlockStage::FfnNorm)],
        }
    }
    fn judge(&self, facts: &Facts, at: &At) -> Verdict {
        let cfg = facts.config;
        let Some(m) = cfg.moe.as_ref().filter(|m| m.is_sparse(self.layer)) else {
            return Verdict::fail(format!("{}: layer {} does not route", at.stage, self.layer));
        };
        let s = |b| Stage::Block(self.layer, b);
        let (y, x) = match (at.capture(), at.capture_of(s(BlockStage::FfnNorm))) {
            (Ok(y), Ok(x)) => (y, x),
            (Err(v), _) | (_, Err(v)) => return v,
        };
        let e = cfg.hidden;
        let t = x.shape()[0];
        if y.shape() != [t, e] || x.shape() != [t, e] {
            return Verdict::fail(format!("{} has shape {:?}, ffn_norm {:?}; expected [{t}, {e}]", at.stage, y.shape(), x.shape()));
        }
        let d = y.dtype().coarser(facts.storage);
        let un = Units {
            u: storage_unit(d),
            u_w: if d == DType::F32 { 0.0 } else { storage_unit(d) },
        };
        let p = format!("model.layers.{}.mlp", self.layer);
        let mut tally = Tally::default();
        let what;
        if self.what == BlockStage::FfnMoeOut {
            what = "Σ weight·expert(ffn_norm) over the chosen experts";
            let (ids, w) = match (at.capture_of(s(BlockStage::FfnMoeTopk)), at.capture_of(s(BlockStage::FfnMoeWeights))) {
                (Ok(i), Ok(w)) => (i, w),
                (Err(v), _) | (_, Err(v)) => return v,
            };
            let k = m.routing.top_k;
            let mut experts: Vec<Option<FileMlp>> = (0..m.routing.experts).map(|_| None).collect();
            for r in 0..t {
                let xr = &x.data()[r * e..][..e];
                let mut want = vec![0.0f64; e];
                let mut allow = vec![0.0f64; e];
                let mut mag = vec![0.0f64; e];
                for c in 0..k {
                    let id = ids.data()[r * k + c];
                    let j = id as usize;
                    if !(id >= 0.0 && j < m.routing.experts) {
                        return Verdict::fail(format!("{} row {r}: expert id {id} out of range", at.stage));
                    }
                    if experts[j].is_none() {
                        match FileMlp::read(facts, &format!("{p}.experts.{j}")) {
                            Ok(f) => experts[j] = Some(f),
                            Err(msg) => return Verdict::fail(format!("cannot read expert {j}: {msg}")),
                        }
                    }
                    let wj = w.data()[r * k + c] as f64;
                    let (yj, dj) = experts[j].as_ref().expect("read above").eval(xr, m.expert_act, un);
                    for i in 0..e {
                        want[i] += wj * yj[i];
                        allow[i] += wj.abs() * dj[i] + un.u * (wj * yj[i]).abs();
                        mag[i] += (wj * yj[i]).abs();
                    }
                }
                for i in 0..e {
                    let a = allow[i] + gamma(k) * mag[i] + un.u * want[i].abs() + 1e-30;
                    tally.add(r * e + i, y.data()[r * e + i], want[i], a);
                }
            }
        } else {
            what = "the shared expert of ffn_norm, times σ(its gate)";
            let sm = match FileMlp::read(facts, &format!("{p}.shared_expert")) {
                Ok(f) => f,
                Err(msg) => return Verdict::fail(format!("cannot read the shared expert: {msg}")),
            };
            let gate = match m.shared_gate {
                true => match facts.file.tensor(&format!("{p}.shared_expert_gate.weight")) {
                    Ok(g) => Some(g),
                    Err(msg) => return Verdict::fail(format!("cannot read the shared expert's gate: {msg}")),
                },
                false => None,
            };
            for r in 0..t {
                let xr = &x.data()[r * e..][..e];
                let (ys, ds) = sm.eval(xr, cfg.act, un);
                let (sig, dsig) = match &gate {
                    Some(g) => {
                        let (l, dl) = project(g, xr, un, None);
                        let sg = 1.0 / (1.0 + (-l[0]).exp());
                        (sg, 0.25 * dl[0] + 4.0 * U_F32 * sg)
                    }
                    None => (1.0, 0.0),
                };
                for i in 0..e {
                    let want = sig * ys[i];
                    let a = sig * ds[i] + dsig * ys[i].abs() + un.u * want.abs() + 1e-30;
                    tally.add(r * e + i, y.data()[r * e + i], want, a);
                }
            }
        }
        tally.verdict(
            y,
            at.stage,
            Wording {
                what,
                within: &format!("u {:.1e}", un.u),
                hint: "does each chosen id compute its own expert, each weight apply once, the shared gate pass a sigmoid?",
            },
            |w| format!("recomputed {:e}", w.want),
        )
    }
}
