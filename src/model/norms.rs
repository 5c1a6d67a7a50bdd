//! The model file's norm weights (its 1-D `*norm.weight` tensors), under HF
//! names, for the checks that recompute a norm from an engine's own captures
//! (`checks::stage::rms_norm`). Read from the file independently of the
//! engines' loader, as the `weights` check reads it: a norm weight an engine
//! lost or mis-mapped must show as the engine's error, not be copied into the
//! recompute. Read once, on first use, and only those tensors (a few KB even
//! for a large model), so a plan that never asks pays nothing.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use crate::error::{Error, Result};
use crate::gguf::GgufFile;

/// The norm weights of one model file, read lazily.
#[derive(Debug)]
pub struct NormWeights {
    model: PathBuf,
    read: OnceLock<std::result::Result<BTreeMap<String, Vec<f32>>, String>>,
}

impl NormWeights {
    pub fn new(model: &Path) -> NormWeights {
        NormWeights {
            model: model.to_path_buf(),
            read: OnceLock::new(),
        }
    }

    /// The weight `name` (HF name, e.g. `model.layers.3.input_layernorm.weight`),
    /// or why it cannot be had (the file unreadable, or without that tensor).
    pub fn get(&self, name: &str) -> std::result::Result<&[f32], String> {
        let all = self
            .read
            .get_or_init(|| read(&self.model).map_err(|e| e.to_string()))
            .as_ref()
            .map_err(|e| format!("cannot read the model's norm weights: {e}"))?;
        all.get(name).map(Vec::as_slice).ok_or_else(|| {
            format!(
                "the model file {} has no norm weight `{name}` ({} norm weights found)",
                self.model.display(),
                all.len()
            )
        })
    }
}

/// Whether a tensor name is a norm weight's, in HF or GGUF naming.
fn is_norm(name: &str) -> bool {
    name.ends_with("norm.weight")
}

fn read(model: &Path) -> Result<BTreeMap<String, Vec<f32>>> {
    let mut out = BTreeMap::new();
    if model.is_dir() {
        let mut files: Vec<PathBuf> = std::fs::read_dir(model)
            .map_err(|e| Error::io(model, e))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|e| e == "safetensors"))
            .collect();
        files.sort();
        for f in files {
            let tf = crate::tensor::io::read_safetensors(&f)?;
            for (name, t) in tf.floats {
                if is_norm(&name) && t.shape().len() == 1 {
                    out.insert(name, t.data().to_vec());
                }
            }
        }
    } else {
        let f = GgufFile::open(model)?;
        for info in f.tensors.iter().filter(|i| is_norm(&i.name)) {
            let t = f.read_tensor(info)?;
            let name = super::gguf::hf_name(&info.name).unwrap_or_else(|| info.name.clone());
            out.insert(name, t.data().to_vec());
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_norms_of_a_model_folder_and_names_a_missing_one() {
        let model = Path::new(env!("CARGO_MANIFEST_DIR")).join("goldens/qwen2-tiny/model");
        let n = NormWeights::new(&model);
        let cfg = crate::model::read_config(&model).unwrap();
        assert_eq!(n.get("model.norm.weight").unwrap().len(), cfg.hidden);
        assert_eq!(n.get("model.layers.1.post_attention_layernorm.weight").unwrap().len(), cfg.hidden);
        let e = n.get("model.layers.99.input_layernorm.weight").unwrap_err();
        assert!(e.contains("no norm weight `model.layers.99.input_layernorm.weight`"), "{e}");
    }

    #[test]
    fn an_unreadable_model_is_an_error_not_a_panic() {
        let e = NormWeights::new(Path::new("/nonexistent/model.gguf")).get("model.norm.weight").unwrap_err();
        assert!(e.starts_with("cannot read the model's norm weights"), "{e}");
    }
}
