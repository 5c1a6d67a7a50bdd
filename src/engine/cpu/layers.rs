//! The CPU engine's weights: HF Llama/Qwen2 tensors taken out of `Weights` by
//! name with their shapes checked, into plain f32 structs. Loading is strict:
//! a missing or mis-shaped tensor is an error naming it, and so is any tensor
//! left over afterwards, because an unexpected tensor usually means the
//! architecture was mis-detected and the engine would silently compute
//! something else.

use crate::error::{Error, Result};
use crate::model::{ModelConfig, Weights};
use crate::tensor::{DType, Tensor};

pub use super::linear::{matmul_input, Linear, Mlp};
use super::linear::visit_linear;


/// One decoder block.
#[derive(Clone, Debug)]
pub struct Block {
    pub attn_norm: Vec<f32>,
    /// q, k and v: three projections, or DeepSeek's latent attention.
    pub qkv: Qkv,
    /// Qwen3's per-head RMSNorm weights of q and k (`[D]` each).
    pub q_norm: Option<Vec<f32>>,
    pub k_norm: Option<Vec<f32>>,
    pub o: Linear,
    /// gpt-oss's per-head attention sink logits (`[H]`).
    pub sinks: Option<Vec<f32>>,
    /// Gemma's norms of the attention and MLP outputs (`[E]` each).
    pub attn_post_norm: Option<Vec<f32>>,
    pub ffn_post_norm: Option<Vec<f32>>,
    pub ffn_norm: Vec<f32>,
    pub ffn: Ffn,
}

/// How a block forms q, k and v.
#[derive(Clone, Debug)]
pub enum Qkv {
    Split { q: Linear, k: Linear, v: Linear },
    Latent(Box<super::mla::LatentWeights>),
}

impl Qkv {
    /// The plain projections (None for latent attention).
    #[cfg_attr(not(test), allow(dead_code))]
    pub fn split(&self) -> Option<(&Linear, &Linear, &Linear)> {
        match self {
            Qkv::Split { q, k, v } => Some((q, k, v)),
            Qkv::Latent(_) => None,
        }
    }
}


/// A block's feed-forward layer: a dense MLP or routed experts.
#[derive(Clone, Debug)]
pub enum Ffn {
    Dense(Mlp),
    Moe(Box<super::moe::MoeWeights>),
}

impl Ffn {
    /// The dense MLP (None in a routed layer).
    #[cfg_attr(not(test), allow(dead_code))]
    pub fn dense(&self) -> Option<&Mlp> {
        match self {
            Ffn::Dense(m) => Some(m),
            Ffn::Moe(_) => None,
        }
    }
}

impl Block {
    /// The block's projections (an MoE layer's router and experts included).
    fn linears_mut(&mut self) -> Vec<&mut Linear> {
        let mut v = match &mut self.qkv {
            Qkv::Split { q, k, v } => vec![q, k, v],
            Qkv::Latent(m) => m.linears_mut(),
        };
        v.push(&mut self.o);
        match &mut self.ffn {
            Ffn::Dense(m) => v.extend(m.linears_mut()),
            Ffn::Moe(m) => v.extend(m.linears_mut()),
        }
        v
    }
}

/// Every weight of the model.
#[derive(Clone, Debug)]
pub struct ModelWeights {
    /// `[V, E]` (in place in the file's map, like `Linear::w`).
    pub embed: Tensor,
    pub blocks: Vec<Block>,
    pub norm: Vec<f32>,
    /// `None` when the head is tied to `embed`.
    pub lm_head: Option<Linear>,
    /// A tied head's input quantisation (see `Linear::q8_block`).
    pub tied_head_q8: Option<usize>,
}

