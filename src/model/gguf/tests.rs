//! The GGUF model mapping on files written by `gguf::writer` into a
//! temporary folder: the config and HF-named weights read from GGUF
//! metadata and tensors, the Llama Q/K permutation undone (as llama.cpp's
//! converter permuted it), and the CPU engine computing the same model from
//! an HF folder and from its GGUF.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use super::*;
use crate::engine::{RunRequest, TapSet};
use crate::gguf::writer::GgufWriter;
use crate::gguf::GgufFile;
use crate::model::{self as tmodel, LoadOptions};
use crate::sampling::Sampling;

fn write(dir: &Path, name: &str, bytes: &[u8]) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, bytes).unwrap();
    p
}

use crate::engine::cpu::test_model::{config_json, tensors as hf_tensors, Opts};

fn hf_model(arch: &str, tied: bool) -> (ModelConfig, BTreeMap<String, Tensor>) {
    let mut v = config_json(tied);
    v["model_type"] = arch.into();
    let cfg = ModelConfig::from_json(&v).unwrap();
    let ts = hf_tensors(Opts {
        tied,
        ..Opts::default()
    })
    .into_iter()
    .map(|(n, s, d)| (n, Tensor::new(s, d)))
    .collect();
    (cfg, ts)
}

use crate::model::ModelConfig;

#[test]
fn permutation_round_trips_and_matches_llama_cpp() {
    // llama.cpp: w.reshape(n_head, 2, D/2, E).swapaxes(1, 2).reshape(w.shape)
    // with n_head = 1, D = 4, E = 1: rows [0, 1, 2, 3] -> [0, 2, 1, 3].
    let t = Tensor::new(vec![4, 1], vec![0.0, 1.0, 2.0, 3.0]);
    assert_eq!(permute_rows(t.clone(), 1).data(), &[0.0, 2.0, 1.0, 3.0]);
    // Two heads of D = 6: within each head [0..3 | 3..6] interleave.
    let t = Tensor::new(vec![12], (0..12).map(|i| i as f32).collect());
    let p = permute_rows(t.clone(), 2);
    assert_eq!(p.data(), &[0., 3., 1., 4., 2., 5., 6., 9., 7., 10., 8., 11.]);
    assert_eq!(unpermute_rows(p, 2), t);
}

#[test]
fn config_and_hf_named_weights_from_gguf() {
    let d = tempfile::tempdir().unwrap();
    for (arch, tied) in [("qwen2", false), ("llama", false), ("llama", true)] {
        let (cfg, ts) = hf_model(arch, tied);
        let p = d.path().join(format!("{arch}-{tied}.gguf"));
        model_writer(&cfg, &ts, GgmlType::F32).write(&p).unwrap();
        let got = tmodel::read_config(&p).unwrap();
        assert_eq!(got.arch, arch);
        assert_eq!(
            (
                got.vocab,
                got.hidden,
                got.ffn,
                got.layers,
                got.heads,
                got.kv_heads,
                got.head_dim
            ),
            (
                cfg.vocab,
                cfg.hidden,
                cfg.ffn,
                cfg.layers,
                cfg.heads,
                cfg.kv_heads,
                cfg.head_dim
            )
        );
        assert_eq!(got.tie_embeddings, tied);
        assert_eq!(got.rope_theta, 10000.0);
        assert!((got.rms_eps - 1e-6).abs() < 1e-12);

        let (_, mut ws) = tmodel::load(&p, &LoadOptions::default()).unwrap();
        for (name, t) in &ts {
            if tied && name == "lm_head.weight" {
                continue;
            }
            assert_eq!(&ws.take(name, t.shape()).unwrap(), t, "{arch}: {name}");
        }
        assert_eq!(ws.remaining().count(), 0);

        // The test switch keeps llama.cpp's layout: Q/K differ for llama only.
        let (_, mut ws) = tmodel::load(
            &p,
            &LoadOptions {
                keep_gguf_qk_permutation: true,
                ..LoadOptions::default()
            },
        )
        .unwrap();
        let q = ws.take("model.layers.0.self_attn.q_proj.weight", &[32, 16]).unwrap();
        let k = ws.take("model.layers.1.self_attn.k_proj.bias", &[16]).unwrap();
        let v = ws.take("model.layers.0.self_attn.v_proj.weight", &[16, 16]).unwrap();
        assert_eq!(q == ts["model.layers.0.self_attn.q_proj.weight"], arch == "qwen2");
        assert_eq!(k == ts["model.layers.1.self_attn.k_proj.bias"], arch == "qwen2");
        assert_eq!(v, ts["model.layers.0.self_attn.v_proj.weight"]);
    }
}

