//! `touchstone merge SHARD.json…`: the shards of one run (`run --shard K/N
//! --json`) merged back into the report the whole run gives
//! (`crate::report::merge` decides), to the terminal and the requested files.

use super::Outcome;
use crate::cli::MergeArgs;
use crate::error::Result;
use crate::report::{self, merge};

pub fn run(args: MergeArgs) -> Result<Outcome> {
    let MergeArgs {
        shards,
        json,
        quiet,
        sinks,
    } = args;
    let outputs = super::run::outputs(&sinks, json.as_deref())?;
    let mut parts = Vec::with_capacity(shards.len());
    for path in shards {
        let (report, shard) = merge::read(&path)?;
        parts.push((path, report, shard));
    }
    let report = merge::merge(parts)?;
    let view = report::terminal::View {
        verbose: false,
        quiet,
        color: false,
    };
    let text = report::terminal::render_view(&report, view);
    if outputs.uses_stdout() {
        eprint!("{text}");
    } else {
        print!("{text}");
    }
    outputs.commit(&|flag| super::run::sink_text(&report, flag, None))?;
    Ok(if report.passed() {
        Outcome::Passed
    } else {
        Outcome::Failed
    })
}
