//! `weights`: the "meta tensor" hunt of every new engine, made a check. Every
//! tensor the engine holds must be finite, not all zeros, and equal — by
//! sha256 of its f32 values after rounding to the storage dtype — to what the
//! model file says; and every tensor of the file must be held by the engine
//! (used by some layer). A tensor all zeros in the file itself fails too (a
//! broken export writes meta tensors as zeros; no trained weight matrix or
//! norm is zero), except a 1-D `*.bias`, which a model may legitimately
//! zero: that is reported as a warning in the passing message.
//!
//! The file is read independently of `model::load` (the engine's loader), by
//! `model::file_tensors` (as the recompute checks read it): safetensors
//! tensors as stored, GGUF tensors dequantised and renamed one at a time
//! (Llama's Q/K rows un-permuted as llama.cpp's converter permuted them),
//! fused Phi-3 projections mapped onto their pieces. A bug in the engine's
//! loading — a tensor left zeroed, two layers swapped, a tensor never mapped —
//! therefore shows as a difference named by tensor. An engine that does not
//! show its weights (`Engine::visit_weights`' default) lacks that capability:
//! the check is not applicable to it, with the reason.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

use serde::de::{self, Deserialize, Deserializer};
use sha2::{Digest, Sha256};

use crate::checks::facts::Facts;
use crate::checks::kind::{Kind, RuleEnv, RunCheck, RunRule};
use crate::checks::verdict::Verdict;
use crate::engine::Engine;
use crate::model::file_tensors::FileTensors;
use crate::model::ModelConfig;
use crate::tensor::DType;

/// `weights` takes no parameters: written bare, `{weights: null}` or `{weights: {}}`.
#[derive(Clone, Debug, PartialEq)]
pub struct Weights;

impl Kind for Weights {
    const NAME: &'static str = "weights";
    const PARAMS: &'static str = "none";
    const ABOUT: &'static str = "every tensor the engine holds is finite, not all zeros, and equal to the model file's; every tensor of the file is used";
    fn bare() -> Self {
        Weights
    }
    fn parse<'de, D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        match Option::<BTreeMap<String, serde_yaml::Value>>::deserialize(d)? {
            Some(m) if !m.is_empty() => Err(de::Error::custom(format!(
                "weights takes no parameters, got: {}",
                m.keys().cloned().collect::<Vec<_>>().join(", ")
            ))),
            _ => Ok(Weights),
        }
    }
}

impl RunRule for Weights {
    fn kind(&self) -> &'static str {
        Self::NAME
    }
    fn expand(&self, _: &RuleEnv) -> Arc<dyn RunCheck> {
        Arc::new(Weights)
    }
}

impl RunCheck for Weights {
    fn id(&self) -> String {
        Self::NAME.into()
    }
    fn evaluate(&self, facts: &Facts, engine: &dyn Engine) -> Verdict {
        check(facts.model, facts.storage, engine)
    }
}

/// What is known of one tensor: shape, hash, whether it is all zeros.
#[derive(Clone, Debug, PartialEq)]
struct Digested {
    shape: Vec<usize>,
    sha256: [u8; 32],
    all_zero: bool,
}

fn digest(shape: &[usize], values: &[f32], storage: DType) -> Digested {
    let mut h = Sha256::new();
    let mut buf = Vec::with_capacity(values.len().min(1 << 16) * 4);
    let mut all_zero = true;
    for chunk in values.chunks(1 << 16) {
        buf.clear();
        for &v in chunk {
            let v = storage.round(v);
            all_zero &= v == 0.0;
            buf.extend_from_slice(&v.to_le_bytes());
        }
        h.update(&buf);
    }
    Digested {
        shape: shape.to_vec(),
        sha256: h.finalize().into(),
        all_zero,
    }
}

/// A tensor that may be all zeros in a correct model: a 1-D bias (some
/// exports zero the biases a model was trained without).
fn may_be_zero(name: &str, shape: &[usize]) -> bool {
    shape.len() == 1 && name.ends_with(".bias")
}

/// Buffers HF checkpoints carry that are not parameters (HF recomputes them).
fn is_buffer(name: &str) -> bool {
    name.ends_with("rotary_emb.inv_freq") || name.ends_with("_cached")
}

/// The file's tensors under the names an engine holds them by (HF names,
/// fused projections as their pieces), digested one at a time: read through
/// `FileTensors`, the loader-independent reader the recompute checks use,
/// without keeping any.
fn file_digests(model: &Path, cfg: &ModelConfig, storage: DType) -> Result<BTreeMap<String, Digested>, String> {
    let file = FileTensors::new(model, cfg);
    let mut out = BTreeMap::new();
    for name in file.names()?.into_iter().filter(|n| !is_buffer(n)) {
        let t = file.read(&name)?;
        out.insert(name, digest(t.shape(), t.data(), storage));
    }
    Ok(out)
}

