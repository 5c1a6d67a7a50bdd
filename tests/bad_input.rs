//! Every kind of bad input gives a typed error naming the file (and line:col for
//! YAML) and exit 2 — or, for a golden of the wrong shape, a failing check that
//! prints both shapes — and never a panic (checked in `common::touchstone`).

mod common;
use common::*;

fn expect_exit2(args: &[&str], needles: &[&str]) -> Output {
    let o = touchstone(args);
    assert_eq!(o.code, 2, "expected exit 2 for {args:?}:\n{}", o.all());
    for n in needles {
        assert!(o.stderr.contains(n), "stderr lacks {n:?}:\n{}", o.stderr);
    }
    o
}

#[test]
fn malformed_yaml() {
    let d = tempfile::tempdir().unwrap();
    let s = write(d.path(), "bad.yaml", "model: [unclosed\nprompt: {tokens: [1]}\n");
    let p = s.display().to_string();
    expect_exit2(&["run", &p], &[&format!("{p}:")]);
}

#[test]
fn unknown_key() {
    let d = tempfile::tempdir().unwrap();
    let text = spec_text(&model_dir(), &hf_golden()).replace("seed: 1234", "sed: 1234");
    let s = write(d.path(), "s.yaml", &text);
    let line = text.lines().position(|l| l.starts_with("sed:")).unwrap() + 1;
    let p = s.display().to_string();
    expect_exit2(&["run", &p], &[&format!("{p}:{line}:1:"), "unknown field `sed`"]);
}

#[test]
fn unknown_stage_suggests_the_right_one() {
    let d = tempfile::tempdir().unwrap();
    let text = spec_text(&model_dir(), &hf_golden()).replace("\"blk.*.q_rope\"", "\"blk.*.qrope\"");
    let s = write(d.path(), "s.yaml", &text);
    let p = s.display().to_string();
    expect_exit2(
        &["run", &p],
        &[&p, "unknown stage pattern `blk.*.qrope`", "did you mean `blk.*.q_rope`"],
    );
}

#[test]
fn unknown_check_suggests_the_right_one() {
    let d = tempfile::tempdir().unwrap();
    let text = spec_text(&model_dir(), &hf_golden()).replace("causal]", "casual]");
    let s = write(d.path(), "s.yaml", &text);
    let p = s.display().to_string();
    expect_exit2(&["run", &p], &[&p, "unknown check `casual`", "did you mean `causal`"]);
}

#[test]
fn layer_past_the_model() {
    let d = tempfile::tempdir().unwrap();
    let text = spec_text(&model_dir(), &hf_golden()).replace("\"blk.*.q_rope\"", "\"blk.7.q_rope\"");
    let s = write(d.path(), "s.yaml", &text);
    expect_exit2(&["run", &s.display().to_string()], &["names layer 7", "has 2 layers"]);
}

#[test]
fn missing_model() {
    let d = tempfile::tempdir().unwrap();
    let missing = d.path().join("no-such-model");
    let s = write(d.path(), "s.yaml", &spec_text(&missing, &hf_golden()));
    expect_exit2(
        &["run", &s.display().to_string()],
        &[&missing.display().to_string(), "not found"],
    );
    // --model naming a missing folder too.
    expect_exit2(
        &["run", "--model", &missing.display().to_string()],
        &[&missing.display().to_string()],
    );
}

#[test]
fn missing_golden_file() {
    let d = tempfile::tempdir().unwrap();
    let missing = d.path().join("nope.safetensors");
    let s = write(d.path(), "s.yaml", &spec_text(&model_dir(), &missing));
    expect_exit2(&["run", &s.display().to_string()], &[&missing.display().to_string()]);
}

#[test]
fn missing_spec_file() {
    expect_exit2(&["run", "specs/does-not-exist.yaml"], &["specs/does-not-exist.yaml"]);
}

#[test]
fn truncated_golden() {
    let d = tempfile::tempdir().unwrap();
    let bytes = std::fs::read(hf_golden()).unwrap();
    let g = d.path().join("hf.safetensors");
    std::fs::write(&g, &bytes[..bytes.len() / 2]).unwrap();
    let s = write(d.path(), "s.yaml", &spec_text(&model_dir(), &g));
    expect_exit2(
        &["run", &s.display().to_string()],
        &[&g.display().to_string(), "not a valid safetensors file"],
    );
}

