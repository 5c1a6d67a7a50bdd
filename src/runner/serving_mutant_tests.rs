//! The serving bugs (issue 36) run through the serving checks, and a rank's
//! shard at the wrong offset through the join of per-rank tensors: each
//! caught by its mode and localised (beside `mutant_tests`, the engine as the
//! instrument).

/// The serving bugs (issue 36): each must be caught by its serving check and
/// localised there (its message names the first differing step/stage), at
/// f32 and at both 16-bit storages; the unmutated engine passes every serving
/// check; the slot-past read is caught only with poisoned memory.
mod serving {
    use crate::checks::Status;
    use crate::engine::cpu::mutants::Mutant;
    use crate::engine::cpu::CpuEngine;
    use crate::engine::Engine;
    use crate::plan::Plan;
    use crate::report::Outcome;
    use crate::runner::{run_on, Filter};
    use crate::spec::Spec;
    use crate::tensor::DType;
    use std::path::Path;

    use crate::checks::run::SERVING as MODES;

    /// The serving checks `modes` of the default spec on a fresh CPU engine.
    fn run(m: Option<Mutant>, storage: DType, modes: &[&str]) -> Vec<Outcome> {
        let root = Path::new(env!("CARGO_MANIFEST_DIR"));
        let spec = Spec::load(&root.join("specs/qwen2-tiny.yaml")).unwrap();
        let mut plan = Plan::build(spec, None).unwrap();
        plan.load_options.storage = storage;
        let eng = CpuEngine::load_with(&plan.model, &plan.load_options).unwrap();
        let eng = match m {
            Some(m) => eng.mutated(m),
            None => eng,
        };
        let filter = Filter(Some(modes.iter().map(|m| format!("::{m}")).collect()));
        let r = run_on(&plan, &eng as &dyn Engine, &filter, &|id| id.to_string());
        assert_eq!(r.outcomes.len(), modes.len(), "every serving check asked for ran once");
        r.outcomes
    }

    /// Where each is localised: the text after "first at" in its message.
    fn expected(m: Mutant) -> &'static str {
        use Mutant::*;
        match m {
            // The padding slots enter the sum: probabilities are the first stage off.
            SoftmaxOverPaddedLength => "first at prefill/blk.0.attn_probs",
            DecodeReadsNeighbourKv => "first at decode1/blk.0.attn_scores",
            ChunkRopeOffsetDropped => "first at prefill/blk.0.q_rope",
            PrefixHitOneShort => "first at prefill/blk.0.attn_scores",
            ReadsOneSlotPast => "first non-finite value at prefill/blk.0.attn_ctx",
            CacheNotCleared => "first at prefill/blk.0.attn_scores",
            BufferLeakedPerRequest => "memory grows with requests",
            _ => unreachable!("not a serving mutant"),
        }
    }

    fn check(storage: DType) {
        let clean = run(None, storage, &MODES);
        for o in &clean {
            assert_eq!(
                o.status,
                Status::Pass,
                "unmutated at {storage}: {}: {}",
                o.check,
                o.message
            );
        }
        let mut rows = Vec::new();
        for (m, mode) in Mutant::SERVING {
            let outs = run(Some(m), storage, &MODES);
            let o = outs.iter().find(|o| o.check == mode).expect("the mode ran");
            assert_eq!(
                o.status,
                Status::Fail,
                "{m:?} at {storage} must fail {mode}: {}",
                o.message
            );
            assert!(
                o.message.contains(expected(m)),
                "{m:?} at {storage}: {mode} must say `{}`: {}",
                expected(m),
                o.message
            );
            if m == Mutant::ReadsOneSlotPast {
                // Ordinary memory hides it: on an engine that never ran
                // poisoned (whose pool would hold stale NaN), every other
                // mode passes.
                let others: Vec<&str> = MODES.into_iter().filter(|x| *x != mode).collect();
                for o in run(Some(m), storage, &others) {
                    assert_eq!(o.status, Status::Pass, "{m:?}: {} sees it: {}", o.check, o.message);
                }
            }
            rows.push(format!(
                "{:<26} {:<18} {}",
                format!("{m:?}"),
                mode,
                o.message.lines().next().unwrap_or("")
            ));
        }
        println!(
            "serving mutants at {storage}: {}/{} caught and localised",
            rows.len(),
            Mutant::SERVING.len()
        );
        println!("{}", rows.join("\n"));
    }

    #[test]
    fn each_serving_bug_is_caught_by_its_mode_and_localised_at_f32() {
        check(DType::F32);
    }

    #[test]
    fn each_serving_bug_is_caught_by_its_mode_and_localised_at_f16() {
        check(DType::F16);
    }

    #[test]
    fn each_serving_bug_is_caught_by_its_mode_and_localised_at_bf16() {
        check(DType::BF16);
    }
}

