//! `touchstone diff BASE.json NEW.json`: the regression report between two runs
//! (two `--json` reports). Checks are matched by `<engine>::<spec>::<id>`; for
//! each, the error before and after (the check's error metric: `max_abs` for
//! golden checks, the invariant's own worst error otherwise), their ratio and
//! the status change.
//!
//! A **regression** is a check that newly fails (failing now, not failing or
//! absent before), or a check passing on both sides whose error grew by more
//! than `factor` (an error appearing where there was exactly none counts: a
//! stage that was exact is not any more). The first regression in execution
//! order (step, then stage, then run checks) is named: like the first
//! divergence, it is where to look first.

pub mod render;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::Deserialize;

use crate::checks::kind::Kind;
use crate::checks::{Family, Metric};
use crate::error::{Error, Result};
use crate::stage::{parse_key, Stage, Step};

/// One check as the JSON report stores it (only what a diff needs).
#[derive(Clone, Debug, Deserialize)]
pub struct JsonCheck {
    pub spec: String,
    pub engine: String,
    pub id: String,
    #[serde(default)]
    pub step: Option<String>,
    #[serde(default)]
    pub stage: Option<String>,
    pub check: String,
    /// The check's family (`"family": …` in reports since it was recorded).
    #[serde(flatten, default)]
    pub family: Option<Family>,
    /// The metric that is the check's error, as the report recorded it.
    #[serde(default)]
    pub error_metric: Option<Metric>,
    pub status: String,
    #[serde(default)]
    pub metrics: BTreeMap<String, f64>,
    #[serde(default)]
    pub message: String,
}

#[derive(Deserialize)]
struct JsonReport {
    checks: Vec<JsonCheck>,
}

impl JsonCheck {
    /// The check's error: its recorded error metric; for a report written
    /// before the metric was recorded, the first metric it has, most
    /// specific first.
    pub fn error(&self) -> Option<(&'static str, f64)> {
        let value = |m: Metric| self.metrics.get(m.key()).map(|v| (m.key(), *v));
        match self.error_metric {
            Some(m) => value(m),
            None => Metric::ALL.into_iter().find_map(value),
        }
    }

    /// The check's family: as recorded, or for a report written before
    /// families were recorded, read from its id as the check tables write
    /// ids (`golden:SOURCE`, `references_agree:BASE~OTHER`).
    pub fn family(&self) -> Family {
        if let Some(f) = &self.family {
            return f.clone();
        }
        let golden = crate::checks::stage::Golden::NAME;
        let agree = crate::checks::stage::ReferencesAgree::NAME;
        match self.check.split_once(':') {
            _ if self.step.is_none() => Family::Run,
            Some((k, source)) if k == golden => Family::Golden { source: source.into() },
            Some((k, pair)) if k == agree => match pair.split_once('~') {
                Some((base, other)) => Family::ReferencesAgree {
                    base: base.into(),
                    other: other.into(),
                },
                None => Family::Invariant,
            },
            _ => Family::Invariant,
        }
    }
    fn key(&self) -> String {
        format!("{}::{}::{}", self.engine, self.spec, self.id)
    }
    fn at(&self) -> Option<(Step, Stage)> {
        parse_key(&format!("{}/{}", self.step.as_deref()?, self.stage.as_deref()?))
    }
}

/// Reads a `--json` report; a missing or malformed file is bad input naming it.
pub fn load(path: &Path) -> Result<Vec<JsonCheck>> {
    let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
    parse_report(&text, path)
}

/// A `--json` report's text; `path` names it in errors. serde_json bounds
/// nesting (128 levels) and parses in linear time.
pub fn parse_report(text: &str, path: &Path) -> Result<Vec<JsonCheck>> {
    let r: JsonReport = serde_json::from_str(text).map_err(|e| {
        Error::Usage(format!(
            "{}: not a touchstone JSON report (`touchstone run --json FILE` writes one): {e}",
            path.display()
        ))
    })?;
    Ok(r.checks)
}

#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub enum Change {
    /// Newly failing, or error grown beyond the factor.
    Regressed,
    /// Failing before, not now.
    Fixed,
    /// Still failing.
    StillFailing,
    /// Present on one side only (not failing).
    Added,
    Removed,
    /// Anything else (error within the factor, or improved).
    Same,
}

#[derive(Clone, Debug)]
pub struct Row {
    /// `<engine>::<spec>`.
    pub run: String,
    /// `<engine>::<spec>::<id>`.
    pub key: String,
    pub id: String,
    pub check: String,
    pub at: Option<(Step, Stage)>,
    pub before: Option<JsonCheck>,
    pub after: Option<JsonCheck>,
    /// after / before of the error metric (inf when before is 0 and after is not).
    pub ratio: Option<f64>,
    pub change: Change,
    /// Why it is a regression (or other note).
    pub note: String,
}

impl Row {
    /// The check's family (from whichever side has it).
    pub fn family(&self) -> Family {
        self.after
            .as_ref()
            .or(self.before.as_ref())
            .map_or(Family::Invariant, JsonCheck::family)
    }
    pub fn before_error(&self) -> Option<f64> {
        self.before.as_ref().and_then(|c| c.error()).map(|e| e.1)
    }
    pub fn after_error(&self) -> Option<f64> {
        self.after.as_ref().and_then(|c| c.error()).map(|e| e.1)
    }
    pub fn status(side: &Option<JsonCheck>) -> &str {
        side.as_ref().map_or("absent", |c| c.status.as_str())
    }
    pub fn step_stage(&self) -> Option<String> {
        self.at.map(|(s, t)| format!("{s}/{t}"))
    }
}