#[test]
fn truncated_model_weights() {
    let d = tempfile::tempdir().unwrap();
    let m = d.path().join("model");
    std::fs::create_dir(&m).unwrap();
    for e in std::fs::read_dir(model_dir()).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), m.join(e.file_name())).unwrap();
    }
    let w = m.join("model.safetensors");
    let bytes = std::fs::read(&w).unwrap();
    std::fs::write(&w, &bytes[..bytes.len() - 1000]).unwrap();
    let s = write(d.path(), "s.yaml", &spec_text(&m, &hf_golden()));
    expect_exit2(&["run", &s.display().to_string()], &[&w.display().to_string()]);
}

#[test]
fn nan_in_golden() {
    let d = tempfile::tempdir().unwrap();
    let g = d.path().join("hf.safetensors");
    altered_golden(&g, |t| t.get_mut("decode1/blk.0.v").unwrap().data_mut()[3] = f32::NAN);
    let s = write(d.path(), "s.yaml", &spec_text(&model_dir(), &g));
    expect_exit2(
        &["run", &s.display().to_string()],
        &[&g.display().to_string(), "decode1/blk.0.v", "NaN"],
    );
}

#[test]
fn golden_of_the_wrong_shape_fails_the_check_with_both_shapes() {
    let d = tempfile::tempdir().unwrap();
    let g = d.path().join("hf.safetensors");
    altered_golden(&g, |t| {
        let old = t.remove("prefill/blk.1.ffn_up").unwrap();
        let (rows, cols) = (old.shape()[0], old.shape()[1]);
        let data = old.data()[..(rows - 1) * cols].to_vec();
        t.insert(
            "prefill/blk.1.ffn_up".into(),
            touchstone::tensor::Tensor::new(vec![rows - 1, cols], data),
        );
    });
    let s = write(d.path(), "s.yaml", &spec_text(&model_dir(), &g));
    let o = touchstone(&[
        "run",
        &s.display().to_string(),
        "--only",
        "prefill/blk.1.ffn_up::golden",
    ]);
    assert_eq!(o.code, 1, "{}", o.all());
    assert!(o.stdout.contains("shape mismatch"), "{}", o.stdout);
    assert!(
        o.stdout.contains("[7, 128]") || o.stdout.contains("128]"),
        "{}",
        o.stdout
    );
}

#[test]
fn usage_errors_exit_2() {
    let o = touchstone(&["run", "--engine", "tpu"]);
    assert_eq!(o.code, 2, "{}", o.all());
    let o = touchstone(&["frobnicate"]);
    assert_eq!(o.code, 2, "{}", o.all());
    let o = touchstone(&["run", "--only", "no-such-check-id"]);
    assert_eq!(o.code, 2, "{}", o.all());
    assert!(o.stderr.contains("touchstone list"), "{}", o.stderr);
}

#[test]
fn inspect_bad_files() {
    let d = tempfile::tempdir().unwrap();
    let p = write(d.path(), "x.safetensors", "garbage");
    expect_exit2(&["inspect", &p.display().to_string()], &[&p.display().to_string()]);
    let p = write(d.path(), "x.npy", "\u{93}NUMPY garbage");
    expect_exit2(&["inspect", &p.display().to_string()], &[&p.display().to_string()]);
    let p = write(d.path(), "x.bin", "");
    expect_exit2(&["inspect", &p.display().to_string()], &["unknown tensor file type"]);
}

#[test]
fn references_agree_needs_two_sources() {
    let d = tempfile::tempdir().unwrap();
    let text = format!(
        "model: {}\ngoldens: {{hf: {}}}\nprompt: {{golden: hf}}\nstages:\n  \"*\": [finite, references_agree]\n",
        model_dir().display(),
        hf_golden().display()
    );
    let s = write(d.path(), "s.yaml", &text);
    expect_exit2(
        &["run", &s.display().to_string()],
        &["`references_agree` needs two golden sources"],
    );
}

/// A copy of the default model folder with `edit` applied to its config.json.
fn model_with_config(dir: &std::path::Path, edit: impl FnOnce(&mut serde_json::Value)) -> std::path::PathBuf {
    let m = dir.join("model");
    std::fs::create_dir_all(&m).unwrap();
    for e in std::fs::read_dir(model_dir()).unwrap() {
        let p = e.unwrap().path();
        std::fs::copy(&p, m.join(p.file_name().unwrap())).unwrap();
    }
    let cfg_path = m.join("config.json");
    let mut cfg: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&cfg_path).unwrap()).unwrap();
    edit(&mut cfg);
    std::fs::write(&cfg_path, serde_json::to_string_pretty(&cfg).unwrap()).unwrap();
    m
}

