//! `chunked_prefill`: the prompt's prefill in one step gives the numbers of
//! the same prefill in chunks of the given sizes (cycled until the prompt is
//! covered), each chunk attending over the cache the chunks before it
//! wrote; the chunks' rows, joined, are the prefill's. What it catches: a
//! chunk boundary that loses a position's RoPE offset, a chunk's causal
//! mask or cache length off by the chunk start.

use super::serving::{self, serving_kind, Rule};
use crate::checks::facts::Facts;
use crate::checks::verdict::Verdict;
use crate::engine::batch::{BatchRequest, SeqRequest, Serving};
use crate::engine::Engine;

#[derive(Clone, Debug, PartialEq, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ChunkedPrefill {
    /// Chunk sizes, cycled over the prompt (each >= 1).
    #[serde(default = "default_sizes")]
    pub sizes: Vec<usize>,
    #[serde(default = "default_steps")]
    pub decode_steps: usize,
}

fn default_sizes() -> Vec<usize> {
    vec![3, 5]
}
fn default_steps() -> usize {
    2
}

serving_kind!(
    ChunkedPrefill,
    "chunked_prefill",
    "sizes ([3, 5], cycled over the prompt), decode_steps (2)",
    "a prefill in chunks gives the numbers of one prefill"
);

/// `sizes` cycled over `t` positions (the last one cut to fit); when that
/// gives one chunk, the prompt's halves.
pub fn chunk_plan(sizes: &[usize], t: usize) -> Vec<usize> {
    let mut out = Vec::new();
    let mut left = t;
    for &s in sizes.iter().cycle() {
        if left == 0 {
            break;
        }
        out.push(s.min(left));
        left -= s.min(left);
    }
    if out.len() < 2 && t >= 2 {
        out = vec![t / 2, t - t / 2];
    }
    out
}

impl ChunkedPrefill {
    fn check(&self) -> Result<(), String> {
        if self.sizes.is_empty() || self.sizes.contains(&0) {
            return Err(format!("chunked_prefill needs sizes >= 1, got {:?}", self.sizes));
        }
        Ok(())
    }

    fn evaluate_mode(&self, facts: &Facts, engine: &dyn Engine, sv: &Serving) -> Result<Verdict, String> {
        let t = facts.prompt.len();
        if t < 2 {
            return Ok(Verdict::not_applicable(
                "not applicable: a one-token prompt has no chunks",
            ));
        }
        if let Some(why) = serving::pass_length_matters(facts, t + self.decode_steps) {
            return Ok(Verdict::not_applicable(why));
        }
        let forced = serving::forced_tokens(engine, facts, self.decode_steps)?;
        let taps = serving::taps(engine, facts);
        let target = serving::target(facts, self.decode_steps, &forced);
        let whole = serving::run_batch(engine, &serving::batch(vec![target.clone()]), &taps)?;
        let chunks = chunk_plan(&self.sizes, t);
        let req = BatchRequest {
            seqs: vec![SeqRequest {
                run: target,
                chunks: chunks.clone(),
                prefix: None,
            }],
            poison: None,
        };
        let chunked = serving::run_batch(engine, &req, &taps)?;
        Ok(serving::judge(
            "chunked prefill",
            &[(format!("the prompt's prefill in chunks {chunks:?}"), &whole[0], &chunked[0], 0)],
            &Rule::of(sv, facts),
            format!("one prefill of {t} positions and chunks {chunks:?}"),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::chunk_plan;

    #[test]
    fn sizes_cycle_over_the_prompt_and_always_split_it() {
        assert_eq!(chunk_plan(&[3, 5], 10), vec![3, 5, 2]);
        assert_eq!(chunk_plan(&[3, 5], 3), vec![1, 2]);
        assert_eq!(chunk_plan(&[1], 3), vec![1, 1, 1]);
    }
}
