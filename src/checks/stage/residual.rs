//! `residual`: a pre-norm decoder block adds its two branches to the stream,
//! `ffn_inp = x + attn_out` (x the block input: `embed` at layer 0, the
//! previous block's `out` after it) and `out = ffn_inp + ffn_out`. The check
//! recomputes each sum from the engine's own captures, so it needs no golden:
//! a dropped residual, a branch added twice, or a sum read from the wrong
//! buffer shows at the exact stage.
//!
//! The allowance is one rounding of the sum plus one of each input, at the
//! captured dtype: an engine adds in f32 (`u32 = 2^-24`, relative to |a + b|)
//! and stores the stage at its storage dtype (`u`, f32/f16/bf16: 2^-24,
//! 2^-11, 2^-8), and an engine that keeps its residual stream wider than the
//! stages it shows has added inputs that differ from the captured ones by
//! up to one storage rounding each. So an element passes when
//! `|y − (a + b)| ≤ u32·|a + b| + u·(|a + b| + |a| + |b|)`, sums taken in f64;
//! a missing branch misses by |a| or |b|, far outside it.

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

#[derive(Clone, Debug, PartialEq)]
pub struct Residual;

impl Kind for Residual {
    const NAME: &'static str = "residual";
    const PARAMS: &'static str = "none";
    const ABOUT: &'static str = "blk.*.ffn_inp, blk.*.out, vision.blk.*.mlp_inp and vision.blk.*.out only: the stage is \
                                 the sum of its two inputs (the block input + attn_out; ffn_inp + ffn_out) within one rounding of the sum and of each \
                                 input at the captured dtype";
    fn bare() -> Self {
        Residual
    }
    fn parse<'de, D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        Empty::deserialize(d).map(|_| Residual)
    }
}

impl StageRule for Residual {
    fn kind(&self) -> &'static str {
        Self::NAME
    }
    fn expand(&self, stage: Stage, env: &RuleEnv) -> Result<Vec<Arc<dyn StageCheck>>, String> {
        let (a, b) = inputs(stage, env)
            .ok_or_else(|| format!("`residual` applies to blk.*.ffn_inp, blk.*.out, a routed layer's blk.*.ffn_out with a shared expert, vision.blk.*.mlp_inp and vision.blk.*.out, not `{stage}`"))?;
        Ok(vec![Arc::new(ResidualCheck { a, b })])
    }
}

/// The two stages a residual stage sums (with post norms, the normed
/// branches: Gemma's `attn_post_norm` and `ffn_post_norm`).
fn inputs(stage: Stage, env: &RuleEnv) -> Option<(Stage, Stage)> {
    use crate::stage::{VBlock, VisionStage as VS};
    use BlockStage::{AttnOut, AttnPostNorm, FfnInp, FfnOut, FfnPostNorm, Out};
    let (attn, ffn) = if env.post_norms {
        (AttnPostNorm, FfnPostNorm)
    } else {
        (AttnOut, FfnOut)
    };
    Some(match stage {
        Stage::Block(l, FfnInp) => (env.block_input(l), Stage::Block(l, attn)),
        // A vision block: block input + attn_out, then mlp_inp + mlp_out.
        Stage::Vision(VS::Block(i, VBlock::MlpInp)) => (
            Stage::Vision(match i {
                0 if env.llava_feature_layer.is_some() => VS::PreNorm,
                0 if env.vision_pos_embed => VS::PosEmbed,
                0 => VS::PatchEmbed,
                i => VS::Block(i - 1, VBlock::Out),
            }),
            Stage::Vision(VS::Block(i, VBlock::AttnOut)),
        ),
        Stage::Vision(VS::Block(i, VBlock::Out)) => (
            Stage::Vision(VS::Block(i, VBlock::MlpInp)),
            Stage::Vision(VS::Block(i, VBlock::MlpOut)),
        ),
        Stage::Block(l, Out) => (Stage::Block(l, FfnInp), Stage::Block(l, ffn)),
        // A routed layer with a shared expert adds the two.
        Stage::Block(l, FfnOut) if env.routed_shared.get(l) == Some(&true) => {
            (Stage::Block(l, BlockStage::FfnMoeOut), Stage::Block(l, BlockStage::FfnShexpOut))
        }
        _ => return None,
    })
}

/// The check at one stage: it is the sum of stages `a` and `b`.
#[derive(Clone, Debug, PartialEq)]
pub struct ResidualCheck {
    pub a: Stage,
    pub b: Stage,
}

impl StageCheck for ResidualCheck {
    fn id(&self) -> String {
        Residual::NAME.into()
    }
    fn family(&self) -> Family {
        Family::Invariant
    }
    fn metric(&self) -> Option<Metric> {
        Some(Metric::MaxAbs)
    }
    fn reads(&self, stage: Stage) -> Vec<Stage> {
        vec![stage, self.a, self.b]
    }
    fn judge(&self, _: &Facts, at: &At) -> Verdict {
        let (y, a, b) = match (at.capture(), at.capture_of(self.a), at.capture_of(self.b)) {
            (Ok(y), Ok(a), Ok(b)) => (y, a, b),
            (Err(v), _, _) | (_, Err(v), _) | (_, _, Err(v)) => return v,
        };
        judge(y, a, b, at.stage, self.a, self.b)
    }
}

