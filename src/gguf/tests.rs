//! GGUF reader and model-mapping tests on files written by `writer` into a
//! temporary folder: round trips per dtype, every integrity check, truncation at
//! every byte, and the Llama Q/K permutation undone (or kept on request).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use super::writer::GgufWriter;
use super::*;
use crate::engine::{RunRequest, TapSet};
use crate::model::gguf::model_writer;
use crate::model::gguf::{permute_rows, unpermute_rows};
use crate::model::{self as tmodel, LoadOptions};
use crate::sampling::Sampling;

fn small() -> GgufWriter {
    let mut w = GgufWriter::new();
    w.kv("general.architecture", Value::String("llama".into()))
        .kv("some.u8", Value::U8(7))
        .kv("some.i64", Value::I64(-3))
        .kv("some.bool", Value::Bool(true))
        .kv("some.f64", Value::F64(0.25))
        .kv(
            "some.array",
            Value::Array(ValueType::U32, (0..20).map(Value::U32).collect()),
        )
        .kv(
            "some.nested",
            Value::Array(
                ValueType::Array,
                vec![Value::Array(ValueType::String, vec![Value::String("x".into())])],
            ),
        );
    let vals: Vec<f32> = (0..64).map(|i| i as f32 * 0.125 - 3.0).collect();
    w.tensor("a", GgmlType::F32, &[4, 16], &vals)
        .tensor("b", GgmlType::F16, &[64], &vals)
        .tensor("c", GgmlType::BF16, &[2, 2, 16], &vals)
        .tensor("d", GgmlType::Q8_0, &[2, 32], &vals);
    w
}

fn write(dir: &Path, name: &str, bytes: &[u8]) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, bytes).unwrap();
    p
}

fn open_err(bytes: &[u8]) -> String {
    let d = tempfile::tempdir().unwrap();
    let p = write(d.path(), "m.gguf", bytes);
    let e = GgufFile::open(&p).expect_err("must be rejected");
    assert!(matches!(e, Error::TensorFile { .. }), "{e:?}");
    let msg = e.to_string();
    assert!(msg.contains(&p.display().to_string()), "{msg}");
    msg
}

#[test]
fn round_trip_of_every_dtype_and_value_type() {
    let d = tempfile::tempdir().unwrap();
    for version in [2, 3] {
        let mut w = small();
        w.version = version;
        let p = write(d.path(), "m.gguf", &w.to_bytes());
        let f = GgufFile::open(&p).unwrap();
        assert_eq!(f.version, version);
        assert_eq!(f.alignment, 32);
        assert_eq!(f.metadata, w.metadata);
        assert_eq!(f.get("some.i64").and_then(Value::as_f64), Some(-3.0));
        assert_eq!(f.get("some.array").unwrap().summary(3, 10), "[len 20] 0, 1, 2, ...");
        let vals: Vec<f32> = (0..64).map(|i| i as f32 * 0.125 - 3.0).collect();
        let a = f.read_tensor(f.tensor("a").unwrap()).unwrap();
        assert_eq!((a.shape(), a.dtype(), a.data()), (&[4, 16][..], DType::F32, &vals[..]));
        assert_eq!(f.tensor("a").unwrap().ne, vec![16, 4]);
        let b = f.read_tensor(f.tensor("b").unwrap()).unwrap();
        assert_eq!((b.dtype(), b.data()), (DType::F16, &vals[..])); // exact in f16
        let c = f.read_tensor(f.tensor("c").unwrap()).unwrap();
        assert_eq!(
            (c.shape(), c.dtype(), c.data()),
            (&[2, 2, 16][..], DType::BF16, &vals[..])
        );
        let q = f.read_tensor(f.tensor("d").unwrap()).unwrap();
        assert_eq!(q.shape(), &[2, 32]);
        for (x, y) in q.data().iter().zip(&vals) {
            assert!((x - y).abs() <= 3.0 / 127.0, "{x} vs {y}");
        }
        for t in &f.tensors {
            assert_eq!(t.offset % 32, 0);
        }
    }
}

