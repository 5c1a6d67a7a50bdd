//! The command line: argument parsing (clap) and the three commands. `main`
//! only maps the outcome to an exit code: 0 all passed, 1 a check failed,
//! 2 bad input or usage.

use std::path::{Path, PathBuf};

use clap::{Parser, Subcommand, ValueEnum};

use crate::engine::EngineKind;
use crate::error::{Error, Result};
use crate::goldens::SourceFilter;
use crate::plan::Plan;
use crate::report::{self, Report};
use crate::runner::{run_plan, Filter};
use crate::spec::Spec;
use crate::tensor::DType;

/// The spec run when none is given.
pub const DEFAULT_SPEC: &str = "specs/qwen2-tiny.yaml";

#[derive(Parser, Debug)]
#[command(
    name = "touchstone",
    version,
    about = "Golden-reference conformance harness for LLM inference engines",
    long_about = "touchstone runs an inference engine with taps on every canonical stage and checks each \
                        stage against YAML-declared invariants and golden tensors recorded from reference \
                        implementations.\n\nExit status: 0 all checks passed, 1 a check failed, 2 bad input or usage."
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Run specs on an engine and report every check (exit 0 pass, 1 fail, 2 bad input).
    Run {
        /// Spec files (default: specs/qwen2-tiny.yaml).
        specs: Vec<PathBuf>,
        /// Engine to run.
        #[arg(long, value_enum, default_value_t = EngineArg::Cpu)]
        engine: EngineArg,
        /// Model to run instead of the spec's (an HF model folder or a .gguf file).
        #[arg(long)]
        model: Option<PathBuf>,
        /// Test aid: keep llama.cpp's Q/K row permutation of Llama GGUF weights
        /// instead of undoing it, to show the failure it causes (first divergence
        /// at blk.0.q). Hidden: never needed for a real run.
        #[arg(long, hide = true)]
        keep_gguf_qk_permutation: bool,
        /// Storage dtype the engine runs in (f32, f16 or bf16): weights and stage
        /// outputs rounded to it, arithmetic in f32. Overrides the spec's `storage:`
        /// (default f32); golden tolerances then come from that dtype's entry.
        #[arg(long, value_name = "DTYPE", value_parser = parse_storage)]
        storage: Option<DType>,
        /// Also write the report as JSON to this file.
        #[arg(long, value_name = "FILE")]
        json: Option<PathBuf>,
        /// Run only checks whose id contains this text (repeatable), e.g.
        /// `decode2/blk.1.q::golden:hf`.
        #[arg(long, value_name = "ID")]
        only: Vec<String>,
        /// Fail (exit 2) instead of skipping when a requested GPU engine is unavailable.
        #[arg(long)]
        require_gpu: bool,
        #[command(flatten)]
        sinks: SinkArgs,
    },
    /// List the check instances of specs (the ids `--only` and `cargo test` filter on).
    List {
        specs: Vec<PathBuf>,
        #[arg(long, value_enum, default_value_t = EngineArg::Cpu)]
        engine: EngineArg,
        #[arg(long)]
        model: Option<PathBuf>,
    },
    /// Show the tensors, dtypes, shapes, statistics and provenance of a .safetensors, .npy or .gguf
    /// file (GGUF: version, metadata and the tensor table too).
    Inspect { file: PathBuf },
    /// Compile every CUDA kernel with NVRTC and, where ptxas is on PATH, report
    /// registers, shared memory, stack and spills (exit 1 on a compile error or spill).
    Kernels {
        /// GPU architecture (repeatable; default sm_90 and sm_80).
        #[arg(long, value_name = "SM")]
        arch: Vec<String>,
    },
    /// Regenerate goldens into pending files, review, accept or reject them.
    Goldens {
        #[command(subcommand)]
        action: GoldensAction,
    },
    /// Regression report between two `run --json` reports (exit 1 on a regression).
    Diff {
        base: PathBuf,
        new: PathBuf,
        /// A passing check regresses when its error grows by more than this factor.
        #[arg(long, default_value_t = 10.0)]
        factor: f64,
        #[command(flatten)]
        sinks: SinkArgs,
    },
    /// Compare two tensor files (.safetensors, .npy, .npz) tensor by tensor (exit 1 if any differs).
    Compare {
        a: PathBuf,
        b: PathBuf,
        /// Absolute tolerance (default: by dtype, as golden checks).
        #[arg(long)]
        atol: Option<f64>,
        /// Relative tolerance (default: by dtype).
        #[arg(long)]
        rtol: Option<f64>,
    },
}

