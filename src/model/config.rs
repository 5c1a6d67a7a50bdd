//! The architecture hyper-parameters an engine and the shape check need, read
//! from an HF `config.json`: Llama-family decoders (Llama, Mistral, Qwen2,
//! Qwen3 with its per-head q/k norms, Phi-3 with fused projections), the
//! mixture-of-experts families (`model::moe`; DeepSeek-V3's latent attention
//! in `model::mla`, gpt-oss's attention sinks here) and Gemma 3
//! (`model::gemma`: its features are general fields here).
//!
//! A config that asks for maths the engines do not implement (RoPE scaling,
//! an activation other than SiLU, soft-capping, ...) is refused with the field
//! named (`unimplemented`): computing a different model and reporting PASSED
//! against goldens recorded from the real one would be the worst outcome.

use std::path::Path;

use serde_json::Value;

use crate::error::{Error, Result};

pub use super::features::{Activation, LocalAttention};
pub use super::mla::Mla;
pub use super::moe::Moe;
pub use super::rope_scaling::RopeScaling;
pub use super::vision::{ImageDims, ImageGrid, MRope, VisionConfig};

#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct ModelConfig {
    /// `model_type` from config.json (`qwen2`, `llama`, ...).
    pub arch: String,
    pub vocab: usize,
    pub hidden: usize,
    pub ffn: usize,
    pub layers: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub rope_theta: f64,
    /// RoPE scaling (linear, dynamic, YaRN, LongRoPE, Llama 3), as HF
    /// computes it (`model::rope_scaling`); None for plain RoPE.
    pub rope_scaling: Option<RopeScaling>,
    pub rms_eps: f64,
    pub tie_embeddings: bool,
    /// Qwen3: q and k go through a per-head RMSNorm (weights of length
    /// head_dim) before RoPE, giving the `q_norm` / `k_norm` stages.
    pub qk_norm: bool,
    /// A sliding window a GGUF declares for a family whose per-layer use
    /// the file does not say (llama.cpp computes no window there): a run must
    /// stay within it (`Plan::build` checks), where it masks nothing. An HF
    /// config's windows are `local`, which the engines implement.
    pub sliding_window: Option<usize>,
    /// The longest context the model was built for (`max_position_embeddings`,
    /// GGUF `context_length`), when the file says.
    pub context_length: Option<usize>,
    /// The MLP's gate activation: SiLU (SwiGLU) or GELU-tanh (Gemma's GeGLU).
    pub act: Activation,
    /// Every RMSNorm multiplies by `1 + w` (Gemma), `w` as HF holds it.
    pub norm_plus_one: bool,
    /// Embedding rows are multiplied by this before block 0 (Gemma: √hidden
    /// rounded to f32, as HF's float32 `embed_scale` and llama.cpp's
    /// `sqrtf(n_embd)`).
    pub embed_scale: Option<f32>,
    /// RMSNorms on the attention and MLP outputs before each residual add
    /// (Gemma): the `attn_post_norm` and `ffn_post_norm` stages.
    pub post_norms: bool,
    /// The scale of q·kᵀ: head_dim^-½, or Gemma's `query_pre_attn_scalar^-½`.
    pub attn_scale: f64,
    /// Sliding-window layers (Mistral, Phi-3, Qwen2/Qwen3's
    /// `max_window_layers`, Gemma 3's interleaving with its own RoPE base):
    /// implemented by the engines, unlike `sliding_window`.
    pub local: Option<LocalAttention>,
    /// A vision-language model's tower (Qwen2-VL, Qwen3-VL): the vision
    /// stages, fusion and M-RoPE follow from it. None for a text model.
    pub vision: Option<VisionConfig>,
    /// The language model's multimodal RoPE sections (with `vision`).
    pub mrope: Option<MRope>,
    /// Mixture-of-experts layers (`model::moe`): None for a dense model.
    pub moe: Option<Moe>,
    /// DeepSeek's multi-head latent attention (`model::mla`): `head_dim` is
    /// then each head's q/k width (nope + rope) and `kv_heads` = `heads`.
    pub mla: Option<Mla>,
    /// gpt-oss's attention sinks: per head a learned logit `self_attn.sinks`
    /// joins every row's softmax and is dropped after it, so a row of
    /// `attn_probs` sums to 1 − its sink's share.
    pub attn_sinks: bool,
}

