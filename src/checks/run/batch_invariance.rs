//! `batch_invariance`: the spec's prompt run alone gives the same numbers as
//! the same request at a seeded random slot among `others` sequences of
//! other lengths, in one batch (different lengths in every step: a prefill
//! beside longer and shorter ones, decode steps beside each other). What it
//! catches: a batched softmax that normalises over the padded length, a
//! decode step reading a neighbouring sequence's KV blocks, any kernel whose
//! result depends on the batch shape.

use super::serving::{self, serving_kind, Rule};
use crate::checks::facts::Facts;
use crate::checks::verdict::Verdict;
use crate::engine::batch::Serving;
use crate::engine::Engine;

#[derive(Clone, Debug, PartialEq, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BatchInvariance {
    /// Other sequences in the batch (>= 1).
    #[serde(default = "default_others")]
    pub others: usize,
    /// Decode steps of every sequence.
    #[serde(default = "default_steps")]
    pub decode_steps: usize,
    /// Seed of the slot draw (default: the spec's seed).
    pub seed: Option<u64>,
}

fn default_others() -> usize {
    3
}
fn default_steps() -> usize {
    2
}

serving_kind!(
    BatchInvariance,
    "batch_invariance",
    "others (3), decode_steps (2), seed (the spec's: where the request sits in the batch)",
    "a request alone gives the numbers it gives at a random slot of a batch of sequences of other lengths"
);

impl BatchInvariance {
    fn check(&self) -> Result<(), String> {
        if self.others == 0 {
            return Err("batch_invariance needs others >= 1 (a batch of one is the request alone)".into());
        }
        Ok(())
    }

    fn evaluate_mode(&self, facts: &Facts, engine: &dyn Engine, sv: &Serving) -> Result<Verdict, String> {
        let n = self.others.min(sv.max_batch.saturating_sub(1));
        if n == 0 {
            return Ok(Verdict::not_applicable(
                "not applicable: the engine takes batches of one sequence (max_batch 1)",
            ));
        }
        let forced = serving::forced_tokens(engine, facts, self.decode_steps)?;
        let taps = serving::taps(engine, facts);
        let target = serving::target(facts, self.decode_steps, &forced);
        let alone = serving::run_batch(engine, &serving::batch(vec![target.clone()]), &taps)?;
        let mut seqs = serving::others(facts, n, self.decode_steps);
        let slot = serving::draw(self.seed.unwrap_or(facts.seed), n + 1);
        seqs.insert(slot, target);
        let lens: Vec<usize> = seqs.iter().map(|s| s.prompt.len()).collect();
        let outs = serving::run_batch(engine, &serving::batch(seqs), &taps)?;
        let rule = Rule::of(sv, facts);
        Ok(serving::judge(
            "batch",
            &[(format!("sequence {slot} (the request) of a batch of prompt lengths {lens:?}"), &alone[0], &outs[slot], 0)],
            &rule,
            format!("the request alone and at slot {slot} of a batch of prompt lengths {lens:?}"),
        ))
    }
}
