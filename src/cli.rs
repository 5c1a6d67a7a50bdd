//! The command line: argument parsing (clap) and the three commands. `main`
//! only maps the outcome to an exit code: 0 all passed, 1 a check failed,
//! 2 bad input or usage.

use std::path::{Path, PathBuf};

use clap::{Parser, Subcommand, ValueEnum};

use crate::cmd::goldens::SourceFilter;
use crate::engine::select::EngineSel;
use crate::engine::EngineKind;
use crate::error::{Error, Result};
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
        /// Spec files or folders of specs (every *.yaml in a folder). Default:
        /// the nearest specs/ folder up from the working directory — its
        /// qwen2-tiny.yaml in a touchstone checkout, else every spec in it.
        specs: Vec<PathBuf>,
        /// Engine to run: `cpu`, `cuda`, `cuda-emu` (the CUDA engine on the
        /// emulated device, no GPU needed), `all` (every built-in, and every
        /// engine the spec declares), a name under the spec's `engines:`, `exec:COMMAND ARGS…`
        /// (any program speaking the subprocess protocol, README "Testing your
        /// own engine"), or `dumps:PATH` (tensors another program wrote).
        #[arg(long, default_value = "cpu", value_name = "ENGINE")]
        engine: String,
        /// Model to run instead of the spec's (an HF model folder or a .gguf file).
        #[arg(long)]
        model: Option<PathBuf>,
        /// Also write the tensors of the main run (every tapped stage at every
        /// step, and the sampled tokens) to this safetensors file: what
        /// `--engine dumps:FILE` checks again later. One spec and one engine only.
        #[arg(long, value_name = "FILE")]
        save_captures: Option<PathBuf>,
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
        /// Run only checks whose id contains this text, or matches this glob
        /// (`*` any text, `?` one character), repeatable: e.g.
        /// `decode2/blk.1.q::golden:hf` or `decode2/blk.1.*`.
        #[arg(long, value_name = "ID")]
        only: Vec<String>,
        /// Summary and failures only (no stage table, no passing run checks).
        #[arg(short, long, conflicts_with = "verbose")]
        quiet: bool,
        /// Every row of the stage table (by default a long table shows only the
        /// rows that did not pass).
        #[arg(short, long)]
        verbose: bool,
        /// Colour the report: auto (on a terminal, unless NO_COLOR is set), always, never.
        #[arg(long, value_enum, default_value_t = ColorArg::Auto, value_name = "WHEN")]
        color: ColorArg,
        /// Fail (exit 2) instead of skipping when a requested GPU engine is unavailable.
        #[arg(long)]
        require_gpu: bool,
        /// Exit 0 even when nothing ran (every check skipped, e.g. `--engine cuda`
        /// without a GPU); the summary still says NOTHING RAN. Without it such a
        /// run exits 1: a run that checked nothing is not a pass.
        #[arg(long)]
        allow_skip: bool,
        #[command(flatten)]
        sinks: SinkArgs,
    },
    /// List the check instances of specs (the ids `--only` and `cargo test` filter on).
    List {
        /// Spec files or folders of specs (default: as for `run`).
        specs: Vec<PathBuf>,
        /// Engine whose trial names to list (as for `run`).
        #[arg(long, default_value = "cpu", value_name = "ENGINE")]
        engine: String,
        #[arg(long)]
        model: Option<PathBuf>,
    },
    /// Show the tensors, dtypes, shapes, statistics and provenance of a .safetensors, .npy or .gguf
    /// file (GGUF: version, metadata and the tensor table too).
    Inspect {
        /// The file to show: .safetensors, .npy, .npz or .gguf.
        file: PathBuf,
    },
    /// Compile every CUDA kernel with NVRTC and, where ptxas is on PATH, report
    /// registers, shared memory, stack and spills (exit 1 on a compile error or spill).
    Kernels {
        /// GPU architecture (repeatable; default sm_90 and sm_80).
        #[arg(long, value_name = "SM")]
        arch: Vec<String>,
        /// Accept a check without ptxas: compile to PTX only, registers and
        /// spills unchecked (without this flag a missing ptxas fails, exit 1).
        #[arg(long)]
        ptx_only: bool,
    },
    /// Regenerate goldens into pending files, review, accept or reject them.
    Goldens {
        #[command(subcommand)]
        action: GoldensAction,
    },
    /// Regression report between two `run --json` reports (exit 1 on a regression).
    Diff {
        /// The baseline report (`touchstone run --json BASE.json`, before the change).
        base: PathBuf,
        /// The report to judge (after the change).
        new: PathBuf,
        /// A passing check regresses when its error grows by more than this factor.
        #[arg(long, default_value_t = 10.0)]
        factor: f64,
        /// Accept checks of BASE that are missing from NEW (by default they fail
        /// the diff, exit 1: a smaller report is not "no regression").
        #[arg(long)]
        allow_vanished: bool,
        /// Show only rows whose status or error changed.
        #[arg(long)]
        changed: bool,
        #[command(flatten)]
        sinks: SinkArgs,
    },
    /// Benchmarks for comparing touchstone with its peers (not checks; not run in CI): one JSON
    /// line per measurement on stdout, a readable line on stderr. `ci/bench.sh` runs them
    /// interleaved with llama.cpp, HF transformers, numpy and torch (README "Benchmarks").
    #[command(subcommand)]
    Bench(crate::cmd::bench::BenchCmd),
    /// Compare two tensor files (.safetensors, .npy, .npz) tensor by tensor (exit 1 if any differs).
    Compare {
        /// First tensor file (.safetensors, .npy, .npz).
        a: PathBuf,
        /// Second tensor file; tensors are matched by name (two single-tensor
        /// files are compared with each other whatever their names).
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
        /// Spec files or folders of specs whose goldens to record (default: as for `run`).
        specs: Vec<PathBuf>,
        #[arg(long, value_enum, default_value_t = SourceArg::All)]
        source: SourceArg,
        /// Python interpreter with the pinned recorder packages (default: $TOUCHSTONE_CACHE/recorders-venv).
        #[arg(long)]
        python: Option<PathBuf>,
    },
    /// List pending goldens (and, with --check, stale ones).
    Status {
        /// Spec files or folders of specs (default: as for `run`).
        specs: Vec<PathBuf>,
        /// Exit 1 when anything is pending, left over from an interrupted write,
        /// or stale (recorded for another model, config or prompt): for CI.
        #[arg(long)]
        check: bool,
    },
    /// Replace goldens with their pending files (atomic rename).
    Accept {
        /// Spec files or folders of specs whose pending goldens to accept (default: as for `run`).
        specs: Vec<PathBuf>,
        #[arg(long, value_enum, default_value_t = SourceArg::All)]
        source: SourceArg,
    },
    /// Delete pending goldens.
    Reject {
        /// Spec files or folders of specs whose pending goldens to delete (default: as for `run`).
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
    /// The spec's `oracle:` (HF in float64).
    Oracle,
    All,
}

