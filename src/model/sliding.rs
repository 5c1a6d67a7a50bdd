//! Which layers of an HF config slide: the sliding-window families' rules,
//! as HF's modeling code applies them (read by `config::ModelConfig`).

use serde_json::Value;

use super::features::LocalAttention;

/// The sliding-window layers of an HF config, as HF's modeling code uses
/// them (a query at p sees keys p − window < j ≤ p there):
/// - Mistral and Phi-3: every layer, when `sliding_window` is not null;
/// - Qwen2 and Qwen3: `layer_types` when given, else the layers from
///   `max_window_layers` on (default 28), and only with
///   `use_sliding_window: true` (the window is null otherwise);
/// - gpt-oss: `layer_types`, by default alternating from a sliding layer 0
///   (HF's `GptOssConfig`), with the model's RoPE (YaRN) on every layer;
/// - Llama: none. HF's Llama has no window, whatever `sliding_window` says
///   (touchstone computes what the reference computes).
pub(super) fn sliding_layers(v: &Value, arch: &str, layers: usize) -> std::result::Result<Option<LocalAttention>, String> {
    // Qwen2/3-MoE without `use_sliding_window` compute no window (HF writes
    // `sliding_window: 0` or null there), and with it one not implemented.
    if matches!(arch, "qwen2_moe" | "qwen3_moe") {
        if v.get("use_sliding_window").and_then(Value::as_bool) == Some(true) {
            return Err(format!(
                "`use_sliding_window` is true: {arch}'s sliding-window layers are not implemented by touchstone's \
                 engines (refusing rather than checking a different model)"
            ));
        }
        let types = super::features::listed_layer_types(v.get("layer_types"), layers)?;
        if let Some(i) = types.iter().flatten().position(|&s| s) {
            return Err(format!("`layer_types[{i}]` is \"sliding_attention\" but `use_sliding_window` is not true"));
        }
        return Ok(None);
    }
    let window = match v.get("sliding_window") {
        None | Some(Value::Null) => None,
        Some(w) => Some(
            w.as_u64()
                .filter(|&w| w > 0)
                .ok_or_else(|| format!("`sliding_window` is {w}, expected a positive integer or null"))? as usize,
        ),
    };
    let types = super::features::listed_layer_types(v.get("layer_types"), layers)?;
    let pattern = match arch {
        "mistral" | "phi3" | "mixtral" => window.map(|_| vec![true; layers]),
        "gpt_oss" => {
            let t = types.clone().unwrap_or_else(|| (0..layers).map(|i| i % 2 == 0).collect());
            if window.is_none() && t.contains(&true) {
                return Err("gpt-oss has sliding_attention layers but `sliding_window` is null".into());
            }
            Some(t)
        }
        "qwen2" | "qwen3" => {
            let used = v.get("use_sliding_window").and_then(Value::as_bool) == Some(true);
            let window = window.filter(|_| used);
            match (&types, window) {
                (Some(t), None) if t.contains(&true) => {
                    return Err(
                        "`layer_types` has sliding_attention layers but the window is off (`use_sliding_window` is \
                         not true or `sliding_window` is null)"
                            .into(),
                    )
                }
                (_, None) => None,
                (Some(t), Some(_)) => Some(t.clone()),
                (None, Some(_)) => {
                    let from = match v.get("max_window_layers") {
                        None | Some(Value::Null) => 28,
                        Some(m) => m
                            .as_u64()
                            .ok_or_else(|| format!("`max_window_layers` is {m}, expected an integer"))?
                            as usize,
                    };
                    Some((0..layers).map(|i| i >= from).collect())
                }
            }
        }
        _ => {
            if let Some((i, _)) = types.iter().flatten().enumerate().find(|(_, &s)| s) {
                return Err(format!(
                    "`layer_types[{i}]` is \"sliding_attention\": HF's {arch} has no sliding-window layers, so this \
                     config is not one touchstone can compute faithfully"
                ));
            }
            None
        }
    };
    Ok(match (pattern, window) {
        (Some(layers), Some(window)) if layers.contains(&true) => Some(LocalAttention {
            window,
            layers,
            rope_theta: None,
        }),
        _ => None,
    })
}
