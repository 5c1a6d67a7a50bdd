//! The planted bugs of the CPU engine (`engine::cpu::mutants`) run through
//! whole plans: each must be caught by the shipped specs and localised to its
//! stage, or its run check. They live beside the runner because they prove
//! the checks and the triage, with the engine as the instrument.

/// The planted-bug self-test: each mutant runs against the shipped specs and
/// must be caught, and localised to its stage (or its run check): the run's
/// earliest failure in execution order — stage failures by (step, stage),
/// then run checks — must be where the bug is.
mod self_test {
    use crate::checks::Status;
    use crate::engine::cpu::mutants::Mutant;
    use crate::engine::cpu::CpuEngine;
    use crate::engine::Engine;
    use crate::plan::Plan;
    use crate::report::SuiteRun;
    use crate::runner::{run_on, Filter};
    use crate::spec::Spec;
    use crate::tensor::DType;
    use std::path::Path;

    /// The storages every mutant must be caught at: an engine's bug shows
    /// through 16-bit rounding too, or the allowances hide it.
    const STORAGES: [DType; 3] = [DType::F32, DType::F16, DType::BF16];

    fn run(spec: &str, m: Option<Mutant>, storage: DType) -> SuiteRun {
        let root = Path::new(env!("CARGO_MANIFEST_DIR"));
        let spec = Spec::load(&root.join("specs").join(spec)).unwrap();
        let mut plan = Plan::build(spec, None).unwrap();
        plan.load_options.storage = storage;
        let eng = CpuEngine::load_with(&plan.model, &plan.load_options).unwrap();
        let eng = match m {
            Some(m) => eng.mutated(m),
            None => eng,
        };
        run_on(&plan, &eng as &dyn Engine, &Filter::default(), &|id| id.to_string())
    }

    /// `<step>/<stage>` (or `run::<check>`) of the run's earliest failure,
    /// with the check that failed there.
    fn earliest_failure(r: &SuiteRun) -> Option<(String, String)> {
        let failed = || r.outcomes.iter().filter(|o| o.status == Status::Fail);
        if let Some(o) = failed().filter(|o| o.at.is_some()).min_by_key(|o| o.at) {
            let (step, stage) = o.at.unwrap();
            return Some((format!("{step}/{stage}"), o.check.clone()));
        }
        failed().next().map(|o| (format!("run::{}", o.check), o.check.clone()))
    }

