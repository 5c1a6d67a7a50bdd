//! The CUDA engine's device copies of the weights that more than one of its
//! modules reads: the linear layers (weight, bias) and, for a
//! vision-language model, the vision tower's (LayerNorms, blocks, mergers),
//! uploaded in the storage type from what the CPU engine's loader read, and
//! read back by name for the `weights` run check.

use crate::engine::cpu::layers::Linear;
use crate::engine::cpu::vision::{LayerNorm, Merger, VisionWeights};
use crate::error::Result;
use crate::model::vision::{VisionConfig, VisionFamily};

use super::seam::{as_f32, DBuf, Dev};
use super::storage::Storage;

pub(super) struct DevLinear<T: Storage> {
    pub(super) w: DBuf<T>,
    pub(super) bias: Option<DBuf<T>>,
    pub(super) out_f: usize,
    pub(super) in_f: usize,
}

pub(super) struct DevLayerNorm<T: Storage> {
    pub(super) w: DBuf<T>,
    pub(super) b: DBuf<T>,
}

pub(super) struct DevMerger<T: Storage> {
    pub(super) norm: DevLayerNorm<T>,
    pub(super) postshuffle: bool,
    pub(super) fc1: DevLinear<T>,
    pub(super) fc2: DevLinear<T>,
}

pub(super) struct DevVisionBlock<T: Storage> {
    pub(super) norm1: DevLayerNorm<T>,
    pub(super) qkv: DevLinear<T>,
    pub(super) proj: DevLinear<T>,
    pub(super) norm2: DevLayerNorm<T>,
    pub(super) fc1: DevLinear<T>,
    pub(super) fc2: DevLinear<T>,
}

/// The tower's weights on the device, in the storage type.
pub(super) struct DevVision<T: Storage> {
    pub(super) patch: DevLinear<T>,
    pub(super) pos_embed: Option<DBuf<T>>,
    pub(super) blocks: Vec<DevVisionBlock<T>>,
    pub(super) merger: DevMerger<T>,
    pub(super) deepstack: Vec<DevMerger<T>>,
}

/// Uploads `v` rounded to `T`.
pub(super) fn upload<T: Storage>(dev: &Dev, v: &[f32]) -> Result<DBuf<T>> {
    let h: Vec<T> = v.iter().map(|&x| T::from_f32(x)).collect();
    dev.upload("weight", &h)
        .map_err(|e| dev.err(format!("weight upload: {e}")))
}

/// Uploads a linear layer (weight and bias) rounded to `T`.
pub(super) fn upload_linear<T: Storage>(dev: &Dev, l: &Linear) -> Result<DevLinear<T>> {
    Ok(DevLinear {
        w: upload(dev, l.w.data())?,
        bias: l.bias.as_deref().map(|b| upload(dev, b)).transpose()?,
        out_f: l.out_f,
        in_f: l.in_f,
    })
}

impl<T: Storage> DevVision<T> {
    /// Uploads the tower the CPU engine's loader read (`VisionWeights::load`).
    pub(super) fn upload(dev: &Dev, host: &VisionWeights) -> Result<DevVision<T>> {
        let ln = |n: &LayerNorm| -> Result<DevLayerNorm<T>> {
            Ok(DevLayerNorm {
                w: upload(dev, &n.w)?,
                b: upload(dev, &n.b)?,
            })
        };
        let lin = |l: &Linear| upload_linear::<T>(dev, l);
        let merger = |m: &Merger| -> Result<DevMerger<T>> {
            Ok(DevMerger {
                norm: ln(&m.norm)?,
                postshuffle: m.postshuffle,
                fc1: lin(&m.fc1)?,
                fc2: lin(&m.fc2)?,
            })
        };
        let mut blocks = Vec::with_capacity(host.blocks.len());
        for b in &host.blocks {
            blocks.push(DevVisionBlock {
                norm1: ln(&b.norm1)?,
                qkv: lin(&b.qkv)?,
                proj: lin(&b.proj)?,
                norm2: ln(&b.norm2)?,
                fc1: lin(&b.fc1)?,
                fc2: lin(&b.fc2)?,
            });
        }
        Ok(DevVision {
            patch: lin(&host.patch)?,
            pos_embed: host.pos_embed.as_deref().map(|p| upload(dev, p)).transpose()?,
            blocks,
            merger: merger(&host.merger)?,
            deepstack: host.deepstack.iter().map(merger).collect::<Result<_>>()?,
        })
    }

