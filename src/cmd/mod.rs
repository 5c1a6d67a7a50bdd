//! The commands, above the library: each file implements one `touchstone`
//! subcommand on top of the plan, runner, report and golden modules; `cli`
//! holds only their argument types. `execute` dispatches.

pub mod bench;
pub mod checks;
pub mod compare;
pub mod diff;
pub mod goldens;
pub mod inspect;
pub mod kernels;
pub mod list;
pub mod merge;
pub mod power;
pub mod run;
pub mod specs;

use crate::cli::{Cli, Command};
use crate::error::Result;

/// What a command achieved, for the exit code (bad input is an `Err`).
pub enum Outcome {
    Passed,
    Failed,
}

pub fn execute(cli: Cli) -> Result<Outcome> {
    match cli.command {
        Command::Run(args) => run::run(args),
        Command::List(args) => list::run(args),
        Command::Checks => {
            print!("{}", checks::render());
            Ok(Outcome::Passed)
        }
        Command::Kernels { arch, ptx_only } => kernels::run(&arch, ptx_only),
        Command::Inspect { file } => {
            print!("{}", inspect::render(&file)?);
            Ok(Outcome::Passed)
        }
        Command::Goldens { action } => goldens::execute(action),
        Command::Diff(args) => diff::run(args),
        Command::Merge(args) => merge::run(args),
        Command::Power {
            spec,
            at,
            engine,
            storage,
            model,
        } => power::run(power::PowerArgs {
            spec,
            at,
            engine,
            storage,
            model,
        }),
        Command::Bench(cmd) => {
            bench::run(cmd)?;
            Ok(Outcome::Passed)
        }
        Command::Compare { a, b, atol, rtol } => {
            let c = compare::compare_files(&a, &b, atol, rtol)?;
            print!("{}", c.text);
            Ok(if c.passed { Outcome::Passed } else { Outcome::Failed })
        }
    }
}
