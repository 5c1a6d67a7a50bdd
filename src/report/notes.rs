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
        let mut by: BTreeMap<&str, (BTreeMap<(Step, Stage), f64>, f64, (Step, Stage))> = BTreeMap::new();
        for o in &self.outcomes {
            let Some(at) = o.at else { continue };
            for (k, v) in &o.metrics {
                let Some(source) = k.strip_prefix(SUSPECT_REFERENCE) else { continue };
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
