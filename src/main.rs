//! The `touchstone` binary: parse arguments, run, map the result to an exit code.
use std::process::ExitCode;

use clap::Parser;
use touchstone::cli::Cli;
use touchstone::cmd::{execute, Outcome};

fn main() -> ExitCode {
    // A reader that stops early (`touchstone list | head`) closes the pipe;
    // Rust ignores SIGPIPE, so the next write would panic. Die quietly as
    // Unix tools do instead.
    #[cfg(unix)]
    // SAFETY: setting a signal's disposition to its default at start-up,
    // before any thread exists, has no preconditions.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => {
            // --help and --version are not errors; clap prints them itself.
            let code = if e.use_stderr() { 2 } else { 0 };
            let _ = e.print();
            return ExitCode::from(code);
        }
    };
    match execute(cli) {
        Ok(Outcome::Passed) => ExitCode::SUCCESS,
        Ok(Outcome::Failed) => ExitCode::from(1),
        Err(e) => {
            eprintln!("touchstone: error: {e}");
            ExitCode::from(2)
        }
    }
}
