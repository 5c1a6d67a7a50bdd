//! The CPU reference engine: a plain f32 Llama/Qwen2 decoder whose arithmetic
//! mirrors HF transformers closely enough (~1e-7) to serve as the reference
//! other engines are compared with, and as a second opinion on HF goldens.
//! With f16/bf16 storage (`LoadOptions::storage`) it emulates an engine that
//! stores weights and stage outputs in that type and computes in f32: the
//! arithmetic stays f32 and values are rounded to storage exactly where the
//! CUDA engine stores them (see `forward`).
//! This file holds the engine type and its step (`driver::Forward`: one
//! forward pass, then the host sampler's pick); the run loop is the driver's,
//! the maths lives in the sibling modules.

pub(crate) mod attention;
pub(crate) mod clip;
mod forward;
mod kv_cache;
pub(crate) mod layers;
pub(crate) mod linear;
pub(crate) mod mla;
pub(crate) mod moe;
pub mod matmul;
pub(crate) mod mutants;
pub(crate) mod ops;
mod paged;
mod serve;
mod tap;
#[cfg(test)]
pub(crate) mod test_model;
#[cfg(test)]
mod tests;
pub(crate) mod vision;

use std::path::Path;

use crate::error::Result;
use crate::model::{self, LoadOptions, ModelConfig, Weights};
use crate::sampling::{Sampler, Sampling};
use crate::tensor::DType;

use super::driver::{self, Forward, StepIn, StepOut};
use super::{Engine, RunOutput, RunRequest, TapSet};
use forward::{forward, Tap};
use kv_cache::KvCache;
use layers::ModelWeights;
use mutants::Mutant;
use ops::LayerRopes;

use crate::arithmetic::{Activations, Arithmetic};

