//! `linear`: a projection stage is its input capture times the model file's
//! weight, plus its bias: `y_i = Σ_j W_ij·x_j + b_i` per token row, in f64.
//! Inputs: `q`/`k`/`v` ← attn_norm, `attn_out` ← attn_ctx, `ffn_gate`/`ffn_up`
//! ← ffn_norm, `ffn_out` ← ffn_act, `logits` ← output_norm (the LM head, or
//! the embeddings when tied). A dropped bias, a wrong or transposed weight,
//! a mis-dequantised block or a GEMM that reads the wrong rows shows at the
//! projection itself, whatever drift its input carries.
//!
//! The allowance, per output element, with S_i = Σ_j |W_ij·x_j| (n terms),
//! u the storage's unit roundoff, u_w the stored weight's (0 at f32, where
//! the weights are the file's dequantised values exactly) and u32 = 2^-24:
//! - weights held at storage, each off by u_w: u_w·S_i (bias: u_w·|b_i|);
//! - the input as the engine used it may be wider than the capture shows
//!   (a fused kernel's f32 input): u·S_i;
//! - f32 accumulation of n products, summed in any order: γ_n·S_i with
//!   γ_n = n·u32/(1 − n·u32) (Higham's worst-case bound);
//! - 8-bit activations (the engine's declared Q8_0/Q8_K blocks): each x_j off
//!   by up to half a step, amax(block of j)/254, so Σ_j |W_ij|·amax_j/254;
//! - an f16/bf16 KV cache holding k and v: u_kv·|y_i| at `k`/`v`;
//! - the output stored: u·|y_i|, and one subnormal rounding.
//!
//! A bound, not an estimate: no safety factor. It is loose where γ_n is
//! (n in the thousands at f32), and tight at 16 bits, where the storage's
//! own rounding dominates: a dropped q bias of a tenth of q's scale is far
//! outside it, a 1e-3 change of one head's share of attn_out inside it.

use std::sync::Arc;

use rayon::prelude::*;
use serde::de::{Deserialize, Deserializer};

use crate::checks::exact_dot::{abs_dot, dot_and_abs};
use crate::checks::projection::{projection, weight_and_bias};
use super::recompute::{Tally, Wording};
use crate::arithmetic::{Activations, Arithmetic};
use crate::checks::facts::Facts;
use crate::checks::family::{Family, Metric};
use crate::checks::kind::{At, Kind, RuleEnv, StageCheck, StageRule};
use crate::checks::params::Empty;
use crate::checks::scaled::{storage_unit, U_F32};
use crate::checks::verdict::Verdict;
use crate::stage::{BlockStage, Stage};
use crate::tensor::Tensor;

#[derive(Clone, Debug, PartialEq)]
pub struct Linear;

impl Kind for Linear {
    const NAME: &'static str = "linear";
    const PARAMS: &'static str = "none";
    const ABOUT: &'static str = "blk.*.q/k/v, attn_out, ffn_gate, ffn_up, ffn_out, ffn_moe_logits and logits: the stage is its input \
                                 capture times the model file's weight plus its bias, within the roundings of the \
                                 engine's arithmetic";
    fn bare() -> Self {
        Linear
    }
    fn parse<'de, D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        Empty::deserialize(d).map(|_| Linear)
    }
}

impl StageRule for Linear {
    fn kind(&self) -> &'static str {
        Self::NAME
    }
    fn expand(&self, stage: Stage, env: &RuleEnv) -> Result<Vec<Arc<dyn StageCheck>>, String> {
        if let Stage::Block(l, BlockStage::FfnOut) = stage {
            if env.routed.get(l) == Some(&true) {
                return Err(format!(
                    "`linear` cannot judge {stage}: layer {l} routes, and its ffn_out is the experts' sum, not a \
                     projection (check `experts` at ffn_moe_out, and `residual` at ffn_out with a shared expert)"
                ));
            }
        }
        let (input, weight) = projection(stage).ok_or_else(|| {
            format!(
                "`linear` applies to blk.*.q, k, v, attn_out, ffn_gate, ffn_up, ffn_out, ffn_moe_logits and logits, not `{stage}`"
            )
        })?;
        Ok(vec![Arc::new(LinearCheck { input, weight })])
    }
}

/// The check at one projection stage.
#[derive(Clone, Debug, PartialEq)]
pub struct LinearCheck {
    pub input: Stage,
    pub weight: String,
}

impl StageCheck for LinearCheck {
    fn id(&self) -> String {
        Linear::NAME.into()
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
        let (w, b, name) = match weight_and_bias(facts, &self.weight) {
            Ok(x) => x,
            Err(e) => return Verdict::fail(format!("linear at {}: {e}", at.stage)),
        };
        let name = name.as_str();
        let kv_stage = matches!(at.stage, Stage::Block(_, BlockStage::K | BlockStage::V));
        let units = Units::of(&facts.arithmetic, y.dtype().coarser(x.dtype()), kv_stage);
        judge(y, x, &w, b.as_ref().map(|b| b.data()), units, at.stage, self.input, name)
    }
}

