//! `references_agree`: the golden sources judged, no engine involved. With a
//! float64 oracle, each reference is measured against it (within `factor`
//! times its own floor, at its arithmetic's unit roundoff); without one,
//! every other source against the first. Where this fails the golden is
//! suspect at that (step, stage), and no failure there is taken as the
//! engine's (`divergence`).

use std::sync::Arc;

use serde::de::{Deserialize, Deserializer};

use crate::checks::facts::Facts;
use crate::checks::family::{Family, Metric};
use crate::checks::kind::{At, Kind, RuleEnv, StageCheck, StageRule};
use crate::checks::measure::{self, last_row_if, ratio_text, sci};
use crate::checks::params::TolOverride;
use crate::checks::row_judge::{row_comparison, worst_row, RowInputs};
use crate::checks::scaled;
use crate::checks::verdict::Verdict;
use crate::compare::{compare, Tolerance};
use crate::golden::ORACLE;
use crate::stage::{Stage, Step};
use crate::tensor::Tensor;

/// The rule as written: `references_agree` or `{references_agree: {atol, rtol}}`.
#[derive(Clone, Debug, PartialEq)]
pub struct ReferencesAgree {
    pub tol: TolOverride,
}

impl Kind for ReferencesAgree {
    const NAME: &'static str = "references_agree";
    const PARAMS: &'static str = "{atol, rtol} (optional)";
    const ABOUT: &'static str = "the goldens themselves: each reference within `factor` of its own floor from the oracle, or every source close to the first; a failure makes the stage a golden suspect";
    fn bare() -> Self {
        ReferencesAgree {
            tol: TolOverride::default(),
        }
    }
    fn parse<'de, D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        Ok(ReferencesAgree {
            tol: Option::<TolOverride>::deserialize(d)?.unwrap_or_default(),
        })
    }
}

impl StageRule for ReferencesAgree {
    fn kind(&self) -> &'static str {
        Self::NAME
    }
    fn expand(&self, _: Stage, env: &RuleEnv) -> Result<Vec<Arc<dyn StageCheck>>, String> {
        let pair = |base: &str, other: &str| {
            Arc::new(Agree {
                base: base.to_string(),
                other: other.to_string(),
                tol: self.tol,
            }) as Arc<dyn StageCheck>
        };
        if env.has_oracle {
            // With an oracle, each reference is measured against the exact answer.
            if env.goldens.is_empty() {
                return Err("`references_agree` needs a golden source besides the oracle".into());
            }
            return Ok(env.goldens.iter().map(|other| pair(ORACLE, other)).collect());
        }
        // Every other source against the first (sources sort by name).
        let Some((base, others)) = env.goldens.split_first() else {
            return Err("`references_agree` needs two golden sources; the spec declares none".into());
        };
        if others.is_empty() {
            return Err(format!(
                "`references_agree` needs two golden sources; the spec declares only `{base}`"
            ));
        }
        Ok(others.iter().map(|other| pair(base, other)).collect())
    }
}

/// Golden `other` compared with golden `base` at one stage.
#[derive(Clone, Debug, PartialEq)]
pub struct Agree {
    pub base: String,
    pub other: String,
    pub tol: TolOverride,
}