/// Architectures whose HF weights follow the Llama layout (q/k/v/o, gate/up/down,
/// two RMSNorms per block, NEOX rotate-half RoPE).
/// The MoE families (`model::moe::MOE_ARCHS`) have the same attention.
const SUPPORTED: &[&str] = &[
    "qwen2",
    "qwen3",
    "llama",
    "mistral",
    "phi3",
    "gemma3_text",
    "mixtral",
    "qwen2_moe",
    "qwen3_moe",
    "deepseek_v3",
    "gpt_oss",
];

impl ModelConfig {
    /// LLaVA's vision side (the tower's feature layer, projector, pinpoints).
    pub fn llava(&self) -> Option<&super::llava::LlavaConfig> {
        self.vision.as_ref().and_then(|v| v.llava.as_ref())
    }

    /// Reads `<dir>/config.json`.
    pub fn from_hf_dir(dir: &Path) -> Result<ModelConfig> {
        Self::from_hf_dir_with(dir, None)
    }

    /// Reads `<dir>/config.json` with a spec's `config:` override merged in
    /// (`merge_override`).
    pub fn from_hf_dir_with(dir: &Path, over: Option<&Value>) -> Result<ModelConfig> {
        let path = dir.join("config.json");
        let text = std::fs::read_to_string(&path).map_err(|e| Error::io(&path, e))?;
        let mut v: Value =
            serde_json::from_str(&text).map_err(|e| Error::model(&path, format!("not valid JSON: {e}")))?;
        if let Some(o) = over {
            merge_override(&mut v, o).map_err(|m| Error::model(&path, format!("the spec's `config:`: {m}")))?;
        }
        Self::from_json(&v).map_err(|msg| Error::model(&path, msg))
    }

