//! Spec parsing on inline texts: every key, and every error located at its
//! line:col with the message a user acts on.

use super::*;
use crate::stage::{BlockStage, Stage};

const GOOD: &str = r#"
model: ../goldens/qwen2-tiny/model
goldens:
  hf: ../goldens/qwen2-tiny/hf.safetensors
prompt: {golden: hf}
seed: 7
tolerance:
  f32: {atol: 1.0e-5, rtol: 1.3e-6}
stages:
  "*": [finite, shape, {golden: hf}]
  "blk.*.attn_probs": [{softmax_rows: {tol: 1.0e-6}}, causal]
  "blk.*.q_rope": [{rope: {input: "blk.{i}.q"}}]
run_checks:
  - determinism
  - {kv_cache: {atol: 1.0e-5}}
  - {greedy_tokens: hf}
"#;

fn parse(text: &str) -> Result<Spec> {
    Spec::parse(Path::new("specs/t.yaml"), text)
}

fn syntax_err(text: &str) -> (usize, usize, String) {
    match parse(text) {
        Err(Error::SpecSyntax { line, col, msg, .. }) => (line, col, msg),
        other => panic!("expected a located spec error, got {other:?}"),
    }
}

#[test]
fn parses_a_full_spec() {
    let s = parse(GOOD).unwrap();
    assert_eq!(s.name, "t");
    assert_eq!(s.model, Path::new("specs/../goldens/qwen2-tiny/model"));
    assert_eq!(s.stages.len(), 3);
    assert!(s.stages[1].0.matches(Stage::Block(1, BlockStage::AttnProbs)));
    assert_eq!(format!("{:?}", s.stages[1].1[0]), "Check(SoftmaxRows { tol: 1e-6 })");
    assert_eq!(s.run_checks.len(), 3);
    assert_eq!(s.tolerance[&DType::F32].rtol, 1.3e-6);
}

#[test]
fn malformed_yaml_is_located() {
    let (line, _, msg) = syntax_err("model: [x\nprompt: {}\n");
    assert!(line >= 1, "{msg}");
}

#[test]
fn unknown_key_is_located_and_named() {
    let (line, col, msg) = syntax_err(&GOOD.replace("seed: 7", "sede: 7"));
    assert_eq!((line, col), (6, 1));
    assert!(msg.contains("unknown field `sede`"), "{msg}");
}

#[test]
fn unknown_stage_gets_a_suggestion() {
    let (line, _, msg) = syntax_err(&GOOD.replace("\"blk.*.attn_probs\"", "\"blk.*.attn_prob\""));
    assert_eq!(line, 11);
    assert!(msg.contains("did you mean `blk.*.attn_probs`"), "{msg}");
}

#[test]
fn unknown_check_gets_a_suggestion() {
    let (line, _, msg) = syntax_err(&GOOD.replace("causal]", "casual]"));
    assert_eq!(line, 11);
    assert!(msg.contains("did you mean `causal`"), "{msg}");
    let (_, _, msg) = syntax_err(&GOOD.replace("- determinism", "- determinsm"));
    assert!(msg.contains("did you mean `determinism`"), "{msg}");
}

#[test]
fn bad_parameters_are_located() {
    let (line, _, msg) = syntax_err(&GOOD.replace("{tol: 1.0e-6}", "{toll: 1.0e-6}"));
    assert_eq!(line, 11);
    assert!(msg.contains("unknown field `toll`"), "{msg}");
    let (_, _, msg) = syntax_err(&GOOD.replace("\"blk.{i}.q\"", "\"blk.{i}.qq\""));
    assert!(msg.contains("not a stage name"), "{msg}");
}

#[test]
fn undeclared_golden_source_is_an_error() {
    let (line, _, msg) = syntax_err(&GOOD.replace("{greedy_tokens: hf}", "{greedy_tokens: hff}"));
    assert_eq!(line, 16);
    assert!(msg.contains("did you mean `hf`"), "{msg}");
}

#[test]
fn prompt_needs_tokens_or_golden() {
    let (_, _, msg) = syntax_err(&GOOD.replace("prompt: {golden: hf}", "prompt: {decode_steps: 2}"));
    assert!(msg.contains("tokens"), "{msg}");
}

#[test]
fn determinism_requires_three_runs_and_temperature() {
    let (_, _, msg) = syntax_err(&GOOD.replace("- determinism", "- {determinism: {runs: 2}}"));
    assert!(msg.contains("runs >= 3"), "{msg}");
    let (_, _, msg) = syntax_err(&GOOD.replace("- determinism", "- {determinism: {sampling: greedy}}"));
    assert!(msg.contains("temperature > 0"), "{msg}");
}

