//! The commands as a user runs them: the default spec passes and prints the
//! per-stage table and JSON report; `list` names the trials; `inspect` shows
//! provenance and statistics; an unavailable engine is skipped, never passed.

mod common;
use common::*;

#[test]
fn default_run_passes_with_table_and_json() {
    let d = tempfile::tempdir().unwrap();
    let j = d.path().join("r.json");
    // By default a long table that all passes is one line...
    let o = touchstone(&["run", "--json", &j.display().to_string()]);
    assert_eq!(o.code, 0, "{}", o.all());
    assert!(!o.stdout.contains("prefill  blk.0.attn_probs"), "{}", o.stdout);
    assert!(o.stdout.contains("all 148 (step, stage) rows pass"), "{}", o.stdout);
    assert!(o.stdout.contains("touchstone: PASSED"), "{}", o.stdout);
    assert!(
        !o.stdout.contains('\x1b'),
        "colour when stdout is not a terminal: {}",
        o.stdout
    );
    // ...--verbose prints every row, --quiet only the summary, --color always colours.
    let v = touchstone(&["run", "--verbose"]);
    assert!(v.stdout.contains("prefill  blk.0.attn_probs"), "{}", v.stdout);
    assert_eq!(
        v.stdout.lines().filter(|l| l.starts_with("decode3 ")).count(),
        37,
        "{}",
        v.stdout
    );
    let q = touchstone(&["run", "--quiet"]);
    assert_eq!(q.code, 0, "{}", q.all());
    assert!(
        !q.stdout.contains("run checks:") && !q.stdout.contains("rows pass"),
        "{}",
        q.stdout
    );
    assert!(q.stdout.contains("touchstone: PASSED"), "{}", q.stdout);
    let c = touchstone(&["run", "--quiet", "--color", "always"]);
    assert!(c.stdout.contains("\x1b[32mPASSED\x1b[0m"), "{}", c.stdout);
    let n = touchstone_env(&["run", "--quiet"], &[("NO_COLOR", "1")]);
    assert!(!n.stdout.contains('\x1b'), "{}", n.stdout);
    let r = json(&j);
    assert_eq!(r["passed"], true);
    assert!(r["first_divergence"].is_null());
    let checks = r["checks"].as_array().unwrap();
    for kind in [
        "finite",
        "shape",
        "softmax_rows",
        "causal",
        "rope",
        "golden:hf",
        "determinism",
        "kv_cache",
        "greedy_tokens:hf",
    ] {
        assert!(
            checks.iter().any(|c| c["check"] == kind && c["status"] == "pass"),
            "no passing {kind}"
        );
    }
    for key in [
        "spec", "engine", "step", "stage", "check", "status", "metrics", "message",
    ] {
        assert!(checks[0].get(key).is_some(), "check lacks {key}");
    }
}

#[test]
fn model_override_runs_the_same_spec() {
    let o = touchstone(&["run", "--model", &model_dir().display().to_string(), "--only", "logits"]);
    assert_eq!(o.code, 0, "{}", o.all());
}

#[test]
fn list_names_every_trial_canonically() {
    let o = touchstone(&["list"]);
    assert_eq!(o.code, 0, "{}", o.all());
    assert!(
        o.stdout
            .lines()
            .any(|l| l == "cpu::qwen2-tiny::prefill/blk.0.attn_probs::softmax_rows"),
        "{}",
        o.stdout
    );
    assert!(o.stdout.lines().any(|l| l == "cpu::qwen2-tiny::run::determinism"));
}

