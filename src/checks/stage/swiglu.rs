//! `swiglu`: the MLP's activation stage is `ffn_act = act(ffn_gate)·ffn_up`
//! element by element, recomputed in f64 from the engine's own captures of
//! gate and up, `act` the model's gate activation: SiLU (SwiGLU), or
//! GELU-tanh for Gemma's GeGLU (the config refuses any other). The
//! activation on the wrong operand, a GELU where SiLU belongs, a product with
//! the wrong buffer or a mis-fused kernel shows at ffn_act itself, whatever
//! drift its inputs carry.
//!
//! The allowance, per element, with y = silu(g)·p, u the storage's unit
//! roundoff and u32 = 2^-24:
//! - own arithmetic, relative to |y|: exp in f32 within (2 + 1.16·|g|)·u32
//!   (CUDA's `__expf` bound, the loosest in common use; libm's is 1 ulp),
//!   the add and the division of silu and the product, 3·u32; silu's output
//!   rounded to storage (HF's 16-bit MLP does) and the output stored, 2u;
//! - inherited: gate and up as the engine used them may be wider than the
//!   captures show (a fused gate/up/act kernel keeps them in f32), each off
//!   by one storage rounding: |p·g·silu'(g)|·u + |silu(g)·p|·u, where
//!   silu'(g) = σ(g)·(1 + g·(1 − σ(g)));
//! - two subnormal roundings (`DType::subnormal_error`), the first scaled by
//!   |p|.
//!
//! GELU-tanh, gelu(g) = ½·g·(1 + tanh(z)), z = √(2/π)·(g + 0.044715·g³): the
//! same terms with gelu' for silu', and its own f32 arithmetic taken
//! absolutely, 4·u32·|g·p|: z's five operations (5·u32·|z|, times tanh's
//! slope sech²(z), and |z|·sech²(z) ≤ 0.45) and tanh's own error (2·u32,
//! CUDA's `tanhf` bound; an exp-based tanh is within it) land on
//! (1 + tanh z), which cancels for g ≪ 0 — so relative to |y| there is no
//! bound, but ½·|g·p| times those ≤ 4.3·u32 is one; plus the final products'
//! 3·u32·|y|.
//!
//! u is the activation's unit where the engine's arithmetic evaluates it
//! coarser than its storage (`act: f16`, llama.cpp's GELU table), and then
//! the gate's and the activation's roundings below that dtype's normal range
//! add its subnormal error each, times |up| (and |act'(g)| for the gate's).
//!
//! A bound, not an estimate: no safety factor. For moderate |g| it is about
//! 4u·|y|: 2.4e-7 relative at f32, 2e-3 at f16, 1.6e-2 at bf16.

use std::sync::Arc;

use serde::de::{Deserialize, Deserializer};

use super::recompute::{Tally, Wording};
use crate::checks::facts::Facts;
use crate::checks::family::{Family, Metric};
use crate::checks::kind::{At, Kind, RuleEnv, StageCheck, StageRule};
use crate::checks::params::Empty;
use crate::checks::scaled::{storage_unit, U_F32};
use crate::checks::verdict::Verdict;
use crate::model::config::Activation;
use crate::stage::{BlockStage, Stage};
use crate::tensor::Tensor;

#[derive(Clone, Debug, PartialEq)]
pub struct Swiglu;

impl Kind for Swiglu {
    const NAME: &'static str = "swiglu";
    const PARAMS: &'static str = "none";
    const ABOUT: &'static str = "blk.*.ffn_act only: the stage is act(ffn_gate)·ffn_up of the engine's own captures \
                                 (act: the model's silu, or gelu_tanh for GeGLU), within the roundings of its \
                                 arithmetic";
    fn bare() -> Self {
        Swiglu
    }
    fn parse<'de, D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        Empty::deserialize(d).map(|_| Swiglu)
    }
}

