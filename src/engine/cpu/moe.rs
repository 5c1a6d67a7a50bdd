//! The CPU engine's routed feed-forward layer (`model::moe`): router,
//! selection, experts and the shared expert, tapped at every routing stage.
//!
//! Arithmetic (what the CUDA engine repeats): the router's GEMM output is
//! stored (rounded to storage) like every projection; scores, the choice and
//! the weights are f32 and never rounded (as attention probabilities); each
//! expert's gate, up, activation and down are stored as a dense MLP's; the
//! routed sum accumulates weight·expert(x) in f32 over the chosen experts in
//! ascending id order (HF's `index_add_` order) and is stored once; the
//! shared expert's gate is σ(stored gate logit) in f32 times its stored
//! output, stored. A row's arithmetic never depends on another row.

use crate::error::Result;
use crate::model::moe::{Moe, Routing, Scores};
use crate::model::Weights;
use crate::tensor::DType;

use super::linear::{Linear, Mlp};
use super::mutants::{Mutant, Mutants};
use super::ops::act_mul;

/// A routed layer's weights.
#[derive(Clone, Debug)]
pub struct MoeWeights {
    /// `[n_experts, E]` (+ bias where the model has one).
    pub router: Linear,
    /// `[n_experts]`, added to the scores to choose (DeepSeek-V3).
    pub correction_bias: Option<Vec<f32>>,
    pub experts: Vec<Mlp>,
    pub shared: Option<Mlp>,
    /// `[1, E]`: the shared expert's gate logit (Qwen2-MoE).
    pub shared_gate: Option<Linear>,
}

impl MoeWeights {
    /// Layer prefix `p` (`model.layers.N.mlp`), per-expert names
    /// (`model::moe_layout`).
    pub(crate) fn load(ws: &mut Weights, moe: &Moe, p: &str, e: usize) -> Result<MoeWeights> {
        let n = moe.routing.experts;
        let correction_bias = match moe.routing.correction_bias {
            true => Some(ws.take(&format!("{p}.gate.e_score_correction_bias"), &[n])?.into_data()),
            false => None,
        };
        Ok(MoeWeights {
            router: Linear::load(ws, &format!("{p}.gate"), n, e)?,
            correction_bias,
            experts: (0..n)
                .map(|j| Mlp::load(ws, &format!("{p}.experts.{j}"), moe.expert_ffn, e))
                .collect::<Result<_>>()?,
            shared: moe
                .shared_ffn
                .map(|f| Mlp::load(ws, &format!("{p}.shared_expert"), f, e))
                .transpose()?,
            shared_gate: match moe.shared_gate {
                true => Some(Linear::load(ws, &format!("{p}.shared_expert_gate"), 1, e)?),
                false => None,
            },
        })
    }

    pub(crate) fn visit(&self, p: &str, f: &mut crate::engine::WeightVisitor) {
        super::linear::visit_linear(f, &format!("{p}.gate"), &self.router);
        if let Some(b) = &self.correction_bias {
            f(&format!("{p}.gate.e_score_correction_bias"), &[b.len()], b);
        }
        for (j, m) in self.experts.iter().enumerate() {
            m.visit(&format!("{p}.experts.{j}"), f);
        }
        if let Some(m) = &self.shared {
            m.visit(&format!("{p}.shared_expert"), f);
        }
        if let Some(g) = &self.shared_gate {
            super::linear::visit_linear(f, &format!("{p}.shared_expert_gate"), g);
        }
    }

    pub(crate) fn linears_mut(&mut self) -> Vec<&mut Linear> {
        let mut v = vec![&mut self.router];
        for m in self.experts.iter_mut().chain(self.shared.as_mut()) {
            v.extend(m.linears_mut());
        }
        v.extend(self.shared_gate.as_mut());
        v
    }

    /// The vectors `linears_mut` does not hold.
    pub(crate) fn round_to(&mut self, storage: DType) {
        if let Some(b) = &mut self.correction_bias {
            storage.round_slice(b);
        }
    }
}

/// Every routing stage of a routed layer's pass over `t` rows.
pub struct MoeOut {
    /// `[t, n]` stored router logits.
    pub logits: Vec<f32>,
    /// `[t, n]` selection scores.
    pub probs: Vec<f32>,
    /// `[t, k]` chosen ids, ascending, as floats.
    pub topk: Vec<f32>,
    /// `[t, k]` their weights.
    pub weights: Vec<f32>,
    /// `[t, E]` the stored routed sum.
    pub routed: Vec<f32>,
    /// `[t, E]` the shared expert's stored output.
    pub shared: Option<Vec<f32>>,
    /// `[t, E]` what the block adds to its residual.
    pub out: Vec<f32>,
}

/// One row's scores in f32: softmax, sigmoid or the logits.
fn scores_f32(kind: Scores, logits: &[f32]) -> Vec<f32> {
    match kind {
        Scores::Softmax => {
            let m = logits.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
            let e: Vec<f32> = logits.iter().map(|x| (x - m).exp()).collect();
            let s: f32 = e.iter().sum();
            e.into_iter().map(|x| x / s).collect()
        }
        Scores::Sigmoid => logits.iter().map(|x| 1.0 / (1.0 + (-x).exp())).collect(),
        Scores::TopkSoftmax => logits.to_vec(),
    }
}

