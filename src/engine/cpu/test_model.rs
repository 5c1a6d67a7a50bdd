//! A tiny synthetic Qwen2 model written to a temporary folder exactly as HF
//! would (config.json + model.safetensors), with knobs for storage dtype, a
//! tied head and biases, and a hook to corrupt the tensor list. The engine
//! tests load it through the public loading path, not a shortcut.

use std::collections::HashMap;
use std::path::Path;

use half::{bf16, f16};
use safetensors::{tensor::TensorView, Dtype};

use super::CpuEngine;

pub const V: usize = 40;
pub const E: usize = 16;
pub const H: usize = 4;
pub const KV: usize = 2;
pub const D: usize = 8; // H·D = 32 ≠ E: exercises an explicit head_dim
pub const F: usize = 24;
pub const L: usize = 2;

#[derive(Clone, Copy)]
pub struct Opts {
    pub dtype: Dtype,
    pub tied: bool,
    pub bias: bool,
}

impl Default for Opts {
    fn default() -> Opts {
        Opts {
            dtype: Dtype::F32,
            tied: false,
            bias: true,
        }
    }
}

/// Deterministic pseudo-random weights in about [-scale, scale].
pub fn fill(n: usize, seed: u64, scale: f32) -> Vec<f32> {
    let mut s = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
        })
        .collect()
}

/// The model's tensors by name (f32 values, before storage conversion).
pub fn tensors(o: Opts) -> Vec<(String, Vec<usize>, Vec<f32>)> {
    let mut t = vec![("model.embed_tokens.weight".to_string(), vec![V, E], fill(V * E, 1, 1.0))];
    let mut seed = 10;
    let mut add = |t: &mut Vec<_>, name: String, shape: Vec<usize>, scale: f32| {
        seed += 1;
        let n = shape.iter().product();
        t.push((name, shape, fill(n, seed, scale)));
    };
    for i in 0..L {
        let p = format!("model.layers.{i}");
        let norm = |s| fill(E, s, 0.2).into_iter().map(|x| 1.0 + x).collect::<Vec<_>>();
        t.push((format!("{p}.input_layernorm.weight"), vec![E], norm(100 + i as u64)));
        t.push((
            format!("{p}.post_attention_layernorm.weight"),
            vec![E],
            norm(200 + i as u64),
        ));
        for (n, out) in [("q", H * D), ("k", KV * D), ("v", KV * D)] {
            add(&mut t, format!("{p}.self_attn.{n}_proj.weight"), vec![out, E], 0.4);
            if o.bias {
                add(&mut t, format!("{p}.self_attn.{n}_proj.bias"), vec![out], 0.2);
            }
        }
        add(&mut t, format!("{p}.self_attn.o_proj.weight"), vec![E, H * D], 0.3);
        add(&mut t, format!("{p}.mlp.gate_proj.weight"), vec![F, E], 0.4);
        add(&mut t, format!("{p}.mlp.up_proj.weight"), vec![F, E], 0.4);
        add(&mut t, format!("{p}.mlp.down_proj.weight"), vec![E, F], 0.3);
    }
    t.push(("model.norm.weight".to_string(), vec![E], vec![1.0; E]));
    if !o.tied {
        add(&mut t, "lm_head.weight".to_string(), vec![V, E], 0.5);
    }
    t
}

pub fn config_json(tied: bool) -> serde_json::Value {
    serde_json::json!({
        "model_type": "qwen2", "vocab_size": V, "hidden_size": E, "intermediate_size": F,
        "num_hidden_layers": L, "num_attention_heads": H, "num_key_value_heads": KV,
        "head_dim": D, "rope_theta": 10000.0, "rms_norm_eps": 1e-6,
        "tie_word_embeddings": tied
    })
}

/// Writes a model folder; `edit` may change the tensor list first.
pub fn write_model(dir: &Path, o: Opts, edit: impl FnOnce(&mut Vec<(String, Vec<usize>, Vec<f32>)>)) {
    let mut ts = tensors(o);
    edit(&mut ts);
    std::fs::write(dir.join("config.json"), config_json(o.tied).to_string()).unwrap();
    let bytes: Vec<Vec<u8>> = ts
        .iter()
        .map(|(_, _, v)| match o.dtype {
            Dtype::F32 => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
            Dtype::F16 => v.iter().flat_map(|x| f16::from_f32(*x).to_le_bytes()).collect(),
            Dtype::BF16 => v.iter().flat_map(|x| bf16::from_f32(*x).to_le_bytes()).collect(),
            other => panic!("test dtype {other:?}"),
        })
        .collect();
    let views: Vec<(String, TensorView)> = ts
        .iter()
        .zip(&bytes)
        .map(|((n, s, _), b)| (n.clone(), TensorView::new(o.dtype, s.clone(), b).unwrap()))
        .collect();
    safetensors::serialize_to_file(views, None::<HashMap<String, String>>, &dir.join("model.safetensors")).unwrap();
}

pub fn model(o: Opts) -> (tempfile::TempDir, CpuEngine) {
    let dir = tempfile::tempdir().unwrap();
    write_model(dir.path(), o, |_| {});
    let eng = CpuEngine::load(dir.path()).unwrap();
    (dir, eng)
}
