//! The vision tower of Qwen2-VL and Qwen3-VL on the CUDA engine, stage for
//! stage as the CPU engine's `cpu::vision::encode` (same taps, same storage
//! rounding points): the Conv3d patch embedding as one GEMM over the
//! flattened patches, Qwen3-VL's learned position table resampled on the
//! host (input preparation, from the table the device holds) and added on the
//! device, then per block LayerNorm (`layernorm.cu`) → fused qkv GEMM split
//! into q/k/v (`copy_cols`) → the 2-D rotary (`rope_axes` with the h and w
//! positions as its two axes) → bidirectional attention (the LM's attention
//! kernel with `causal = 0`) → proj → residual → LayerNorm → MLP (`act`:
//! quick_gelu or gelu_tanh) → residual, and the patch mergers (LayerNorm,
//! m² rows read as one, fc1, exact erf GELU, fc2), Qwen3-VL's deepstack ones
//! included (their weights are in `weights.rs`).

use cudarc::cublas::{CudaBlas, Gemm};

use crate::engine::cpu::vision::{interpolate_pos, vision_inv_freq};
use crate::engine::ImageInput;
use crate::error::Result;
use crate::model::vision::{VisionAct, VisionConfig};
use crate::stage::{Stage, VBlock, VisionStage as VS};

use super::device::{CudaEngine, GBuf, TapCtx};
use super::launch;
use super::seam::{as_f32, DBuf, KArg, View, ViewMut};
use super::storage::Storage;
use super::weights::{DevLayerNorm, DevMerger, DevVision};

/// `act_T`'s kinds (cuda/elementwise.cu).
pub(super) const ACT_QUICK_GELU: i32 = 0;
pub(super) const ACT_GELU_TANH: i32 = 1;
pub(super) const ACT_GELU_ERF: i32 = 2;

/// What the tower hands the language model, on the device: the merger's
/// rows (`[M, E]`) and Qwen3-VL's deepstack features (each `[M, E]`).
pub(super) struct DevFeatures<T: Storage> {
    pub(super) merger: GBuf<T>,
    pub(super) rows: usize,
    pub(super) deepstack: Vec<GBuf<T>>,
}

