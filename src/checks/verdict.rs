//! The result of one check instance: pass, fail or skip, the numbers behind
//! it, and a message a person can act on (on failure: where, by how much,
//! both values). Every check kind returns one; the report never sees anything
//! else of a check.

use std::collections::BTreeMap;

#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Status {
    Pass,
    Fail,
    Skip,
    /// The engine cannot tap a stage the check reads (its capabilities):
    /// neither passed nor failed, counted apart from skips.
    #[serde(rename = "not_applicable")]
    NotApplicable,
}

#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct Verdict {
    pub status: Status,
    pub metrics: BTreeMap<String, f64>,
    pub message: String,
}

impl Verdict {
    pub fn pass(message: impl Into<String>) -> Verdict {
        Verdict {
            status: Status::Pass,
            metrics: BTreeMap::new(),
            message: message.into(),
        }
    }
    pub fn fail(message: impl Into<String>) -> Verdict {
        Verdict {
            status: Status::Fail,
            metrics: BTreeMap::new(),
            message: message.into(),
        }
    }
    pub fn skip(reason: impl Into<String>) -> Verdict {
        Verdict {
            status: Status::Skip,
            metrics: BTreeMap::new(),
            message: reason.into(),
        }
    }
    /// Not applicable to the engine (it cannot tap a stage the check reads).
    pub fn not_applicable(reason: impl Into<String>) -> Verdict {
        Verdict {
            status: Status::NotApplicable,
            metrics: BTreeMap::new(),
            message: reason.into(),
        }
    }
    /// Pass or fail on `ok`, with the same message either way.
    pub fn check(ok: bool, message: impl Into<String>) -> Verdict {
        if ok {
            Verdict::pass(message)
        } else {
            Verdict::fail(message)
        }
    }
    pub fn metric(mut self, name: &str, value: f64) -> Verdict {
        self.metrics.insert(name.to_string(), value);
        self
    }
    pub fn passed(&self) -> bool {
        self.status == Status::Pass
    }
    pub fn failed(&self) -> bool {
        self.status == Status::Fail
    }
}
