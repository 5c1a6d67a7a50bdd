//! Markdown (`--markdown FILE`) for pull-request comments and CI step
//! summaries: a verdict line per run, the failures first (one table row each,
//! first divergence marked), then every (step, stage) in a collapsed table.

use std::collections::BTreeMap;
use std::fmt::Write;

use super::{Outcome, Report};
use crate::checks::Status;
use crate::compare::sci;
use crate::stage::{Stage, Step};

/// Makes text safe inside a table cell: no pipes, no line breaks.
pub fn cell(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('|', "\\|")
        .replace('\r', "")
        .replace('\n', "<br>")
}

fn metric(o: &Outcome, k: &str) -> String {
    o.metrics.get(k).map_or("-".into(), |v| sci(*v))
}

pub fn render(report: &Report) -> String {
    let c = report.counts();
    let verdict = if c.failed > 0 {
        "❌ FAILED"
    } else if c.passed == 0 {
        "⚠️ NOTHING RAN"
    } else {
        "✅ PASSED"
    };
    let mut out = format!(
        "## touchstone: {verdict}\n\n{} passed, {} failed, {} skipped{}\n",
        c.passed,
        c.failed,
        c.skipped,
        c.not_applicable_tail()
    );
    for run in &report.runs {
        let _ = write!(
            out,
            "\n### `{}` on `{}` (storage {})",
            run.spec, run.engine, run.storage
        );
        if let Some(reason) = &run.skipped {
            let _ = writeln!(out, ": skipped ({})", cell(reason));
            continue;
        }
        let _ = writeln!(out, ": {}\n", if run.passed { "passed" } else { "FAILED" });
        if let Some(d) = &run.first_divergence {
            let _ = writeln!(out, "First divergence: **{}/{}** (`{}`)\n", d.step, d.stage, d.check);
        }
        if let Some(d) = &run.suspect_golden {
            let _ = writeln!(out, "Golden suspect: **{}/{}** (`{}`)\n", d.step, d.stage, d.check);
        }
        let mut failures: Vec<&Outcome> = run.outcomes.iter().filter(|o| o.status == Status::Fail).collect();
        failures.sort_by_key(|o| !o.first_divergence);
        if !failures.is_empty() {
            let _ = writeln!(
                out,
                "| | check | max\\|Δ\\| | NMSE | message |\n|---|---|---:|---:|---|"
            );
            for o in &failures {
                let tag = if o.first_divergence {
                    "**first divergence** "
                } else if o.at_suspect_golden {
                    "**golden suspect** "
                } else if o.downstream_of.is_some() {
                    "downstream "
                } else {
                    ""
                };
                let _ = writeln!(
                    out,
                    "| ❌ | `{}` | {} | {} | {}{} |",
                    o.id,
                    metric(o, "max_abs"),
                    metric(o, "nmse"),
                    tag,
                    cell(&o.message)
                );
            }
            out.push('\n');
        }
        let mut rows: BTreeMap<(Step, Stage), Vec<&Outcome>> = BTreeMap::new();
        for o in &run.outcomes {
            if let Some(at) = o.at {
                rows.entry(at).or_default().push(o);
            }
        }
        if !rows.is_empty() {
            let _ = writeln!(
                out,
                "<details><summary>{} stages</summary>\n\n| step | stage | result | checks | worst golden max\\|Δ\\| |\n|---|---|---|---:|---:|",
                rows.len()
            );
            for ((step, stage), outs) in &rows {
                let failed = outs.iter().any(|o| o.status == Status::Fail);
                let passed = outs.iter().filter(|o| o.status == Status::Pass).count();
                let worst = outs
                    .iter()
                    .filter(|o| o.is_golden())
                    .filter_map(|o| o.metrics.get("max_abs"))
                    .fold(None, |m: Option<f64>, &v| Some(m.map_or(v, |m| m.max(v))));
                let _ = writeln!(
                    out,
                    "| {step} | {stage} | {} | {passed}/{} | {} |",
                    if failed { "❌" } else { "✅" },
                    outs.len(),
                    worst.map_or("-".into(), sci)
                );
            }
            let _ = writeln!(out, "\n</details>");
        }
        let run_checks: Vec<&Outcome> = run.outcomes.iter().filter(|o| o.at.is_none()).collect();
        if !run_checks.is_empty() {
            let _ = writeln!(out, "\n| run check | result | message |\n|---|---|---|");
            for o in run_checks {
                let s = match o.status {
                    Status::Pass => "✅",
                    Status::Fail => "❌",
                    Status::Skip => "skip",
                    Status::NotApplicable => "n/a",
                };
                let _ = writeln!(
                    out,
                    "| `{}` | {s} | {} |",
                    o.check,
                    cell(o.message.lines().next().unwrap_or(""))
                );
            }
        }
    }
    out
}
