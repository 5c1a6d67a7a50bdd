//! Reading HF configs: every field the engines use, every refusal by name,
//! sliding windows and RoPE scaling as HF reads them.

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
            json!({"rope_type": "su", "factor": 4.0}),
            "rope_scaling.rope_type",
        ),
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
            json!(["full_attention", "chunked_attention"]),
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
fn sliding_windows_are_read_as_hf_uses_them() {
    let mut v = base();
    v["rope_theta"] = json!(1e4);
    v["sliding_window"] = json!(8);
    // Qwen2: only with use_sliding_window, from max_window_layers on.
    assert_eq!(ModelConfig::from_json(&v).unwrap().local, None);
    v["use_sliding_window"] = json!(true);
    v["max_window_layers"] = json!(1);
    let c = ModelConfig::from_json(&v).unwrap();
    assert_eq!((c.window_of(0), c.window_of(1)), (None, Some(8)));
    assert_eq!(c.rope_theta_of(1), 1e4, "a Qwen2 sliding layer keeps the model's RoPE");
    assert!(c.unfaithful_beyond(100).is_none(), "the window is implemented");
    // The default max_window_layers (28) leaves a 2-layer model full.
    v["max_window_layers"] = Value::Null;
    assert_eq!(ModelConfig::from_json(&v).unwrap().local, None);
    // layer_types, when given, decides.
    v["layer_types"] = json!(["sliding_attention", "full_attention"]);
    let c = ModelConfig::from_json(&v).unwrap();
    assert_eq!((c.window_of(0), c.window_of(1)), (Some(8), None));
    v["use_sliding_window"] = json!(false);
    assert!(ModelConfig::from_json(&v).unwrap_err().contains("window is off"));
    // Mistral: every layer while sliding_window is set.
    v["model_type"] = json!("mistral");
    v["layer_types"] = Value::Null;
    let c = ModelConfig::from_json(&v).unwrap();
    assert_eq!((c.window_of(0), c.window_of(1)), (Some(8), Some(8)));
    // Llama: HF's Llama has no window, whatever the config says.
    v["model_type"] = json!("llama");
    assert_eq!(ModelConfig::from_json(&v).unwrap().local, None);
    v["layer_types"] = json!(["sliding_attention", "full_attention"]);
    assert!(ModelConfig::from_json(&v).unwrap_err().contains("no sliding-window layers"));
}

