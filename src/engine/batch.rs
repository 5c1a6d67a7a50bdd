//! Requests that carry several sequences: what a serving engine runs. A
//! `BatchRequest` is a list of sequences, each a `RunRequest` (its own prompt,
//! decode steps, sampling and seed) plus how its prefill is served: in chunks
//! of given sizes, and/or from a prefix an earlier sequence of the batch
//! computed (a prefix-cache hit). The engine runs them together: one engine
//! step holds the next work of every live sequence (a prefill chunk or one
//! decode token), sequences of different lengths side by side.
//!
//! What comes back is one `RunOutput` per sequence, in the canonical layouts
//! of a plain run, so every check reads a sequence of a batch as it reads a
//! run alone: a chunked prefill's captures are its chunks' rows joined into
//! the prefill tensor (`join_chunks`); a prefix hit's prefill covers only the
//! rows it computed (positions L..T: `[T−L, …]`, attention `[H, T−L, T]`), and
//! its `positions[0]` says so.
//!
//! The built-in engines share the schedule (`run`): each engine provides a
//! batched forward pass over its paged KV cache (`BatchForward`), and the
//! order of work — who waits for a prefix, which chunk goes next, what each
//! decode step is fed, sampling, `sample_probs` — is written once here.

use super::driver::Forward;
use super::{Captures, Engine, RunOutput, RunRequest, TapSet};
use crate::error::{Error, Result};
use crate::sampling::{distribution, Sampler, Sampling};
use crate::stage::{BlockStage, Stage, Step};
use crate::tensor::Tensor;

/// Several sequences run together.
#[derive(Clone, Debug, PartialEq)]
pub struct BatchRequest {
    pub seqs: Vec<SeqRequest>,
    /// Fill KV blocks and scratch with this before each use, so that a read of
    /// memory the sequence never wrote shows (NaN, or a huge value).
    pub poison: Option<Poison>,
}

/// One sequence of a batch.
#[derive(Clone, Debug, PartialEq)]
pub struct SeqRequest {
    pub run: RunRequest,
    /// Prefill chunk sizes, in order (empty: the prefill in one step). They
    /// sum to the prompt length less the prefix reused.
    pub chunks: Vec<usize>,
    /// Start from an earlier sequence's cache.
    pub prefix: Option<PrefixHit>,
}

/// A prefix-cache hit: the first `len` positions are sequence `from`'s (its
/// prompt starts with the same `len` tokens), reused, not recomputed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PrefixHit {
    pub from: usize,
    pub len: usize,
}

/// What poisoned memory holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Poison {
    Nan,
    Huge,
}

impl Poison {
    pub fn value(self) -> f32 {
        match self {
            Poison::Nan => f32::NAN,
            // Large enough to swamp any sum it enters, finite so that it
            // shows as a wrong number rather than a NaN.
            Poison::Huge => 1.0e30,
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            Poison::Nan => "nan",
            Poison::Huge => "huge",
        }
    }
}

/// What an engine that takes batches declares (`Capabilities::serving`; a
/// protocol engine's load answer `"batches"`).
#[derive(Clone, Debug, PartialEq)]
pub struct Serving {
    /// Positions per KV block (prefix hits are tested around it); None for
    /// an engine whose cache is not paged.
    pub block_size: Option<usize>,
    /// A sequence's numbers do not depend on the batch, its order, chunking
    /// or prefix reuse: they are then compared bitwise; otherwise within the
    /// allowance its arithmetic derives (logits only).
    pub invariant: bool,
    /// It fills its memory with `BatchRequest::poison` when asked.
    pub poison: bool,
    /// The most sequences one request may carry.
    pub max_batch: usize,
}