impl ModelWeights {
    pub fn load(cfg: &ModelConfig, ws: &mut Weights) -> Result<ModelWeights> {
        let (e, f, v) = (cfg.hidden, cfg.ffn, cfg.vocab);
        let (qd, kvd) = (cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim);
        let embed = ws.take("model.embed_tokens.weight", &[v, e])?;
        let mut blocks = Vec::with_capacity(cfg.layers);
        for i in 0..cfg.layers {
            let p = format!("model.layers.{i}");
            blocks.push(Block {
                attn_norm: ws.take(&format!("{p}.input_layernorm.weight"), &[e])?.into_data(),
                qkv: match &cfg.mla {
                    Some(m) => Qkv::Latent(Box::new(super::mla::LatentWeights::load(ws, cfg, m, &p)?)),
                    None => Qkv::Split {
                        q: Linear::load(ws, &format!("{p}.self_attn.q_proj"), qd, e)?,
                        k: Linear::load(ws, &format!("{p}.self_attn.k_proj"), kvd, e)?,
                        v: Linear::load(ws, &format!("{p}.self_attn.v_proj"), kvd, e)?,
                    },
                },
                q_norm: qk_norm(ws, cfg, &format!("{p}.self_attn.q_norm.weight"))?,
                k_norm: qk_norm(ws, cfg, &format!("{p}.self_attn.k_norm.weight"))?,
                o: Linear::load(ws, &format!("{p}.self_attn.o_proj"), e, cfg.heads * cfg.v_head_dim())?,
                sinks: match cfg.attn_sinks {
                    true => Some(ws.take(&format!("{p}.self_attn.sinks"), &[cfg.heads])?.into_data()),
                    false => None,
                },
                attn_post_norm: post_norm(ws, cfg, &format!("{p}.post_attention_layernorm.weight"))?,
                ffn_post_norm: post_norm(ws, cfg, &format!("{p}.post_feedforward_layernorm.weight"))?,
                ffn_norm: ws
                    .take(&format!("{p}.{}.weight", ffn_norm_name(cfg)), &[e])?
                    .into_data(),
                ffn: match cfg.moe.as_ref().filter(|m| m.is_sparse(i)) {
                    Some(moe) => Ffn::Moe(Box::new(super::moe::MoeWeights::load(ws, moe, &format!("{p}.mlp"), e)?)),
                    None => Ffn::Dense(Mlp::load(ws, &format!("{p}.mlp"), f, e)?),
                },
            });
        }
        let norm = ws.take("model.norm.weight", &[e])?.into_data();
        // HF ties the head to the embeddings when the config says so (a stored
        // `lm_head.weight` is then overwritten), and a checkpoint saved with
        // tied weights simply has no `lm_head.weight`.
        let head = ws.take_opt("lm_head.weight", &[v, e])?;
        let lm_head = match head {
            Some(t) if !cfg.tie_embeddings => Some(Linear {
                w: t,
                bias: None,
                out_f: v,
                in_f: e,
                q8_block: None,
            }),
            _ => None,
        };
        let leftover: Vec<&str> = ws.remaining().filter(|n| !is_ignorable_buffer(n)).collect();
        if !leftover.is_empty() {
            let shown: Vec<String> = leftover.iter().take(5).map(|n| format!("`{n}`")).collect();
            return Err(Error::model(
                &ws.dir,
                format!(
                    "{} weight(s) not used by the {} decoder (is the architecture right?): {}{}",
                    leftover.len(),
                    cfg.arch,
                    shown.join(", "),
                    if leftover.len() > 5 { ", ..." } else { "" }
                ),
            ));
        }
        Ok(ModelWeights {
            embed,
            blocks,
            norm,
            lm_head,
            tied_head_q8: None,
        })
    }

