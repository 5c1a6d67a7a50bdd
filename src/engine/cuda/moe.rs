//! The CUDA engine's feed-forward layers: the dense MLP's weights and a
//! routed layer (`model::moe`) on the device, with the CPU engine's
//! arithmetic (`engine::cpu::moe`): the router's GEMM, `moe_route` (scores,
//! the choice, the weights; `cuda/moe.cu`), then per expert in ascending id
//! order its tokens gathered, its MLP (the dense kernels), and its output
//! accumulated with the weights into an f32 sum, stored once; the shared
//! expert and its sigmoid gate.
//!
//! Which tokens an expert computes is read back to the host once per layer
//! (the ids, a few bytes a token) to size each expert's GEMMs: a production
//! engine would keep that on the device (a grouped GEMM over a permutation);
//! here the per-expert launches keep every stage the CPU engine taps
//! readable, and the emulated device runs the same kernels in CI.

use cudarc::cublas::{CudaBlas, Gemm};

use super::device::{CudaEngine, GBuf};
use super::forward::DevSeg;
use super::launch;
use super::seam::{Dev, KArg, Kernel, View, ViewMut};
use super::storage::Storage;
use super::block_weights::{DevMlp, DevMoe};
use crate::error::Result;
use crate::model::config::Activation;
use crate::model::moe::{Routing, Scores};
use crate::stage::{BlockStage as B, Stage};

/// `moe_route` over `rows` rows of `logits` (`[rows, n]`, the bias `[n]`
/// where the model has one) into the scores `[rows, n]`, ids and weights
/// `[rows, k]` (`cuda/moe.cu`): the engine's and its kernel test's one launch.
#[allow(clippy::too_many_arguments)]
pub(super) fn launch_route<T: Storage>(
    dev: &Dev,
    f: &Kernel,
    r: &Routing,
    logits: View<'_, T>,
    bias: Option<View<'_, T>>,
    probs: &mut ViewMut<'_, f32>,
    ids: &mut ViewMut<'_, f32>,
    weights: &mut ViewMut<'_, f32>,
    rows: usize,
) -> Result<()> {
    let kind: i32 = match r.scores {
        Scores::Softmax => 0,
        Scores::Sigmoid => 1,
        Scores::TopkSoftmax => 2,
    };
    let (g, tg) = r.groups.map_or((0, 0), |(g, tg)| (g as i32, tg as i32));
    // SAFETY: moe_route_T(logits [rows, n], bias [n] or NULL, probs [rows, n],
    // ids [rows, k], weights [rows, k], rows, n, k, kind, norm, scaling, groups).
    unsafe {
        dev.launch(
            f,
            launch::elementwise(rows),
            &mut [
                logits.arg(),
                bias.as_ref().map_or(KArg::Null, |b| b.arg()),
                probs.arg(),
                ids.arg(),
                weights.arg(),
                (rows as i32).into(),
                (r.experts as i32).into(),
                (r.top_k as i32).into(),
                kind.into(),
                i32::from(r.norm_topk).into(),
                (r.scaling as f32).into(),
                g.into(),
                tg.into(),
            ],
        )
    }
}

