//! Loading an HF model folder's weights: every `*.safetensors` file in the folder
//! (one file or shards), f32/f16/bf16 all widened to f32. The engines compute in
//! f32; the storage dtype stays on each tensor.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use crate::error::{Error, Result};
use crate::tensor::io::read_safetensors;
use crate::tensor::Tensor;

#[derive(Debug)]
pub struct Weights {
    /// The folder the weights were read from, for error messages.
    pub dir: PathBuf,
    tensors: BTreeMap<String, Tensor>,
}

impl Weights {
    pub fn from_hf_dir(dir: &Path) -> Result<Weights> {
        let rd = std::fs::read_dir(dir).map_err(|e| Error::io(dir, e))?;
        let mut files: Vec<PathBuf> = rd
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|e| e == "safetensors"))
            .collect();
        files.sort();
        if files.is_empty() {
            return Err(Error::model(dir, "no *.safetensors weight files in the model folder"));
        }
        let mut tensors = BTreeMap::new();
        for f in files {
            let tf = read_safetensors(&f)?;
            if let Some(k) = tf.ints.keys().next() {
                return Err(Error::model(&f, format!("weight `{k}` has an integer dtype")));
            }
            for (name, t) in tf.floats {
                if tensors.insert(name.clone(), t).is_some() {
                    return Err(Error::model(
                        &f,
                        format!("weight `{name}` appears in more than one file"),
                    ));
                }
            }
        }
        Ok(Weights {
            dir: dir.to_path_buf(),
            tensors,
        })
    }

    pub fn from_map(dir: PathBuf, tensors: BTreeMap<String, Tensor>) -> Weights {
        Weights { dir, tensors }
    }

    /// Replaces the tensors by `f` of them (an MoE checkpoint's experts in
    /// the per-expert layout: `moe_layout::canonicalise`); its error names
    /// the folder.
    pub fn remap(
        &mut self,
        f: impl FnOnce(BTreeMap<String, Tensor>) -> std::result::Result<BTreeMap<String, Tensor>, String>,
    ) -> Result<()> {
        self.tensors = f(std::mem::take(&mut self.tensors)).map_err(|m| Error::model(&self.dir, m))?;
        Ok(())
    }

    /// Renames every tensor by `f` (a VLM's names into the one layout the
    /// engines read: `vision::canonical_name`).
    pub fn rename(&mut self, f: impl Fn(&str) -> String) {
        self.tensors = std::mem::take(&mut self.tensors)
            .into_iter()
            .map(|(k, v)| (f(&k), v))
            .collect();
    }

    /// Adds (or replaces) a tensor: loaders that reshape the file's tensors
    /// (fused projections split, GGUF renames) put the pieces back here.
    pub fn insert(&mut self, name: String, t: Tensor) {
        self.tensors.insert(name, t);
    }

    /// Takes a tensor out whatever its shape (`None` when absent).
    pub fn remove(&mut self, name: &str) -> Option<Tensor> {
        self.tensors.remove(name)
    }

    /// Every name held, sorted.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.tensors.keys().map(String::as_str)
    }

    pub fn contains(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    /// Takes a tensor out, checking its shape. A missing tensor or a wrong shape
    /// is an error naming the folder and the tensor.
    pub fn take(&mut self, name: &str, shape: &[usize]) -> Result<Tensor> {
        let t = self
            .tensors
            .remove(name)
            .ok_or_else(|| Error::model(&self.dir, format!("missing weight `{name}`")))?;
        if t.shape() != shape {
            return Err(Error::model(
                &self.dir,
                format!("weight `{name}` has shape {:?}, expected {shape:?}", t.shape()),
            ));
        }
        Ok(t)
    }

    /// Like `take`, but a missing tensor is `None` (optional biases, tied heads).
    pub fn take_opt(&mut self, name: &str, shape: &[usize]) -> Result<Option<Tensor>> {
        if self.contains(name) {
            self.take(name, shape).map(Some)
        } else {
            Ok(None)
        }
    }

    /// Names left after an engine took what it needs (unused weights are reported,
    /// since an unexpected tensor often means a mis-detected architecture).
    pub fn remaining(&self) -> impl Iterator<Item = &str> {
        self.tensors.keys().map(String::as_str)
    }
}
