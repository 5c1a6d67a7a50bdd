//! The CUDA engine's q/k/v: three projections, or DeepSeek's latent
//! attention (`model::mla`) with the CPU engine's arithmetic
//! (`engine::cpu::mla`): the latents' projections and RMSNorms with the
//! dense kernels, their split (`copy_cols`), the per-head keys and values
//! (`mla_split_kv`, values padded with zeros to the q/k head width for the
//! cache and the one attention kernel), RoPE on each head's last `rope`
//! values (`rope_mla`), and the context cut back to `v_head_dim` per head.

use cudarc::cublas::{CudaBlas, Gemm};

use super::device::{CudaEngine, GBuf, RopeTables};
use super::launch;
use super::block_weights::DevLatent;
use super::seam::View;
use super::storage::Storage;
use crate::error::Result;

/// What a latent pass leaves besides q and k: v as tapped and v padded.
pub(super) struct LatentValues<T: Storage> {
    pub(super) v: GBuf<T>,
    pub(super) v_pad: GBuf<T>,
}

impl<T: Storage> CudaEngine<T>
where
    CudaBlas: Gemm<T>,
{
    /// Latent attention's q and k (`[t, H, Dqk]`, before RoPE) into `q`
    /// and `k`, and its values, from `x` (the attn_norm output).
    pub(super) fn latent_qkv(
        &self,
        m: &DevLatent<T>,
        x: View<'_, T>,
        t: usize,
        q: &mut GBuf<T>,
        k: &mut GBuf<T>,
    ) -> Result<LatentValues<T>> {
        let mla = self.cfg.mla.as_ref().expect("latent attention has an MLA config");
        let (h, d, dv, r) = (self.cfg.heads, self.cfg.head_dim, mla.v_head_dim, mla.kv_lora_rank);
        match &m.q_a {
            Some((a, n)) => {
                let mut qa = self.gbuf::<T>("q_a", t * a.out_f)?;
                let mut qan = self.gbuf::<T>("q_a_norm", t * a.out_f)?;
                self.linear(x, t, a, &mut qa.view_mut())?;
                self.rmsnorm_rows(qa.view(), n, &mut qan.view_mut(), t, a.out_f)?;
                self.linear(qan.view(), t, &m.q, &mut q.view_mut())?;
            }
            None => self.linear(x, t, &m.q, &mut q.view_mut())?,
        }
        let mut kva = self.gbuf::<T>("kv_a", t * (r + mla.rope))?;
        self.linear(x, t, &m.kv_a, &mut kva.view_mut())?;
        let mut lat = self.gbuf::<T>("kv_latent", t * r)?;
        self.copy_columns(kva.view(), &mut lat, t, r + mla.rope, 0, r)?;
        let mut latn = self.gbuf::<T>("kv_latent_norm", t * r)?;
        self.rmsnorm_rows(lat.view(), &m.kv_a_norm, &mut latn.view_mut(), t, r)?;
        let mut kvb = self.gbuf::<T>("kv_b", t * h * (mla.nope + dv))?;
        self.linear(latn.view(), t, &m.kv_b, &mut kvb.view_mut())?;
        let mut v = self.gbuf::<T>("v", t * h * dv)?;
        let mut v_pad = self.gbuf::<T>("v_pad", t * h * d)?;
        {
            let (mut kv_, mut vv, mut pv) = (k.view_mut(), v.view_mut(), v_pad.view_mut());
            // SAFETY: mla_split_kv_T(kvb [t, H, nope + dv], kva [t, r + rope], k [t, H, d],
            // v [t, H, dv], v_pad [t, H, d], t, H, nope, dv, rope, r).
            unsafe {
                self.dev.launch(
                    &self.f.mla_split_kv,
                    launch::elementwise(t * h * d),
                    &mut [
                        kvb.view().arg(),
                        kva.view().arg(),
                        kv_.arg(),
                        vv.arg(),
                        pv.arg(),
                        (t as i32).into(),
                        (h as i32).into(),
                        (mla.nope as i32).into(),
                        (dv as i32).into(),
                        (mla.rope as i32).into(),
                        (r as i32).into(),
                    ],
                )
            }?;
        }
        Ok(LatentValues { v, v_pad })
    }

    /// RoPE on each head's RoPE part, rows `r0..r0+rows` of `x` into `out`
    /// (positions `pos0..`), the rest copied.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn rope_mla_rows(
        &self,
        x: &GBuf<T>,
        out: &mut GBuf<T>,
        tabs: &RopeTables,
        r0: usize,
        rows: usize,
        heads: usize,
        pos0: usize,
    ) -> Result<()> {
        let mla = self.cfg.mla.as_ref().expect("latent attention has an MLA config");
        let d = self.cfg.head_dim;
        let span = r0 * heads * d..(r0 + rows) * heads * d;
        let xv = x.view().slice(span.clone());
        let o0 = out.g.interior().start;
        let mut ov = out.buf.view_mut(o0 + span.start..o0 + span.end);
        // SAFETY: rope_mla_T over [rows, heads, d]; tables [positions, rope/2] cover pos0 + rows.
        let r = unsafe {
            self.dev.launch(
                &self.f.rope_mla,
                launch::elementwise(rows * heads * d),
                &mut [
                    xv.arg(),
                    ov.arg(),
                    tabs.cos.arg(),
                    tabs.sin.arg(),
                    (rows as i32).into(),
                    (heads as i32).into(),
                    (d as i32).into(),
                    (mla.nope as i32).into(),
                    (mla.rope as i32).into(),
                    i32::from(mla.interleave).into(),
                    (pos0 as i32).into(),
                ],
            )
        };
        r
    }
}
