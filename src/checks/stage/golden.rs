//! `golden`: the engine's capture against a golden source's tensor at the
//! same (step, stage), fed the same tokens. With a float64 oracle and no
//! explicit atol/rtol, an f32 run is judged by the scaled policy (its error
//! against the oracle within `factor` times the reference's own, or the
//! floor); otherwise by the allclose rule at the tolerance that applies.

use std::sync::Arc;

use serde::de::{Deserialize, Deserializer};

use crate::checks::facts::Facts;
use super::golden_routes;
use crate::checks::floor;
use crate::checks::family::{Family, Metric};
use crate::checks::kind::{At, Kind, Located, RuleEnv, StageCheck, StageRule};
use crate::checks::measure::{self, last_row_if, ratio_text, sci};
use crate::checks::params::{opt_tol_value, StrOrMap, TolOverride};
use crate::checks::row_judge::{row_comparison, worst_row, Peer, RowInputs};
use crate::checks::scaled;
use crate::checks::verdict::Verdict;
use crate::compare::{compare, Tolerance};
use crate::golden::{GoldenSet, ORACLE};
use crate::stage::{BlockStage, Stage, Step};
use crate::tensor::Tensor;

/// The rule as written: `golden` (every declared source), `{golden: hf}`, or
/// `{golden: {source: hf, atol: 1e-4, rtol: 1e-3}}`.
#[derive(Clone, Debug, PartialEq)]
pub struct Golden {
    pub source: Option<String>,
    pub tol: TolOverride,
}

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct Full {
    source: Option<String>,
    #[serde(default, deserialize_with = "opt_tol_value")]
    atol: Option<f64>,
    #[serde(default, deserialize_with = "opt_tol_value")]
    rtol: Option<f64>,
}

impl Kind for Golden {
    const NAME: &'static str = "golden";
    const PARAMS: &'static str = "a source name, or {source, atol, rtol}; no source: one check per declared source";
    const ABOUT: &'static str = "close to the golden's tensor: with an oracle and no atol/rtol, within `factor` of the reference's own error against the oracle (the scaled policy); else |a−e| ≤ atol + rtol·|e|";
    fn bare() -> Self {
        Golden {
            source: None,
            tol: TolOverride::default(),
        }
    }
    fn parse<'de, D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        Ok(match StrOrMap::<Full>::deserialize(d)? {
            StrOrMap::Str(s) => Golden {
                source: Some(s),
                tol: TolOverride::default(),
            },
            StrOrMap::Map(f) => Golden {
                source: f.source,
                tol: TolOverride { atol: f.atol, rtol: f.rtol },
            },
        })
    }
}

impl StageRule for Golden {
    fn kind(&self) -> &'static str {
        Self::NAME
    }
    fn validate(&self, env: &RuleEnv) -> Result<(), Located> {
        match &self.source {
            Some(s) => env.require_source("golden check", s),
            None if env.goldens.is_empty() => Err(Located {
                needle: "golden".into(),
                msg: "a `golden` check needs a golden source, but the spec declares no `goldens:`".into(),
            }),
            None => Ok(()),
        }
    }
    /// One check per source: the named one, or every declared source.
    fn expand(&self, _: Stage, env: &RuleEnv) -> Result<Vec<Arc<dyn StageCheck>>, String> {
        let sources = match &self.source {
            Some(s) => vec![s.clone()],
            None => env.goldens.clone(),
        };
        Ok(sources
            .into_iter()
            .map(|source| {
                Arc::new(GoldenCheck {
                    source,
                    tol: self.tol,
                }) as Arc<dyn StageCheck>
            })
            .collect())
    }
}

/// The check against one source.
#[derive(Clone, Debug, PartialEq)]
pub struct GoldenCheck {
    pub source: String,
    pub tol: TolOverride,
}

