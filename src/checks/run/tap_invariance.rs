//! `tap_invariance`: tapping an engine must not change what it computes. Real
//! engines run another path when asked for intermediate tensors (graph
//! capture or torch.compile switched off, fused kernels split, a flash
//! kernel replaced by one that writes its probabilities), so every stage
//! check may judge a path the engine never runs in production. This check
//! runs the spec's prompt twice, greedy: once tapping only the logits (the
//! closest to an untapped run that still shows numbers) and once tapping
//! every stage the engine can tap, and requires the same tokens and the
//! same logits at every step — bit for bit by default (an engine whose paths
//! share their arithmetic gives identical bits), or within `atol`/`rtol`
//! where a spec states what its engine's split kernels may change.

use std::sync::Arc;

use serde::de::{Deserialize, Deserializer};

use super::run_engine;
use crate::checks::facts::Facts;
use crate::checks::family::Metric;
use crate::checks::kind::{Count, Kind, Limit, RuleEnv, RunCheck, RunRule};
use crate::checks::params::tol_value;
use crate::checks::verdict::Verdict;
use crate::compare::{compare, Tolerance};
use crate::engine::{Engine, RunRequest, TapSet};
use crate::sampling::Sampling;
use crate::stage::{Stage, Step};

#[derive(Clone, Debug, PartialEq, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TapInvariance {
    #[serde(default, deserialize_with = "tol_value")]
    pub atol: f64,
    #[serde(default, deserialize_with = "tol_value")]
    pub rtol: f64,
    /// Decode steps to generate (default: the prompt's decode_steps).
    pub decode_steps: Option<usize>,
}

impl Kind for TapInvariance {
    const NAME: &'static str = "tap_invariance";
    const PARAMS: &'static str = "atol (0), rtol (0), decode_steps (the prompt's)";
    const ABOUT: &'static str = "a run tapping only the logits and one tapping every stage the engine can tap sample \
                                 the same tokens and give the same logits (bit for bit unless atol/rtol say otherwise)";
    fn bare() -> Self {
        TapInvariance {
            atol: 0.0,
            rtol: 0.0,
            decode_steps: None,
        }
    }
    fn parse<'de, D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        Ok(Option::<TapInvariance>::deserialize(d)?.unwrap_or_else(Self::bare))
    }
}

impl RunRule for TapInvariance {
    fn kind(&self) -> &'static str {
        Self::NAME
    }
    fn counts(&self) -> Vec<Count> {
        self.decode_steps
            .map(|n| Count {
                key: "decode_steps",
                what: "tap_invariance.decode_steps",
                n,
                limit: Limit::DecodeSteps,
            })
            .into_iter()
            .collect()
    }
    fn expand(&self, _: &RuleEnv) -> Arc<dyn RunCheck> {
        Arc::new(self.clone())
    }
}

impl RunCheck for TapInvariance {
    fn id(&self) -> String {
        Self::NAME.into()
    }
    fn metric(&self) -> Option<Metric> {
        Some(Metric::MaxAbs)
    }
    fn steps(&self, decode_steps: usize) -> Option<(&'static str, usize)> {
        Some((
            "the prompt plus tap_invariance.decode_steps",
            self.decode_steps.unwrap_or(decode_steps),
        ))
    }
    fn reruns(&self) -> bool {
        true
    }
    fn evaluate(&self, facts: &Facts, engine: &dyn Engine) -> Verdict {
        evaluate(self, facts, engine).unwrap_or_else(|e| Verdict::fail(format!("the engine failed: {e}")))
    }
}

fn evaluate(k: &TapInvariance, facts: &Facts, engine: &dyn Engine) -> Result<Verdict, String> {
    let steps = k.decode_steps.unwrap_or(facts.decode_steps);
    let req = RunRequest {
        prompt: facts.prompt.to_vec(),
        decode_steps: steps,
        sampling: Sampling::Greedy,
        seed: facts.seed,
        forced: None,
        image: facts.image.cloned(),
    };
    let caps = engine.capabilities();
    if let Some(why) = caps.why_not(Stage::Logits) {
        return Ok(Verdict::not_applicable(why));
    }
    let logits_only: TapSet = [Stage::Logits].into_iter().collect();
    let every = caps.tappable(facts.config, false);
    let plain = run_engine(engine, &req, &logits_only)?;
    let tapped = run_engine(engine, &req, &every)?;
    if plain.sampled != tapped.sampled {
        return Ok(Verdict::fail(format!(
            "tapping every stage changed the tokens: {:?} with only the logits tapped, {:?} with every stage tapped \
             (the tapped path computes something else: taps must not change what the engine runs)",
            plain.sampled, tapped.sampled
        )));
    }
    let tol = Tolerance {
        atol: k.atol,
        rtol: k.rtol,
    };
    let mut worst: Option<(f64, Step)> = None;
    for step in Step::sequence(steps) {
        let a = plain
            .captures
            .get(step, Stage::Logits)
            .ok_or_else(|| format!("no logits at {step} from the run tapping only the logits"))?;
        let b = tapped
            .captures
            .get(step, Stage::Logits)
            .ok_or_else(|| format!("no logits at {step} from the run tapping every stage"))?;
        let c = compare(b, a, tol).map_err(|e| format!("{step}: {e}"))?;
        let max_abs = c.max_abs.as_ref().map_or(0.0, |m| m.0);
        if !c.passed() {
            return Ok(Verdict::fail(format!(
                "tapping every stage changed the logits at {step} (actual: every stage tapped; expected: only the \
                 logits tapped; atol {} rtol {}):\n{}",
                k.atol,
                k.rtol,
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
        "tapping every stage ({} of them) left the tokens and the logits of {} step(s) unchanged (atol {} rtol {}; \
         worst max|Δ| {w:.2e} at {at})",
        every.iter().count(),
        steps + 1,
        k.atol,
        k.rtol
    ))
    .metric("max_abs", w))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::cpu::mutants::Mutant;
    use crate::engine::cpu::CpuEngine;
    use crate::plan::Plan;
    use crate::spec::Spec;
    use std::path::Path;

    #[test]
    fn the_cpu_and_cuda_emu_engines_are_tap_invariant_and_an_untapped_scale_bug_is_not() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR"));
        for spec in ["qwen2-tiny.yaml", "gemma3-tiny.yaml"] {
            let plan = Plan::build(Spec::load(&root.join("specs").join(spec)).unwrap(), None).unwrap();
            let facts = plan.facts();
            let k = TapInvariance::bare();
            let cpu = CpuEngine::load_with(&plan.model, &plan.load_options).unwrap();
            let v = k.evaluate(&facts, &cpu);
            assert!(v.passed(), "{spec} cpu: {}", v.message);
            let emu = crate::engine::cuda::load_emu(&plan.model, &plan.load_options).unwrap();
            let v = k.evaluate(&facts, emu.as_ref());
            assert!(v.passed(), "{spec} cuda-emu: {}", v.message);
            let bug = CpuEngine::load_with(&plan.model, &plan.load_options)
                .unwrap()
                .mutated(Mutant::UntappedAttnScale);
            let v = k.evaluate(&facts, &bug);
            assert!(v.failed() && v.message.contains("tapping every stage changed"), "{spec}: {}", v.message);
        }
    }
}
