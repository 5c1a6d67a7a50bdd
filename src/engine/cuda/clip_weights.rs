//! The CUDA engine's device copies of LLaVA's CLIP tower and projector
//! (`clip.rs` runs them), uploaded in the storage type from what the CPU
//! engine's loader read, and read back by name for the `weights` run check.

use crate::engine::cpu::clip::ClipWeights;
use crate::error::Result;
use crate::model::llava::LlavaConfig;

use super::seam::{as_f32, DBuf, Dev};
use super::storage::Storage;
use super::weights::{upload, upload_linear, DevLayerNorm, DevLinear};

pub(super) struct DevClipBlock<T: Storage> {
    pub(super) norm1: DevLayerNorm<T>,
    pub(super) q: DevLinear<T>,
    pub(super) k: DevLinear<T>,
    pub(super) v: DevLinear<T>,
    pub(super) o: DevLinear<T>,
    pub(super) norm2: DevLayerNorm<T>,
    pub(super) fc1: DevLinear<T>,
    pub(super) fc2: DevLinear<T>,
}

/// The tower and projector on the device, in the storage type.
pub(super) struct DevClip<T: Storage> {
    pub(super) patch: DevLinear<T>,
    pub(super) class: DBuf<T>,
    /// `[N + 1, Ev]`.
    pub(super) pos: DBuf<T>,
    pub(super) pre_norm: DevLayerNorm<T>,
    pub(super) blocks: Vec<DevClipBlock<T>>,
    pub(super) post_norm: DevLayerNorm<T>,
    pub(super) proj1: DevLinear<T>,
    pub(super) proj2: DevLinear<T>,
    pub(super) newline: Option<DBuf<T>>,
}

impl<T: Storage> DevClip<T> {
    /// Uploads what the CPU engine's loader read (`ClipWeights::load`).
    pub(super) fn upload(dev: &Dev, host: &ClipWeights) -> Result<DevClip<T>> {
        let ln = |n: &crate::engine::cpu::vision::LayerNorm| -> Result<DevLayerNorm<T>> {
            Ok(DevLayerNorm {
                w: upload(dev, &n.w)?,
                b: upload(dev, &n.b)?,
            })
        };
        let lin = |l: &crate::engine::cpu::layers::Linear| upload_linear::<T>(dev, l);
        let mut blocks = Vec::with_capacity(host.blocks.len());
        for b in &host.blocks {
            blocks.push(DevClipBlock {
                norm1: ln(&b.norm1)?,
                q: lin(&b.q)?,
                k: lin(&b.k)?,
                v: lin(&b.v)?,
                o: lin(&b.o)?,
                norm2: ln(&b.norm2)?,
                fc1: lin(&b.fc1)?,
                fc2: lin(&b.fc2)?,
            });
        }
        Ok(DevClip {
            patch: lin(&host.patch)?,
            class: upload(dev, &host.class)?,
            pos: upload(dev, &host.pos)?,
            pre_norm: ln(&host.pre_norm)?,
            blocks,
            post_norm: ln(&host.post_norm)?,
            proj1: lin(&host.proj1)?,
            proj2: lin(&host.proj2)?,
            newline: host.newline.as_deref().map(|n| upload(dev, n)).transpose()?,
        })
    }

    /// Every tensor the device holds, read back, by the names and shapes of
    /// `ClipWeights::visit`.
    pub(super) fn visit(&self, dev: &Dev, cfg: &LlavaConfig, f: &mut crate::engine::WeightVisitor) -> Result<()> {
        let back = |f: &mut crate::engine::WeightVisitor, name: &str, shape: &[usize], buf: &DBuf<T>| -> Result<()> {
            dev.with_host(buf.view(..), |h| f(name, shape, &as_f32(h)))
        };
        let lin = |f: &mut crate::engine::WeightVisitor, name: &str, l: &DevLinear<T>| -> Result<()> {
            back(f, &format!("{name}.weight"), &[l.out_f, l.in_f], &l.w)?;
            if let Some(b) = &l.bias {
                back(f, &format!("{name}.bias"), &[l.out_f], b)?;
            }
            Ok(())
        };
        let ln = |f: &mut crate::engine::WeightVisitor, name: &str, n: &DevLayerNorm<T>| -> Result<()> {
            back(f, &format!("{name}.weight"), &[n.w.len()], &n.w)?;
            back(f, &format!("{name}.bias"), &[n.b.len()], &n.b)
        };
        let t = &cfg.tower;
        let vm = "vision_tower";
        let kernel = [t.hidden, t.channels, t.patch, t.patch];
        back(f, &format!("{vm}.embeddings.patch_embedding.weight"), &kernel, &self.patch.w)?;
        back(f, &format!("{vm}.embeddings.class_embedding"), &[t.hidden], &self.class)?;
        back(f, &format!("{vm}.embeddings.position_embedding.weight"), &[t.patches() + 1, t.hidden], &self.pos)?;
        ln(f, &format!("{vm}.pre_layrnorm"), &self.pre_norm)?;
        for (i, b) in self.blocks.iter().enumerate() {
            let p = format!("{vm}.encoder.layers.{i}");
            ln(f, &format!("{p}.layer_norm1"), &b.norm1)?;
            for (name, l) in [("q_proj", &b.q), ("k_proj", &b.k), ("v_proj", &b.v), ("out_proj", &b.o)] {
                lin(f, &format!("{p}.self_attn.{name}"), l)?;
            }
            ln(f, &format!("{p}.layer_norm2"), &b.norm2)?;
            lin(f, &format!("{p}.mlp.fc1"), &b.fc1)?;
            lin(f, &format!("{p}.mlp.fc2"), &b.fc2)?;
        }
        ln(f, &format!("{vm}.post_layernorm"), &self.post_norm)?;
        lin(f, "multi_modal_projector.linear_1", &self.proj1)?;
        lin(f, "multi_modal_projector.linear_2", &self.proj2)?;
        if let Some(nl) = &self.newline {
            back(f, "image_newline", &[nl.len()], nl)?;
        }
        Ok(())
    }
}
