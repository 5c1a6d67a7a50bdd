//! `poisoned_memory`: a batch run with the engine's KV blocks and scratch
//! filled with NaN, and again with a huge value, before each use gives
//! every sequence the numbers of the same batch on ordinary memory, and no
//! capture of a poisoned run holds a NaN or an infinity. A read of memory
//! the sequence never wrote (one slot past its end, a block it does not
//! own) then shows even where ordinary memory would hide it: stale or zero
//! keys near the other scores, or a masked probability of 0 times a stale
//! value (0 · NaN is NaN).

use super::serving::{self, serving_kind, Rule};
use crate::checks::facts::Facts;
use crate::checks::verdict::Verdict;
use crate::engine::batch::{Poison, Serving};
use crate::engine::Engine;

#[derive(Clone, Debug, PartialEq, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PoisonedMemory {
    /// The poisons, each a run (nan, huge).
    #[serde(default = "default_values")]
    pub values: Vec<Poison>,
    /// Sequences in the batch: the spec's prompt and others of other lengths.
    #[serde(default = "default_size")]
    pub size: usize,
    #[serde(default = "default_steps")]
    pub decode_steps: usize,
}

fn default_values() -> Vec<Poison> {
    vec![Poison::Nan, Poison::Huge]
}
fn default_size() -> usize {
    3
}
fn default_steps() -> usize {
    2
}

serving_kind!(
    PoisonedMemory,
    "poisoned_memory",
    "values ([nan, huge]), size (3), decode_steps (2)",
    "a batch on memory filled with NaN or huge values gives the numbers of ordinary memory, all finite"
);

impl PoisonedMemory {
    fn check(&self) -> Result<(), String> {
        if self.values.is_empty() || self.size == 0 {
            return Err("poisoned_memory needs at least one value and size >= 1".into());
        }
        Ok(())
    }

    fn evaluate_mode(&self, facts: &Facts, engine: &dyn Engine, sv: &Serving) -> Result<Verdict, String> {
        if !sv.poison {
            return Ok(Verdict::not_applicable(
                "not applicable: the engine declares no poison hook (`poison: true` in its batches declaration)",
            ));
        }
        let forced = serving::forced_tokens(engine, facts, self.decode_steps)?;
        let taps = serving::taps(engine, facts);
        let mut seqs = vec![serving::target(facts, self.decode_steps, &forced)];
        seqs.extend(serving::others(facts, self.size.min(sv.max_batch) - 1, self.decode_steps));
        let lens: Vec<usize> = seqs.iter().map(|s| s.prompt.len()).collect();
        let mut req = serving::batch(seqs);
        let clean = serving::run_batch(engine, &req, &taps)?;
        let rule = Rule::of(sv, facts);
        for &p in &self.values {
            req.poison = Some(p);
            let outs = serving::run_batch(engine, &req, &taps)?;
            for (i, out) in outs.iter().enumerate() {
                if let Some(((step, stage), t, at)) = out.captures.iter().find_map(|(k, t)| {
                    t.data().iter().position(|x| !x.is_finite()).map(|at| (*k, t, at))
                }) {
                    return Ok(Verdict::fail(format!(
                        "poisoned memory: with memory poisoned to {} sequence {i} (prompt lengths {lens:?}) reads \
                         memory it never wrote: first non-finite value at {step}/{stage} {:?} = {}",
                        p.name(),
                        t.unravel(at),
                        t.data()[at]
                    )));
                }
            }
            let pairs: Vec<_> = clean
                .iter()
                .zip(&outs)
                .enumerate()
                .map(|(i, (c, o))| (format!("sequence {i} on memory poisoned to {}", p.name()), c, o, 0))
                .collect();
            let v = serving::judge("poisoned memory", &pairs, &rule, String::new());
            if v.failed() {
                return Ok(v);
            }
        }
        let names: Vec<_> = self.values.iter().map(|p| p.name()).collect();
        Ok(Verdict::pass(format!(
            "poisoned memory: a batch of prompt lengths {lens:?} on memory poisoned to {names:?} gives every sequence \
             the numbers of ordinary memory, all finite, {}",
            rule.describe()
        )))
    }
}
