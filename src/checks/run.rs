//! Checks on whole runs rather than one stage: bitwise determinism with a fixed
//! seed (and a different seed must matter), incremental decode against a full
//! recompute (the KV cache), and greedy tokens against a golden source.

use crate::checks::Verdict;
use crate::compare::{compare, Tolerance};
use crate::engine::{Engine, RunOutput, RunRequest, TapSet};
use crate::plan::Plan;
use crate::runner::run_engine;
use crate::sampling::Sampling;
use crate::spec::{DeterminismSpec, KvCacheSpec, RunCheck};
use crate::stage::{Stage, Step};
use crate::tensor::Tensor;

pub fn evaluate(plan: &Plan, engine: &dyn Engine, check: &RunCheck) -> Verdict {
    if let (RunCheck::Determinism(_) | RunCheck::KvCache(_), Some(why)) = (check, engine.reruns()) {
        return Verdict::skip(format!("skipped: {why}"));
    }
    let result = match check {
        RunCheck::Determinism(d) => determinism(plan, engine, d),
        RunCheck::KvCache(k) => kv_cache(plan, engine, k),
        RunCheck::GreedyTokens { source } => match source {
            Some(s) => greedy_tokens(plan, engine, s),
            None => Err("greedy_tokens needs a golden source and the spec declares none".into()),
        },
        RunCheck::Weights => Ok(super::weights::check(&plan.model, plan.load_options.storage, engine)),
    };
    result.unwrap_or_else(|e| Verdict::fail(format!("the engine failed: {e}")))
}

fn determinism(plan: &Plan, engine: &dyn Engine, d: &DeterminismSpec) -> Result<Verdict, String> {
    let seed = d.seed.unwrap_or(plan.spec.seed);
    let other_seed = d.other_seed.unwrap_or(seed.wrapping_add(1));
    let req = |seed| RunRequest {
        prompt: plan.prompt.clone(),
        decode_steps: d.decode_steps,
        sampling: d.sampling.to_sampling(),
        seed,
        forced: None,
    };
    // Every stage the model has (no q_norm on a model without it), so any
    // engine can be asked for exactly what it computes.
    let taps: TapSet = crate::stage::Stage::of_model(
        &plan.config,
        d.sampling.to_sampling() != crate::sampling::Sampling::Greedy,
    )
    .into_iter()
    .collect();
    let first = run_engine(engine, &req(seed), &taps)?;
    for run in 2..=d.runs {
        let again = run_engine(engine, &req(seed), &taps)?;
        if again.sampled != first.sampled {
            return Ok(Verdict::fail(format!(
                "run {run} with seed {seed} sampled {:?}, run 1 sampled {:?}",
                again.sampled, first.sampled
            ))
            .metric("runs", d.runs as f64));
        }
        if let Some(diff) = first_bitwise_difference(&first, &again) {
            return Ok(Verdict::fail(format!(
                "run {run} with seed {seed} is not bitwise identical to run 1: {diff}"
            ))
            .metric("runs", d.runs as f64));
        }
    }
    let other = run_engine(engine, &req(other_seed), &TapSet::none())?;
    if other.sampled == first.sampled {
        return Ok(Verdict::fail(format!(
            "seed {other_seed} sampled the same {} tokens as seed {seed} ({:?}): the seed does not reach the sampler",
            first.sampled.len(),
            first.sampled
        )));
    }
    Ok(Verdict::pass(format!(
        "{} runs with seed {seed} bitwise identical ({} captures, tokens {:?}); seed {other_seed} sampled {:?}",
        d.runs,
        first.captures.len(),
        first.sampled,
        other.sampled
    ))
    .metric("runs", d.runs as f64)
    .metric("captures", first.captures.len() as f64))
}

fn first_bitwise_difference(a: &RunOutput, b: &RunOutput) -> Option<String> {
    for ((key, ta), (_, tb)) in a.captures.iter().zip(b.captures.iter()) {
        if ta.shape() != tb.shape() {
            return Some(format!(
                "{}/{} shape {:?} vs {:?}",
                key.0,
                key.1,
                ta.shape(),
                tb.shape()
            ));
        }
        let differing = ta
            .data()
            .iter()
            .zip(tb.data())
            .filter(|(x, y)| x.to_bits() != y.to_bits())
            .count();
        if let Some(i) = ta
            .data()
            .iter()
            .zip(tb.data())
            .position(|(x, y)| x.to_bits() != y.to_bits())
        {
            return Some(format!(
                "{}/{}: {differing} of {} values differ; first at {:?} ({:e} vs {:e})",
                key.0,
                key.1,
                ta.numel(),
                ta.unravel(i),
                ta.data()[i],
                tb.data()[i]
            ));
        }
    }
    (a.captures.len() != b.captures.len()).then(|| format!("{} vs {} captures", a.captures.len(), b.captures.len()))
}

