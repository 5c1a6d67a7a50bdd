//! What a run says once rather than check by check: the references left out
//! of the engine's allowance because they were beyond their own at some
//! stages (read off the golden checks' `suspect_reference:` metrics), and
//! the runner's own statements (`SuiteRun::notes`: a storage the model's
//! values overflow).

use std::collections::BTreeMap;

use serde::Serialize;

use super::SuiteRun;
use crate::checks::stage::SUSPECT_REFERENCE;
use crate::stage::{Stage, Step};

/// A reference that was beyond its own allowance (factor × its floor) at
/// some (step, stage)s, and so widened no engine allowance there.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct SuspectReference {
    pub source: String,
    /// How many (step, stage)s.
    pub stages: usize,
    /// The earliest, `<step>/<stage>`.
    pub first: String,
    /// Its largest error over its floor, and where.
    pub worst_ratio: f64,
    pub worst_at: String,
}

impl SuspectReference {
    /// The sentence the terminal report prints.
    pub fn sentence(&self) -> String {
        format!(
            "reference `{}` was beyond its own allowance at {} (step, stage){} (first {}; worst {} at {}): it was \
             not counted toward the engine's allowance there",
            self.source,
            self.stages,
            if self.stages == 1 { "" } else { "s" },
            self.first,
            if self.worst_ratio.is_finite() {
                format!("{:.2}× its floor", self.worst_ratio)
            } else {
                "non-finite".into()
            },
            self.worst_at
        )
    }
}

impl SuiteRun {
    /// Every reference some golden check left out, in source order.
    pub fn suspect_references(&self) -> Vec<SuspectReference> {
        // Per source: each stage's ratio, and the worst with its place.
        type Seen = (BTreeMap<(Step, Stage), f64>, f64, (Step, Stage));
        let mut by: BTreeMap<&str, Seen> = BTreeMap::new();
        for o in &self.outcomes {
            let Some(at) = o.at else { continue };
            for (k, v) in &o.metrics {
                let Some(source) = k.strip_prefix(SUSPECT_REFERENCE) else {
                    continue;
                };
                let e = by.entry(source).or_insert((BTreeMap::new(), f64::NEG_INFINITY, at));
                e.0.insert(at, *v);
                if *v > e.1 || v.is_nan() {
                    e.1 = *v;
                    e.2 = at;
                }
            }
        }
        by.into_iter()
            .map(|(source, (at, worst, worst_at))| {
                let (first, _) = at.iter().next().expect("an entry per suspect stage");
                SuspectReference {
                    source: source.to_string(),
                    stages: at.len(),
                    first: format!("{}/{}", first.0, first.1),
                    worst_ratio: worst,
                    worst_at: format!("{}/{}", worst_at.0, worst_at.1),
                }
            })
            .collect()
    }
}

/// The largest scaled-policy ratio of a kind of check in a run: its error
/// over the base its allowance is `factor` times (the engine's golden checks
/// against `max(reference error, floor)`, a reference's own against its
/// floor), and where.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct LargestRatio {
    /// `engine`, or the reference's source name.
    pub of: String,
    pub ratio: f64,
    pub at: String,
}

impl SuiteRun {
    /// The engine's largest ratio over its golden checks, then each
    /// reference's over its `references_agree` (sources in name order):
    /// how close a run came to its allowances, read off the checks' `ratio`
    /// metric. Empty where no scaled check ran.
    pub fn largest_ratios(&self) -> Vec<LargestRatio> {
        let mut by: BTreeMap<String, (f64, String)> = BTreeMap::new();
        for o in &self.outcomes {
            let Some(r) = o.metrics.get("ratio").copied().filter(|r| !r.is_nan()) else {
                continue;
            };
            let of = match &o.family {
                crate::checks::Family::Golden { .. } => "engine".to_string(),
                crate::checks::Family::ReferencesAgree { other, .. } => other.clone(),
                _ => continue,
            };
            let e = by.entry(of).or_insert((f64::NEG_INFINITY, String::new()));
            if r > e.0 {
                // The place, and the check where it is the engine's (one of
                // several golden checks at a stage).
                let at = match (o.id.rsplit_once("::"), &o.family) {
                    (Some((at, c)), crate::checks::Family::Golden { .. }) => format!("{at} ({c})"),
                    (Some((at, _)), _) => at.to_string(),
                    (None, _) => o.id.clone(),
                };
                *e = (r, at);
            }
        }
        let mut out: Vec<LargestRatio> = by
            .into_iter()
            .map(|(of, (ratio, at))| LargestRatio { of, ratio, at })
            .collect();
        out.sort_by_key(|r| r.of != "engine");
        out
    }
}