    /// Where each mutant must be caught: (spec, expected earliest failure).
    /// A bug that is no bug for a model (theta 10000 on a theta-10000 model)
    /// is checked on the spec whose model it changes.
    fn expectations(m: Mutant) -> (&'static str, &'static str) {
        use Mutant::*;
        match m {
            SoftmaxUnnormalised => ("qwen2-tiny.yaml", "prefill/blk.0.attn_probs"),
            // The extra visible key shows in the scores first (0 in the golden).
            CausalOffByOne => ("qwen2-tiny.yaml", "prefill/blk.0.attn_scores"),
            RopeThetaWrong => ("llama-tiny.yaml", "prefill/blk.0.q_rope"),
            RopePositionFrozenInDecode => ("qwen2-tiny.yaml", "decode1/blk.0.q_rope"),
            RopeTableWrapping => ("qwen2-tiny-long.yaml", "prefill/blk.0.q_rope"),
            KvWrittenOneSlotOff => ("qwen2-tiny.yaml", "decode1/blk.0.attn_scores"),
            // The long spec records attn_out, not attn_probs (size): the first
            // recorded stage the short read changes.
            KvReadShort => ("qwen2-tiny-long.yaml", "prefill/blk.0.attn_out"),
            GqaModulo => ("qwen2-tiny.yaml", "prefill/blk.0.attn_scores"),
            AttnScaleOverD => ("qwen2-tiny.yaml", "prefill/blk.0.attn_scores"),
            RmsEpsWrong => ("qwen2-tiny.yaml", "prefill/blk.0.attn_norm"),
            RmsLengthWrong => ("qwen2-tiny.yaml", "prefill/blk.0.attn_norm"),
            RmsWeightMissing => ("qwen2-tiny.yaml", "prefill/blk.0.attn_norm"),
            QkvBiasDropped => ("qwen2-tiny.yaml", "prefill/blk.0.q"),
            SiluOnUp => ("qwen2-tiny.yaml", "prefill/blk.0.ffn_act"),
            ResidualMissing => ("qwen2-tiny.yaml", "prefill/blk.0.ffn_inp"),
            LmHeadTiedWhenUntied => ("qwen2-tiny.yaml", "prefill/logits"),
            SeedIgnored => ("qwen2-tiny.yaml", "run::determinism"),
            TemperatureMisapplied => ("qwen2-tiny-sampling.yaml", "prefill/sample_probs"),
            // phi3-tiny's LM head rows are equal in pairs: every greedy pick is an
            // exact tie, and HF took the lower index each time.
            ArgmaxTieLast => ("phi3-tiny.yaml", "run::greedy_tokens:hf"),
            OProjHeadShareOff => ("qwen2-tiny.yaml", "prefill/blk.0.attn_out"),
            SkipQkNorm => ("qwen3-tiny.yaml", "prefill/blk.0.q_norm"),
            EmbedNotScaled => ("gemma3-tiny.yaml", "prefill/embed"),
            LocalRopeGlobalBase => ("gemma3-tiny.yaml", "prefill/blk.0.q_rope"),
            NormWithoutPlusOne => ("gemma3-tiny.yaml", "prefill/blk.0.attn_norm"),
            // Every stage check judges the tapped path: the run check that
            // compares it with a logits-only run is the one that can see it.
            UntappedAttnScale => ("qwen2-tiny.yaml", "run::tap_invariance"),
            // Too few merger rows for the grid: the merger's shape, and the
            // image-token count, fail at the merger.
            MergeSizeOff => ("qwen2-vl-tiny.yaml", "prefill/vision.merger"),
            FusionOneRowEarly => ("qwen2-vl-tiny.yaml", "prefill/inputs_embeds"),
            MropeOneD => ("qwen2-vl-tiny.yaml", "prefill/positions"),
            VisionAttnCausal => ("qwen2-vl-tiny.yaml", "prefill/vision.blk.0.attn_probs"),
            // Qwen3-VL's language model rotates with base 1e6, its tower 1e4.
            VisionRopeTextTheta => ("qwen3-vl-tiny.yaml", "prefill/vision.blk.0.q_rope"),
            // LLaVA (issue 39): the feature layer's and CLS's bugs first show
            // in the projector's input; a miscount or misplacement of the
            // image-token rows at the merger (its shape, image_tokens, packing).
            LlavaFeatureLastLayer => ("llava-tiny.yaml", "prefill/vision.features"),
            LlavaClsKept => ("llava-tiny.yaml", "prefill/vision.features"),
            LlavaPreNormSkipped => ("llava-tiny.yaml", "prefill/vision.pre_norm"),
            LlavaTowerErfGelu => ("llava-tiny.yaml", "prefill/vision.blk.0.mlp_act"),
            LlavaImageTokenShort => ("llava-tiny.yaml", "prefill/vision.merger"),
            NextNewlineMissing => ("llava-next-tiny.yaml", "prefill/vision.merger"),
            NextUnpadRoundedOther => ("llava-next-tiny.yaml", "prefill/vision.merger"),
            // Long context (issue 37): each on the tiny model of its scaling,
            // where the prompt's prefill (30 tokens) stays within the
            // original 32 positions and the decode steps pass them.
            // HF takes LongRoPE's short factors for a 30-token pass; the
            // allocated context (128) picks the long ones.
            LongropeByContext => ("longrope-tiny.yaml", "prefill/blk.0.q_rope"),
            YarnNoAttentionFactor => ("yarn-tiny.yaml", "prefill/blk.0.q_rope"),
            YarnTruncatedAnyway => ("yarn-tiny.yaml", "prefill/blk.0.q_rope"),
            Llama3BandOffByOne => ("llama3-tiny.yaml", "prefill/blk.0.q_rope"),
            // Layer 1 is the sliding one: one more key is scored where the
            // golden has 0.
            WindowOneTooWide => ("swa-tiny.yaml", "prefill/blk.1.attn_scores"),
            DynamicFromZero => ("dynamic-tiny.yaml", "prefill/blk.0.q_rope"),
            // Routing (issue 38): each on the family whose routing it changes.
            // Without renormalisation (Qwen2-MoE) a softmax over the k weighs
            // otherwise than the softmax over all experts.
            SoftmaxOverTopkOnly => ("qwen2-moe-tiny.yaml", "prefill/blk.0.ffn_moe_weights"),
            TopkNotRenormalised => ("qwen3-moe-tiny.yaml", "prefill/blk.0.ffn_moe_weights"),
            SharedGateNoSigmoid => ("qwen2-moe-tiny.yaml", "prefill/blk.0.ffn_shexp_out"),
            // mixtral-tiny's experts 0 and 1 have equal router rows: every
            // token scores them equally.
            RouteTieToHigherId => ("mixtral-tiny.yaml", "prefill/blk.0.ffn_moe_topk"),
            ExpertIdOffByOne => ("mixtral-tiny.yaml", "prefill/blk.0.ffn_moe_out"),
            // DeepSeek-V3's layer 0 is dense (first_k_dense_replace 1).
            BiasInWeights => ("deepseek-v3-tiny.yaml", "prefill/blk.1.ffn_moe_weights"),
            GroupMaskIgnored => ("deepseek-v3-tiny.yaml", "prefill/blk.1.ffn_moe_topk"),
            RoutedScalingMissing => ("deepseek-v3-tiny.yaml", "prefill/blk.1.ffn_moe_weights"),
            MlaRopeWrongPart => ("deepseek-v3-tiny.yaml", "prefill/blk.0.q_rope"),
            // Without its sink a row's probabilities grow: the first stage.
            SinksIgnored => ("gpt-oss-tiny.yaml", "prefill/blk.0.attn_probs"),
            // The serving bugs have their own self-test (`serving` below).
            SoftmaxOverPaddedLength
            | DecodeReadsNeighbourKv
            | ChunkRopeOffsetDropped
            | PrefixHitOneShort
            | ReadsOneSlotPast
            | CacheNotCleared
            | BufferLeakedPerRequest => {
                unreachable!("{m:?} is scored by the serving self-test")
            }
        }
    }

