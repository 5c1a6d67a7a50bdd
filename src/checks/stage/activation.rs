//! `activation`: a vision tower's elementwise activations are their function
//! of the engine's own captured input, element by element, recomputed in
//! f64: `vision.blk.{i}.mlp_act` = act(`vision.blk.{i}.mlp_fc1`), act the
//! tower's (CLIP's and Qwen2-VL's quick_gelu x·σ(1.702x), Qwen3-VL's
//! GELU-tanh), and LLaVA's `vision.proj_act` = the erf GELU
//! x·½(1 + erf(x/√2)) of `vision.proj_fc1`. An erf GELU where quick_gelu
//! belongs moves an element at |x| ≈ 2 by ~1% of it: below a 16-bit
//! golden's allowance at this stage (set by its largest elements), far above
//! this check's, which follows each element.
//!
//! The allowance, per element, with y = act(x), u the storage's unit
//! roundoff and u32 = 2^-24:
//! - the output stored: u·|y|;
//! - the f32 evaluation, relative to |y|: quick_gelu's exp within
//!   (2 + 1.16·|1.702x|)·u32 (CUDA's `__expf` bound; the sigmoid's relative
//!   error is at most the exponential's), the product 1.702x, the add, the
//!   division and the final product 4·u32; the erf and tanh forms' final
//!   products 3·u32·|y|, and their (1 + erf) / (1 + tanh) cancelling for
//!   x ≪ 0, so taken absolutely: ½·|x| times erf's or tanh's own error
//!   (2·u32, CUDA's `erff`/`tanhf` bounds) plus the argument's roundings
//!   (tanh: 5·u32·|z| of z = √(2/π)(x + 0.044715x³), times sech² ≤ 1);
//! - inherited: the input as the engine used it may be wider than its
//!   capture (a fused kernel keeps it in f32): |act'(x)|·u·|x|;
//! - two subnormal roundings of the storage (`DType::subnormal_error`).
//!
//! A bound, not an estimate: no safety factor.

use std::sync::Arc;

use serde::de::{Deserialize, Deserializer};

use super::recompute::{Tally, Wording};
use crate::checks::facts::Facts;
use crate::checks::family::{Family, Metric};
use crate::checks::kind::{At, Kind, RuleEnv, StageCheck, StageRule};
use crate::checks::params::Empty;
use crate::checks::scaled::{storage_unit, U_F32};
use crate::checks::verdict::Verdict;
use crate::model::vision::VisionAct;
use crate::stage::{Stage, VBlock, VisionStage};
use crate::tensor::Tensor;

#[derive(Clone, Debug, PartialEq)]
pub struct ActivationRule;

impl Kind for ActivationRule {
    const NAME: &'static str = "activation";
    const PARAMS: &'static str = "none";
    const ABOUT: &'static str = "vision.blk.*.mlp_act and vision.proj_act only: the stage is the model's activation \
                                 (the tower's quick_gelu or gelu_tanh; the projector's erf GELU) of the engine's own \
                                 capture of its input, element by element, within the roundings of its arithmetic";
    fn bare() -> Self {
        ActivationRule
    }
    fn parse<'de, D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        Empty::deserialize(d).map(|_| ActivationRule)
    }
}

impl StageRule for ActivationRule {
    fn kind(&self) -> &'static str {
        Self::NAME
    }
    fn expand(&self, stage: Stage, _: &RuleEnv) -> Result<Vec<Arc<dyn StageCheck>>, String> {
        let input = match stage {
            Stage::Vision(VisionStage::Block(i, VBlock::MlpAct)) => Stage::Vision(VisionStage::Block(i, VBlock::MlpFc1)),
            Stage::Vision(VisionStage::ProjAct) => Stage::Vision(VisionStage::ProjFc1),
            _ => return Err(format!("`activation` applies to vision.blk.*.mlp_act and vision.proj_act, not `{stage}`")),
        };
        Ok(vec![Arc::new(ActivationCheck { input })])
    }
}

/// The functions judged.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Act {
    QuickGelu,
    GeluTanh,
    GeluErf,
}

impl Act {
    fn name(self) -> &'static str {
        match self {
            Act::QuickGelu => "quick_gelu",
            Act::GeluTanh => "gelu_tanh",
            Act::GeluErf => "gelu (erf)",
        }
    }

    /// act(x), act'(x), the f32 evaluation's error relative to |act(x)| and
    /// absolute per unit |x| (module comment).
    fn terms(self, x: f64) -> (f64, f64, f64, f64) {
        match self {
            Act::QuickGelu => {
                let s = 1.0 / (1.0 + (-1.702 * x).exp());
                (x * s, s * (1.0 + 1.702 * x * (1.0 - s)), (6.0 + 1.16 * (1.702 * x).abs()) * U_F32, 0.0)
            }
            Act::GeluErf => {
                let phi = 0.5 * (1.0 + libm::erf(x / std::f64::consts::SQRT_2));
                let pdf = (-0.5 * x * x).exp() / (2.0 * std::f64::consts::PI).sqrt();
                (x * phi, phi + x * pdf, 3.0 * U_F32, 2.0 * U_F32)
            }
            Act::GeluTanh => {
                let c = (2.0 / std::f64::consts::PI).sqrt();
                let z = c * (x + 0.044715 * x * x * x);
                let t = z.tanh();
                let sech2 = 1.0 - t * t;
                let d = 0.5 * (1.0 + t) + 0.5 * x * sech2 * c * (1.0 + 3.0 * 0.044715 * x * x);
                (0.5 * x * (1.0 + t), d, 3.0 * U_F32, 4.0 * U_F32)
            }
        }
    }
}

