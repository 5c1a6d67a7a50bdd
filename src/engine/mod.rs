//! The seam every engine implements: load a model, run a prompt plus decode
//! steps, and hand back the tensors of the stages that were tapped. The runner
//! and the checks only ever see this trait, so an engine outside touchstone
//! (a Rust crate implementing `Engine`, see `crate::harness`; any program
//! speaking the subprocess protocol, `exec`; or tensors another program wrote,
//! `dumps`) gets exactly the checks, report and first-divergence logic of the
//! built-in ones.
//!
//! What an engine owes each tapped stage is the canonical tensor of the
//! stage table (`stage::shape`, docs/stages-and-checks.md): row-major, no batch dimension, one tensor per
//! (step, stage), values as the engine computed them (f32, or rounded to its
//! storage dtype and tagged with it). The prefill step runs the whole prompt
//! at positions 0..T; decode step n runs one token at position T + n − 1 with
//! the KV cache of everything before it.

pub mod batch;
pub mod blocks;
pub mod capabilities;
pub mod cpu;
pub mod cuda;
pub mod driver;
pub mod dumps;
pub mod exec;
pub mod multimodal;
pub mod names;
pub mod output;
mod protocol_json;
pub mod registry;
pub mod replay;
pub mod requires;
pub mod shards;
pub mod third_party;

use crate::error::Result;
use crate::model::ModelConfig;
use crate::sampling::Sampling;
use crate::stage::{Stage, Step};
use crate::tensor::Tensor;
use std::collections::{BTreeMap, BTreeSet};

/// Whether an engine can run on this machine. Trials of an unavailable engine are
/// reported as skipped with the reason, never as passed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Availability {
    Available,
    Unavailable(String),
}

/// What to run.
#[derive(Clone, Debug, PartialEq)]
pub struct RunRequest {
    /// Prompt token ids, processed in one prefill step.
    pub prompt: Vec<u32>,
    /// Single-token decode steps after the prefill.
    pub decode_steps: usize,
    pub sampling: Sampling,
    /// Seed of the sampling RNG (unused by greedy sampling).
    pub seed: u64,
    /// Teacher forcing: when set, decode step n is fed `forced[n-1]` instead of
    /// the token sampled from the previous step (the sampled tokens are still
    /// reported). This keeps decode-step comparisons against a golden meaningful
    /// even when one sampled token differs.
    pub forced: Option<Vec<u32>>,
    /// A vision-language model's image, processed (`ImageInput`): its
    /// features replace the prompt's image-pad tokens. None for text.
    pub image: Option<std::sync::Arc<ImageInput>>,
}

/// One processed image as a VLM engine receives it: the processor's flattened
/// patches (the `vision.pixels` stage, `[N, C·T·P·P]` in merge-window
/// order) and its grid (`image_grid_thw`). Where it came from (a PNG through
/// touchstone's processor, or a golden's recorded pixels) is said by `origin`.
#[derive(Clone, Debug, PartialEq)]
pub struct ImageInput {
    /// Qwen-VL: `[N, C·T·P·P]` patches; LLaVA: `[P, 3, S, S]` tower images.
    pub pixels: Tensor,
    /// Qwen-VL: `image_grid_thw`. LLaVA: t the tower images, h = w = S/P.
    pub grid: crate::model::ImageGrid,
    /// The image's (height, width) as given, before any tiling: LLaVA-NeXT's
    /// unpadding and token count read it. None where a golden's pixels did
    /// not record it.
    pub size: Option<(usize, usize)>,
    /// The image file, when there is one (external engines may read it).
    pub path: Option<std::path::PathBuf>,
    /// Where the pixels came from, for messages.
    pub origin: String,
}

impl ImageInput {
    /// What its stages' shapes depend on.
    pub fn dims(&self) -> crate::model::ImageDims {
        crate::model::ImageDims {
            grid: self.grid,
            size: self.size,
        }
    }
}

impl RunRequest {
    /// A text request sampled greedily (the seed is then unused but kept),
    /// free-running.
    pub fn greedy(prompt: Vec<u32>, decode_steps: usize, seed: u64) -> RunRequest {
        RunRequest {
            prompt,
            decode_steps,
            sampling: Sampling::Greedy,
            seed,
            forced: None,
            image: None,
        }
    }