/// Runs the check for `engine`, which loaded `model` with `storage`.
pub fn check(model: &Path, storage: DType, engine: &dyn Engine) -> Verdict {
    let cfg = engine.config().clone();
    let mut held: BTreeMap<String, Digested> = BTreeMap::new();
    let mut non_finite: Vec<String> = Vec::new();
    let visited = engine.visit_weights(&mut |name, shape, values| {
        if let Some(i) = values.iter().position(|v| !v.is_finite()) {
            non_finite.push(format!("`{name}` holds {} at flat index {i}", values[i]));
        }
        held.insert(name.to_string(), digest(shape, values, storage));
    });
    match visited {
        Ok(()) => {}
        // The trait's default: the engine does not show its weights (a
        // protocol engine, dumps, HF transformers or llama.cpp under test).
        // A capability it lacks, as a stage it cannot tap: not applicable.
        Err(crate::Error::Usage(why)) => return Verdict::not_applicable(format!("not applicable: {why}")),
        Err(e) => return Verdict::skip(e.to_string()),
    }
    let file = match file_digests(model, &cfg, storage) {
        Ok(f) => f,
        Err(e) => return Verdict::fail(format!("cannot read the model file to compare with: {e}")),
    };

    let mut problems: Vec<String> = non_finite;
    let mut warnings: Vec<String> = Vec::new();
    for (name, h) in &held {
        match file.get(name) {
            None => problems.push(format!(
                "`{name}` is held by the engine but the model file has no such tensor"
            )),
            Some(f) if f.shape != h.shape => problems.push(format!(
                "`{name}` has shape {:?} in the engine, {:?} in the file",
                h.shape, f.shape
            )),
            Some(f) if h.all_zero && !f.all_zero => problems.push(format!(
                "`{name}` is all zeros in the engine but not in the file (left unfilled?)"
            )),
            Some(f) if f.all_zero && h.all_zero && may_be_zero(name, &f.shape) => {
                warnings.push(format!("`{name}` is all zeros (in the file too)"))
            }
            Some(f) if f.all_zero => problems.push(format!(
                "`{name}` (shape {:?}) is all zeros in the model file itself: a broken export or an \
                 unmaterialised (meta) tensor, no trained weight is zero",
                f.shape
            )),
            Some(f) if f.sha256 != h.sha256 => {
                let twin = file
                    .iter()
                    .find(|(n, d)| *n != name && d.sha256 == h.sha256)
                    .map(|(n, _)| format!(": it holds the values of `{n}` (swapped or mis-mapped?)"))
                    .unwrap_or_default();
                problems.push(format!("`{name}` differs from the file (sha256 of its values){twin}"))
            }
            Some(_) => {}
        }
    }
    let tied_head = |n: &str| n == "lm_head.weight" && cfg.tie_embeddings;
    for (name, f) in &file {
        if held.contains_key(name) {
            continue;
        }
        if tied_head(name) {
            // HF ties the head to the embeddings and ignores a stored copy; it
            // is "used" only if it is that copy.
            match held.get("model.embed_tokens.weight") {
                Some(e) if e.sha256 == f.sha256 => continue,
                _ => {
                    problems.push(
                        "`lm_head.weight` is in the file but the config ties the head to the embeddings and the \
                         two differ: the engine ignores a head the file provides"
                            .into(),
                    );
                    continue;
                }
            }
        }
        problems.push(format!(
            "`{name}` (shape {:?}) is in the model file but the engine holds no such tensor: no layer uses it \
             (never mapped?)",
            f.shape
        ));
    }
    let n = held.len();
    if problems.is_empty() {
        let warned = if warnings.is_empty() {
            String::new()
        } else {
            format!("; warning: {}", warnings.join("; "))
        };
        Verdict::pass(format!(
            "{n} tensors held by the engine are finite, non-zero and equal to the model file (sha256 of their \
             values at {storage} storage); all {} tensors of the file are used{warned}",
            file.len()
        ))
        .metric("tensors", n as f64)
        .metric("warnings", warnings.len() as f64)
    } else {
        let shown = problems.iter().take(12).cloned().collect::<Vec<_>>().join("\n    ");
        let more = if problems.len() > 12 {
            format!("\n    ... and {} more", problems.len() - 12)
        } else {
            String::new()
        };
        Verdict::fail(format!(
            "{} problem(s) with the weights the engine holds ({} tensors) against {}:\n    {shown}{more}",
            problems.len(),
            n,
            model.display()
        ))
        .metric("problems", problems.len() as f64)
        .metric("tensors", n as f64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::cpu::CpuEngine;
    use crate::model::{LoadOptions, LoaderBug};
    use std::path::PathBuf;

    fn model(rel: &str) -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join(rel)
    }

    fn run(rel: &str, opts: LoadOptions) -> Verdict {
        let m = model(rel);
        let eng = CpuEngine::load_with(&m, &opts).unwrap();
        check(&m, opts.storage, &eng)
    }

    #[test]
    fn passes_on_every_shipped_model_and_format() {
        for rel in [
            "goldens/qwen2-tiny/model",
            "goldens/qwen2-tiny/model.gguf",
            "goldens/llama-tiny/model",
            "goldens/llama-tiny/model.gguf",
            "goldens/qwen3-tiny/model",
            "goldens/qwen3-tiny/model.gguf",
            "goldens/phi3-tiny/model",
            "goldens/phi3-tiny/model.gguf",
        ] {
            for storage in [DType::F32, DType::BF16] {
                let v = run(
                    rel,
                    LoadOptions {
                        storage,
                        ..Default::default()
                    },
                );
                assert!(v.passed(), "{rel} at {storage}: {}", v.message);
            }
        }
    }

    #[test]
    fn each_planted_loader_bug_fails_naming_the_tensor() {
        let q0 = "model.layers.0.self_attn.q_proj.weight";
        let q1 = "model.layers.1.self_attn.q_proj.weight";
        for rel in ["goldens/qwen2-tiny/model", "goldens/qwen2-tiny/model.gguf"] {
            for (bug, names, why) in [
                (
                    LoaderBug::Zero("model.layers.1.mlp.down_proj.weight".into()),
                    vec!["model.layers.1.mlp.down_proj.weight"],
                    "all zeros",
                ),
                (
                    LoaderBug::Swap(q0.into(), q1.into()),
                    vec![q0, q1],
                    "holds the values of",
                ),
                (
                    LoaderBug::Unmapped("model.layers.0.self_attn.k_proj.bias".into()),
                    vec!["model.layers.0.self_attn.k_proj.bias"],
                    "never mapped",
                ),
            ] {
                let v = run(
                    rel,
                    LoadOptions {
                        plant: Some(bug.clone()),
                        ..Default::default()
                    },
                );
                assert!(v.failed(), "{rel} {bug:?} passed: {}", v.message);
                for n in names {
                    assert!(v.message.contains(&format!("`{n}`")), "{rel} {bug:?}: {}", v.message);
                }
                assert!(v.message.contains(why), "{rel} {bug:?}: {}", v.message);
            }
        }
    }

    /// A copy of the tiny model whose file holds `name` as all zeros (a
    /// broken export), loaded faithfully by the CPU engine: both agree, and
    /// the check must still fail (or, for a 1-D bias, warn).
    fn zeroed_in_the_file(name: &str) -> Verdict {
        let src = model("goldens/qwen2-tiny/model");
        let d = tempfile::tempdir().unwrap();
        for e in std::fs::read_dir(&src).unwrap() {
            let e = e.unwrap();
            std::fs::copy(e.path(), d.path().join(e.file_name())).unwrap();
        }
        let file = d.path().join("model.safetensors");
        let mut f = crate::tensor::io::read_safetensors(&file).unwrap();
        f.floats.get_mut(name).expect("the tensor exists").data_mut().fill(0.0);
        crate::tensor::io::write_safetensors(&file, &f.floats, &f.ints, &f.metadata).unwrap();
        let eng = CpuEngine::load(d.path()).unwrap();
        check(d.path(), DType::F32, &eng)
    }

    #[test]
    fn a_tensor_all_zeros_in_the_file_itself_fails_naming_it() {
        let name = "model.layers.1.mlp.up_proj.weight";
        let v = zeroed_in_the_file(name);
        assert!(v.failed(), "{}", v.message);
        assert!(
            v.message.contains(&format!("`{name}`")) && v.message.contains("all zeros in the model file itself"),
            "{}",
            v.message
        );
        // A norm weight is no bias: zeros there are broken too.
        let v = zeroed_in_the_file("model.layers.0.input_layernorm.weight");
        assert!(v.failed(), "{}", v.message);
    }

    #[test]
    fn a_bias_all_zeros_in_the_file_passes_with_a_warning() {
        let name = "model.layers.0.self_attn.k_proj.bias";
        let v = zeroed_in_the_file(name);
        assert!(v.passed(), "{}", v.message);
        assert!(v.message.contains(&format!("warning: `{name}` is all zeros")), "{}", v.message);
        assert_eq!(v.metrics["warnings"], 1.0);
    }

    #[test]
    fn an_engine_that_hides_its_weights_is_not_applicable_with_the_reason() {
        struct Opaque(CpuEngine);
        impl Engine for Opaque {
            fn name(&self) -> &str {
                "opaque"
            }
            fn config(&self) -> &ModelConfig {
                self.0.config()
            }
            fn run(
                &self,
                r: &crate::engine::RunRequest,
                t: &crate::engine::TapSet,
            ) -> crate::error::Result<crate::engine::RunOutput> {
                self.0.run(r, t)
            }
        }
        let m = model("goldens/qwen2-tiny/model");
        let v = check(&m, DType::F32, &Opaque(CpuEngine::load(&m).unwrap()));
        assert_eq!(v.status, crate::checks::verdict::Status::NotApplicable);
        assert!(v.message.contains("does not expose"), "{}", v.message);
    }
}
