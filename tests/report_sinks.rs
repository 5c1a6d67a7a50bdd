//! The report sinks on a fixed fixture report (built here, no engine run):
//! insta snapshots pin the terminal, Markdown and JUnit renderings; the JUnit
//! file must parse as XML with one testcase per check; the HTML page carries an
//! SVG plot per step with the tolerance line and the first divergence.
//!
//! Snapshots live in tests/snapshots/. On CI (`CI=true`) insta never writes
//! them: a changed rendering fails the test instead of blessing itself.

use std::collections::BTreeMap;

use touchstone::checks::{Family, Status, Verdict};
use touchstone::report::{html, junit, markdown, terminal, Outcome, Report, SuiteRun};
use touchstone::stage::{BlockStage, Stage, Step};

fn verdict(status: Status, message: &str, metrics: &[(&str, f64)]) -> Verdict {
    Verdict {
        status,
        metrics: metrics
            .iter()
            .map(|(k, v)| (k.to_string(), *v))
            .collect::<BTreeMap<_, _>>(),
        message: message.to_string(),
    }
}

fn outcome(at: Option<(Step, Stage)>, check: &str, v: Verdict) -> Outcome {
    let id = match at {
        Some((s, t)) => format!("{s}/{t}::{check}"),
        None => format!("run::{check}"),
    };
    let rerun = format!("touchstone run specs/fixture.yaml --engine cpu --only '{id}'");
    // The fixture names its checks; their families are what the runner would give them.
    let family = match (at, check.split_once(':')) {
        (None, _) => Family::Run,
        (_, Some(("golden", source))) => Family::Golden { source: source.into() },
        (_, Some(("references_agree", pair))) => {
            let (base, other) = pair.split_once('~').expect("base~other");
            Family::ReferencesAgree {
                base: base.into(),
                other: other.into(),
            }
        }
        _ => Family::Invariant,
    };
    Outcome::new("fixture", "cpu", &id, at, family, v, rerun)
}

/// Two steps, two layers' worth of a few stages; decode1/blk.1.attn_out fails
/// (the first divergence), logits fails downstream, one skip, two run checks.
pub fn fixture() -> Report {
    let tol = [("atol", 1e-5), ("rtol", 1.3e-6)];
    let golden_pass = |step, stage, max_abs: f64| {
        let mut m = vec![("max_abs", max_abs), ("nmse", max_abs * 1e-3), ("cosine", 1.0)];
        m.extend(tol);
        outcome(
            Some((step, stage)),
            "golden:hf",
            verdict(
                Status::Pass,
                &format!("within tolerance of golden `hf`: max|Δ| {max_abs:.1e}"),
                &m,
            ),
        )
    };
    let a0 = Stage::Block(0, BlockStage::AttnOut);
    let a1 = Stage::Block(1, BlockStage::AttnOut);
    let p0 = Stage::Block(0, BlockStage::AttnProbs);
    let fail_msg = "differs from golden `hf` (goldens/fixture/hf.safetensors):\n\
                    Mismatched elements: 1 / 64 (1.56%) under |a-e| <= atol 1e-5 + rtol 1.3e-6*|e|\n\
                    Greatest absolute difference: 1.0e-2 at index [0, 5] (actual 0.1234, expected 0.1334; allowed there 1.0e-5)\n\
                    NMSE 2.1e-3, cosine 0.9989000, max ULP 123456 <&\"'>";
    let mut fail_m = vec![
        ("max_abs", 1e-2),
        ("nmse", 2.1e-3),
        ("cosine", 0.9989),
        ("mismatched", 1.0),
    ];
    fail_m.extend(tol);
    let outcomes = vec![
        golden_pass(Step::Prefill, Stage::Embed, 0.0),
        outcome(
            Some((Step::Prefill, Stage::Embed)),
            "finite",
            verdict(Status::Pass, "all finite", &[]),
        ),
        golden_pass(Step::Prefill, p0, 8.9e-8),
        outcome(
            Some((Step::Prefill, p0)),
            "softmax_rows",
            verdict(Status::Pass, "rows sum to 1", &[("max_row_err", 1.2e-7)]),
        ),
        golden_pass(Step::Prefill, a0, 2.4e-7),
        golden_pass(Step::Prefill, a1, 3.0e-7),
        golden_pass(Step::Prefill, Stage::Logits, 1.9e-6),
        golden_pass(Step::Decode(1), Stage::Embed, 0.0),
        golden_pass(Step::Decode(1), a0, 2.0e-7),
        outcome(
            Some((Step::Decode(1), a1)),
            "golden:hf",
            verdict(Status::Fail, fail_msg, &fail_m),
        ),
        outcome(
            Some((Step::Decode(1), Stage::Logits)),
            "golden:hf",
            verdict(
                Status::Fail,
                "differs from golden `hf`: 12/512 mismatched",
                &[
                    ("max_abs", 4e-3),
                    ("nmse", 1e-4),
                    ("cosine", 0.9999),
                    ("atol", 1e-5),
                    ("rtol", 1.3e-6),
                ],
            ),
        ),
        outcome(
            Some((Step::Decode(1), Stage::Logits)),
            "shape",
            verdict(Status::Skip, "no capture requested", &[]),
        ),
        outcome(
            None,
            "determinism",
            verdict(Status::Pass, "3 runs bitwise identical", &[("runs", 3.0)]),
        ),
        outcome(
            None,
            "greedy_tokens",
            verdict(
                Status::Fail,
                "token 2 differs: engine 17, golden 249",
                &[("first_mismatch", 2.0)],
            ),
        ),
    ];
    Report {
        runs: vec![SuiteRun::new("fixture", "specs/fixture.yaml", "cpu", outcomes, None)],
    }
}

