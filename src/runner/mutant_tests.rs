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
        }
    }

    /// Mutants the shipped specs cannot catch yet, each with what it needs.
    /// The self-test requires exactly these to be missed: when coverage lands
    /// the list must shrink (and the issue it belongs to can close), and a
    /// newly missed mutant fails the test.
    const NOT_YET_COVERED: [(Mutant, &str); 0] = [];

    /// Mutants the 16-bit runs do not localise, each with why: the test
    /// requires exactly these to be missed or caught elsewhere, so the list
    /// must shrink when detection power at 16 bits improves (issue 20 stays
    /// open on them). The allowance at a 16-bit stage is at least
    /// factor·c·(u_store + u_weight)·M = 4·2·2u·M (f16 u = 4.9e-4: 7.8e-3·M;
    /// bf16 u = 3.9e-3: 6.3e-2·M); a bug smaller than that is rounding to
    /// these floors.
    fn not_localised_at(storage: DType) -> &'static [(Mutant, &'static str)] {
        use Mutant::*;
        const NO_ORACLE: &str = "its spec (qwen2-tiny-sampling) has no oracle and an f32-only tolerance table: \
                                 nothing there judges a 16-bit engine (no floors without an oracle)";
        match storage {
            DType::F16 => &[
                (
                    RmsEpsWrong,
                    "eps 1e-6 -> 1e-5 moves attn_norm by less than the f16 allowance there",
                ),
                (
                    OProjHeadShareOff,
                    "1e-3 on one head's share of attn_out is 2 f16 roundings, under the f16 allowance",
                ),
                (TemperatureMisapplied, NO_ORACLE),
            ],
            DType::BF16 => &[
                (
                    RmsEpsWrong,
                    "eps 1e-6 -> 1e-5 moves attn_norm by less than the bf16 allowance there",
                ),
                (
                    RmsLengthWrong,
                    "7.8e-3 is 2 bf16 roundings: caught only downstream (greedy tokens)",
                ),
                (
                    QkvBiasDropped,
                    "the tiny model's q bias is small against q: under the bf16 allowance at the prefill, \
                     caught at decode2/blk.0.q",
                ),
                (
                    OProjHeadShareOff,
                    "1e-3 on one head's share of attn_out is a quarter of one bf16 rounding",
                ),
                (TemperatureMisapplied, NO_ORACLE),
            ],
            _ => &[],
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
            // Without an oracle a spec has no floors: its tolerance table
            // says which storages it judges (qwen2-tiny-sampling: f32 only).
            if storage != DType::F32 && spec == "qwen2-tiny-sampling.yaml" {
                continue;
            }
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
}

#[cfg(test)]
mod probe {
    use crate::engine::cpu::mutants::Mutant;
    use crate::engine::cpu::CpuEngine;
    use crate::engine::{Engine, RunRequest, TapSet};
    use crate::plan::Plan;
    use crate::spec::Spec;
    use crate::stage::{Stage, Step, BlockStage};
    use crate::tensor::DType;
    use std::path::Path;

    #[test]
    fn probe_gap_sizes() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR"));
        let plan = Plan::build(Spec::load(&root.join("specs/qwen2-tiny.yaml")).unwrap(), None).unwrap();
        for (m, stage) in [(Mutant::RmsEpsWrong, Stage::Block(0, BlockStage::AttnNorm)), (Mutant::RmsLengthWrong, Stage::Block(0, BlockStage::AttnNorm)), (Mutant::QkvBiasDropped, Stage::Block(0, BlockStage::Q)), (Mutant::OProjHeadShareOff, Stage::Block(0, BlockStage::AttnOut))] {
            for d in [DType::F32, DType::F16, DType::BF16] {
                let mut o = plan.load_options.clone();
                o.storage = d;
                let e = CpuEngine::load_with(&plan.model, &o).unwrap();
                let req = RunRequest { prompt: plan.prompt.clone(), decode_steps: plan.decode_steps, sampling: plan.sampling(), seed: 0, forced: plan.forced.clone() };
                let a = e.run(&req, &TapSet::all(plan.config.layers)).unwrap();
                let b = e.mutated(m).run(&req, &TapSet::all(plan.config.layers)).unwrap();
                let (ya, yb) = (a.captures.get(Step::Prefill, stage).unwrap(), b.captures.get(Step::Prefill, stage).unwrap());
                let eps = 2.0 * d.unit_roundoff();
                let (mut mx, mut sum, mut changed, mut rel) = (0f64, 0f64, 0usize, 0f64);
                for (&x, &y) in ya.data().iter().zip(yb.data()) {
                    let ulp = (2f64.powi((x.abs() as f64).log2().floor() as i32) * eps).max(2.0 * d.subnormal_error());
                    let k = (y as f64 - x as f64).abs() / ulp;
                    mx = mx.max(k); sum += k; if x != y { changed += 1; }
                    rel = rel.max((y as f64 - x as f64).abs() / (x.abs() as f64 + 1e-30));
                }
                let n = ya.numel();
                let big = ya.data().iter().fold(0f64, |m, x| m.max(x.abs() as f64));
                let dmax = ya.data().iter().zip(yb.data()).fold(0f64, |m, (x, y)| m.max((x - y).abs() as f64));
                let rms = (ya.data().iter().map(|x| (*x as f64).powi(2)).sum::<f64>() / n as f64).sqrt();
                println!("{m:?} {d}: max|Δ| {dmax:.2e} = {:.2} u·max|y| = {:.2} u·rms(y);", dmax / (d.unit_roundoff() * big), dmax / (d.unit_roundoff() * rms));
                println!("{m:?} {d}: max {mx:.2} ulp, mean {:.3} ulp, changed {changed}/{n}, max rel {rel:.2e}", sum / n as f64);
            }
        }
    }
}
