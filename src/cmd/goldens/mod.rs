//! The golden review flow, modelled on insta's pending snapshots: `regen`
//! records goldens into pending files beside the committed ones and shows what
//! changed; `status` lists pending files; `accept` renames them over the
//! goldens (atomic); `reject` deletes them. CI never writes goldens. A
//! spec's goldens are those of `goldens:` and `oracle:`, and the folder of
//! next-token goldens its `next_token` run check names (`next_token`).

mod args;
mod aux;
pub mod change;
pub mod job;
pub mod next_token;
pub mod pending;
mod progress;
mod record;
pub mod regen;
mod venv;

use std::path::{Path, PathBuf};

use super::specs::specs_or_default;
use super::Outcome;
use crate::cli::{GoldensAction, SourceArg};
use crate::error::{Error, Result};
use crate::plan::Plan;
use crate::spec::Spec;
use job::{Job, RecordArgs, Recorder};
use pending::{GoldenKind, GoldenRef};

/// Which golden sources a command applies to (`--source`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SourceFilter {
    Hf,
    LlamaCpp,
    Oracle,
    All,
}

impl SourceFilter {
    fn accepts(self, source: &str) -> bool {
        match self {
            SourceFilter::All => true,
            // HF at any dtype (`hf`, `hf-bf16`, `hf-f16`).
            SourceFilter::Hf => matches!(Recorder::for_source(source), Some(Recorder::Hf | Recorder::HfHalf(_))),
            SourceFilter::LlamaCpp => Recorder::for_source(source) == Some(Recorder::LlamaCpp),
            SourceFilter::Oracle => Recorder::for_source(source) == Some(Recorder::Oracle),
        }
    }
}

/// The repository a spec belongs to (`engine::third_party::repo_root`: the
/// nearest ancestor holding `goldens/recorders/requirements.txt`, else the
/// source tree of this binary), where the recorders and their venv's
/// requirements are.
pub fn repo_root(spec: &Path) -> PathBuf {
    crate::engine::third_party::repo_root(spec)
}

/// Every golden the specs declare (a `next_token` check's five files
/// included), filtered by source, with the spec's model.
pub fn jobs(specs: &[PathBuf], filter: SourceFilter) -> Result<Vec<Job>> {
    let mut jobs = Vec::new();
    for p in specs {
        let spec = Spec::load(p)?;
        let oracle = spec
            .oracle
            .iter()
            .map(|o| (crate::golden::ORACLE.to_string(), o.clone()));
        let sources: Vec<(String, PathBuf)> = spec
            .goldens
            .iter()
            .map(|(s, g)| (s.clone(), g.clone()))
            .chain(oracle)
            .collect();
        for (source, golden) in &sources {
            if !filter.accepts(source) {
                continue;
            }
            let recorder = Recorder::for_source(source).ok_or_else(|| {
                Error::Usage(format!(
                    "{}: no recorder for golden source `{source}` (known: hf, hf-bf16, hf-f16, llama.cpp, and the spec's oracle)",
                    p.display()
                ))
            })?;
            jobs.push(Job {
                golden: GoldenRef {
                    spec: spec.name.clone(),
                    source: source.clone(),
                    golden: golden.clone(),
                    kind: GoldenKind::Stage,
                },
                model: spec.model.clone(),
                recorder,
                args: record_args(&spec),
            });
        }
        jobs.extend(next_token::jobs(&spec, filter, record_args(&spec).kv_f16)?);
    }
    if jobs.is_empty() {
        return Err(Error::Usage(format!(
            "no golden matches --source {filter:?} in {}",
            specs
                .iter()
                .map(|p| p.display().to_string())
                .collect::<Vec<_>>()
                .join(", ")
        )));
    }
    Ok(jobs)
}

