//! A vision-language model's share of a CUDA engine step, as the CPU
//! engine's `step` and `forward::Multimodal`: the run's image and M-RoPE
//! delta; at the prefill the tower's features (`vision.rs`) scattered into
//! the image-pad rows of the embeddings (`inputs_embeds`); the step's M-RoPE
//! positions (`model::vision::mrope_positions` at the prefill, `pos0 + delta`
//! on every axis after it), uploaded for the `rope_axes` kernel with the LM's
//! frequencies and `MRope::axis_of` table; and Qwen3-VL's deepstack features
//! added to the image rows after the first layers.

use std::sync::Arc;

use cudarc::cublas::{CudaBlas, Gemm};

use crate::engine::{ImageInput, RunRequest};
use crate::error::{Error, Result};
use crate::stage::{BlockStage as B, Stage};
use crate::tensor::Tensor;

use super::device::{CudaEngine, GBuf, TapCtx};
use super::seam::DBuf;
use super::storage::Storage;
use super::vision::DevFeatures;

/// Per-run state of a VLM: the image, the M-RoPE delta (set at the
/// prefill), and the LM's frequencies and axis table on the device.
pub(super) struct VlmRun {
    image: Option<Arc<ImageInput>>,
    delta: i64,
    /// M-RoPE's frequencies and axis table (None: LLaVA's plain RoPE).
    mrope: Option<(DBuf<f32>, DBuf<i32>)>,
}

/// One step's multimodal inputs on the device.
pub(super) struct VlmStep<T: Storage> {
    /// `[3, T]` (t, h, w) positions (None: LLaVA rotates at the plain ones).
    pub(super) pos: Option<DBuf<i32>>,
    /// The image-pad rows that take feature rows, in order (as many as
    /// there are feature rows, at most).
    pads: Option<(DBuf<i32>, usize)>,
    features: Option<DevFeatures<T>>,
}

impl<T: Storage> CudaEngine<T>
where
    CudaBlas: Gemm<T>,
{
    /// A VLM's run state (None for a text model), the image checked as
    /// every engine checks it.
    pub(super) fn vlm_begin(&self, req: &RunRequest) -> Result<Option<VlmRun>> {
        if let Some(img) = &req.image {
            crate::engine::multimodal::check_image(&self.cfg, img, self.dev.engine_name())?;
        }
        if self.cfg.vision.is_none() {
            return Ok(None);
        }
        let mrope = match &self.cfg.mrope {
            Some(mr) => {
                let half = self.cfg.head_dim / 2;
                let axes: Vec<i32> = (0..half).map(|j| mr.axis_of(j) as i32).collect();
                Some((
                    self.dev.upload("mrope_inv_freq", self.ropes.global.inv_freq())?,
                    self.dev.upload("mrope_axes", &axes)?,
                ))
            }
            None => None,
        };
        Ok(Some(VlmRun {
            image: req.image.clone(),
            delta: 0,
            mrope,
        }))
    }

    /// The step's positions (tapped), the image encoded and fused into
    /// `embed` at the prefill (`inputs_embeds` tapped at every step).
    pub(super) fn vlm_prologue(
        &self,
        run: &mut VlmRun,
        tokens: &[u32],
        pos0: usize,
        embed: &mut GBuf<T>,
        tc: &mut TapCtx,
    ) -> Result<VlmStep<T>> {
        let vc = self.cfg.vision.as_ref().expect("a VLM run has a vision config");
        let (t, e) = (tokens.len(), self.cfg.hidden);
        let mut pos = None;
        if run.mrope.is_some() {
            let grids: Vec<_> = run.image.iter().map(|i| i.grid).collect();
            let (positions, delta) =
                crate::model::vision::step_positions(tokens, pos0, vc.image_token, &grids, vc.merge, run.delta)
                    .map_err(|m| Error::engine(self.dev.engine_name(), m))?;
            run.delta = delta;
            let flat: Vec<i32> = positions
                .iter()
                .flat_map(|a| a.iter().map(|&v| i32::try_from(v).unwrap_or(i32::MAX)))
                .collect();
            pos = Some(self.dev.upload("mrope_positions", &flat)?);
        }

        let mut features = None;
        if let (0, Some(img)) = (pos0, &run.image) {
            match (&self.vision, &self.clip, &vc.llava) {
                (_, Some(cw), Some(lc)) => features = Some(self.encode_clip(cw, lc, img, tc)?),
                (Some(vw), _, None) => features = Some(self.encode(vw, vc, img, tc)?),
                _ => {}
            }
        }
        let mut pads = None;
        if let Some(f) = &features {
            // Feature row r replaces image-pad row r (HF's masked_scatter).
            let rows: Vec<i32> = (0..t)
                .filter(|&i| tokens[i] == vc.image_token)
                .take(f.rows)
                .map(|i| i as i32)
                .collect();
            if !rows.is_empty() {
                let idx = self.dev.upload("image_rows", &rows)?;
                self.scatter_rows(f.merger.view(), &mut embed.view_mut(), &idx, rows.len(), e, false)?;
                pads = Some((idx, rows.len()));
            }
        }
        self.tap(tc, Stage::InputsEmbeds, &[t, e], embed)?;
        if let (true, Some(pos)) = (tc.taps.contains(Stage::Positions), &pos) {
            // What the device rotates by, read back.
            let back = self.dev.download(pos.view(..))?;
            let values = back.iter().map(|&v| v as f32).collect();
            tc.caps.insert(
                tc.step,
                Stage::Positions,
                Tensor::new(vec![3, t], values).with_dtype(T::DTYPE),
            );
        }
        Ok(VlmStep { pos, pads, features })
    }

    /// M-RoPE of `x` `[T, heads, D]` at the step's positions.
    pub(super) fn mrope(
        &self,
        run: &VlmRun,
        vs: &VlmStep<T>,
        x: &GBuf<T>,
        out: &mut GBuf<T>,
        heads: usize,
    ) -> Result<()> {
        let (Some((inv_freq, axes)), Some(pos)) = (&run.mrope, &vs.pos) else {
            return Err(self.dev.err("M-RoPE asked of a model without it"));
        };
        let rows = pos.len() / 3;
        self.rope_axes(
            x.view(),
            &mut out.view_mut(),
            inv_freq,
            pos,
            axes,
            rows,
            heads,
            self.cfg.head_dim,
        )
    }

    /// Qwen3-VL: after layer `l` (< the number of deepstack mergers), its
    /// features are added to the image rows of `out`; the stage is tapped at
    /// every step (a decode step has no image rows: it equals `out`).
    pub(super) fn deepstack(&self, vs: &VlmStep<T>, l: usize, out: &mut GBuf<T>, tc: &mut TapCtx) -> Result<()> {
        let n_deep = self.cfg.vision.as_ref().map_or(0, |v| v.deepstack.len());
        if l >= n_deep {
            return Ok(());
        }
        if let (Some(f), Some((idx, n))) = (&vs.features, &vs.pads) {
            if let Some(ds) = f.deepstack.get(l) {
                let e = self.cfg.hidden;
                self.scatter_rows(ds.view(), &mut out.view_mut(), idx, *n, e, true)?;
            }
        }
        let t = out.g.len / self.cfg.hidden;
        self.tap(tc, Stage::Block(l, B::Deepstack), &[t, self.cfg.hidden], out)
    }
}
