//! Shards of one run merged back into the report the whole run gives.
//!
//! `touchstone run --shard K/N` runs every N-th (spec, engine) run of the
//! whole selection, starting at the K-th, and its `--json` report says which
//! shard it is and lists every run of the whole selection in order
//! (`Shard`). `touchstone merge` reads the N shard reports back, refuses a
//! set that is not exactly one run's shards (a shard missing or given twice,
//! shards of another selection or another N, a run missing or reported by
//! two shards), and puts the runs back in the order of the whole selection:
//! the merged report is the one a single run writes, in every sink.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Deserializer, Serialize};

use super::{Divergence, Outcome, Report, SuiteRun};
use crate::error::{Error, Result};
use crate::tensor::DType;

/// Which shard of which runs a shard report is.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Shard {
    /// 1-based.
    pub index: usize,
    pub count: usize,
    /// Every run of the whole selection, in order: `<spec path> on <engine>`
    /// (a shard holds its own of them, in this order).
    pub runs: Vec<String>,
}

impl Shard {
    /// Whether run `i` (0-based, in the whole selection's order) is this
    /// shard's: runs are dealt round-robin, so shards differ by at most one
    /// run and a run's shard depends only on its place in the selection.
    pub fn owns(index: usize, count: usize, i: usize) -> bool {
        i % count == index - 1
    }
}

/// `K/N` as `--shard` takes it.
pub fn parse_shard(s: &str) -> std::result::Result<(usize, usize), String> {
    let bad = || format!("--shard {s:?}: expected K/N with 1 <= K <= N, e.g. 2/3");
    let (k, n) = s.split_once('/').ok_or_else(bad)?;
    let (k, n): (usize, usize) = (
        k.trim().parse().map_err(|_| bad())?,
        n.trim().parse().map_err(|_| bad())?,
    );
    if k == 0 || n == 0 || k > n {
        return Err(bad());
    }
    Ok((k, n))
}

/// A run as the JSON report stores it (its checks are listed apart).
#[derive(Deserialize)]
struct JsonRun {
    spec: String,
    spec_path: String,
    engine: String,
    storage: DType,
    passed: bool,
    first_divergence: Option<Divergence>,
    suspect_golden: Option<Divergence>,
    skipped: Option<String>,
    #[serde(default)]
    notes: Vec<String>,
    prompt_text: Option<String>,
    continuation_text: Option<String>,
}

#[derive(Deserialize)]
struct JsonReport {
    #[serde(default)]
    shard: Option<Shard>,
    runs: Vec<JsonRun>,
    checks: Vec<Outcome>,
}

/// Reads a `--json` report back: its runs with their checks, and its shard.
pub fn read(path: &Path) -> Result<(Report, Option<Shard>)> {
    let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
    let doc: JsonReport = serde_json::from_str(&text).map_err(|e| {
        Error::Usage(format!(
            "{}:{}:{}: not a touchstone --json report: {e}",
            path.display(),
            e.line(),
            e.column()
        ))
    })?;
    let mut checks = doc.checks.into_iter().peekable();
    let mut runs = Vec::with_capacity(doc.runs.len());
    // The checks are written run after run, in order.
    for r in doc.runs {
        let mut outcomes = Vec::new();
        while let Some(o) = checks.next_if(|o| o.spec == r.spec && o.engine == r.engine) {
            outcomes.push(with_place(o));
        }
        runs.push(SuiteRun {
            spec: r.spec,
            spec_path: r.spec_path,
            engine: r.engine,
            storage: r.storage,
            passed: r.passed,
            first_divergence: r.first_divergence,
            suspect_golden: r.suspect_golden,
            skipped: r.skipped,
            notes: r.notes,
            prompt_text: r.prompt_text,
            continuation_text: r.continuation_text,
            outcomes,
        });
    }
    if let Some(o) = checks.next() {
        return Err(Error::Usage(format!(
            "{}: check {} belongs to no run of the report (spec {}, engine {})",
            path.display(),
            o.id,
            o.spec,
            o.engine
        )));
    }
    Ok((Report { runs }, doc.shard))
}