    /// The token decode step `n` (1-based) is fed: the forced one, or the one
    /// sampled at the step before (`sampled` holds one token per step run so
    /// far; sampled tokens are always < vocab, as they index the logits).
    pub fn decode_input(&self, n: usize, sampled: &[u32]) -> u32 {
        match &self.forced {
            Some(f) => f[n - 1],
            None => sampled[n - 1],
        }
    }

    /// What every engine checks before running: a non-empty prompt, enough
    /// forced tokens, and every token inside the vocabulary. Shared so that all
    /// engines reject the same requests with the same words.
    pub fn validate(&self, engine: &str, vocab: usize) -> Result<()> {
        let bad = |msg: String| crate::error::Error::engine(engine, msg);
        if self.prompt.is_empty() {
            return Err(bad("the prompt is empty (a prefill needs at least one token)".into()));
        }
        let in_vocab = |what: &str, tokens: &[u32]| match tokens.iter().position(|&t| t as usize >= vocab) {
            Some(i) => Err(bad(format!(
                "{what} token {i} is id {}, outside the vocabulary of {vocab}",
                tokens[i]
            ))),
            None => Ok(()),
        };
        in_vocab("prompt", &self.prompt)?;
        if let Some(forced) = &self.forced {
            if forced.len() < self.decode_steps {
                return Err(bad(format!(
                    "teacher forcing gives {} token(s) for {} decode step(s)",
                    forced.len(),
                    self.decode_steps
                )));
            }
            in_vocab("forced", &forced[..self.decode_steps])?;
        }
        Ok(())
    }
}

/// Which stages to capture (the same set at every step). Capturing nothing costs
/// nothing: an engine asks `contains` before copying anything out.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TapSet {
    stages: BTreeSet<Stage>,
}

impl TapSet {
    pub fn none() -> TapSet {
        TapSet::default()
    }
    pub fn all(n_layers: usize) -> TapSet {
        TapSet {
            stages: Stage::all(n_layers).into_iter().collect(),
        }
    }
    pub fn contains(&self, stage: Stage) -> bool {
        self.stages.contains(&stage)
    }
    pub fn is_empty(&self) -> bool {
        self.stages.is_empty()
    }
    pub fn insert(&mut self, stage: Stage) {
        self.stages.insert(stage);
    }
    pub fn iter(&self) -> impl Iterator<Item = Stage> + '_ {
        self.stages.iter().copied()
    }
    /// Whether every stage of `self` is in `other`.
    pub fn is_subset(&self, other: &TapSet) -> bool {
        self.stages.is_subset(&other.stages)
    }
}

impl FromIterator<Stage> for TapSet {
    fn from_iter<I: IntoIterator<Item = Stage>>(iter: I) -> Self {
        TapSet {
            stages: iter.into_iter().collect(),
        }
    }
}

/// Tapped tensors of one run, keyed by (step, stage), in canonical layouts
/// (`stage::shape`, docs/stages-and-checks.md: row-major, no batch dimension).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Captures {
    map: BTreeMap<(Step, Stage), Tensor>,
}

impl Captures {
    pub fn insert(&mut self, step: Step, stage: Stage, t: Tensor) {
        self.map.insert((step, stage), t);
    }
    pub fn get(&self, step: Step, stage: Stage) -> Option<&Tensor> {
        self.map.get(&(step, stage))
    }
    pub fn iter(&self) -> impl Iterator<Item = (&(Step, Stage), &Tensor)> {
        self.map.iter()
    }
    pub fn iter_mut(&mut self) -> impl Iterator<Item = (&(Step, Stage), &mut Tensor)> {
        self.map.iter_mut()
    }
    pub fn len(&self) -> usize {
        self.map.len()
    }
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }
}

/// The result of one run.
#[derive(Clone, Debug, PartialEq)]
pub struct RunOutput {
    pub captures: Captures,
    /// One token per step: sampled from the last row of that step's logits.
    /// `sampled[0]` comes from the prefill; with teacher forcing off, `sampled[n]`
    /// is what decode step n+1 was fed.
    pub sampled: Vec<u32>,
    /// Absolute positions processed by each step (prefill 0..T, then one each).
    pub positions: Vec<Vec<usize>>,
    /// Tensor names in an external engine's output that are neither canonical
    /// nor mapped by `names:` (shown when a tapped stage is missing).
    pub unmapped: Vec<String>,
}

