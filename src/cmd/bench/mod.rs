//! `touchstone bench`: measurements for comparing touchstone with its peers
//! (llama.cpp, HF transformers, numpy, torch). Each mode prints one JSON line
//! per measurement on stdout, for `ci/bench.sh` to collect, and a line for a
//! person on stderr. Nothing here is a check: the numbers are reported, never
//! judged, and no bench runs in CI (the peers take minutes to build).
//!
//! - `engine`: the CPU engine as a library, prefill and greedy decode, no taps.
//! - `bandwidth`: the machine's memory read bandwidth, the ceiling of decode
//!   (every weight is read once per token) and of the comparator.
//! - `compare`: the in-process comparator (`crate::compare::compare`) in GB/s
//!   of input read, beside the bandwidth measured in the same process.

pub mod bandwidth;
pub mod comparator;
pub mod engine;
pub mod proc_stats;
pub mod stats;

use crate::cli::bench::BenchCmd;
use crate::error::{Error, Result};

/// Bytes in a GB as this module reports them: decimal, as bandwidths are quoted.
pub const GB: f64 = 1e9;
/// Bytes in a MiB (buffer sizes are given in MiB).
pub const MIB: usize = 1 << 20;

pub fn run(cmd: BenchCmd) -> Result<()> {
    match cmd {
        BenchCmd::Engine(a) => engine::run(&a),
        BenchCmd::Bandwidth(a) => bandwidth::run(&a),
        BenchCmd::Compare(a) => comparator::run(&a),
    }
}

/// Makes rayon's global pool exactly `threads` wide. Global rather than a
/// scoped `install`, so that every parallel loop of the engine and the
/// comparator, wherever it is spawned from, runs on these threads and no
/// others: the peers are given the same number. Fails if the pool was already
/// built (only possible when called twice in one process).
pub fn init_threads(threads: usize) -> Result<()> {
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build_global()
        .map_err(|e| Error::Usage(format!("cannot start {threads} worker threads: {e}")))?;
    Ok(())
}

/// One measurement: the JSON line on stdout (flushed, so a driver reading a
/// pipe sees it at once) and the human line on stderr.
pub fn emit(json: &serde_json::Value, human: &str) {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{json}");
    let _ = out.flush();
    eprintln!("{human}");
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use crate::cli::bench::BenchCmd;
    use crate::cli::{Cli, Command};

    fn parse(args: &[&str]) -> Result<BenchCmd, clap::Error> {
        let cli = Cli::try_parse_from(["touchstone", "bench"].iter().chain(args))?;
        match cli.command {
            Command::Bench(b) => Ok(b),
            other => panic!("parsed as {other:?}"),
        }
    }

    #[test]
    fn the_defaults_are_the_issue_s_measurement() {
        let Ok(BenchCmd::Engine(a)) = parse(&["engine", "--model", "m"]) else {
            panic!("bench engine did not parse")
        };
        assert_eq!((a.prompt_tokens, a.decode, a.reps, a.warmup), (32, 32, 3, 1));
        let Ok(BenchCmd::Compare(c)) = parse(&["compare"]) else {
            panic!("bench compare did not parse")
        };
        assert_eq!((c.mib, c.bandwidth_mib, c.a, c.b), (256, 1024, None, None));
    }

    #[test]
    fn zero_sizes_counts_and_half_inputs_are_usage_errors() {
        for bad in [
            &["bandwidth", "--threads", "0"][..],
            &["bandwidth", "--mib", "0"],
            &["compare", "--reps", "0"],
            &["compare", "--a", "x.npy"],
            &["engine", "--model", "m", "--decode", "0"],
            &["engine", "--model", "m", "--prompt-tokens", "-3"],
            &["engine"],
        ] {
            let err = parse(bad).expect_err(&format!("{bad:?} was accepted"));
            // clap's usage errors print to stderr: main maps them to exit 2.
            assert!(err.use_stderr(), "{bad:?}: {err}");
        }
    }
}