/// What the allowance is built from (see the module comment).
#[derive(Clone, Copy, Debug)]
struct Units {
    u: f64,
    u_w: f64,
    /// The KV cache's rounding beyond the stage's (k and v only).
    u_kv: f64,
    /// Block length of 8-bit activations, if the engine quantises them.
    q8_block: Option<usize>,
    eta: f64,
}

impl Units {
    fn of(ar: &Arithmetic, captured: crate::tensor::DType, kv_stage: bool) -> Units {
        let d = captured.coarser(ar.storage);
        Units {
            u: storage_unit(d),
            u_w: ar.u_weight(),
            u_kv: if kv_stage { ar.u_kv() } else { 0.0 },
            q8_block: match ar.activations {
                Activations::Q8 { block } => Some(block),
                Activations::Exact => None,
            },
            eta: d.subnormal_error(),
        }
    }
}

/// `y = x·Wᵀ + b` row by row within the allowance.
#[allow(clippy::too_many_arguments)]
fn judge(y: &Tensor, x: &Tensor, w: &Tensor, b: Option<&[f32]>, units: Units, stage: Stage, input: Stage, wname: &str) -> Verdict {
    let (out, n) = match w.shape() {
        [o, i] => (*o, *i),
        s => return Verdict::fail(format!("linear: weight `{wname}` has shape {s:?}, not a matrix")),
    };
    let rows = x.numel() / n.max(1);
    if x.shape().last() != Some(&n) || y.shape().first() != x.shape().first() || y.numel() != rows * out {
        return Verdict::fail(format!(
            "linear: {stage} has shape {:?} and its input {input} {:?}; `{wname}` is [{out}, {n}], so {stage} \
             must hold {out} values per row of {n}",
            y.shape(),
            x.shape()
        ));
    }
    if b.is_some_and(|b| b.len() != out) {
        return Verdict::fail(format!("linear: the bias of `{wname}` has {} values for {out} outputs", b.unwrap().len()));
    }
    let nf = n as f64 * U_F32;
    let gamma = nf / (1.0 - nf);
    let per_s = units.u_w + units.u + gamma;
    let xd = x.data();
    // Half a quantisation step of each input (its block's amax/254).
    let steps: Vec<f64> = match units.q8_block {
        Some(block) => xd
            .chunks_exact(n)
            .flat_map(|xr| {
                xr.chunks(block).flat_map(|xs| {
                    let amax = xs.iter().fold(0.0f64, |m, v| m.max((*v as f64).abs()));
                    std::iter::repeat_n(amax / 254.0, xs.len())
                })
            })
            .collect(),
        None => Vec::new(),
    };
    // The recomputation is the check's whole cost (the LM head is 136M
    // products per token row on a 0.5B model). Weight rows run in parallel,
    // each against every token row while it is in cache: the matrix is read
    // from memory once, not once per token row.
    let wanted: Vec<Vec<(f64, f64)>> = w
        .data()
        .par_chunks_exact(n)
        .enumerate()
        .map(|(i, wr)| {
            let bi = b.map_or(0.0, |b| b[i] as f64);
            (0..rows)
                .map(|r| {
                    let (acc, s) = dot_and_abs(wr, &xd[r * n..(r + 1) * n]);
                    let q = if steps.is_empty() { 0.0 } else { abs_dot(wr, &steps[r * n..(r + 1) * n]) };
                    let want = acc + bi;
                    let allowed = (per_s * s + q + units.u_w * bi.abs()) * (1.0 + units.u)
                        + (units.u + units.u_kv) * want.abs()
                        + units.eta;
                    (want, allowed)
                })
                .collect()
        })
        .collect();
    let mut tally = Tally::default();
    for (r, yr) in y.data().chunks_exact(out).enumerate() {
        for (i, &yv) in yr.iter().enumerate() {
            let (want, allowed) = wanted[i][r];
            tally.add(r * out + i, yv, want, allowed);
        }
    }
    let words = Wording {
        what: &format!("{input}·{wname}ᵀ{}", if b.is_some() { " + bias" } else { "" }),
        within: &format!("u {:.1e}, n {n}", units.u),
        hint: "a bias dropped, the wrong weight, or a GEMM reading the wrong rows?",
    };
    tally.verdict(y, stage, words, |w| format!("recomputed {:e}", w.want))
}

