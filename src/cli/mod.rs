//! The command line's argument types (clap), and nothing else: what each
//! command does is `cmd`'s. `main` parses, calls `cmd::execute` and maps the
//! outcome to an exit code: 0 all passed, 1 a check failed, 2 bad input or usage.

pub mod bench;

use std::path::PathBuf;

use clap::{Parser, Subcommand, ValueEnum};

use crate::tensor::DType;

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
    Run(RunArgs),
    /// List the check instances of specs (the ids `--only` and `cargo test` filter on).
    List(ListArgs),
    /// List every check kind a spec can name: its parameters and what must hold
    /// (stage checks under `stages:`, run checks under `run_checks:`).
    Checks,
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
    Diff(DiffArgs),
    /// Merge the `--json` reports of `run --shard 1/N` … `N/N` into the report one run of the
    /// whole selection gives (exit 0 pass, 1 a check failed, 2 a shard missing, given twice, or
    /// of another run).
    Merge(MergeArgs),
    /// Benchmarks for comparing touchstone with its peers (not checks; not run in CI): one JSON
    /// line per measurement on stdout, a readable line on stderr. `ci/bench.sh` runs them
    /// interleaved with llama.cpp, HF transformers, numpy and torch (docs/benchmarks.md).
    #[command(subcommand)]
    Bench(bench::BenchCmd),
    /// Detection power: the smallest relative change of one block of one stage the
    /// spec's checks localise. The engine runs once; its capture of STEP/STAGE has one
    /// token row (the step's last) scaled by 1 + δ, δ from 1e-1 down to 1e-6, and
    /// the stage checks are judged again each time (exit 1 if even 1e-1 is not
    /// localised there).
    Power {
        /// The spec (default: the nearest specs/ folder's default spec).
        spec: Option<PathBuf>,
        /// Where to plant the change: STEP/STAGE, e.g. prefill/blk.11.ffn_act.
        #[arg(long, value_name = "STEP/STAGE")]
        at: String,
        /// The engine (as `run --engine`, one engine).
        #[arg(long, default_value = "cpu", value_name = "ENGINE")]
        engine: String,
        /// Storage dtype the engine runs in (f32, f16 or bf16; default the spec's).
        #[arg(long, value_name = "DTYPE", value_parser = parse_storage)]
        storage: Option<DType>,
        /// Model to run instead of the spec's.
        #[arg(long)]
        model: Option<PathBuf>,
    },
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

