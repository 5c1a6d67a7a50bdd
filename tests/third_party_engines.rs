//! `--engine hf` and `--engine llama.cpp` (docs/third-party-engines.md): HF
//! transformers and llama.cpp under test, run by touchstone as a user would.
//! Both pass the tiny spec (llama.cpp on its GGUF, with flash attention's
//! stages not applicable and its f16 KV cache's kv_cache allowance), and a
//! planted change in each fails at its stage: a wrong attention scale patched
//! into HF at prefill/blk.0.attn_scores, a wrong RoPE base given to
//! llama.cpp's context at prefill/blk.0.q_rope. The real model's runs take
//! tens of seconds (llama.cpp) to over a minute (HF): they run where the model
//! is cached, HF's only with `--include-ignored`.
//!
//! They need the recorders' venv and libllama, which `touchstone goldens
//! regen` creates and the test command (ci/test.sh) does not install (torch
//! is gigabytes): where they are missing every trial is ignored with the
//! reason and the command that creates them, on CI too. Only the missing
//! environment's own error is checked everywhere.

mod common;
use common::*;

use libtest_mimic::{Arguments, Completion, Trial};
use std::path::Path;

fn main() {
    let args = Arguments::from_args();
    let real = touchstone::model::cache::model_path("qwen2.5-coder-0.5b-instruct-q4_k_m.gguf");
    let mut trials = vec![Trial::test("a_missing_environment_is_a_clear_error", || {
        a_missing_environment_is_a_clear_error();
        Ok(())
    })];
    type Case = (&'static str, Need, fn());
    let cases: [Case; 8] = [
        ("hf_passes_the_tiny_spec", Need::Hf, hf_passes_the_tiny_spec),
        (
            "llama_cpp_passes_the_tiny_spec_on_its_gguf",
            Need::LlamaCpp,
            llama_cpp_passes_the_tiny_spec_on_its_gguf,
        ),
        (
            "hf_with_a_wrong_attention_scale_diverges_at_attn_scores",
            Need::Hf,
            hf_planted,
        ),
        (
            "llama_cpp_with_a_wrong_rope_base_diverges_at_q_rope",
            Need::LlamaCpp,
            llama_cpp_planted,
        ),
        (
            "llama_cpp_refuses_an_hf_folder_naming_the_gguf",
            Need::LlamaCpp,
            llama_cpp_refuses_a_folder,
        ),
        (
            "real_model_llama_cpp_passes_and_its_planted_change_fails",
            Need::Real(false),
            real_llama_cpp,
        ),
        ("real_model_hf_passes", Need::Real(true), real_hf),
        ("real_model_hf_planted_change_fails", Need::Real(true), real_hf_planted),
    ];
    for (name, need, f) in cases {
        let missing = need.missing(&real);
        trials.push(match missing {
            Some(why) => Trial::ignorable_test(name, move || Ok(Completion::ignored_with(why.clone()))),
            None => Trial::test(name, move || {
                f();
                Ok(())
            })
            .with_ignored_flag(matches!(need, Need::Real(true))),
        });
    }
    libtest_mimic::run(&args, trials).exit();
}

/// What a trial needs besides the binary.
#[derive(Clone, Copy)]
enum Need {
    Hf,
    LlamaCpp,
    /// The real model and both engines' environment; true: slow (HF).
    Real(bool),
}

impl Need {
    /// Why it cannot run here (the error `--engine` itself gives), or None.
    fn missing(self, real: &Path) -> Option<String> {
        let spec = root().join("specs/qwen2-tiny.yaml");
        let names: &[&str] = match self {
            Need::Hf => &["hf"],
            Need::LlamaCpp => &["llama.cpp"],
            Need::Real(_) => &["hf", "llama.cpp"],
        };
        for n in names {
            if let Some(Err(e)) = touchstone::engine::third_party::ThirdParty::parse(n, &spec) {
                return Some(format!("{e} (ci/test.sh does not install it; ignored on CI too)"));
            }
        }
        if matches!(self, Need::Real(_)) && !real.is_file() {
            return Some(format!(
                "the real model {} is not cached (python3 ci/fetch_real_model.py)",
                real.display()
            ));
        }
        None
    }
}

fn spec(name: &str) -> String {
    root().join("specs").join(name).display().to_string()
}

fn tiny_gguf() -> String {
    root().join("goldens/qwen2-tiny/model.gguf").display().to_string()
}

/// Runs touchstone with a JSON report; (exit code, output, report).
fn run(args: &[&str]) -> (i32, String, serde_json::Value) {
    let d = tempfile::tempdir().unwrap();
    let j = d.path().join("r.json");
    let js = j.display().to_string();
    let mut all: Vec<&str> = args.to_vec();
    all.extend(["-q", "--json", &js]);
    let o = touchstone(&all);
    let r = if j.exists() { json(&j) } else { serde_json::Value::Null };
    (o.code, o.all(), r)
}

fn summary(r: &serde_json::Value, key: &str) -> u64 {
    r["summary"][key].as_u64().unwrap_or(0)
}

fn check_message<'a>(r: &'a serde_json::Value, id_part: &str) -> &'a str {
    r["checks"]
        .as_array()
        .and_then(|cs| {
            cs.iter()
                .find(|c| c["id"].as_str().is_some_and(|i| i.ends_with(id_part)))
        })
        .and_then(|c| c["message"].as_str())
        .unwrap_or_else(|| panic!("no check ending in {id_part}"))
}