/// The (step, stage) of an outcome read back (not stored: it is its step and
/// stage fields, parsed).
fn with_place(mut o: Outcome) -> Outcome {
    o.at = match (&o.step, &o.stage) {
        (Some(step), Some(stage)) => crate::stage::parse_key(&format!("{step}/{stage}")),
        _ => None,
    };
    o
}

/// The shards' runs, in the whole selection's order.
pub fn merge(parts: Vec<(PathBuf, Report, Option<Shard>)>) -> Result<Report> {
    let bad = |msg: String| Err(Error::Usage(msg));
    let mut first: Option<(PathBuf, Shard)> = None;
    let mut by_index: BTreeMap<usize, PathBuf> = BTreeMap::new();
    let mut by_run: BTreeMap<usize, SuiteRun> = BTreeMap::new();
    for (path, report, shard) in parts {
        let Some(shard) = shard else {
            return bad(format!(
                "{}: not a shard's report (written by `touchstone run --shard K/N --json FILE`)",
                path.display()
            ));
        };
        match &first {
            None => first = Some((path.clone(), shard.clone())),
            Some((p0, s0)) if s0.count != shard.count || s0.runs != shard.runs => {
                return bad(format!(
                    "{} and {} are shards of different runs (other specs, engines or shard count)",
                    p0.display(),
                    path.display()
                ));
            }
            Some(_) => {}
        }
        if let Some(p) = by_index.insert(shard.index, path.clone()) {
            return bad(format!(
                "shard {}/{} is given twice: {} and {}",
                shard.index,
                shard.count,
                p.display(),
                path.display()
            ));
        }
        // A shard's runs are its own of the whole list, in order.
        let own: Vec<usize> = (0..shard.runs.len())
            .filter(|&i| Shard::owns(shard.index, shard.count, i))
            .collect();
        if own.len() != report.runs.len() {
            return bad(format!(
                "{}: shard {}/{} should hold {} run(s), it holds {}",
                path.display(),
                shard.index,
                shard.count,
                own.len(),
                report.runs.len()
            ));
        }
        by_run.extend(own.into_iter().zip(report.runs));
    }
    let Some((_, shard)) = first else {
        return bad("merge: give the shard reports to merge".into());
    };
    let missing: Vec<String> = (1..=shard.count)
        .filter(|k| !by_index.contains_key(k))
        .map(|k| format!("{k}/{}", shard.count))
        .collect();
    if !missing.is_empty() {
        return bad(format!(
            "shard(s) {} missing: a merge needs every shard",
            missing.join(", ")
        ));
    }
    let mut runs = Vec::with_capacity(shard.runs.len());
    // Every shard is present and holds its own runs: none is missing.
    for i in 0..shard.runs.len() {
        runs.extend(by_run.remove(&i));
    }
    Ok(Report { runs })
}

/// Reads a metrics map whose NaN values the JSON writer wrote as null.
pub fn nan_metrics<'de, D: Deserializer<'de>>(d: D) -> std::result::Result<BTreeMap<String, f64>, D::Error> {
    let m: BTreeMap<String, Option<f64>> = Deserialize::deserialize(d)?;
    Ok(m.into_iter().map(|(k, v)| (k, v.unwrap_or(f64::NAN))).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shard_arguments_are_checked() {
        assert_eq!(parse_shard("2/3"), Ok((2, 3)));
        for bad in ["0/3", "4/3", "3", "a/b", "1/0"] {
            assert!(parse_shard(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn round_robin_deals_every_run_to_exactly_one_shard() {
        for n in 1..5 {
            for i in 0..11 {
                assert_eq!((1..=n).filter(|&k| Shard::owns(k, n, i)).count(), 1);
            }
        }
    }
}