/// One reading of an engine's memory (`Engine::memory`).
#[derive(Clone, Debug, PartialEq)]
pub struct MemoryReading {
    pub bytes: u64,
    /// What was read (e.g. "resident set of pid 123 (VmRSS)").
    pub what: String,
    /// Whether the count is exact (allocated bytes), or page- and
    /// allocator-granular (a resident set): the growth bound follows.
    pub exact: bool,
}

/// The visitor of `Engine::visit_weights`: (HF name, shape, values).
pub type WeightVisitor<'a> = dyn FnMut(&str, &[usize], &[f32]) + 'a;

pub trait Engine: Send + Sync {
    /// The name in trial ids and reports (`cpu`, `cuda`, a spec's engine name).
    fn name(&self) -> &str;
    /// How it computes, where its storage dtype does not say it all (e.g.
    /// activations quantised to 8 bits before each matmul): the scaled
    /// policy's floors follow it. None: plain arithmetic at its storage.
    fn arithmetic(&self) -> Option<crate::arithmetic::Arithmetic> {
        None
    }
    /// The stages it can tap (every one unless it says otherwise): checks
    /// reading another stage are not applicable to it (`capabilities`).
    /// Taking an image is declared (`no_images: None`), never assumed: the
    /// default runs text models only, and a vision-language spec on it is
    /// skipped once with that reason.
    fn capabilities(&self) -> capabilities::Capabilities {
        capabilities::Capabilities::text_only()
    }
    /// The model's configuration (shapes of every stage follow from it).
    fn config(&self) -> &ModelConfig;
    /// Runs `req` (a prefill of the prompt, then `req.decode_steps` single-token
    /// steps, teacher-forced when `req.forced` is set) and returns the tensors
    /// of the stages in `taps` at every step, in their canonical layout, with
    /// the token sampled after each step. A stage outside `taps` need not be
    /// captured; a tapped one that is missing fails its checks.
    fn run(&self, req: &RunRequest, taps: &TapSet) -> Result<RunOutput>;
    /// Runs several sequences together (`batch`): one output per sequence,
    /// in the request's order, each in the canonical layouts of a plain run.
    /// Only an engine whose capabilities declare `serving` is asked.
    fn run_batch(&self, req: &batch::BatchRequest, taps: &TapSet) -> Result<Vec<RunOutput>> {
        let _ = (req, taps);
        Err(crate::Error::Usage(format!(
            "the {} engine does not take batches",
            self.name()
        )))
    }
    /// What the engine holds in memory now, as read from outside it (a
    /// protocol engine's resident set, which touchstone reads from /proc, and
    /// the bytes it reports itself), each with what was read. Empty: nothing
    /// to read from outside (an in-process engine: the `repeat` check counts
    /// its heap itself).
    fn memory(&self) -> Result<Vec<MemoryReading>> {
        Ok(Vec::new())
    }
    /// Whether it computes in touchstone's process (its heap is then what
    /// the `repeat` check counts); false for a protocol engine's process.
    fn in_process(&self) -> bool {
        true
    }
    /// `None` when the engine can run more than once (the default). An engine
    /// that cannot (recorded dumps) says why, and the run checks that need a
    /// second run (determinism, kv_cache) are skipped with that reason.
    fn reruns(&self) -> Option<String> {
        None
    }
    /// The engine's own tokenization of `text` (in its chat template as one
    /// user message with the generation prompt when `chat`), for engines
    /// that ship their own tokenizer: None when it has none (the `tokenizer`
    /// run check is then not applicable).
    fn tokenize(&self, text: &str, chat: bool) -> Option<Result<Vec<u32>>> {
        let _ = (text, chat);
        None
    }
    /// Calls `f` once per weight tensor the engine holds, with its HF name
    /// (fused projections under their split names: `q_proj`, `gate_proj`, ...),
    /// its row-major shape and its values as held (rounded to the storage
    /// dtype, widened to f32; a device engine copies each tensor back). The
    /// `weights` run check compares them with the model file. An engine that
    /// cannot show its weights keeps this default, and the check is not
    /// applicable to it, with the reason.
    fn visit_weights(&self, f: &mut WeightVisitor) -> Result<()> {
        let _ = f;
        Err(crate::Error::Usage(format!(
            "the {} engine does not expose the weights it holds",
            self.name()
        )))
    }
}
