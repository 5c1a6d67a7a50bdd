//! Gemma 3 (HF `model_type: gemma3_text`, GGUF `gemma3`): what it adds to the
//! Llama layout, read from its config and turned into the general features of
//! [`ModelConfig`] the engines and checks implement:
//!
//! - RMSNorm multiplies by `1 + w` (`Gemma3RMSNorm`; llama.cpp's converter
//!   stores `w + 1` in the GGUF, the loader gives it back as HF's `w`);
//! - the embedding rows are scaled by √hidden (`Gemma3TextScaledWordEmbedding`);
//! - a GELU-tanh gated MLP (`gelu_pytorch_tanh`, GeGLU);
//! - per-head q/k norms, as Qwen3;
//! - RMSNorms on the attention and MLP outputs before each residual add
//!   (`post_attention_layernorm`, `post_feedforward_layernorm`), the MLP's
//!   input norm being `pre_feedforward_layernorm`;
//! - the score scale `query_pre_attn_scalar^-½`;
//! - local (sliding-window) layers interleaved with global ones, each kind
//!   with its own RoPE base.
//!
//! Anything else a Gemma 3 config asks for (RoPE scaling of either layer
//! type, soft-capping, bidirectional attention) is refused by name, as for
//! every family.

use serde_json::{Map, Value};

use super::features::{Activation, LocalAttention};

/// The Gemma features of one config.
#[derive(Clone, Debug, PartialEq)]
pub struct GemmaParts {
    pub local: Option<LocalAttention>,
    pub attn_scale: f64,
    pub rope_theta: f64,
}

/// llama.cpp's default pattern: of every 6 layers the first 5 are local
/// (`set_swa_pattern(6)`), as HF's `sliding_window_pattern` default 6 gives
/// (layer i is global iff (i + 1) % 6 == 0).
pub const DEFAULT_PATTERN: usize = 6;
/// The RoPE base of local layers when a GGUF does not say (llama.cpp's
/// `rope_freq_base_train_swa` default; HF's `rope_local_base_freq` default).
pub const DEFAULT_LOCAL_THETA: f64 = 10000.0;

/// Per layer, whether it is local: the first `pattern − 1` of every
/// `pattern` layers (pattern 0: all local).
pub fn pattern_layers(layers: usize, pattern: usize) -> Vec<bool> {
    (0..layers).map(|i| pattern == 0 || i % pattern < pattern - 1).collect()
}

/// Reads the Gemma-only keys of an HF config `v` and returns them with a copy
/// of `v` in the Llama form the generic reader takes (flat `rope_theta`,
/// `hidden_act: silu` standing for the activation it has read, the
/// Gemma-only keys removed), so every other key is still judged by the
/// generic reader's refusals.
pub fn normalise(v: &Value) -> Result<(Value, GemmaParts), String> {
    let obj = v.as_object().ok_or("the config is not a JSON object")?;
    let present = |k: &str| obj.get(k).filter(|x| !x.is_null());
    let refuse = |field: &str, got: &Value, what: &str| {
        Err(format!(
            "`{field}` is {got}: {what} is not implemented by touchstone's engines, so this model cannot be \
             computed faithfully (refusing rather than checking a different model)"
        ))
    };
    let act = present("hidden_activation")
        .or_else(|| present("hidden_act"))
        .and_then(Value::as_str)
        .unwrap_or("gelu_pytorch_tanh");
    if Activation::parse(act) != Some(Activation::GeluTanh) {
        return refuse(
            "hidden_activation",
            &Value::String(act.into()),
            "a Gemma activation other than gelu_pytorch_tanh",
        );
    }
    if let Some(x) = present("use_bidirectional_attention").filter(|x| x.as_bool() == Some(true)) {
        return refuse("use_bidirectional_attention", x, "bidirectional attention");
    }
    let layers = obj
        .get("num_hidden_layers")
        .and_then(Value::as_u64)
        .ok_or("missing or non-integer key `num_hidden_layers`")? as usize;
    let types = layer_types(obj, layers)?;
    let (global_theta, local_theta) = rope_thetas(obj)?;
    let any_local = types.iter().any(|l| *l);
    let local = if any_local {
        let w = present("sliding_window")
            .and_then(Value::as_u64)
            .filter(|&w| w > 0)
            .ok_or("`layer_types` has sliding_attention layers but `sliding_window` is not a positive integer")?;
        Some(LocalAttention {
            window: w as usize,
            layers: types,
            rope_theta: Some(local_theta),
        })
    } else {
        None
    };
    let head_dim = obj.get("head_dim").and_then(Value::as_u64);
    let scalar = present("query_pre_attn_scalar")
        .map(|x| {
            x.as_f64()
                .filter(|s| *s > 0.0)
                .ok_or_else(|| format!("`query_pre_attn_scalar` is {x}, expected a positive number"))
        })
        .transpose()?
        .or(head_dim.map(|d| d as f64))
        .ok_or("missing `query_pre_attn_scalar` and `head_dim`")?;
    let mut rest: Map<String, Value> = obj.clone();
    for k in [
        "rope_parameters",
        "rope_scaling",
        "rope_local_base_freq",
        "layer_types",
        "sliding_window",
        "sliding_window_pattern",
        "hidden_activation",
        "query_pre_attn_scalar",
        "use_bidirectional_attention",
    ] {
        rest.remove(k);
    }
    rest.insert("rope_theta".into(), global_theta.into());
    rest.insert("hidden_act".into(), "silu".into());
    Ok((
        Value::Object(rest),
        GemmaParts {
            local,
            attn_scale: scalar.powf(-0.5),
            rope_theta: global_theta,
        },
    ))
}