#[test]
fn custom_alignment_is_honoured_and_must_be_a_power_of_two() {
    let d = tempfile::tempdir().unwrap();
    let mut w = small();
    w.kv("general.alignment", Value::U32(64));
    let p = write(d.path(), "m.gguf", &w.to_bytes());
    let f = GgufFile::open(&p).unwrap();
    assert_eq!((f.alignment, f.data_offset % 64), (64, 0));
    assert!(f.tensors.iter().all(|t| t.offset % 64 == 0));

    let mut w = small();
    w.kv("general.alignment", Value::U32(48));
    let msg = open_err(&w.to_bytes());
    assert!(
        msg.contains("general.alignment") && msg.contains("power of two"),
        "{msg}"
    );
    let mut w = small();
    w.kv("general.alignment", Value::String("32".into()));
    assert!(open_err(&w.to_bytes()).contains("general.alignment"));
}

#[test]
fn magic_and_version_are_checked() {
    let mut b = small().to_bytes();
    b[..4].copy_from_slice(b"GGML");
    assert!(open_err(&b).contains("not a GGUF file"));
    for v in [1u32, 4] {
        let mut b = small().to_bytes();
        b[4..8].copy_from_slice(&v.to_le_bytes());
        let msg = open_err(&b);
        assert!(msg.contains(&format!("GGUF version {v} is not supported")), "{msg}");
    }
    let d = tempfile::tempdir().unwrap();
    let p = write(d.path(), "empty.gguf", b"");
    assert!(GgufFile::open(&p).unwrap_err().to_string().contains("empty file"));
}

#[test]
fn every_truncation_is_an_error_not_a_panic() {
    let b = small().to_bytes();
    let d = tempfile::tempdir().unwrap();
    let p = d.path().join("t.gguf");
    for n in 1..b.len() {
        std::fs::write(&p, &b[..n]).unwrap();
        let e = GgufFile::open(&p).expect_err(&format!("a file cut at {n} of {} bytes must be rejected", b.len()));
        let msg = e.to_string();
        assert!(
            msg.contains("truncated") || msg.contains("past the end"),
            "cut at {n}: {msg}"
        );
    }
}

#[test]
fn huge_lengths_are_bounded_by_the_file() {
    // The first key's length claims far more bytes than the file has.
    let mut b = small().to_bytes();
    b[24..32].copy_from_slice(&u64::MAX.to_le_bytes());
    assert!(open_err(&b).contains("truncated"));
    // A metadata count no file could hold.
    let mut b = small().to_bytes();
    b[16..24].copy_from_slice(&(u64::MAX / 2).to_le_bytes());
    assert!(open_err(&b).contains("metadata entries"));
    // A tensor count no file could hold.
    let mut b = small().to_bytes();
    b[8..16].copy_from_slice(&(1u64 << 40).to_le_bytes());
    assert!(open_err(&b).contains("tensors"));
    // An array claiming 2^60 elements.
    let mut w = GgufWriter::new();
    w.kv("arr", Value::Array(ValueType::U64, vec![Value::U64(1)]));
    let mut b = w.to_bytes();
    let at = 24 + 8 + 3 + 4 + 4; // header, key, type, element type
    b[at..at + 8].copy_from_slice(&(1u64 << 60).to_le_bytes());
    let msg = open_err(&b);
    assert!(msg.contains("`arr`") && msg.contains("truncated"), "{msg}");
}