fn kv_cache(plan: &Plan, engine: &dyn Engine, k: &KvCacheSpec) -> Result<Verdict, String> {
    let steps = k.decode_steps.unwrap_or(plan.decode_steps).max(1);
    let taps: TapSet = [Stage::Logits].into_iter().collect();
    let incremental = run_engine(
        engine,
        &RunRequest {
            prompt: plan.prompt.clone(),
            decode_steps: steps,
            sampling: Sampling::Greedy,
            seed: plan.spec.seed,
            forced: None,
        },
        &taps,
    )?;
    // The tokens decode steps were fed, then one prefill over all of them.
    let mut all = plan.prompt.clone();
    all.extend(&incremental.sampled[..steps]);
    let full = run_engine(
        engine,
        &RunRequest {
            prompt: all,
            decode_steps: 0,
            sampling: Sampling::Greedy,
            seed: plan.spec.seed,
            forced: None,
        },
        &taps,
    )?;
    let full_logits = full
        .captures
        .get(Step::Prefill, Stage::Logits)
        .ok_or("no logits from the full recompute")?;
    let v = plan.config.vocab;
    let p = plan.prompt.len();
    let tol = Tolerance {
        atol: k.atol,
        rtol: k.rtol,
    };
    let mut worst: Option<(f64, Step)> = None;
    for step in Step::sequence(steps) {
        let inc = incremental
            .captures
            .get(step, Stage::Logits)
            .ok_or_else(|| format!("no logits at {step}"))?;
        let (start, rows) = match step {
            Step::Prefill => (0, p),
            Step::Decode(n) => (p + n - 1, 1),
        };
        let reference = Tensor::new(
            vec![rows, v],
            full_logits.data()[start * v..(start + rows) * v].to_vec(),
        );
        let c = compare(inc, &reference, tol).map_err(|e| format!("{step}: {e}"))?;
        let max_abs = c.max_abs.as_ref().map_or(0.0, |m| m.0);
        if !c.passed() {
            return Ok(Verdict::fail(format!(
                "incremental decode differs from a full recompute over prompt + {steps} generated tokens at {step} (rows {start}..{}):\n{}",
                start + rows,
                c.explain()
            ))
            .metric("max_abs", max_abs));
        }
        if worst.is_none_or(|(w, _)| max_abs > w) {
            worst = Some((max_abs, step));
        }
    }
    let (w, at) = worst.expect("at least the prefill step");
    Ok(Verdict::pass(format!(
        "incremental logits over {steps} decode steps equal a full recompute within atol {} rtol {}; worst max|Δ| {w:.2e} at {at}",
        k.atol, k.rtol
    ))
    .metric("max_abs", w))
}

fn greedy_tokens(plan: &Plan, engine: &dyn Engine, source: &str) -> Result<Verdict, String> {
    let golden = &plan.goldens[source];
    let expected = golden.greedy_ids().map_err(|e| e.to_string())?;
    if golden.prompt() != plan.prompt.as_slice() {
        return Ok(Verdict::fail(format!(
            "the run's prompt {:?} is not the prompt golden `{source}` was recorded with {:?}",
            plan.prompt,
            golden.prompt()
        )));
    }
    let out = run_engine(
        engine,
        &RunRequest {
            prompt: plan.prompt.clone(),
            decode_steps: expected.len().saturating_sub(1),
            sampling: Sampling::Greedy,
            seed: plan.spec.seed,
            forced: None,
        },
        &TapSet::none(),
    )?;
    match out.sampled.iter().zip(&expected).position(|(a, b)| a != b) {
        Some(i) => Ok(Verdict::fail(format!(
            "greedy token {i} differs: engine {} vs golden `{source}` {} (engine {:?}, golden {:?})",
            out.sampled[i], expected[i], out.sampled, expected
        ))
        .metric("first_mismatch", i as f64)),
        None => Ok(Verdict::pass(format!(
            "{} greedy tokens equal golden `{source}`: {:?}",
            expected.len(),
            expected
        ))
        .metric("tokens", expected.len() as f64)),
    }
}

#[cfg(test)]
mod tests {
    //! Each run check passes on the CPU engine and FAILS on an engine with the
    //! fault it exists to catch, injected by a wrapper around the CPU engine.
    use std::path::Path;
    use std::sync::atomic::{AtomicU32, Ordering};

