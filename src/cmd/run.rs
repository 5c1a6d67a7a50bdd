//! `touchstone run`: plans every spec first (bad input fails before any
//! engine runs), runs each on the engines asked for, renders the report to
//! the terminal and the requested files, and decides the exit: a run that
//! checked nothing is not a pass.

use std::path::Path;

use super::specs::specs_or_default;
use super::Outcome;
use crate::cli::{ColorArg, RunArgs, SinkArgs};
use crate::engine::registry::EngineSel;
use crate::engine::Availability;
use crate::error::{Error, Result};
use crate::plan::Plan;
use crate::report::merge::Shard;
use crate::report::{self, Report};
use crate::runner::{self, rerun_command, Filter, RunOptions};
use crate::spec::Spec;

pub fn run(args: RunArgs) -> Result<Outcome> {
    let RunArgs {
        specs,
        engine,
        model,
        save_captures,
        keep_gguf_qk_permutation,
        storage,
        activations,
        json,
        only,
        require_gpu,
        allow_skip,
        shard,
        quiet,
        verbose,
        color,
        sinks,
    } = args;
    // Report paths are checked before anything runs.
    let outputs = outputs(&sinks, json.as_deref())?;
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
                if let Some(a) = activations {
                    plan.load_options.activations = a;
                }
                plans.push(plan);
            }
            Err(e) if paths.len() == 1 => return Err(e),
            Err(e) => bad.push(e),
        }
    }
    let mut chosen = Vec::new();
    for plan in &plans {
        let sels = EngineSel::resolve(&engine, &plan.spec.declared())?;
        if activations.is_some() {
            if let Some(other) = sels.iter().find(|s| **s != EngineSel::Cpu) {
                return Err(Error::Usage(format!(
                    "--activations is a mode of the cpu engine; `{}` computes as it does (an external engine \
                     declares its arithmetic in the spec's `engines:` or its load answer)",
                    other.name()
                )));
            }
        }
        if require_gpu {
            for sel in sels.iter().filter(|s| **s == EngineSel::Cuda) {
                if let Availability::Unavailable(reason) = sel.availability() {
                    return Err(Error::Usage(format!(
                        "--require-gpu: the {} engine is unavailable: {reason}",
                        sel.name()
                    )));
                }
            }
        }
        chosen.push(sels);
    }
    // `--shard K/N`: every run of the selection is listed, this shard's run.
    let all_runs: Vec<String> = plans
        .iter()
        .zip(&chosen)
        .flat_map(|(plan, sels)| {
            sels.iter()
                .map(move |sel| format!("{} on {}", plan.spec.path.display(), sel.name()))
        })
        .collect();
    let shard = shard.map(|(index, count)| Shard {
        index,
        count,
        runs: all_runs.clone(),
    });
    if save_captures.is_some() && (plans.len() != 1 || chosen[0].len() != 1) {
        return Err(Error::Usage(
            "--save-captures writes one run: give one spec and one engine".into(),
        ));
    }
    let mut place = 0..;
    for (plan, sels) in plans.iter().zip(&chosen) {
        for sel in sels {
            let i = place.next().unwrap_or_default();
            if shard.as_ref().is_some_and(|s| !Shard::owns(s.index, s.count, i)) {
                continue;
            }
            let spinner = progress(&format!(
                "{} on {}: loading the model and running",
                plan.spec.name,
                sel.name()
            ));
            let rerun = |id: &str| rerun_command(plan, sel, id, model.as_deref());
            let opts = RunOptions {
                filter: &filter,
                rerun: &rerun,
                save: save_captures.as_deref(),
                from: None,
            };
            let run = runner::run(plan, sel, &opts);
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
    if let Some(s) = &shard {
        eprintln!(
            "touchstone: shard {}/{}: {} of the selection's {} run(s); `touchstone merge` joins the shards' --json reports",
            s.index,
            s.count,
            report.runs.len(),
            s.runs.len()
        );
        if report.runs.is_empty() {
            // More shards than runs: this shard has nothing to do, which is
            // not a failure of the suite (the merge still needs its report).
            outputs.commit(&|flag| sink_text(&report, flag, shard.as_ref()))?;
            return Ok(Outcome::Passed);
        }
    }
    if selected == 0 {
        return Err(Error::Usage(
            "no check matched --only; `touchstone list` shows the ids".into(),
        ));
    }
    let view = report::terminal::View {
        verbose,
        quiet,
        color: colour(color, outputs.uses_stdout()),
    };
    let text = report::terminal::render_view(&report, view);
    if outputs.uses_stdout() {
        eprint!("{text}");
    } else {
        print!("{text}");
    }
    outputs.commit(&|flag| sink_text(&report, flag, shard.as_ref()))?;
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
            "touchstone: NOTHING RAN: all {} selected check(s) were skipped or not applicable; that is not a \
             pass (exit 1). Pass --allow-skip to accept a run that checks nothing.",
            c.skipped + c.not_applicable
        );
        return Ok(Outcome::Failed);
    }
    Ok(if report.passed() {
        Outcome::Passed
    } else {
        Outcome::Failed
    })
}

/// A report file's text (`flag`: the option naming it); a shard's JSON
/// report says which shard of which runs it is.
pub fn sink_text(report: &Report, flag: &str, shard: Option<&Shard>) -> String {
    match flag {
        "--json" => report::json::to_string_with(report, shard),
        "--junit" => report::junit::render(report),
        "--markdown" => report::markdown::render(report),
        _ => report::html::render(report),
    }
}

/// The report outputs with `json` first, resolved (checked) before the run.
pub fn outputs(sinks: &SinkArgs, json: Option<&Path>) -> Result<report::outputs::Outputs> {
    report::outputs::Outputs::resolve(&[
        ("--json", json),
        ("--junit", sinks.junit.as_deref()),
        ("--markdown", sinks.markdown.as_deref()),
        ("--html", sinks.html.as_deref()),
    ])
}

/// Whether to colour output going to stdout (`auto`: a terminal, and
/// NO_COLOR unset or empty, as no-color.org asks).
fn colour(arg: ColorArg, to_stderr: bool) -> bool {
    use std::io::IsTerminal;
    match arg {
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