#[derive(clap::Args, Debug)]
pub struct RunArgs {
    /// Spec files or folders of specs (every *.yaml in a folder). Default:
    /// the nearest specs/ folder up from the working directory — its
    /// qwen2-tiny.yaml in a touchstone checkout, else every spec in it.
    pub specs: Vec<PathBuf>,
    /// Engine to run: `cpu`, `cuda`, `cuda-emu` (the CUDA engine on the
    /// emulated device, no GPU needed), `all` (every built-in, and every
    /// engine the spec declares), `hf` / `llama.cpp` (HF transformers and
    /// llama.cpp under test, run by the recorders' Python that `goldens regen`
    /// creates; `hf:ARGS…` passes arguments, docs/third-party-engines.md; not
    /// part of `all`), a name under the spec's `engines:`, `exec:COMMAND ARGS…`
    /// (any program speaking the subprocess protocol, docs/testing-your-engine.md),
    /// or `dumps:PATH` (tensors another program wrote).
    #[arg(long, default_value = "cpu", value_name = "ENGINE")]
    pub engine: String,
    /// Model to run instead of the spec's (an HF model folder or a .gguf file).
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Also write the tensors of the main run (every tapped stage at every
    /// step, and the sampled tokens) to this safetensors file: what
    /// `--engine dumps:FILE` checks again later. One spec and one engine only.
    #[arg(long, value_name = "FILE")]
    pub save_captures: Option<PathBuf>,
    /// Test aid: keep llama.cpp's Q/K row permutation of Llama GGUF weights
    /// instead of undoing it, to show the failure it causes (first divergence
    /// at blk.0.q). Hidden: never needed for a real run.
    #[arg(long, hide = true)]
    pub keep_gguf_qk_permutation: bool,
    /// Storage dtype the engine runs in (f32, f16 or bf16): weights and stage
    /// outputs rounded to it, arithmetic in f32. Overrides the spec's `storage:`
    /// (default f32); golden tolerances then come from that dtype's entry.
    #[arg(long, value_name = "DTYPE", value_parser = parse_storage)]
    pub storage: Option<DType>,
    /// The CPU engine quantises every matmul input to 8 bits first, in blocks
    /// of 32 (q8_0) or 256 (q8_k), as llama.cpp does for quantised weights,
    /// and declares that arithmetic: the scaled policy then judges it by the
    /// floors of that arithmetic and against references of the same one
    /// (docs/tolerances.md). Only the cpu engine has this mode.
    #[arg(long, value_name = "Q8", value_parser = parse_activations)]
    pub activations: Option<crate::arithmetic::Activations>,
    /// Also write the report as JSON to this file.
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,
    /// Run only checks whose id contains this text, or matches this glob
    /// (`*` any text, `?` one character), repeatable: e.g.
    /// `decode2/blk.1.q::golden:hf` or `decode2/blk.1.*`.
    #[arg(long, value_name = "ID")]
    pub only: Vec<String>,
    /// Summary and failures only (no stage table, no passing run checks).
    #[arg(short, long, conflicts_with = "verbose")]
    pub quiet: bool,
    /// Every row of the stage table (by default a long table shows only the
    /// rows that did not pass).
    #[arg(short, long)]
    pub verbose: bool,
    /// Colour the report: auto (on a terminal, unless NO_COLOR is set), always, never.
    #[arg(long, value_enum, default_value_t = ColorArg::Auto, value_name = "WHEN")]
    pub color: ColorArg,
    /// Fail (exit 2) instead of skipping when a requested GPU engine is unavailable.
    #[arg(long)]
    pub require_gpu: bool,
    /// Exit 0 even when nothing ran (every check skipped, e.g. `--engine cuda`
    /// without a GPU); the summary still says NOTHING RAN. Without it such a
    /// run exits 1: a run that checked nothing is not a pass.
    #[arg(long)]
    pub allow_skip: bool,
    /// Run only shard K of N of the (spec, engine) runs the other arguments
    /// select (dealt round-robin in the order a whole run takes them), e.g.
    /// one CI job each for 1/3, 2/3 and 3/3; their `--json` reports say
    /// which shard they are, and `touchstone merge` puts them back into the
    /// report of the whole run (docs/sharding.md).
    #[arg(long, value_name = "K/N", value_parser = crate::report::merge::parse_shard)]
    pub shard: Option<(usize, usize)>,
    #[command(flatten)]
    pub sinks: SinkArgs,
}

#[derive(clap::Args, Debug)]
pub struct MergeArgs {
    /// The shards' reports (`touchstone run --shard K/N --json FILE`), every one of 1/N … N/N, in
    /// any order.
    #[arg(required = true)]
    pub shards: Vec<PathBuf>,
    /// Write the merged report as JSON to this file.
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,
    /// Summary and failures only (no stage table, no passing run checks).
    #[arg(short, long)]
    pub quiet: bool,
    #[command(flatten)]
    pub sinks: SinkArgs,
}

#[derive(clap::Args, Debug)]
pub struct ListArgs {
    /// Spec files or folders of specs (default: as for `run`).
    pub specs: Vec<PathBuf>,
    /// Engine whose trial names to list (as for `run`).
    #[arg(long, default_value = "cpu", value_name = "ENGINE")]
    pub engine: String,
    #[arg(long)]
    pub model: Option<PathBuf>,
}

#[derive(clap::Args, Debug)]
pub struct DiffArgs {
    /// The baseline report (`touchstone run --json BASE.json`, before the change).
    pub base: PathBuf,
    /// The report to judge (after the change).
    pub new: PathBuf,
    /// A passing check regresses when its error grows by more than this factor.
    #[arg(long, default_value_t = 10.0)]
    pub factor: f64,
    /// Accept checks of BASE that are missing from NEW (by default they fail
    /// the diff, exit 1: a smaller report is not "no regression").
    #[arg(long)]
    pub allow_vanished: bool,
    /// Show only rows whose status or error changed.
    #[arg(long)]
    pub changed: bool,
    #[command(flatten)]
    pub sinks: SinkArgs,
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
    /// Print the subset arguments `regen` passes the HF and llama.cpp
    /// recorders for a spec (`--steps`, `--stages`, `--stages-at`, `--logits`,
    /// `--rows` and the auxiliary stages its floors read, `--aux`), one per
    /// line: what goldens/recorders/regen.sh records a compact golden with.
    Args {
        /// The spec.
        spec: PathBuf,
        /// Separate the arguments with NUL bytes instead of newlines.
        #[arg(short = '0', long)]
        null: bool,
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

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum ColorArg {
    Auto,
    Always,
    Never,
}

/// `--activations`: q8_0 or q8_k.
pub fn parse_activations(s: &str) -> std::result::Result<crate::arithmetic::Activations, String> {
    use crate::arithmetic::Activations;
    match s {
        "q8_0" => Ok(Activations::Q8 { block: 32 }),
        "q8_k" => Ok(Activations::Q8 { block: 256 }),
        _ => Err(format!("`{s}`: expected q8_0 (blocks of 32) or q8_k (blocks of 256)")),
    }
}

/// `--storage`: the dtype names specs use.
pub fn parse_storage(s: &str) -> std::result::Result<DType, String> {
    DType::parse(s).ok_or_else(|| format!("unknown dtype `{s}` (known: f32, f16, bf16)"))
}