#[test]
fn terminal_snapshot() {
    insta::assert_snapshot!("terminal", terminal::render(&fixture()));
}

#[test]
fn markdown_snapshot() {
    insta::assert_snapshot!("markdown", markdown::render(&fixture()));
}

#[test]
fn junit_snapshot() {
    insta::assert_snapshot!("junit", junit::render(&fixture()));
}

#[test]
fn junit_parses_with_one_testcase_per_check_and_full_failure_messages() {
    let r = fixture();
    let xml = junit::render(&r);
    let doc = roxmltree::Document::parse(&xml).expect("JUnit output is well-formed XML");
    let cases: Vec<_> = doc.descendants().filter(|n| n.has_tag_name("testcase")).collect();
    assert_eq!(cases.len(), r.runs[0].outcomes.len());
    let failed = cases
        .iter()
        .find(|c| c.attribute("name") == Some("decode1/blk.1.attn_out::golden:hf"))
        .unwrap();
    let failure = failed.children().find(|n| n.has_tag_name("failure")).unwrap();
    let text = failure.text().unwrap();
    // The whole message, unescaped back, and the rerun command.
    assert!(
        text.contains("Greatest absolute difference: 1.0e-2 at index [0, 5]"),
        "{text}"
    );
    assert!(text.contains("<&\"'>"), "{text}");
    assert!(text.contains("rerun: touchstone run"), "{text}");
    assert!(text.starts_with("[FIRST DIVERGENCE]"), "{text}");
    let skipped = doc.descendants().filter(|n| n.has_tag_name("skipped")).count();
    assert_eq!(skipped, 1);
    let root = doc.root_element();
    assert_eq!(root.attribute("failures"), Some("3"));
    // Characters XML cannot hold are replaced, never emitted.
    let mut r = fixture();
    r.runs[0].outcomes[0].message = "a\u{1}b\u{FFFF}c".into();
    r.runs[0].outcomes[0].status = Status::Fail;
    let xml = junit::render(&r);
    roxmltree::Document::parse(&xml).expect("still well-formed XML");
    assert!(xml.contains("a\u{FFFD}b\u{FFFD}c") && !xml.contains('\u{1}'), "{xml}");
}

