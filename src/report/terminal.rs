//! The human report: one table row per (step, stage) with the worst golden error
//! per source, the first divergence marked, then every failure in full (message
//! and rerun command), then the run checks and a one-line summary.

use std::collections::BTreeMap;
use std::fmt::Write;

use super::{Outcome, Report, SuiteRun};
use crate::checks::{Family, Status};
use crate::stage::{Stage, Step};

/// Failures printed in full beyond the first divergence; the rest are listed by id.
const FULL_FAILURES: usize = 8;
/// Above this many (step, stage) rows the default table shows only the rows
/// that did not pass (a real model has thousands); `--verbose` shows all.
const MAX_DEFAULT_ROWS: usize = 40;

/// How much to show, and whether to colour it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct View {
    /// Every row of the stage table.
    pub verbose: bool,
    /// Summary and failures only: no stage table, no passing run checks.
    pub quiet: bool,
    /// ANSI colours (pass green, FAIL red, skip yellow).
    pub color: bool,
}

impl View {
    fn paint(self, text: &str, code: &str) -> String {
        if self.color {
            format!("\x1b[{code}m{text}\x1b[0m")
        } else {
            text.to_string()
        }
    }
    /// `text` coloured by the status word it starts with (it keeps its padding).
    fn status(self, text: &str) -> String {
        match text.trim() {
            "pass" | "PASSED" => self.paint(text, "32"),
            "FAIL" | "FAILED" => self.paint(text, "1;31"),
            "skip" | "NOTHING RAN" => self.paint(text, "33"),
            _ => text.to_string(),
        }
    }
}

/// The report as `touchstone run` prints it by default (no colour).
pub fn render(report: &Report) -> String {
    render_view(report, View::default())
}

pub fn render_view(report: &Report, view: View) -> String {
    let mut out = String::new();
    let c = report.counts();
    for run in &report.runs {
        render_run(&mut out, run, view);
    }
    // A run where nothing ran is not a pass: say so (e.g. every engine unavailable).
    let verdict = if c.failed > 0 {
        "FAILED"
    } else if c.passed == 0 {
        "NOTHING RAN"
    } else {
        "PASSED"
    };
    let _ = writeln!(
        out,
        "touchstone: {}: {} passed, {} failed, {} skipped{}",
        view.status(verdict),
        c.passed,
        c.failed,
        c.skipped,
        c.not_applicable_tail()
    );
    out
}