fn first_divergence(r: &serde_json::Value) -> (String, String) {
    let fd = &r["runs"][0]["first_divergence"];
    (
        fd["step"].as_str().unwrap_or("").into(),
        fd["stage"].as_str().unwrap_or("").into(),
    )
}

fn hf_passes_the_tiny_spec() {
    let (code, out, r) = run(&["run", &spec("qwen2-tiny.yaml"), "--engine", "hf"]);
    assert_eq!(code, 0, "{out}");
    assert_eq!(r["runs"][0]["engine"], "hf", "{out}");
    // HF taps every stage: only `weights` is not applicable (the protocol
    // has no op to show them), and the serving checks (engine_hf.py runs one
    // sequence at a time and declares no batches).
    let na: Vec<&str> = r["checks"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|c| c["status"] == "not_applicable")
        .filter_map(|c| c["id"].as_str())
        .collect();
    let want: Vec<String> = std::iter::once("run::weights".to_string())
        .chain(touchstone::checks::run::SERVING.iter().map(|s| format!("run::{s}")))
        .collect();
    assert_eq!(na, want, "{out}");
    assert!(out.contains("is `hf-transformers`"), "{out}");
}

fn llama_cpp_passes_the_tiny_spec_on_its_gguf() {
    let (code, out, r) = run(&[
        "run",
        &spec("qwen2-tiny.yaml"),
        "--engine",
        "llama.cpp",
        "--model",
        &tiny_gguf(),
    ]);
    assert_eq!(code, 0, "{out}");
    // Flash attention: every attn_scores/attn_probs check is not applicable.
    assert!(summary(&r, "not_applicable") > 0, "{out}");
    let kv = check_message(&r, "run::kv_cache");
    assert!(kv.contains("kv: f16") && kv.contains("unit roundoff"), "{kv}");
    let tap = check_message(&r, "run::tap_invariance");
    assert!(tap.contains("unchanged"), "{tap}");
}

fn hf_planted() {
    let (code, out, r) = run(&["run", &spec("qwen2-tiny.yaml"), "--engine", "hf:--attn-scale 0.5"]);
    assert_eq!(code, 1, "{out}");
    assert_eq!(
        first_divergence(&r),
        ("prefill".into(), "blk.0.attn_scores".into()),
        "{out}"
    );
    assert!(out.contains("hf-transformers+attn-scale=0.5"), "{out}");
    // The rerun command names the engine with its argument.
    let rerun = r["checks"]
        .as_array()
        .and_then(|cs| cs.iter().find(|c| c["first_divergence"] == true))
        .and_then(|c| c["rerun"].as_str())
        .unwrap_or_default();
    assert!(rerun.contains("--engine 'hf:--attn-scale 0.5'"), "{rerun}");
}

fn llama_cpp_planted() {
    let (code, out, r) = run(&[
        "run",
        &spec("qwen2-tiny.yaml"),
        "--engine",
        "llama.cpp:--rope-freq-base 1000",
        "--model",
        &tiny_gguf(),
    ]);
    assert_eq!(code, 1, "{out}");
    assert_eq!(first_divergence(&r), ("prefill".into(), "blk.0.q_rope".into()), "{out}");
}

fn llama_cpp_refuses_a_folder() {
    let (code, out, r) = run(&["run", &spec("qwen2-tiny.yaml"), "--engine", "llama.cpp"]);
    assert_eq!(code, 1, "{out}");
    assert_eq!(summary(&r, "passed"), 0, "{out}");
    assert!(
        out.contains("llama.cpp runs .gguf files") && out.contains("model.gguf"),
        "{out}"
    );
}

fn a_missing_environment_is_a_clear_error() {
    let empty = tempfile::tempdir().unwrap();
    let cache = empty.path().display().to_string();
    for engine in ["hf", "llama.cpp", "hf:--attn-scale 0.5"] {
        let o = touchstone_env(
            &["run", &spec("qwen2-tiny.yaml"), "--engine", engine],
            &[("TOUCHSTONE_CACHE", &cache)],
        );
        assert_eq!(o.code, 2, "{engine}: {}", o.all());
        assert!(
            o.stderr.contains("recorders' Python environment") && o.stderr.contains("goldens regen"),
            "{engine}: {}",
            o.all()
        );
        assert!(!o.stderr.contains("panicked"), "{}", o.all());
    }
}

fn real_llama_cpp() {
    let (code, out, r) = run(&["run", &spec("qwen2.5-0.5b.yaml"), "--engine", "llama.cpp"]);
    assert_eq!(code, 0, "{out}");
    assert!(summary(&r, "not_applicable") > 0, "{out}");
    let (code, out, r) = run(&[
        "run",
        &spec("qwen2.5-0.5b.yaml"),
        "--engine",
        "llama.cpp:--rope-freq-base 10000",
    ]);
    assert_eq!(code, 1, "{out}");
    assert_eq!(first_divergence(&r), ("prefill".into(), "blk.0.q_rope".into()), "{out}");
}

fn real_hf() {
    let (code, out, _) = run(&["run", &spec("qwen2.5-0.5b.yaml"), "--engine", "hf"]);
    assert_eq!(code, 0, "{out}");
}

fn real_hf_planted() {
    let (code, out, r) = run(&["run", &spec("qwen2.5-0.5b.yaml"), "--engine", "hf:--attn-scale 0.0625"]);
    assert_eq!(code, 1, "{out}");
    assert_eq!(
        first_divergence(&r),
        ("prefill".into(), "blk.0.attn_scores".into()),
        "{out}"
    );
}