    /// Mutants the shipped specs cannot catch yet, each with what it needs.
    /// The self-test requires exactly these to be missed: when coverage lands
    /// the list must shrink (and the issue it belongs to can close), and a
    /// newly missed mutant fails the test.
    const NOT_YET_COVERED: [(Mutant, &str); 0] = [];

    /// Mutants the 16-bit runs do not localise, each with why: the test
    /// requires exactly these to be missed or caught elsewhere, so the list
    /// must shrink when detection power at 16 bits improves. Each is below
    /// the storage's resolution at its stage, and
    /// `the_16_bit_gaps_are_within_the_own_rounding_floor` measures that:
    /// the change the mutant makes at its stage is within c·(u_store +
    /// u_weight)·M (c = 2: 4u·M), what a correct engine's own roundings at a
    /// stage that reads stored weights may reach, so no check can tell it
    /// from rounding there.
    fn not_localised_at(storage: DType) -> &'static [(Mutant, &'static str)] {
        use Mutant::*;
        match storage {
            DType::F16 => &[
                (
                    RmsEpsWrong,
                    "eps 1e-6 -> 1e-5 moves attn_norm by 1.2 u·M (at most 1 f16 ulp per element)",
                ),
                (
                    OProjHeadShareOff,
                    "1e-3 on one head's share of attn_out moves it by 0.84 u·M",
                ),
            ],
            DType::BF16 => &[
                (
                    RmsEpsWrong,
                    "eps 1e-6 -> 1e-5 moves attn_norm by 0.6 u·M (at most 1 bf16 ulp per element)",
                ),
                (
                    RmsLengthWrong,
                    "a mean over n - 1 scales attn_norm by 1 - 7.8e-3: 2.4 u·M, at most 2 bf16 ulps per element",
                ),
                (
                    OProjHeadShareOff,
                    "1e-3 on one head's share of attn_out moves it by 0.84 u·M, a quarter of one bf16 rounding",
                ),
            ],
            _ => &[],
        }
    }

    /// The long-context bugs are caught without any golden too: the `rope`
    /// check's formula (the config's scaling at the pass's length) at the
    /// first q_rope they change, naming the position, and `causal` on the
    /// sliding layer for the wide window.
    #[test]
    fn long_context_bugs_fail_their_golden_free_check() {
        use Mutant::*;
        for (m, spec, id, says) in [
            (LongropeByContext, "longrope-tiny.yaml", "prefill/blk.0.q_rope::rope", "seq_len 30 (<= 32"),
            (YarnNoAttentionFactor, "yarn-tiny.yaml", "prefill/blk.0.q_rope::rope", "attention factor"),
            (YarnTruncatedAnyway, "yarn-tiny.yaml", "prefill/blk.0.q_rope::rope", "wrong rotation angle"),
            (Llama3BandOffByOne, "llama3-tiny.yaml", "prefill/blk.0.q_rope::rope", "wrong rotation angle"),
            (DynamicFromZero, "dynamic-tiny.yaml", "prefill/blk.0.q_rope::rope", "seq_len 30 (<= 32"),
            (WindowOneTooWide, "swa-tiny.yaml", "prefill/blk.1.attn_probs::causal", "one position too wide"),
        ] {
            let r = run(spec, Some(m), DType::F32);
            let o = r
                .outcomes
                .iter()
                .find(|o| o.id == id)
                .unwrap_or_else(|| panic!("{m:?}: no outcome {id} on {spec}"));
            assert_eq!(o.status, Status::Fail, "{m:?}: {id} on {spec} must fail: {}", o.message);
            assert!(o.message.contains(says), "{m:?}: {id}: {}", o.message);
            // And the correct engine passes the same check.
            let clean = run(spec, None, DType::F32);
            let c = clean.outcomes.iter().find(|o| o.id == id).expect("planned");
            assert_eq!(c.status, Status::Pass, "{spec}: {id}: {}", c.message);
        }
    }

    /// The MoE families' bugs fail their golden-free check at the stage
    /// they break, at f32 and at bf16 (where a correct engine's near-ties
    /// are told, not failed): `routing` at the weights, `experts` at the
    /// sums, `softmax_rows` where gpt-oss's sinks are left out.
    #[test]
    fn moe_bugs_fail_their_golden_free_check() {
        use Mutant::*;
        for (m, spec, id, says) in [
            (SoftmaxOverTopkOnly, "qwen2-moe-tiny.yaml", "prefill/blk.0.ffn_moe_weights::routing", "unbiased scores"),
            (TopkNotRenormalised, "qwen3-moe-tiny.yaml", "prefill/blk.0.ffn_moe_weights::routing", "divided by their sum"),
            (SharedGateNoSigmoid, "qwen2-moe-tiny.yaml", "prefill/blk.0.ffn_shexp_out::experts", "σ(its gate)"),
            (ExpertIdOffByOne, "mixtral-tiny.yaml", "prefill/blk.0.ffn_moe_out::experts", "chosen experts"),
            (BiasInWeights, "deepseek-v3-tiny.yaml", "prefill/blk.1.ffn_moe_weights::routing", "unbiased scores"),
            (GroupMaskIgnored, "deepseek-v3-tiny.yaml", "prefill/blk.1.ffn_moe_topk::routing", "topk_group"),
            (RoutedScalingMissing, "deepseek-v3-tiny.yaml", "prefill/blk.1.ffn_moe_weights::routing", "routed_scaling_factor 2.5"),
            (RouteTieToHigherId, "mixtral-tiny.yaml", "prefill/blk.0.ffn_moe_topk::routing", "ties go to the lower expert id"),
            (SinksIgnored, "gpt-oss-tiny.yaml", "prefill/blk.0.attn_probs::softmax_rows", "is the sink logit in the softmax"),
        ] {
            for storage in [DType::F32, DType::BF16] {
                let r = run(spec, Some(m), storage);
                let o = r
                    .outcomes
                    .iter()
                    .find(|o| o.id == id)
                    .unwrap_or_else(|| panic!("{m:?}: no outcome {id} on {spec}"));
                assert_eq!(o.status, Status::Fail, "{m:?} at {storage}: {id} on {spec} must fail: {}", o.message);
                assert!(o.message.contains(says), "{m:?}: {id}: {}", o.message);
                let clean = run(spec, None, storage);
                let c = clean.outcomes.iter().find(|o| o.id == id).expect("planned");
                assert_eq!(c.status, Status::Pass, "{spec} at {storage}: {id}: {}", c.message);
            }
        }
    }

    #[test]
    fn every_mutant_is_caught_and_localised_at_f32() {
        caught_and_localised(DType::F32);
    }

    #[test]
    fn every_mutant_is_caught_and_localised_at_f16() {
        caught_and_localised(DType::F16);
    }

    #[test]
    fn every_mutant_is_caught_and_localised_at_bf16() {
        caught_and_localised(DType::BF16);
    }

    fn caught_and_localised(storage: DType) {
        let mut rows = Vec::new();
        let mut missed = Vec::new();
        let mut gaps = Vec::new();
        for m in Mutant::ALL {
            if let Some((_, why)) = NOT_YET_COVERED.iter().find(|(n, _)| *n == m) {
                let (spec, _) = expectations(m);
                if Path::new(env!("CARGO_MANIFEST_DIR")).join("specs").join(spec).exists() {
                    // It must really be missed where it is expected to be caught.
                    if let Some((at, check)) = earliest_failure(&run(spec, Some(m), storage)) {
                        missed.push(format!(
                            "{m:?} is listed as not covered but is caught at {at} ({check})"
                        ));
                    }
                }
                rows.push(format!(
                    "{:<28} {:<22} {:<28} NOT COVERED YET: needs {why}",
                    format!("{m:?}"),
                    spec,
                    "-"
                ));
                gaps.push(m);
                continue;
            }
            if let Some((_, why)) = not_localised_at(storage).iter().find(|(n, _)| *n == m) {
                let (spec, want) = expectations(m);
                let got = earliest_failure(&run(spec, Some(m), storage));
                if got.as_ref().is_some_and(|(at, _)| at == want) {
                    missed.push(format!(
                        "{m:?} is listed as not localised at {storage} but is, at {want}: shorten the list"
                    ));
                }
                let shown = got.map_or("not caught".into(), |(at, check)| format!("{at} ({check})"));
                rows.push(format!(
                    "{:<28} {:<22} {:<28} NOT LOCALISED at {storage} ({shown}): {why}",
                    format!("{m:?}"),
                    spec,
                    want
                ));
                gaps.push(m);
                continue;
            }
            let (spec, want) = expectations(m);
            if !Path::new(env!("CARGO_MANIFEST_DIR")).join("specs").join(spec).exists() {
                missed.push(format!("{m:?}: spec {spec} does not exist"));
                continue;
            }
            let got = earliest_failure(&run(spec, Some(m), storage));
            let ok = got.as_ref().is_some_and(|(at, _)| at == want);
            let shown = got
                .map(|(at, check)| format!("{at} ({check})"))
                .unwrap_or_else(|| "NOT CAUGHT".into());
            rows.push(format!("{:<28} {:<22} {:<28} {shown}", format!("{m:?}"), spec, want));
            if !ok {
                missed.push(format!("{m:?} on {spec}: expected {want}, got {shown}"));
            }
        }
        let caught = Mutant::ALL.len() - missed.len() - gaps.len();
        println!("storage {storage}");
        println!("{:<28} {:<22} {:<28} earliest failure", "mutant", "spec", "expected");
        for r in &rows {
            println!("{r}");
        }
        println!(
            "score at {storage}: {caught}/{} mutants caught and localised ({} not covered or not localised)",
            Mutant::ALL.len(),
            gaps.len()
        );
        assert!(
            missed.is_empty(),
            "at {storage}, not caught or not localised:\n{}",
            missed.join("\n")
        );
    }

    /// The change a mutant makes at `at` (`<step>/<stage>`) on `spec`'s
    /// prompt at `storage`, as max|mutated − correct| / (u·M), M the correct
    /// engine's max|y| there.
    fn change_in_roundings(spec: &str, m: Mutant, storage: DType, at: &str) -> f64 {
        use crate::engine::{RunRequest, TapSet};
        let root = Path::new(env!("CARGO_MANIFEST_DIR"));
        let plan = Plan::build(Spec::load(&root.join("specs").join(spec)).unwrap(), None).unwrap();
        let mut opts = plan.load_options.clone();
        opts.storage = storage;
        let eng = CpuEngine::load_with(&plan.model, &opts).unwrap();
        let req = RunRequest {
            prompt: plan.prompt.clone(),
            decode_steps: plan.decode_steps,
            sampling: plan.sampling(),
            seed: plan.spec.seed,
            forced: plan.forced.clone(),
            image: None,
        };
        let (step, stage) = crate::stage::parse_key(at).unwrap();
        let taps: TapSet = [stage].into_iter().collect();
        let a = eng.run(&req, &taps).unwrap();
        let b = eng.mutated(m).run(&req, &taps).unwrap();
        let (ya, yb) = (
            a.captures.get(step, stage).unwrap(),
            b.captures.get(step, stage).unwrap(),
        );
        let big = ya.data().iter().fold(0f64, |mx, x| mx.max(x.abs() as f64));
        let d = ya
            .data()
            .iter()
            .zip(yb.data())
            .fold(0f64, |mx, (x, y)| mx.max((x - y).abs() as f64));
        d / (storage.unit_roundoff() * big)
    }

    #[test]
    fn the_16_bit_gaps_are_within_the_own_rounding_floor() {
        // c·(u_store + u_weight)·M with c = 2 and u_weight = u_store.
        const FLOOR: f64 = 4.0;
        let mut rows = Vec::new();
        for storage in [DType::F16, DType::BF16] {
            for (m, _) in not_localised_at(storage) {
                let (spec, at) = expectations(*m);
                let k = change_in_roundings(spec, *m, storage, at);
                rows.push(format!("{storage:<5} {:<20} {at:<26} {k:.2} u·M", format!("{m:?}")));
                assert!(
                    k <= FLOOR,
                    "{m:?} at {storage} changes {at} by {k:.2} u·M, more than a correct engine's own rounding \
                     (≤ {FLOOR} u·M): it is detectable, and must be caught and localised"
                );
            }
            // And a localised one for contrast: what a caught bug moves.
            if storage == DType::F16 {
                let k = change_in_roundings(
                    "qwen2-tiny.yaml",
                    Mutant::RmsLengthWrong,
                    storage,
                    "prefill/blk.0.attn_norm",
                );
                rows.push(format!(
                    "{storage:<5} {:<20} {:<26} {k:.2} u·M (caught)",
                    "RmsLengthWrong", "prefill/blk.0.attn_norm"
                ));
                assert!(k > FLOOR);
            }
        }
        println!("{}", rows.join("\n"));
    }

    #[test]
    fn the_unmutated_engine_passes_the_specs_the_self_test_uses() {
        for (storage, spec) in STORAGES.into_iter().flat_map(|d| {
            [
                "qwen2-tiny.yaml",
                "llama-tiny.yaml",
                "qwen2-tiny-long.yaml",
                "qwen2-tiny-sampling.yaml",
                "phi3-tiny.yaml",
                "qwen3-tiny.yaml",
            ]
            .map(move |s| (d, s))
        }) {
            let mut r = run(spec, None, storage);
            if storage != DType::F32 {
                // Greedy picks at 16 bits flip the tiny models' near-ties
                // (qwen2-tiny at bf16: token 2 is 24, HF's f32 pick 422);
                // telling a near-tie from a wrong pick by the arithmetic's
                // margin is issue 21's, so greedy_tokens is left out here.
                r.outcomes.retain(|o| !o.check.starts_with("greedy_tokens"));
            }
            assert!(
                earliest_failure(&r).is_none(),
                "{spec} at {storage}: {:?}",
                earliest_failure(&r)
            );
        }
    }
}