/// `y = a + b` element by element within the allowance (see the module comment).
fn judge(y: &Tensor, a: &Tensor, b: &Tensor, stage: Stage, sa: Stage, sb: Stage) -> Verdict {
    if y.shape() != a.shape() || y.shape() != b.shape() {
        return Verdict::fail(format!(
            "residual: {stage} has shape {:?}, {sa} {:?}, {sb} {:?}: a sum needs one shape",
            y.shape(),
            a.shape(),
            b.shape()
        ));
    }
    let u = storage_unit(y.dtype().coarser(a.dtype()).coarser(b.dtype()));
    let mut tally = Tally::default();
    for (i, ((&yv, &av), &bv)) in y.data().iter().zip(a.data()).zip(b.data()).enumerate() {
        let (av, bv) = (av as f64, bv as f64);
        let s = av + bv;
        let allowed = U_F32 * s.abs() + u * (s.abs() + av.abs() + bv.abs()) + f32::MIN_POSITIVE as f64;
        tally.add(i, yv, s, allowed);
    }
    let words = Wording {
        what: &format!("{sa} + {sb}"),
        within: &format!("one rounding, u {u:.1e}"),
        hint: "a residual dropped, added twice or read from the wrong buffer?",
    };
    tally.verdict(y, stage, words, |w| {
        format!("{sa} + {sb} = {:e} + {:e} = {:e}", a.data()[w.index], b.data()[w.index], w.want)
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

    fn t(v: &[f32]) -> Tensor {
        Tensor::new(vec![1, v.len()], v.to_vec())
    }

    const Y: Stage = Stage::Block(0, BlockStage::FfnInp);
    const A: Stage = Stage::Embed;
    const B: Stage = Stage::Block(0, BlockStage::AttnOut);

    #[test]
    fn a_rounded_sum_passes_and_a_missing_or_moved_branch_fails_naming_the_element() {
        let (a, b) = ([1.5f32, -2.25, 1e-3, 300.0], [0.1f32, 2.25, 7.0, -0.3]);
        let sum: Vec<f32> = a.iter().zip(&b).map(|(x, y)| x + y).collect();
        assert!(judge(&t(&sum), &t(&a), &t(&b), Y, A, B).passed());
        // The residual dropped: the stage is the branch alone.
        let v = judge(&t(&b), &t(&a), &t(&b), Y, A, B);
        assert!(v.failed() && v.message.starts_with("4 of 4 elements"), "{}", v.message);
        // One element off by a relative 1e-4: far more than one f32 rounding.
        let mut moved = sum.clone();
        moved[3] *= 1.0 + 1e-4;
        let v = judge(&t(&moved), &t(&a), &t(&b), Y, A, B);
        assert!(v.failed() && v.message.contains("index [0, 3]"), "{}", v.message);
        let mut nan = sum;
        nan[1] = f32::NAN;
        assert!(judge(&t(&nan), &t(&a), &t(&b), Y, A, B).failed());
    }

    #[test]
    fn bf16_storage_allows_one_bf16_rounding_and_no_more() {
        let bf = |v: &[f32]| t(&v.iter().map(|x| DType::BF16.round(*x)).collect::<Vec<_>>()).with_dtype(DType::BF16);
        let (a, b) = ([1.0f32, 3.0, -5.5], [0.00390625f32, 0.75, 0.125]);
        let (ta, tb) = (bf(&a), bf(&b));
        let sum: Vec<f32> = ta.data().iter().zip(tb.data()).map(|(x, y)| x + y).collect();
        assert!(judge(&bf(&sum), &ta, &tb, Y, A, B).passed());
        // Off by 4 bf16 units of the sum: not one rounding.
        let off: Vec<f32> = sum.iter().map(|s| s * (1.0 + 4.0 / 256.0)).collect();
        assert!(judge(&bf(&off), &ta, &tb, Y, A, B).failed());
    }

    #[test]
    fn rules_expand_to_the_right_inputs_and_refuse_other_stages() {
        let env = RuleEnv::default();
        let check = |s| format!("{:?}", Residual.expand(s, &env).unwrap()[0]);
        assert!(check(Stage::Block(1, BlockStage::FfnInp)).contains("a: Block(0, Out), b: Block(1, AttnOut)"));
        assert!(check(Stage::Block(1, BlockStage::Out)).contains("a: Block(1, FfnInp), b: Block(1, FfnOut)"));
        assert!(Residual.expand(Stage::Block(0, BlockStage::Q), &env).is_err());
    }

    #[test]
    fn the_cpu_engine_passes_at_every_storage_and_its_dropped_residual_is_caught_at_ffn_inp() {
        let model = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("goldens/qwen2-tiny/model");
        let req = RunRequest {
            prompt: vec![1, 17, 42, 99],
            decode_steps: 2,
            sampling: Sampling::Greedy,
            seed: 0,
            forced: None,
            image: None,
        };
        let layers = CpuEngine::load(&model).unwrap().config().layers;
        let verdicts = |engine: &CpuEngine| {
            let out = engine.run(&req, &TapSet::all(layers)).unwrap();
            let mut v = Vec::new();
            for step in Step::sequence(2) {
                for l in 0..layers {
                    for stage in [Stage::Block(l, BlockStage::FfnInp), Stage::Block(l, BlockStage::Out)] {
                        let (a, b) = inputs(stage, &RuleEnv::default()).unwrap();
                        let got = |s| out.captures.get(step, s).unwrap();
                        v.push((format!("{step}/{stage}"), judge(got(stage), got(a), got(b), stage, a, b)));
                    }
                }
            }
            v
        };
        for storage in [DType::F32, DType::F16, DType::BF16] {
            let opts = crate::model::LoadOptions {
                storage,
                ..Default::default()
            };
            for (at, v) in verdicts(&CpuEngine::load_with(&model, &opts).unwrap()) {
                assert!(v.passed(), "{storage} {at}: {}", v.message);
            }
        }
        let bug = verdicts(&CpuEngine::load(&model).unwrap().mutated(Mutant::ResidualMissing));
        let first = bug.iter().find(|(_, v)| v.failed()).expect("the dropped residual is caught");
        assert_eq!(first.0, "prefill/blk.0.ffn_inp", "{}", first.1.message);
    }
}
