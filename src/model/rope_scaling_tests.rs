//! RoPE scaling against HF's own tables (a committed fixture), and the
//! reading of either config form with its refusals.

use super::*;
use serde_json::json;

/// HF transformers' own frequencies (goldens/recorders/rope_scaling_vectors.py
/// wrote the fixture): touchstone's f32 table must be them bit for bit, and
/// the f64 formula within the bound the `rope` check grants.
#[test]
fn f32_tables_are_hfs_bit_for_bit() {
    let text = include_str!("../../tests/fixtures/rope_scaling/hf_vectors.jsonl");
    let mut n = 0;
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        let case: Value = serde_json::from_str(line).unwrap();
        let name = case["name"].as_str().unwrap();
        let cfg = json!({"rope_parameters": case["params"], "max_position_embeddings": case["max_position_embeddings"]});
        let s = RopeScaling::from_config(&cfg, "llama").unwrap().expect(name);
        let seq_len = case["seq_len"].as_u64().map_or(0, |n| n as usize);
        let got = s.inv_freq_f32(32, 10000.0, seq_len);
        let want: Vec<f32> = case["inv_freq_bits"]
            .as_array()
            .unwrap()
            .iter()
            .map(|b| f32::from_bits(b.as_u64().unwrap() as u32))
            .collect();
        // Past its boundary dynamic NTK's base is a 0-dim tensor that torch
        // raises to the exponents with a tensor-tensor pow, which is not
        // libm's powf (measured: up to 2 ulps apart on this fixture; every
        // other table, a Python-float base, is bit for bit): two ulps are
        // granted there and nowhere else, far inside the check's 9u.
        let ulps = if name.starts_with("dynamic") && s.table_key(seq_len) != 0 { 2 } else { 0 };
        for (j, (g, w)) in got.iter().zip(&want).enumerate() {
            let off = (g.to_bits() as i64 - w.to_bits() as i64).abs();
            assert!(off <= ulps, "{name}: pair {j}: touchstone {g:e}, HF {w:e} ({off} ulps, {ulps} allowed)");
        }
        assert_eq!(got.len(), want.len(), "{name}");
        let af = case["attention_factor"].as_f64().unwrap();
        assert_eq!(s.attention_factor(), af, "{name}: attention factor");
        // The exact formula is within the bound the check grants HF's f32.
        let exact = s.inv_freq_f64(32, 10000.0, seq_len);
        for (j, (w, x)) in want.iter().zip(&exact).enumerate() {
            let rel = (*w as f64 - x).abs() / x;
            assert!(rel <= s.f32_rel_error(), "{name}: pair {j}: HF {w:e} vs exact {x:e}: {rel:e} > {:e}", s.f32_rel_error());
        }
        n += 1;
    }
    assert_eq!(n, 10, "every case of the fixture was checked");
}

#[test]
fn reads_either_form_and_refuses_what_is_not_implemented() {
    let v4 = json!({"max_position_embeddings": 256, "rope_theta": 1e4,
                    "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}});
    let v5 = json!({"max_position_embeddings": 256,
                    "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4,
                                         "original_max_position_embeddings": 64}});
    let a = RopeScaling::from_config(&v4, "qwen2").unwrap().unwrap();
    assert_eq!(a, RopeScaling::from_config(&v5, "qwen2").unwrap().unwrap());
    assert!(matches!(a, RopeScaling::Yarn { original: 64, truncate: true, .. }));
    assert_eq!(RopeScaling::from_config(&json!({"rope_theta": 1e4}), "qwen2").unwrap(), None);
    let default = json!({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4}});
    assert_eq!(RopeScaling::from_config(&default, "qwen2").unwrap(), None);
    for (cfg, want) in [
        (json!({"rope_scaling": {"rope_type": "su", "factor": 2.0}}), "\"su\""),
        (json!({"rope_scaling": {"factor": 2.0}}), "no `rope_type`"),
        (json!({"rope_scaling": {"rope_type": "linear"}}), "needs `factor`"),
        (json!({"rope_scaling": {"rope_type": "linear", "factor": -1.0}}), "positive"),
        (json!({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 1.0,
                                  "original_max_position_embeddings": 64}}), "must exceed"),
        (json!({"rope_scaling": {"rope_type": "yarn", "factor": 2.0, "truncate": "no"}, "max_position_embeddings": 8}), "truncate"),
        (json!({"rope_scaling": {"rope_type": "longrope", "short_factor": [1.0]}, "max_position_embeddings": 8}), "long_factor"),
        (json!({"rope_scaling": {"rope_type": "linear", "factor": 2.0, "partial_rotary_factor": 0.5}}), "partial RoPE"),
    ] {
        let e = RopeScaling::from_config(&cfg, "llama").expect_err(&cfg.to_string());
        assert!(e.contains(want), "{cfg}: {e}");
    }
    let lr = json!({"rope_scaling": {"rope_type": "longrope", "short_factor": [1.0, 1.0], "long_factor": [1.0, 2.0]},
                    "max_position_embeddings": 256, "original_max_position_embeddings": 64});
    let s = RopeScaling::from_config(&lr, "phi3").unwrap().unwrap();
    assert!(s.validate(8).unwrap_err().contains("head_dim/2 = 4"));
    assert!(s.validate(4).is_ok());
    // Phi-3 without a top-level original length takes HF's class default.
    let lr = json!({"rope_scaling": {"rope_type": "longrope", "short_factor": [1.0], "long_factor": [1.0]},
                    "max_position_embeddings": 8192});
    assert_eq!(RopeScaling::from_config(&lr, "phi3").unwrap().unwrap().original_context(), Some(4096));
}

#[test]
fn step_dependent_tables_switch_past_their_boundary_only() {
    let d = RopeScaling::Dynamic { factor: 4.0, max_positions: 64 };
    assert_eq!(d.table_key(64), 0);
    assert_eq!(d.table_key(65), 65);
    assert_eq!(d.inv_freq_f32(16, 1e4, 64), d.inv_freq_f32(16, 1e4, 1));
    assert_ne!(d.inv_freq_f32(16, 1e4, 65), d.inv_freq_f32(16, 1e4, 64));
    let l = RopeScaling::Longrope { short: vec![1.0; 8], long: vec![2.0; 8], original: 64, attention_factor: 1.1 };
    assert_eq!((l.table_key(64), l.table_key(65), l.table_key(1000)), (0, 1, 1));
    assert_eq!(l.inv_freq_f32(16, 1e4, 65)[3], l.inv_freq_f32(16, 1e4, 64)[3] / 2.0);
    let y = RopeScaling::Yarn { factor: 4.0, original: 64, attention_factor: 1.0, beta_fast: 32.0, beta_slow: 1.0, truncate: true };
    assert_eq!(y.switch_after(), None);
    assert_eq!(y.inv_freq_f32(16, 1e4, 1), y.inv_freq_f32(16, 1e4, 10_000));
}