fn render_run(out: &mut String, run: &SuiteRun, view: View) {
    let _ = writeln!(
        out,
        "== {} on engine {}, storage {} ({}) ==",
        run.spec, run.engine, run.storage, run.spec_path
    );
    // Quoted with Rust's escapes, so newlines and trailing spaces stay visible.
    if let Some(p) = &run.prompt_text {
        let _ = writeln!(out, "prompt: {p:?}");
    }
    if let Some(c) = &run.continuation_text {
        let _ = writeln!(out, "continuation: {c:?}");
    }
    if let Some(reason) = &run.skipped {
        let _ = writeln!(out, "skipped: {reason}\n");
        return;
    }
    for note in &run.notes {
        let _ = writeln!(out, "note: {note}");
    }
    for s in run.suspect_references() {
        let _ = writeln!(out, "note: {}", s.sentence());
    }
    // How close the run came to its allowances (error / base; each check
    // allows up to the spec's factor): the engine's, then each reference's.
    let ratios = run.largest_ratios();
    if !ratios.is_empty() {
        let text: Vec<String> = ratios
            .iter()
            .map(|r| format!("{} {:.3} {}", r.of, r.ratio, r.at))
            .collect();
        let _ = writeln!(out, "largest ratios: {}", text.join(", "));
    }
    // (check, source) of every golden check, one column each.
    let sources: Vec<(String, String)> = {
        let mut s: Vec<(String, String)> = run
            .outcomes
            .iter()
            .filter_map(|o| o.family.source().map(|src| (o.check.clone(), src.to_string())))
            .collect();
        s.sort();
        s.dedup();
        s
    };
    // Scaled policy (an oracle): the engine's error against the oracle once,
    // then per reference the ratio that decides (engine error / reference error).
    let scaled = run
        .outcomes
        .iter()
        .any(|o| o.is_golden() && o.metrics.contains_key("ratio"));
    // The references' distance from each other, shown as the error budget.
    let budget_label: Option<String> = run.outcomes.iter().filter(|_| !scaled).find_map(|o| match &o.family {
        Family::ReferencesAgree { base, other } => Some(format!("budget {base}↔{other}")),
        _ => None,
    });
    let mut rows: BTreeMap<(Step, Stage), Vec<&Outcome>> = BTreeMap::new();
    for o in &run.outcomes {
        if let Some(at) = o.at {
            rows.entry(at).or_default().push(o);
        }
    }
    // The default hides passing rows of a long table; quiet hides the table.
    let hide_passing = !view.verbose && rows.len() > MAX_DEFAULT_ROWS;
    let not_passing = |outs: &Vec<&Outcome>| outs.iter().any(|o| o.status != Status::Pass);
    let shown_rows = rows.values().filter(|o| !hide_passing || not_passing(o)).count();
    if view.quiet {
        // Summary and failures only.
    } else if shown_rows == 0 && !rows.is_empty() {
        let _ = writeln!(
            out,
            "all {} (step, stage) rows pass ({} checks; --verbose shows the table)",
            rows.len(),
            rows.values().map(Vec::len).sum::<usize>()
        );
    } else if !rows.is_empty() {
        let mut header = format!("{:<8} {:<18} {:<6} {:>6}", "step", "stage", "result", "checks");
        if scaled {
            let _ = write!(header, "  {:>10}", "err/oracle");
        }
        for (_, src) in &sources {
            if scaled {
                let _ = write!(header, "  {:>10}", format!("ratio {src}"));
            } else {
                let _ = write!(header, "  {:>10} {:>10}", format!("max|Δ| {src}"), "cosine");
            }
        }
        if let Some(label) = &budget_label {
            let _ = write!(header, "  {label:>12}");
        }
        let _ = writeln!(out, "{header}  note");
        for ((step, stage), outs) in rows.iter().filter(|(_, o)| !hide_passing || not_passing(o)) {
            let failed = outs.iter().any(|o| o.status == Status::Fail);
            let all_skipped = outs.iter().all(|o| o.status == Status::Skip);
            let all_na = outs
                .iter()
                .all(|o| matches!(o.status, Status::Skip | Status::NotApplicable));
            let result = if failed {
                "FAIL"
            } else if all_skipped {
                "skip"
            } else if all_na {
                "n/a "
            } else {
                "pass"
            };
            let passed = outs.iter().filter(|o| o.status == Status::Pass).count();
            let mut line = format!(
                "{:<8} {:<18} {} {:>6}",
                step.to_string(),
                stage.to_string(),
                view.status(&format!("{result:<6}")),
                format!("{passed}/{}", outs.len())
            );
            if scaled {
                let e = outs
                    .iter()
                    .find_map(|o| o.metrics.get("error_vs_oracle").filter(|_| o.is_golden()));
                let _ = write!(line, "  {:>10}", e.map_or("-".to_string(), |v| format!("{v:.2e}")));
            }
            for (check, _) in &sources {
                match outs.iter().find(|o| &o.check == check) {
                    Some(o) if scaled => {
                        let r = o.metrics.get("ratio").map_or("-".to_string(), |v| format!("{v:.3}"));
                        let _ = write!(line, "  {r:>10}");
                    }
                    None if scaled => {
                        let _ = write!(line, "  {:>10}", "");
                    }
                    Some(o) => {
                        let m = |k: &str| o.metrics.get(k).map_or("-".to_string(), |v| format!("{v:.2e}"));
                        let cos = o.metrics.get("cosine").map_or("-".to_string(), |v| format!("{v:.7}"));
                        let _ = write!(line, "  {:>10} {:>10}", m("max_abs"), cos);
                    }
                    None => {
                        let _ = write!(line, "  {:>10} {:>10}", "", "");
                    }
                }
            }
            if budget_label.is_some() {
                let b = outs
                    .iter()
                    .filter(|o| o.is_references_agree())
                    .filter_map(|o| o.metrics.get("max_abs"))
                    .fold(None, |m: Option<f64>, v| Some(m.map_or(*v, |m| m.max(*v))));
                let _ = write!(line, "  {:>12}", b.map_or("-".to_string(), |v| format!("{v:.2e}")));
            }
            let note = if let Some(o) = outs.iter().find(|o| o.first_divergence) {
                format!("<< FIRST DIVERGENCE ({})", o.check)
            } else if let Some(o) = outs.iter().find(|o| o.at_suspect_golden && o.is_references_agree()) {
                format!("<< GOLDEN SUSPECT ({})", o.check)
            } else if failed {
                let names: Vec<&str> = outs
                    .iter()
                    .filter(|o| o.status == Status::Fail)
                    .map(|o| o.check.as_str())
                    .collect();
                match outs.iter().find_map(|o| o.downstream_of.as_deref()) {
                    Some(d) => format!("{} (downstream of {d})", names.join(", ")),
                    None => names.join(", "),
                }
            } else {
                String::new()
            };
            let _ = writeln!(out, "{}", format!("{}  {note}", line.trim_end()).trim_end());
        }
        if hide_passing {
            let _ = writeln!(
                out,
                "({} passing rows not shown; --verbose shows every row)",
                rows.len() - shown_rows
            );
        }
    }

    let run_checks: Vec<&Outcome> = run
        .outcomes
        .iter()
        .filter(|o| o.at.is_none() && (!view.quiet || o.status == Status::Fail))
        .collect();
    if !run_checks.is_empty() {
        let _ = writeln!(out, "\nrun checks:");
        for o in &run_checks {
            let status = match o.status {
                Status::Pass => "pass",
                Status::Fail => "FAIL",
                Status::Skip => "skip",
                Status::NotApplicable => "n/a",
            };
            let first_line = o.message.lines().next().unwrap_or("");
            let _ = writeln!(
                out,
                "  {} {:<24} {first_line}",
                view.status(&format!("{status:<5}")),
                o.check
            );
        }
    }

    // Failures in full: the first divergence first, then in execution order.
    let mut failures: Vec<&Outcome> = run.outcomes.iter().filter(|o| o.status == Status::Fail).collect();
    failures.sort_by_key(|o| !o.first_divergence);
    if !failures.is_empty() {
        let _ = writeln!(out, "\nfailures ({}):", failures.len());
        for (n, o) in failures.iter().enumerate() {
            // A long list is cut to a count (a real model's downstream
            // failures number thousands; their ids alone were one 20 KB line).
            if n > FULL_FAILURES && !view.verbose {
                let _ = writeln!(
                    out,
                    "  ... and {} more failures (--verbose shows every one; --json FILE writes them all)",
                    failures.len() - n
                );
                break;
            }
            let tag = if o.first_divergence {
                " [FIRST DIVERGENCE]".to_string()
            } else if o.at_suspect_golden {
                " [GOLDEN SUSPECT: the references are outside their allowance here]".to_string()
            } else if let Some(d) = &o.downstream_of {
                format!(" [downstream of {d}]")
            } else {
                String::new()
            };
            let _ = writeln!(out, "--- {} {}{tag}", view.status("FAIL"), o.full_id());
            for l in o.message.lines() {
                let _ = writeln!(out, "    {l}");
            }
            let _ = writeln!(out, "    rerun: {}", o.rerun);
        }
    }
    let _ = writeln!(out);
}
