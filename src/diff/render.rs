//! The diff's sinks: terminal text, Markdown, JUnit (one testcase per check,
//! failing when it regressed) and the HTML page (per step, the error through the
//! stages before and after, the first regression highlighted).

use std::collections::BTreeMap;
use std::fmt::Write;

use super::{Change, DiffReport, Row};
use crate::checks::Status;
use crate::compare::sci;
use crate::report::html::escape;
use crate::report::html::{self, Plot, Section, Series};
use crate::report::junit::{self, Case, Suite};
use crate::report::markdown::cell;
use crate::stage::Step;

fn err(v: Option<f64>) -> String {
    v.map_or("-".into(), sci)
}

fn ratio(r: Option<f64>) -> String {
    match r {
        None => "-".into(),
        Some(r) if r.is_infinite() => "inf".into(),
        Some(r) => format!("{r:.3}x"),
    }
}

fn status_change(r: &Row) -> String {
    let (b, a) = (Row::status(&r.before), Row::status(&r.after));
    if b == a {
        a.to_string()
    } else {
        format!("{b} -> {a}")
    }
}

/// Rows worth a line: an error on either side, or a status change.
fn shown(r: &Row) -> bool {
    r.before_error().is_some() || r.after_error().is_some() || Row::status(&r.before) != Row::status(&r.after)
}

fn verdict(d: &DiffReport) -> String {
    let n = d.regressions().count();
    let counts = format!(
        "{} checks compared, {} vanished (in BASE, not in NEW), {} new (in NEW only), factor {}x",
        d.compared(),
        d.vanished(),
        d.added(),
        d.factor
    );
    let vanished = if d.vanished() > 0 && !d.allow_vanished {
        format!(
            "; {} check(s) of BASE VANISHED from NEW (pass --allow-vanished if that is intended)",
            d.vanished()
        )
    } else {
        String::new()
    };
    match d.first_regression() {
        Some(f) => format!(
            "REGRESSED: {n} regression(s); first regressed stage in execution order: {} ({}: {}){vanished}; {counts}",
            f.step_stage().unwrap_or_else(|| "run".into()),
            f.id,
            f.note
        ),
        None if !vanished.is_empty() => format!("REGRESSED{vanished}; {counts}"),
        None => format!("no regression ({counts})"),
    }
}

/// The terminal table: rows with an error or a status change (`changed_only`:
/// only rows whose change is not `Same`).
pub fn terminal_rows(d: &DiffReport, changed_only: bool) -> String {
    terminal_impl(d, changed_only)
}

pub fn terminal(d: &DiffReport) -> String {
    terminal_impl(d, false)
}

fn terminal_impl(d: &DiffReport, changed_only: bool) -> String {
    let mut out = format!("BASE {}\nNEW  {}\n", d.base.display(), d.new.display());
    let _ = writeln!(
        out,
        "{:<48} {:>10} {:>10} {:>9}  {:<14} note",
        "check", "before", "after", "ratio", "status"
    );
    let multi = {
        let mut runs: Vec<&str> = d.rows.iter().map(|r| r.run.as_str()).collect();
        runs.sort();
        runs.dedup();
        runs.len() > 1
    };
    for r in d
        .rows
        .iter()
        .filter(|r| shown(r) && (!changed_only || r.change != Change::Same))
    {
        let name = if multi { &r.key } else { &r.id };
        let mark = if r.change == Change::Regressed {
            "<< REGRESSION: "
        } else {
            ""
        };
        let _ = writeln!(
            out,
            "{:<48} {:>10} {:>10} {:>9}  {:<14} {mark}{}",
            name,
            err(r.before_error()),
            err(r.after_error()),
            ratio(r.ratio),
            status_change(r),
            r.note
        );
    }
    let _ = writeln!(out, "\ndiff: {}", verdict(d));
    out
}

pub fn markdown(d: &DiffReport) -> String {
    let regressed = d.regressed();
    let mut out = format!(
        "## touchstone diff: {}\n\n{}\n\n",
        if regressed {
            "❌ REGRESSED"
        } else {
            "✅ no regression"
        },
        cell(&verdict(d))
    );
    let head = "| check | before | after | ratio | status | note |\n|---|---:|---:|---:|---|---|\n";
    let line = |r: &Row| {
        format!(
            "| `{}` | {} | {} | {} | {} | {} |\n",
            r.key,
            err(r.before_error()),
            err(r.after_error()),
            ratio(r.ratio),
            status_change(r),
            cell(&r.note)
        )
    };
    if regressed {
        out += head;
        for r in d.regressions() {
            out += &line(r);
        }
        out.push('\n');
    }
    let rest: Vec<&Row> = d
        .rows
        .iter()
        .filter(|r| r.change != Change::Regressed && shown(r))
        .collect();
    if !rest.is_empty() {
        let _ = write!(out, "<details><summary>{} other checks</summary>\n\n{head}", rest.len());
        for r in rest {
            out += &line(r);
        }
        out += "\n</details>\n";
    }
    out
}

