//! What kind of evidence a check is, typed: the first divergence, the golden
//! suspects, the report's columns and the diff all ask this, and none of them
//! may recover it from a check's name. `Family` is written into the JSON
//! report (`"family": "golden", "source": "hf"`), so readers of reports
//! (`touchstone diff`) get it typed too.

use serde::{Deserialize, Serialize};

#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(tag = "family", rename_all = "snake_case")]
pub enum Family {
    /// A property of the engine's own capture; no reference involved.
    Invariant,
    /// The engine's capture against golden `source`.
    Golden { source: String },
    /// Golden `other` against golden `base` (the oracle, or the first
    /// source): the references judged, no engine involved.
    ReferencesAgree { base: String, other: String },
    /// A property of whole runs (determinism, KV cache, tokens, weights).
    Run,
}

impl Family {
    pub fn is_golden(&self) -> bool {
        matches!(self, Family::Golden { .. })
    }
    pub fn is_references_agree(&self) -> bool {
        matches!(self, Family::ReferencesAgree { .. })
    }
    /// The golden sources a check of this family reads.
    pub fn sources(&self) -> Vec<&str> {
        match self {
            Family::Golden { source } => vec![source],
            Family::ReferencesAgree { base, other } => vec![base, other],
            Family::Invariant | Family::Run => Vec::new(),
        }
    }

    /// The golden source a golden check measures against.
    pub fn source(&self) -> Option<&str> {
        match self {
            Family::Golden { source } => Some(source),
            _ => None,
        }
    }
}

/// The metric that is a check's error: what `touchstone diff` compares before
/// and after, and what the report's columns show.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Metric {
    /// Greatest |actual − expected|.
    MaxAbs,
    /// Greatest |Σ − 1| over softmax rows.
    MaxRowErr,
    /// Greatest |p| on a masked (future) entry.
    FutureMaxAbs,
    /// Greatest change RoPE made at position 0 (where it must be the identity).
    Pos0MaxAbs,
}

impl Metric {
    /// Every metric, most specific first.
    pub const ALL: [Metric; 4] = [
        Metric::MaxAbs,
        Metric::MaxRowErr,
        Metric::FutureMaxAbs,
        Metric::Pos0MaxAbs,
    ];

    /// The key of this metric in a verdict's metrics.
    pub fn key(self) -> &'static str {
        match self {
            Metric::MaxAbs => "max_abs",
            Metric::MaxRowErr => "max_row_err",
            Metric::FutureMaxAbs => "future_max_abs",
            Metric::Pos0MaxAbs => "pos0_max_abs",
        }
    }
}
