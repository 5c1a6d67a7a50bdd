//! The auxiliary stages of a compact recording (`record:`): what the scaled
//! policy's floors read that the subset does not keep, recorded beside it
//! (`--aux STEP=STAGE,…`; provenance `record.aux`) and never checked
//! themselves. A floor computed from operands nobody kept would be an
//! estimate through them; with these it is exact (`checks::floor`):
//!
//! - the direct inputs of every recorded stage (`ffn_inp` and `ffn_out` of a
//!   layer that keeps only `out`), at the step it is recorded;
//! - at every recorded attention stage, the KV cache it reads: `k_rope`
//!   (scores) or `v` (context) at every step up to its own, every token row
//!   (a later row attends to every key).

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use super::job::RecordArgs;
use crate::checks::floor::{cache_stage, floor_reads};
use crate::error::{Error, Result};
use crate::stage::pattern::StagePattern;
use crate::stage::{Stage, Step};

/// `--aux` arguments for the recorders of a compact text golden (none for a
/// whole recording or a VLM's, which record every stage); `decode_steps` is
/// the number the recording makes.
pub(super) fn aux_args(model: &Path, args: &RecordArgs, decode_steps: Option<u64>) -> Result<Vec<String>> {
    if args.image.is_some()
        || (args.steps.is_none() && args.stages.is_none() && args.rows.is_none() && args.stages_at.is_empty())
    {
        return Ok(Vec::new());
    }
    let cfg = crate::model::read_config(model)?;
    let patterns = match &args.stages {
        Some(ps) => Some(
            ps.iter()
                .map(|p| StagePattern::parse(p).map_err(|e| Error::Usage(format!("record.stages: {e}"))))
                .collect::<Result<Vec<_>>>()?,
        ),
        None => None,
    };
    let steps: Vec<Step> = match &args.steps {
        Some(names) => names
            .iter()
            .map(|n| Step::parse(n).ok_or_else(|| Error::Usage(format!("record.steps: `{n}` is not a step"))))
            .collect::<Result<_>>()?,
        None => Step::sequence(decode_steps.unwrap_or(0) as usize),
    };
    // `record.stages_at`: more stages at one step.
    let mut at: BTreeMap<Step, Vec<StagePattern>> = BTreeMap::new();
    for (name, ps) in &args.stages_at {
        let step =
            Step::parse(name).ok_or_else(|| Error::Usage(format!("record.stages_at: `{name}` is not a step")))?;
        for p in ps {
            at.entry(step)
                .or_default()
                .push(StagePattern::parse(p).map_err(|e| Error::Usage(format!("record.stages_at: {e}")))?);
        }
    }
    let mut all_steps = steps.clone();
    all_steps.extend(at.keys().filter(|s| !steps.contains(s)));
    all_steps.sort();
    let kept = |step: Step, s: Stage| {
        (steps.contains(&step) && patterns.as_ref().is_none_or(|ps| ps.iter().any(|p| p.matches(s))))
            || at.get(&step).is_some_and(|ps| ps.iter().any(|p| p.matches(s)))
    };
    let sampled = args.sample_probs.is_some();
    let aux = aux_stages(
        &Stage::of_model(&cfg, sampled),
        &all_steps,
        args.rows.is_some(),
        &kept,
        &|s| floor_reads(&cfg, s),
    );
    let flag = |flag: &'static str, m: BTreeMap<Step, BTreeSet<Stage>>| {
        m.into_iter().flat_map(move |(step, stages)| {
            let list: Vec<String> = stages.iter().map(Stage::to_string).collect();
            [flag.to_string(), format!("{step}={}", list.join(","))]
        })
    };
    Ok(flag("--aux", aux.whole).chain(flag("--aux-rows", aux.rows)).collect())
}

/// The stages to record beside a subset, per step.
#[derive(Debug, Default)]
struct Aux {
    /// Every token row (the KV caches).
    whole: BTreeMap<Step, BTreeSet<Stage>>,
    /// On the subset's rows (the recorded stages' inputs).
    rows: BTreeMap<Step, BTreeSet<Stage>>,
}

/// Per step, the stages to record beside the subset (see the module
/// comment): `stages` are the model's, `kept` says which the subset records
/// at which of its `steps`, `rows` whether it keeps only some token rows,
/// `reads` what a stage's floor reads.
fn aux_stages(
    stages: &[Stage],
    steps: &[Step],
    rows: bool,
    kept: &dyn Fn(Step, Stage) -> bool,
    reads: &dyn Fn(Stage) -> Vec<Stage>,
) -> Aux {
    let recorded = |step: Step, s: Stage| kept(step, s);
    let mut aux = Aux::default();
    for &step in steps {
        for &s in stages.iter().filter(|s| kept(step, **s)) {
            let cache = cache_stage(s);
            for f in reads(s) {
                // A decode step has no image: nothing of the tower to read.
                if step != Step::Prefill && matches!(f, Stage::Vision(_)) {
                    continue;
                }
                if Some(f) == cache {
                    for earlier in Step::sequence(step.index()) {
                        if rows || !recorded(earlier, f) {
                            aux.whole.entry(earlier).or_default().insert(f);
                        }
                    }
                } else if !recorded(step, f) {
                    aux.rows.entry(step).or_default().insert(f);
                }
            }
        }
    }
    aux
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::stage::BlockStage::*;

    fn b(l: usize, s: crate::stage::BlockStage) -> Stage {
        Stage::Block(l, s)
    }

    #[test]
    fn a_layer_keeping_only_out_gets_its_inputs_and_attention_its_cache_at_every_step() {
        let stages = vec![b(0, KRope), b(0, AttnScores), b(0, FfnInp), b(0, FfnOut), b(0, Out)];
        let reads = |s: Stage| match s {
            Stage::Block(0, AttnScores) => vec![b(0, QRope), b(0, KRope)],
            Stage::Block(0, Out) => vec![b(0, FfnInp), b(0, FfnOut)],
            _ => vec![],
        };
        let kept = |_: Step, s: Stage| matches!(s, Stage::Block(0, AttnScores | Out));
        let steps = [Step::Prefill, Step::Decode(2)];
        let aux = aux_stages(&stages, &steps, true, &kept, &reads);
        // The scores' query and the out's inputs where they are judged, on
        // their rows…
        for step in steps {
            for s in [b(0, QRope), b(0, FfnInp), b(0, FfnOut)] {
                assert!(aux.rows[&step].contains(&s), "{step} {s}");
            }
        }
        // …and the keys at every step up to the judged one, decode1
        // included, every row.
        for step in [Step::Prefill, Step::Decode(1), Step::Decode(2)] {
            assert!(aux.whole[&step].contains(&b(0, KRope)), "{step}");
        }
        assert_eq!(aux.whole[&Step::Decode(1)].len(), 1);
        assert!(!aux.rows.contains_key(&Step::Decode(1)));
        // A whole recording of every step needs nothing beside it.
        let all = |_: Step, _: Stage| true;
        let aux = aux_stages(&stages, &[Step::Prefill, Step::Decode(1)], false, &all, &reads);
        assert!(aux.whole.is_empty() && aux.rows.is_empty(), "{aux:?}");
    }
}