impl StageCheck for GoldenCheck {
    fn id(&self) -> String {
        format!("{}:{}", Golden::NAME, self.source)
    }
    fn family(&self) -> Family {
        Family::Golden {
            source: self.source.clone(),
        }
    }
    fn metric(&self) -> Option<Metric> {
        Some(Metric::MaxAbs)
    }
    /// A compact golden (`record:`) plans checks only where it recorded; a
    /// tensor it claims but lacks still fails.
    fn planned(&self, step: Step, stage: Stage, facts: &Facts) -> bool {
        facts.goldens.get(&self.source).is_some_and(|g| g.records(step, stage))
    }
    /// A route is judged with the engine's scores at hand (a near-tie).
    fn reads(&self, stage: Stage) -> Vec<Stage> {
        match stage {
            Stage::Block(l, BlockStage::FfnMoeTopk) => vec![stage, Stage::Block(l, BlockStage::FfnMoeProbs)],
            _ => vec![stage],
        }
    }
    /// Its source, and the oracle where the scaled policy judges.
    fn goldens(&self, facts: &Facts) -> Vec<String> {
        let mut v = vec![self.source.clone()];
        if self.scaled(facts) {
            v.push(ORACLE.to_string());
        }
        v
    }
    fn judge(&self, facts: &Facts, at: &At) -> Verdict {
        let actual = match at.capture() {
            Ok(t) => t,
            Err(v) => return v,
        };
        let run = at.run.expect("a capture implies a run");
        let (step, stage, source) = (at.step, at.stage, self.source.as_str());
        let Some(golden) = facts.goldens.get(source) else {
            return Verdict::fail(format!("golden source `{source}` is not loaded"));
        };
        let file = golden.path.display();
        let Some(expected) = golden.get(step, stage) else {
            return Verdict::fail(format!("golden `{source}` ({file}) has no tensor `{step}/{stage}`"));
        };
        // A comparison is only meaningful if both sides were fed the same tokens.
        let fed = facts.fed(run, step);
        if let Some(recorded) = golden.tokens.get(&step) {
            if *recorded != fed {
                return Verdict::fail(format!(
                    "inputs differ at {step}: the engine was fed tokens {fed:?}, golden `{source}` was recorded \
                     with {recorded:?}"
                ));
            }
        }
        // Where the engine took another route (a near-tie), the golden's
        // later stages follow another computation; a route is a set.
        if let Some(why) = golden_routes::rerouted_before(&|st, s| run.captures.get(st, s), golden, step, stage) {
            return Verdict::not_applicable(why);
        }
        if let Stage::Block(l, BlockStage::FfnMoeTopk) = stage {
            let probs = run.captures.get(step, Stage::Block(l, BlockStage::FfnMoeProbs));
            return golden_routes::judge_ids(facts, probs, step, stage, actual, golden);
        }
        // A golden that kept some token rows is compared on those rows.
        let actual = &facts.on_recorded_rows(actual, step, stage);
        let actual = &last_row_if(actual, expected, stage, golden.logits_last_row());
        // The scaled policy judges every arithmetic (its floors follow the
        // engine's); without an oracle the allclose rule does.
        if self.scaled(facts) {
            if let Some(o) = facts.oracle.filter(|o| o.records(step, stage)) {
                return scaled_against(facts, at, actual, source, expected, o, &fed);
            }
        }
        let tol = measure::tolerance(facts, actual, expected, self.tol);
        match compare(actual, expected, tol) {
            Err(m) => Verdict::fail(format!("{m} (golden `{source}`: {file})")).metric("shape_mismatch", 1.0),
            Ok(c) => {
                let message = if c.passed() {
                    format!("within tolerance of golden `{source}`: {}", c.summary())
                } else {
                    format!("differs from golden `{source}` ({file}):\n{}", c.explain())
                };
                measure::compared(c.passed(), message, &c)
            }
        }
    }
}

