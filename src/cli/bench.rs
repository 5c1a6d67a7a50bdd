//! `touchstone bench`'s arguments (the measurements are `cmd::bench`'s).

use std::path::PathBuf;

use clap::Subcommand;

#[derive(Subcommand, Debug)]
pub enum BenchCmd {
    /// The CPU engine on a model: prefill of a fixed token list, then greedy
    /// decode steps, no taps; tok/s per repetition, load time, peak RSS.
    Engine(EngineArgs),
    /// Memory read bandwidth: a parallel sum over a buffer much larger than
    /// the last-level cache, best of the repetitions, in GB/s (1e9 bytes/s).
    Bandwidth(BandwidthArgs),
    /// The comparator behind every golden check on two f32 tensors, in GB/s of
    /// input read (both tensors), and its fraction of the bandwidth measured in
    /// the same process.
    Compare(CompareArgs),
}

#[derive(clap::Args, Debug, Clone)]
pub struct BandwidthArgs {
    /// Worker threads (rayon's pool), the same number the peers are given.
    #[arg(long, default_value_t = default_threads(), value_parser = clap::value_parser!(u16).range(1..))]
    pub threads: u16,
    /// Buffer size in MiB. Use several times the last-level cache, or the
    /// cache serves part of it and the figure is too high.
    #[arg(long, default_value_t = 1024, value_parser = clap::value_parser!(u32).range(1..=1 << 20))]
    pub mib: u32,
    /// Timed passes over the buffer (the best is the bandwidth).
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u32).range(1..=1000))]
    pub reps: u32,
}

/// The machine's cores, or 1 when the OS does not say.
pub fn default_threads() -> u16 {
    std::thread::available_parallelism().map_or(1, |n| u16::try_from(n.get()).unwrap_or(u16::MAX))
}

#[derive(clap::Args, Debug, Clone)]
pub struct CompareArgs {
    /// Size of each generated tensor in MiB (ignored with --a/--b). Use
    /// several times the last-level cache, as the golden files of a real model
    /// are.
    #[arg(long, default_value_t = 256, value_parser = clap::value_parser!(u32).range(1..=1 << 16))]
    pub mib: u32,
    /// Worker threads (rayon's pool), the same number the peers are given.
    #[arg(long, default_value_t = default_threads(), value_parser = clap::value_parser!(u16).range(1..))]
    pub threads: u16,
    /// Timed comparisons.
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u32).range(1..=1000))]
    pub reps: u32,
    /// The "actual" tensor, from a file holding exactly one float tensor
    /// (.npy, .safetensors, .npz); needs --b. Default: generated (seeded).
    #[arg(long, value_name = "FILE", requires = "b")]
    pub a: Option<PathBuf>,
    /// The "expected" tensor, the same shape as --a.
    #[arg(long, value_name = "FILE", requires = "a")]
    pub b: Option<PathBuf>,
    /// Buffer of the bandwidth measurement made beside it, in MiB.
    #[arg(long, default_value_t = 1024, value_parser = clap::value_parser!(u32).range(1..=1 << 20))]
    pub bandwidth_mib: u32,
}

#[derive(clap::Args, Debug, Clone)]
pub struct EngineArgs {
    /// The model: an HF folder (config.json + *.safetensors) or a .gguf file.
    #[arg(long, value_name = "PATH")]
    pub model: PathBuf,
    /// Prompt length: token ids (17 + 7919·i) mod vocab, i = 0..N, fed as one
    /// prefill (the ids are printed in the summary line so the peers can be
    /// fed the same ones).
    #[arg(long, default_value_t = 32, value_parser = clap::value_parser!(u32).range(1..=1 << 20))]
    pub prompt_tokens: u32,
    /// Greedy decode steps after the prefill, one token each.
    #[arg(long, default_value_t = 32, value_parser = clap::value_parser!(u32).range(1..=1 << 20))]
    pub decode: u32,
    /// Worker threads (rayon's pool), the same number the peers are given.
    #[arg(long, default_value_t = default_threads(), value_parser = clap::value_parser!(u16).range(1..))]
    pub threads: u16,
    /// Timed repetitions (each: a prefill run, then a prefill + decode run).
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..=1000))]
    pub reps: u32,
    /// Untimed runs first (prefill + 1 decode step each): the first run of a
    /// process pays for page faults and thread start-up.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(0..=100))]
    pub warmup: u32,
}
