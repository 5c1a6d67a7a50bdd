//! Model description and weights, independent of any engine, and the one entry
//! point for reading a model: an HF folder (`config.json` + `*.safetensors`) or
//! a `.gguf` file.
pub mod cache;
pub mod config;
pub mod features;
pub mod file_tensors;
pub mod fused;
pub mod gemma;
pub mod gguf;
pub mod llava;
pub mod mla;
pub mod moe;
pub mod moe_layout;
pub mod rope_scaling;
mod sliding;
pub mod vision;
pub mod weights;

use std::path::Path;

pub use config::ModelConfig;
pub use vision::{ImageDims, ImageGrid, VisionConfig};
pub use weights::Weights;

use crate::error::{Error, Result};
use crate::gguf::GgufFile;

/// How a model is loaded.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct LoadOptions {
    /// Test aid: keep llama.cpp's Q/K row permutation of Llama GGUF weights
    /// instead of undoing it, so the engine computes the wrong model and a spec
    /// shows where (the first divergence is `blk.0.q`). Never set it otherwise.
    pub keep_gguf_qk_permutation: bool,
    /// The storage dtype the engine holds weights and stage outputs in (all
    /// arithmetic is f32 whatever it is): f32, or f16/bf16 with f32 accumulation.
    pub storage: crate::tensor::DType,
    /// How matmul inputs are held: exact, or quantised to 8 bits in blocks
    /// (the CPU engine's llama.cpp-like mode; it then declares that
    /// arithmetic, see `Engine::arithmetic`).
    pub activations: crate::arithmetic::Activations,
    /// Test aid: the arithmetic the engine declares instead of the one it
    /// computes in (to show a mis-declared engine fails). Never set it otherwise.
    #[doc(hidden)]
    pub declare: Option<crate::arithmetic::Arithmetic>,
    /// Test aid: a loader bug planted after the file is read, so tests can
    /// show the `weights` check names the tensor. Never set it otherwise.
    #[doc(hidden)]
    pub plant: Option<LoaderBug>,
    /// A spec's `config:` override (HF config keys), merged into the
    /// model's config before anything is computed from it.
    pub config: Option<serde_json::Value>,
}

/// A planted loader bug (see `LoadOptions::plant`): the three ways a new
/// engine's loader typically goes wrong without any load error.
#[doc(hidden)]
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LoaderBug {
    /// The tensor is left zeroed (allocated, never filled).
    Zero(String),
    /// Two tensors of the same shape (two layers' q_proj, say) are swapped.
    Swap(String, String),
    /// The tensor is never mapped: its name is not in the loader's table, so
    /// it is dropped (an optional tensor such as a bias then silently goes).
    Unmapped(String),
    /// A fused q·k·v projection (Phi-3) split with q and k swapped: k taken
    /// from the top rows, q after it.
    SplitKFirst,
}

impl LoaderBug {
    fn apply(&self, ws: &mut Weights) -> Result<()> {
        let dir = ws.dir.clone();
        let missing = |n: &str| Error::model(&dir, format!("planted loader bug: no weight `{n}`"));
        match self {
            LoaderBug::Zero(n) => {
                let mut t = ws.remove(n).ok_or_else(|| missing(n))?;
                t.data_mut().fill(0.0);
                ws.insert(n.clone(), t);
            }
            LoaderBug::Swap(a, b) => {
                let ta = ws.remove(a).ok_or_else(|| missing(a))?;
                let tb = ws.remove(b).ok_or_else(|| missing(b))?;
                ws.insert(a.clone(), tb);
                ws.insert(b.clone(), ta);
            }
            LoaderBug::Unmapped(n) => {
                ws.remove(n).ok_or_else(|| missing(n))?;
            }
            LoaderBug::SplitKFirst => {}
        }
        Ok(())
    }
}

enum Format {
    HfDir,
    Gguf,
}

fn format_of(path: &Path) -> Result<Format> {
    let meta = std::fs::metadata(path).map_err(|e| match e.kind() {
        std::io::ErrorKind::NotFound => Error::model(path, "model not found (no such file or folder)"),
        _ => Error::io(path, e),
    })?;
    if meta.is_dir() {
        Ok(Format::HfDir)
    } else if crate::gguf::is_gguf_path(path) {
        Ok(Format::Gguf)
    } else {
        Err(Error::model(
            path,
            "not a model: expected an HF model folder (config.json + *.safetensors) or a .gguf file",
        ))
    }
}

/// Reads only the config of a model (an HF folder or a `.gguf` file).
pub fn read_config(path: &Path) -> Result<ModelConfig> {
    read_config_with(path, None)
}

/// Reads only the config of a model, with a spec's `config:` override.
pub fn read_config_with(path: &Path, over: Option<&serde_json::Value>) -> Result<ModelConfig> {
    match format_of(path)? {
        Format::HfDir => ModelConfig::from_hf_dir_with(path, over),
        Format::Gguf => gguf_config_with(&GgufFile::open(path)?, path, over),
    }
}

fn gguf_config_with(f: &GgufFile, path: &Path, over: Option<&serde_json::Value>) -> Result<ModelConfig> {
    let cfg = gguf::config(f)?;
    match over {
        None => Ok(cfg),
        Some(o) => cfg
            .with_gguf_override(o)
            .map_err(|m| Error::model(path, format!("the spec's `config:`: {m}"))),
    }
}

/// A weight's name in the layout the engines read: a LLaVA checkpoint's
/// (`llava::canonical_name`), else a Qwen-VL's (`vision::canonical_name`,
/// which changes no text model's name).
pub fn canonical_name(cfg: &ModelConfig, name: &str) -> String {
    match cfg.vision.as_ref().and_then(|v| v.llava.as_ref()) {
        Some(_) => llava::canonical_name(name),
        None => vision::canonical_name(name),
    }
}

/// Reads the config and the weights (HF names, f32 values) of a model.
/// Fused projections (Phi-3) come back split into the Llama layout.
pub fn load(path: &Path, opts: &LoadOptions) -> Result<(ModelConfig, Weights)> {
    let (cfg, mut ws) = match format_of(path)? {
        Format::HfDir => {
            let cfg = ModelConfig::from_hf_dir_with(path, opts.config.as_ref())?;
            let mut ws = Weights::from_hf_dir(path)?;
            if cfg.vision.is_some() {
                ws.rename(|n| canonical_name(&cfg, n));
            }
            ws.remap(|t| moe_layout::canonicalise(&cfg, t))?;
            (cfg, ws)
        }
        Format::Gguf => {
            let f = GgufFile::open(path)?;
            let cfg = gguf_config_with(&f, path, opts.config.as_ref())?;
            let ws = gguf::weights(&f, &cfg, opts)?;
            (cfg, ws)
        }
    };
    fused::split(&cfg, &mut ws, opts.plant == Some(LoaderBug::SplitKFirst))?;
    if let Some(bug) = opts.plant.as_ref().filter(|b| **b != LoaderBug::SplitKFirst) {
        bug.apply(&mut ws)?;
    }
    Ok((cfg, ws))
}
