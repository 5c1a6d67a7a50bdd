//! Outcomes of check instances, grouped per (spec, engine) run, with the first
//! divergence marked. Rendering lives in the sinks (`terminal`, `json`,
//! `junit`, `markdown`, `html`); this module only aggregates, so every sink sees
//! the same facts.

pub mod html;
pub mod json;
pub mod junit;
pub mod markdown;
pub mod merge;
pub mod notes;
pub mod outputs;
pub mod terminal;

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::checks::divergence::{self, Mark};
use crate::checks::{Family, Metric, Status, Verdict};
use crate::stage::{Stage, Step};
use crate::tensor::DType;

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Outcome {
    pub spec: String,
    pub engine: String,
    /// `<step>/<stage>::<check>` or `run::<check>`.
    pub id: String,
    pub step: Option<String>,
    pub stage: Option<String>,
    pub check: String,
    /// What kind of evidence the check is (`"family": "golden", "source": "hf"`).
    #[serde(flatten)]
    pub family: Family,
    /// The metric that is the check's error, if it has one.
    pub error_metric: Option<Metric>,
    pub status: Status,
    // JSON has no NaN: serde_json writes it as null, read back as NaN.
    #[serde(deserialize_with = "merge::nan_metrics")]
    pub metrics: BTreeMap<String, f64>,
    pub message: String,
    /// True for the check that is the run's first divergence.
    pub first_divergence: bool,
    /// For failures after the first divergence: the `<step>/<stage>` they follow.
    pub downstream_of: Option<String>,
    /// A failure at a (step, stage) where the references are outside their own
    /// allowance (a failing `references_agree`): the golden is suspect there,
    /// so this failure is not taken as the engine's.
    pub at_suspect_golden: bool,
    /// The command that reruns exactly this check.
    pub rerun: String,
    #[serde(skip)]
    pub at: Option<(Step, Stage)>,
}

impl Outcome {
    pub fn new(
        spec: &str,
        engine: &str,
        id: &str,
        at: Option<(Step, Stage)>,
        family: Family,
        verdict: Verdict,
        rerun: String,
    ) -> Outcome {
        Outcome {
            spec: spec.to_string(),
            engine: engine.to_string(),
            id: id.to_string(),
            step: at.map(|(s, _)| s.to_string()),
            stage: at.map(|(_, s)| s.to_string()),
            check: id.rsplit("::").next().unwrap_or(id).to_string(),
            family,
            error_metric: None,
            status: verdict.status,
            metrics: verdict.metrics,
            message: verdict.message,
            first_divergence: false,
            downstream_of: None,
            at_suspect_golden: false,
            rerun,
            at,
        }
    }

    /// The trial name: `<engine>::<spec>::<id>`.
    pub fn full_id(&self) -> String {
        format!("{}::{}::{}", self.engine, self.spec, self.id)
    }

    /// The outcome with the metric that is its error.
    pub fn with_error_metric(mut self, metric: Option<Metric>) -> Outcome {
        self.error_metric = metric;
        self
    }

    pub fn is_golden(&self) -> bool {
        self.family.is_golden()
    }

