//! Each run check passes on the CPU engine and FAILS on an engine with the
//! fault it exists to catch, injected by a wrapper around the CPU engine.
use std::path::Path;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

use super::evaluate;
use crate::checks::kind::RunCheck;
use crate::checks::verdict::Verdict;
use crate::engine::cpu::CpuEngine;
use crate::engine::{Engine, RunOutput, RunRequest, TapSet};
use crate::model::ModelConfig;
use crate::plan::{CheckKind, Plan};
use crate::spec::Spec;
use crate::stage::{Stage, Step};

enum Fault {
    /// Each run perturbs one logit by a different amount (a race, an uninitialised buffer).
    NonDeterministic(AtomicU32),
    /// The seed never reaches the sampler.
    SeedIgnored,
    /// Decode steps read a stale KV cache: their logits are off.
    StaleCache,
    /// The engine picks a different token at decode step 2.
    WrongToken,
    /// At decode step 2 one logit is far too large and the engine picks it:
    /// a pick consistent with logits that are themselves wrong.
    WrongLogit,
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
            Fault::WrongLogit => {
                let vocab = self.inner.config().vocab;
                let pick = out.sampled.get(2).copied();
                for ((step, stage), t) in out.captures.iter_mut() {
                    if let (Step::Decode(2), Stage::Logits, Some(pick)) = (step, stage, pick) {
                        let row = t.numel() - vocab;
                        let top = t.data()[row..].iter().fold(f32::MIN, |m, v| m.max(*v));
                        let other = (pick as usize + 1) % vocab;
                        t.data_mut()[row + other] = top + 5.0;
                        out.sampled[2] = other as u32;
                    }
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

fn check(plan: &Plan, id: &str) -> Arc<dyn RunCheck> {
    plan.checks
        .iter()
        .find_map(|c| match &c.kind {
            CheckKind::Run(rc) if rc.id() == id => Some(rc.clone()),
            _ => None,
        })
        .unwrap()
}

fn eval(plan: &Plan, engine: &dyn Engine, check: Arc<dyn RunCheck>) -> Verdict {
    evaluate(check.as_ref(), &plan.facts(), engine)
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
        let v = eval(&plan, &engine, check(&plan, id));
        assert!(v.passed(), "{id}: {}", v.message);
    }
}

#[test]
fn determinism_fails_when_runs_differ() {
    let plan = plan();
    let v = eval(
        &plan,
        &faulty(&plan, Fault::NonDeterministic(AtomicU32::new(0))),
        check(&plan, "determinism"),
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
    let v = eval(&plan, &faulty(&plan, Fault::SeedIgnored), check(&plan, "determinism"));
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
    let v = eval(&plan, &faulty(&plan, Fault::StaleCache), check(&plan, "kv_cache"));
    assert!(v.failed(), "{}", v.message);
    assert!(v.message.contains("decode1"), "{}", v.message);
}

#[test]
fn greedy_tokens_fail_on_a_wrong_token() {
    let plan = plan();
    let v = eval(
        &plan,
        &faulty(&plan, Fault::WrongToken),
        check(&plan, "greedy_tokens:hf"),
    );
    assert!(v.failed(), "{}", v.message);
    assert!(v.message.starts_with("greedy token 2 differs"), "{}", v.message);
}

#[test]
fn a_16_bit_near_tie_passes_and_a_wrong_logit_does_not() {
    // bf16 logits tie where f32 HF's do not (qwen2-tiny, decode2): the
    // engine's pick is the lower index of its own tie, within twice the
    // logits' allowance, so a near-tie, not a failure.
    let mut plan = plan();
    plan.load_options.storage = crate::tensor::DType::BF16;
    let engine = CpuEngine::load_with(&plan.model, &plan.load_options).unwrap();
    let v = eval(&plan, &engine, check(&plan, "greedy_tokens:hf"));
    assert!(v.passed(), "{}", v.message);
    assert_eq!(v.metrics.get("near_tie"), Some(&1.0), "{}", v.message);
    assert!(
        v.message.contains("within twice the logits' allowance"),
        "{}",
        v.message
    );

    // A pick its logits support, but the logits are wrong: not excused.
    let plan = self::plan();
    let v = eval(
        &plan,
        &faulty(&plan, Fault::WrongLogit),
        check(&plan, "greedy_tokens:hf"),
    );
    assert!(v.failed(), "{}", v.message);
    assert!(
        v.message.contains("decode2/logits are outside their allowance"),
        "{}",
        v.message
    );
}