    use super::*;
    use crate::engine::cpu::CpuEngine;
    use crate::model::ModelConfig;
    use crate::spec::Spec;

    enum Fault {
        /// Each run perturbs one logit by a different amount (a race, an uninitialised buffer).
        NonDeterministic(AtomicU32),
        /// The seed never reaches the sampler.
        SeedIgnored,
        /// Decode steps read a stale KV cache: their logits are off.
        StaleCache,
        /// The engine picks a different token at decode step 2.
        WrongToken,
    }

    struct Faulty {
        inner: CpuEngine,
        fault: Fault,
    }

    impl Engine for Faulty {
        fn name(&self) -> &str {
            "faulty"
        }
        fn config(&self) -> &ModelConfig {
            self.inner.config()
        }
        fn run(&self, req: &RunRequest, taps: &TapSet) -> crate::Result<RunOutput> {
            let mut req = req.clone();
            if let Fault::SeedIgnored = self.fault {
                req.seed = 0;
            }
            let mut out = self.inner.run(&req, taps)?;
            match &self.fault {
                Fault::NonDeterministic(n) => {
                    let k = n.fetch_add(1, Ordering::SeqCst);
                    for ((_, stage), t) in out.captures.iter_mut() {
                        if *stage == Stage::Logits {
                            t.data_mut()[0] += k as f32 * 1e-6;
                        }
                    }
                }
                Fault::StaleCache => {
                    for ((step, _), t) in out.captures.iter_mut() {
                        if *step != Step::Prefill {
                            t.data_mut().iter_mut().for_each(|x| *x += 1e-3);
                        }
                    }
                }
                Fault::WrongToken => {
                    if out.sampled.len() > 2 {
                        out.sampled[2] = (out.sampled[2] + 1) % self.inner.config().vocab as u32;
                    }
                }
                Fault::SeedIgnored => {}
            }
            Ok(out)
        }
    }

    fn plan() -> Plan {
        let spec = Spec::load(&Path::new(env!("CARGO_MANIFEST_DIR")).join("specs/qwen2-tiny.yaml")).unwrap();
        Plan::build(spec, None).unwrap()
    }

    fn check(plan: &Plan, id: &str) -> RunCheck {
        plan.spec.run_checks.iter().find(|c| c.id() == id).unwrap().clone()
    }

    fn faulty(plan: &Plan, fault: Fault) -> Faulty {
        Faulty {
            inner: CpuEngine::load(&plan.model).unwrap(),
            fault,
        }
    }

    #[test]
    fn run_checks_pass_on_the_cpu_engine() {
        let plan = plan();
        let engine = CpuEngine::load(&plan.model).unwrap();
        for id in ["determinism", "kv_cache", "greedy_tokens:hf"] {
            let v = evaluate(&plan, &engine, &check(&plan, id));
            assert!(v.passed(), "{id}: {}", v.message);
        }
    }

    #[test]
    fn determinism_fails_when_runs_differ() {
        let plan = plan();
        let v = evaluate(
            &plan,
            &faulty(&plan, Fault::NonDeterministic(AtomicU32::new(0))),
            &check(&plan, "determinism"),
        );
        assert!(v.failed(), "{}", v.message);
        assert!(
            v.message.contains("not bitwise identical") && v.message.contains("logits"),
            "{}",
            v.message
        );
    }

    #[test]
    fn determinism_fails_when_the_seed_is_ignored() {
        let plan = plan();
        let v = evaluate(&plan, &faulty(&plan, Fault::SeedIgnored), &check(&plan, "determinism"));
        assert!(v.failed(), "{}", v.message);
        assert!(
            v.message.contains("the seed does not reach the sampler"),
            "{}",
            v.message
        );
    }

    #[test]
    fn kv_cache_fails_on_a_stale_cache() {
        let plan = plan();
        let v = evaluate(&plan, &faulty(&plan, Fault::StaleCache), &check(&plan, "kv_cache"));
        assert!(v.failed(), "{}", v.message);
        assert!(v.message.contains("decode1"), "{}", v.message);
    }

    #[test]
    fn greedy_tokens_fail_on_a_wrong_token() {
        let plan = plan();
        let v = evaluate(
            &plan,
            &faulty(&plan, Fault::WrongToken),
            &check(&plan, "greedy_tokens:hf"),
        );
        assert!(v.failed(), "{}", v.message);
        assert!(v.message.starts_with("greedy token 2 differs"), "{}", v.message);
    }
}