/// The CUDA engine on the emulated device is a built-in engine that always
/// runs: the default spec passes on it with the same table as the CPU engine,
/// and `all` includes it, the real models too (issue 23: emulated within 2x
/// of the CPU engine's time), except where a spec says `emulate: false`.
#[test]
fn cuda_emu_runs_the_default_spec_and_is_in_all() {
    let o = touchstone(&["run", "--engine", "cuda-emu"]);
    assert_eq!(o.code, 0, "{}", o.all());
    assert!(o.stdout.contains("all 148 (step, stage) rows pass"), "{}", o.stdout);
    assert!(o.stdout.contains("touchstone: PASSED"), "{}", o.stdout);
    let o = touchstone(&["list", "--engine", "all"]);
    assert_eq!(o.code, 0, "{}", o.all());
    assert!(
        o.stdout.lines().any(|l| l == "cuda-emu::qwen2-tiny::run::determinism"),
        "{}",
        o.stdout
    );
    let real = root().join("specs/qwen2.5-0.5b.yaml");
    if touchstone::spec::Spec::load(&real).is_ok_and(|s| s.model.exists()) {
        let o = touchstone(&["list", "--engine", "all", &real.display().to_string()]);
        assert_eq!(o.code, 0, "{}", o.all());
        for engine in ["cpu", "cuda-emu"] {
            assert!(
                o.stdout
                    .lines()
                    .any(|l| l.starts_with(&format!("{engine}::qwen2.5-0.5b::"))),
                "{engine}: {}",
                o.stdout
            );
        }
    }
    assert!(touchstone::spec::Spec::load(&real).unwrap().emulate);
    // `emulate: false` leaves cuda-emu out of `all`, not out of `--engine cuda-emu`.
    let tiny = root().join("specs/qwen2-tiny.yaml");
    let text = std::fs::read_to_string(&tiny).unwrap() + "\nemulate: false\n";
    let spec = touchstone::spec::Spec::parse(&tiny, &text).unwrap();
    assert!(!spec.emulate);
    let sels = touchstone::engine::registry::EngineSel::resolve("all", &spec.declared()).unwrap();
    assert!(!sels.iter().any(|s| s.name() == "cuda-emu"));
    assert_eq!(
        touchstone::engine::registry::EngineSel::resolve("cuda-emu", &spec.declared()).unwrap()[0].name(),
        "cuda-emu"
    );
}

#[test]
fn cuda_is_skipped_with_a_reason_not_passed() {
    use touchstone::engine::registry::EngineSel;
    use touchstone::engine::Availability;
    let Availability::Unavailable(reason) = EngineSel::Cuda.availability() else {
        return; // a machine with a GPU runs the CUDA trials for real
    };
    // A run that checked nothing is not a pass: exit 1, saying so...
    let o = touchstone(&["run", "--engine", "cuda"]);
    assert_eq!(o.code, 1, "{}", o.all());
    assert!(
        o.stdout.contains(&format!("skipped: {}", &reason[..30])),
        "{}",
        o.stdout
    );
    assert!(o.stdout.contains("NOTHING RAN: 0 passed, 0 failed"), "{}", o.stdout);
    assert!(o.stderr.contains("--allow-skip"), "{}", o.stderr);
    // ...unless the user says a skipped run is acceptable; the summary still says so.
    let o = touchstone(&["run", "--engine", "cuda", "--allow-skip"]);
    assert_eq!(o.code, 0, "{}", o.all());
    assert!(o.stdout.contains("NOTHING RAN: 0 passed, 0 failed"), "{}", o.stdout);
    // --require-gpu turns the skip into exit 2, naming what is missing.
    let o = touchstone(&["run", "--engine", "cuda", "--require-gpu"]);
    assert_eq!(o.code, 2, "{}", o.all());
    assert!(
        o.stderr.contains("--require-gpu: the cuda engine is unavailable"),
        "{}",
        o.all()
    );
    assert!(o.stderr.contains(&reason), "{}", o.all());
}

#[test]
fn inspect_shows_provenance_and_stats() {
    let o = touchstone(&["inspect", &hf_golden().display().to_string()]);
    assert_eq!(o.code, 0, "{}", o.all());
    for needle in [
        "metadata provenance",
        "\"attn_implementation\": \"eager\"",
        "model_sha256",
        "prefill/blk.0.attn_probs",
        "f32",
        "[4, 14, 14]",
    ] {
        assert!(o.stdout.contains(needle), "inspect lacks {needle}:\n{}", o.stdout);
    }
}