impl<T: Storage> CudaEngine<T>
where
    CudaBlas: Gemm<T>,
{
    /// A guarded buffer holding `data` rounded to `T` (a device input that is
    /// also a stage, such as the pixels).
    pub(super) fn gbuf_from(&self, label: &str, data: &[f32]) -> Result<GBuf<T>> {
        let host: Vec<T> = data.iter().map(|&x| T::from_f32(x)).collect();
        let up = self.dev.upload(label, &host)?;
        let mut g = self.gbuf::<T>(label, data.len())?;
        self.dev.copy(up.view(..), &mut g.view_mut())?;
        Ok(g)
    }

    /// LayerNorm of `rows` rows of `width`, eps the config's (f64).
    pub(super) fn layernorm(
        &self,
        x: View<'_, T>,
        n: &DevLayerNorm<T>,
        out: &mut ViewMut<'_, T>,
        rows: usize,
        width: usize,
        eps: f64,
    ) -> Result<()> {
        let wi = width as i32;
        // SAFETY: layernorm_T(x [rows, width], w [width], b [width], out [rows, width], width, eps).
        unsafe {
            self.dev.launch(
                &self.f.layernorm,
                launch::per_row(rows, width),
                &mut [x.arg(), n.w.arg(), n.b.arg(), out.arg(), wi.into(), eps.into()],
            )
        }
    }

    /// `out = act(x)` over `n` elements (`ACT_*`).
    pub(super) fn act(&self, x: View<'_, T>, out: &mut ViewMut<'_, T>, n: usize, kind: i32) -> Result<()> {
        let nn = n as i64;
        // SAFETY: act_T(x [n], out [n], n, kind).
        unsafe {
            self.dev.launch(
                &self.f.act,
                launch::elementwise(n),
                &mut [x.arg(), out.arg(), nn.into(), kind.into()],
            )
        }
    }

    /// RoPE (NEOX pairs) of `x` `[rows, heads, d]` at per-row, per-axis
    /// positions `pos` `[naxes, rows]`, frequency j turning by axis `axes[j]`
    /// at `inv_freq[j]` (both `[d/2]`).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn rope_axes(
        &self,
        x: View<'_, T>,
        out: &mut ViewMut<'_, T>,
        inv_freq: &DBuf<f32>,
        pos: &DBuf<i32>,
        axes: &DBuf<i32>,
        rows: usize,
        heads: usize,
        d: usize,
    ) -> Result<()> {
        assert!(inv_freq.len() == d / 2 && axes.len() == d / 2 && pos.len() >= rows);
        let (r, h, dd) = (rows as i32, heads as i32, d as i32);
        // SAFETY: rope_axes_T(x, out [rows, heads, d], inv_freq [d/2], pos [naxes, rows]
        // (axes < naxes, asserted by the callers' tables), axes [d/2], rows, heads, d).
        unsafe {
            self.dev.launch(
                &self.f.rope_axes,
                launch::elementwise(rows * heads * d / 2),
                &mut [
                    x.arg(),
                    out.arg(),
                    inv_freq.arg(),
                    pos.arg(),
                    axes.arg(),
                    r.into(),
                    h.into(),
                    dd.into(),
                ],
            )
        }
    }

    /// A vision tower's attention: `rows` queries over the same `rows` keys,
    /// no mask, window or sinks, scale Dv^-½ (the LM's attention kernel with
    /// `causal = 0`); q, k, v `[rows, heads, d]`, probs `[heads, rows, rows]`
    /// when asked, ctx `[rows, heads·d]`; `attn` is `launch::attention(rows,
    /// heads, d, rows)`.
    pub(super) fn attend_bidirectional(
        &self,
        [q, k, v]: [View<'_, T>; 3],
        probs: Option<&mut ViewMut<'_, f32>>,
        ctx: &mut ViewMut<'_, T>,
        (rows, heads, d): (usize, usize, usize),
        attn: launch::Launch,
    ) -> Result<()> {
        let (r, h, dd) = (rows as i32, heads as i32, d as i32);
        let scale = (d as f64).powf(-0.5) as f32;
        let mut args = vec![q.arg(), k.arg(), v.arg(), KArg::Null];
        args.push(probs.map_or(KArg::Null, |p| p.arg()));
        args.push(ctx.arg());
        // rows, heads, kv_heads = heads, head_dim, pos0 0, s = rows, scale, no window, not causal, no sinks.
        args.extend([
            r.into(),
            h.into(),
            h.into(),
            dd.into(),
            0i32.into(),
            r.into(),
            scale.into(),
            0i32.into(),
            0i32.into(),
            KArg::Null,
        ]);
        // SAFETY: q, k, v [rows, heads, d] (k and v read as a cache of `rows` positions), probs
        // [heads, rows, rows] or NULL, ctx [rows, heads*d]; smem (d + rows) floats as `launch::attention`.
        unsafe { self.dev.launch(&self.f.attention_prefill, attn, &mut args) }
    }

    /// Row r of `src` `[n, width]` into row `idx[r]` of `dst`, replaced or
    /// (`accumulate`) added.
    pub(super) fn scatter_rows(
        &self,
        src: View<'_, T>,
        dst: &mut ViewMut<'_, T>,
        idx: &DBuf<i32>,
        n: usize,
        width: usize,
        accumulate: bool,
    ) -> Result<()> {
        assert!(idx.len() >= n && src.len() >= n * width);
        let (nn, w, acc) = (n as i32, width as i32, accumulate as i32);
        // SAFETY: scatter_rows_T(src [n, width], dst [rows, width], idx [n] (< rows, distinct:
        // the image-pad rows of the step's tokens), n, width, accumulate).
        unsafe {
            self.dev.launch(
                &self.f.scatter_rows,
                launch::elementwise(n * width),
                &mut [src.arg(), dst.arg(), idx.arg(), nn.into(), w.into(), acc.into()],
            )
        }
    }

    /// Runs the tower on `img` (grid checked by `check_image`), tapping every
    /// vision stage, as `cpu::vision::encode`.
    pub(super) fn encode(
        &self,
        vw: &DevVision<T>,
        vc: &VisionConfig,
        img: &ImageInput,
        tc: &mut TapCtx,
    ) -> Result<DevFeatures<T>> {
        let g = img.grid;
        let n = g.patches();
        let (ev, hv, dv, fv, m, e) = (vc.hidden, vc.heads, vc.head_dim(), vc.ffn, vc.merge, self.cfg.hidden);
        let pw = vc.patch_width();
        let vs = Stage::Vision;
        let px = self.gbuf_from("pixels", img.pixels.data())?;
        self.tap(tc, vs(VS::Pixels), &[n, pw], &px)?;

        let mut x = self.gbuf::<T>("patch_embed", n * ev)?;
        self.linear(px.view(), n, &vw.patch, &mut x.view_mut())?;
        self.tap(tc, vs(VS::PatchEmbed), &[n, ev], &x)?;
        if let Some(table) = &vw.pos_embed {
            // The resampling is input preparation: on the host, from the table the device holds.
            let host = self.dev.with_host(table.view(..), |h| as_f32(h).into_owned())?;
            let pos = self.gbuf_from("pos_interp", &interpolate_pos(&host, ev, g, m))?;
            let mut y = self.gbuf::<T>("pos_embed", n * ev)?;
            self.add(x.view(), pos.view(), &mut y)?;
            self.tap(tc, vs(VS::PosEmbed), &[n, ev], &y)?;
            x = y;
        }

        // The 2-D rotary: frequency j < D/4 turns by the patch's row h at
        // f_j, frequency D/4 + j by its column w at f_j.
        let quarter = dv / 4;
        let inv = vision_inv_freq(dv, vc.rope_theta as f32);
        let inv2: Vec<f32> = (0..dv / 2).map(|j| inv[j % quarter]).collect();
        let axes: Vec<i32> = (0..dv / 2).map(|j| (j / quarter) as i32).collect();
        let hw = g.patch_hw(m);
        let pos: Vec<i32> = hw
            .iter()
            .map(|p| p.0 as i32)
            .chain(hw.iter().map(|p| p.1 as i32))
            .collect();
        let (inv_d, axes_d, pos_d) = (
            self.dev.upload("vision_inv_freq", &inv2)?,
            self.dev.upload("vision_rope_axes", &axes)?,
            self.dev.upload("vision_positions", &pos)?,
        );
        let attn_launch = launch::attention(n, hv, dv, n).map_err(|msg| self.dev.err(msg))?;
        let kind = match vc.act {
            VisionAct::QuickGelu => ACT_QUICK_GELU,
            VisionAct::GeluTanh => ACT_GELU_TANH,
        };
        let mut deepstack = Vec::new();
        for (i, b) in vw.blocks.iter().enumerate() {
            let st = |s: VBlock| Stage::Vision(VS::Block(i, s));
            let mut h1 = self.gbuf::<T>("vision_norm1", n * ev)?;
            self.layernorm(x.view(), &b.norm1, &mut h1.view_mut(), n, ev, vc.ln_eps)?;
            self.tap(tc, st(VBlock::Norm1), &[n, ev], &h1)?;
            let mut qkv = self.gbuf::<T>("vision_qkv", n * 3 * ev)?;
            self.linear(h1.view(), n, &b.qkv, &mut qkv.view_mut())?;
            let mut parts = Vec::with_capacity(3);
            for part in 0..3 {
                let mut p = self.gbuf::<T>("vision_qkv_part", n * ev)?;
                self.copy_columns(qkv.view(), &mut p, n, 3 * ev, part * ev, ev)?;
                parts.push(p);
            }
            let (q, k, v) = (&parts[0], &parts[1], &parts[2]);
            self.tap(tc, st(VBlock::Q), &[n, hv, dv], q)?;
            self.tap(tc, st(VBlock::K), &[n, hv, dv], k)?;
            self.tap(tc, st(VBlock::V), &[n, hv, dv], v)?;
            let mut q_rope = self.gbuf::<T>("vision_q_rope", n * ev)?;
            let mut k_rope = self.gbuf::<T>("vision_k_rope", n * ev)?;
            self.rope_axes(q.view(), &mut q_rope.view_mut(), &inv_d, &pos_d, &axes_d, n, hv, dv)?;
            self.rope_axes(k.view(), &mut k_rope.view_mut(), &inv_d, &pos_d, &axes_d, n, hv, dv)?;
            self.tap(tc, st(VBlock::QRope), &[n, hv, dv], &q_rope)?;
            self.tap(tc, st(VBlock::KRope), &[n, hv, dv], &k_rope)?;

            let want_probs = tc.taps.contains(st(VBlock::AttnProbs));
            let mut probs = if want_probs {
                Some(self.gbuf::<f32>("vision_attn_probs", hv * n * n)?)
            } else {
                None
            };
            let mut ctx = self.gbuf::<T>("vision_ctx", n * ev)?;
            let mut pv = probs.as_mut().map(|p| p.view_mut());
            self.attend_bidirectional(
                [q_rope.view(), k_rope.view(), v.view()],
                pv.as_mut(),
                &mut ctx.view_mut(),
                (n, hv, dv),
                attn_launch,
            )?;
            if let Some(p) = &probs {
                self.tap(tc, st(VBlock::AttnProbs), &[hv, n, n], p)?;
            }
            self.tap(tc, st(VBlock::AttnCtx), &[n, hv * dv], &ctx)?;
            let mut attn_out = self.gbuf::<T>("vision_attn_out", n * ev)?;
            self.linear(ctx.view(), n, &b.proj, &mut attn_out.view_mut())?;
            self.tap(tc, st(VBlock::AttnOut), &[n, ev], &attn_out)?;
            let mut mid = self.gbuf::<T>("vision_mlp_inp", n * ev)?;
            self.add(x.view(), attn_out.view(), &mut mid)?;
            self.tap(tc, st(VBlock::MlpInp), &[n, ev], &mid)?;
            let mut h2 = self.gbuf::<T>("vision_norm2", n * ev)?;
            self.layernorm(mid.view(), &b.norm2, &mut h2.view_mut(), n, ev, vc.ln_eps)?;
            self.tap(tc, st(VBlock::Norm2), &[n, ev], &h2)?;
            let mut f1 = self.gbuf::<T>("vision_fc1", n * fv)?;
            self.linear(h2.view(), n, &b.fc1, &mut f1.view_mut())?;
            self.tap(tc, st(VBlock::MlpFc1), &[n, fv], &f1)?;
            let mut a = self.gbuf::<T>("vision_act", n * fv)?;
            self.act(f1.view(), &mut a.view_mut(), n * fv, kind)?;
            self.tap(tc, st(VBlock::MlpAct), &[n, fv], &a)?;
            let mut f2 = self.gbuf::<T>("vision_fc2", n * ev)?;
            self.linear(a.view(), n, &b.fc2, &mut f2.view_mut())?;
            self.tap(tc, st(VBlock::MlpOut), &[n, ev], &f2)?;
            let mut out = self.gbuf::<T>("vision_out", n * ev)?;
            self.add(mid.view(), f2.view(), &mut out)?;
            self.tap(tc, st(VBlock::Out), &[n, ev], &out)?;
            x = out;
            if let Some(j) = vc.deepstack.iter().position(|&d| d == i) {
                let (_, y) = self.merge(&vw.deepstack[j], &x, n, ev, m, vc.ln_eps)?;
                self.tap(tc, vs(VS::Deepstack(j)), &[n / (m * m), e], &y)?;
                deepstack.push(y);
            }
        }
        let (normed, y) = self.merge(&vw.merger, &x, n, ev, m, vc.ln_eps)?;
        self.tap(tc, vs(VS::MergerNorm), &[n, ev], &normed)?;
        let rows = n / (m * m);
        self.tap(tc, vs(VS::Merger), &[rows, e], &y)?;
        Ok(DevFeatures {
            merger: y,
            rows,
            deepstack,
        })
    }

    /// A merger over `x` `[N, Ev]` (windows of m² consecutive rows): the
    /// normed rows `[N, Ev]` and the output `[N/m², E]`.
    fn merge(
        &self,
        mg: &DevMerger<T>,
        x: &GBuf<T>,
        n: usize,
        ev: usize,
        m: usize,
        eps: f64,
    ) -> Result<(GBuf<T>, GBuf<T>)> {
        let (wide, rows, e) = (ev * m * m, n / (m * m), self.cfg.hidden);
        let mut normed = self.gbuf::<T>("merger_norm", n * ev)?;
        if mg.postshuffle {
            self.layernorm(x.view(), &mg.norm, &mut normed.view_mut(), rows, wide, eps)?;
        } else {
            self.layernorm(x.view(), &mg.norm, &mut normed.view_mut(), n, ev, eps)?;
        }
        let mut h = self.gbuf::<T>("merger_fc1", rows * wide)?;
        self.linear(normed.view(), rows, &mg.fc1, &mut h.view_mut())?;
        let mut a = self.gbuf::<T>("merger_act", rows * wide)?;
        self.act(h.view(), &mut a.view_mut(), rows * wide, ACT_GELU_ERF)?;
        let mut y = self.gbuf::<T>("merger_out", rows * e)?;
        self.linear(a.view(), rows, &mg.fc2, &mut y.view_mut())?;
        Ok((normed, y))
    }
}