/// The recorder arguments a spec asks for: its prompt text and decode steps,
/// and its `record:` subset.
fn record_args(spec: &Spec) -> RecordArgs {
    RecordArgs {
        config_override: spec.config.as_ref().map(|c| c.to_string()),
        tokens: spec.prompt.tokens.clone(),
        prompt: spec.prompt.text.clone(),
        chat: spec.prompt.chat,
        decode_steps: spec.prompt.decode_steps,
        image: spec.prompt.image.clone(),
        steps: spec.record.steps.clone(),
        stages: spec.record.stages.clone(),
        stages_at: spec.record.stages_at.clone(),
        logits_last: spec.record.logits == crate::spec::LogitsRows::Last,
        rows: spec.record.rows.clone(),
        kv_f16: spec
            .scaled
            .arithmetic
            .iter()
            .any(|(src, a)| Recorder::for_source(src) == Some(Recorder::LlamaCpp) && a.kv == crate::tensor::DType::F16),
        sample_probs: match spec.sampling {
            crate::sampling::Sampling::Random {
                temperature,
                top_k,
                top_p,
            } => Some(format!("{temperature},{},{}", top_k.unwrap_or(0), top_p.unwrap_or(1.0))),
            crate::sampling::Sampling::Greedy => None,
        },
        hf_golden: spec
            .goldens
            .iter()
            .find(|(source, _)| Recorder::for_source(source) == Some(Recorder::Hf))
            .map(|(_, path)| path.clone()),
        oracle: spec.oracle.clone(),
        prompt_set: None,
        arithmetic: None,
    }
}

pub fn refs(jobs: &[Job]) -> Vec<GoldenRef> {
    jobs.iter().map(|j| j.golden.clone()).collect()
}

pub fn execute(action: GoldensAction) -> Result<Outcome> {
    use crate::cmd::goldens::{jobs, pending, refs, regen, repo_root};
    match action {
        GoldensAction::Regen { specs, source, python } => {
            // Refuse before reading anything, so CI cannot write even a cache file.
            regen::refuse_on_ci("regenerate")?;
            let specs = specs_or_default(specs)?;
            let jobs = jobs(&specs, filter(source))?;
            let r = regen::regen(&repo_root(&specs[0]), &jobs, python.as_deref())?;
            print!("{}", r.text);
            if !r.failed.is_empty() {
                return Err(Error::Usage(format!(
                    "{} golden(s) not recorded: {}",
                    r.failed.len(),
                    r.failed
                        .iter()
                        .map(|(l, why)| format!("{l}: {why}"))
                        .collect::<Vec<_>>()
                        .join("; ")
                )));
            }
            Ok(if r.changed { Outcome::Failed } else { Outcome::Passed })
        }
        GoldensAction::Status { specs, check } => {
            let specs = specs_or_default(specs)?;
            let (text, mut attention) = pending::status_count(&refs(&jobs(&specs, SourceFilter::All)?));
            print!("{text}");
            if check {
                // Stale goldens: the plan's freshness check (model hash, config
                // dimensions, prompt) is what `run` would stop on.
                for p in &specs {
                    if let Err(e) = Spec::load(p).and_then(|s| Plan::build(s, None)) {
                        attention += 1;
                        println!("STALE or unusable: {e}");
                    }
                }
                if attention > 0 {
                    println!("goldens status --check: {attention} item(s) need attention");
                    return Ok(Outcome::Failed);
                }
                println!("goldens status --check: nothing pending, nothing stale");
            }
            Ok(Outcome::Passed)
        }
        GoldensAction::Accept { specs, source } => {
            regen::refuse_on_ci("accept")?;
            print!(
                "{}",
                pending::accept(&refs(&jobs(&specs_or_default(specs)?, filter(source))?))?
            );
            Ok(Outcome::Passed)
        }
        GoldensAction::Args { spec, null } => {
            let sp = Spec::load(&spec)?;
            let args = record_args(&sp);
            let golden = sp
                .goldens
                .values()
                .next()
                .or(sp.oracle.as_ref())
                .cloned()
                .unwrap_or_default();
            let mut out = args::subset_args(&args);
            out.extend(aux::aux_args(&sp.model, &args, args::decode_steps(&golden, &args))?);
            let sep = if null { "\0" } else { "\n" };
            print!("{}", out.iter().map(|a| format!("{a}{sep}")).collect::<String>());
            Ok(Outcome::Passed)
        }
        GoldensAction::Reject { specs, source } => {
            print!(
                "{}",
                pending::reject(&refs(&jobs(&specs_or_default(specs)?, filter(source))?))?
            );
            Ok(Outcome::Passed)
        }
    }
}

/// `--source` as a filter.
fn filter(source: SourceArg) -> SourceFilter {
    match source {
        SourceArg::Hf => SourceFilter::Hf,
        SourceArg::LlamaCpp => SourceFilter::LlamaCpp,
        SourceArg::Oracle => SourceFilter::Oracle,
        SourceArg::All => SourceFilter::All,
    }
}
