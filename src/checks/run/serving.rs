//! What the serving run checks share (`batch_invariance`, `order_invariance`,
//! `chunked_prefill`, `prefix_reuse`, `poisoned_memory`, `repeat`): the
//! sequences they run, the comparison of one sequence's two outputs, and the
//! rule of what "the same numbers" means for an engine.
//!
//! Every request is teacher-forced (the spec's forced tokens, else the
//! tokens the sequence sampled alone), so that a sequence's steps are fed
//! the same tokens in both runs and a difference is localised to the first
//! (step, stage) where it appears, not smeared over by a different token.
//!
//! The same numbers: bitwise, every tapped stage and every sampled token,
//! where the engine declares itself batch-invariant (`Serving::invariant`);
//! otherwise the logits within the allowance its arithmetic derives (the
//! `kv_cache` check's: the spec's storage allowance, or twice the scaled
//! allowance of a golden of the engine's arithmetic), since an engine that
//! regroups reductions by batch shape may round each stage differently.

use crate::checks::facts::Facts;
use crate::checks::verdict::Verdict;
use crate::compare::{compare, Tolerance};
use crate::engine::batch::{BatchRequest, SeqRequest, Serving};
use crate::engine::{Engine, RunOutput, RunRequest, TapSet};
use crate::stage::{BlockStage, Stage, Step};
use crate::tensor::Tensor;

/// The serving declaration of the engine, or the verdict that the check is
/// not applicable to it (with the reason).
pub fn serving(engine: &dyn Engine, facts: &Facts) -> Result<Serving, Verdict> {
    if facts.image.is_some() {
        return Err(Verdict::not_applicable(
            "not applicable: batches of image requests are not checked (the serving checks run text prompts)",
        ));
    }
    engine
        .capabilities()
        .serving_or_why()
        .cloned()
        .map_err(Verdict::not_applicable)
}

/// Why a mode that changes how far a forward pass reaches (a chunked
/// prefill, a prefix served from the cache) is not applicable to this model:
/// its RoPE table depends on each pass's length (dynamic NTK, LongRoPE, HF's
/// `dynamic_rope_update`), so once a run reaches past the boundary the
/// schedules compute different numbers by HF's own rule, and comparing them
/// would fail a correct engine. None where the model has no such table or
/// the run (`reach` positions) stays within the boundary.
pub fn pass_length_matters(facts: &Facts, reach: usize) -> Option<String> {
    let s = facts.config.rope_scaling.as_ref()?;
    let b = s.switch_after()?;
    (reach > b).then(|| {
        format!(
            "not applicable: the model's {} RoPE chooses its table by each forward pass's length (HF's \
             `dynamic_rope_update`), and this run reaches {reach} positions, past {b}: splitting or reusing passes \
             changes the numbers by HF's own rule",
            s.name()
        )
    })
}

/// Every stage the engine can tap (greedy: no sample_probs).
pub fn taps(engine: &dyn Engine, facts: &Facts) -> TapSet {
    engine.capabilities().tappable(facts.config, false)
}

/// The spec's prompt as one sequence, greedy, teacher-forced with `forced`.
pub fn target(facts: &Facts, decode_steps: usize, forced: &[u32]) -> RunRequest {
    RunRequest {
        forced: Some(forced[..decode_steps].to_vec()),
        ..RunRequest::greedy(facts.prompt.to_vec(), decode_steps, facts.seed)
    }
}

/// The tokens decode steps are fed: the spec's forced tokens when it has
/// enough, else what the prompt samples greedily alone.
pub fn forced_tokens(engine: &dyn Engine, facts: &Facts, decode_steps: usize) -> Result<Vec<u32>, String> {
    if let Some(f) = facts.forced.filter(|f| f.len() >= decode_steps) {
        return Ok(f[..decode_steps].to_vec());
    }
    let req = RunRequest::greedy(facts.prompt.to_vec(), decode_steps, facts.seed);
    let out = engine.run(&req, &TapSet::none()).map_err(|e| e.to_string())?;
    Ok(out.sampled[..decode_steps].to_vec())
}

/// `n` other sequences of other lengths (drawn from the prompt's tokens,
/// rotated and cycled, so every id is one the model takes): half as long,
/// a few tokens longer, a single token, much longer, ... within the model's
/// context. Each is greedy and free-running.
pub fn others(facts: &Facts, n: usize, decode_steps: usize) -> Vec<RunRequest> {
    let p = facts.prompt;
    let t = p.len();
    let room = facts
        .config
        .context_length
        .unwrap_or(usize::MAX)
        .saturating_sub(decode_steps + 1);
    (0..n)
        .map(|j| {
            let want = match j % 4 {
                0 => (t / 2).max(1),
                1 => t + 5,
                2 => 1,
                _ => t + 17 + j,
            };
            let len = want.min(room).max(1);
            let len = if len == t { t + 1 } else { len }.min(room.max(1));
            let prompt = (0..len).map(|i| p[(i + 3 * (j + 1)) % t]).collect();
            RunRequest::greedy(prompt, decode_steps, facts.seed)
        })
        .collect()
}