#[test]
fn scaled_rope_sets_the_scaled_context() {
    let mut v = base();
    v["max_position_embeddings"] = json!(32768);
    v["rope_scaling"] = json!({"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768});
    v["rope_theta"] = json!(1e6);
    let c = ModelConfig::from_json(&v).unwrap();
    assert_eq!(c.context_length, Some(131072));
    assert_eq!(c.rope_scaling.as_ref().map(|s| s.name()), Some("yarn"));
    v["rope_scaling"] = json!({"type": "dynamic", "factor": 2.0});
    assert_eq!(ModelConfig::from_json(&v).unwrap().context_length, None, "dynamic grows as far as asked");
}

#[test]
fn rejects_bad_group() {
    let mut v = base();
    v["rope_theta"] = json!(1e4);
    v["num_key_value_heads"] = json!(3);
    assert!(ModelConfig::from_json(&v).unwrap_err().contains("multiple"));
}

#[test]
fn an_override_updates_the_rope_parameters_the_config_has() {
    // transformers 5: into rope_parameters, rope_theta kept, `type` as rope_type.
    let mut v = base();
    v["rope_parameters"] = json!({"rope_type": "default", "rope_theta": 1e6});
    v["max_position_embeddings"] = json!(32768);
    let over = json!({"rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}});
    merge_override(&mut v, &over).unwrap();
    assert_eq!(v["rope_parameters"]["rope_type"], "yarn");
    assert_eq!(v["rope_parameters"]["rope_theta"], 1e6);
    assert!(v.get("rope_scaling").is_none());
    let c = ModelConfig::from_json(&v).unwrap();
    assert_eq!((c.rope_theta, c.context_length), (1e6, Some(131072)));
    // transformers 4: into rope_scaling; any other key replaces the config's.
    let mut v = base();
    v["rope_theta"] = json!(1e4);
    merge_override(&mut v, &json!({"rope_scaling": {"type": "linear", "factor": 2.0}, "sliding_window": 8})).unwrap();
    assert_eq!(v["rope_scaling"], json!({"rope_type": "linear", "factor": 2.0}));
    assert_eq!(v["sliding_window"], 8);
    assert!(merge_override(&mut v, &json!({"rope_scaling": 3})).unwrap_err().contains("expected a mapping"));
    assert!(merge_override(&mut v, &json!([1])).is_err());
    // Per-layer-type rope parameters (Gemma 3) take no such override.
    let mut g = json!({"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                           "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}});
    let e = merge_override(&mut g, &json!({"rope_scaling": {"type": "linear", "factor": 8.0}})).unwrap_err();
    assert!(e.contains("per layer type"), "{e}");
}

#[test]
fn a_gguf_takes_only_a_rope_override() {
    let mut v = base();
    v["rope_theta"] = json!(1e6);
    v["max_position_embeddings"] = json!(32768);
    let c = ModelConfig::from_json(&v).unwrap();
    let y = c
        .clone()
        .with_gguf_override(&json!({"rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}}))
        .unwrap();
    assert_eq!(y.rope_scaling.as_ref().map(|s| s.name()), Some("yarn"));
    assert_eq!(y.context_length, Some(131072));
    let e = c.with_gguf_override(&json!({"sliding_window": 8})).unwrap_err();
    assert!(e.contains("`sliding_window` cannot override a GGUF"), "{e}");
}

#[test]
fn moe_families_read_their_routing() {
    use crate::model::moe::Scores;
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("goldens");
    let read = |m: &str| ModelConfig::from_hf_dir(&root.join(m).join("model")).unwrap();
    let mix = read("mixtral-tiny");
    let r = &mix.moe.as_ref().unwrap().routing;
    assert_eq!((r.experts, r.top_k, r.scores, r.norm_topk), (8, 2, Scores::Softmax, true));
    let q2 = read("qwen2_moe-tiny");
    let m = q2.moe.as_ref().unwrap();
    assert!(!m.routing.norm_topk && m.shared_gate && m.shared_ffn.is_some());
    let q3 = read("qwen3_moe-tiny");
    assert!(q3.qk_norm && q3.moe.as_ref().unwrap().routing.norm_topk);
    let ds = read("deepseek_v3-tiny");
    let m = ds.moe.as_ref().unwrap();
    assert_eq!(m.sparse, vec![false, true, true], "first_k_dense_replace 1");
    assert_eq!((m.routing.groups, m.routing.scaling, m.routing.scores), (Some((4, 2)), 2.5, Scores::Sigmoid));
    assert!(m.routing.correction_bias && m.shared_ffn == Some(32) && !m.shared_gate);
    let mla = ds.mla.as_ref().unwrap();
    assert_eq!((ds.head_dim, ds.kv_heads, ds.rope_dim(), ds.v_head_dim()), (24, 4, 8, 16));
    assert_eq!((mla.q_lora_rank, mla.kv_lora_rank, mla.interleave), (Some(32), 32, true));
    let go = read("gpt_oss-tiny");
    let m = go.moe.as_ref().unwrap();
    assert_eq!((m.routing.scores, m.routing.router_bias, m.routing.norm_topk), (Scores::TopkSoftmax, true, false));
    assert_eq!(m.expert_act, crate::model::config::Activation::ClampedSwiglu { alpha: 1.702, limit: 7.0 });
    assert!(m.interleaved && go.attn_sinks && go.rope_scaling.as_ref().is_some_and(|r| r.name() == "yarn"));
    assert_eq!((go.window_of(0), go.window_of(1)), (Some(8), None), "layer_types: sliding, full");
    // Without `layer_types`, HF alternates from a sliding layer 0.
    let mut v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(root.join("gpt_oss-tiny/model/config.json")).unwrap()).unwrap();
    v.as_object_mut().unwrap().remove("layer_types");
    assert_eq!(ModelConfig::from_json(&v).unwrap().local.unwrap().layers, vec![true, false]);
    // A Qwen-MoE with its (unimplemented) sliding window is refused.
    let mut v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(root.join("qwen3_moe-tiny/model/config.json")).unwrap()).unwrap();
    v["use_sliding_window"] = true.into();
    let e = ModelConfig::from_json(&v).unwrap_err();
    assert!(e.contains("use_sliding_window"), "{e}");
    // Routing parameters that cannot hold are refused by name.
    let mut v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(root.join("deepseek_v3-tiny/model/config.json")).unwrap()).unwrap();
    v["topk_group"] = 5.into();
    assert!(ModelConfig::from_json(&v).unwrap_err().contains("topk_group"));
    v["topk_group"] = 2.into();
    v["scoring_func"] = "softmax".into();
    assert!(ModelConfig::from_json(&v).unwrap_err().contains("scoring_func"));
}
