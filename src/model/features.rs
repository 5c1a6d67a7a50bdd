//! Model features beyond the Llama layout that more than one family may have:
//! the MLP's gate activation and interleaved local attention. `ModelConfig`
//! holds them; `model::gemma` reads Gemma 3's into them.

/// The HF name of the MLP's input norm: `post_attention_layernorm` in the
/// Llama layout, `pre_feedforward_layernorm` where the model has post norms
/// (Gemma, whose `post_attention_layernorm` is the attention output's norm).
pub fn ffn_norm_name(post_norms: bool) -> &'static str {
    if post_norms {
        "pre_feedforward_layernorm"
    } else {
        "post_attention_layernorm"
    }
}

/// The MLP's gated activation, `act(gate)·up` (gpt-oss's also changes up).
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Activation {
    /// x·σ(x) (HF `silu`).
    Silu,
    /// 0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³))) (HF `gelu_pytorch_tanh`).
    GeluTanh,
    /// gpt-oss's experts: g = min(gate, limit), u = clamp(up, ±limit), then
    /// (u + 1)·g·σ(α·g) (HF `GptOssExperts._apply_gate`; α and the limit
    /// are the config's `swiglu_alpha` and `swiglu_limit`, f32 as torch
    /// multiplies an f32 tensor by a Python float).
    ClampedSwiglu { alpha: f32, limit: f32 },
}

impl Activation {
    /// The HF name's activation (`gelu` is the exact erf GELU: not this one).
    pub fn parse(name: &str) -> Option<Activation> {
        match name {
            "silu" | "swish" => Some(Activation::Silu),
            "gelu_pytorch_tanh" => Some(Activation::GeluTanh),
            _ => None,
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            Activation::Silu => "silu",
            Activation::GeluTanh => "gelu_tanh",
            Activation::ClampedSwiglu { .. } => "clamped_swiglu",
        }
    }
}

/// Interleaved local attention (see `ModelConfig::local`).
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct LocalAttention {
    /// A query at position p sees keys at positions p − window < j ≤ p (HF's
    /// `sliding_window_overlay`, llama.cpp's `p1 − p0 >= n_swa` masked).
    pub window: usize,
    /// Per layer: true for a local layer.
    pub layers: Vec<bool>,
    /// The RoPE base of local layers when they have their own (Gemma 3,
    /// unscaled); None: the model's RoPE, scaling included (Mistral, Qwen2).
    pub rope_theta: Option<f64>,
}

/// An HF config's `layer_types` (transformers 5), when given: per layer,
/// true for `sliding_attention`, false for `full_attention`; any other type
/// is refused by index.
pub fn listed_layer_types(lt: Option<&serde_json::Value>, layers: usize) -> Result<Option<Vec<bool>>, String> {
    let Some(lt) = lt.filter(|x| !x.is_null()) else {
        return Ok(None);
    };
    let items = lt.as_array().ok_or("`layer_types` is not a list")?;
    if items.len() != layers {
        return Err(format!(
            "`layer_types` has {} entries but `num_hidden_layers` is {layers}",
            items.len()
        ));
    }
    items
        .iter()
        .enumerate()
        .map(|(i, t)| match t.as_str() {
            Some("sliding_attention") => Ok(true),
            Some("full_attention") => Ok(false),
            _ => Err(format!(
                "`layer_types[{i}]` is {t}: a layer type other than full_attention or sliding_attention is not \
                 implemented by touchstone's engines"
            )),
        })
        .collect::<Result<Vec<bool>, String>>()
        .map(Some)
}