impl SourceArg {
    fn filter(self) -> SourceFilter {
        match self {
            SourceArg::Hf => SourceFilter::Hf,
            SourceArg::LlamaCpp => SourceFilter::LlamaCpp,
            SourceArg::Oracle => SourceFilter::Oracle,
            SourceArg::All => SourceFilter::All,
        }
    }
}

impl SinkArgs {
    /// The report outputs with `json` first, resolved (checked) before the run.
    fn resolve(&self, json: Option<&Path>) -> Result<report::outputs::Outputs> {
        report::outputs::Outputs::resolve(&[
            ("--json", json),
            ("--junit", self.junit.as_deref()),
            ("--markdown", self.markdown.as_deref()),
            ("--html", self.html.as_deref()),
        ])
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum ColorArg {
    Auto,
    Always,
    Never,
}

impl ColorArg {
    /// Whether to colour output going to stdout (`auto`: a terminal, and
    /// NO_COLOR unset or empty, as no-color.org asks).
    fn enabled(self, to_stderr: bool) -> bool {
        use std::io::IsTerminal;
        match self {
            ColorArg::Always => true,
            ColorArg::Never => false,
            ColorArg::Auto => {
                let tty = if to_stderr {
                    std::io::stderr().is_terminal()
                } else {
                    std::io::stdout().is_terminal()
                };
                tty && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty())
            }
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

/// A spinner on stderr while a spec runs (model loading and engine runs take
/// seconds to minutes on a real model); nothing when stderr is not a terminal.
fn progress(msg: &str) -> Option<indicatif::ProgressBar> {
    use std::io::IsTerminal;
    if !std::io::stderr().is_terminal() {
        return None;
    }
    let b = indicatif::ProgressBar::new_spinner();
    b.set_style(indicatif::ProgressStyle::with_template("{spinner} {msg} {elapsed}").expect("valid template"));
    b.set_message(msg.to_string());
    b.enable_steady_tick(std::time::Duration::from_millis(120));
    Some(b)
}

/// With no SPEC: the nearest `specs/` folder from the working directory up
/// through its parents; its default spec (`qwen2-tiny.yaml`, touchstone's own
/// checkout) when it has one, else every spec in it. Says on stderr which it
/// used. Never a path compiled into the binary: a run from elsewhere must not
/// silently check touchstone's own spec.
fn discover_specs() -> Result<Vec<PathBuf>> {
    let cwd = std::env::current_dir().map_err(|e| Error::Usage(format!("cannot read the working directory: {e}")))?;
    for (up, abs) in cwd.ancestors().enumerate() {
        if !abs.join("specs").is_dir() {
            continue;
        }
        // Shown relative to the working directory (`specs/…`, `../specs/…`).
        let dir: PathBuf = std::iter::repeat_n("..", up).collect();
        let specs = dir.join("specs");
        let default = dir.join(DEFAULT_SPEC);
        let chosen = if default.is_file() {
            vec![default]
        } else {
            spec_files_in(&specs)?
        };
        if chosen.is_empty() {
            continue;
        }
        let shown: Vec<String> = chosen.iter().map(|p| p.display().to_string()).collect();
        eprintln!("touchstone: no SPEC given; using {}", shown.join(", "));
        return Ok(chosen);
    }
    Err(Error::Usage(format!(
        "no SPEC given and no specs/ folder with a spec in {} or its parents: name a spec file or a folder of specs",
        cwd.display()
    )))
}

/// The `*.yaml` / `*.yml` files of a folder, sorted.
fn spec_files_in(dir: &Path) -> Result<Vec<PathBuf>> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(|e| Error::io(dir, e))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.is_file() && p.extension().is_some_and(|x| x == "yaml" || x == "yml"))
        .collect();
    v.sort();
    Ok(v)
}

/// The specs named (a folder stands for every spec in it), or the discovered
/// default when none is named.
fn specs_or_default(specs: Vec<PathBuf>) -> Result<Vec<PathBuf>> {
    if specs.is_empty() {
        return discover_specs();
    }
    let mut out = Vec::new();
    for p in specs {
        if p.is_dir() {
            let files = spec_files_in(&p)?;
            if files.is_empty() {
                return Err(Error::Usage(format!(
                    "{}: a folder with no *.yaml spec in it",
                    p.display()
                )));
            }
            out.extend(files);
        } else {
            out.push(p);
        }
    }
    Ok(out)
}

pub fn execute(cli: Cli) -> Result<Outcome> {
    match cli.command {
        Command::Run {
            specs,
            engine,
            model,
            save_captures,
            keep_gguf_qk_permutation,
            storage,
            json,
            only,
            require_gpu,
            allow_skip,
            quiet,
            verbose,
            color,
            sinks,
        } => {
            // Report paths are checked before anything runs.
            let outputs = sinks.resolve(json.as_deref())?;
            let filter = Filter(if only.is_empty() { None } else { Some(only) });
            let mut report = Report::default();
            // Plan everything first so bad input fails before any engine runs.
            // One bad spec among several is reported and the others still run
            // (the exit code is then 2); a single bad spec is simply the error.
            let paths = specs_or_default(specs)?;
            let mut plans = Vec::new();
            let mut bad = Vec::new();
            for p in &paths {
                match Spec::load(p).and_then(|s| Plan::build(s, model.as_deref())) {
                    Ok(mut plan) => {
                        plan.load_options.keep_gguf_qk_permutation = keep_gguf_qk_permutation;
                        if let Some(s) = storage {
                            plan.load_options.storage = s;
                        }
                        plans.push(plan);
                    }
                    Err(e) if paths.len() == 1 => return Err(e),
                    Err(e) => bad.push(e),
                }
            }
            let mut chosen = Vec::new();
            for plan in &plans {
                let sels = EngineSel::resolve(&engine, &plan.spec)?;
                if require_gpu {
                    for sel in sels.iter().filter(|s| **s == EngineSel::Builtin(EngineKind::Cuda)) {
                        if let crate::engine::Availability::Unavailable(reason) = sel.availability() {
                            return Err(Error::Usage(format!(
                                "--require-gpu: the {} engine is unavailable: {reason}",
                                sel.name()
                            )));
                        }
                    }
                }
                chosen.push(sels);
            }
            if save_captures.is_some() && (plans.len() != 1 || chosen[0].len() != 1) {
                return Err(Error::Usage(
                    "--save-captures writes one run: give one spec and one engine".into(),
                ));
            }
            for (plan, sels) in plans.iter().zip(&chosen) {
                for sel in sels {
                    let spinner = progress(&format!(
                        "{} on {}: loading the model and running",
                        plan.spec.name,
                        sel.name()
                    ));
                    let run = match &save_captures {
                        Some(path) => crate::runner::run_plan_saving(plan, sel, &filter, model.as_deref(), path),
                        None => run_plan(plan, sel, &filter, model.as_deref()),
                    };
                    if let Some(s) = spinner {
                        s.finish_and_clear();
                    }
                    report.runs.push(run?);
                }
            }
            let selected: usize = report.runs.iter().map(|r| r.outcomes.len()).sum();
            if plans.is_empty() {
                let msgs: Vec<String> = bad.iter().map(|e| e.to_string()).collect();
                return Err(Error::Usage(format!("no spec could run:\n  {}", msgs.join("\n  "))));
            }
            if selected == 0 {
                return Err(Error::Usage(
                    "no check matched --only; `touchstone list` shows the ids".into(),
                ));
            }
            let view = report::terminal::View {
                verbose,
                quiet,
                color: color.enabled(outputs.uses_stdout()),
            };
            let text = report::terminal::render_view(&report, view);
            if outputs.uses_stdout() {
                eprint!("{text}");
            } else {
                print!("{text}");
            }
            outputs.commit(&|flag| match flag {
                "--json" => report::json::to_string(&report),
                "--junit" => report::junit::render(&report),
                "--markdown" => report::markdown::render(&report),
                _ => report::html::render(&report),
            })?;
            if !bad.is_empty() {
                let msgs: Vec<String> = bad.iter().map(|e| e.to_string()).collect();
                return Err(Error::Usage(format!(
                    "{} of {} specs could not run (the others' results are above):\n  {}",
                    bad.len(),
                    paths.len(),
                    msgs.join("\n  ")
                )));
            }
            let c = report.counts();
            if c.failed == 0 && c.passed == 0 && !allow_skip {
                eprintln!(
                    "touchstone: NOTHING RAN: all {} selected check(s) were skipped; that is not a pass (exit 1). \
                     Pass --allow-skip to accept a run that checks nothing.",
                    c.skipped
                );
                return Ok(Outcome::Failed);
            }
            Ok(if report.passed() {
                Outcome::Passed
            } else {
                Outcome::Failed
            })
        }
        Command::List { specs, engine, model } => {
            for p in specs_or_default(specs)? {
                let plan = Plan::build(Spec::load(&p)?, model.as_deref())?;
                for sel in EngineSel::resolve(&engine, &plan.spec)? {
                    for c in &plan.checks {
                        println!("{}::{}::{}", sel.name(), plan.spec.name, c.id);
                    }
                }
            }
            Ok(Outcome::Passed)
        }
        Command::Kernels { arch, ptx_only } => crate::cmd::kernels::run(&arch, ptx_only),
        Command::Inspect { file } => {
            print!("{}", crate::cmd::inspect::render(&file)?);
            Ok(Outcome::Passed)
        }
        Command::Goldens { action } => goldens(action),
        Command::Diff {
            base,
            new,
            factor,
            allow_vanished,
            changed,
            sinks,
        } => {
            use crate::diff::render;
            let outputs = sinks.resolve(None)?;
            let d = crate::diff::diff_files(&base, &new, factor, allow_vanished)?;
            let text = render::terminal_rows(&d, changed);
            if outputs.uses_stdout() {
                eprint!("{text}");
            } else {
                print!("{text}");
            }
            outputs.commit(&|flag| match flag {
                "--junit" => render::junit(&d),
                "--markdown" => render::markdown(&d),
                _ => render::html(&d),
            })?;
            Ok(if d.regressed() {
                Outcome::Failed
            } else {
                Outcome::Passed
            })
        }
        Command::Bench(cmd) => {
            crate::cmd::bench::run(cmd)?;
            Ok(Outcome::Passed)
        }
        Command::Compare { a, b, atol, rtol } => {
            let c = crate::cmd::compare::compare_files(&a, &b, atol, rtol)?;
            print!("{}", c.text);
            Ok(if c.passed { Outcome::Passed } else { Outcome::Failed })
        }
    }
}

fn goldens(action: GoldensAction) -> Result<Outcome> {
    use crate::cmd::goldens::{jobs, pending, refs, regen, repo_root};
    match action {
        GoldensAction::Regen { specs, source, python } => {
            // Refuse before reading anything, so CI cannot write even a cache file.
            regen::refuse_on_ci("regenerate")?;
            let specs = specs_or_default(specs)?;
            let jobs = jobs(&specs, source.filter())?;
            let r = regen::regen(&repo_root(&specs[0]), &jobs, python.as_deref())?;
            print!("{}", r.text);
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
                pending::accept(&refs(&jobs(&specs_or_default(specs)?, source.filter())?))?
            );
            Ok(Outcome::Passed)
        }
        GoldensAction::Reject { specs, source } => {
            print!(
                "{}",
                pending::reject(&refs(&jobs(&specs_or_default(specs)?, source.filter())?))?
            );
            Ok(Outcome::Passed)
        }
    }
}
