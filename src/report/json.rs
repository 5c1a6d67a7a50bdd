//! The machine-readable report (`--json FILE`): top-level `passed`,
//! `first_divergence` (of the first run that has one), per-run summaries, and
//! every check outcome with its metrics, message and rerun command.

use serde::Serialize;

use super::merge::Shard;
use super::{Counts, Divergence, Outcome, Report};
use crate::tensor::DType;

#[derive(Serialize)]
struct JsonReport<'a> {
    /// Present in a shard's report only (`run --shard`), for `merge`.
    #[serde(skip_serializing_if = "Option::is_none")]
    shard: Option<&'a Shard>,
    passed: bool,
    summary: Counts,
    first_divergence: Option<JsonDivergence<'a>>,
    runs: Vec<JsonRun<'a>>,
    checks: Vec<&'a Outcome>,
}

#[derive(Serialize)]
struct JsonDivergence<'a> {
    spec: &'a str,
    engine: &'a str,
    #[serde(flatten)]
    at: &'a Divergence,
}

#[derive(Serialize)]
struct JsonRun<'a> {
    spec: &'a str,
    spec_path: &'a str,
    engine: &'a str,
    storage: DType,
    passed: bool,
    first_divergence: Option<&'a Divergence>,
    suspect_golden: Option<&'a Divergence>,
    skipped: Option<&'a str>,
    notes: &'a [String],
    suspect_references: Vec<super::notes::SuspectReference>,
    largest_ratios: Vec<super::notes::LargestRatio>,
    prompt_text: Option<&'a str>,
    continuation_text: Option<&'a str>,
}

pub fn to_string(report: &Report) -> String {
    to_string_with(report, None)
}

/// The report of one shard of a run: the report of its runs, and which shard
/// of which runs it is.
pub fn to_string_with(report: &Report, shard: Option<&Shard>) -> String {
    let first_divergence = report.runs.iter().find_map(|r| {
        r.first_divergence.as_ref().map(|at| JsonDivergence {
            spec: &r.spec,
            engine: &r.engine,
            at,
        })
    });
    let doc = JsonReport {
        shard,
        passed: report.passed(),
        summary: report.counts(),
        first_divergence,
        runs: report
            .runs
            .iter()
            .map(|r| JsonRun {
                spec: &r.spec,
                spec_path: &r.spec_path,
                engine: &r.engine,
                storage: r.storage,
                passed: r.passed,
                first_divergence: r.first_divergence.as_ref(),
                suspect_golden: r.suspect_golden.as_ref(),
                skipped: r.skipped.as_deref(),
                notes: &r.notes,
                suspect_references: r.suspect_references(),
                largest_ratios: r.largest_ratios(),
                prompt_text: r.prompt_text.as_deref(),
                continuation_text: r.continuation_text.as_deref(),
            })
            .collect(),
        checks: report.runs.iter().flat_map(|r| &r.outcomes).collect(),
    };
    serde_json::to_string_pretty(&doc).expect("report is plain data")
}
