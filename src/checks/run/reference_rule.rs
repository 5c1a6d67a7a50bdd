//! `reference_rule:<source>`: a golden source the spec declares to compute
//! by another rule than the config's from a position on (`reference_rules`:
//! llama.cpp without Qwen2's sliding window, with YaRN's correction range
//! always truncated, with LongRoPE's factors chosen by its context size, or
//! without dynamic NTK). The engine is never judged against it there (its
//! `records` is false for those steps); this check makes the difference
//! data instead of a silence: from the goldens alone it measures, stage by
//! stage, how far the source is from a reference that follows the config,
//! before the position and from it on. It passes when the difference is
//! seen (from the position on, at least 10 times what the two differ by
//! before it, where they follow the same rule) and fails when it is not, or
//! when nothing past the position was recorded: a declaration that no
//! longer holds must not go on hiding the reference.

use crate::checks::facts::Facts;
use crate::checks::kind::RunCheck;
use crate::checks::verdict::Verdict;
use crate::engine::Engine;
use crate::golden::GoldenSet;
use crate::stage::{Stage, Step};

#[derive(Clone, Debug, PartialEq)]
pub struct ReferenceRuleCheck {
    pub source: String,
    /// The first position where the source's rule gives other numbers.
    pub from_position: usize,
    /// What the source does instead, in words.
    pub rule: String,
}

/// How much larger the difference must be from the position on than before
/// it to count as seen: the references' own distance where they follow one
/// rule is rounding; a different rule moves values by orders of magnitude.
const SEEN: f64 = 10.0;

/// The largest relative difference of a region: |a − b| over the largest
/// |b| of the stage's rows there, where it was reached.
#[derive(Clone, Copy, Debug, Default)]
struct Worst {
    rel: f64,
    at: Option<(Step, Stage, usize)>,
}

impl Worst {
    fn take(&mut self, rel: f64, at: (Step, Stage, usize)) {
        if rel > self.rel || self.at.is_none() {
            *self = Worst { rel, at: Some(at) };
        }
    }
    fn describe(&self) -> String {
        match self.at {
            Some((st, sg, p)) => format!("{:.3e} (at {st}/{sg}, position {p})", self.rel),
            None => "nothing recorded".into(),
        }
    }
}

impl RunCheck for ReferenceRuleCheck {
    fn id(&self) -> String {
        format!("reference_rule:{}", self.source)
    }
    fn evaluate(&self, facts: &Facts, _: &dyn Engine) -> Verdict {
        let Some(g) = facts.goldens.get(&self.source) else {
            return Verdict::fail(format!("golden source `{}` is not loaded", self.source));
        };
        // The reference that follows the config: the first golden without a
        // declared rule of its own, else the oracle.
        let base = facts
            .goldens
            .iter()
            .find(|(s, o)| **s != self.source && o.departs_from().is_none())
            .map(|(s, o)| (s.as_str(), &**o))
            .or_else(|| facts.oracle.map(|o| ("oracle", o)));
        let Some((base_name, base)) = base else {
            return Verdict::fail("no reference follows the config to measure the declared difference against");
        };
        let from = self.from_position;
        let (before, after, stages) = measure(g, base, from);
        let head = format!(
            "golden `{}` declared to follow another rule from position {from}: {}; measured against `{base_name}` \
             over {stages} stages: largest relative difference before position {from} {}, from it on {}",
            self.source,
            self.rule,
            before.describe(),
            after.describe()
        );
        let v = if after.at.is_none() {
            Verdict::fail(format!(
                "{head}: nothing at or past position {from} was recorded, so the declared difference cannot be seen; \
                 record further or remove the declaration"
            ))
        } else if after.rel > SEEN * before.rel.max(f64::MIN_POSITIVE) && after.rel > 0.0 {
            Verdict::pass(format!(
                "{head}: the difference is seen (data, not a failure: the engine is judged against `{}` only before \
                 position {from})",
                self.source
            ))
        } else {
            Verdict::fail(format!(
                "{head}: the declared difference is not seen (at most {SEEN}x the distance before the position): \
                 does `{}` follow the config after all? Then drop its `reference_rules` entry so the engine is \
                 judged against it everywhere",
                self.source
            ))
        };
        v.metric("before_rel", before.rel).metric("after_rel", after.rel)
    }
}

/// The worst relative difference of `g` from `base` over rows before `from`
/// and from it on, over every (step, stage) both hold with one shape.
fn measure(g: &GoldenSet, base: &GoldenSet, from: usize) -> (Worst, Worst, usize) {
    let (mut before, mut after, mut stages) = (Worst::default(), Worst::default(), 0);
    for &(step, stage) in g.keys() {
        let (Some(a), Some(b)) = (g.get(step, stage), base.get(step, stage)) else { continue };
        if a.shape() != b.shape() || stage.row_axis().is_none() {
            continue;
        }
        let axis = stage.row_axis().expect("checked");
        let dims = a.shape();
        let Some(&rows) = dims.get(axis) else { continue };
        let inner: usize = dims[axis + 1..].iter().product();
        let outer: usize = dims[..axis].iter().product();
        // The absolute position of each row held (a row subset, or every row).
        let first = match step {
            Step::Prefill => 0,
            Step::Decode(_) => g.last_position(step),
        };
        let pos_of = |r: usize| match g.rows_at(step, stage) {
            Some(rs) if rs.len() == rows => first + rs[r],
            _ if stage == Stage::Logits && g.logits_last_row() => g.last_position(step),
            _ => first + r,
        };
        stages += 1;
        let (ad, bd) = (a.data(), b.data());
        // Per region: the largest |Δ| and the largest |b| of this stage.
        let mut agg = [(0.0f64, 0.0f64, 0usize); 2];
        for r in 0..rows {
            let p = pos_of(r);
            let region = usize::from(p >= from);
            for o in 0..outer {
                let off = (o * rows + r) * inner;
                for i in off..off + inner {
                    let (x, y) = (ad[i] as f64, bd[i] as f64);
                    let d = (x - y).abs();
                    let e = &mut agg[region];
                    if d > e.0 {
                        e.0 = d;
                        e.2 = p;
                    }
                    e.1 = e.1.max(y.abs());
                }
            }
        }
        for (region, (d, m, p)) in agg.into_iter().enumerate() {
            let seen_rows = (0..rows).any(|r| usize::from(pos_of(r) >= from) == region);
            if !seen_rows {
                continue;
            }
            let rel = if m > 0.0 { d / m } else { d };
            let w = if region == 0 { &mut before } else { &mut after };
            w.take(rel, (step, stage, p));
        }
    }
    (before, after, stages)
}
