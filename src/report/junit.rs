//! JUnit XML (`--junit FILE`), the format CI systems ingest: one `<testsuite>`
//! per (spec, engine) run, one `<testcase>` per check instance named by its id,
//! `<failure>` carrying the full message and the rerun command, `<skipped>`
//! carrying the reason. Text is XML-escaped, and characters XML 1.0 cannot
//! hold at all are replaced, so the file always parses.

use std::fmt::Write;

use super::Report;
use crate::checks::Status;

/// Escapes text for XML content and attribute values.
pub fn escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&apos;"),
            '\t' | '\n' | '\r' => out.push(c),
            c if (c as u32) < 0x20 || c == '\u{FFFE}' || c == '\u{FFFF}' => out.push('\u{FFFD}'),
            c => out.push(c),
        }
    }
    out
}

/// One test case, independent of where it came from (a run or a diff).
pub struct Case {
    pub classname: String,
    pub name: String,
    pub status: Status,
    /// Failure or skip text (first line becomes the `message` attribute).
    pub text: String,
}

pub struct Suite {
    pub name: String,
    pub cases: Vec<Case>,
}

pub fn render_suites(root: &str, suites: &[Suite]) -> String {
    let count = |s: &Suite, st: Status| s.cases.iter().filter(|c| c.status == st).count();
    let total: usize = suites.iter().map(|s| s.cases.len()).sum();
    let failures: usize = suites.iter().map(|s| count(s, Status::Fail)).sum();
    let skipped: usize = suites.iter().map(|s| count(s, Status::Skip)).sum();
    let mut out = String::from("<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n");
    let _ = writeln!(
        out,
        "<testsuites name=\"{}\" tests=\"{total}\" failures=\"{failures}\" errors=\"0\" skipped=\"{skipped}\">",
        escape(root)
    );
    for s in suites {
        let _ = writeln!(
            out,
            "  <testsuite name=\"{}\" tests=\"{}\" failures=\"{}\" errors=\"0\" skipped=\"{}\">",
            escape(&s.name),
            s.cases.len(),
            count(s, Status::Fail),
            count(s, Status::Skip)
        );
        for c in &s.cases {
            let open = format!(
                "    <testcase classname=\"{}\" name=\"{}\"",
                escape(&c.classname),
                escape(&c.name)
            );
            let first = c.text.lines().next().unwrap_or("");
            match c.status {
                Status::Pass => {
                    let _ = writeln!(out, "{open}/>");
                }
                Status::Fail => {
                    let _ = writeln!(
                        out,
                        "{open}>\n      <failure message=\"{}\" type=\"check failed\">{}</failure>\n    </testcase>",
                        // The whole failure text: CI UIs often show only the attribute.
                        escape(&c.text),
                        escape(&c.text)
                    );
                }
                Status::Skip => {
                    let _ = writeln!(
                        out,
                        "{open}>\n      <skipped message=\"{}\"/>\n    </testcase>",
                        escape(first)
                    );
                }
            }
        }
        let _ = writeln!(out, "  </testsuite>");
    }
    out.push_str("</testsuites>\n");
    out
}

/// A run report as JUnit: classname `<engine>::<spec>`, name the check id.
pub fn render(report: &Report) -> String {
    let suites: Vec<Suite> = report
        .runs
        .iter()
        .map(|r| Suite {
            name: format!("{}::{}", r.engine, r.spec),
            cases: r
                .outcomes
                .iter()
                .map(|o| {
                    let mut text = o.message.clone();
                    if o.first_divergence {
                        text = format!("[FIRST DIVERGENCE] {text}");
                    } else if let Some(d) = &o.downstream_of {
                        text = format!("[downstream of {d}] {text}");
                    }
                    if o.status == Status::Fail {
                        text += &format!("\nrerun: {}", o.rerun);
                    }
                    Case {
                        classname: format!("{}::{}", o.engine, o.spec),
                        name: o.id.clone(),
                        status: o.status,
                        text,
                    }
                })
                .collect(),
        })
        .collect();
    render_suites("touchstone", &suites)
}
