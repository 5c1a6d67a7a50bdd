//! `rms_norm`: a norm stage is RMSNorm of its input, recomputed from the
//! engine's own capture of that input, the model file's norm weight and the
//! config's eps: `y_i = x_i·w_i / sqrt(Σ_j x_j²/n + eps)` over each row of
//! width n (the hidden size; head_dim for Qwen3's q_norm/k_norm, per head).
//! Inputs: `attn_norm` ← the block input (`embed` at layer 0, the previous
//! block's `out` after it), `ffn_norm` ← `ffn_inp`, `output_norm` ← the last
//! block's `out`, `q_norm`/`k_norm` ← `q`/`k`. A wrong eps, a mean over the
//! wrong length, a missing or mis-mapped weight shows at the norm itself,
//! however far the stream has drifted from the references upstream.
//!
//! The allowance, per element, relative to the recomputed |y_i| (u the
//! storage's unit roundoff, u_w the stored weight's: 0 at f32, u32 = 2^-24):
//! - the weight held at the storage dtype: u_w;
//! - the input as the engine used it may be wider than the capture shows
//!   (a residual stream kept in f32): x_i off by u, and so the RMS by u: 2u;
//! - the normalised value rounded to storage before the weight product (as
//!   HF's 16-bit RMSNorm does), and the output stored: 2u;
//! - the f32 arithmetic of the RMS: n squares summed (γ_n on the sum, halved
//!   by the square root), the mean, eps, sqrt, reciprocal, and the two
//!   products: (n/2 + 5)·u32.
//!
//! That is rel = u_w + 4u + (n/2 + 5)·u32, allowed γ = rel/(1 − rel) of
//! |y_i| (first-order terms compounded), plus two subnormal roundings
//! (`DType::subnormal_error`, scaled by |w_i|) for elements that small. A
//! bound, not an estimate, so no safety factor: a correct engine is within
//! it at every element. What it resolves: at f32 ~1e-6 relative (a mean over
//! n − 1 is 1/(2n) ≈ 1e-2 off on a 64-wide model); at f16 2.4e-3; at bf16
//! 1.9e-2, which is coarser than a mean over n − 1 on wide rows (the 16-bit
//! storage itself cannot show that bug per element there).

use std::sync::Arc;

use serde::de::{Deserialize, Deserializer};

use super::recompute::{Tally, Wording};
use crate::checks::facts::Facts;
use crate::checks::family::{Family, Metric};
use crate::checks::kind::{At, Kind, RuleEnv, StageCheck, StageRule};
use crate::checks::params::Empty;
use crate::checks::scaled::{storage_unit, U_F32};
use crate::checks::verdict::Verdict;
use crate::stage::{BlockStage, Stage};
use crate::tensor::Tensor;
#[cfg(test)]
use crate::tensor::DType;

#[derive(Clone, Debug, PartialEq)]
pub struct RmsNorm;

impl Kind for RmsNorm {
    const NAME: &'static str = "rms_norm";
    const PARAMS: &'static str = "none";
    const ABOUT: &'static str = "blk.*.attn_norm, blk.*.ffn_norm, output_norm, blk.*.q_norm/k_norm (and Gemma's \
                                 blk.*.attn_post_norm/ffn_post_norm): the stage is RMSNorm of its input capture with \
                                 the model file's weight (1 + w for Gemma) and eps, within the roundings of the \
                                 engine's arithmetic";
    fn bare() -> Self {
        RmsNorm
    }
    fn parse<'de, D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        Empty::deserialize(d).map(|_| RmsNorm)
    }
}

impl StageRule for RmsNorm {
    fn kind(&self) -> &'static str {
        Self::NAME
    }
    fn expand(&self, stage: Stage, env: &RuleEnv) -> Result<Vec<Arc<dyn StageCheck>>, String> {
        let refuse = || {
            format!(
                "`rms_norm` applies to blk.*.attn_norm, blk.*.ffn_norm, output_norm, blk.*.q_norm, \
                 blk.*.k_norm, blk.*.attn_post_norm and blk.*.ffn_post_norm, not `{stage}`"
            )
        };
        let (input, weight) = norm_of(stage, env).ok_or_else(refuse)?;
        Ok(vec![Arc::new(RmsNormCheck { input, weight })])
    }
}

