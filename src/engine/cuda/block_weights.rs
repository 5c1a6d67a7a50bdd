//! The CUDA engine's per-block weights beyond a plain linear: the MLP (dense,
//! or routed experts with a shared one) and q/k/v (three projections, or
//! DeepSeek's latent attention), uploaded in the storage type from what the
//! CPU engine's loader read, and read back by HF name for the `weights`
//! check. The forward passes that use them are `moe` and `mla`.

use super::seam::DBuf;
use super::storage::Storage;
use super::weights::{upload, upload_linear, DevLinear};
use crate::engine::cpu::layers::{Ffn, Mlp, Qkv};
use crate::error::Result;

/// A gated MLP on the device (a dense layer's, an expert's, a shared one).
pub(super) struct DevMlp<T: Storage> {
    pub(super) gate: DevLinear<T>,
    pub(super) up: DevLinear<T>,
    pub(super) down: DevLinear<T>,
}

/// A routed layer's weights on the device.
pub(super) struct DevMoe<T: Storage> {
    pub(super) router: DevLinear<T>,
    pub(super) correction_bias: Option<DBuf<T>>,
    pub(super) experts: Vec<DevMlp<T>>,
    pub(super) shared: Option<DevMlp<T>>,
    pub(super) shared_gate: Option<DevLinear<T>>,
}

/// A block's feed-forward layer on the device.
pub(super) enum DevFfn<T: Storage> {
    Dense(DevMlp<T>),
    Moe(Box<DevMoe<T>>),
}

fn upload_mlp<T: Storage>(dev: &super::seam::Dev, m: &Mlp) -> Result<DevMlp<T>> {
    Ok(DevMlp {
        gate: upload_linear(dev, &m.gate)?,
        up: upload_linear(dev, &m.up)?,
        down: upload_linear(dev, &m.down)?,
    })
}

impl<T: Storage> DevFfn<T> {
    /// Uploads what the CPU engine's loader read.
    pub(super) fn upload(dev: &super::seam::Dev, host: &Ffn) -> Result<DevFfn<T>> {
        Ok(match host {
            Ffn::Dense(m) => DevFfn::Dense(upload_mlp(dev, m)?),
            Ffn::Moe(m) => DevFfn::Moe(Box::new(DevMoe {
                router: upload_linear(dev, &m.router)?,
                correction_bias: m.correction_bias.as_deref().map(|b| upload(dev, b)).transpose()?,
                experts: m.experts.iter().map(|x| upload_mlp(dev, x)).collect::<Result<_>>()?,
                shared: m.shared.as_ref().map(|x| upload_mlp(dev, x)).transpose()?,
                shared_gate: m.shared_gate.as_ref().map(|g| upload_linear(dev, g)).transpose()?,
            })),
        })
    }

    /// Every device tensor under its HF name (prefix `….mlp`), for
    /// `visit_weights`: `lin` reads back a linear, `vec` a vector.
    pub(super) fn visit<W: ?Sized>(
        &self,
        p: &str,
        f: &mut W,
        lin: &dyn Fn(&mut W, &str, &DevLinear<T>) -> Result<()>,
        vec: &dyn Fn(&mut W, &str, usize, &DBuf<T>) -> Result<()>,
    ) -> Result<()> {
        let mlp = |f: &mut W, p: &str, m: &DevMlp<T>| -> Result<()> {
            lin(f, &format!("{p}.gate_proj"), &m.gate)?;
            lin(f, &format!("{p}.up_proj"), &m.up)?;
            lin(f, &format!("{p}.down_proj"), &m.down)
        };
        match self {
            DevFfn::Dense(m) => mlp(f, p, m),
            DevFfn::Moe(m) => {
                lin(f, &format!("{p}.gate"), &m.router)?;
                if let Some(b) = &m.correction_bias {
                    vec(f, &format!("{p}.gate.e_score_correction_bias"), m.router.out_f, b)?;
                }
                for (j, x) in m.experts.iter().enumerate() {
                    mlp(f, &format!("{p}.experts.{j}"), x)?;
                }
                if let Some(x) = &m.shared {
                    mlp(f, &format!("{p}.shared_expert"), x)?;
                }
                if let Some(g) = &m.shared_gate {
                    lin(f, &format!("{p}.shared_expert_gate"), g)?;
                }
                Ok(())
            }
        }
    }
}

/// A block's latent-attention weights on the device.
pub(super) struct DevLatent<T: Storage> {
    pub(super) q_a: Option<(DevLinear<T>, DBuf<T>)>,
    pub(super) q: DevLinear<T>,
    pub(super) kv_a: DevLinear<T>,
    pub(super) kv_a_norm: DBuf<T>,
    pub(super) kv_b: DevLinear<T>,
}

/// A block's q/k/v weights on the device.
pub(super) enum DevQkv<T: Storage> {
    Split {
        q: DevLinear<T>,
        k: DevLinear<T>,
        v: DevLinear<T>,
    },
    Latent(Box<DevLatent<T>>),
}

impl<T: Storage> DevQkv<T> {
    pub(super) fn upload(dev: &super::seam::Dev, host: &Qkv) -> Result<DevQkv<T>> {
        Ok(match host {
            Qkv::Split { q, k, v } => DevQkv::Split {
                q: upload_linear(dev, q)?,
                k: upload_linear(dev, k)?,
                v: upload_linear(dev, v)?,
            },
            Qkv::Latent(m) => DevQkv::Latent(Box::new(DevLatent {
                q_a: match &m.q_a {
                    Some((a, n)) => Some((upload_linear(dev, a)?, upload(dev, n)?)),
                    None => None,
                },
                q: upload_linear(dev, &m.q)?,
                kv_a: upload_linear(dev, &m.kv_a)?,
                kv_a_norm: upload(dev, &m.kv_a_norm)?,
                kv_b: upload_linear(dev, &m.kv_b)?,
            })),
        })
    }

    /// Every device tensor under its HF name (`p` = `….self_attn`).
    pub(super) fn visit<W: ?Sized>(
        &self,
        p: &str,
        f: &mut W,
        lin: &dyn Fn(&mut W, &str, &DevLinear<T>) -> Result<()>,
        vec: &dyn Fn(&mut W, &str, usize, &DBuf<T>) -> Result<()>,
    ) -> Result<()> {
        match self {
            DevQkv::Split { q, k, v } => {
                lin(f, &format!("{p}.q_proj"), q)?;
                lin(f, &format!("{p}.k_proj"), k)?;
                lin(f, &format!("{p}.v_proj"), v)
            }
            DevQkv::Latent(m) => {
                match &m.q_a {
                    Some((a, n)) => {
                        lin(f, &format!("{p}.q_a_proj"), a)?;
                        vec(f, &format!("{p}.q_a_layernorm.weight"), a.out_f, n)?;
                        lin(f, &format!("{p}.q_b_proj"), &m.q)?;
                    }
                    None => lin(f, &format!("{p}.q_proj"), &m.q)?,
                }
                lin(f, &format!("{p}.kv_a_proj_with_mqa"), &m.kv_a)?;
                vec(f, &format!("{p}.kv_a_layernorm.weight"), m.kv_b.in_f, &m.kv_a_norm)?;
                lin(f, &format!("{p}.kv_b_proj"), &m.kv_b)
            }
        }
    }
}