impl BatchRequest {
    /// What every engine checks before running a batch, with the same words.
    pub fn validate(&self, engine: &str, vocab: usize, serving: &Serving) -> Result<()> {
        let bad = |msg: String| Error::engine(engine, msg);
        if self.seqs.is_empty() {
            return Err(bad("the batch has no sequences".into()));
        }
        if self.seqs.len() > serving.max_batch {
            return Err(bad(format!(
                "the batch has {} sequences; the engine takes at most {}",
                self.seqs.len(),
                serving.max_batch
            )));
        }
        if self.poison.is_some() && !serving.poison {
            return Err(bad(
                "poisoned memory was asked for, but the engine declares no poison hook".into(),
            ));
        }
        for (i, s) in self.seqs.iter().enumerate() {
            let at = |m: String| bad(format!("sequence {i}: {m}"));
            s.run.validate(engine, vocab).map_err(|e| at(e.to_string()))?;
            if s.run.image.is_some() {
                return Err(at("batches of image requests are not supported".into()));
            }
            let reused = match s.prefix {
                None => 0,
                Some(p) => {
                    if p.from >= i {
                        return Err(at(format!(
                            "its prefix comes from sequence {}, which is not an earlier sequence",
                            p.from
                        )));
                    }
                    let src = &self.seqs[p.from].run.prompt;
                    if p.len == 0 || p.len >= s.run.prompt.len() || p.len > src.len() {
                        return Err(at(format!(
                            "a prefix of {} positions must be at least 1, shorter than its prompt ({}) and no \
                             longer than sequence {}'s ({})",
                            p.len,
                            s.run.prompt.len(),
                            p.from,
                            src.len()
                        )));
                    }
                    if src[..p.len] != s.run.prompt[..p.len] {
                        return Err(at(format!(
                            "its first {} prompt tokens differ from sequence {}'s",
                            p.len, p.from
                        )));
                    }
                    p.len
                }
            };
            let rest = s.run.prompt.len() - reused;
            if !s.chunks.is_empty() && (s.chunks.contains(&0) || s.chunks.iter().sum::<usize>() != rest) {
                return Err(at(format!(
                    "prefill chunks {:?} must be positive and sum to the {rest} prompt positions it computes",
                    s.chunks
                )));
            }
        }
        Ok(())
    }
}

impl SeqRequest {
    /// A sequence run alone: its whole prompt in one prefill.
    pub fn plain(run: RunRequest) -> SeqRequest {
        SeqRequest {
            run,
            chunks: Vec::new(),
            prefix: None,
        }
    }
    /// The prefill's work items: the chunk sizes, or the whole remainder.
    fn chunk_sizes(&self) -> Vec<usize> {
        if self.chunks.is_empty() {
            vec![self.run.prompt.len() - self.prefix.map_or(0, |p| p.len)]
        } else {
            self.chunks.clone()
        }
    }
}

/// Whether a stage is `[H, T, S]` (rows on axis 1, keys on axis 2).
fn is_attention(stage: Stage) -> bool {
    matches!(stage, Stage::Block(_, BlockStage::AttnScores | BlockStage::AttnProbs))
}

/// Joins a prefill's chunk captures into one prefill capture per stage: rows
/// concatenated; an attention tensor's chunk `[H, Tc, Sc]` placed at its rows
/// and keys 0..Sc of `[H, ΣTc, S_last]`, every other entry 0 (causally
/// masked). A stage missing from some chunk is left out (its checks then
/// fail as missing).
pub fn join_chunks(mut parts: Vec<Captures>) -> Captures {
    let mut out = Captures::default();
    if parts.len() <= 1 {
        return parts.pop().unwrap_or_default();
    }
    let first = &parts[0];
    for ((_, stage), t0) in first.iter() {
        let pieces: Option<Vec<&Tensor>> = parts.iter().map(|p| p.get(Step::Prefill, *stage)).collect();
        let Some(pieces) = pieces else { continue };
        let joined = if is_attention(*stage) {
            let (h, s) = (t0.shape()[0], pieces.last().expect("parts").shape()[2]);
            let rows: usize = pieces.iter().map(|p| p.shape()[1]).sum();
            let mut data = vec![0.0f32; h * rows * s];
            let mut r0 = 0;
            for p in &pieces {
                let (tc, sc) = (p.shape()[1], p.shape()[2]);
                for hh in 0..h {
                    for r in 0..tc {
                        data[(hh * rows + r0 + r) * s..][..sc].copy_from_slice(&p.data()[(hh * tc + r) * sc..][..sc]);
                    }
                }
                r0 += tc;
            }
            Tensor::new(vec![h, rows, s], data)
        } else {
            let mut shape = t0.shape().to_vec();
            shape[0] = pieces.iter().map(|p| p.shape()[0]).sum();
            Tensor::new(shape, pieces.iter().flat_map(|p| p.data().iter().copied()).collect())
        };
        out.insert(Step::Prefill, *stage, joined.with_dtype(t0.dtype()));
    }
    out
}

/// One sequence's work in one engine step.
pub struct Item {
    /// Its index in the batch.
    pub seq: usize,
    pub step: Step,
    pub tokens: Vec<u32>,
    /// The position of its first token (its cache holds exactly this many).
    pub pos0: usize,
    /// Where the engine writes this item's tapped stages.
    pub caps: Captures,
}