impl<T: Storage> CudaEngine<T>
where
    CudaBlas: Gemm<T>,
{
    /// `act(gate)·up` over `n` values (SwiGLU, GeGLU or gpt-oss's clamped
    /// SwiGLU), stored.
    pub(super) fn act_mul(&self, act: Activation, gate: View<'_, T>, up: View<'_, T>, out: &mut GBuf<T>) -> Result<()> {
        let n = out.g.len as i64;
        let mut av = out.view_mut();
        let mut args = vec![gate.arg(), up.arg(), av.arg(), n.into()];
        let kernel = match act {
            Activation::Silu => &self.f.silu_mul,
            Activation::GeluTanh => &self.f.gelu_mul,
            Activation::ClampedSwiglu { alpha, limit } => {
                args.extend([alpha.into(), limit.into()]);
                &self.f.swiglu_clamped
            }
        };
        // SAFETY: silu_mul_T / gelu_mul_T(gate, up, out, n), all n long;
        // swiglu_clamped_T takes alpha and the limit after them.
        let r = unsafe { self.dev.launch(kernel, launch::elementwise(n as usize), &mut args) };
        r
    }

    /// A dense MLP over `rows` rows of `x` into `out` (`[rows, E]`), with
    /// gated activation `act`.
    fn mlp(&self, m: &DevMlp<T>, act_kind: Activation, x: View<'_, T>, rows: usize, out: &mut GBuf<T>) -> Result<()> {
        let f = m.gate.out_f;
        let mut gate = self.gbuf::<T>("expert_gate", rows * f)?;
        let mut up = self.gbuf::<T>("expert_up", rows * f)?;
        let mut act = self.gbuf::<T>("expert_act", rows * f)?;
        self.linear(x, rows, &m.gate, &mut gate.view_mut())?;
        self.linear(x, rows, &m.up, &mut up.view_mut())?;
        self.act_mul(act_kind, gate.view(), up.view(), &mut act)?;
        self.linear(act.view(), rows, &m.down, &mut out.view_mut())
    }

    /// Layer `l`'s routed MLP over the `t` rows of `x` (`ffn_norm`) into
    /// `out` (`ffn_out`), tapping every routing stage.
    pub(super) fn moe_ffn(
        &self,
        segs: &mut [DevSeg],
        l: usize,
        m: &DevMoe<T>,
        x: &GBuf<T>,
        out: &mut GBuf<T>,
        t: usize,
    ) -> Result<()> {
        let moe = self.cfg.moe.as_ref().expect("a routed layer has an MoE config");
        let r = &moe.routing;
        let (e, n, k) = (self.cfg.hidden, r.experts, r.top_k);
        let st = |b| Stage::Block(l, b);
        let mut logits = self.gbuf::<T>("moe_logits", t * n)?;
        self.linear(x.view(), t, &m.router, &mut logits.view_mut())?;
        self.tap_rows(segs, st(B::FfnMoeLogits), &[n], &logits)?;
        let mut probs = self.gbuf::<f32>("moe_probs", t * n)?;
        let mut ids = self.gbuf::<f32>("moe_topk", t * k)?;
        let mut wts = self.gbuf::<f32>("moe_weights", t * k)?;
        {
            let bias = m.correction_bias.as_ref().map(|b| b.view(..));
            let (mut pv, mut iv, mut wv) = (probs.view_mut(), ids.view_mut(), wts.view_mut());
            launch_route(&self.dev, &self.f.moe_route, r, logits.view(), bias, &mut pv, &mut iv, &mut wv, t)?;
        }
        self.tap_rows(segs, st(B::FfnMoeProbs), &[n], &probs)?;
        self.tap_rows(segs, st(B::FfnMoeTopk), &[k], &ids)?;
        self.tap_rows(segs, st(B::FfnMoeWeights), &[k], &wts)?;
        let (host_ids, host_w) = (self.dev.download(ids.view())?, self.dev.download(wts.view())?);
        // Per expert, its rows (ascending) and their weights.
        let mut routed_to: Vec<(Vec<i32>, Vec<f32>)> = vec![(Vec::new(), Vec::new()); n];
        for (i, (&id, &w)) in host_ids.iter().zip(&host_w).enumerate() {
            let j = id as usize;
            if !(id >= 0.0 && j < n && id == j as f32) {
                return Err(self.dev.err(format!("moe_route wrote expert id {id} (of {n})")));
            }
            routed_to[j].0.push((i / k) as i32);
            routed_to[j].1.push(w);
        }
        let mut acc = self.dev.alloc_zeros::<f32>("moe_acc", t * e)?;
        for (j, (rows, w)) in routed_to.iter().enumerate().filter(|(_, r)| !r.0.is_empty()) {
            let mm = rows.len();
            let idx = self.dev.upload("moe_rows", rows)?;
            let wd = self.dev.upload("moe_row_weights", w)?;
            let mut xg = self.gbuf::<T>("expert_in", mm * e)?;
            {
                let mut gv = xg.view_mut();
                // SAFETY: moe_gather_T(src [t, E], dst [m, E], idx [m] (< t), m, E).
                unsafe {
                    self.dev.launch(
                        &self.f.moe_gather,
                        launch::elementwise(mm * e),
                        &mut [x.view().arg(), gv.arg(), idx.arg(), (mm as i32).into(), (e as i32).into()],
                    )
                }?;
            }
            let mut y = self.gbuf::<T>("expert_out", mm * e)?;
            self.mlp(&m.experts[j], moe.expert_act, xg.view(), mm, &mut y)?;
            let mut av = acc.view_mut(..);
            // SAFETY: moe_accumulate_T(y [m, E], idx [m] (< t), w [m], acc [t, E], m, E).
            unsafe {
                self.dev.launch(
                    &self.f.moe_accumulate,
                    launch::elementwise(mm * e),
                    &mut [
                        y.view().arg(),
                        idx.arg(),
                        wd.arg(),
                        av.arg(),
                        (mm as i32).into(),
                        (e as i32).into(),
                    ],
                )
            }?;
        }
        let mut routed = self.gbuf::<T>("moe_out", t * e)?;
        {
            let mut rv = routed.view_mut();
            let nn = (t * e) as i64;
            // SAFETY: moe_store_T(acc [n] f32, out [n], n).
            unsafe {
                self.dev.launch(
                    &self.f.moe_store,
                    launch::elementwise(t * e),
                    &mut [acc.view(..).arg(), rv.arg(), nn.into()],
                )
            }?;
        }
        self.tap_rows(segs, st(B::FfnMoeOut), &[e], &routed)?;
        match &m.shared {
            Some(sm) => {
                let mut sh = self.gbuf::<T>("shexp_out", t * e)?;
                self.mlp(sm, self.cfg.act, x.view(), t, &mut sh)?;
                if let Some(g) = &m.shared_gate {
                    let mut gl = self.gbuf::<T>("shexp_gate", t)?;
                    self.linear(x.view(), t, g, &mut gl.view_mut())?;
                    let mut sv = sh.view_mut();
                    // SAFETY: sigmoid_scale_T(g [t], x [t, E] in place, t, E).
                    unsafe {
                        self.dev.launch(
                            &self.f.sigmoid_scale,
                            launch::elementwise(t * e),
                            &mut [gl.view().arg(), sv.arg(), (t as i32).into(), (e as i32).into()],
                        )
                    }?;
                }
                self.tap_rows(segs, st(B::FfnShexpOut), &[e], &sh)?;
                self.add(routed.view(), sh.view(), out)
            }
            None => self.dev.copy(routed.view(), &mut out.view_mut()),
        }
    }
}

#[cfg(test)]
#[path = "moe_tests.rs"]
mod tests;