impl StageRule for Swiglu {
    fn kind(&self) -> &'static str {
        Self::NAME
    }
    fn expand(&self, stage: Stage, _: &RuleEnv) -> Result<Vec<Arc<dyn StageCheck>>, String> {
        match stage {
            Stage::Block(l, BlockStage::FfnAct) => Ok(vec![Arc::new(SwigluCheck { layer: l })]),
            _ => Err(format!("`swiglu` applies to blk.*.ffn_act, not `{stage}`")),
        }
    }
}

/// The check at one layer's ffn_act.
#[derive(Clone, Debug, PartialEq)]
pub struct SwigluCheck {
    pub layer: usize,
}

impl SwigluCheck {
    fn gate(&self) -> Stage {
        Stage::Block(self.layer, BlockStage::FfnGate)
    }
    fn up(&self) -> Stage {
        Stage::Block(self.layer, BlockStage::FfnUp)
    }
}

impl StageCheck for SwigluCheck {
    fn id(&self) -> String {
        Swiglu::NAME.into()
    }
    fn family(&self) -> Family {
        Family::Invariant
    }
    fn metric(&self) -> Option<Metric> {
        Some(Metric::MaxAbs)
    }
    fn reads(&self, stage: Stage) -> Vec<Stage> {
        vec![stage, self.gate(), self.up()]
    }
    fn judge(&self, facts: &Facts, at: &At) -> Verdict {
        let (y, g, p) = match (at.capture(), at.capture_of(self.gate()), at.capture_of(self.up())) {
            (Ok(y), Ok(g), Ok(p)) => (y, g, p),
            (Err(v), _, _) | (_, Err(v), _) | (_, _, Err(v)) => return v,
        };
        let d = y.dtype().coarser(g.dtype()).coarser(p.dtype()).coarser(facts.storage);
        // An engine that evaluates the gate activation coarser than its
        // storage (`Arithmetic::act`: llama.cpp's CPU GEGLU rounds the gate to
        // f16 and reads GELU from an f16 table) makes the roundings of g and
        // act(g) at that unit: the allowance takes the coarser of the two.
        let act = facts.arithmetic.act;
        let u = storage_unit(d).max(act.unit_roundoff());
        // Small gates and activations fall below f16's normal range (6.1e-5)
        // there: the two roundings at that unit are absolute, each at most
        // act's subnormal error, times |up| (and |act'(g)| for the gate's).
        let eta_act = if act.unit_roundoff() > storage_unit(d) { act.subnormal_error() } else { 0.0 };
        judge(y, g, p, facts.config.act, u, (d.subnormal_error(), eta_act), at.stage)
    }
}

fn sigmoid(g: f64) -> f64 {
    1.0 / (1.0 + (-g).exp())
}

/// act(g), act'(g), and act's own f32 error bound (relative to |act(g)|,
/// absolute per unit |g|): see the module comment.
fn act_terms(act: Activation, g: f64) -> (f64, f64, f64, f64) {
    match act {
        Activation::Silu => {
            let s = sigmoid(g);
            (g * s, s * (1.0 + g * (1.0 - s)), (5.0 + 1.16 * g.abs()) * U_F32, 0.0)
        }
        Activation::GeluTanh => {
            let c = (2.0 / std::f64::consts::PI).sqrt();
            let z = c * (g + 0.044715 * g * g * g);
            let t = z.tanh();
            let sech2 = 1.0 - t * t;
            let d = 0.5 * (1.0 + t) + 0.5 * g * sech2 * c * (1.0 + 3.0 * 0.044715 * g * g);
            (0.5 * g * (1.0 + t), d, 3.0 * U_F32, 4.0 * U_F32)
        }
        // The gate part g·σ(αg), on the clamped gate (`judge` clamps the
        // operands): SiLU's terms in αg, plus the rounding of α·g.
        Activation::ClampedSwiglu { alpha, .. } => {
            let a = alpha as f64;
            let s = sigmoid(a * g);
            (g * s, s * (1.0 + a * g * (1.0 - s)), (6.0 + 1.16 * (a * g).abs()) * U_F32, 0.0)
        }
    }
}