/// A batch of plain sequences.
pub fn batch(runs: Vec<RunRequest>) -> BatchRequest {
    BatchRequest {
        seqs: runs.into_iter().map(SeqRequest::plain).collect(),
        poison: None,
    }
}

/// One engine batch, its error as text.
pub fn run_batch(engine: &dyn Engine, req: &BatchRequest, taps: &TapSet) -> Result<Vec<RunOutput>, String> {
    let outs = engine.run_batch(req, taps).map_err(|e| e.to_string())?;
    if outs.len() != req.seqs.len() {
        return Err(format!(
            "the engine answered a batch of {} sequences with {} outputs",
            req.seqs.len(),
            outs.len()
        ));
    }
    Ok(outs)
}

/// A deterministic draw in 0..n from `seed` (splitmix64).
pub fn draw(seed: u64, n: usize) -> usize {
    let mut z = seed.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    ((z ^ (z >> 31)) % n as u64) as usize
}

/// How two outputs of one sequence must agree.
pub struct Rule {
    pub bitwise: bool,
    /// The logits' allowance where not bitwise, and how it was derived.
    pub tol: Tolerance,
    pub basis: String,
}

impl Rule {
    pub fn of(serving: &Serving, facts: &Facts) -> Rule {
        let (tol, basis) = super::kv_cache::allowance_of(1e-5, 0.0, facts);
        Rule {
            bitwise: serving.invariant,
            tol,
            basis,
        }
    }
    /// How the rule reads in a message.
    pub fn describe(&self) -> String {
        if self.bitwise {
            "bitwise (the engine declares itself batch-invariant)".into()
        } else {
            format!(
                "logits within atol {:.3e} rtol {:.3e}{} (the engine does not declare itself batch-invariant)",
                self.tol.atol, self.tol.rtol, self.basis
            )
        }
    }
}

/// `t`'s rows from `from` on (a prefix hit computes only those): the first
/// axis of a row stage, the second of an attention tensor.
pub fn rows_from(stage: Stage, t: &Tensor, from: usize) -> Tensor {
    if from == 0 || stage == Stage::SampleProbs {
        return t.clone();
    }
    let shape = t.shape();
    if matches!(stage, Stage::Block(_, BlockStage::AttnScores | BlockStage::AttnProbs)) {
        let (h, rows, s) = (shape[0], shape[1], shape[2]);
        let from = from.min(rows);
        let data = (0..h)
            .flat_map(|hh| t.data()[(hh * rows + from) * s..(hh + 1) * rows * s].iter().copied())
            .collect();
        return Tensor::new(vec![h, rows - from, s], data).with_dtype(t.dtype());
    }
    let width: usize = shape[1..].iter().product();
    let from = from.min(shape[0]);
    let mut sh = shape.to_vec();
    sh[0] -= from;
    Tensor::new(sh, t.data()[from * width..].to_vec()).with_dtype(t.dtype())
}

/// The first way `got` (sequence `seq` of the mode's run) differs from
/// `want` (the same sequence as the reference ran it), in step then stage
/// order; `from`: the prefill rows `got` computed start there. None: equal
/// under `rule`.
pub fn first_difference(want: &RunOutput, got: &RunOutput, from: usize, rule: &Rule) -> Option<String> {
    for ((step, stage), w) in want.captures.iter() {
        if !rule.bitwise && *stage != Stage::Logits {
            continue;
        }
        let w = if *step == Step::Prefill {
            rows_from(*stage, w, from)
        } else {
            w.clone()
        };
        let Some(g) = got.captures.get(*step, *stage) else {
            return Some(format!(
                "{step}/{stage}: missing from this run (the reference run has it)"
            ));
        };
        if g.shape() != w.shape() {
            return Some(format!(
                "{step}/{stage}: shape {:?}, the reference's {:?}",
                g.shape(),
                w.shape()
            ));
        }
        if rule.bitwise {
            let differ = |(a, b): (&f32, &f32)| a.to_bits() != b.to_bits();
            if let Some(i) = w.data().iter().zip(g.data()).position(differ) {
                let n = w.data().iter().zip(g.data()).filter(|p| differ(*p)).count();
                return Some(format!(
                    "{step}/{stage}: {n} of {} values differ in their bits; first at {:?}: {:e} here, {:e} in the \
                     reference",
                    w.numel(),
                    w.unravel(i),
                    g.data()[i],
                    w.data()[i]
                ));
            }
        } else {
            match compare(g, &w, rule.tol) {
                Ok(c) if c.passed() => {}
                Ok(c) => return Some(format!("{step}/{stage}:\n{}", c.explain())),
                Err(e) => return Some(format!("{step}/{stage}: {e}")),
            }
        }
    }
    if rule.bitwise && want.sampled != got.sampled {
        return Some(format!(
            "sampled tokens {:?}, the reference's {:?}",
            got.sampled, want.sampled
        ));
    }
    None
}