/// One row's choice and weights from its f32 scores (`raw` unbiased, `sel`
/// what top-k is taken over), with the planted routing bugs of tests.
fn route_row(r: &Routing, raw: &[f32], sel: &[f32], logits: &[f32], mx: Mutants) -> (Vec<usize>, Vec<f32>) {
    let wide: Vec<f64> = sel.iter().map(|&x| x as f64).collect();
    let ok = if mx.is(Mutant::GroupMaskIgnored) {
        vec![true; wide.len()]
    } else {
        crate::model::moe::eligible(r, &wide)
    };
    let masked: Vec<f64> = wide
        .iter()
        .zip(&ok)
        .map(|(s, ok)| if *ok { *s } else { f64::NEG_INFINITY })
        .collect();
    let mut ids = if mx.is(Mutant::RouteTieToHigherId) {
        // A stable sort of the reversed indices: a tie goes to the higher id.
        let mut idx: Vec<usize> = (0..masked.len()).rev().collect();
        idx.sort_by(|&a, &b| masked[b].total_cmp(&masked[a]));
        idx.truncate(r.top_k);
        idx
    } else {
        crate::model::moe::top_indices(&masked, r.top_k)
    };
    ids.sort_unstable();
    let from = if mx.is(Mutant::BiasInWeights) { sel } else { raw };
    let mut w: Vec<f32> = ids.iter().map(|&i| from[i]).collect();
    let softmax_k = r.scores == Scores::TopkSoftmax || mx.is(Mutant::SoftmaxOverTopkOnly);
    if softmax_k {
        // Over the chosen logits (gpt-oss; a bug for the softmax families).
        let l: Vec<f32> = ids.iter().map(|&i| logits[i]).collect();
        w = scores_f32(Scores::Softmax, &l);
    } else if r.norm_topk && !mx.is(Mutant::TopkNotRenormalised) {
        let s: f32 = w.iter().sum();
        w.iter_mut().for_each(|x| *x /= s);
    }
    if !mx.is(Mutant::RoutedScalingMissing) {
        let scale = r.scaling as f32;
        w.iter_mut().for_each(|x| *x *= scale);
    }
    (ids, w)
}

/// A dense MLP over `rows` rows of `x`, every stage stored.
pub fn mlp(m: &Mlp, act: crate::model::config::Activation, x: &[f32], rows: usize, sd: DType) -> Vec<f32> {
    let [gate, up] = Linear::forward_many([&m.gate, &m.up], x, rows, sd, true);
    let mut a = act_mul(act, &gate, &up);
    sd.round_slice(&mut a);
    m.down.forward(&a, rows, sd)
}

/// The routed layer over `t` rows of `hn` (the stored `ffn_norm` output).
pub fn forward(
    cfg: &crate::model::ModelConfig,
    w: &MoeWeights,
    hn: &[f32],
    t: usize,
    sd: DType,
    mx: Mutants,
) -> MoeOut {
    let moe = cfg.moe.as_ref().expect("a routed layer has an MoE config");
    let r = &moe.routing;
    let (e, n, k) = (cfg.hidden, r.experts, r.top_k);
    let logits = w.router.forward(hn, t, sd);
    let mut probs = Vec::with_capacity(t * n);
    let mut topk = Vec::with_capacity(t * k);
    let mut weights = Vec::with_capacity(t * k);
    // Per expert, the rows routed to it and their weights, rows ascending.
    let mut routed_to: Vec<Vec<(usize, f32)>> = vec![Vec::new(); n];
    for row in 0..t {
        let l = &logits[row * n..][..n];
        let raw = scores_f32(r.scores, l);
        let sel: Vec<f32> = match &w.correction_bias {
            Some(b) => raw.iter().zip(b).map(|(s, b)| s + b).collect(),
            None => raw.clone(),
        };
        let (ids, wts) = route_row(r, &raw, &sel, l, mx);
        for (&j, &wt) in ids.iter().zip(&wts) {
            // The planted bug computes the next expert for the chosen id.
            let used = if mx.is(Mutant::ExpertIdOffByOne) { (j + 1) % n } else { j };
            routed_to[used].push((row, wt));
        }
        probs.extend_from_slice(&sel);
        topk.extend(ids.iter().map(|&j| j as f32));
        weights.extend_from_slice(&wts);
    }
    let mut acc = vec![0.0f32; t * e];
    for (j, rows) in routed_to.iter().enumerate().filter(|(_, r)| !r.is_empty()) {
        let x: Vec<f32> = rows.iter().flat_map(|&(row, _)| hn[row * e..][..e].iter().copied()).collect();
        let y = mlp(&w.experts[j], moe.expert_act, &x, rows.len(), sd);
        for (i, &(row, wt)) in rows.iter().enumerate() {
            for (a, &v) in acc[row * e..][..e].iter_mut().zip(&y[i * e..][..e]) {
                *a += wt * v;
            }
        }
    }
    sd.round_slice(&mut acc);
    let routed = acc;
    let shared = w.shared.as_ref().map(|m| {
        let mut s = mlp(m, cfg.act, hn, t, sd);
        if let Some(g) = &w.shared_gate {
            let gl = g.forward(hn, t, sd);
            for (row, gv) in s.chunks_exact_mut(e).zip(gl) {
                let gate = if mx.is(Mutant::SharedGateNoSigmoid) {
                    gv
                } else {
                    1.0 / (1.0 + (-gv).exp())
                };
                row.iter_mut().for_each(|v| *v = sd.round(gate * *v));
            }
        }
        s
    });
    let out = match &shared {
        Some(s) => routed.iter().zip(s).map(|(a, b)| sd.round(a + b)).collect(),
        None => routed.clone(),
    };
    MoeOut {
        logits,
        probs,
        topk,
        weights,
        routed,
        shared,
        out,
    }
}