/// The eighth serving bug: a rank's shard at the wrong offset. The CPU
/// engine's captures, written as two ranks would (q split by heads, ffn_out
/// as partial sums) and read back as a protocol engine's run file, give the
/// engine's own tensors; rank 1's q one head early is refused, naming the
/// rank and the stage.
mod shards {
    use crate::engine::cpu::CpuEngine;
    use crate::engine::names::NameMap;
    use crate::engine::output::read_run;
    use crate::engine::{Engine, RunRequest, TapSet};
    use crate::stage::{BlockStage, Stage, Step};
    use crate::tensor::io::{read_safetensors, write_safetensors};
    use crate::tensor::Tensor;
    use std::collections::BTreeMap;
    use std::path::Path;

    /// `t` `[T, H, D]` split into heads `[h0, h1)`.
    fn heads(t: &Tensor, h0: usize, h1: usize) -> Tensor {
        let (rows, h, d) = (t.shape()[0], t.shape()[1], t.shape()[2]);
        let data = (0..rows)
            .flat_map(|r| t.data()[(r * h + h0) * d..(r * h + h1) * d].iter().copied())
            .collect();
        Tensor::new(vec![rows, h1 - h0, d], data)
    }

    #[test]
    fn two_ranks_join_into_the_engines_tensors_and_a_rank_at_the_wrong_offset_is_named() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR"));
        let eng = CpuEngine::load(&root.join("goldens/qwen2-tiny/model")).unwrap();
        let cfg = eng.config().clone();
        let (q, out) = (Stage::Block(0, BlockStage::Q), Stage::Block(0, BlockStage::FfnOut));
        let req = RunRequest::greedy(vec![5, 9, 14, 3], 1, 0);
        let run = eng.run(&req, &[q, out].into_iter().collect::<TapSet>()).unwrap();
        let half = cfg.heads / 2;
        let write = |skew: usize| {
            let mut floats = BTreeMap::new();
            for step in [Step::Prefill, Step::Decode(1)] {
                let tq = run.captures.get(step, q).unwrap();
                floats.insert(format!("{step}/{q}@rank0:axis=1:offset=0"), heads(tq, 0, half));
                let at = half - skew;
                floats.insert(
                    format!("{step}/{q}@rank1:axis=1:offset={at}"),
                    heads(tq, half, cfg.heads),
                );
                // A partial sum: the output split as 0.25 + 0.75 of itself.
                let to = run.captures.get(step, out).unwrap();
                let part = |f: f32| Tensor::new(to.shape().to_vec(), to.data().iter().map(|x| x * f).collect());
                floats.insert(format!("{step}/{out}@rank0:partial"), part(0.25));
                floats.insert(format!("{step}/{out}@rank1:partial"), part(0.75));
            }
            let ints = [(
                "tokens".to_string(),
                (vec![2], run.sampled.iter().map(|&x| x as i64).collect()),
            )]
            .into_iter()
            .collect();
            let d = tempfile::tempdir().unwrap();
            let p = d.path().join("ranks.safetensors");
            write_safetensors(&p, &floats, &ints, &BTreeMap::new()).unwrap();
            let file = read_safetensors(&p).unwrap();
            read_run(&file, &NameMap::default(), &cfg, &req, "ranks")
        };
        let joined = write(0).unwrap().output;
        for step in [Step::Prefill, Step::Decode(1)] {
            assert_eq!(
                joined.captures.get(step, q),
                run.captures.get(step, q),
                "{step}: q shards joined"
            );
            let (j, r) = (
                joined.captures.get(step, out).unwrap(),
                run.captures.get(step, out).unwrap(),
            );
            let worst = j
                .data()
                .iter()
                .zip(r.data())
                .map(|(a, b)| (a - b).abs() / b.abs().max(1.0))
                .fold(0.0, f32::max);
            assert!(
                worst <= 2.0 * f32::EPSILON,
                "{step}: partial sums add back to ffn_out ({worst:e})"
            );
        }
        let e = match write(1) {
            Ok(_) => panic!("rank 1's shard one head early was joined"),
            Err(e) => e.to_string(),
        };
        assert!(
            e.contains("/blk.0.q: rank 1's shard covers 1..3 of axis 1") && e.contains("overlaps rank 0's 0..2"),
            "{e}"
        );
        println!("a rank's shard one head early: {e}");
    }
}