/// Per layer, whether it is a sliding (local) layer: `layer_types` when
/// given (transformers 5), else `sliding_window_pattern` (transformers 4).
fn layer_types(obj: &Map<String, Value>, layers: usize) -> Result<Vec<bool>, String> {
    if let Some(types) = super::features::listed_layer_types(obj.get("layer_types"), layers)? {
        return Ok(types);
    }
    let pattern = match obj.get("sliding_window_pattern").filter(|x| !x.is_null()) {
        None => DEFAULT_PATTERN,
        Some(p) => {
            p.as_u64()
                .ok_or_else(|| format!("`sliding_window_pattern` is {p}, expected an integer"))? as usize
        }
    };
    Ok(pattern_layers(layers, pattern))
}

/// (global, local) RoPE bases, each refused unless its RoPE is the default.
fn rope_thetas(obj: &Map<String, Value>) -> Result<(f64, f64), String> {
    let default_only = |field: &str, p: &Value| -> Result<(), String> {
        if let Some(t) = p.get("rope_type").filter(|t| t.as_str() != Some("default")) {
            return Err(format!(
                "`{field}.rope_type` is {t}: RoPE scaling is not implemented by touchstone's engines, so this \
                 model cannot be computed faithfully (refusing rather than checking a different model)"
            ));
        }
        if let Some(f) = p.get("factor").filter(|f| !f.is_null()) {
            return Err(format!(
                "`{field}.factor` is {f}: RoPE scaling is not implemented by touchstone's engines"
            ));
        }
        Ok(())
    };
    let theta = |p: &Value, field: &str| -> Result<f64, String> {
        p.get("rope_theta")
            .and_then(Value::as_f64)
            .ok_or_else(|| format!("missing number `{field}.rope_theta`"))
    };
    if let Some(rp) = obj.get("rope_parameters").filter(|x| !x.is_null()) {
        let full = rp
            .get("full_attention")
            .ok_or("`rope_parameters` has no `full_attention` entry")?;
        default_only("rope_parameters.full_attention", full)?;
        let g = theta(full, "rope_parameters.full_attention")?;
        let l = match rp.get("sliding_attention") {
            Some(s) => {
                default_only("rope_parameters.sliding_attention", s)?;
                theta(s, "rope_parameters.sliding_attention")?
            }
            None => DEFAULT_LOCAL_THETA,
        };
        return Ok((g, l));
    }
    if let Some(rs) = obj.get("rope_scaling").filter(|x| !x.is_null()) {
        default_only("rope_scaling", rs)?;
    }
    let g = obj
        .get("rope_theta")
        .and_then(Value::as_f64)
        .ok_or("missing `rope_theta` (looked in `rope_parameters.full_attention` and `rope_theta`)")?;
    let l = obj
        .get("rope_local_base_freq")
        .and_then(Value::as_f64)
        .unwrap_or(DEFAULT_LOCAL_THETA);
    Ok((g, l))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::ModelConfig;
    use serde_json::json;

    fn base() -> Value {
        json!({"model_type": "gemma3_text", "vocab_size": 512, "hidden_size": 64,
               "intermediate_size": 128, "num_hidden_layers": 6, "num_attention_heads": 4,
               "num_key_value_heads": 2, "head_dim": 32, "rms_norm_eps": 1e-6,
               "hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": 32,
               "sliding_window": 4, "tie_word_embeddings": true,
               "layer_types": ["sliding_attention", "sliding_attention", "sliding_attention",
                               "sliding_attention", "sliding_attention", "full_attention"],
               "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                   "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}},
               "attn_logit_softcapping": null, "final_logit_softcapping": null})
    }

    #[test]
    fn reads_every_gemma_feature() {
        let c = ModelConfig::from_json(&base()).unwrap();
        assert_eq!(c.arch, "gemma3");
        assert_eq!(c.act, Activation::GeluTanh);
        assert!(c.norm_plus_one && c.post_norms && c.qk_norm);
        assert_eq!(c.embed_scale, Some((64f64).sqrt() as f32));
        assert_eq!(c.attn_scale, 32f64.powf(-0.5));
        assert_eq!(c.rope_theta_of(0), 1e4);
        assert_eq!(c.rope_theta_of(5), 1e6);
        assert_eq!(c.window_of(4), Some(4));
        assert_eq!(c.window_of(5), None);
        assert!(c.unfaithful_beyond(100).is_none(), "the window is implemented");
    }

    #[test]
    fn transformers_4_keys_give_the_same_model() {
        let mut v = base();
        let o = v.as_object_mut().unwrap();
        o.remove("layer_types");
        o.remove("rope_parameters");
        o.insert("rope_theta".into(), json!(1e6));
        o.insert("rope_local_base_freq".into(), json!(1e4));
        o.insert("sliding_window_pattern".into(), json!(6));
        assert_eq!(
            ModelConfig::from_json(&v).unwrap(),
            ModelConfig::from_json(&base()).unwrap()
        );
    }

    #[test]
    fn refuses_what_the_engines_do_not_compute_by_name() {
        for (k, val, named) in [
            ("hidden_activation", json!("gelu"), "hidden_activation"),
            ("final_logit_softcapping", json!(30.0), "final_logit_softcapping"),
            ("attn_logit_softcapping", json!(50.0), "attn_logit_softcapping"),
            (
                "use_bidirectional_attention",
                json!(true),
                "use_bidirectional_attention",
            ),
            (
                "rope_parameters",
                json!({"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                       "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}),
                "rope_parameters.full_attention.rope_type",
            ),
            (
                "layer_types",
                json!([
                    "sliding_attention",
                    "chunked_attention",
                    "sliding_attention",
                    "sliding_attention",
                    "sliding_attention",
                    "full_attention"
                ]),
                "layer_types[1]",
            ),
        ] {
            let mut v = base();
            v[k] = val.clone();
            let e = ModelConfig::from_json(&v).expect_err(&format!("{k}={val} must be refused"));
            assert!(
                e.contains(&format!("`{named}`")) && e.contains("not implemented"),
                "{k}: {e}"
            );
        }
    }

    /// The tiny Gemma 3 as an HF folder and as llama.cpp's converter wrote it
    /// (norms stored as w + 1): the same config, and the CPU engine computes
    /// the same bits from either (the loader's w = g − 1 is exact here, and
    /// 1 + w then gives back the stored g).
    #[test]
    fn the_tiny_gemma_reads_the_same_from_hf_and_from_its_gguf() {
        use crate::engine::cpu::CpuEngine;
        use crate::engine::{Engine, RunRequest, TapSet};
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("goldens/gemma3-tiny");
        let hf = crate::model::read_config(&dir.join("model")).unwrap();
        let mut gg = crate::model::read_config(&dir.join("model.gguf")).unwrap();
        assert!(gg.context_length.is_some());
        gg.context_length = hf.context_length;
        // GGUF stores eps as an f32 (the engines add it in f32 either way).
        assert_eq!(gg.rms_eps as f32, hf.rms_eps as f32);
        gg.rms_eps = hf.rms_eps;
        assert_eq!(gg, hf);
        let req = RunRequest {
            prompt: vec![3, 70, 140, 7, 300, 12, 9, 41],
            decode_steps: 2,
            sampling: crate::sampling::Sampling::Greedy,
            seed: 0,
            forced: None,
            image: None,
        };
        let run = |p: &str| {
            let e = CpuEngine::load(&dir.join(p)).unwrap();
            e.run(&req, &TapSet::all(hf.layers)).unwrap()
        };
        let (a, b) = (run("model"), run("model.gguf"));
        assert_eq!(a.sampled, b.sampled);
        for ((step, stage), t) in a.captures.iter() {
            let u = b.captures.get(*step, *stage).unwrap();
            assert!(
                t.data().iter().zip(u.data()).all(|(x, y)| x.to_bits() == y.to_bits()),
                "{step}/{stage} differs between the HF folder and the GGUF"
            );
        }
    }

    #[test]
    fn the_pattern_is_llama_cpps() {
        assert_eq!(pattern_layers(7, 6), [true, true, true, true, true, false, true]);
        assert_eq!(pattern_layers(2, 0), [true, true]);
    }
}
