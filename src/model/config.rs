//! The architecture hyper-parameters an engine and the shape check need, read
//! from an HF `config.json`: Llama-family decoders (Llama, Mistral, Qwen2,
//! Qwen3 with its per-head q/k norms, Phi-3 with fused projections) and
//! Gemma 3 (`model::gemma`: its features are general fields here).
//!
//! A config that asks for maths the engines do not implement (RoPE scaling,
//! an activation other than SiLU, soft-capping, ...) is refused with the field
//! named (`unimplemented`): computing a different model and reporting PASSED
//! against goldens recorded from the real one would be the worst outcome.

use std::path::Path;

use serde_json::Value;

use crate::error::{Error, Result};

pub use super::features::{Activation, LocalAttention};
pub use super::vision::{ImageGrid, MRope, VisionConfig};

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
    pub rms_eps: f64,
    pub tie_embeddings: bool,
    /// Qwen3: q and k go through a per-head RMSNorm (weights of length
    /// head_dim) before RoPE, giving the `q_norm` / `k_norm` stages.
    pub qk_norm: bool,
    /// A sliding attention window (keys older than this many positions are
    /// masked), when the model uses one. The engines do not implement it, so a
    /// run must stay within it (`Plan::build` checks), where it masks nothing.
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
    /// Local (sliding-window) layers interleaved with global ones, each with
    /// its own RoPE base (Gemma 3): implemented by the engines, unlike
    /// `sliding_window`.
    pub local: Option<LocalAttention>,
    /// A vision-language model's tower (Qwen2-VL, Qwen3-VL): the vision
    /// stages, fusion and M-RoPE follow from it. None for a text model.
    pub vision: Option<VisionConfig>,
    /// The language model's multimodal RoPE sections (with `vision`).
    pub mrope: Option<MRope>,
}

/// Architectures whose HF weights follow the Llama layout (q/k/v/o, gate/up/down,
/// two RMSNorms per block, NEOX rotate-half RoPE).
const SUPPORTED: &[&str] = &["qwen2", "qwen3", "llama", "mistral", "phi3", "gemma3_text"];

impl ModelConfig {
    /// Reads `<dir>/config.json`.
    pub fn from_hf_dir(dir: &Path) -> Result<ModelConfig> {
        let path = dir.join("config.json");
        let text = std::fs::read_to_string(&path).map_err(|e| Error::io(&path, e))?;
        let v: Value = serde_json::from_str(&text).map_err(|e| Error::model(&path, format!("not valid JSON: {e}")))?;
        Self::from_json(&v).map_err(|msg| Error::model(&path, msg))
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
        let sliding_window = sliding_window(v, &arch)?;
        let context_length = v
            .get("max_position_embeddings")
            .and_then(Value::as_u64)
            .map(|n| n as usize);
        let cfg = ModelConfig {
            vocab: usize_key("vocab_size")?,
            hidden,
            ffn: usize_key("intermediate_size")?,
            layers: usize_key("num_hidden_layers")?,
            heads,
            kv_heads,
            head_dim,
            rope_theta,
            rms_eps,
            tie_embeddings,
            qk_norm: arch == "qwen3",
            sliding_window,
            context_length,
            act: Activation::Silu,
            norm_plus_one: false,
            embed_scale: None,
            post_norms: false,
            attn_scale: (head_dim as f64).powf(-0.5),
            local: None,
            vision: None,
            mrope: None,
            arch,
        };
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
        Ok(())
    }

    /// The sliding window of layer `l`, if it is a local layer.
    pub fn window_of(&self, l: usize) -> Option<usize> {
        self.local
            .as_ref()
            .filter(|a| a.layers.get(l) == Some(&true))
            .map(|a| a.window)
    }