pub fn junit(d: &DiffReport) -> String {
    let mut suites: BTreeMap<String, Vec<Case>> = BTreeMap::new();
    for r in &d.rows {
        let run = r.run.clone();
        let text = format!(
            "{}: error {} -> {} (ratio {}), status {}",
            if r.note.is_empty() { "unchanged" } else { &r.note },
            err(r.before_error()),
            err(r.after_error()),
            ratio(r.ratio),
            status_change(r)
        );
        let text = match &r.after {
            Some(a) if r.change == Change::Regressed && !a.message.is_empty() => format!("{text}\n{}", a.message),
            _ => text,
        };
        suites.entry(run.clone()).or_default().push(Case {
            classname: format!("diff::{run}"),
            name: r.id.clone(),
            status: if r.change == Change::Regressed {
                Status::Fail
            } else {
                Status::Pass
            },
            text,
        });
    }
    let suites: Vec<Suite> = suites
        .into_iter()
        .map(|(name, cases)| Suite {
            name: format!("diff::{name}"),
            cases,
        })
        .collect();
    junit::render_suites("touchstone diff", &suites)
}

pub fn html(d: &DiffReport) -> String {
    let header = format!(
        "<p>BASE <code>{}</code><br>NEW <code>{}</code></p><p class=\"{}\">{}</p>",
        escape(&d.base.display().to_string()),
        escape(&d.new.display().to_string()),
        if d.regressed() { "fail" } else { "pass" },
        escape(&verdict(d))
    );
    // run -> step -> golden rows in stage order (rows are already in execution order)
    let mut runs: BTreeMap<String, BTreeMap<Step, Vec<&Row>>> = BTreeMap::new();
    for r in d.rows.iter().filter(|r| r.family().is_golden()) {
        if let Some((step, _)) = r.at {
            runs.entry(r.run.clone()).or_default().entry(step).or_default().push(r);
        }
    }
    let first = d.first_regression().map(|r| r.key.clone());
    let mut sections = Vec::new();
    for (run, steps) in &runs {
        let mut plots = Vec::new();
        for (step, rows) in steps {
            let mut labels: Vec<String> = Vec::new();
            let mut idx = |r: &Row| {
                let l = format!("{}", r.at.expect("stage rows").1);
                match labels.iter().position(|x| *x == l) {
                    Some(i) => i,
                    None => {
                        labels.push(l);
                        labels.len() - 1
                    }
                }
            };
            // One line per (golden source, side): mixing two sources in one
            // line would zigzag between them at every stage.
            // (source, is NEW) -> points (x index, error, failed).
            type Points = Vec<(usize, f64, bool)>;
            let mut lines: BTreeMap<(String, bool), Points> = BTreeMap::new();
            let mut highlight = None;
            for r in rows {
                let i = idx(r);
                let source = r.family().source().unwrap_or_default().to_string();
                if let Some(e) = r.before_error() {
                    let failed = Row::status(&r.before) == "fail";
                    lines.entry((source.clone(), false)).or_default().push((i, e, failed));
                }
                if let Some(e) = r.after_error() {
                    lines
                        .entry((source, true))
                        .or_default()
                        .push((i, e, r.change == Change::Regressed));
                }
                if first.as_deref() == Some(r.key.as_str()) {
                    highlight = Some((i, format!("first regression ({})", r.check)));
                }
            }
            const BASE_COLORS: [plotters::style::RGBColor; 2] = [html::BLUE, html::PURPLE];
            const NEW_COLORS: [plotters::style::RGBColor; 2] = [html::ORANGE, html::GREEN];
            let sources: Vec<String> = {
                let mut v: Vec<String> = lines.keys().map(|k| k.0.clone()).collect();
                v.dedup();
                v
            };
            let series = lines
                .into_iter()
                .map(|((source, is_new), points)| {
                    let k = sources.iter().position(|s| *s == source).unwrap_or(0) % 2;
                    Series {
                        name: format!("{} {source}", if is_new { "NEW" } else { "BASE" }),
                        color: if is_new { NEW_COLORS[k] } else { BASE_COLORS[k] },
                        points,
                    }
                })
                .collect();
            plots.push(Plot {
                title: format!("{step}: max |Δ| vs each golden, BASE and NEW"),
                x_labels: labels,
                series,
                tolerance: rows
                    .iter()
                    .find_map(|r| r.after.as_ref().and_then(|a| a.metrics.get("atol")))
                    .map(|a| (*a, format!("atol {a:e}"))),
                highlight,
                y_desc: "max |Δ| (log)".into(),
            });
        }
        let details = d
            .regressions()
            .filter(|r| r.run == *run)
            .map(|r| {
                (
                    format!("{} — {}", r.key, r.note),
                    format!(
                        "error {} -> {} (ratio {}), status {}\n{}",
                        err(r.before_error()),
                        err(r.after_error()),
                        ratio(r.ratio),
                        status_change(r),
                        r.after.as_ref().map_or("", |a| a.message.as_str())
                    ),
                )
            })
            .collect();
        sections.push(Section {
            title: run.clone(),
            summary_html: String::new(),
            plots,
            details,
        });
    }
    html::page("touchstone diff", &header, &sections)
}
