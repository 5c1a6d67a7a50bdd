//! The architecture hyper-parameters an engine and the shape check need, read
//! from an HF `config.json`. Qwen2 and Llama-family decoders only.

use std::path::Path;

use serde_json::Value;

use crate::error::{Error, Result};

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
}

/// Architectures whose HF weights follow the Llama layout (q/k/v/o, gate/up/down,
/// two RMSNorms per block, NEOX rotate-half RoPE).
const SUPPORTED: &[&str] = &["qwen2", "llama", "mistral"];

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
        if !SUPPORTED.contains(&arch.as_str()) {
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
        let cfg = ModelConfig {
            arch,
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
        };
        cfg.validate()?;
        Ok(cfg)
    }

    pub(crate) fn validate(&self) -> std::result::Result<(), String> {
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
        Ok(())
    }

    /// Query heads per KV head (GQA group size).
    pub fn group(&self) -> usize {
        self.heads / self.kv_heads
    }
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

    #[test]
    fn rejects_bad_group() {
        let mut v = base();
        v["rope_theta"] = json!(1e4);
        v["num_key_value_heads"] = json!(3);
        assert!(ModelConfig::from_json(&v).unwrap_err().contains("multiple"));
    }
}
