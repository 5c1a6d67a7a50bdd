//! The CPU reference engine: a plain f32 Llama/Qwen2 decoder whose arithmetic
//! mirrors HF transformers closely enough (~1e-7) to serve as the reference
//! other engines are compared with, and as a second opinion on HF goldens.
//! With f16/bf16 storage (`LoadOptions::storage`) it emulates an engine that
//! stores weights and stage outputs in that type and computes in f32: the
//! arithmetic stays f32 and values are rounded to storage exactly where the
//! CUDA engine stores them (see `forward`).
//! This file holds the engine type and the run loop (prefill, decode steps,
//! sampling, teacher forcing); the maths lives in the sibling modules.

pub(crate) mod attention;
mod forward;
mod kv_cache;
pub(crate) mod layers;
pub mod matmul;
pub(crate) mod mutants;
pub(crate) mod ops;
#[cfg(test)]
pub(crate) mod test_model;
#[cfg(test)]
mod tests;

use std::path::Path;

use crate::error::Result;
use crate::model::{self, LoadOptions, ModelConfig, Weights};
use crate::sampling::Sampler;
use crate::stage::{Stage, Step};
use crate::tensor::DType;

use super::{Captures, Engine, RunOutput, RunRequest, TapSet};
use forward::{forward, Tap};
use kv_cache::KvCache;
use layers::ModelWeights;
use ops::Rope;

pub struct CpuEngine {
    cfg: ModelConfig,
    weights: ModelWeights,
    rope: Rope,
    /// Weights and stage outputs are rounded to this (f32: nothing is rounded).
    storage: DType,
    /// Planted bugs (test builds only; see `mutants`).
    mutants: mutants::Mutants,
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
        CpuEngine::from_weights_stored(cfg, &mut ws, opts.storage)
    }

    /// Builds the engine from an already-read config and weights (every weight
    /// must be used; see `layers`).
    pub fn from_weights(cfg: ModelConfig, ws: &mut Weights) -> Result<CpuEngine> {
        CpuEngine::from_weights_stored(cfg, ws, DType::F32)
    }

    /// `from_weights` with f16/bf16 storage emulated: every weight is rounded
    /// to `storage` here, and every stage output in `forward`.
    pub fn from_weights_stored(cfg: ModelConfig, ws: &mut Weights, storage: DType) -> Result<CpuEngine> {
        let mut weights = ModelWeights::load(&cfg, ws)?;
        weights.round_to(storage);
        let rope = Rope::new(cfg.head_dim, cfg.rope_theta);
        Ok(CpuEngine {
            cfg,
            weights,
            rope,
            storage,
            mutants: mutants::Mutants::default(),
        })
    }

    /// This engine with a bug planted (tests only).
    #[cfg(test)]
    pub(crate) fn mutated(mut self, m: mutants::Mutant) -> CpuEngine {
        self.mutants = mutants::Mutants::with(m);
        if m == mutants::Mutant::RopeThetaWrong {
            self.rope = Rope::new(self.cfg.head_dim, 10000.0);
        }
        self
    }

    /// The storage dtype this engine emulates.
    pub fn storage(&self) -> DType {
        self.storage
    }
}

impl Engine for CpuEngine {
    fn name(&self) -> &str {
        "cpu"
    }

    fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    fn visit_weights(&self, f: &mut super::WeightVisitor) -> Result<()> {
        self.weights.visit(&self.cfg, f);
        Ok(())
    }

    fn run(&self, req: &RunRequest, taps: &TapSet) -> Result<RunOutput> {
        req.validate("cpu", self.cfg.vocab)?;

        let cfg = &self.cfg;
        let total = req.prompt.len() + req.decode_steps;
        let mut cache = KvCache::new(cfg.layers, cfg.kv_heads, cfg.head_dim, total);
        let mx = self.mutants;
        let mut sampling = req.sampling.clone();
        if let (true, crate::sampling::Sampling::Random { temperature, .. }) =
            (mx.is(mutants::Mutant::TemperatureMisapplied), &mut sampling)
        {
            *temperature = *temperature * *temperature / 2.0;
        }
        let seed = if mx.is(mutants::Mutant::SeedIgnored) {
            0
        } else {
            req.seed
        };
        let mut sampler = Sampler::new(sampling.clone(), seed);
        let mut captures = Captures::default();
        let mut sampled = Vec::with_capacity(req.decode_steps + 1);
        let mut positions = Vec::with_capacity(req.decode_steps + 1);

        let mut tokens = req.prompt.clone();
        for step in Step::sequence(req.decode_steps) {
            if let Step::Decode(n) = step {
                tokens = vec![req.decode_input(n, &sampled)];
            }
            let pos0 = cache.len();
            let mut tap = Tap {
                taps,
                step,
                caps: &mut captures,
                dtype: self.storage,
                mutants: self.mutants,
            };
            let logits = forward(cfg, &self.weights, &self.rope, &tokens, pos0, &mut cache, &mut tap);
            if taps.contains(Stage::SampleProbs) {
                // What the sampler draws this step's token from (random only).
                if let Some(p) = crate::sampling::distribution(&sampling, &logits) {
                    let t = crate::tensor::Tensor::new(vec![1, p.len()], p).with_dtype(self.storage);
                    captures.insert(step, Stage::SampleProbs, t);
                }
            }
            let token = if mx.is(mutants::Mutant::ArgmaxTieLast) && req.sampling == crate::sampling::Sampling::Greedy {
                mutants::argmax_last(&logits)
            } else {
                sampler.sample(&logits)
            };
            sampled.push(token);
            positions.push((pos0..pos0 + tokens.len()).collect());
        }
        Ok(RunOutput {
            captures,
            sampled,
            positions,
            unmapped: Vec::new(),
        })
    }
}