#[test]
fn config_fields_the_engines_do_not_implement_are_refused_by_name() {
    use serde_json::json;
    for (key, value, named) in [
        (
            "rope_scaling",
            json!({"rope_type": "su", "factor": 4.0}),
            "rope_scaling.rope_type",
        ),
        ("hidden_act", json!("banana"), "hidden_act"),
        ("final_logit_softcapping", json!(30.0), "final_logit_softcapping"),
        ("partial_rotary_factor", json!(0.5), "partial_rotary_factor"),
    ] {
        let d = tempfile::tempdir().unwrap();
        let m = model_with_config(d.path(), |c| c[key] = value.clone());
        let s = write(d.path(), "s.yaml", &spec_text(&m, &hf_golden()));
        let o = expect_exit2(
            &["run", &s.display().to_string()],
            &[&format!("`{named}`"), "not implemented"],
        );
        assert!(o.stderr.contains("config.json"), "{}", o.stderr);
    }
}

#[test]
fn a_sliding_window_in_an_hf_config_is_computed_and_its_zeros_checked() {
    use serde_json::json;
    let d = tempfile::tempdir().unwrap();
    // Both layers slide with a window of 4 (transformers 5 writes
    // layer_types, which then decides, as in HF).
    let m = model_with_config(d.path(), |c| {
        c["sliding_window"] = json!(4);
        c["use_sliding_window"] = json!(true);
        c["layer_types"] = json!(["sliding_attention", "sliding_attention"]);
    });
    let s = write(d.path(), "s.yaml", &spec_text(&m, &hf_golden()));
    let report = d.path().join("r.json");
    let o = touchstone(&[
        "run",
        &s.display().to_string(),
        "--engine",
        "cpu",
        "--only",
        "*::causal",
        "--json",
        &report.display().to_string(),
    ]);
    assert_eq!(o.code, 0, "{}", o.all());
    let r = json(&report);
    let causal: Vec<&serde_json::Value> = r["checks"].as_array().unwrap().iter().collect();
    // The prefill and, on a sliding layer, every decode step.
    assert!(causal.len() > 2, "{causal:?}");
    for c in causal {
        let msg = c["message"].as_str().unwrap();
        assert!(msg.contains("older than the window are exactly 0"), "{msg}");
        assert!(msg.contains("sliding window 4"), "{msg}");
    }
}

#[test]
fn a_config_override_the_goldens_were_not_recorded_with_is_refused() {
    let (_d, s, _) = edited_spec(
        "\nprompt:",
        "\nconfig:\n  rope_scaling: {type: linear, factor: 2.0}\nprompt:",
    );
    expect_exit2(&["run", &s], &["stale golden", "recorded with config override none", "\"linear\""]);
    let (_d, s, text) = edited_spec("\nprompt:", "\nconfig: 3\nprompt:");
    let line = line_of(&text, "config:");
    expect_exit2(&["run", &s], &[&format!("{s}:{line}:"), "non-empty mapping"]);
    // On the model's own keys: an override the engines do not implement is
    // refused by name, as in config.json.
    let (_d, s, _) = edited_spec("\nprompt:", "\nconfig:\n  rope_scaling: {type: su, factor: 2.0}\nprompt:");
    expect_exit2(&["run", &s], &["\"su\"", "not implemented"]);
}

/// The default spec (absolute paths) with `from` replaced by `to`, written to a temp dir.
fn edited_spec(from: &str, to: &str) -> (tempfile::TempDir, String, String) {
    let d = tempfile::tempdir().unwrap();
    let text = spec_text(&model_dir(), &hf_golden());
    assert!(text.contains(from), "the default spec lacks {from:?}");
    let text = text.replacen(from, to, 1);
    let s = write(d.path(), "s.yaml", &text).display().to_string();
    (d, s, text)
}

fn line_of(text: &str, needle: &str) -> usize {
    text.lines().position(|l| l.contains(needle)).unwrap() + 1
}