#[test]
fn bad_value_types_and_duplicates_are_named() {
    let mut w = GgufWriter::new();
    w.kv("k", Value::U8(1));
    let mut b = w.to_bytes();
    b[24 + 8 + 1..24 + 8 + 1 + 4].copy_from_slice(&13u32.to_le_bytes());
    let msg = open_err(&b);
    assert!(
        msg.contains("metadata key `k`") && msg.contains("value type id 13"),
        "{msg}"
    );

    let mut w = GgufWriter::new();
    w.kv("k", Value::Bool(true));
    let mut b = w.to_bytes();
    b[24 + 8 + 1 + 4] = 2; // header, key, type, then the bool
    let msg = open_err(&b);
    assert!(msg.contains("`k`") && msg.contains("bool value is 2"), "{msg}");

    let mut w = GgufWriter::new();
    w.metadata.push(("k".into(), Value::U8(1)));
    w.metadata.push(("k".into(), Value::U8(2)));
    assert!(open_err(&w.to_bytes()).contains("`k` appears more than once"));
}

#[test]
fn tensor_ranges_are_checked() {
    // Offset past the end.
    let mut w = small();
    w.tensors.pop();
    let mut b = w.to_bytes();
    let cut = b.len() - 10;
    b.truncate(cut);
    let msg = open_err(&b);
    assert!(msg.contains("tensor `c`") && msg.contains("past the end"), "{msg}");

    // Misaligned and overlapping offsets: patch the offset fields.
    let offset_field = |b: &[u8], name: &str| -> usize {
        let needle = [&(name.len() as u64).to_le_bytes()[..], name.as_bytes()].concat();
        let at = b.windows(needle.len()).position(|w| w == needle).unwrap() + needle.len();
        let n_dims = u32::from_le_bytes(b[at..at + 4].try_into().unwrap()) as usize;
        at + 4 + 8 * n_dims + 4
    };
    let b0 = small().to_bytes();
    let mut b = b0.clone();
    let at = offset_field(&b, "b");
    let off = u64::from_le_bytes(b[at..at + 8].try_into().unwrap());
    b[at..at + 8].copy_from_slice(&(off + 4).to_le_bytes());
    let msg = open_err(&b);
    assert!(msg.contains("tensor `b`") && msg.contains("alignment 32"), "{msg}");
    let mut b = b0.clone();
    b[at..at + 8].copy_from_slice(&0u64.to_le_bytes());
    let msg = open_err(&b);
    assert!(
        msg.contains("overlap") && msg.contains("`a`") && msg.contains("`b`"),
        "{msg}"
    );
    let mut b = b0;
    b[at..at + 8].copy_from_slice(&(u64::MAX - 31).to_le_bytes());
    assert!(open_err(&b).contains("past the end"));
}

#[test]
fn every_type_has_one_row_and_its_id() {
    let all: Vec<GgmlType> = GgmlType::all().collect();
    assert_eq!(all.len(), 38);
    for (i, t) in all.iter().enumerate() {
        assert_eq!(GgmlType::from_id(t.id()), Some(*t));
        assert_eq!(ggml_type_name(t.id()), Some(t.name()));
        // The name is the variant's own (no fallback row was used).
        assert_eq!(t.name(), format!("{t:?}"));
        assert!(all[..i].iter().all(|u| u.id() < t.id()), "id order");
        let (qk, bytes) = t.block();
        assert!(qk > 0 && bytes > 0, "{t:?}");
    }
    let ids: Vec<u32> = (0..=64).filter(|&i| GgmlType::from_id(i).is_some()).collect();
    assert_eq!(ids.len(), 38);
    assert_eq!(known_type_ids(), "0..=3, 6..=35, 39..=42");
    assert_eq!(
        quant::readable_names(),
        "F32, F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, BF16"
    );
    // ggml's sizes for the types the real models use (ggml-common.h).
    assert_eq!(GgmlType::Q4_K.block(), (256, 144));
    assert_eq!(GgmlType::Q5_0.block(), (32, 22));
    assert_eq!(GgmlType::Q6_K.block(), (256, 210));
    assert_eq!(GgmlType::IQ2_XS.block(), (256, 74));
}