/// The check at one activation stage.
#[derive(Clone, Debug, PartialEq)]
pub struct ActivationCheck {
    input: Stage,
}

impl StageCheck for ActivationCheck {
    fn id(&self) -> String {
        ActivationRule::NAME.into()
    }
    fn family(&self) -> Family {
        Family::Invariant
    }
    fn metric(&self) -> Option<Metric> {
        Some(Metric::MaxAbs)
    }
    fn reads(&self, stage: Stage) -> Vec<Stage> {
        vec![stage, self.input]
    }
    fn judge(&self, facts: &Facts, at: &At) -> Verdict {
        let Some(vc) = &facts.config.vision else {
            return Verdict::not_applicable("the model has no vision tower");
        };
        let act = match (at.stage, vc.act) {
            (Stage::Vision(VisionStage::ProjAct), _) => Act::GeluErf,
            (_, VisionAct::QuickGelu) => Act::QuickGelu,
            (_, VisionAct::GeluTanh) => Act::GeluTanh,
        };
        let (y, x) = match (at.capture(), at.capture_of(self.input)) {
            (Ok(y), Ok(x)) => (y, x),
            (Err(v), _) | (_, Err(v)) => return v,
        };
        let d = y.dtype().coarser(x.dtype()).coarser(facts.storage);
        judge(y, x, act, storage_unit(d), d.subnormal_error(), at.stage, self.input)
    }
}

/// `y = act(x)` element by element within the allowance (module comment).
pub fn judge(y: &Tensor, x: &Tensor, act: Act, u: f64, eta: f64, stage: Stage, input: Stage) -> Verdict {
    if y.shape() != x.shape() {
        return Verdict::fail(format!(
            "activation: {stage} has shape {:?} and {input} {:?}: an elementwise function keeps the shape",
            y.shape(),
            x.shape()
        ));
    }
    let mut tally = Tally::default();
    for (i, (&yv, &xv)) in y.data().iter().zip(x.data()).enumerate() {
        let xf = xv as f64;
        let (want, slope, own_rel, own_abs) = act.terms(xf);
        let own = u + own_rel;
        let allowed =
            own / (1.0 - own) * want.abs() + own_abs * 0.5 * xf.abs() + u * (slope * xf).abs() + 2.0 * eta;
        tally.add(i, yv, want, allowed);
    }
    let name = act.name();
    let what = format!("{name}({input})");
    let words = Wording {
        what: &what,
        within: &format!("u {u:.1e}"),
        hint: &format!("another activation than {name}, or the wrong input buffer?"),
    };
    tally.verdict(y, stage, words, |w| format!("{name}({:e}) = {:e}", x.data()[w.index], w.want))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tensor::DType;

    const Y: Stage = Stage::Vision(VisionStage::Block(0, VBlock::MlpAct));
    const X: Stage = Stage::Vision(VisionStage::Block(0, VBlock::MlpFc1));

    fn quick(x: f32) -> f32 {
        x * (1.0 / (1.0 + (-(1.702f32 * x)).exp()))
    }
    fn erf_gelu(x: f32) -> f32 {
        x * 0.5 * (1.0 + libm::erff(x * std::f32::consts::FRAC_1_SQRT_2))
    }

    /// Every storage: the f32 evaluation rounded to storage passes; the erf
    /// GELU in quick_gelu's place (and the reverse) fails, even at bf16.
    #[test]
    fn the_right_activation_passes_and_the_other_gelu_fails_at_every_storage() {
        let xs: Vec<f32> = (0..400).map(|i| (i as f32 - 200.0) * 0.03).collect();
        for d in [DType::F32, DType::F16, DType::BF16] {
            let x = Tensor::new(vec![20, 20], xs.iter().map(|v| d.round(*v)).collect()).with_dtype(d);
            let out = |f: fn(f32) -> f32| {
                Tensor::new(vec![20, 20], x.data().iter().map(|v| d.round(f(*v))).collect()).with_dtype(d)
            };
            let (u, eta) = (storage_unit(d), d.subnormal_error());
            assert!(judge(&out(quick), &x, Act::QuickGelu, u, eta, Y, X).passed(), "{d}");
            assert!(judge(&out(erf_gelu), &x, Act::GeluErf, u, eta, Y, X).passed(), "{d}");
            let v = judge(&out(erf_gelu), &x, Act::QuickGelu, u, eta, Y, X);
            assert!(v.failed() && v.message.contains("another activation than quick_gelu"), "{d}: {}", v.message);
            assert!(judge(&out(quick), &x, Act::GeluErf, u, eta, Y, X).failed(), "{d}");
        }
    }

    #[test]
    fn only_the_vision_activations_take_it() {
        let env = RuleEnv::default();
        assert!(ActivationRule.expand(Y, &env).is_ok());
        assert!(ActivationRule.expand(Stage::Vision(VisionStage::ProjAct), &env).is_ok());
        assert!(ActivationRule.expand(X, &env).is_err());
    }
}