/// Lanes of the f64 sums below: independent partial sums let the compiler
/// keep several additions in flight (a single running sum is bound by the
/// add's latency). Each product of two f32s is exact in f64, so the order of
/// summation moves the result by a few f64 ulps, 2^-29 of the f32 roundings
/// the allowance is made of.
#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::cpu::mutants::Mutant;
    use crate::engine::cpu::CpuEngine;
    use crate::engine::{Engine, RunRequest, TapSet};
    use crate::model::file_tensors::FileTensors;
    use crate::sampling::Sampling;
    use crate::stage::Step;
    use crate::tensor::DType;
    use std::path::Path;

    /// Every projection stage of a model's run, judged.
    fn verdicts(dir: &str, engine: &CpuEngine, ar: Arithmetic) -> Vec<(String, Verdict)> {
        let model = Path::new(env!("CARGO_MANIFEST_DIR")).join("goldens").join(dir).join("model");
        let cfg = engine.config().clone();
        let file = FileTensors::new(&model, &cfg);
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
                let Some((input, mut name)) = projection(stage) else { continue };
                if name == "lm_head.weight" && !file.has(&name) {
                    name = "model.embed_tokens.weight".into();
                }
                let (y, x) = (out.captures.get(step, stage).unwrap(), out.captures.get(step, input).unwrap());
                let w = file.tensor(&name).unwrap();
                let bn = name.replace(".weight", ".bias");
                let b = file.has(&bn).then(|| file.tensor(&bn).unwrap());
                let kv = matches!(stage, Stage::Block(_, BlockStage::K | BlockStage::V));
                let units = Units::of(&ar, y.dtype(), kv);
                v.push((format!("{step}/{stage}"), judge(y, x, &w, b.as_ref().map(|b| b.data()), units, stage, input, &name)));
            }
        }
        v
    }

    #[test]
    fn the_cpu_engine_passes_at_every_storage_and_with_q8_activations_declared() {
        for dir in ["qwen2-tiny", "llama-tiny", "phi3-tiny", "qwen3-tiny"] {
            let model = Path::new(env!("CARGO_MANIFEST_DIR")).join("goldens").join(dir).join("model");
            for storage in [DType::F32, DType::F16, DType::BF16] {
                let opts = crate::model::LoadOptions {
                    storage,
                    ..Default::default()
                };
                let eng = CpuEngine::load_with(&model, &opts).unwrap();
                let all = verdicts(dir, &eng, Arithmetic::of_storage(storage));
                assert!(all.len() > 10, "{dir}: {} verdicts", all.len());
                for (at, v) in all {
                    assert!(v.passed(), "{dir} {storage} {at}: {}", v.message);
                }
            }
        }
    }

    #[test]
    fn an_engine_quantising_its_activations_passes_declared_q8_and_fails_declared_f32() {
        let model = Path::new(env!("CARGO_MANIFEST_DIR")).join("goldens/qwen2-tiny/model");
        for block in [32, 256] {
            let opts = crate::model::LoadOptions {
                activations: Activations::Q8 { block },
                ..Default::default()
            };
            let eng = CpuEngine::load_with(&model, &opts).unwrap();
            let declared = Arithmetic {
                activations: Activations::Q8 { block },
                ..Arithmetic::F32
            };
            for (at, v) in verdicts("qwen2-tiny", &eng, declared) {
                assert!(v.passed(), "q8 block {block} {at}: {}", v.message);
            }
            let as_f32 = verdicts("qwen2-tiny", &eng, Arithmetic::F32);
            let first = as_f32.iter().find(|(_, v)| v.failed()).expect("8-bit inputs are no f32 arithmetic");
            assert_eq!(first.0, "prefill/blk.0.q", "{}", first.1.message);
        }
    }

    #[test]
    fn a_dropped_bias_is_caught_at_q_at_every_storage_and_silu_on_up_only_downstream_of_ffn_act() {
        let model = Path::new(env!("CARGO_MANIFEST_DIR")).join("goldens/qwen2-tiny/model");
        for storage in [DType::F32, DType::F16, DType::BF16] {
            let opts = crate::model::LoadOptions {
                storage,
                ..Default::default()
            };
            let eng = CpuEngine::load_with(&model, &opts).unwrap().mutated(Mutant::QkvBiasDropped);
            let all = verdicts("qwen2-tiny", &eng, Arithmetic::of_storage(storage));
            let first = all.iter().find(|(_, v)| v.failed()).expect("the dropped bias is caught");
            assert_eq!(first.0, "prefill/blk.0.q", "{storage}: {}", first.1.message);
            assert!(first.1.message.contains("a bias dropped"), "{}", first.1.message);
        }
        // A bug inside ffn_act is not the projections' to see: ffn_out is
        // consistent with the (wrong) ffn_act it was given.
        let eng = CpuEngine::load(&model).unwrap().mutated(Mutant::SiluOnUp);
        assert!(verdicts("qwen2-tiny", &eng, Arithmetic::F32).iter().all(|(_, v)| v.passed()));
    }

    #[test]
    fn only_projection_stages_take_it() {
        assert!(Linear.expand(Stage::Logits, &RuleEnv::default()).is_ok());
        assert!(Linear.expand(Stage::Block(0, BlockStage::AttnNorm), &RuleEnv::default()).is_err());
    }
}