#[test]
fn the_cpu_engine_computes_the_same_model_from_hf_and_gguf() {
    use crate::engine::cpu::CpuEngine;
    use crate::engine::Engine;
    let d = tempfile::tempdir().unwrap();
    let hf_dir = d.path().join("hf");
    std::fs::create_dir(&hf_dir).unwrap();
    crate::engine::cpu::test_model::write_model(&hf_dir, Opts::default(), |_| {});
    let (cfg, ts) = hf_model("llama", false);
    // The HF folder says qwen2; the arithmetic is the same Llama-layout decoder.
    let mut v = config_json(false);
    v["model_type"] = "llama".into();
    std::fs::write(hf_dir.join("config.json"), v.to_string()).unwrap();
    let p = d.path().join("m.gguf");
    model_writer(&cfg, &ts, GgmlType::F32).write(&p).unwrap();

    let req = RunRequest {
        prompt: vec![1, 5, 9, 3],
        decode_steps: 2,
        sampling: Sampling::Greedy,
        seed: 0,
        forced: None,
        image: None,
    };
    let taps = TapSet::all(cfg.layers);
    let hf = CpuEngine::load(&hf_dir).unwrap().run(&req, &taps).unwrap();
    let gg = CpuEngine::load(&p).unwrap().run(&req, &taps).unwrap();
    assert_eq!(hf, gg, "bitwise the same run");
    let kept = CpuEngine::load_with(
        &p,
        &LoadOptions {
            keep_gguf_qk_permutation: true,
            ..LoadOptions::default()
        },
    )
    .unwrap()
    .run(&req, &taps)
    .unwrap();
    let q = crate::stage::Stage::Block(0, crate::stage::BlockStage::Q);
    let step = crate::stage::Step::Prefill;
    assert_ne!(kept.captures.get(step, q), hf.captures.get(step, q));
}

fn model_err(w: &GgufWriter) -> String {
    let d = tempfile::tempdir().unwrap();
    let p = d.path().join("m.gguf");
    w.write(&p).unwrap();
    let e = tmodel::load(&p, &LoadOptions::default()).expect_err("must be rejected");
    assert!(matches!(e, Error::Model { .. }), "{e:?}");
    let msg = e.to_string();
    assert!(msg.contains(&p.display().to_string()), "{msg}");
    msg
}

#[test]
fn model_errors_name_the_key_or_tensor() {
    let (cfg, ts) = hf_model("llama", false);
    let base = model_writer(&cfg, &ts, GgmlType::F32);

    let mut w = base.clone();
    w.tensors.retain(|t| t.name != "blk.1.ffn_up.weight");
    let msg = model_err(&w);
    assert!(
        msg.contains("missing tensor `blk.1.ffn_up.weight`") && msg.contains("model.layers.1.mlp.up_proj.weight"),
        "{msg}"
    );

    let mut w = base.clone();
    w.tensors.retain(|t| t.name != "output_norm.weight");
    w.tensor("output_norm.weight", GgmlType::F32, &[3], &[1.0; 3]);
    assert!(model_err(&w).contains("tensor `output_norm.weight` has shape [3]"));

    for key in [
        "llama.block_count",
        "llama.attention.layer_norm_rms_epsilon",
        "tokenizer.ggml.model",
    ] {
        let mut w = base.clone();
        w.metadata.retain(|(k, _)| k != key);
        let msg = model_err(&w);
        assert!(msg.contains(&format!("missing metadata key `{key}`")), "{msg}");
    }
    let mut w = base.clone();
    w.kv("general.architecture", Value::String("gpt2".into()));
    assert!(model_err(&w).contains("`gpt2`, which is not supported"));

    let mut w = base.clone();
    w.kv("llama.embedding_length", Value::String("16".into()));
    assert!(model_err(&w).contains("`llama.embedding_length` is a string"));

    let mut w = base.clone();
    w.kv(
        "tokenizer.ggml.tokens",
        Value::Array(ValueType::String, vec![Value::String("a".into()); 7]),
    );
    let msg = model_err(&w);
    assert!(msg.contains("7 tokens") && msg.contains("token_embd.weight"), "{msg}");

    let mut w = base;
    w.kv("llama.attention.head_count_kv", Value::U32(3));
    assert!(model_err(&w).contains("multiple"));
}

