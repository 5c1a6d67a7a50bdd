//! `order_invariance`: a batch and the same batch permuted (a seeded
//! shuffle) give every sequence the same numbers. What it catches: a
//! sequence reading state by its slot rather than its own (block tables,
//! positions, sampler streams indexed by slot).

use super::serving::{self, serving_kind, Rule};
use crate::checks::facts::Facts;
use crate::checks::verdict::Verdict;
use crate::engine::batch::Serving;
use crate::engine::Engine;

#[derive(Clone, Debug, PartialEq, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OrderInvariance {
    /// Sequences in the batch (>= 2): the spec's prompt and others.
    #[serde(default = "default_size")]
    pub size: usize,
    #[serde(default = "default_steps")]
    pub decode_steps: usize,
    /// Seed of the permutation (default: the spec's seed).
    pub seed: Option<u64>,
}

fn default_size() -> usize {
    4
}
fn default_steps() -> usize {
    2
}

serving_kind!(
    OrderInvariance,
    "order_invariance",
    "size (4), decode_steps (2), seed (the spec's: the permutation)",
    "a batch permuted gives every sequence the numbers it had"
);

impl OrderInvariance {
    fn check(&self) -> Result<(), String> {
        if self.size < 2 {
            return Err("order_invariance needs size >= 2".into());
        }
        Ok(())
    }

    fn evaluate_mode(&self, facts: &Facts, engine: &dyn Engine, sv: &Serving) -> Result<Verdict, String> {
        let size = self.size.min(sv.max_batch);
        if size < 2 {
            return Ok(Verdict::not_applicable(
                "not applicable: the engine takes batches of one sequence (max_batch 1)",
            ));
        }
        let forced = serving::forced_tokens(engine, facts, self.decode_steps)?;
        let taps = serving::taps(engine, facts);
        let mut seqs = vec![serving::target(facts, self.decode_steps, &forced)];
        seqs.extend(serving::others(facts, size - 1, self.decode_steps));
        // A seeded Fisher–Yates shuffle that moves something.
        let seed = self.seed.unwrap_or(facts.seed);
        let mut perm: Vec<usize> = (0..size).collect();
        for i in (1..size).rev() {
            perm.swap(i, serving::draw(seed.wrapping_add(i as u64), i + 1));
        }
        if perm.iter().enumerate().all(|(i, &p)| i == p) {
            perm.reverse();
        }
        let first = serving::run_batch(engine, &serving::batch(seqs.clone()), &taps)?;
        let permuted: Vec<_> = perm.iter().map(|&i| seqs[i].clone()).collect();
        let second = serving::run_batch(engine, &serving::batch(permuted), &taps)?;
        let pairs: Vec<_> = perm
            .iter()
            .enumerate()
            .map(|(at, &i)| (format!("sequence {i} (at slot {at} once permuted {perm:?})"), &first[i], &second[at], 0))
            .collect();
        let rule = Rule::of(sv, facts);
        Ok(serving::judge(
            "order",
            &pairs,
            &rule,
            format!("{size} sequences in order and permuted {perm:?}"),
        ))
    }
}