/// A built-in engine's batched forward pass over its paged KV cache. Its
/// name, vocabulary and storage are its single-run `Forward`'s; what it
/// takes is its `Engine::capabilities().serving`.
pub trait BatchForward: Forward + Engine {
    /// One request's hold on the engine's serving state.
    type Session<'a>
    where
        Self: 'a;
    /// Takes the serving state for `req` (empty caches for its sequences).
    fn open(&self, req: &BatchRequest) -> Result<Self::Session<'_>>;
    /// Before sequence `seq`'s first step: reuse its prefix, if any.
    fn start(&self, s: &mut Self::Session<'_>, seq: usize, prefix: Option<PrefixHit>) -> Result<()>;
    /// One forward pass over every item (appending their keys and values,
    /// writing their taps); returns each item's last row of logits.
    fn batch_step(&self, s: &mut Self::Session<'_>, items: &mut [Item], taps: &TapSet) -> Result<Vec<Vec<f32>>>;
    /// After the request: every sequence's memory goes back to the engine.
    fn close(&self, s: Self::Session<'_>) -> Result<()>;
}

/// Where a sequence is in its request.
#[derive(Default)]
struct Progress {
    started: bool,
    /// Prompt positions done (reused or computed).
    pos: usize,
    /// Prefill chunks done.
    chunks_done: usize,
    parts: Vec<Captures>,
    out: Option<RunOutput>,
}

/// Runs a batch on a built-in engine: every live sequence's next work in
/// each engine step, until each has run its prefill and its decode steps.
pub fn run<F: BatchForward>(engine: &F, req: &BatchRequest, taps: &TapSet) -> Result<Vec<RunOutput>> {
    let name = Forward::engine_name(engine);
    let caps = Engine::capabilities(engine);
    let serving = caps.serving_or_why().map_err(|why| Error::engine(name, why))?;
    req.validate(name, Forward::vocab(engine), serving)?;
    let mut session = engine.open(req)?;
    let result = schedule(engine, &mut session, req, taps);
    engine.close(session)?;
    result
}

fn schedule<F: BatchForward>(
    engine: &F,
    session: &mut F::Session<'_>,
    req: &BatchRequest,
    taps: &TapSet,
) -> Result<Vec<RunOutput>> {
    let n = req.seqs.len();
    let mut prog: Vec<Progress> = (0..n).map(|_| Progress::default()).collect();
    let mut samplers: Vec<Sampler> = req
        .seqs
        .iter()
        .map(|s| Sampler::new(s.run.sampling.clone(), s.run.seed))
        .collect();
    loop {
        let mut items = Vec::new();
        for (i, s) in req.seqs.iter().enumerate() {
            if prog[i]
                .out
                .as_ref()
                .is_some_and(|o| o.sampled.len() > s.run.decode_steps)
            {
                continue;
            }
            if !prog[i].started {
                // A prefix hit waits until its source's prompt is in the cache.
                if let Some(p) = s.prefix {
                    if prog[p.from].out.is_none() {
                        continue;
                    }
                }
                engine.start(session, i, s.prefix)?;
                prog[i].started = true;
                prog[i].pos = s.prefix.map_or(0, |p| p.len);
            }
            let p = &prog[i];
            let (step, tokens, pos0) = match &p.out {
                None => {
                    let size = s.chunk_sizes()[p.chunks_done];
                    (Step::Prefill, s.run.prompt[p.pos..p.pos + size].to_vec(), p.pos)
                }
                Some(o) => {
                    let k = o.sampled.len();
                    let pos0 = s.run.prompt.len() + k - 1;
                    (Step::Decode(k), vec![s.run.decode_input(k, &o.sampled)], pos0)
                }
            };
            items.push(Item {
                seq: i,
                step,
                tokens,
                pos0,
                caps: Captures::default(),
            });
        }
        if items.is_empty() {
            break;
        }
        let rows = engine.batch_step(session, &mut items, taps)?;
        for (mut item, row) in items.into_iter().zip(rows) {
            let s = &req.seqs[item.seq];
            let p = &mut prog[item.seq];
            let last_chunk = match item.step {
                Step::Prefill => {
                    p.pos += item.tokens.len();
                    p.chunks_done += 1;
                    p.parts.push(std::mem::take(&mut item.caps));
                    p.chunks_done == s.chunk_sizes().len()
                }
                Step::Decode(_) => true,
            };
            if !last_chunk {
                continue;
            }
            let token = samplers[item.seq].sample(&row);
            let out = p.out.get_or_insert_with(|| RunOutput {
                captures: join_chunks(std::mem::take(&mut p.parts)),
                sampled: Vec::new(),
                positions: Vec::new(),
                unmapped: Vec::new(),
            });
            if let Step::Decode(_) = item.step {
                for ((st, stage), t) in item.caps.iter() {
                    out.captures.insert(*st, *stage, t.clone());
                }
            }
            let first = match item.step {
                Step::Prefill => s.prefix.map_or(0, |p| p.len),
                Step::Decode(_) => item.pos0,
            };
            out.positions.push((first..item.pos0 + item.tokens.len()).collect());
            if taps.contains(Stage::SampleProbs) && matches!(s.run.sampling, Sampling::Random { .. }) {
                if let Some(d) = distribution(&s.run.sampling, &row) {
                    let t = Tensor::new(vec![1, d.len()], d).with_dtype(Forward::storage(engine));
                    out.captures.insert(item.step, Stage::SampleProbs, t);
                }
            }
            out.sampled.push(token);
        }
    }
    Ok(prog
        .into_iter()
        .map(|p| p.out.expect("every sequence ran its prefill"))
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(shape: Vec<usize>, v: Vec<f32>) -> Tensor {
        Tensor::new(shape, v)
    }

    #[test]
    fn chunks_join_into_the_prefill_tensor_with_causal_zeros() {
        let probs = Stage::Block(0, BlockStage::AttnProbs);
        let embed = Stage::Embed;
        let mut a = Captures::default();
        a.insert(Step::Prefill, embed, t(vec![2, 1], vec![1.0, 2.0]));
        // [H=1, 2 rows, 2 keys]
        a.insert(Step::Prefill, probs, t(vec![1, 2, 2], vec![1.0, 0.0, 0.5, 0.5]));
        let mut b = Captures::default();
        b.insert(Step::Prefill, embed, t(vec![1, 1], vec![3.0]));
        b.insert(Step::Prefill, probs, t(vec![1, 1, 3], vec![0.2, 0.3, 0.5]));
        let j = join_chunks(vec![a, b]);
        assert_eq!(j.get(Step::Prefill, embed).unwrap().data(), &[1.0, 2.0, 3.0]);
        let p = j.get(Step::Prefill, probs).unwrap();
        assert_eq!(p.shape(), &[1, 3, 3]);
        assert_eq!(p.data(), &[1.0, 0.0, 0.0, 0.5, 0.5, 0.0, 0.2, 0.3, 0.5]);
    }

    fn seq(prompt: Vec<u32>, chunks: Vec<usize>, prefix: Option<PrefixHit>) -> SeqRequest {
        SeqRequest {
            run: RunRequest::greedy(prompt, 1, 0),
            chunks,
            prefix,
        }
    }

    #[test]
    fn bad_batches_are_refused_with_the_sequence_and_the_reason() {
        let serving = Serving {
            block_size: Some(4),
            invariant: true,
            poison: false,
            max_batch: 2,
        };
        let check = |seqs: Vec<SeqRequest>, poison| {
            BatchRequest { seqs, poison }
                .validate("e", 10, &serving)
                .err()
                .map(|e| e.to_string())
                .unwrap_or_default()
        };
        assert!(check(vec![], None).contains("no sequences"));
        let ok = seq(vec![1, 2, 3], vec![], None);
        assert!(check(vec![ok.clone(); 3], None).contains("at most 2"));
        assert!(check(vec![ok.clone()], Some(Poison::Nan)).contains("no poison hook"));
        assert!(check(vec![seq(vec![1, 2, 3], vec![1, 1], None)], None).contains("sum to the 3"));
        let hit = |from, len, prompt| seq(prompt, vec![], Some(PrefixHit { from, len }));
        assert!(check(vec![hit(0, 1, vec![1, 2])], None).contains("not an earlier sequence"));
        assert!(check(vec![ok.clone(), hit(0, 3, vec![1, 2, 3])], None).contains("shorter than its prompt"));
        assert!(check(vec![ok.clone(), hit(0, 2, vec![1, 9, 3])], None).contains("differ from sequence 0"));
        assert_eq!(check(vec![ok, hit(0, 2, vec![1, 2, 9, 9])], None), "");
    }
}