#[test]
fn f16_bf16_and_q8_0_models_load() {
    let (cfg, ts) = hf_model("qwen2", false);
    let d = tempfile::tempdir().unwrap();
    let p = d.path().join("m.gguf");
    for (ty, tol) in [(GgmlType::F16, 1e-3), (GgmlType::BF16, 1e-2)] {
        model_writer(&cfg, &ts, ty).write(&p).unwrap();
        let (_, mut ws) = tmodel::load(&p, &LoadOptions::default()).unwrap();
        let t = ws.take("model.layers.0.mlp.up_proj.weight", &[24, 16]).unwrap();
        assert_eq!(t.dtype(), ty.dtype());
        let exp = &ts["model.layers.0.mlp.up_proj.weight"];
        assert!(t.data().iter().zip(exp.data()).all(|(a, b)| (a - b).abs() < tol));
    }
    // Q8_0 needs rows of 32: with E = 16 the file is refused, naming a tensor.
    model_writer(&cfg, &ts, GgmlType::Q8_0).write(&p).unwrap();
    let msg = tmodel::load(&p, &LoadOptions::default()).unwrap_err().to_string();
    assert!(msg.contains("block size 32"), "{msg}");
    // ... and with E = 32 it loads, dequantised.
    let mut w = GgufWriter::new();
    let vals: Vec<f32> = (0..64).map(|i| ((i * 37) % 64) as f32 / 32.0 - 1.0).collect();
    w.tensor("w", GgmlType::Q8_0, &[2, 32], &vals);
    w.write(&p).unwrap();
    let f = GgufFile::open(&p).unwrap();
    let t = f.read_tensor(&f.tensors[0]).unwrap();
    assert!(t
        .data()
        .iter()
        .zip(&vals)
        .all(|(a, b)| (a - b).abs() <= 0.5 / 127.0 + 1e-6));
}

#[test]
fn load_dispatch_names_unknown_files() {
    let d = tempfile::tempdir().unwrap();
    let p = write(d.path(), "m.bin", b"x");
    assert!(tmodel::read_config(&p).unwrap_err().to_string().contains(".gguf file"));
    assert!(tmodel::read_config(&d.path().join("nope.gguf"))
        .unwrap_err()
        .to_string()
        .contains("not found"));
}

#[test]
fn a_model_with_unreadable_types_names_every_such_tensor() {
    let (cfg, ts) = hf_model("qwen2", false);
    let mut w = model_writer(&cfg, &ts, GgmlType::F32);
    // Types with a block size but no dequantiser: I8 (1 byte) and F64 (8).
    for t in w.tensors.iter_mut() {
        let n = t.bytes.len() / 4;
        if t.name.ends_with("ffn_up.weight") {
            (t.type_id, t.bytes) = (GgmlType::I8.id(), vec![0; n]);
        } else if t.name == "output_norm.weight" {
            (t.type_id, t.bytes) = (GgmlType::F64.id(), vec![0; 8 * n]);
        }
    }
    let msg = model_err(&w);
    assert!(
        msg.contains(
            "2 tensors of type I8 are not supported: blk.0.ffn_up.weight, blk.1.ffn_up.weight; \
             1 tensor of type F64 is not supported: output_norm.weight (dequantisation exists for F32, F16, Q4_0"
        ),
        "{msg}"
    );
    // The file itself opens: header, metadata and table are fine.
    let d = tempfile::tempdir().unwrap();
    let p = d.path().join("m.gguf");
    w.write(&p).unwrap();
    assert_eq!(GgufFile::open(&p).unwrap().tensors.len(), w.tensors.len());
    assert!(tmodel::read_config(&p).is_ok());
}
