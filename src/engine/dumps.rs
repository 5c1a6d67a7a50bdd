//! `--engine dumps:PATH`: tensors some other program already wrote, for
//! engines that cannot be driven. PATH is one safetensors run file (see
//! `output`), or a folder holding one, or a folder of `.npy` files named
//! `<step>/<name>.npy` plus `tokens.npy`. Names are canonical or mapped by the
//! spec's `names:`. Every run request is answered with the same tensors, so
//! checks that need another run (determinism, kv_cache) are skipped with that
//! reason (`Engine::reruns`).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use super::names::NameMap;
use super::output::read_run;
use super::{Engine, RunOutput, RunRequest, TapSet};
use crate::error::{Error, Result};
use crate::model::ModelConfig;
use crate::tensor::io::TensorFile;

const NAME: &str = "dumps";

pub struct DumpsEngine {
    config: ModelConfig,
    storage: crate::tensor::DType,
    names: NameMap,
    file: TensorFile,
}

impl DumpsEngine {
    /// `storage` is the dtype the dumping run used (the spec's, or `--storage`).
    pub fn open(path: &Path, model: &Path, storage: crate::tensor::DType, names: &NameMap) -> Result<DumpsEngine> {
        let config = crate::model::read_config(model)?;
        let file = read_dumps(path)?;
        Ok(DumpsEngine {
            config,
            storage,
            names: names.clone(),
            file,
        })
    }
}

/// One tensor file from a run file, a folder holding one, or a folder of
/// `<step>/<name>.npy` files (every float tensor keyed `<step>/<name>`).
fn read_dumps(path: &Path) -> Result<TensorFile> {
    let fail = |msg: String| Error::engine(NAME, format!("{}: {msg}", path.display()));
    if path.is_file() {
        return crate::tensor::io::read_safetensors(path);
    }
    if !path.is_dir() {
        return Err(fail("no such file or folder".into()));
    }
    let entries = |dir: &Path| -> Result<Vec<PathBuf>> {
        let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
            .map_err(|e| Error::io(dir, e))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .collect();
        v.sort();
        Ok(v)
    };
    let top = entries(path)?;
    let st: Vec<&PathBuf> = top
        .iter()
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .collect();
    match st.as_slice() {
        [one] => return crate::tensor::io::read_safetensors(one),
        [] => {}
        many => {
            return Err(fail(format!(
                "{} safetensors files; give the one to check: {}",
                many.len(),
                many.iter()
                    .map(|p| p.display().to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            )))
        }
    }
    let mut out = TensorFile {
        path: path.to_path_buf(),
        ..Default::default()
    };
    let mut floats = BTreeMap::new();
    for step_dir in top.iter().filter(|p| p.is_dir()) {
        let step = step_dir
            .file_name()
            .and_then(|s| s.to_str())
            .unwrap_or_default()
            .to_string();
        for f in entries(step_dir)?
            .into_iter()
            .filter(|p| p.extension().is_some_and(|x| x == "npy"))
        {
            let name = f.file_stem().and_then(|s| s.to_str()).unwrap_or_default().to_string();
            let t = crate::tensor::io::read_npy(&f)?;
            let (_, tensor) = t
                .floats
                .into_iter()
                .next()
                .ok_or_else(|| fail(format!("{}: not a float array", f.display())))?;
            floats.insert(format!("{step}/{name}"), tensor);
        }
    }
    let tokens = path.join("tokens.npy");
    if tokens.is_file() {
        let t = crate::tensor::io::read_npy(&tokens)?;
        if let Some((_, v)) = t.ints.into_iter().next() {
            out.ints.insert("tokens".into(), v);
        } else if let Some((_, f)) = t.floats.into_iter().next() {
            return Err(fail(format!(
                "tokens.npy holds {:?} floats; the tokens must be an integer array",
                f.shape()
            )));
        }
    }
    if floats.is_empty() {
        return Err(fail(
            "neither a safetensors file nor `<step>/<name>.npy` files (e.g. prefill/blk.0.q.npy)".into(),
        ));
    }
    out.floats = floats;
    Ok(out)
}

impl Engine for DumpsEngine {
    fn name(&self) -> &str {
        NAME
    }
    /// What the dumps hold (at any step) is what they can tap. Dumps with a
    /// tensor touchstone cannot name claim every stage instead, so a stage
    /// missing there is reported with the names to map (`names:`).
    fn capabilities(&self) -> super::capabilities::Capabilities {
        let mut held = std::collections::BTreeSet::new();
        for key in self.file.floats.keys() {
            let name = key.split_once('/').map_or(key.as_str(), |(_, n)| n);
            match self.names.resolve(name) {
                Some((stage, _)) => {
                    held.insert(stage);
                }
                None => return super::capabilities::Capabilities::all(),
            }
        }
        let taps = held
            .iter()
            .filter_map(|s| crate::stage::pattern::StagePattern::parse(&s.to_string()).ok())
            .collect();
        super::capabilities::Capabilities {
            taps: Some(taps),
            cannot_tap: Vec::new(),
            why: Some("the dumps hold no tensor for it at any step".into()),
            no_images: None,
            serving: None,
        }
    }
    fn config(&self) -> &ModelConfig {
        &self.config
    }
    fn run(&self, req: &RunRequest, _taps: &TapSet) -> Result<RunOutput> {
        let read = read_run(&self.file, &self.names, &self.config, req, NAME)?;
        let mut out = read.output;
        out.unmapped = read.unmapped;
        super::exec::tag_storage(&mut out, self.storage);
        Ok(out)
    }
    fn reruns(&self) -> Option<String> {
        Some("dumps are one recorded run: a check that needs another run of the engine cannot be made".into())
    }
}