impl StageCheck for Agree {
    fn id(&self) -> String {
        format!("{}:{}~{}", ReferencesAgree::NAME, self.base, self.other)
    }
    fn family(&self) -> Family {
        Family::ReferencesAgree {
            base: self.base.clone(),
            other: self.other.clone(),
        }
    }
    fn metric(&self) -> Option<Metric> {
        Some(Metric::MaxAbs)
    }
    /// Reads no engine stage: the references alone.
    fn reads(&self, _: Stage) -> Vec<Stage> {
        Vec::new()
    }
    fn planned(&self, step: Step, stage: Stage, facts: &Facts) -> bool {
        let recorded = |src: &str| facts.source(src).is_some_and(|g| g.records(step, stage));
        recorded(&self.base) && recorded(&self.other)
    }
    fn judge(&self, facts: &Facts, at: &At) -> Verdict {
        let (step, stage, base, other) = (at.step, at.stage, self.base.as_str(), self.other.as_str());
        let (Some(b), Some(o)) = (facts.source(base), facts.source(other)) else {
            return Verdict::fail(format!("golden source `{base}` or `{other}` is not loaded"));
        };
        let (Some(expected), Some(actual)) = (b.get(step, stage), o.get(step, stage)) else {
            let missing = if b.get(step, stage).is_none() { b } else { o };
            return Verdict::fail(format!(
                "golden `{}` ({}) has no tensor `{step}/{stage}`",
                missing.source,
                missing.path.display()
            ));
        };
        if b.tokens.get(&step) != o.tokens.get(&step) {
            return Verdict::fail(format!(
                "goldens `{base}` and `{other}` were recorded with different tokens at {step}: {:?} vs {:?}",
                b.tokens.get(&step),
                o.tokens.get(&step)
            ));
        }
        // Routes are sets, and a near-tie routed otherwise makes the two
        // references' later stages incomparable (`golden_routes`).
        if let Some(why) = super::golden_routes::rerouted_before(&|st, s| o.get(st, s), b, step, stage) {
            return Verdict::not_applicable(why);
        }
        if let Stage::Block(l, crate::stage::BlockStage::FfnMoeTopk) = stage {
            let probs = o.get(step, Stage::Block(l, crate::stage::BlockStage::FfnMoeProbs));
            return super::golden_routes::judge_ids(facts, probs, step, stage, actual, b);
        }
        // A golden that kept some token rows is compared on those rows.
        let (actual, expected) = (
            &facts.on_recorded_rows(actual, step, stage),
            &facts.on_recorded_rows(expected, step, stage),
        );
        let (actual, expected) = (
            &last_row_if(actual, expected, stage, b.logits_last_row()),
            &last_row_if(expected, actual, stage, o.logits_last_row()),
        );
        if base == ORACLE && !self.tol.is_set() {
            return against_oracle(facts, step, stage, other, actual, expected);
        }
        let tol = measure::tolerance(facts, actual, expected, self.tol);
        match compare(actual, expected, tol) {
            Err(m) => Verdict::fail(format!("`{other}` vs `{base}`: {m}")).metric("shape_mismatch", 1.0),
            Ok(c) => {
                let message = if c.passed() {
                    format!("`{other}` agrees with `{base}`: {}", c.summary())
                } else {
                    format!(
                        "the references disagree: `{other}` ({}) vs `{base}` ({}):\n{}",
                        o.path.display(),
                        b.path.display(),
                        c.explain()
                    )
                };
                measure::compared(c.passed(), message, &c)
            }
        }
    }
}

/// Reference `other` against the oracle under the scaled policy: within
/// `factor` times its own floor (its arithmetic's unit roundoff), else the
/// golden is suspect here.
fn against_oracle(facts: &Facts, step: Step, stage: Stage, other: &str, reference: &Tensor, oracle: &Tensor) -> Verdict {
    let m = scaled::max_abs_value(oracle);
    let Some(og) = facts.oracle else {
        return Verdict::fail("the spec has no oracle".to_string());
    };
    let u = match measure::source_arithmetic(facts, other) {
        Ok(a) => a,
        Err(e) => return Verdict::fail(e),
    };
    let Some(golden) = facts.source(other) else {
        return Verdict::fail(format!("golden source `{other}` is not loaded"));
    };
    let x = |st: Step, s: Stage| golden.get(st, s);
    let fl = measure::floor_of(facts, og, step, stage, m, u, Some(other), &x);
    let c = match compare(reference, oracle, Tolerance::new(0.0, 0.0)) {
        Ok(c) => c,
        Err(e) => return Verdict::fail(format!("`{other}` vs the oracle: {e}")).metric("shape_mismatch", 1.0),
    };
    let r = if c.non_finite() > 0 {
        f64::INFINITY
    } else {
        c.max_abs.as_ref().map_or(0.0, |(v, _)| *v)
    };
    let j = scaled::judge_reference(measure::policy(facts), r, fl.total());
    let c = compare(reference, oracle, Tolerance::new(j.allowed, 0.0)).expect("shapes matched above");
    // At a residual add, every token row within its own row's allowance too.
    let inputs = RowInputs {
        judged: reference,
        oracle_view: oracle,
        peers: Vec::new(),
    };
    let row = worst_row(facts, og, step, stage, u, Some(other), &x, &inputs).filter(|r| !r.passed());
    let head = format!(
        "`{other}`'s error {} (max|{other} − oracle|), its floor {} (arithmetic {u}: {}, c {}): ratio {} {} factor {}",
        sci(r),
        sci(j.floor),
        fl.how,
        facts.scaled.floor,
        ratio_text(j.ratio()),
        if j.passed() { "<=" } else { ">" },
        j.factor
    );
    let message = match (j.passed(), &row) {
        (true, None) => head,
        (true, Some(row)) => format!(
            "golden `{other}` is suspect here: one token row is further from the exact answer than its arithmetic \
             allows:\n{}\n{head}\n{}",
            row.explain(j.factor),
            row_comparison(reference, oracle, row).unwrap_or_default()
        ),
        (false, _) => format!(
            "golden `{other}` is suspect here: further from the exact answer than its arithmetic allows:\n{head}\n{}",
            c.explain()
        ),
    };
    let mut v = measure::scaled_verdict(j.passed() && row.is_none(), message, &c, &j);
    for (name, value) in row.iter().flat_map(|r| r.metrics()) {
        v.metrics.insert(name.to_string(), value);
    }
    v
}