#[test]
fn html_is_self_contained_with_a_plot_per_step() {
    let page = html::render(&fixture());
    assert!(page.starts_with("<!DOCTYPE html>"));
    assert_eq!(page.matches("<svg").count(), 2, "one plot per step");
    assert!(page.contains("first divergence (golden:hf)"), "highlight label");
    assert!(page.contains("atol 1e-5"), "tolerance line label");
    assert!(page.contains("blk.1.attn_out"), "stage names on the x axis");
    assert!(page.contains("NMSE 2.1e-3, cosine 0.9989000, max ULP 123456 &lt;&amp;&quot;&apos;&gt;"));
    // Nothing fetched: no scripts, no external sources or stylesheets (the SVG
    // namespace URI is an identifier, not a fetch).
    assert!(!page.contains("<script") && !page.contains("src=") && !page.contains("<link"));
}

/// A scaled-policy run where the HF golden is off at decode1/blk.0.attn_out:
/// its `references_agree` fails there, the engine's golden check at the same
/// stage fails too, and a later stage fails against the engine.
fn scaled_fixture() -> Report {
    let st = |l, b| Stage::Block(l, b);
    let golden = |step, stage, ratio: f64, status| {
        outcome(
            Some((step, stage)),
            "golden:hf",
            verdict(
                status,
                "engine error …",
                &[
                    ("ratio", ratio),
                    ("factor", 4.0),
                    ("error_vs_oracle", ratio * 1e-6),
                    ("allowed", 4e-6),
                ],
            ),
        )
    };
    let agree = |step, stage, ratio: f64, status| {
        outcome(
            Some((step, stage)),
            "references_agree:oracle~hf",
            verdict(status, "`hf`'s error …", &[("ratio", ratio), ("factor", 4.0)]),
        )
    };
    let (a0, o0) = (st(0, BlockStage::AttnOut), st(0, BlockStage::Out));
    let outcomes = vec![
        golden(Step::Prefill, a0, 0.7, Status::Pass),
        agree(Step::Prefill, a0, 1.2, Status::Pass),
        golden(Step::Decode(1), a0, 5.0, Status::Fail),
        agree(Step::Decode(1), a0, 900.0, Status::Fail),
        golden(Step::Decode(1), o0, 6.0, Status::Fail),
        agree(Step::Decode(1), o0, 1.0, Status::Pass),
    ];
    Report {
        runs: vec![SuiteRun::new("fixture", "specs/fixture.yaml", "cpu", outcomes, None)],
    }
}

#[test]
fn a_suspect_golden_is_never_the_first_divergence() {
    let r = scaled_fixture();
    let run = &r.runs[0];
    let s = run.suspect_golden.as_ref().expect("suspect golden");
    assert_eq!((s.step.as_str(), s.stage.as_str()), ("decode1", "blk.0.attn_out"));
    // The engine's failure at the suspect stage is not blamed on it; the next
    // stage, where the references are within their allowance, is.
    let fd = run.first_divergence.as_ref().expect("first divergence");
    assert_eq!((fd.step.as_str(), fd.stage.as_str()), ("decode1", "blk.0.out"));
    let at_suspect: Vec<&str> = run
        .outcomes
        .iter()
        .filter(|o| o.at_suspect_golden)
        .map(|o| o.id.as_str())
        .collect();
    assert_eq!(
        at_suspect,
        [
            "decode1/blk.0.attn_out::golden:hf",
            "decode1/blk.0.attn_out::references_agree:oracle~hf"
        ]
    );
    let term = terminal::render(&r);
    assert!(term.contains("GOLDEN SUSPECT"), "{term}");
    assert!(term.contains("ratio hf"), "the ratio column: {term}");
}

#[test]
fn html_plots_the_scaled_ratio_against_the_factor() {
    let page = html::render(&scaled_fixture());
    assert!(page.contains("scaled policy, error ratio per stage"));
    assert!(page.contains("factor 4 (fails above)"), "factor line");
    assert!(page.contains("hf vs oracle / its floor"), "the references' own ratio");
    assert!(page.contains("Golden suspect: decode1/blk.0.attn_out"));
}