/// The stage a norm stage normalises, and the HF name of its weight. None
/// for a stage that is no norm (or output_norm while the layer count is
/// unknown). With post norms (Gemma) HF's `post_attention_layernorm` is the
/// attention output's norm and the MLP's input norm is
/// `pre_feedforward_layernorm`.
fn norm_of(stage: Stage, env: &RuleEnv) -> Option<(Stage, String)> {
    let (layers, post_norms) = (env.layers, env.post_norms);
    use BlockStage::{AttnNorm, AttnOut, AttnPostNorm, FfnInp, FfnNorm, FfnOut, FfnPostNorm, KNorm, QNorm, K, Q};
    let p = |l: usize, name: &str| format!("model.layers.{l}.{name}.weight");
    let ffn_norm = crate::model::features::ffn_norm_name(post_norms);
    Some(match stage {
        Stage::Block(l, AttnNorm) => (env.block_input(l), p(l, "input_layernorm")),
        Stage::Block(l, FfnNorm) => (Stage::Block(l, FfnInp), p(l, ffn_norm)),
        Stage::Block(l, AttnPostNorm) => (Stage::Block(l, AttnOut), p(l, "post_attention_layernorm")),
        Stage::Block(l, FfnPostNorm) => (Stage::Block(l, FfnOut), p(l, "post_feedforward_layernorm")),
        Stage::Block(l, QNorm) => (Stage::Block(l, Q), p(l, "self_attn.q_norm")),
        Stage::Block(l, KNorm) => (Stage::Block(l, K), p(l, "self_attn.k_norm")),
        Stage::OutputNorm => (env.block_input(layers.filter(|&l| l > 0)?), "model.norm.weight".into()),
        _ => return None,
    })
}

/// The check at one norm stage: RMSNorm of `input` with `weight`.
#[derive(Clone, Debug, PartialEq)]
pub struct RmsNormCheck {
    pub input: Stage,
    pub weight: String,
}

impl StageCheck for RmsNormCheck {
    fn id(&self) -> String {
        RmsNorm::NAME.into()
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
        let (y, x) = match (at.capture(), at.capture_of(self.input)) {
            (Ok(y), Ok(x)) => (y, x),
            (Err(v), _) | (_, Err(v)) => return v,
        };
        let w = match facts.file.norm(&self.weight) {
            Ok(w) => w,
            Err(e) => return Verdict::fail(format!("rms_norm at {}: {e}", at.stage)),
        };
        let units = Units {
            u: storage_unit(y.dtype().coarser(x.dtype()).coarser(facts.storage)),
            u_w: facts.arithmetic.u_weight(),
            eta: facts.storage.coarser(y.dtype()).subnormal_error(),
        };
        judge(
            y,
            x,
            Weight::of(w, facts.config.norm_plus_one),
            facts.config.rms_eps,
            units,
            at.stage,
            self.input,
        )
    }
}

/// The unit roundoffs the allowance is built from (see the module comment).
#[derive(Clone, Copy, Debug)]
struct Units {
    /// A stored stage value's.
    u: f64,
    /// A stored weight's (0 at f32).
    u_w: f64,
    /// One rounding's absolute error in the subnormal range.
    eta: f64,
}

#[cfg(test)]
impl Units {
    /// The units of plain arithmetic at a storage dtype.
    fn at(storage: DType) -> Units {
        Units {
            u: storage_unit(storage),
            u_w: if storage == DType::F32 { 0.0 } else { storage_unit(storage) },
            eta: storage.subnormal_error(),
        }
    }
}

/// A norm's weight as it multiplies: `w`, or Gemma's `1 + w` formed in f32
/// (HF's `1.0 + self.weight.float()`; llama.cpp's converter stores it so
/// rounded). For `1 + w` an engine holding `w` at its storage dtype is off by
/// u_w·|w|, which relative to |1 + w| is unbounded near w = −1: that term is
/// allowed per element, absolutely, besides u_w relative to |1 + w| (an
/// engine holding 1 + w itself at storage).
struct Weight<'a> {
    raw: &'a [f32],
    plus_one: bool,
}