#[test]
fn every_known_type_opens_and_only_reading_needs_a_dequantiser() {
    let mut w = small();
    for ty in GgmlType::all() {
        let (qk, bytes) = ty.block();
        w.raw_tensor(
            &format!("t.{}", ty.name()),
            ty.id(),
            vec![2 * qk, 3],
            vec![0; 6 * bytes as usize],
        );
    }
    let d = tempfile::tempdir().unwrap();
    let p = write(d.path(), "all.gguf", &w.to_bytes());
    let f = GgufFile::open(&p).unwrap();
    for ty in GgmlType::all() {
        let info = f.tensor(&format!("t.{}", ty.name())).unwrap();
        assert_eq!((info.ggml_type, info.size), (ty, 6 * ty.block().1));
        match f.read_tensor(info) {
            Ok(t) => {
                assert!(ty.readable(), "{ty:?}");
                assert_eq!(t.shape(), &[3, 2 * ty.block().0 as usize]);
                assert!(t.data().iter().all(|&x| x == 0.0), "{ty:?}: zero blocks are zeros");
            }
            Err(e) => {
                assert!(!ty.readable(), "{ty:?}: {e}");
                let msg = e.to_string();
                assert!(
                    msg.contains(&p.display().to_string())
                        && msg.contains(&format!("tensor `t.{}` is of type {}", ty.name(), ty.name()))
                        && msg.contains("dequantisation exists for F32, F16, Q4_0"),
                    "{msg}"
                );
            }
        }
    }
}

#[test]
fn truncated_quantised_data_names_the_tensor() {
    // Two Q6_K blocks (420 bytes) as the last tensor: any cut into them is an
    // error naming it, never a short read.
    let mut w = small();
    w.raw_tensor("blk.0.ffn_down.weight", GgmlType::Q6_K.id(), vec![256, 2], vec![7; 420]);
    let b = w.to_bytes();
    let d = tempfile::tempdir().unwrap();
    let p = d.path().join("q.gguf");
    std::fs::write(&p, &b).unwrap();
    let f = GgufFile::open(&p).unwrap();
    let t = f.read_tensor(f.tensor("blk.0.ffn_down.weight").unwrap()).unwrap();
    assert_eq!(t.shape(), &[2, 256]);
    for cut in [1, 209, 210, 211, 419] {
        let msg = open_err(&b[..b.len() - cut]);
        assert!(
            msg.contains("tensor `blk.0.ffn_down.weight`") && msg.contains("past the end of the file"),
            "cut {cut}: {msg}"
        );
    }
}

#[test]
fn unknown_type_ids_and_bad_sizes_name_the_tensor() {
    for id in [4u32, 5, 36, 37, 38, 43, 999] {
        let mut w = small();
        w.raw_tensor("x", id, vec![4], vec![0; 16]);
        let msg = open_err(&w.to_bytes());
        assert!(
            msg.contains(&format!("tensor `x`: ggml type id {id} is not supported"))
                && msg.contains("known ids: 0..=3, 6..=35, 39..=42"),
            "{msg}"
        );
    }
    let mut w = small();
    w.raw_tensor("q", GgmlType::Q8_0_ID, vec![16], vec![0; 17]);
    assert!(open_err(&w.to_bytes()).contains("block size 32"));
    let mut w = small();
    w.raw_tensor("blk.0.ffn_up.weight", GgmlType::Q4_K.id(), vec![64, 2], vec![0; 144]);
    let msg = open_err(&w.to_bytes());
    assert!(
        msg.contains("tensor `blk.0.ffn_up.weight`") && msg.contains("not a multiple of the Q4_K block size 256"),
        "{msg}"
    );
    let mut w = small();
    w.raw_tensor("five", 0, vec![1, 1, 1, 1, 1], vec![0; 4]);
    assert!(open_err(&w.to_bytes()).contains("5 dimensions"));
}

// ---- the model mapping ----

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