/// Extra report files (`run` and `diff`).
#[derive(clap::Args, Debug, Default)]
pub struct SinkArgs {
    /// Write JUnit XML (one testcase per check) to this file.
    #[arg(long, value_name = "FILE")]
    pub junit: Option<PathBuf>,
    /// Write a Markdown summary (failures first) to this file.
    #[arg(long, value_name = "FILE")]
    pub markdown: Option<PathBuf>,
    /// Write a self-contained HTML page with per-layer error plots to this file.
    #[arg(long, value_name = "FILE")]
    pub html: Option<PathBuf>,
}

#[derive(Subcommand, Debug)]
pub enum GoldensAction {
    /// Record goldens into pending `<golden>.new` files and show the change
    /// (exit 0 unchanged, 1 changed; refused with exit 2 when CI is set).
    Regen {
        /// Spec files (default: specs/qwen2-tiny.yaml).
        specs: Vec<PathBuf>,
        #[arg(long, value_enum, default_value_t = SourceArg::All)]
        source: SourceArg,
        /// Python interpreter with the pinned recorder packages (default: $TOUCHSTONE_CACHE/recorders-venv).
        #[arg(long)]
        python: Option<PathBuf>,
    },
    /// List pending goldens.
    Status { specs: Vec<PathBuf> },
    /// Replace goldens with their pending files (atomic rename).
    Accept {
        specs: Vec<PathBuf>,
        #[arg(long, value_enum, default_value_t = SourceArg::All)]
        source: SourceArg,
    },
    /// Delete pending goldens.
    Reject {
        specs: Vec<PathBuf>,
        #[arg(long, value_enum, default_value_t = SourceArg::All)]
        source: SourceArg,
    },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum SourceArg {
    Hf,
    #[value(name = "llama.cpp")]
    LlamaCpp,
    All,
}

impl SourceArg {
    fn filter(self) -> SourceFilter {
        match self {
            SourceArg::Hf => SourceFilter::Hf,
            SourceArg::LlamaCpp => SourceFilter::LlamaCpp,
            SourceArg::All => SourceFilter::All,
        }
    }
}

impl SinkArgs {
    /// Writes each requested file (atomically) from its renderer.
    fn write(
        &self,
        junit: impl Fn() -> String,
        markdown: impl Fn() -> String,
        html: impl Fn() -> String,
    ) -> Result<()> {
        for (path, render) in [
            (&self.junit, &junit as &dyn Fn() -> String),
            (&self.markdown, &markdown),
            (&self.html, &html),
        ] {
            if let Some(p) = path {
                crate::goldens::pending::write_atomic(p, render().as_bytes())?;
            }
        }
        Ok(())
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum EngineArg {
    Cpu,
    Cuda,
    All,
}

impl EngineArg {
    pub fn kinds(self) -> Vec<EngineKind> {
        match self {
            EngineArg::Cpu => vec![EngineKind::Cpu],
            EngineArg::Cuda => vec![EngineKind::Cuda],
            EngineArg::All => EngineKind::ALL.to_vec(),
        }
    }
}

/// `--storage`: the dtype names specs use.
fn parse_storage(s: &str) -> std::result::Result<DType, String> {
    DType::parse(s).ok_or_else(|| format!("unknown dtype `{s}` (known: f32, f16, bf16)"))
}

/// What a command achieved, for the exit code.
pub enum Outcome {
    Passed,
    Failed,
}

/// The default spec: in the working directory if present, else in the source tree
/// this binary was built from (so `cargo run` works from any folder of the repo).
pub fn default_spec() -> PathBuf {
    let local = PathBuf::from(DEFAULT_SPEC);
    if local.exists() {
        local
    } else {
        Path::new(env!("CARGO_MANIFEST_DIR")).join(DEFAULT_SPEC)
    }
}

fn specs_or_default(specs: Vec<PathBuf>) -> Vec<PathBuf> {
    if specs.is_empty() {
        vec![default_spec()]
    } else {
        specs
    }
}

pub fn execute(cli: Cli) -> Result<Outcome> {
    match cli.command {
        Command::Run {
            specs,
            engine,
            model,
            keep_gguf_qk_permutation,
            storage,
            json,
            only,
            require_gpu,
            sinks,
        } => {
            if require_gpu {
                for kind in engine.kinds().into_iter().filter(|k| *k != EngineKind::Cpu) {
                    if let crate::engine::Availability::Unavailable(reason) = kind.availability() {
                        return Err(Error::Usage(format!(
                            "--require-gpu: the {} engine is unavailable: {reason}",
                            kind.name()
                        )));
                    }
                }
            }
            let filter = Filter(if only.is_empty() { None } else { Some(only) });
            let mut report = Report::default();
            // Plan everything first so bad input anywhere fails before any engine runs.
            let plans = specs_or_default(specs)
                .iter()
                .map(|p| {
                    let mut plan = Plan::build(Spec::load(p)?, model.as_deref())?;
                    plan.load_options.keep_gguf_qk_permutation = keep_gguf_qk_permutation;
                    if let Some(s) = storage {
                        plan.load_options.storage = s;
                    }
                    Ok(plan)
                })
                .collect::<Result<Vec<_>>>()?;
            for plan in &plans {
                for kind in engine.kinds() {
                    report.runs.push(run_plan(plan, kind, &filter, model.as_deref())?);
                }
            }
            let selected: usize = report.runs.iter().map(|r| r.outcomes.len()).sum();
            if selected == 0 {
                return Err(Error::Usage(
                    "no check matched --only; `touchstone list` shows the ids".into(),
                ));
            }
            print!("{}", report::terminal::render(&report));
            if let Some(path) = json {
                report::json::write(&report, &path)?;
            }
            sinks.write(
                || report::junit::render(&report),
                || report::markdown::render(&report),
                || report::html::render(&report),
            )?;
            Ok(if report.passed() {
                Outcome::Passed
            } else {
                Outcome::Failed
            })
        }
        Command::List { specs, engine, model } => {
            for p in specs_or_default(specs) {
                let plan = Plan::build(Spec::load(&p)?, model.as_deref())?;
                for kind in engine.kinds() {
                    for c in &plan.checks {
                        println!("{}::{}::{}", kind.name(), plan.spec.name, c.id);
                    }
                }
            }
            Ok(Outcome::Passed)
        }
        Command::Kernels { arch } => crate::kernels::run(&arch),
        Command::Inspect { file } => {
            print!("{}", crate::inspect::render(&file)?);
            Ok(Outcome::Passed)
        }
        Command::Goldens { action } => goldens(action),
        Command::Diff {
            base,
            new,
            factor,
            sinks,
        } => {
            use crate::diff::render;
            let d = crate::diff::diff_files(&base, &new, factor)?;
            print!("{}", render::terminal(&d));
            sinks.write(|| render::junit(&d), || render::markdown(&d), || render::html(&d))?;
            Ok(if d.regressed() {
                Outcome::Failed
            } else {
                Outcome::Passed
            })
        }
        Command::Compare { a, b, atol, rtol } => {
            let c = crate::compare_files::compare_files(&a, &b, atol, rtol)?;
            print!("{}", c.text);
            Ok(if c.passed { Outcome::Passed } else { Outcome::Failed })
        }
    }
}

fn goldens(action: GoldensAction) -> Result<Outcome> {
    use crate::goldens::{jobs, pending, refs, regen, repo_root};
    match action {
        GoldensAction::Regen { specs, source, python } => {
            // Refuse before reading anything, so CI cannot write even a cache file.
            regen::refuse_on_ci("regenerate")?;
            let specs = specs_or_default(specs);
            let jobs = jobs(&specs, source.filter())?;
            let r = regen::regen(&repo_root(&specs[0]), &jobs, python.as_deref())?;
            print!("{}", r.text);
            Ok(if r.changed { Outcome::Failed } else { Outcome::Passed })
        }
        GoldensAction::Status { specs } => {
            print!(
                "{}",
                pending::status(&refs(&jobs(&specs_or_default(specs), SourceFilter::All)?))
            );
            Ok(Outcome::Passed)
        }
        GoldensAction::Accept { specs, source } => {
            regen::refuse_on_ci("accept")?;
            print!(
                "{}",
                pending::accept(&refs(&jobs(&specs_or_default(specs), source.filter())?))?
            );
            Ok(Outcome::Passed)
        }
        GoldensAction::Reject { specs, source } => {
            print!(
                "{}",
                pending::reject(&refs(&jobs(&specs_or_default(specs), source.filter())?))?
            );
            Ok(Outcome::Passed)
        }
    }
}