    pub fn is_references_agree(&self) -> bool {
        self.family.is_references_agree()
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Divergence {
    pub step: String,
    pub stage: String,
    pub check: String,
}

/// One spec run on one engine.
#[derive(Clone, Debug, Serialize)]
pub struct SuiteRun {
    pub spec: String,
    pub spec_path: String,
    pub engine: String,
    /// The storage dtype the engine ran in (weights and stage outputs).
    pub storage: DType,
    pub passed: bool,
    pub first_divergence: Option<Divergence>,
    /// The earliest (step, stage) where a golden is suspect: the references
    /// are outside their own allowance there (its `check` is the failing
    /// `references_agree`).
    pub suspect_golden: Option<Divergence>,
    /// Set when the whole run was skipped (engine unavailable).
    pub skipped: Option<String>,
    /// Statements the run makes once instead of check by check (a storage
    /// the model's values overflow).
    pub notes: Vec<String>,
    /// The prompt as text (the model's tokenizer decoding the prompt ids);
    /// `None` when the model has no tokenizer.
    pub prompt_text: Option<String>,
    /// What the engine generated after the prompt (one token per step), as text.
    pub continuation_text: Option<String>,
    pub outcomes: Vec<Outcome>,
}

impl SuiteRun {
    /// Marks the first divergence — the earliest (step, stage), in execution
    /// order, where a golden check failed while the references there are
    /// within their own allowance — and labels every later failure as
    /// downstream of it. Where a `references_agree` fails the golden is
    /// suspect: failures at that (step, stage) are marked so and never make
    /// the first divergence (with one reference and no oracle there is no
    /// such check, and a moved golden is the first divergence).
    pub fn new(
        spec: &str,
        spec_path: &str,
        engine: &str,
        mut outcomes: Vec<Outcome>,
        skipped: Option<String>,
    ) -> SuiteRun {
        let marks: Vec<Mark> = outcomes
            .iter()
            .map(|o| Mark {
                at: o.at,
                family: &o.family,
                status: o.status,
                check: &o.check,
                // Its own error metric, not the budget attached beside it.
                measured: match o.error_metric {
                    Some(m) => o.metrics.contains_key(m.key()),
                    None => o.metrics.keys().any(|k| k != "budget_max_abs"),
                },
            })
            .collect();
        let t = divergence::triage(&marks);
        let at_of = |i: usize, outcomes: &[Outcome]| {
            let o: &Outcome = &outcomes[i];
            let at = o.at.expect("triage picks staged outcomes");
            Divergence {
                step: at.0.to_string(),
                stage: at.1.to_string(),
                check: o.check.clone(),
            }
        };
        let suspect_golden = t.suspect_golden.map(|i| at_of(i, &outcomes));
        let first_divergence = t.first.map(|i| at_of(i, &outcomes));
        for (i, o) in outcomes.iter_mut().enumerate() {
            o.at_suspect_golden = t.suspect[i];
            o.first_divergence = t.first == Some(i);
            o.downstream_of = t.downstream[i].map(|(step, stage)| format!("{step}/{stage}"));
        }
        let passed = outcomes.iter().all(|o| o.status != Status::Fail);
        SuiteRun {
            spec: spec.to_string(),
            spec_path: spec_path.to_string(),
            engine: engine.to_string(),
            storage: DType::F32,
            passed,
            first_divergence,
            suspect_golden,
            skipped,
            notes: Vec::new(),
            prompt_text: None,
            continuation_text: None,
            outcomes,
        }
    }

    /// Records the prompt and the generated continuation as text.
    pub fn with_text(mut self, prompt: Option<String>, continuation: Option<String>) -> SuiteRun {
        self.prompt_text = prompt;
        self.continuation_text = continuation;
        self
    }

    /// Adds a statement the run makes once.
    pub fn with_note(mut self, note: String) -> SuiteRun {
        self.notes.push(note);
        self
    }

    /// Records the storage dtype the run used (`SuiteRun::new` assumes f32).
    pub fn with_storage(mut self, storage: DType) -> SuiteRun {
        self.storage = storage;
        self
    }
}

#[derive(Clone, Debug, Default, Serialize)]
pub struct Counts {
    pub passed: usize,
    pub failed: usize,
    pub skipped: usize,
    /// Checks reading a stage the engine cannot tap (its capabilities).
    pub not_applicable: usize,
}

impl Counts {
    /// `, N not applicable` when there are any (the summary lines' tail).
    pub fn not_applicable_tail(&self) -> String {
        if self.not_applicable == 0 {
            String::new()
        } else {
            format!(", {} not applicable", self.not_applicable)
        }
    }
}

#[derive(Clone, Debug, Default)]
pub struct Report {
    pub runs: Vec<SuiteRun>,
}

impl Report {
    pub fn passed(&self) -> bool {
        self.runs.iter().all(|r| r.passed)
    }

    pub fn counts(&self) -> Counts {
        let mut c = Counts::default();
        for o in self.runs.iter().flat_map(|r| &r.outcomes) {
            match o.status {
                Status::Pass => c.passed += 1,
                Status::Fail => c.failed += 1,
                Status::Skip => c.skipped += 1,
                Status::NotApplicable => c.not_applicable += 1,
            }
        }
        c
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::stage::BlockStage;

    /// An outcome; a golden one measured (max_abs), as a compared tensor is.
    fn o(step: Step, stage: Stage, check: &str, status: Status) -> Outcome {
        let mut metrics = BTreeMap::new();
        if check.starts_with("golden:") {
            metrics.insert("max_abs".to_string(), 1.0);
        }
        let v = Verdict {
            status,
            metrics,
            message: String::new(),
        };
        let family = match check.strip_prefix("golden:") {
            Some(source) => Family::Golden { source: source.into() },
            None => Family::Invariant,
        };
        Outcome::new(
            "s",
            "cpu",
            &format!("{step}/{stage}::{check}"),
            Some((step, stage)),
            family,
            v,
            String::new(),
        )
    }

    #[test]
    fn first_divergence_is_the_earliest_failing_golden_and_later_failures_are_downstream() {
        let q1 = Stage::Block(1, BlockStage::Q);
        let q0 = Stage::Block(0, BlockStage::Q);
        let run = SuiteRun::new(
            "s",
            "s.yaml",
            "cpu",
            vec![
                o(Step::Decode(2), Stage::Logits, "golden:hf", Status::Fail),
                o(Step::Decode(1), q1, "finite", Status::Fail),
                o(Step::Decode(1), q1, "golden:hf", Status::Fail),
                o(Step::Decode(1), q0, "golden:hf", Status::Pass),
                o(Step::Prefill, Stage::Logits, "softmax_rows", Status::Fail),
                // A claimed stage the engine did not write: a golden failure
                // that measured nothing, earlier, and no first divergence.
                {
                    let mut x = o(Step::Prefill, q0, "golden:hf", Status::Fail);
                    x.metrics.clear();
                    x
                },
            ],
            None,
        );
        let d = run.first_divergence.clone().unwrap();
        assert_eq!(
            (d.step.as_str(), d.stage.as_str(), d.check.as_str()),
            ("decode1", "blk.1.q", "golden:hf")
        );
        assert!(run.outcomes[2].first_divergence);
        assert_eq!(run.outcomes[0].downstream_of.as_deref(), Some("decode1/blk.1.q"));
        // An invariant failing at the same stage is not downstream; one before it neither.
        assert_eq!(run.outcomes[1].downstream_of, None);
        assert_eq!(run.outcomes[4].downstream_of, None);
        assert!(!run.outcomes[5].first_divergence && run.outcomes[5].downstream_of.is_none());
        assert!(!run.passed);
    }
}