#[test]
fn tolerances_that_cannot_fail_or_cannot_pass_are_refused() {
    for bad in [
        "{atol: .inf, rtol: .nan}",
        "{atol: -1.0e-5, rtol: 1.3e-6}",
        "{atol: 1.0e-5, rtol: .nan}",
    ] {
        let (_d, s, text) = edited_spec("{atol: 1.0e-5, rtol: 1.3e-6}", bad);
        let line = line_of(&text, bad);
        expect_exit2(
            &["run", &s],
            &[&format!("{s}:{line}:"), "a tolerance must be a finite number >= 0"],
        );
    }
    let (_d, s, _) = edited_spec("{kv_cache: {atol: 1.0e-5", "{kv_cache: {atol: .nan");
    expect_exit2(&["run", &s], &["a tolerance must be a finite number >= 0"]);
    let (_d, s, _) = edited_spec("{softmax_rows: {tol: 1.0e-5}}", "{softmax_rows: {tol: -1.0}}");
    expect_exit2(&["run", &s], &["a tolerance must be a finite number >= 0"]);
}

#[test]
fn duplicate_keys_are_errors_at_every_depth() {
    let (_d, s, text) = edited_spec("  llama.cpp: ", "  hf: /elsewhere.safetensors\n  llama.cpp: ");
    let line = line_of(&text, "/elsewhere.safetensors");
    expect_exit2(
        &["run", &s],
        &[&format!("{s}:{line}:"), "duplicate entry with key \"hf\""],
    );
    let (_d, s, _) = edited_spec("seed: 1234", "seed: 1234\nseed: 1");
    expect_exit2(&["run", &s], &["duplicate"]);
}

#[test]
fn unbounded_counts_are_refused_before_anything_runs() {
    for (from, to, needle) in [
        (
            "decode_steps: 4}}",
            "decode_steps: 9223372036854775807}}",
            "kv_cache.decode_steps is 9223372036854775807",
        ),
        (
            "decode_steps: 4}}",
            "decode_steps: 2147483648}}",
            "kv_cache.decode_steps is 2147483648",
        ),
        ("runs: 3,", "runs: 0x7fffffff,", "determinism.runs is 2147483647"),
        (
            "decode_steps: 8,",
            "decode_steps: 65536,",
            "determinism.decode_steps is 65536",
        ),
    ] {
        let (_d, s, _) = edited_spec(from, to);
        let t = std::time::Instant::now();
        expect_exit2(&["run", &s], &[needle, "at most"]);
        assert!(t.elapsed().as_secs() < 10, "{to}: took {:?}", t.elapsed());
    }
    // Within the fixed limits but past the model's 1024 positions.
    let (_d, s, _) = edited_spec("decode_steps: 4}}", "decode_steps: 1020}}");
    expect_exit2(
        &["run", &s],
        &[
            "kv_cache.decode_steps reach 1034 positions",
            "context is 1024 positions",
        ],
    );
}

#[test]
fn deeply_nested_yaml_is_refused_in_linear_time() {
    let d = tempfile::tempdir().unwrap();
    let s = write(d.path(), "deep.yaml", &format!("model: {}\n", "[".repeat(32_000)))
        .display()
        .to_string();
    let t = std::time::Instant::now();
    expect_exit2(&["run", &s], &["nested deeper than 64 levels"]);
    assert!(t.elapsed().as_secs_f64() < 2.0, "took {:?}", t.elapsed());
}

/// Found by fuzzing (tests/fuzz.rs, gguf_reader): a GGUF whose block_count is
/// huge made the loader loop over (and allocate for) every declared layer.
#[test]
fn a_gguf_declaring_absurd_dimensions_is_refused_at_once() {
    let seed = std::fs::read(root().join("tests/fuzz/corpus/gguf_reader/tiny.gguf")).unwrap();
    let key = b"qwen2.block_count";
    let at = seed.windows(key.len()).position(|w| w == key).unwrap() + key.len();
    // After the key: its value type (u32 = 4) and the value.
    assert_eq!(&seed[at..at + 4], &4u32.to_le_bytes());
    for (value, needle) in [(u32::MAX, "at most 4096"), (4000, "has only 12 tensors")] {
        let mut bytes = seed.clone();
        bytes[at + 4..at + 8].copy_from_slice(&value.to_le_bytes());
        let d = tempfile::tempdir().unwrap();
        let p = write_bytes(d.path(), "big.gguf", &bytes);
        let t = std::time::Instant::now();
        let o = touchstone(&["run", "--model", &p.display().to_string()]);
        assert_eq!(o.code, 2, "{}", o.all());
        assert!(
            o.stderr.contains("block_count") || o.stderr.contains("num_hidden_layers"),
            "{}",
            o.stderr
        );
        assert!(o.stderr.contains(needle), "{}", o.stderr);
        assert!(t.elapsed().as_secs() < 5);
    }
}

fn write_bytes(dir: &std::path::Path, name: &str, bytes: &[u8]) -> std::path::PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, bytes).unwrap();
    p
}
