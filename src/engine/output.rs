//! One run's tensors as a file: what a protocol engine writes for each `run`
//! request, what `--engine dumps:` reads, and what `run --save-captures`
//! writes. Float tensors `<step>/<name>` (names canonical, or mapped by
//! `names:`), plus `tokens`, an integer tensor of shape `[1 + N]`: the token
//! sampled after each step.

use std::collections::BTreeMap;
use std::path::Path;

use super::names::NameMap;
use super::{Captures, RunOutput, RunRequest};
use crate::error::{Error, Result};
use crate::model::ModelConfig;
use crate::stage::shape::canonical_shape;
use crate::stage::Step;
use crate::tensor::io::TensorFile;
use crate::tensor::Tensor;

/// (T, S) of `step` for a request with a prompt of `prompt_len` tokens whose
/// prefill computed the positions from `from` on (0; a prefix hit's L).
fn step_dims(prompt_len: usize, from: usize, step: Step) -> (usize, usize) {
    match step {
        Step::Prefill => (prompt_len - from, prompt_len),
        Step::Decode(n) => (1, prompt_len + n),
    }
}

/// What a run file holds besides its captures: names that are neither
/// canonical nor mapped (shown when a tapped stage is missing).
pub struct Read {
    pub output: RunOutput,
    pub unmapped: Vec<String>,
}

/// Reads a run file for `req`. Steps past the request's are ignored; a
/// tensor of a step or stage the request did not ask for is simply unused.
pub fn read_run(file: &TensorFile, names: &NameMap, cfg: &ModelConfig, req: &RunRequest, engine: &str) -> Result<Read> {
    read_run_from(file, names, cfg, req, 0, engine)
}

/// `read_run` for a sequence whose prefill computed positions `from..T`
/// only (a prefix-cache hit of `from` positions: its prefill tensors have
/// T − from rows). Per-rank tensors (`shards`) are joined first.
pub fn read_run_from(
    file: &TensorFile,
    names: &NameMap,
    cfg: &ModelConfig,
    req: &RunRequest,
    from: usize,
    engine: &str,
) -> Result<Read> {
    let bad = |msg: String| Error::engine(engine, format!("{}: {msg}", file.path.display()));
    let mut captures = Captures::default();
    let mut unmapped = Vec::new();
    let joined = join_ranks(file, names, cfg, req, from).map_err(bad)?;
    for (key, t) in file
        .floats
        .iter()
        .filter(|(k, _)| !k.contains('@'))
        .chain(joined.iter())
    {
        let Some((step_name, name)) = key.split_once('/') else {
            unmapped.push(key.clone());
            continue;
        };
        let Some(step) = Step::parse(step_name) else {
            unmapped.push(key.clone());
            continue;
        };
        if step.index() > req.decode_steps {
            continue;
        }
        let Some((stage, reshape)) = names.resolve(name) else {
            unmapped.push(key.clone());
            continue;
        };
        let mut t = t.clone();
        if reshape {
            let (tt, s) = step_dims(req.prompt.len(), from, step);
            let want = canonical_shape(cfg, stage, tt, s, req.image.as_ref().map(|i| i.dims()));
            if want.iter().product::<usize>() == t.numel() {
                t = Tensor::new(want, t.data().to_vec()).with_dtype(t.dtype());
            }
        }
        captures.insert(step, stage, t);
    }
    let n = req.decode_steps + 1;
    let (shape, ids) = file.ints.get("tokens").ok_or_else(|| {
        bad(format!(
            "no `tokens` tensor (an integer tensor [{n}]: the token sampled after each step)"
        ))
    })?;
    if ids.len() < n || shape.iter().product::<usize>() != ids.len() {
        return Err(bad(format!(
            "`tokens` has shape {shape:?}; the run has {n} steps (prefill + {} decode), so it needs [{n}]",
            req.decode_steps
        )));
    }
    let sampled = ids[..n]
        .iter()
        .map(|&v| u32::try_from(v).ok().filter(|&x| (x as usize) < cfg.vocab))
        .collect::<Option<Vec<u32>>>()
        .ok_or_else(|| {
            bad(format!(
                "`tokens` {:?} holds an id outside the vocabulary of {}",
                &ids[..n],
                cfg.vocab
            ))
        })?;
    let positions = Step::sequence(req.decode_steps)
        .into_iter()
        .map(|st| {
            let (t, s) = step_dims(req.prompt.len(), from, st);
            (s - t..s).collect()
        })
        .collect();
    unmapped.sort();
    Ok(Read {
        output: RunOutput {
            captures,
            sampled,
            positions,
            unmapped: Vec::new(),
        },
        unmapped,
    })
}

/// The stages answered per rank (`<step>/<stage>@rank…`), each joined into
/// its canonical tensor under its plain name.
fn join_ranks(
    file: &TensorFile,
    names: &NameMap,
    cfg: &ModelConfig,
    req: &RunRequest,
    from: usize,
) -> std::result::Result<BTreeMap<String, Tensor>, String> {
    let mut pieces: BTreeMap<&str, Vec<super::shards::Piece>> = BTreeMap::new();
    for (key, t) in file.floats.iter().filter(|(k, _)| k.contains('@')) {
        let (base, rank, part) = super::shards::parse(key).expect("has @")?;
        pieces.entry(base).or_default().push(super::shards::Piece {
            rank,
            part,
            tensor: t.clone(),
        });
    }
    let mut out = BTreeMap::new();
    for (base, ps) in pieces {
        let resolved = base
            .split_once('/')
            .and_then(|(st, name)| Some((Step::parse(st)?, names.resolve(name)?.0)));
        let Some((step, stage)) = resolved else {
            return Err(format!(
                "`{base}`: per-rank tensors of a name that is not `<step>/<stage>`"
            ));
        };
        let (tt, s) = step_dims(req.prompt.len(), from, step);
        let shape = canonical_shape(cfg, stage, tt, s, req.image.as_ref().map(|i| i.dims()));
        out.insert(base.to_string(), super::shards::join(base, &shape, ps)?);
    }
    Ok(out)
}

/// Writes a run's captures and sampled tokens as a run file (F32 tensors).
pub fn write_run(path: &Path, out: &RunOutput, metadata: &BTreeMap<String, String>) -> Result<()> {
    let floats: BTreeMap<String, Tensor> = out
        .captures
        .iter()
        .map(|((step, stage), t)| (format!("{step}/{stage}"), t.clone()))
        .collect();
    let ints: BTreeMap<String, (Vec<usize>, Vec<i64>)> = [(
        "tokens".to_string(),
        (vec![out.sampled.len()], out.sampled.iter().map(|&x| x as i64).collect()),
    )]
    .into_iter()
    .collect();
    crate::tensor::io::write_safetensors(path, &floats, &ints, metadata)
}