impl<'a> Weight<'a> {
    fn of(raw: &'a [f32], plus_one: bool) -> Weight<'a> {
        Weight { raw, plus_one }
    }
    fn len(&self) -> usize {
        self.raw.len()
    }
    /// (the multiplier, the raw weight's magnitude held at storage).
    fn at(&self, i: usize) -> (f64, f64) {
        let w = self.raw[i];
        if self.plus_one {
            ((1.0 + w) as f64, (w as f64).abs())
        } else {
            (w as f64, 0.0)
        }
    }
}

/// `y` is RMSNorm of `x` (rows of `w.len()`) within the allowance.
fn judge(y: &Tensor, x: &Tensor, w: Weight, eps: f64, units: Units, stage: Stage, input: Stage) -> Verdict {
    let n = w.len();
    if y.shape() != x.shape() || n == 0 || y.shape().last().is_none_or(|&d| d % n != 0) {
        return Verdict::fail(format!(
            "rms_norm: {stage} has shape {:?} and {input} {:?}; a norm of rows of {n} (its weight's length) needs \
             one shape whose last axis is a multiple of {n}",
            y.shape(),
            x.shape()
        ));
    }
    let rel = units.u_w + 4.0 * units.u + (n as f64 / 2.0 + 5.0) * U_F32;
    let gamma = rel / (1.0 - rel);
    let mut tally = Tally::default();
    for (r, (yr, xr)) in y.data().chunks_exact(n).zip(x.data().chunks_exact(n)).enumerate() {
        let ms = xr.iter().map(|&v| (v as f64) * (v as f64)).sum::<f64>() / n as f64;
        let inv = 1.0 / (ms + eps).sqrt();
        for (i, (&yv, &xv)) in yr.iter().zip(xr).enumerate() {
            let (wv, raw) = w.at(i);
            let xh = xv as f64 * inv;
            let want = xh * wv;
            let allowed = gamma * want.abs() + units.u_w * raw * xh.abs() + 2.0 * units.eta * (1.0 + wv.abs());
            tally.add(r * n + i, yv, want, allowed);
        }
    }
    let words = Wording {
        what: &format!("RMSNorm({input})·w"),
        within: &format!("rel {rel:.1e}, eps {eps:e}, rows of {n}"),
        hint: "eps, the mean's length or the weight wrong?",
    };
    tally.verdict(y, stage, words, |w| format!("recomputed {:e}", w.want))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::cpu::mutants::Mutant;
    use crate::engine::cpu::CpuEngine;
    use crate::engine::{Engine, RunRequest, TapSet};
    use crate::model::file_tensors::FileTensors;
    use crate::sampling::Sampling;
    use crate::stage::Step;
    use std::path::Path;

    const Y: Stage = Stage::Block(0, BlockStage::AttnNorm);
    const X: Stage = Stage::Embed;

    fn t(v: &[f32], dtype: DType) -> Tensor {
        Tensor::new(vec![1, v.len()], v.iter().map(|x| dtype.round(*x)).collect()).with_dtype(dtype)
    }

    /// RMSNorm in f32 over a row, divided by `div` (the true length, or a bug's).
    fn norm(x: &[f32], w: &[f32], eps: f32, div: usize) -> Vec<f32> {
        let ms = x.iter().map(|v| v * v).sum::<f32>() / div as f32;
        x.iter().zip(w).map(|(v, g)| g * (v / (ms + eps).sqrt())).collect()
    }

    #[test]
    fn a_correct_norm_passes_at_every_storage_and_a_mean_over_n_minus_1_fails_at_f32_and_f16() {
        let x: Vec<f32> = (0..64).map(|i| ((i * 37 % 17) as f32 - 8.0) * 0.013).collect();
        let w: Vec<f32> = (0..64).map(|i| 0.5 + (i % 7) as f32 * 0.1).collect();
        for d in [DType::F32, DType::F16, DType::BF16] {
            let xs = t(&x, d);
            let ok = judge(&t(&norm(xs.data(), &w, 1e-6, 64), d), &xs, Weight::of(&w, false), 1e-6, Units::at(d), Y, X);
            assert!(ok.passed(), "{d}: {}", ok.message);
            let bug = judge(&t(&norm(xs.data(), &w, 1e-6, 63), d), &xs, Weight::of(&w, false), 1e-6, Units::at(d), Y, X);
            // 1/(2·64) = 7.8e-3 relative: over the f32 and f16 allowances
            // (1e-6, 2.4e-3), under bf16's (1.9e-2).
            assert_eq!(bug.failed(), d != DType::BF16, "{d}: {}", bug.message);
        }
        let bug = judge(&t(&norm(&x, &w, 1e-6, 63), DType::F32), &t(&x, DType::F32), Weight::of(&w, false), 1e-6, Units::at(DType::F32), Y, X);
        assert!(bug.message.contains(" of 64 elements of blk.0.attn_norm are not RMSNorm(embed)·w"), "{}", bug.message);
        // A shape that is no norm of rows of the weight's length.
        let v = judge(&t(&x[..60], DType::F32), &t(&x[..60], DType::F32), Weight::of(&w, false), 1e-6, Units::at(DType::F32), Y, X);
        assert!(v.failed() && v.message.contains("multiple of 64"), "{}", v.message);
    }

    #[test]
    fn rules_expand_to_the_right_input_and_weight_and_refuse_other_stages() {
        let env = RuleEnv {
            layers: Some(4),
            ..RuleEnv::default()
        };
        let check = |s| format!("{:?}", RmsNorm.expand(s, &env).unwrap()[0]);
        assert!(check(Stage::Block(2, BlockStage::AttnNorm)).contains("input: Block(1, Out)"));
        assert!(check(Stage::Block(2, BlockStage::FfnNorm)).contains("model.layers.2.post_attention_layernorm.weight"));
        assert!(check(Stage::OutputNorm).contains("input: Block(3, Out)"));
        assert!(check(Stage::Block(1, BlockStage::KNorm)).contains("input: Block(1, K)"));
        assert!(RmsNorm.expand(Stage::Block(0, BlockStage::Q), &env).is_err());
        assert!(RmsNorm.expand(Stage::OutputNorm, &RuleEnv::default()).is_err());
    }

    /// Every norm stage of a model's run, judged.
    fn verdicts(dir: &str, engine: &CpuEngine, storage: DType) -> Vec<(String, Verdict)> {
        let model = Path::new(env!("CARGO_MANIFEST_DIR")).join("goldens").join(dir).join("model");
        let norms = FileTensors::new(&model, engine.config());
        let cfg = engine.config().clone();
        let req = RunRequest {
            prompt: vec![1, 17, 42, 99, 7],
            decode_steps: 2,
            sampling: Sampling::Greedy,
            seed: 0,
            forced: None,
            image: None,
        };
        let out = engine.run(&req, &TapSet::all(cfg.layers)).unwrap();
        let mut v = Vec::new();
        for step in Step::sequence(2) {
            for stage in Stage::of_model(&cfg, false) {
                let Some((input, weight)) = norm_of(stage, &RuleEnv { layers: Some(cfg.layers), post_norms: cfg.post_norms, ..RuleEnv::default() }) else { continue };
                let Some(y) = out.captures.get(step, stage) else { continue };
                let x = out.captures.get(step, input).unwrap();
                let w = norms.norm(&weight).unwrap();
                v.push((format!("{step}/{stage}"), judge(
                    y,
                    x,
                    Weight::of(w, cfg.norm_plus_one),
                    cfg.rms_eps,
                    Units::at(storage),
                    stage,
                    input,
                )));
            }
        }
        v
    }

    #[test]
    fn the_cpu_engine_passes_at_every_storage_and_its_norm_bugs_are_caught_at_the_first_norm() {
        for dir in ["qwen2-tiny", "qwen3-tiny"] {
            let model = Path::new(env!("CARGO_MANIFEST_DIR")).join("goldens").join(dir).join("model");
            for storage in [DType::F32, DType::F16, DType::BF16] {
                let opts = crate::model::LoadOptions {
                    storage,
                    ..Default::default()
                };
                let eng = CpuEngine::load_with(&model, &opts).unwrap();
                let all = verdicts(dir, &eng, storage);
                assert!(all.len() > 10, "{dir}: {} norm verdicts", all.len());
                for (at, v) in all {
                    assert!(v.passed(), "{dir} {storage} {at}: {}", v.message);
                }
            }
        }
        let model = Path::new(env!("CARGO_MANIFEST_DIR")).join("goldens/qwen2-tiny/model");
        for m in [Mutant::RmsLengthWrong, Mutant::RmsWeightMissing, Mutant::RmsEpsWrong] {
            let eng = CpuEngine::load(&model).unwrap().mutated(m);
            let all = verdicts("qwen2-tiny", &eng, DType::F32);
            let first = all.iter().find(|(_, v)| v.failed()).unwrap_or_else(|| panic!("{m:?} not caught"));
            assert_eq!(first.0, "prefill/blk.0.attn_norm", "{m:?}: {}", first.1.message);
        }
    }
}
