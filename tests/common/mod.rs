//! Helpers shared by the integration tests: run the binary, make a scratch copy
//! of the default spec pointing at (possibly altered) goldens.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use touchstone::tensor::io::{read_safetensors, write_safetensors};
use touchstone::tensor::Tensor;

pub fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

pub fn model_dir() -> PathBuf {
    root().join("goldens/qwen2-tiny/model")
}

pub fn hf_golden() -> PathBuf {
    root().join("goldens/qwen2-tiny/hf.safetensors")
}

pub struct Output {
    pub code: i32,
    pub stdout: String,
    pub stderr: String,
}

impl Output {
    pub fn all(&self) -> String {
        format!("{}{}", self.stdout, self.stderr)
    }
}

/// Runs the touchstone binary; asserts it never panicked, whatever the input.
pub fn touchstone(args: &[&str]) -> Output {
    touchstone_env(args, &[])
}

/// The default spec's text with its model and HF golden replaced by absolute
/// paths, and every other relative path made absolute.
pub fn spec_text(model: &Path, golden: &Path) -> String {
    let text = std::fs::read_to_string(root().join("specs/qwen2-tiny.yaml")).unwrap();
    assert!(text.contains("../goldens/qwen2-tiny/model") && text.contains("../goldens/qwen2-tiny/hf.safetensors"));
    text.replace("../goldens/qwen2-tiny/model", &model.display().to_string())
        .replace("../goldens/qwen2-tiny/hf.safetensors", &golden.display().to_string())
        .replace("../goldens/", &format!("{}/goldens/", root().display()))
        .replace("../examples/", &format!("{}/examples/", root().display()))
}

/// Writes `text` as `name` in `dir` and returns its path.
pub fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    p
}

/// Copies the HF golden to `dst`, letting `edit` change float tensors by key.
pub fn altered_golden(dst: &Path, mut edit: impl FnMut(&mut BTreeMap<String, Tensor>)) {
    let f = read_safetensors(&hf_golden()).unwrap();
    let mut floats = f.floats;
    edit(&mut floats);
    write_safetensors(dst, &floats, &f.ints, &f.metadata).unwrap();
}

pub fn json(path: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

/// Runs the touchstone binary with extra environment variables.
pub fn touchstone_env(args: &[&str], envs: &[(&str, &str)]) -> Output {
    run_in(&root(), args, envs)
}

/// `touchstone ARGS` with `dir` as the working directory.
#[allow(dead_code)]
pub fn touchstone_in(dir: &Path, args: &[&str]) -> Output {
    run_in(dir, args, &[])
}

fn run_in(dir: &Path, args: &[&str], envs: &[(&str, &str)]) -> Output {
    let out = Command::new(env!("CARGO_BIN_EXE_touchstone"))
        .args(args)
        // CI (if the test suite itself runs on CI) is cleared unless a test sets it.
        .env_remove("CI")
        .envs(envs.iter().copied())
        .current_dir(dir)
        .output()
        .expect("the touchstone binary runs");
    let o = Output {
        code: out.status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    };
    assert!(!o.all().contains("panicked"), "touchstone panicked:\n{}", o.all());
    o
}

/// The default spec reduced to its HF golden: for a model file the llama.cpp
/// golden was not recorded from (that golden pins the sha256 of llama.cpp's own
/// GGUF, so any other file is rightly reported as a stale golden), and for tests
/// that write beside the goldens (no path in it may lead into the repository's).
pub fn hf_only_spec_text(model: &Path, golden: &Path) -> String {
    let text = spec_text(model, golden).replace(", {golden: llama.cpp}, references_agree", "");
    let kept: Vec<&str> = text
        .lines()
        .filter(|l| !l.contains("llama.cpp:") && !l.contains("greedy_tokens: llama.cpp") && !l.starts_with("oracle:"))
        .collect();
    let out = kept.join("\n") + "\n";
    assert!(!out.contains("{golden: llama.cpp}") && out.contains("{golden: hf}"));
    out
}

/// Multiplies by (1 + rel) every element of `t` whose multi-index `in_block` accepts.
pub fn perturb(t: &mut Tensor, rel: f32, in_block: &dyn Fn(&[usize]) -> bool) -> usize {
    let shape = t.shape().to_vec();
    let mut n = 0;
    for (flat, x) in t.data_mut().iter_mut().enumerate() {
        let mut idx = vec![0; shape.len()];
        let mut r = flat;
        for d in (0..shape.len()).rev() {
            idx[d] = r % shape[d];
            r /= shape[d];
        }
        if in_block(&idx) {
            *x *= 1.0 + rel;
            n += 1;
        }
    }
    n
}

/// (id, status) of every stage check of a JSON report, in report order.
pub fn stage_verdicts(j: &serde_json::Value) -> Vec<(String, String)> {
    j["checks"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|c| !c["id"].as_str().unwrap().starts_with("run::"))
        .map(|c| {
            (
                c["id"].as_str().unwrap().to_string(),
                c["status"].as_str().unwrap().to_string(),
            )
        })
        .collect()
}