pub struct CpuEngine {
    cfg: ModelConfig,
    weights: ModelWeights,
    ropes: LayerRopes,
    /// Weights and stage outputs are rounded to this (f32: nothing is rounded).
    storage: DType,
    /// Planted bugs (test builds only; see `mutants`).
    mutants: mutants::Mutants,
    /// What it declares (`Engine::arithmetic`): None for plain arithmetic at
    /// its storage.
    declared: Option<Arithmetic>,
    /// A VLM's vision tower: Qwen-VL's, or LLaVA's CLIP tower and projector.
    vision: Option<vision::VisionWeights>,
    clip: Option<clip::ClipWeights>,
    /// The paged KV cache batches run on, kept across requests.
    serve: std::sync::Mutex<paged::ServeState>,
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
        let mut e = CpuEngine::from_weights_stored(cfg, &mut ws, opts.storage)?;
        if let Activations::Q8 { block } = opts.activations {
            e.weights.quantise_activations(block);
            e.declared = Some(Arithmetic {
                activations: opts.activations,
                ..Arithmetic::of_storage(opts.storage)
            });
        }
        if let Some(d) = opts.declare {
            e.declared = Some(d);
        }
        Ok(e)
    }

    /// Builds the engine from an already-read config and weights (every weight
    /// must be used; see `layers`).
    pub fn from_weights(cfg: ModelConfig, ws: &mut Weights) -> Result<CpuEngine> {
        CpuEngine::from_weights_stored(cfg, ws, DType::F32)
    }

    /// `from_weights` with f16/bf16 storage emulated: every weight is rounded
    /// to `storage` here, and every stage output in `forward`.
    pub fn from_weights_stored(cfg: ModelConfig, ws: &mut Weights, storage: DType) -> Result<CpuEngine> {
        let (mut vision, mut clip) = (None, None);
        match cfg.vision.as_ref().map(|vc| (vc, &vc.llava)) {
            Some((_, Some(lc))) => clip = Some(clip::ClipWeights::load(ws, lc, cfg.hidden)?),
            Some((vc, None)) => vision = Some(vision::VisionWeights::load(&cfg, vc, ws)?),
            None => {}
        }
        let mut weights = ModelWeights::load(&cfg, ws)?;
        weights.round_to(storage);
        if let Some(v) = &mut vision {
            v.linears_mut().into_iter().for_each(|l| l.round_to(storage));
        }
        if let Some(c) = &mut clip {
            c.linears_mut().into_iter().for_each(|l| l.round_to(storage));
            // The embedding tables are stored like the linears (the CUDA
            // engine holds them in its storage type; the `packing` check
            // expects the newline so).
            storage.round_slice(&mut c.class);
            storage.round_slice(&mut c.pos);
            if let Some(nl) = &mut c.newline {
                storage.round_slice(nl);
            }
        }
        let ropes = LayerRopes::new(&cfg);
        let serve = std::sync::Mutex::new(paged::ServeState {
            pool: paged::Pool::new(cfg.layers, cfg.kv_heads * cfg.head_dim),
            slots: Vec::new(),
        });
        Ok(CpuEngine {
            serve,
            cfg,
            weights,
            ropes,
            storage,
            mutants: mutants::Mutants::default(),
            declared: None,
            vision,
            clip,
        })
    }

    /// This engine with a bug planted (tests only).
    #[cfg(test)]
    pub(crate) fn mutated(mut self, m: mutants::Mutant) -> CpuEngine {
        self.mutants = mutants::Mutants::with(m);
        if m == mutants::Mutant::RopeThetaWrong {
            self.ropes = self.ropes.replaced(ops::Rope::new(self.cfg.head_dim, 10000.0));
        }
        if let Some(r) = mutants::planted_tables(m, &self.cfg) {
            self.ropes = self.ropes.replaced(r);
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

    fn arithmetic(&self) -> Option<Arithmetic> {
        self.declared
    }

    fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    /// Every stage, images (the vision tower of Qwen2-VL and Qwen3-VL), and
    /// batches of text (bitwise batch-invariant, paged, poisonable).
    fn capabilities(&self) -> super::capabilities::Capabilities {
        super::capabilities::Capabilities {
            serving: self.cfg.vision.is_none().then(CpuEngine::serving_caps),
            ..super::capabilities::Capabilities::all()
        }
    }

    fn run_batch(&self, req: &super::batch::BatchRequest, taps: &TapSet) -> Result<Vec<RunOutput>> {
        super::batch::run(self, req, taps)
    }

    fn visit_weights(&self, f: &mut super::WeightVisitor) -> Result<()> {
        self.weights.visit(&self.cfg, f);
        if let (Some(v), Some(vc)) = (&self.vision, &self.cfg.vision) {
            v.visit(vc, f);
        }
        if let (Some(c), Some(lc)) = (&self.clip, self.cfg.vision.as_ref().and_then(|v| v.llava.as_ref())) {
            c.visit(lc, f);
        }
        Ok(())
    }

    fn run(&self, req: &RunRequest, taps: &TapSet) -> Result<RunOutput> {
        driver::run(self, req, taps)
    }
}

/// A run's state: the KV cache and the host sampler.
pub struct CpuRun {
    cache: KvCache,
    sampler: Sampler,
    greedy: bool,
    /// A VLM run's image, and its M-RoPE delta once the prefill set it.
    image: Option<std::sync::Arc<super::ImageInput>>,
    rope_delta: i64,
}

impl CpuEngine {
    /// Where a step's captures go, tagged with this engine's storage.
    fn tap<'a>(&self, taps: &'a super::TapSet, step: crate::stage::Step, caps: &'a mut super::Captures) -> Tap<'a> {
        Tap {
            taps,
            step,
            caps,
            dtype: self.storage,
            mutants: self.mutants,
        }
    }
}

impl Forward for CpuEngine {
    type Run = CpuRun;

    fn engine_name(&self) -> &str {
        "cpu"
    }

    fn vocab(&self) -> usize {
        self.cfg.vocab
    }

    fn storage(&self) -> DType {
        self.storage
    }

    fn begin(&self, req: &RunRequest) -> Result<(CpuRun, Sampling)> {
        let cfg = &self.cfg;
        let mx = self.mutants;
        let mut sampling = req.sampling.clone();
        if let (true, Sampling::Random { temperature, .. }) = (mx.is(Mutant::TemperatureMisapplied), &mut sampling) {
            *temperature = *temperature * *temperature / 2.0;
        }
        let seed = if mx.is(Mutant::SeedIgnored) { 0 } else { req.seed };
        let run = CpuRun {
            cache: KvCache::new(
                cfg.layers,
                cfg.kv_heads,
                cfg.head_dim,
                req.prompt.len() + req.decode_steps,
            ),
            sampler: Sampler::new(sampling.clone(), seed),
            greedy: req.sampling == Sampling::Greedy,
            image: req.image.clone(),
            rope_delta: 0,
        };
        if let Some(img) = &req.image {
            super::multimodal::check_image(cfg, img, "cpu")?;
        }
        Ok((run, sampling))
    }

    fn step(&self, run: &mut CpuRun, s: StepIn) -> Result<StepOut> {
        debug_assert_eq!(run.cache.len(), s.pos0, "the driver's positions are the cache's");
        // A VLM: the prefill encodes the image; every step rotates by M-RoPE.
        let mut features = None;
        let mm = match &self.cfg.vision {
            // LLaVA: the prefill encodes the image; positions are the plain ones.
            Some(vc) if vc.llava.is_some() => {
                if let (0, Some(img), Some(cw), Some(lc)) = (s.pos0, &run.image, &self.clip, &vc.llava) {
                    let mut tap = self.tap(s.taps, s.step, &mut *s.caps);
                    let f = clip::encode_tapped(lc, cw, img, &mut tap).map_err(|m| crate::Error::engine("cpu", m))?;
                    features = Some(f);
                }
                let p: Vec<i64> = (s.pos0..s.pos0 + s.tokens.len()).map(|i| i as i64).collect();
                Some(([p.clone(), p.clone(), p], vc.image_token))
            }
            Some(vc) => {
                let grids: Vec<_> = run.image.iter().map(|i| i.grid).collect();
                let (positions, delta) = if s.pos0 == 0 && self.mutants.is(Mutant::MropeOneD) {
                    let p: Vec<i64> = (0..s.tokens.len() as i64).collect();
                    ([p.clone(), p.clone(), p], 0)
                } else {
                    let (t, m) = (vc.image_token, vc.merge);
                    crate::model::vision::step_positions(s.tokens, s.pos0, t, &grids, m, run.rope_delta)
                        .map_err(|m| crate::Error::engine("cpu", m))?
                };
                run.rope_delta = delta;
                if let (0, Some(img), Some(vw)) = (s.pos0, &run.image, &self.vision) {
                    let mut tap = self.tap(s.taps, s.step, &mut *s.caps);
                    features = Some(vision::encode(&self.cfg, vc, vw, img, &mut tap));
                }
                Some((positions, vc.image_token))
            }
            None => None,
        };
        let mm = mm.map(|(positions, image_token)| forward::Multimodal {
            features: features.as_ref(),
            positions,
            image_token,
        });
        let tap = self.tap(s.taps, s.step, s.caps);
        let logits = forward(
            &self.cfg,
            &self.weights,
            &self.ropes,
            s.tokens,
            s.pos0,
            &mut run.cache,
            tap,
            mm.as_ref(),
        );
        let token = if self.mutants.is(Mutant::ArgmaxTieLast) && run.greedy {
            mutants::argmax_last(&logits)
        } else {
            run.sampler.sample(&logits)
        };
        Ok(StepOut {
            token,
            logits: s.want_logits.then_some(logits),
        })
    }
}