#[test]
fn storage_defaults_to_f32_and_parses_each_dtype() {
    assert_eq!(parse(GOOD).unwrap().storage, DType::F32);
    for (text, want) in [("f32", DType::F32), ("f16", DType::F16), ("bf16", DType::BF16)] {
        let s = parse(&GOOD.replace("seed: 7", &format!("seed: 7\nstorage: {text}"))).unwrap();
        assert_eq!(s.storage, want, "{text}");
    }
}

#[test]
fn unknown_storage_is_located_with_the_known_dtypes() {
    let (line, col, msg) = syntax_err(&GOOD.replace("seed: 7", "seed: 7\nstorage: fp8"));
    assert_eq!((line, col), (7, 10), "{msg}");
    assert!(msg.contains("unknown dtype `fp8` (known: f32, f16, bf16)"), "{msg}");
    // Not a scalar: still located.
    let (line, _, msg) = syntax_err(&GOOD.replace("seed: 7", "seed: 7\nstorage: [bf16]"));
    assert_eq!(line, 7, "{msg}");
}

/// Any spec error's message (located or not).
fn err_text(text: &str) -> String {
    match parse(text) {
        Err(e) => e.to_string(),
        Ok(_) => panic!("expected an error for:\n{text}"),
    }
}

#[test]
fn oracle_and_scaled_are_validated() {
    let with = |extra: &str| format!("{GOOD}{extra}");
    let s = parse(&with(
        "oracle: ../goldens/qwen2-tiny/oracle.safetensors\nscaled: {factor: 3}\n",
    ))
    .unwrap();
    assert_eq!(
        s.oracle.as_deref(),
        Some(Path::new("specs/../goldens/qwen2-tiny/oracle.safetensors"))
    );
    assert_eq!(
        (s.scaled.factor, s.scaled.floor),
        (3.0, crate::checks::scaled::DEFAULT_FLOOR)
    );
    assert!(err_text(&with("scaled: {factor: 3}\n")).contains("no `oracle:`"));
    assert!(err_text(&with("oracle: o.safetensors\nscaled: {factor: 0.5}\n")).contains("below 1"));
    assert!(
        err_text(&with("oracle: o.safetensors\nscaled: {arithmetic: {llama: q8_0}}\n"))
            .contains("not declared under `goldens:`")
    );
    assert!(err_text(&with("oracle: o.safetensors\nscaled: {arithmetic: {hf: q4}}\n")).contains("expected f32"));
    assert!(err_text(&with("oracle: o.safetensors\nscaled: {factr: 3}\n")).contains("unknown field"));
    let renamed = GOOD.replace("  hf: ../goldens/qwen2-tiny/hf.safetensors", "  hf: a\n  oracle: b");
    assert!(err_text(&renamed).contains("top-level `oracle:`"));
}

#[test]
fn engines_and_names_are_validated() {
    let with = |extra: &str| format!("{GOOD}{extra}");
    let s = parse(&with(
        "engines:\n  mine: {exec: [python3, e.py], timeout_s: 5}\nnames:\n  \"layers.{i}.q\": \"blk.{i}.q\"\n  \"final\": {stage: output_norm, reshape: true}\n",
    ))
    .unwrap();
    assert_eq!(s.engines["mine"].exec, ["python3", "e.py"]);
    assert_eq!(
        s.names.resolve("layers.3.q"),
        Some((Stage::Block(3, BlockStage::Q), false))
    );
    assert_eq!(s.names.resolve("final"), Some((Stage::OutputNorm, true)));
    assert!(err_text(&with("engines:\n  cpu: {exec: [x]}\n")).contains("built-in engine name"));
    assert!(err_text(&with("engines:\n  \"a b\": {exec: [x]}\n")).contains("use letters"));
    assert!(err_text(&with("engines:\n  e: {exec: []}\n")).contains("needs a command"));
    assert!(err_text(&with("engines:\n  e: {exec: [x], timeout_s: 0}\n")).contains("every request would time out"));
    assert!(err_text(&with("engines:\n  e: {exec: [x], timeout_s: -1}\n")).contains("finite number >= 0"));
    assert!(err_text(&with("engines:\n  e: {exec: [x], timout: 1}\n")).contains("unknown field"));
    assert!(err_text(&with("names:\n  \"layers.{i}.q\": \"blk.{i}.qq\"\n")).contains("not a stage name"));
    assert!(err_text(&with("names:\n  \"layers.{i}.q\": output_norm\n")).contains("on both sides"));
}