/// The new families' own planted bugs (issue: real models): a Qwen3 engine
/// without its q/k norms, a Phi-3 loader splitting q and k the wrong way round.
mod families {
    use crate::checks::Status;
    use crate::engine::cpu::mutants::Mutant;
    use crate::engine::cpu::CpuEngine;
    use crate::engine::Engine;
    use crate::model::LoaderBug;
    use crate::plan::Plan;
    use crate::runner::{run_on, Filter};
    use crate::spec::Spec;
    use std::path::Path;

    fn first_divergence(spec: &str, bug: Option<LoaderBug>, m: Option<Mutant>) -> (Option<String>, Vec<String>) {
        let root = Path::new(env!("CARGO_MANIFEST_DIR"));
        let mut plan = Plan::build(Spec::load(&root.join("specs").join(spec)).unwrap(), None).unwrap();
        plan.load_options.plant = bug;
        let mut eng = CpuEngine::load_with(&plan.model, &plan.load_options).unwrap();
        if let Some(m) = m {
            eng = eng.mutated(m);
        }
        let r = run_on(&plan, &eng as &dyn Engine, &Filter::default(), &|id| id.to_string());
        let failed_run_checks = r
            .outcomes
            .iter()
            .filter(|o| o.at.is_none() && o.status == Status::Fail)
            .map(|o| o.check.clone())
            .collect();
        (
            r.first_divergence.map(|d| format!("{}/{}", d.step, d.stage)),
            failed_run_checks,
        )
    }