    /// Every tensor held, by HF name (see `Engine::visit_weights`). A tied head
    /// is the embedding itself and is not visited twice.
    pub fn visit(&self, cfg: &ModelConfig, f: &mut crate::engine::WeightVisitor) {
        let (e, v, d) = (cfg.hidden, cfg.vocab, cfg.head_dim);
        let lin = visit_linear;
        f("model.embed_tokens.weight", &[v, e], self.embed.data());
        for (i, b) in self.blocks.iter().enumerate() {
            let p = format!("model.layers.{i}");
            f(&format!("{p}.input_layernorm.weight"), &[e], &b.attn_norm);
            match &b.qkv {
                Qkv::Split { q, k, v } => {
                    lin(f, &format!("{p}.self_attn.q_proj"), q);
                    lin(f, &format!("{p}.self_attn.k_proj"), k);
                    lin(f, &format!("{p}.self_attn.v_proj"), v);
                }
                Qkv::Latent(m) => m.visit(&format!("{p}.self_attn"), f),
            }
            if let Some(qn) = &b.q_norm {
                f(&format!("{p}.self_attn.q_norm.weight"), &[d], qn);
            }
            if let Some(kn) = &b.k_norm {
                f(&format!("{p}.self_attn.k_norm.weight"), &[d], kn);
            }
            lin(f, &format!("{p}.self_attn.o_proj"), &b.o);
            if let Some(s) = &b.sinks {
                f(&format!("{p}.self_attn.sinks"), &[s.len()], s);
            }
            if let Some(n) = &b.attn_post_norm {
                f(&format!("{p}.post_attention_layernorm.weight"), &[e], n);
            }
            f(&format!("{p}.{}.weight", ffn_norm_name(cfg)), &[e], &b.ffn_norm);
            if let Some(n) = &b.ffn_post_norm {
                f(&format!("{p}.post_feedforward_layernorm.weight"), &[e], n);
            }
            match &b.ffn {
                Ffn::Dense(m) => m.visit(&format!("{p}.mlp"), f),
                Ffn::Moe(m) => m.visit(&format!("{p}.mlp"), f),
            }
        }
        f("model.norm.weight", &[e], &self.norm);
        if let Some(h) = &self.lm_head {
            lin(f, "lm_head", h);
        }
    }

    /// Every projection (and the LM head) quantises its input to 8 bits in
    /// blocks of `block` values before its GEMM.
    pub fn quantise_activations(&mut self, block: usize) {
        for b in &mut self.blocks {
            for lin in b.linears_mut() {
                lin.q8_block = Some(block);
            }
        }
        if let Some(h) = &mut self.lm_head {
            h.q8_block = Some(block);
        }
        self.tied_head_q8 = Some(block);
    }

    /// Rounds every weight to the storage dtype (the identity for f32): an
    /// engine with f16/bf16 storage holds its weights in that type, and the CPU
    /// engine emulates it by holding the rounded values widened to f32.
    pub fn round_to(&mut self, storage: DType) {
        if storage == DType::F32 {
            return;
        }
        storage.round_slice(self.embed.data_mut());
        for b in &mut self.blocks {
            storage.round_slice(&mut b.attn_norm);
            storage.round_slice(&mut b.ffn_norm);
            for n in [
                &mut b.q_norm,
                &mut b.k_norm,
                &mut b.attn_post_norm,
                &mut b.ffn_post_norm,
                &mut b.sinks,
            ]
            .into_iter()
            .flatten()
            {
                storage.round_slice(n);
            }
            if let Ffn::Moe(m) = &mut b.ffn {
                m.round_to(storage);
            }
            if let Qkv::Latent(m) = &mut b.qkv {
                m.round_to(storage);
            }
            for lin in b.linears_mut() {
                lin.round_to(storage);
            }
        }
        storage.round_slice(&mut self.norm);
        if let Some(h) = &mut self.lm_head {
            h.round_to(storage);
        }
    }
}

/// A q/k norm weight: required when the architecture has them (Qwen3), and
/// otherwise left in `ws`, where it is reported as unused.
fn qk_norm(ws: &mut Weights, cfg: &ModelConfig, name: &str) -> Result<Option<Vec<f32>>> {
    if !cfg.qk_norm {
        return Ok(None);
    }
    Ok(Some(ws.take(name, &[cfg.head_dim])?.into_data()))
}

/// A post norm's weight: required when the architecture has them (Gemma),
/// else not taken.
fn post_norm(ws: &mut Weights, cfg: &ModelConfig, name: &str) -> Result<Option<Vec<f32>>> {
    if !cfg.post_norms {
        return Ok(None);
    }
    Ok(Some(ws.take(name, &[cfg.hidden])?.into_data()))
}

/// The HF name of the MLP's input norm (`model::features::ffn_norm_name`).
pub fn ffn_norm_name(cfg: &ModelConfig) -> &'static str {
    crate::model::features::ffn_norm_name(cfg.post_norms)
}

/// Non-parameter buffers some checkpoints carry (RoPE tables HF recomputes).
fn is_ignorable_buffer(name: &str) -> bool {
    name.ends_with("rotary_emb.inv_freq")
        || name.ends_with("rotary_emb.cos_cached")
        || name.ends_with("rotary_emb.sin_cached")
}