#[test]
fn inspect_reads_npy() {
    let d = tempfile::tempdir().unwrap();
    let p = d.path().join("x.npy");
    // A hand-built v1.0 .npy of two little-endian f32 values, 1.5 and -2.
    let header = "{'descr': '<f4', 'fortran_order': False, 'shape': (2,), }";
    let mut h = header.to_string();
    while !(10 + h.len() + 1).is_multiple_of(64) {
        h.push(' ');
    }
    h.push('\n');
    let mut bytes = b"\x93NUMPY\x01\x00".to_vec();
    bytes.extend((h.len() as u16).to_le_bytes());
    bytes.extend(h.as_bytes());
    bytes.extend(1.5f32.to_le_bytes());
    bytes.extend((-2.0f32).to_le_bytes());
    std::fs::write(&p, &bytes).unwrap();
    let o = touchstone(&["inspect", &p.display().to_string()]);
    assert_eq!(o.code, 0, "{}", o.all());
    assert!(
        o.stdout.contains("-2.0000e0") && o.stdout.contains("1.5000e0"),
        "{}",
        o.stdout
    );
    // The same file cut short is a typed error naming it.
    std::fs::write(&p, &bytes[..bytes.len() - 3]).unwrap();
    let o = touchstone(&["inspect", &p.display().to_string()]);
    assert_eq!(o.code, 2, "{}", o.all());
    assert!(o.stderr.contains(&p.display().to_string()), "{}", o.stderr);
}

#[test]
fn both_models_pass_from_hf_folders_and_gguf_files() {
    for (spec, gguf) in [
        ("specs/qwen2-tiny.yaml", "goldens/qwen2-tiny/model.gguf"),
        ("specs/llama-tiny.yaml", "goldens/llama-tiny/model.gguf"),
    ] {
        let o = touchstone(&["run", spec, "--only", "golden"]);
        assert_eq!(o.code, 0, "{spec}:\n{}", o.all());
        let o = touchstone(&["run", spec, "--model", gguf]);
        assert_eq!(o.code, 0, "{spec} from {gguf}:\n{}", o.all());
    }
}

#[test]
fn llama_gguf_with_its_qk_permutation_kept_diverges_at_blk0_q() {
    let d = tempfile::tempdir().unwrap();
    let j = d.path().join("r.json");
    let o = touchstone(&[
        "run",
        "specs/llama-tiny.yaml",
        "--model",
        "goldens/llama-tiny/model.gguf",
        "--keep-gguf-qk-permutation",
        "--json",
        &j.display().to_string(),
    ]);
    assert_eq!(o.code, 1, "{}", o.all());
    let fd = &json(&j)["first_divergence"];
    assert_eq!(
        (fd["step"].as_str(), fd["stage"].as_str()),
        (Some("prefill"), Some("blk.0.q")),
        "{fd}"
    );
}