/// The operands `act_terms` multiplies: the gate and up as stored, or the
/// clamped SwiGLU's min(g, limit) and clamp(up, ±limit) + 1.
fn operands(act: Activation, g: f64, p: f64) -> (f64, f64) {
    match act {
        Activation::ClampedSwiglu { limit, .. } => {
            let l = limit as f64;
            (g.min(l), p.clamp(-l, l) + 1.0)
        }
        _ => (g, p),
    }
}

/// `y = act(g)·p` element by element within the allowance (module comment).
fn judge(y: &Tensor, g: &Tensor, p: &Tensor, act: Activation, u: f64, eta: (f64, f64), stage: Stage) -> Verdict {
    let (eta, eta_act) = eta;
    if y.shape() != g.shape() || y.shape() != p.shape() {
        return Verdict::fail(format!(
            "swiglu: {stage} has shape {:?}, ffn_gate {:?}, ffn_up {:?}: an elementwise product needs one shape",
            y.shape(),
            g.shape(),
            p.shape()
        ));
    }
    let mut tally = Tally::default();
    for (i, ((&yv, &gv), &pv)) in y.data().iter().zip(g.data()).zip(p.data()).enumerate() {
        let (gf, pf) = operands(act, gv as f64, pv as f64);
        let (a, da, own_rel, own_abs) = act_terms(act, gf);
        let want = a * pf;
        let own = 2.0 * u + own_rel;
        let inherited = u * ((pf * gf * da).abs() + want.abs());
        let allowed = own / (1.0 - own) * want.abs()
            + own_abs * (gf * pf).abs()
            + inherited
            + eta * (1.0 + pf.abs())
            + eta_act * pf.abs() * (1.0 + da.abs());
        tally.add(i, yv, want, allowed);
    }
    let name = act.name();
    let what = format!("{name}(gate)·up");
    let words = Wording {
        what: &what,
        within: &format!("u {u:.1e}"),
        hint: &format!("{name} on the wrong operand, another activation, or the wrong buffer?"),
    };
    tally.verdict(y, stage, words, |w| {
        format!("{name}({:e})·{:e} = {:e}", g.data()[w.index], p.data()[w.index], w.want)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::cpu::mutants::Mutant;
    use crate::engine::cpu::CpuEngine;
    use crate::engine::{Engine, RunRequest, TapSet};
    use crate::sampling::Sampling;
    use crate::stage::Step;
    use crate::tensor::DType;
    use std::path::Path;

    const Y: Stage = Stage::Block(0, BlockStage::FfnAct);

    fn t(v: &[f32], d: DType) -> Tensor {
        Tensor::new(vec![1, v.len()], v.iter().map(|x| d.round(*x)).collect()).with_dtype(d)
    }

    fn silu(g: f32) -> f32 {
        g / (1.0 + (-g).exp())
    }

    #[test]
    fn an_activation_evaluated_at_f16_is_judged_at_f16() {
        // llama.cpp's CPU GEGLU: the gate rounded to f16, GELU read at f16
        // (normal and subnormal gates: llama.cpp's cases from gemma3-270m),
        // times up in f32; f32 storage.
        let g: Vec<f32> = vec![0.674_076_9, 2.093_613_1e-5, -3.0, 1.5, -4.246_365_3e-6, 7.528_811_7e-6];
        let p: Vec<f32> = vec![-1.452_296_7, -0.376_518_46, 0.5, 2.0, -8.729_734e-3, 0.226_069_75];
        let f16 = DType::F16;
        let y: Vec<f32> = g
            .iter()
            .zip(&p)
            .map(|(&gv, &pv)| f16.round(act_terms(Activation::GeluTanh, f16.round(gv) as f64).0 as f32) * pv)
            .collect();
        let (tg, tp, ty) = (t(&g, DType::F32), t(&p, DType::F32), t(&y, DType::F32));
        let at_f16 = (DType::F32.subnormal_error(), f16.subnormal_error());
        assert!(judge(&ty, &tg, &tp, Activation::GeluTanh, f16.unit_roundoff(), at_f16, Y).passed());
        let v = judge(&ty, &tg, &tp, Activation::GeluTanh, U_F32, (DType::F32.subnormal_error(), 0.0), Y);
        assert!(v.failed(), "an f32 allowance cannot hold f16 roundings: {}", v.message);
    }

    #[test]
    fn silu_gate_times_up_passes_at_every_storage_and_silu_on_up_or_a_small_scale_fails() {
        let g: Vec<f32> = (0..200).map(|i| (i as f32 - 100.0) * 0.11).collect();
        let p: Vec<f32> = (0..200).map(|i| ((i * 31 % 23) as f32 - 11.0) * 0.07).collect();
        for d in [DType::F32, DType::F16, DType::BF16] {
            let (tg, tp) = (t(&g, d), t(&p, d));
            let y: Vec<f32> = tg.data().iter().zip(tp.data()).map(|(g, p)| silu(*g) * p).collect();
            let u = storage_unit(d);
            assert!(judge(&t(&y, d), &tg, &tp, Activation::Silu, u, (d.subnormal_error(), 0.0), Y).passed(), "{d}");
            // SiLU on up instead of gate.
            let bug: Vec<f32> = tg.data().iter().zip(tp.data()).map(|(g, p)| g * silu(*p)).collect();
            let v = judge(&t(&bug, d), &tg, &tp, Activation::Silu, u, (d.subnormal_error(), 0.0), Y);
            assert!(v.failed() && v.message.contains("silu on the wrong operand"), "{d}: {}", v.message);
            // Every element 8 storage roundings too large: over the ~4u allowance.
            let scaled: Vec<f32> = y.iter().map(|v| v * (1.0 + 8.0 * u as f32)).collect();
            assert!(judge(&t(&scaled, d), &tg, &tp, Activation::Silu, u, (d.subnormal_error(), 0.0), Y).failed(), "{d}");
        }
    }

    #[test]
    fn only_ffn_act_takes_it() {
        assert!(Swiglu.expand(Stage::Block(3, BlockStage::FfnAct), &RuleEnv::default()).is_ok());
        assert!(Swiglu.expand(Stage::Block(3, BlockStage::FfnUp), &RuleEnv::default()).is_err());
    }

    #[test]
    fn the_cpu_engine_passes_at_every_storage_and_silu_on_up_is_caught_at_the_first_ffn_act() {
        let model = Path::new(env!("CARGO_MANIFEST_DIR")).join("goldens/qwen2-tiny/model");
        let req = RunRequest {
            prompt: vec![1, 17, 42, 99, 7],
            decode_steps: 2,
            sampling: Sampling::Greedy,
            seed: 0,
            forced: None,
            image: None,
        };
        let verdicts = |engine: &CpuEngine, d: DType| {
            let layers = engine.config().layers;
            let out = engine.run(&req, &TapSet::all(layers)).unwrap();
            let mut v = Vec::new();
            for step in Step::sequence(2) {
                for l in 0..layers {
                    let c = SwigluCheck { layer: l };
                    let got = |s| out.captures.get(step, s).unwrap();
                    let stage = Stage::Block(l, BlockStage::FfnAct);
                    let u = storage_unit(d);
                    v.push((format!("{step}/{stage}"), judge(got(stage), got(c.gate()), got(c.up()), Activation::Silu, u, (d.subnormal_error(), 0.0), stage)));
                }
            }
            v
        };
        for d in [DType::F32, DType::F16, DType::BF16] {
            let opts = crate::model::LoadOptions {
                storage: d,
                ..Default::default()
            };
            for (at, v) in verdicts(&CpuEngine::load_with(&model, &opts).unwrap(), d) {
                assert!(v.passed(), "{d} {at}: {}", v.message);
            }
        }
        let bug = verdicts(&CpuEngine::load(&model).unwrap().mutated(Mutant::SiluOnUp), DType::F32);
        let first = bug.iter().find(|(_, v)| v.failed()).expect("silu on up is caught");
        assert_eq!(first.0, "prefill/blk.0.ffn_act", "{}", first.1.message);
    }
}