/// The verdict of a mode that compared `pairs` (what, reference, output,
/// prefill rows from) under `rule`: the first differing one fails, named.
pub fn judge(mode: &str, pairs: &[(String, &RunOutput, &RunOutput, usize)], rule: &Rule, done: String) -> Verdict {
    for (what, want, got, from) in pairs {
        if let Some(d) = first_difference(want, got, *from, rule) {
            return Verdict::fail(format!(
                "{mode}: {what} differs from its reference ({}): first at {d}",
                rule.describe()
            ));
        }
    }
    let compared = if rule.bitwise {
        format!(
            "{} captures equal",
            pairs.iter().map(|p| p.2.captures.len()).sum::<usize>()
        )
    } else {
        format!(
            "the logits of {} steps agree",
            pairs.iter().map(|p| p.2.sampled.len()).sum::<usize>()
        )
    };
    Verdict::pass(format!("{mode}: {done}; {compared}, {}", rule.describe())).metric("sequences", pairs.len() as f64)
}

/// The boilerplate of a serving kind: `Kind` (parsed as `NAME` or
/// `{NAME: {params}}`), `RunRule` and `RunCheck`, around the kind's
/// `fn evaluate_mode(&self, &Facts, &dyn Engine, &Serving) -> Result<Verdict, String>`
/// and its `decode_steps` field.
macro_rules! serving_kind {
    ($kind:ident, $name:literal, $params:literal, $about:literal) => {
        impl $crate::checks::kind::Kind for $kind {
            const NAME: &'static str = $name;
            const PARAMS: &'static str = $params;
            const ABOUT: &'static str = $about;
            fn bare() -> Self {
                serde_yaml::from_str("{}").expect("every parameter has a default")
            }
            fn parse<'de, D: serde::de::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                use serde::de::Deserialize;
                Ok(Option::<$kind>::deserialize(d)?.unwrap_or_else(<Self as $crate::checks::kind::Kind>::bare))
            }
            fn check_params(&self) -> Result<(), String> {
                self.check()
            }
        }

        impl $crate::checks::kind::RunRule for $kind {
            fn kind(&self) -> &'static str {
                $name
            }
            fn counts(&self) -> Vec<$crate::checks::kind::Count> {
                vec![$crate::checks::kind::Count {
                    key: "decode_steps",
                    what: concat!($name, ".decode_steps"),
                    n: self.decode_steps,
                    limit: $crate::checks::kind::Limit::DecodeSteps,
                }]
            }
            fn expand(&self, _: &$crate::checks::kind::RuleEnv) -> std::sync::Arc<dyn $crate::checks::kind::RunCheck> {
                std::sync::Arc::new(self.clone())
            }
        }

        impl $crate::checks::kind::RunCheck for $kind {
            fn id(&self) -> String {
                $name.into()
            }
            fn steps(&self, _: usize) -> Option<(&'static str, usize)> {
                Some((
                    concat!("the prompt plus ", $name, ".decode_steps"),
                    self.decode_steps,
                ))
            }
            fn reruns(&self) -> bool {
                true
            }
            fn evaluate(
                &self,
                facts: &$crate::checks::facts::Facts,
                engine: &dyn $crate::engine::Engine,
            ) -> $crate::checks::verdict::Verdict {
                let serving = match super::serving::serving(engine, facts) {
                    Ok(s) => s,
                    Err(v) => return v,
                };
                self.evaluate_mode(facts, engine, &serving)
                    .unwrap_or_else(|e| $crate::checks::verdict::Verdict::fail(format!("the engine failed: {e}")))
            }
        }
    };
}
pub(crate) use serving_kind;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_prefix_hits_rows_are_the_tail_of_the_full_prefill() {
        let t = Tensor::new(vec![3, 2], vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
        assert_eq!(rows_from(Stage::Embed, &t, 1).data(), &[3.0, 4.0, 5.0, 6.0]);
        let p = Tensor::new(vec![2, 2, 2], (0..8).map(|x| x as f32).collect());
        let s = rows_from(Stage::Block(0, BlockStage::AttnProbs), &p, 1);
        assert_eq!((s.shape(), s.data()), (&[2usize, 1, 2][..], &[2.0, 3.0, 6.0, 7.0][..]));
    }

    #[test]
    fn draws_are_deterministic_and_in_range() {
        assert_eq!(draw(7, 5), draw(7, 5));
        assert!((0..100).all(|s| draw(s, 4) < 4));
        assert!(
            (0..100)
                .map(|s| draw(s, 4))
                .collect::<std::collections::BTreeSet<_>>()
                .len()
                == 4
        );
    }
}
