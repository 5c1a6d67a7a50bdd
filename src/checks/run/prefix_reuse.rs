//! `prefix_reuse`: a prompt whose first L positions an earlier sequence of
//! the batch computed (a prefix-cache hit: the engine reuses that cache)
//! gives the numbers of the same prompt computed afresh, at prefix lengths
//! that straddle the engine's KV block size (block − 1, block, block + 1:
//! a partial block copied, exactly one block shared, one shared and one
//! position past it), plus any lengths the spec adds. What it catches: a
//! hit reusing one position too few or too many, a shared block written
//! by the sequence that borrowed it.
//!
//! The prompt is the spec's, cycled to at least the longest prefix plus a
//! few positions; the earlier sequence's prompt is that prefix followed by
//! other tokens, so only the prefix is shared.

use super::serving::{self, serving_kind, Rule};
use crate::checks::facts::Facts;
use crate::checks::verdict::Verdict;
use crate::engine::batch::{BatchRequest, PrefixHit, SeqRequest, Serving};
use crate::engine::{Engine, RunRequest};

#[derive(Clone, Debug, PartialEq, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PrefixReuse {
    /// Prefix lengths besides the block size's neighbours (each >= 1).
    #[serde(default)]
    pub lengths: Vec<usize>,
    #[serde(default = "default_steps")]
    pub decode_steps: usize,
}

fn default_steps() -> usize {
    2
}

serving_kind!(
    PrefixReuse,
    "prefix_reuse",
    "lengths (besides block − 1, block, block + 1 of the engine's block size), decode_steps (2)",
    "a prompt served from a cached prefix gives the numbers of the prompt computed afresh"
);

/// Positions computed after the longest prefix.
const TAIL: usize = 4;

impl PrefixReuse {
    fn check(&self) -> Result<(), String> {
        if self.lengths.contains(&0) {
            return Err("prefix_reuse lengths must be >= 1".into());
        }
        Ok(())
    }

    fn evaluate_mode(&self, facts: &Facts, engine: &dyn Engine, sv: &Serving) -> Result<Verdict, String> {
        if sv.max_batch < 2 {
            return Ok(Verdict::not_applicable(
                "not applicable: a prefix hit needs two sequences in a batch (max_batch 1)",
            ));
        }
        let mut lengths = self.lengths.clone();
        if let Some(b) = sv.block_size {
            lengths.extend([b.saturating_sub(1).max(1), b, b + 1]);
        }
        if lengths.is_empty() {
            lengths = vec![(facts.prompt.len() / 2).max(1)];
        }
        lengths.sort();
        lengths.dedup();
        let room = facts.config.context_length.unwrap_or(usize::MAX);
        let longest = lengths.last().copied().unwrap_or(1);
        let total = longest + TAIL;
        if let Some(why) = serving::pass_length_matters(facts, total + self.decode_steps) {
            return Ok(Verdict::not_applicable(why));
        }
        if total + self.decode_steps > room {
            return Ok(Verdict::not_applicable(format!(
                "not applicable: a prefix of {longest} plus {TAIL} positions and {} decode steps exceeds the model's \
                 context of {room}",
                self.decode_steps
            )));
        }
        let p = facts.prompt;
        let prompt: Vec<u32> = (0..total).map(|i| p[i % p.len()]).collect();
        let taps = serving::taps(engine, facts);
        let forced: Vec<u32> = (0..self.decode_steps).map(|i| p[(i * 7 + 1) % p.len()]).collect();
        let req = |prompt: Vec<u32>| RunRequest {
            forced: Some(forced.clone()),
            ..RunRequest::greedy(prompt, self.decode_steps, facts.seed)
        };
        let fresh = serving::run_batch(engine, &serving::batch(vec![req(prompt.clone())]), &taps)?;
        let rule = Rule::of(sv, facts);
        let mut hits = Vec::new();
        for &len in &lengths {
            // The earlier sequence: the same first `len` tokens, then others.
            let mut first = prompt[..len].to_vec();
            first.extend((0..TAIL).map(|i| p[(len + 2 * i + 1) % p.len()]));
            let batch = BatchRequest {
                seqs: vec![
                    SeqRequest::plain(req(first)),
                    SeqRequest {
                        run: req(prompt.clone()),
                        chunks: Vec::new(),
                        prefix: Some(PrefixHit { from: 0, len }),
                    },
                ],
                poison: None,
            };
            let outs = serving::run_batch(engine, &batch, &taps)?;
            if let Some(d) = serving::first_difference(&fresh[0], &outs[1], len, &rule) {
                return Ok(Verdict::fail(format!(
                    "prefix reuse: the prompt of {total} positions with its first {len} from a cache hit (block size \
                     {}) differs from the prompt computed afresh ({}): first at {d}",
                    sv.block_size.map_or("none".into(), |b| b.to_string()),
                    rule.describe()
                )));
            }
            hits.push(len);
        }
        Ok(Verdict::pass(format!(
            "prefix reuse: a prompt of {total} positions served from cached prefixes of {hits:?} positions (block size \
             {}) equals the prompt computed afresh, {}",
            sv.block_size.map_or("none".into(), |b| b.to_string()),
            rule.describe()
        ))
        .metric("prefixes", hits.len() as f64))
    }
}