    #[test]
    fn the_new_families_pass_as_loaded() {
        for spec in ["qwen3-tiny.yaml", "phi3-tiny.yaml"] {
            let (fd, runs) = first_divergence(spec, None, None);
            assert_eq!((fd, runs), (None, vec![]), "{spec}");
        }
    }

    #[test]
    fn qwen3_without_qk_norm_diverges_at_q_norm() {
        let (fd, _) = first_divergence("qwen3-tiny.yaml", None, Some(Mutant::SkipQkNorm));
        assert_eq!(fd.as_deref(), Some("prefill/blk.0.q_norm"));
    }

    #[test]
    fn phi3_split_with_q_and_k_swapped_diverges_at_q_and_fails_the_weights_check() {
        let (fd, runs) = first_divergence("phi3-tiny.yaml", Some(LoaderBug::SplitKFirst), None);
        assert_eq!(fd.as_deref(), Some("prefill/blk.0.q"));
        assert!(runs.contains(&"weights".to_string()), "{runs:?}");
    }

    /// Each VLM invariant fails on its planted bug without any golden: the
    /// checks judge the engine's own captures (and pass on the correct engine).
    #[test]
    fn each_vlm_invariant_fails_on_its_planted_bug() {
        use crate::checks::Status;
        use crate::engine::cpu::CpuEngine;
        use crate::runner::{run_on, Filter};
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
        let plan = Plan::build(Spec::load(&root.join("specs/qwen2-vl-tiny.yaml")).unwrap(), None).unwrap();
        let status = |m: Option<Mutant>, id: &str| {
            let eng = CpuEngine::load(&plan.model).unwrap();
            let eng = match m {
                Some(m) => eng.mutated(m),
                None => eng,
            };
            let r = run_on(&plan, &eng, &Filter::default(), &|id| id.to_string());
            let o = r
                .outcomes
                .iter()
                .find(|o| o.id == id)
                .unwrap_or_else(|| panic!("no check {id}"));
            (o.status, o.message.clone())
        };
        for (m, id) in [
            (Mutant::MergeSizeOff, "prefill/vision.merger::image_tokens"),
            (Mutant::FusionOneRowEarly, "prefill/inputs_embeds::fusion"),
            (Mutant::MropeOneD, "prefill/positions::mrope"),
            (
                Mutant::VisionAttnCausal,
                "prefill/vision.blk.0.attn_probs::bidirectional",
            ),
            // qwen2-vl-tiny's language model rotates with base 1e6, its tower 1e4.
            (Mutant::VisionRopeTextTheta, "prefill/vision.blk.0.q_rope::rope"),
            (Mutant::MropeOneD, "prefill/blk.0.q_rope::rope"),
        ] {
            let (ok, _) = status(None, id);
            assert_eq!(ok, Status::Pass, "{id} on the correct engine");
            let (bad, msg) = status(Some(m), id);
            assert_eq!(bad, Status::Fail, "{m:?} must fail {id}: {msg}");
            println!("{m:?}: {id}: {msg}");
        }
    }
}