    /// The RoPE base of layer `l` (local layers have their own).
    pub fn rope_theta_of(&self, l: usize) -> f64 {
        match &self.local {
            Some(a) if a.layers.get(l) == Some(&true) => a.rope_theta,
            _ => self.rope_theta,
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
    // RoPE scaling of any type, in transformers 4 (`rope_scaling`) or 5
    // (`rope_parameters.rope_type` and its factors) form.
    if let Some(rs) = present("rope_scaling") {
        let ty = rs.get("rope_type").or_else(|| rs.get("type"));
        let default = ty.and_then(Value::as_str) == Some("default") && rs.get("factor").is_none();
        if !default {
            let field = if ty.is_some() {
                "rope_scaling.rope_type"
            } else {
                "rope_scaling"
            };
            return refuse(field, ty.unwrap_or(rs), "RoPE scaling");
        }
    }
    if let Some(rp) = present("rope_parameters") {
        if let Some(ty) = rp.get("rope_type").filter(|t| t.as_str() != Some("default")) {
            return refuse("rope_parameters.rope_type", ty, "RoPE scaling");
        }
        for k in [
            "factor",
            "original_max_position_embeddings",
            "low_freq_factor",
            "high_freq_factor",
        ] {
            if let Some(x) = rp.get(k).filter(|x| !x.is_null()) {
                return refuse(&format!("rope_parameters.{k}"), x, "RoPE scaling");
            }
        }
    }
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
    if let Some(lt) = present("layer_types").and_then(Value::as_array) {
        if let Some((i, t)) = lt
            .iter()
            .enumerate()
            .find(|(_, t)| t.as_str() != Some("full_attention"))
        {
            return refuse(
                &format!("layer_types[{i}]"),
                t,
                "a layer type other than full attention",
            );
        }
    }
    Ok(())
}

/// The sliding window a config actually uses. Qwen2/Qwen3 carry a
/// `sliding_window` that only applies with `use_sliding_window: true`; for
/// Mistral and Phi-3 a non-null `sliding_window` is in force.
fn sliding_window(v: &Value, arch: &str) -> std::result::Result<Option<usize>, String> {
    let w = match v.get("sliding_window") {
        None | Some(Value::Null) => return Ok(None),
        Some(w) => w
            .as_u64()
            .ok_or_else(|| format!("`sliding_window` is {w}, expected a positive integer or null"))?,
    };
    let gated = matches!(arch, "qwen2" | "qwen3");
    let used = !gated || v.get("use_sliding_window").and_then(Value::as_bool) == Some(true);
    Ok(used.then_some(w as usize))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn base() -> Value {
        json!({"model_type": "qwen2", "vocab_size": 512, "hidden_size": 64,
               "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
               "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-6})
    }

    #[test]
    fn reads_rope_theta_from_either_place() {
        let mut v4 = base();
        v4["rope_theta"] = json!(1000000.0);
        assert_eq!(ModelConfig::from_json(&v4).unwrap().rope_theta, 1e6);
        let mut v5 = base();
        v5["rope_parameters"] = json!({"rope_theta": 10000.0, "rope_type": "default"});
        assert_eq!(ModelConfig::from_json(&v5).unwrap().rope_theta, 1e4);
        assert!(ModelConfig::from_json(&base()).unwrap_err().contains("rope_theta"));
    }

    fn with(k: &str, val: Value) -> std::result::Result<ModelConfig, String> {
        let mut v = base();
        v["rope_theta"] = json!(1e4);
        v[k] = val;
        ModelConfig::from_json(&v)
    }

    #[test]
    fn refuses_every_unimplemented_field_by_name() {
        for (k, val, named) in [
            (
                "rope_scaling",
                json!({"rope_type": "yarn", "factor": 4.0}),
                "rope_scaling.rope_type",
            ),
            (
                "rope_scaling",
                json!({"type": "linear", "factor": 2.0}),
                "rope_scaling.rope_type",
            ),
            ("rope_scaling", json!({"factor": 2.0}), "rope_scaling"),
            (
                "rope_parameters",
                json!({"rope_type": "llama3", "rope_theta": 1e4}),
                "rope_parameters.rope_type",
            ),
            (
                "rope_parameters",
                json!({"rope_theta": 1e4, "factor": 8.0}),
                "rope_parameters.factor",
            ),
            ("hidden_act", json!("banana"), "hidden_act"),
            ("hidden_act", json!("gelu_pytorch_tanh"), "hidden_act"),
            ("hidden_activation", json!("gelu"), "hidden_activation"),
            ("attn_logit_softcapping", json!(50.0), "attn_logit_softcapping"),
            ("final_logit_softcapping", json!(30.0), "final_logit_softcapping"),
            ("partial_rotary_factor", json!(0.5), "partial_rotary_factor"),
            ("mlp_bias", json!(true), "mlp_bias"),
            ("pretraining_tp", json!(2), "pretraining_tp"),
            ("logits_scaling", json!(8.0), "logits_scaling"),
            (
                "layer_types",
                json!(["full_attention", "sliding_attention"]),
                "layer_types[1]",
            ),
        ] {
            let err = with(k, val.clone()).expect_err(&format!("{k}: {val} must be refused"));
            assert!(err.contains(&format!("`{named}`")), "{k}={val}: {err}");
            assert!(err.contains("not implemented"), "{err}");
        }
    }

    #[test]
    fn accepts_the_values_that_change_nothing() {
        for (k, val) in [
            ("rope_scaling", Value::Null),
            ("rope_parameters", json!({"rope_type": "default", "rope_theta": 1e4})),
            ("hidden_act", json!("silu")),
            ("attn_logit_softcapping", Value::Null),
            ("partial_rotary_factor", json!(1.0)),
            ("mlp_bias", json!(false)),
            ("pretraining_tp", json!(1)),
            ("layer_types", json!(["full_attention", "full_attention"])),
            // Qwen2's window is off unless use_sliding_window is true.
            ("sliding_window", json!(32768)),
        ] {
            let c = with(k, val.clone()).unwrap_or_else(|e| panic!("{k}={val}: {e}"));
            assert_eq!(c.sliding_window, None);
        }
    }

    #[test]
    fn a_sliding_window_in_force_bounds_the_run() {
        let mut v = base();
        v["rope_theta"] = json!(1e4);
        v["sliding_window"] = json!(8);
        v["use_sliding_window"] = json!(true);
        let c = ModelConfig::from_json(&v).unwrap();
        assert_eq!(c.sliding_window, Some(8));
        assert!(c.unfaithful_beyond(8).is_none());
        assert!(c.unfaithful_beyond(9).unwrap().contains("sliding_window"));
        v["model_type"] = json!("mistral");
        v["use_sliding_window"] = Value::Null;
        assert_eq!(ModelConfig::from_json(&v).unwrap().sliding_window, Some(8));
    }

    #[test]
    fn rejects_bad_group() {
        let mut v = base();
        v["rope_theta"] = json!(1e4);
        v["num_key_value_heads"] = json!(3);
        assert!(ModelConfig::from_json(&v).unwrap_err().contains("multiple"));
    }
}
