//! LLaVA's vision side on the CUDA engine, stage for stage as the CPU
//! engine's `cpu::clip` (same taps, same storage rounding points): the patch
//! convolution as one GEMM over the flattened patches (the flattening, a
//! permutation of the pixels, is input preparation on the host, as Qwen-VL's
//! processor hands its patches flattened), each image's CLS row and patches
//! laid out by device copies and the position table added, `pre_layrnorm`,
//! then per block LayerNorm → q/k/v GEMMs with biases → bidirectional
//! attention over each image's N + 1 rows (the LM's attention kernel with
//! `causal = 0`, one launch per image) → out_proj → residual → LayerNorm →
//! fc1 → quick_gelu → fc2 → residual; the chosen hidden state without CLS
//! (device copies), the projector (linear_1 → erf GELU → linear_2), and the
//! image-token rows copied in LLaVA-NeXT's packed order
//! (`model::llava::packed_rows`).

use cudarc::cublas::{CudaBlas, Gemm};

use crate::engine::cpu::clip::patchify;
use crate::engine::ImageInput;
use crate::error::{Error, Result};
use crate::model::llava::{packed_rows, LlavaConfig, Select};
use crate::stage::{Stage, VBlock, VisionStage as VS};

use super::device::{CudaEngine, GBuf, TapCtx};
use super::launch;
use super::clip_weights::DevClip;
use super::seam::{DBuf, ViewMut};
use super::storage::Storage;
use super::vision::{DevFeatures, ACT_GELU_ERF, ACT_QUICK_GELU};

/// Rows `a..b` (of `width`) of a guarded buffer's interior, written.
fn rows_mut<T: Storage>(g: &mut GBuf<T>, a: usize, b: usize, width: usize) -> ViewMut<'_, T> {
    let r = g.g.interior();
    g.buf.view_mut(r.start + a * width..r.start + b * width)
}