pub struct DiffReport {
    pub base: PathBuf,
    pub new: PathBuf,
    pub factor: f64,
    /// Whether checks of BASE missing from NEW are accepted (`--allow-vanished`).
    /// By default they fail the diff: a report with 11 of 730 checks must not
    /// read as "no regression".
    pub allow_vanished: bool,
    /// In execution order.
    pub rows: Vec<Row>,
}

impl DiffReport {
    pub fn regressions(&self) -> impl Iterator<Item = &Row> {
        self.rows.iter().filter(|r| r.change == Change::Regressed)
    }
    pub fn first_regression(&self) -> Option<&Row> {
        self.regressions().next()
    }
    /// Checks in BASE that NEW does not have.
    pub fn vanished(&self) -> usize {
        self.rows.iter().filter(|r| r.change == Change::Removed).count()
    }
    /// Checks in NEW that BASE did not have.
    pub fn added(&self) -> usize {
        self.rows.iter().filter(|r| r.before.is_none()).count()
    }
    /// Checks on both sides.
    pub fn compared(&self) -> usize {
        self.rows
            .iter()
            .filter(|r| r.before.is_some() && r.after.is_some())
            .count()
    }
    /// A regression, or vanished checks not allowed.
    pub fn regressed(&self) -> bool {
        self.first_regression().is_some() || (self.vanished() > 0 && !self.allow_vanished)
    }
}

pub fn diff_files(base: &Path, new: &Path, factor: f64, allow_vanished: bool) -> Result<DiffReport> {
    if !(factor.is_finite() && factor >= 1.0) {
        return Err(Error::Usage(format!("--factor must be a number >= 1, got {factor}")));
    }
    let b = load(base)?;
    let n = load(new)?;
    Ok(DiffReport {
        base: base.to_path_buf(),
        new: new.to_path_buf(),
        factor,
        allow_vanished,
        rows: diff(b, n, factor),
    })
}

pub fn diff(base: Vec<JsonCheck>, new: Vec<JsonCheck>, factor: f64) -> Vec<Row> {
    let mut by_key: BTreeMap<String, (Option<JsonCheck>, Option<JsonCheck>)> = BTreeMap::new();
    let mut first_seen: Vec<String> = Vec::new();
    for c in base {
        let k = c.key();
        if !by_key.contains_key(&k) {
            first_seen.push(k.clone());
        }
        by_key.entry(k).or_default().0 = Some(c);
    }
    for c in new {
        let k = c.key();
        if !by_key.contains_key(&k) {
            first_seen.push(k.clone());
        }
        by_key.entry(k).or_default().1 = Some(c);
    }
    let mut rows: Vec<Row> = Vec::new();
    for key in first_seen {
        let (before, after) = by_key.remove(&key).expect("key recorded");
        let any = after.as_ref().or(before.as_ref()).expect("one side present");
        let (id, check, at) = (any.id.clone(), any.check.clone(), any.at());
        let run = format!("{}::{}", any.engine, any.spec);
        let fails = |s: &Option<JsonCheck>| s.as_ref().is_some_and(|c| c.status == "fail");
        let passes = |s: &Option<JsonCheck>| s.as_ref().is_some_and(|c| c.status == "pass");
        let eb = before.as_ref().and_then(|c| c.error()).map(|e| e.1);
        let ea = after.as_ref().and_then(|c| c.error()).map(|e| e.1);
        let ratio = match (eb, ea) {
            (Some(b), Some(a)) if b > 0.0 => Some(a / b),
            (Some(_), Some(a)) if a > 0.0 => Some(f64::INFINITY),
            (Some(_), Some(_)) => Some(1.0),
            _ => None,
        };
        let (change, note) = if after.is_none() {
            // Checked of before and gone now: neither fixed nor passing.
            (
                Change::Removed,
                format!("VANISHED: only in BASE (was {})", Row::status(&before)),
            )
        } else if fails(&after) && !fails(&before) {
            let was = Row::status(&before).to_string();
            (Change::Regressed, format!("newly failing (was {was})"))
        } else if fails(&after) {
            (Change::StillFailing, "still failing".into())
        } else if fails(&before) {
            (Change::Fixed, "fixed".into())
        } else if passes(&before) && passes(&after) && ratio.is_some_and(|r| r > factor) {
            let r = ratio.expect("checked");
            let note = if r.is_infinite() {
                "error grew from exactly 0".to_string()
            } else {
                format!("error grew {r:.3}x (> {factor}x)")
            };
            (Change::Regressed, note)
        } else if before.is_none() {
            (Change::Added, "only in NEW".into())
        } else {
            (Change::Same, String::new())
        };
        rows.push(Row {
            run,
            key,
            id,
            check,
            at,
            before,
            after,
            ratio,
            change,
            note,
        });
    }
    // Execution order: stage checks by (step, stage), then run checks; ties keep report order.
    rows.sort_by_key(|r| (r.at.is_none(), r.at));
    rows
}
