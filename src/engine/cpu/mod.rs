//! The CPU reference engine: a plain f32 Llama/Qwen2 decoder whose arithmetic
//! mirrors HF transformers closely enough (~1e-7) to serve as the reference
//! other engines are compared with, and as a second opinion on HF goldens.
//! This file holds the engine type and the run loop (prefill, decode steps,
//! sampling, teacher forcing); the maths lives in the sibling modules.

mod attention;
mod forward;
mod kv_cache;
pub(crate) mod layers;
pub(crate) mod ops;
#[cfg(test)]
pub(crate) mod test_model;
#[cfg(test)]
mod tests;

use std::path::Path;

use crate::error::Result;
use crate::model::{self, LoadOptions, ModelConfig, Weights};
use crate::sampling::Sampler;
use crate::stage::Step;

use super::{Captures, Engine, RunOutput, RunRequest, TapSet};
use forward::{forward, Tap};
use kv_cache::KvCache;
use layers::ModelWeights;
use ops::Rope;

pub struct CpuEngine {
    cfg: ModelConfig,
    weights: ModelWeights,
    rope: Rope,
}

impl CpuEngine {
    /// Loads an HF model folder (`config.json` + `*.safetensors`) or a `.gguf`
    /// file (f32/f16/bf16 weights, Q8_0 in GGUF, all widened to f32).
    pub fn load(model: &Path) -> Result<CpuEngine> {
        CpuEngine::load_with(model, &LoadOptions::default())
    }

    /// `load` with options (see `LoadOptions`).
    pub fn load_with(model: &Path, opts: &LoadOptions) -> Result<CpuEngine> {
        let (cfg, mut ws) = model::load(model, opts)?;
        CpuEngine::from_weights(cfg, &mut ws)
    }

    /// Builds the engine from an already-read config and weights (every weight
    /// must be used; see `layers`).
    pub fn from_weights(cfg: ModelConfig, ws: &mut Weights) -> Result<CpuEngine> {
        let weights = ModelWeights::load(&cfg, ws)?;
        let rope = Rope::new(cfg.head_dim, cfg.rope_theta);
        Ok(CpuEngine { cfg, weights, rope })
    }
}

impl Engine for CpuEngine {
    fn name(&self) -> &'static str {
        "cpu"
    }

    fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    fn run(&self, req: &RunRequest, taps: &TapSet) -> Result<RunOutput> {
        req.validate("cpu", self.cfg.vocab)?;

        let cfg = &self.cfg;
        let total = req.prompt.len() + req.decode_steps;
        let mut cache = KvCache::new(cfg.layers, cfg.kv_heads, cfg.head_dim, total);
        let mut sampler = Sampler::new(req.sampling.clone(), req.seed);
        let mut captures = Captures::default();
        let mut sampled = Vec::with_capacity(req.decode_steps + 1);
        let mut positions = Vec::with_capacity(req.decode_steps + 1);

        let mut tokens = req.prompt.clone();
        for step in Step::sequence(req.decode_steps) {
            if let Step::Decode(n) = step {
                // Sampled tokens are always < vocab (they index the logits).
                let fed = match &req.forced {
                    Some(f) => f[n - 1],
                    None => *sampled.last().expect("the prefill sampled a token"),
                };
                tokens = vec![fed];
            }
            let pos0 = cache.len();
            let mut tap = Tap {
                taps,
                step,
                caps: &mut captures,
            };
            let logits = forward(cfg, &self.weights, &self.rope, &tokens, pos0, &mut cache, &mut tap);
            sampled.push(sampler.sample(&logits));
            positions.push((pos0..pos0 + tokens.len()).collect());
        }
        Ok(RunOutput {
            captures,
            sampled,
            positions,
        })
    }
}
