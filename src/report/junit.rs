//! JUnit XML (`--junit FILE`), the format CI systems ingest, written by
//! `quick-junit` (nextest's writer): one `<testsuite>` per (spec, engine) run,
//! one `<testcase>` per check instance named by its id, `<failure>` carrying
//! the full message and the rerun command (in the `message` attribute too,
//! as many CI UIs show only that), `<skipped>` carrying the reason.

use quick_junit::{NonSuccessKind, TestCase, TestCaseStatus, TestSuite};

use super::Report;
use crate::checks::Status;

/// One test case, independent of where it came from (a run or a diff).
pub struct Case {
    pub classname: String,
    pub name: String,
    pub status: Status,
    /// Failure or skip text (a skip's first line is its message).
    pub text: String,
}

pub struct Suite {
    pub name: String,
    pub cases: Vec<Case>,
}

/// Characters XML 1.0 cannot hold replaced by U+FFFD, so a message keeps a
/// mark where one was (quick-junit would drop C0 controls silently, and
/// passes U+FFFE/U+FFFF through).
fn xml_text(s: &str) -> String {
    s.chars()
        .map(|c| match c {
            '\t' | '\n' | '\r' => c,
            c if (c as u32) < 0x20 || c == '\u{FFFE}' || c == '\u{FFFF}' => '\u{FFFD}',
            c => c,
        })
        .collect()
}

pub fn render_suites(root: &str, suites: &[Suite]) -> String {
    let mut report = quick_junit::Report::new(xml_text(root));
    for s in suites {
        let mut suite = TestSuite::new(xml_text(&s.name));
        for c in &s.cases {
            let text = xml_text(&c.text);
            let status = match c.status {
                Status::Pass => TestCaseStatus::success(),
                Status::Fail => {
                    let mut st = TestCaseStatus::non_success(NonSuccessKind::Failure);
                    st.set_message(text.as_str())
                        .set_type("check failed")
                        .set_description(text.as_str());
                    st
                }
                Status::Skip | Status::NotApplicable => {
                    let mut st = TestCaseStatus::skipped();
                    st.set_message(text.lines().next().unwrap_or(""));
                    st
                }
            };
            let mut case = TestCase::new(xml_text(&c.name), status);
            case.set_classname(xml_text(&c.classname));
            suite.add_test_case(case);
        }
        report.add_test_suite(suite);
    }
    report.to_string().expect("a report of plain strings serialises")
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