    /// A GGUF model's config with a spec's `config:` override: only its RoPE
    /// scaling (`rope_scaling` / `rope_parameters`) and
    /// `max_position_embeddings`, merged into the HF form of what the file says.
    pub fn with_gguf_override(mut self, over: &Value) -> std::result::Result<ModelConfig, String> {
        let o = over.as_object().ok_or("expected a mapping of HF config keys")?;
        if let Some(k) = o
            .keys()
            .find(|k| !matches!(k.as_str(), "rope_scaling" | "rope_parameters" | "max_position_embeddings"))
        {
            return Err(format!(
                "`{k}` cannot override a GGUF model's config (a GGUF takes rope_scaling, rope_parameters and \
                 max_position_embeddings; give an HF model folder for other keys)"
            ));
        }
        if self.rope_scaling.is_some() {
            return Err("the model already has RoPE scaling; an override cannot be merged into it".into());
        }
        let mut v = serde_json::json!({"rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta}});
        if let Some(c) = self.context_length {
            v["max_position_embeddings"] = c.into();
        }
        merge_override(&mut v, over)?;
        let max_positions = v.get("max_position_embeddings").and_then(Value::as_u64).map(|n| n as usize);
        self.rope_scaling = RopeScaling::from_config(&v, &self.arch)?;
        self.context_length = match &self.rope_scaling {
            Some(rs) => rs.scaled_context(max_positions),
            None => max_positions,
        };
        self.validate()?;
        Ok(self)
    }

    pub fn from_json(v: &Value) -> std::result::Result<ModelConfig, String> {
        let arch = v
            .get("model_type")
            .and_then(Value::as_str)
            .ok_or("missing string key `model_type`")?
            .to_string();
        if arch == "gemma3_text" {
            // Gemma 3 is read as the Llama form plus its features; the family
            // is called `gemma3` as llama.cpp calls it.
            let (rest, parts) = super::gemma::normalise(v)?;
            let mut rest = rest;
            rest["model_type"] = "gemma3".into();
            let mut cfg = Self::from_json_llama(&rest, "gemma3".into())?;
            cfg.act = Activation::GeluTanh;
            cfg.norm_plus_one = true;
            cfg.embed_scale = Some((cfg.hidden as f64).sqrt() as f32);
            cfg.post_norms = true;
            cfg.qk_norm = true;
            cfg.attn_scale = parts.attn_scale;
            cfg.rope_theta = parts.rope_theta;
            cfg.local = parts.local;
            return Ok(cfg);
        }
        if arch == "gemma3" {
            return Err(
                "model_type `gemma3` is Gemma 3's vision-language checkpoint; touchstone runs its text \
                        decoder: give a `gemma3_text` model (Gemma3ForCausalLM)"
                    .into(),
            );
        }
        if arch == "llava" || arch == "llava_next" {
            // A Llama (Vicuna, Mistral) text model behind a CLIP tower and a
            // projector; plain 1-D positions.
            let lc = super::llava::LlavaConfig::from_json(v)?;
            let text = super::llava::text_config(v)?;
            let text_arch = text.get("model_type").and_then(Value::as_str).unwrap_or("").to_string();
            let mut cfg = Self::from_json_llama(&text, text_arch).map_err(|e| format!("text_config: {e}"))?;
            cfg.arch = arch;
            cfg.vision = Some(VisionConfig::of_llava(lc, cfg.hidden));
            return Ok(cfg);
        }
        if arch == "qwen2_vl" || arch == "qwen3_vl" {
            let (text, text_arch, vision, mrope) = super::vision::split_config(v)?;
            let mut cfg = Self::from_json_llama(&text, text_arch.into()).map_err(|e| format!("text_config: {e}"))?;
            if vision.out_hidden != cfg.hidden {
                return Err(format!(
                    "the vision merger gives rows of {} but the language model's hidden size is {}",
                    vision.out_hidden, cfg.hidden
                ));
            }
            if mrope.section.iter().sum::<usize>() != cfg.head_dim / 2 {
                return Err(format!(
                    "`mrope_section` {:?} sums to {}, not head_dim/2 = {}",
                    mrope.section,
                    mrope.section.iter().sum::<usize>(),
                    cfg.head_dim / 2
                ));
            }
            if let Some(rs) = &cfg.rope_scaling {
                return Err(format!(
                    "text_config: RoPE scaling ({}) with M-RoPE is not implemented by touchstone's engines \
                     (refusing rather than checking a different model)",
                    rs.name()
                ));
            }
            cfg.arch = arch;
            cfg.vision = Some(vision);
            cfg.mrope = Some(mrope);
            return Ok(cfg);
        }
        Self::from_json_llama(v, arch)
    }

    /// A Llama-layout config (`arch` its family).
    fn from_json_llama(v: &Value, arch: String) -> std::result::Result<ModelConfig, String> {
        if !SUPPORTED.contains(&arch.as_str()) && arch != "gemma3" {
            return Err(format!(
                "model_type `{arch}` is not supported (supported: {})",
                SUPPORTED.join(", ")
            ));
        }
        let usize_key = |k: &str| -> std::result::Result<usize, String> {
            v.get(k)
                .and_then(Value::as_u64)
                .map(|n| n as usize)
                .ok_or_else(|| format!("missing or non-integer key `{k}`"))
        };
        let hidden = usize_key("hidden_size")?;
        let heads = usize_key("num_attention_heads")?;
        let kv_heads = match v.get("num_key_value_heads") {
            Some(Value::Null) | None => heads,
            Some(_) => usize_key("num_key_value_heads")?,
        };
        let head_dim = match v.get("head_dim") {
            Some(Value::Null) | None => hidden / heads.max(1),
            Some(_) => usize_key("head_dim")?,
        };
        // transformers 5 writes `rope_parameters.rope_theta`; configs written by
        // transformers 4 (most published Qwen2.5 checkpoints) have `rope_theta`.
        let rope_theta = v
            .get("rope_parameters")
            .and_then(|p| p.get("rope_theta"))
            .or_else(|| v.get("rope_theta"))
            .and_then(Value::as_f64)
            .ok_or("missing `rope_theta` (looked in `rope_parameters.rope_theta` and `rope_theta`)")?;
        let rms_eps = v
            .get("rms_norm_eps")
            .and_then(Value::as_f64)
            .ok_or("missing number key `rms_norm_eps`")?;
        let tie_embeddings = v.get("tie_word_embeddings").and_then(Value::as_bool).unwrap_or(false);
        unimplemented(v)?;
        let rope_scaling = RopeScaling::from_config(v, &arch)?;
        let layers = usize_key("num_hidden_layers")?;
        let local = super::sliding::sliding_layers(v, &arch, layers)?;
        let max_positions = v
            .get("max_position_embeddings")
            .and_then(Value::as_u64)
            .map(|n| n as usize);
        // A scaled model's context is the scaled one (dynamic: unbounded).
        let context_length = match &rope_scaling {
            Some(rs) => rs.scaled_context(max_positions),
            None => max_positions,
        };
        let mut cfg = ModelConfig {
            vocab: usize_key("vocab_size")?,
            hidden,
            ffn: usize_key("intermediate_size")?,
            layers,
            heads,
            kv_heads,
            head_dim,
            rope_theta,
            rope_scaling,
            rms_eps,
            tie_embeddings,
            qk_norm: arch == "qwen3" || arch == "qwen3_moe",
            sliding_window: None,
            context_length,
            act: Activation::Silu,
            norm_plus_one: false,
            embed_scale: None,
            post_norms: false,
            attn_scale: (head_dim as f64).powf(-0.5),
            local,
            vision: None,
            mrope: None,
            moe: super::moe::Moe::from_config(v, &arch, layers)?,
            mla: None,
            attn_sinks: arch == "gpt_oss",
            arch,
        };
        if cfg.arch == "deepseek_v3" {
            let mla = super::mla::Mla::from_config(v)?;
            // HF's `head_dim` of a DeepSeek config is the RoPE part's width.
            cfg.head_dim = mla.qk_head_dim();
            cfg.kv_heads = cfg.heads;
            cfg.attn_scale = (cfg.head_dim as f64).powf(-0.5) * deepseek_mscale(v).powi(2);
            cfg.mla = Some(mla);
        }
        cfg.validate()?;
        Ok(cfg)
    }

    pub(crate) fn validate(&self) -> std::result::Result<(), String> {
        // Upper bounds far beyond any real decoder (the largest have ~130
        // layers, 128 heads, hidden 16-32K, vocab ~260K): a corrupt or hostile
        // config must be an error, not a loop or an allocation per layer.
        for (name, n, max) in [
            ("vocab_size", self.vocab, 1usize << 24),
            ("hidden_size", self.hidden, 1 << 20),
            ("intermediate_size", self.ffn, 1 << 22),
            ("num_hidden_layers", self.layers, 4096),
            ("num_attention_heads", self.heads, 4096),
            ("num_key_value_heads", self.kv_heads, 4096),
            ("head_dim", self.head_dim, 1 << 16),
        ] {
            if n > max {
                return Err(format!("`{name}` is {n}; at most {max} is accepted"));
            }
        }
        for (name, n) in [
            ("vocab_size", self.vocab),
            ("hidden_size", self.hidden),
            ("intermediate_size", self.ffn),
            ("num_hidden_layers", self.layers),
            ("num_attention_heads", self.heads),
            ("num_key_value_heads", self.kv_heads),
            ("head_dim", self.head_dim),
        ] {
            if n == 0 {
                return Err(format!("`{name}` must be positive"));
            }
        }
        if !self.heads.is_multiple_of(self.kv_heads) {
            return Err(format!(
                "num_attention_heads ({}) is not a multiple of num_key_value_heads ({})",
                self.heads, self.kv_heads
            ));
        }
        if !self.head_dim.is_multiple_of(2) {
            return Err(format!("head_dim ({}) must be even for RoPE", self.head_dim));
        }
        if let Some(l) = &self.local {
            if l.layers.len() != self.layers {
                return Err(format!(
                    "the local-layer pattern covers {} layers but the model has {}",
                    l.layers.len(),
                    self.layers
                ));
            }
            if l.window == 0 {
                return Err("the sliding window must be positive".into());
            }
        }
        if let Some(rs) = &self.rope_scaling {
            rs.validate(self.rope_dim())?;
        }
        if let Some(m) = &self.moe {
            m.validate()?;
            if m.sparse.len() != self.layers {
                return Err(format!("the MoE layer pattern covers {} layers but the model has {}", m.sparse.len(), self.layers));
            }
        }
        Ok(())
    }

    /// The sliding window of layer `l`, if it is a local layer.
    pub fn window_of(&self, l: usize) -> Option<usize> {
        self.local
            .as_ref()
            .filter(|a| a.layers.get(l) == Some(&true))
            .map(|a| a.window)
    }

    /// The RoPE base of layer `l` (Gemma 3's local layers have their own).
    pub fn rope_theta_of(&self, l: usize) -> f64 {
        match &self.local {
            Some(LocalAttention {
                layers,
                rope_theta: Some(t),
                ..
            }) if layers.get(l) == Some(&true) => *t,
            _ => self.rope_theta,
        }
    }

    /// The RoPE scaling of layer `l`: the model's, except on local layers
    /// with a base of their own (Gemma 3's are unscaled).
    pub fn rope_scaling_of(&self, l: usize) -> Option<&RopeScaling> {
        match &self.local {
            Some(LocalAttention {
                layers,
                rope_theta: Some(_),
                ..
            }) if layers.get(l) == Some(&true) => None,
            _ => self.rope_scaling.as_ref(),
        }
    }

    /// The distinct RoPE bases the layers use, in layer order of first use.
    pub fn rope_thetas(&self) -> Vec<f64> {
        let mut v: Vec<f64> = Vec::new();
        for l in 0..self.layers {
            let t = self.rope_theta_of(l);
            if !v.contains(&t) {
                v.push(t);
            }
        }
        v
    }

    /// Whether a run reaching `positions` positions (prompt + decode steps)
    /// is outside what the engines compute faithfully: beyond the sliding
    /// window (which they do not implement). Returns the reason.
    pub fn unfaithful_beyond(&self, positions: usize) -> Option<String> {
        match self.sliding_window {
            Some(w) if positions > w => Some(format!(
                "the run reaches {positions} positions but the model's sliding attention window is {w} \
                 (`sliding_window`): touchstone's engines do not implement the window, so only runs of at most \
                 {w} positions (where it masks nothing) are computed faithfully"
            )),
            _ => None,
        }
    }

    /// The width RoPE rotates per head: the head, or MLA's RoPE part.
    pub fn rope_dim(&self) -> usize {
        self.mla.as_ref().map_or(self.head_dim, |m| m.rope)
    }

    /// Each head's value width (MLA's `v_head_dim`, else `head_dim`).
    pub fn v_head_dim(&self) -> usize {
        self.mla.as_ref().map_or(self.head_dim, |m| m.v_head_dim)
    }

    /// Query heads per KV head (GQA group size).
    pub fn group(&self) -> usize {
        self.heads / self.kv_heads
    }
}

/// Config fields whose value changes the maths, with the values the engines
/// implement. Anything else is refused, naming the field: a config that asks
/// for YaRN or GELU and still "passes" would be a silent green.
fn unimplemented(v: &Value) -> std::result::Result<(), String> {
    let refuse = |field: &str, got: &Value, what: &str| {
        Err(format!(
            "`{field}` is {got}: {what} is not implemented by touchstone's engines, so this model cannot be \
             computed faithfully (refusing rather than checking a different model)"
        ))
    };
    let present = |k: &str| v.get(k).filter(|x| !x.is_null());
    for k in ["hidden_act", "hidden_activation"] {
        if let Some(a) = present(k) {
            if a.as_str() != Some("silu") && a.as_str() != Some("swish") {
                return refuse(k, a, "an activation other than SiLU");
            }
        }
    }
    for k in ["attn_logit_softcapping", "final_logit_softcapping"] {
        if let Some(x) = present(k) {
            return refuse(k, x, "logit soft-capping");
        }
    }
    if let Some(x) = present("partial_rotary_factor").filter(|x| x.as_f64() != Some(1.0)) {
        return refuse("partial_rotary_factor", x, "partial RoPE");
    }
    if let Some(x) = present("mlp_bias").filter(|x| x.as_bool() != Some(false)) {
        return refuse("mlp_bias", x, "a bias in the MLP projections");
    }
    if let Some(x) = present("pretraining_tp").filter(|x| x.as_u64().is_some_and(|n| n > 1)) {
        return refuse("pretraining_tp", x, "tensor-parallel split projections");
    }
    if let Some(x) = present("qk_layernorm").filter(|x| x.as_bool() == Some(true)) {
        return refuse("qk_layernorm", x, "a q/k layer norm outside Qwen3");
    }
    for k in [
        "embedding_multiplier",
        "logits_scaling",
        "residual_multiplier",
        "attention_multiplier",
    ] {
        if let Some(x) = present(k).filter(|x| x.as_f64() != Some(1.0)) {
            return refuse(k, x, "a scaled embedding, residual, attention or logits");
        }
    }
    Ok(())
}

/// DeepSeek's attention-scale correction under YaRN (HF's
/// `yarn_apply_mscale`: the scale times mscale², mscale = 0.1·m·ln(factor)
/// + 1 with m = `mscale_all_dim`, 1 without it or without YaRN).
fn deepseek_mscale(v: &Value) -> f64 {
    let p = v.get("rope_parameters").or_else(|| v.get("rope_scaling"));
    let Some(p) = p.filter(|p| p.is_object()) else { return 1.0 };
    let yarn = p.get("rope_type").or_else(|| p.get("type")).and_then(Value::as_str) == Some("yarn");
    let m = p.get("mscale_all_dim").and_then(Value::as_f64).unwrap_or(0.0);
    let factor = p.get("factor").and_then(Value::as_f64).unwrap_or(1.0);
    if !yarn || m == 0.0 || factor <= 1.0 {
        return 1.0;
    }
    0.1 * m * factor.ln() + 1.0
}

/// Merges a spec's `config:` override into an HF config `v`, as the
/// recorders do (`goldens/recorders/hf_loading.py`): each key replaces the
/// config's, except the RoPE scaling keys, which update the rope parameters
/// the config already has (`rope_parameters` in transformers 5, else
/// `rope_scaling`), `type` read as `rope_type`, so that `rope_theta` and the
/// other parameters the override does not name are kept.
pub fn merge_override(v: &mut Value, over: &Value) -> std::result::Result<(), String> {
    let (Some(base), Some(o)) = (v.as_object_mut(), over.as_object()) else {
        return Err("expected a mapping of HF config keys".into());
    };
    for (k, x) in o {
        if k == "rope_scaling" || k == "rope_parameters" {
            let params = x
                .as_object()
                .ok_or_else(|| format!("`{k}` is {x}, expected a mapping"))?;
            // Gemma 3 keeps one dict per layer type: an override of "the"
            // rope parameters names no layer type, and merged beside them
            // it would be read by nothing.
            let nested = base
                .get("rope_parameters")
                .and_then(Value::as_object)
                .is_some_and(|p| p.values().any(Value::is_object));
            if nested {
                return Err(format!(
                    "`{k}` cannot override this model's RoPE: its rope_parameters are per layer type \
                     (full_attention, sliding_attention), and RoPE scaling of either is not implemented"
                ));
            }
            let into = if base.get("rope_parameters").is_some_and(Value::is_object) {
                "rope_parameters"
            } else if base.get("rope_scaling").is_some_and(Value::is_object) {
                "rope_scaling"
            } else {
                k.as_str()
            };
            let target = base
                .entry(into)
                .or_insert_with(|| Value::Object(Default::default()));
            if !target.is_object() {
                *target = Value::Object(Default::default());
            }
            let t = target.as_object_mut().expect("an object");
            for (pk, pv) in params {
                let key = if pk == "type" { "rope_type" } else { pk.as_str() };
                t.insert(key.to_string(), pv.clone());
            }
        } else {
            base.insert(k.clone(), x.clone());
        }
    }
    Ok(())
}

#[cfg(test)]
#[path = "config_tests.rs"]
mod tests;