impl GoldenCheck {
    /// Whether the scaled policy judges (an oracle, no explicit atol/rtol),
    /// where the oracle records the stage.
    fn scaled(&self, facts: &Facts) -> bool {
        !self.tol.is_set() && facts.oracle.is_some()
    }
}

/// The engine against reference `source` under the scaled policy: its error
/// against the oracle within `factor` times the reference's own (or the floor).
fn scaled_against(
    facts: &Facts,
    at: &At,
    actual: &Tensor,
    source: &str,
    reference: &Tensor,
    oracle: &GoldenSet,
    fed: &[u32],
) -> Verdict {
    let (step, stage) = (at.step, at.stage);
    if let Some(recorded) = oracle.tokens.get(&step) {
        if recorded != fed {
            return Verdict::fail(format!(
                "inputs differ at {step}: the engine was fed tokens {fed:?}, the oracle ({}) was recorded with \
                 {recorded:?}",
                oracle.path.display()
            ));
        }
    }
    let (o, m) = match measure::oracle_at(oracle, step, stage, actual) {
        Ok(x) => x,
        Err(e) => return Verdict::fail(e),
    };
    let o = match facts.on_recorded_rows(&o, step, stage) {
        std::borrow::Cow::Owned(t) => std::borrow::Cow::Owned(t),
        std::borrow::Cow::Borrowed(_) => o,
    };
    let actual = &*last_row_if(actual, &o, stage, oracle.logits_last_row());
    // The reference error the engine is measured by: the largest among the
    // references of the same arithmetic as `source`, each a correct
    // implementation whose spread is the honest error scale. A reference of
    // another arithmetic never widens this, and neither does one beyond its
    // own allowance (factor × its floor): it is suspect here, said so, and
    // the engine is judged by the others and its own floor.
    let arith = |src: &str| measure::source_arithmetic(facts, src);
    let class = match arith(source) {
        Ok(a) => a,
        Err(e) => return Verdict::fail(e),
    };
    let policy = measure::policy(facts);
    let mut r = 0.0f64;
    let mut peers = Vec::new();
    let mut peer_tensors = Vec::new();
    let mut suspects = Vec::new();
    for (name, g) in facts.goldens.iter() {
        match arith(name) {
            Ok(a) if a == class => {}
            Ok(_) => continue,
            Err(e) => return Verdict::fail(e),
        }
        let t = if name == source {
            Some(reference)
        } else {
            g.get(step, stage)
        };
        let Some(t) = t else { continue };
        let t = facts.on_recorded_rows(t, step, stage);
        let t = last_row_if(&t, &o, stage, o.shape().first() == Some(&1)).into_owned();
        let e = match scaled::max_error(&t, &o) {
            Ok((e, _)) => e,
            Err(e) => {
                return Verdict::fail(format!("golden `{name}` vs the oracle: {e}")).metric("shape_mismatch", 1.0)
            }
        };
        let own = measure::floor_of(facts, oracle, step, stage, m, class, Some(name), &floor::of_golden(g));
        let judged = scaled::judge_reference(policy, e, own.total());
        if !judged.passed() {
            suspects.push((name.clone(), judged));
            continue;
        }
        r = r.max(e);
        peers.push(format!("{name} {}", sci(e)));
        let row_allowed = measure::floor_at(facts, oracle, step, class, Some(name))
            .row_floors(stage, &floor::of_golden(g))
            .map(|f| f.into_iter().map(|x| policy.factor * x).collect());
        peer_tensors.push(Peer {
            tensor: std::borrow::Cow::Owned(t),
            row_allowed,
        });
    }
    let e = match scaled::max_error(actual, &o) {
        Ok((e, _)) => e,
        Err(e) => {
            return Verdict::fail(format!("{e} (the oracle: {})", oracle.path.display())).metric("shape_mismatch", 1.0)
        }
    };
    // The engine's floor in its own arithmetic, from its own errors at the
    // stage's inputs.
    // The engine's floor inherits its own errors only at inputs a golden
    // check verifies: at one recorded for the floors alone (`record.aux`) a
    // bug would pass into the floor unseen (an attention that reads the cache
    // short gives a wrong attn_ctx, and an attn_out consistent with it), so
    // there it is estimated as a correct implementation would carry it. The
    // KV cache is read as the engine captured it (k_rope and v at every
    // step): the stage that reads it must be consistent with what the engine
    // says it cached, and the cache's own stages are checked where recorded.
    let verified = |st: Step, s: Stage| {
        matches!(s, Stage::Block(_, BlockStage::KRope | BlockStage::V)) || facts.goldens.values().any(|g| g.records(st, s))
    };
    let engine = |st: Step, s: Stage| {
        verified(st, s)
            .then(|| at.run.and_then(|r| r.captures.get(st, s)))
            .flatten()
    };
    let fl = measure::floor_of(facts, oracle, step, stage, m, facts.arithmetic, None, &engine);
    let j = scaled::judge_engine(measure::policy(facts), e, r, fl.total());
    // The comparator at the allowance gives the failure its count, worst
    // element with both values, NMSE and cosine (engine vs oracle).
    let c = compare(actual, &o, Tolerance::new(j.allowed, 0.0)).expect("shapes matched above");
    // At a residual add, every token row within its own row's allowance too.
    let inputs = RowInputs {
        judged: actual,
        oracle_view: &o,
        peers: peer_tensors,
    };
    let row = worst_row(facts, oracle, step, stage, facts.arithmetic, None, &engine, &inputs).filter(|r| !r.passed());
    let counted = match (peers.is_empty(), suspects.is_empty()) {
        (true, true) => "none recorded".to_string(),
        (true, false) => "none counted".to_string(),
        (false, _) => peers.join(", "),
    };
    let head = format!(
        "engine error {} (max|engine − oracle|), reference error {} (max|reference − oracle| of {counted}, \
         arithmetic {class}), engine floor {} (arithmetic {}: {}, c {}): ratio {} {} factor {}{}",
        sci(j.error),
        sci(r),
        sci(j.floor),
        facts.arithmetic,
        fl.how,
        facts.scaled.floor,
        ratio_text(j.ratio()),
        if j.passed() { "<=" } else { ">" },
        j.factor,
        suspects
            .iter()
            .map(|(n, sj)| format!(
                "\nreference `{n}` not counted: suspect here, its error {} exceeds its own allowance {} (factor × \
                 its floor {}, ratio {})",
                sci(sj.error),
                sci(sj.allowed),
                sci(sj.floor),
                ratio_text(sj.ratio())
            ))
            .collect::<String>()
    );
    let message = match (j.passed() && c.passed(), &row) {
        (true, None) => head,
        (true, Some(row)) => format!(
            "one token row is further from the exact answer than `{source}` allows (oracle {}):\n{}\n{head}\n{}",
            oracle.path.display(),
            row.explain(j.factor),
            row_comparison(actual, &o, row).unwrap_or_default()
        ),
        (false, _) => format!(
            "further from the exact answer than `{source}` allows (oracle {}):\n{head}\n{}",
            oracle.path.display(),
            c.explain()
        ),
    };
    let mut v = measure::scaled_verdict(j.passed() && c.passed() && row.is_none(), message, &c, &j);
    for (name, value) in row.iter().flat_map(|r| r.metrics()) {
        v.metrics.insert(name.to_string(), value);
    }
    // Each reference left out, by its ratio to its own allowance's base: the
    // report says once which references were suspect where.
    for (name, sj) in &suspects {
        v.metrics.insert(format!("{SUSPECT_REFERENCE}{name}"), sj.ratio());
    }
    v
}

/// The metric prefix naming a reference left out of the engine's allowance
/// (`suspect_reference:hf-bf16` = its error over its floor).
pub const SUSPECT_REFERENCE: &str = "suspect_reference:";