#[test]
fn storage_flag_overrides_the_spec_and_is_reported() {
    let d = tempfile::tempdir().unwrap();
    let j = d.path().join("r.json");
    let jp = j.display().to_string();
    let check = |r: &serde_json::Value| r["checks"][0].clone();

    // The f32 default spec run with bf16 storage: the spec has an oracle, so
    // the scaled policy judges the bf16 engine by the floors of bf16
    // arithmetic (its own rounding and what it inherits), and it passes.
    let o = touchstone(&[
        "run",
        "--storage",
        "bf16",
        "--only",
        "prefill/logits::golden:hf",
        "--json",
        &jp,
    ]);
    assert_eq!(o.code, 0, "{}", o.all());
    assert!(
        o.stdout
            .contains("== qwen2-tiny on engine cpu, storage bf16 (specs/qwen2-tiny.yaml) =="),
        "{}",
        o.stdout
    );
    let r = json(&j);
    assert_eq!(r["runs"][0]["storage"], "bf16");
    let c = check(&r);
    assert!(c["message"].as_str().unwrap().contains("arithmetic bf16"), "{c}");
    // bf16's error is far beyond f32 rounding, and within bf16's allowance.
    let m = &c["metrics"];
    assert!(m["error_vs_oracle"].as_f64().unwrap() > 1e-2, "{c}");
    assert!(
        m["error_vs_oracle"].as_f64().unwrap() <= m["allowed"].as_f64().unwrap(),
        "{c}"
    );
    // The rerun command reproduces the override.
    assert!(c["rerun"].as_str().unwrap().contains(" --storage bf16 "), "{c}");

    // The bf16 spec passes at its own storage, with its own bf16 tolerance...
    let spec = "specs/qwen2-tiny-bf16.yaml";
    let o = touchstone(&["run", spec, "--only", "prefill/blk.0.q::golden:hf", "--json", &jp]);
    assert_eq!(o.code, 0, "{}", o.all());
    let r = json(&j);
    assert_eq!(r["runs"][0]["storage"], "bf16");
    let c = check(&r);
    assert_eq!(c["metrics"]["atol"].as_f64(), Some(0.2), "{c}");
    assert!(!c["rerun"].as_str().unwrap().contains("--storage"), "{c}");
    // ...and `--storage f32` overrides it: f32 captures, the spec's f32 entry.
    let o = touchstone(&[
        "run",
        spec,
        "--storage",
        "f32",
        "--only",
        "prefill/blk.0.q::golden:hf",
        "--json",
        &jp,
    ]);
    assert_eq!(o.code, 0, "{}", o.all());
    assert!(o.stdout.contains("storage f32"), "{}", o.stdout);
    let r = json(&j);
    assert_eq!(r["runs"][0]["storage"], "f32");
    let c = check(&r);
    assert_eq!(c["metrics"]["atol"].as_f64(), Some(1e-5), "{c}");
    assert!(c["metrics"]["max_abs"].as_f64().unwrap() < 1e-5, "{c}");
    assert!(c["rerun"].as_str().unwrap().contains(" --storage f32 "), "{c}");

    // An unknown dtype is a usage error naming the known ones.
    let o = touchstone(&["run", "--storage", "fp8"]);
    assert_eq!(o.code, 2, "{}", o.all());
    assert!(
        o.stderr.contains("unknown dtype `fp8` (known: f32, f16, bf16)"),
        "{}",
        o.stderr
    );
}

#[test]
fn with_no_spec_the_nearest_specs_folder_is_used_and_named() {
    // From a subfolder of the checkout: ../specs/qwen2-tiny.yaml, said on stderr.
    let o = touchstone_in(&root().join("src/engine"), &["list"]);
    assert_eq!(o.code, 0, "{}", o.all());
    assert!(o.stderr.contains("using ../../specs/qwen2-tiny.yaml"), "{}", o.stderr);
    // From a folder with no specs/ above it: an error, not the compiled-in spec.
    let d = tempfile::tempdir().unwrap();
    let o = touchstone_in(d.path(), &["run"]);
    assert_eq!(o.code, 2, "{}", o.all());
    assert!(o.stderr.contains("no SPEC given and no specs/ folder"), "{}", o.stderr);
    // A user's own specs/ without touchstone's default: every spec in it.
    std::fs::create_dir(d.path().join("specs")).unwrap();
    std::fs::write(d.path().join("specs/mine.yaml"), spec_text(&model_dir(), &hf_golden())).unwrap();
    let o = touchstone_in(d.path(), &["list"]);
    assert_eq!(o.code, 0, "{}", o.all());
    assert!(o.stderr.contains("using specs/mine.yaml"), "{}", o.stderr);
}

#[test]
fn a_folder_of_specs_runs_them_all_and_one_bad_spec_does_not_stop_the_others() {
    let d = tempfile::tempdir().unwrap();
    let good = hf_only_spec_text(&model_dir(), &hf_golden());
    std::fs::write(d.path().join("a-good.yaml"), &good).unwrap();
    std::fs::write(d.path().join("b-bad.yaml"), good.replace("seed:", "sede:")).unwrap();
    let o = touchstone(&[
        "run",
        &d.path().display().to_string(),
        "--only",
        "prefill/embed::golden:hf",
    ]);
    assert_eq!(o.code, 2, "{}", o.all());
    assert!(o.stdout.contains("== a-good on engine cpu"), "{}", o.stdout);
    assert!(o.stderr.contains("1 of 2 specs could not run"), "{}", o.stderr);
    assert!(
        o.stderr.contains("b-bad.yaml") && o.stderr.contains("unknown field `sede`"),
        "{}",
        o.stderr
    );
}