impl<T: Storage> CudaEngine<T>
where
    CudaBlas: Gemm<T>,
{
    /// Runs the tower and projector on `img` (checked by `check_image`),
    /// tapping every vision stage, as `cpu::clip::encode_tapped`.
    pub(super) fn encode_clip(
        &self,
        w: &DevClip<T>,
        lc: &LlavaConfig,
        img: &ImageInput,
        tc: &mut TapCtx,
    ) -> Result<DevFeatures<T>> {
        let t = &lc.tower;
        let (ev, hv, fv, e) = (t.hidden, t.heads, t.ffn, self.cfg.hidden);
        let dv = ev / hv;
        let (n, p) = (t.patches(), img.grid.t);
        let (r, s) = (n + 1, t.image_size);
        let total = p * r;
        let vs = Stage::Vision;
        let px = self.gbuf_from("pixels", img.pixels.data())?;
        self.tap(tc, vs(VS::Pixels), &[p, 3, s, s], &px)?;
        let flat = self.gbuf_from("patches", &patchify(lc, img.pixels.data()))?;
        let mut patches = self.gbuf::<T>("patch_embed", p * n * ev)?;
        self.linear(flat.view(), p * n, &w.patch, &mut patches.view_mut())?;
        self.tap(tc, vs(VS::PatchEmbed), &[p * n, ev], &patches)?;

        // cat(CLS, patches) and the position table, image by image.
        let mut with_cls = self.gbuf::<T>("with_cls", total * ev)?;
        let mut pos = self.gbuf::<T>("pos_rows", total * ev)?;
        for i in 0..p {
            self.dev.copy(w.class.view(..), &mut rows_mut(&mut with_cls, i * r, i * r + 1, ev))?;
            let src = patches.view().slice(i * n * ev..(i + 1) * n * ev);
            self.dev.copy(src, &mut rows_mut(&mut with_cls, i * r + 1, (i + 1) * r, ev))?;
            self.dev.copy(w.pos.view(..), &mut rows_mut(&mut pos, i * r, (i + 1) * r, ev))?;
        }
        let mut x = self.gbuf::<T>("pos_embed", total * ev)?;
        self.add(with_cls.view(), pos.view(), &mut x)?;
        self.tap(tc, vs(VS::PosEmbed), &[total, ev], &x)?;
        let mut normed = self.gbuf::<T>("pre_norm", total * ev)?;
        self.layernorm(x.view(), &w.pre_norm, &mut normed.view_mut(), total, ev, t.ln_eps)?;
        self.tap(tc, vs(VS::PreNorm), &[total, ev], &normed)?;
        let mut x = normed;

        let attn_launch = launch::attention(r, hv, dv, r).map_err(|msg| self.dev.err(msg))?;
        // hidden_states[0] is pre_layrnorm's output, [i] block i − 1's: the
        // one the features read is kept.
        let mut features_src = match lc.feature_layer {
            0 => Some(self.gbuf_copy(&x, "hidden_state")?),
            _ => None,
        };
        for (i, b) in w.blocks.iter().enumerate() {
            let st = |s: VBlock| Stage::Vision(VS::Block(i, s));
            let mut h1 = self.gbuf::<T>("clip_norm1", total * ev)?;
            self.layernorm(x.view(), &b.norm1, &mut h1.view_mut(), total, ev, t.ln_eps)?;
            self.tap(tc, st(VBlock::Norm1), &[total, ev], &h1)?;
            let mut qkv = Vec::with_capacity(3);
            for (l, name, stage) in [(&b.q, "clip_q", VBlock::Q), (&b.k, "clip_k", VBlock::K), (&b.v, "clip_v", VBlock::V)] {
                let mut y = self.gbuf::<T>(name, total * ev)?;
                self.linear(h1.view(), total, l, &mut y.view_mut())?;
                self.tap(tc, st(stage), &[total, hv, dv], &y)?;
                qkv.push(y);
            }
            let want_probs = tc.taps.contains(st(VBlock::AttnProbs));
            let mut probs = match want_probs {
                true => Some(self.gbuf::<f32>("clip_attn_probs", p * hv * r * r)?),
                false => None,
            };
            let mut ctx = self.gbuf::<T>("clip_ctx", total * ev)?;
            for img_i in 0..p {
                let span = img_i * r * ev..(img_i + 1) * r * ev;
                let (qv, kv, vv) = (
                    qkv[0].view().slice(span.clone()),
                    qkv[1].view().slice(span.clone()),
                    qkv[2].view().slice(span),
                );
                let mut cv = rows_mut(&mut ctx, img_i * r, (img_i + 1) * r, ev);
                let mut pv = probs.as_mut().map(|g| rows_mut(g, img_i * hv * r, (img_i + 1) * hv * r, r));
                self.attend_bidirectional([qv, kv, vv], pv.as_mut(), &mut cv, (r, hv, dv), attn_launch)?;
            }
            if let Some(g) = &probs {
                self.tap(tc, st(VBlock::AttnProbs), &[p * hv, r, r], g)?;
            }
            self.tap(tc, st(VBlock::AttnCtx), &[total, ev], &ctx)?;
            let mut attn_out = self.gbuf::<T>("clip_attn_out", total * ev)?;
            self.linear(ctx.view(), total, &b.o, &mut attn_out.view_mut())?;
            self.tap(tc, st(VBlock::AttnOut), &[total, ev], &attn_out)?;
            let mut mid = self.gbuf::<T>("clip_mlp_inp", total * ev)?;
            self.add(x.view(), attn_out.view(), &mut mid)?;
            self.tap(tc, st(VBlock::MlpInp), &[total, ev], &mid)?;
            let mut h2 = self.gbuf::<T>("clip_norm2", total * ev)?;
            self.layernorm(mid.view(), &b.norm2, &mut h2.view_mut(), total, ev, t.ln_eps)?;
            self.tap(tc, st(VBlock::Norm2), &[total, ev], &h2)?;
            let mut f1 = self.gbuf::<T>("clip_fc1", total * fv)?;
            self.linear(h2.view(), total, &b.fc1, &mut f1.view_mut())?;
            self.tap(tc, st(VBlock::MlpFc1), &[total, fv], &f1)?;
            let mut a = self.gbuf::<T>("clip_act", total * fv)?;
            self.act(f1.view(), &mut a.view_mut(), total * fv, ACT_QUICK_GELU)?;
            self.tap(tc, st(VBlock::MlpAct), &[total, fv], &a)?;
            let mut f2 = self.gbuf::<T>("clip_fc2", total * ev)?;
            self.linear(a.view(), total, &b.fc2, &mut f2.view_mut())?;
            self.tap(tc, st(VBlock::MlpOut), &[total, ev], &f2)?;
            let mut out = self.gbuf::<T>("clip_out", total * ev)?;
            self.add(mid.view(), f2.view(), &mut out)?;
            self.tap(tc, st(VBlock::Out), &[total, ev], &out)?;
            x = out;
            if i + 1 == lc.feature_layer {
                features_src = Some(self.gbuf_copy(&x, "hidden_state")?);
            }
        }
        let hidden = features_src.ok_or_else(|| {
            Error::engine(self.dev.engine_name(), format!("hidden state {} was not computed", lc.feature_layer))
        })?;
        // The chosen hidden state, CLS dropped per image by the default strategy.
        let skip = usize::from(lc.select == Select::Default);
        let f_rows = p * (r - skip);
        let mut feats = self.gbuf::<T>("features", f_rows * ev)?;
        for i in 0..p {
            let src = hidden.view().slice((i * r + skip) * ev..(i + 1) * r * ev);
            self.dev.copy(src, &mut rows_mut(&mut feats, i * (r - skip), (i + 1) * (r - skip), ev))?;
        }
        self.tap(tc, vs(VS::Features), &[f_rows, ev], &feats)?;
        let mut h = self.gbuf::<T>("proj_fc1", f_rows * e)?;
        self.linear(feats.view(), f_rows, &w.proj1, &mut h.view_mut())?;
        self.tap(tc, vs(VS::ProjFc1), &[f_rows, e], &h)?;
        let mut a = self.gbuf::<T>("proj_act", f_rows * e)?;
        self.act(h.view(), &mut a.view_mut(), f_rows * e, ACT_GELU_ERF)?;
        self.tap(tc, vs(VS::ProjAct), &[f_rows, e], &a)?;
        let mut y = self.gbuf::<T>("projector", f_rows * e)?;
        self.linear(a.view(), f_rows, &w.proj2, &mut y.view_mut())?;
        self.tap(tc, vs(VS::Projector), &[f_rows, e], &y)?;
        let merger = match (&lc.pinpoints, &w.newline) {
            (Some(_), Some(newline)) => self.pack_next(lc, newline, &y, img.size)?,
            _ => y,
        };
        let rows = merger.g.len / e;
        self.tap(tc, vs(VS::Merger), &[rows, e], &merger)?;
        Ok(DevFeatures {
            merger,
            rows,
            deepstack: Vec::new(),
        })
    }

    /// A copy of `x` (a hidden state the features read later).
    fn gbuf_copy(&self, x: &GBuf<T>, label: &str) -> Result<GBuf<T>> {
        let mut y = self.gbuf::<T>(label, x.g.len)?;
        self.dev.copy(x.view(), &mut y.view_mut())?;
        Ok(y)
    }

    /// LLaVA-NeXT's image-token rows, copied from the projector's in the
    /// packed order (base image, each kept grid row then `image_newline`).
    fn pack_next(
        &self,
        lc: &LlavaConfig,
        newline: &DBuf<T>,
        proj: &GBuf<T>,
        size: Option<(usize, usize)>,
    ) -> Result<GBuf<T>> {
        let bad = |m: String| Error::engine(self.dev.engine_name(), m);
        let (h, w) = size.ok_or_else(|| bad("LLaVA-NeXT needs the image's size (H, W) to pack its rows".into()))?;
        let order = packed_rows(lc, h, w).map_err(bad)?;
        let e = self.cfg.hidden;
        let mut out = self.gbuf::<T>("merger", order.len() * e)?;
        for (k, p) in order.into_iter().enumerate() {
            let src = match p.projector_row() {
                Some(row) => proj.view().slice(row * e..(row + 1) * e),
                None => newline.view(..),
            };
            self.dev.copy(src, &mut rows_mut(&mut out, k, k + 1, e))?;
        }
        Ok(out)
    }
}