    /// Every tensor the device holds, read back, by canonical HF name (the
    /// names and shapes of `VisionWeights::visit`).
    pub(super) fn visit(&self, dev: &Dev, vc: &VisionConfig, f: &mut crate::engine::WeightVisitor) -> Result<()> {
        let back = |f: &mut crate::engine::WeightVisitor, name: &str, shape: &[usize], buf: &DBuf<T>| -> Result<()> {
            dev.with_host(buf.view(..), |h| f(name, shape, &as_f32(h)))
        };
        let lin = |f: &mut crate::engine::WeightVisitor, name: &str, shape: &[usize], l: &DevLinear<T>| -> Result<()> {
            back(f, &format!("{name}.weight"), shape, &l.w)?;
            if let Some(b) = &l.bias {
                back(f, &format!("{name}.bias"), &[l.out_f], b)?;
            }
            Ok(())
        };
        let plain = |l: &DevLinear<T>| [l.out_f, l.in_f];
        let ln = |f: &mut crate::engine::WeightVisitor, name: &str, n: &DevLayerNorm<T>| -> Result<()> {
            back(f, &format!("{name}.weight"), &[n.w.len()], &n.w)?;
            back(f, &format!("{name}.bias"), &[n.b.len()], &n.b)
        };
        let kernel = [vc.hidden, vc.in_channels, vc.temporal_patch, vc.patch, vc.patch];
        lin(f, "visual.patch_embed.proj", &kernel, &self.patch)?;
        if let Some(p) = &self.pos_embed {
            back(f, "visual.pos_embed.weight", &[p.len() / vc.hidden, vc.hidden], p)?;
        }
        let (fc1, fc2) = match vc.family {
            VisionFamily::Qwen2Vl | VisionFamily::Llava | VisionFamily::LlavaNext => ("mlp.fc1", "mlp.fc2"),
            VisionFamily::Qwen3Vl => ("mlp.linear_fc1", "mlp.linear_fc2"),
        };
        for (i, b) in self.blocks.iter().enumerate() {
            let p = format!("visual.blocks.{i}");
            ln(f, &format!("{p}.norm1"), &b.norm1)?;
            lin(f, &format!("{p}.attn.qkv"), &plain(&b.qkv), &b.qkv)?;
            lin(f, &format!("{p}.attn.proj"), &plain(&b.proj), &b.proj)?;
            ln(f, &format!("{p}.norm2"), &b.norm2)?;
            lin(f, &format!("{p}.{fc1}"), &plain(&b.fc1), &b.fc1)?;
            lin(f, &format!("{p}.{fc2}"), &plain(&b.fc2), &b.fc2)?;
        }
        let m = &self.merger;
        let (mn, m1, m2) = match vc.family {
            VisionFamily::Qwen2Vl | VisionFamily::Llava | VisionFamily::LlavaNext => ("visual.merger.ln_q", "visual.merger.mlp.0", "visual.merger.mlp.2"),
            VisionFamily::Qwen3Vl => (
                "visual.merger.norm",
                "visual.merger.linear_fc1",
                "visual.merger.linear_fc2",
            ),
        };
        ln(f, mn, &m.norm)?;
        lin(f, m1, &plain(&m.fc1), &m.fc1)?;
        lin(f, m2, &plain(&m.fc2), &m.fc2)?;
        for (j, d) in self.deepstack.iter().enumerate() {
            let p = format!("visual.deepstack_merger_list.{j}");
            ln(f, &format!("{p}.norm"), &d.norm)?;
            lin(f, &format!("{p}.linear_fc1"), &plain(&d.fc1), &d.fc1)?;
            lin(f, &format!("{p}.linear_fc2"), &plain(&d.fc2), &d.fc2)?;
        }
        Ok(())
    }
}
