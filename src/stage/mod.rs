//! The canonical stage vocabulary shared by every engine and golden source, in
//! execution order, and the steps of a run (prefill, decode1, decode2, ...).
//! Keys in captures and golden files are `<step>/<stage>`. The order defined
//! here is what "first divergence" means, so it lives in one place.

pub mod pattern;
mod rope;
pub mod shape;
pub mod vision;

use std::fmt;

pub use rope::RopeStyle;
pub use vision::{VBlock, VisionStage};

/// Per-block stages in execution order, with their canonical suffix.
pub const BLOCK_STAGES: [(&str, BlockStage); 28] = [
    ("attn_norm", BlockStage::AttnNorm),
    ("q", BlockStage::Q),
    ("k", BlockStage::K),
    ("v", BlockStage::V),
    ("q_norm", BlockStage::QNorm),
    ("k_norm", BlockStage::KNorm),
    ("q_rope", BlockStage::QRope),
    ("k_rope", BlockStage::KRope),
    ("attn_scores", BlockStage::AttnScores),
    ("attn_probs", BlockStage::AttnProbs),
    ("attn_ctx", BlockStage::AttnCtx),
    ("attn_out", BlockStage::AttnOut),
    ("attn_post_norm", BlockStage::AttnPostNorm),
    ("ffn_inp", BlockStage::FfnInp),
    ("ffn_norm", BlockStage::FfnNorm),
    ("ffn_gate", BlockStage::FfnGate),
    ("ffn_up", BlockStage::FfnUp),
    ("ffn_act", BlockStage::FfnAct),
    ("ffn_moe_logits", BlockStage::FfnMoeLogits),
    ("ffn_moe_probs", BlockStage::FfnMoeProbs),
    ("ffn_moe_topk", BlockStage::FfnMoeTopk),
    ("ffn_moe_weights", BlockStage::FfnMoeWeights),
    ("ffn_moe_out", BlockStage::FfnMoeOut),
    ("ffn_shexp_out", BlockStage::FfnShexpOut),
    ("ffn_out", BlockStage::FfnOut),
    ("ffn_post_norm", BlockStage::FfnPostNorm),
    ("out", BlockStage::Out),
    ("deepstack", BlockStage::Deepstack),
];

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum BlockStage {
    AttnNorm,
    Q,
    K,
    V,
    /// Qwen3: per-head RMSNorm of q, before RoPE.
    QNorm,
    /// Qwen3: per-head RMSNorm of k, before RoPE.
    KNorm,
    QRope,
    KRope,
    /// `[H, T, S]`: q·kᵀ times the attention scale, the softmax input;
    /// entries the causal mask removes are exactly 0 (goldens stay finite).
    AttnScores,
    AttnProbs,
    AttnCtx,
    AttnOut,
    /// Gemma: RMSNorm of attn_out, the branch the residual adds.
    AttnPostNorm,
    FfnInp,
    FfnNorm,
    FfnGate,
    FfnUp,
    FfnAct,
    /// A routed layer (`model::moe`): `[T, n_experts]` router logits
    /// (`ffn_norm` times the router weight, + its bias).
    FfnMoeLogits,
    /// `[T, n_experts]`: the scores top-k is taken over (softmax, or
    /// sigmoid + correction bias, or the logits), before group masking.
    FfnMoeProbs,
    /// `[T, k]`: the chosen expert ids (as floats), ascending.
    FfnMoeTopk,
    /// `[T, k]`: the chosen experts' weights, in the ids' order.
    FfnMoeWeights,
    /// `[T, E]`: Σ weight·expert(x), the routed experts' sum.
    FfnMoeOut,
    /// `[T, E]`: the shared expert's output (after its sigmoid gate where
    /// it has one).
    FfnShexpOut,
    /// The MLP's output; in a routed layer ffn_moe_out + ffn_shexp_out.
    FfnOut,
    /// Gemma: RMSNorm of ffn_out, the branch the residual adds.
    FfnPostNorm,
    Out,
    /// Qwen3-VL: the hidden state after decoder layer i plus deepstack
    /// feature i on the image rows (the next layer's input), for i below the
    /// number of deepstack features.
    Deepstack,
}

impl BlockStage {
    pub fn name(self) -> &'static str {
        BLOCK_STAGES
            .iter()
            .find(|(_, s)| *s == self)
            .map(|(n, _)| *n)
            .expect("every block stage is in BLOCK_STAGES")
    }
    pub fn parse(s: &str) -> Option<BlockStage> {
        BLOCK_STAGES.iter().find(|(n, _)| *n == s).map(|(_, b)| *b)
    }
}

/// One canonical stage. The derived `Ord` is execution order: embed, then each
/// block's stages layer by layer, then output_norm, then logits.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Stage {
    /// A vision-language model's tower (prefill only).
    Vision(VisionStage),
    Embed,
    /// `[T, E]`: a VLM's embeddings after the image features replace the
    /// image-pad rows (what block 0 reads).
    InputsEmbeds,
    /// `[3, T]`: a VLM's M-RoPE position ids (t, h, w) of the step's tokens.
    Positions,
    Block(usize, BlockStage),
    OutputNorm,
    Logits,
    /// `[1, V]`: the distribution a random draw samples the step's token from
    /// (after temperature, top-k and top-p; 0 for removed tokens). Only runs
    /// with random sampling have it.
    SampleProbs,
}

impl Stage {
    /// The token axis of the stage's canonical layout (1 for the `[H, T, S]`
    /// attention stages, else 0): the axis a golden's row subset
    /// (`record.rows`) keeps rows of. None for a stage without one.
    pub fn row_axis(self) -> Option<usize> {
        match self {
            Stage::SampleProbs => None,
            Stage::Block(_, BlockStage::AttnScores | BlockStage::AttnProbs) => Some(1),
            Stage::Vision(VisionStage::Block(_, VBlock::AttnProbs)) | Stage::Positions => Some(1),
            _ => Some(0),
        }
    }

    /// Every stage of the vocabulary for `n_layers` blocks, in execution
    /// order, including stages only some architectures have (`q_norm`,
    /// `k_norm`, the post norms): what patterns are validated against. A model's own stages
    /// are [`Stage::of_model`].
    pub fn all(n_layers: usize) -> Vec<Stage> {
        // Qwen-VL's and LLaVA's towers, merged in execution order.
        let mut vision = VisionStage::all(n_layers, n_layers, true);
        vision.extend(VisionStage::all_llava(n_layers));
        vision.sort();
        vision.dedup();
        let mut v: Vec<Stage> = vision.into_iter().map(Stage::Vision).collect();
        v.extend([Stage::Embed, Stage::InputsEmbeds, Stage::Positions]);
        for l in 0..n_layers {
            v.extend(BLOCK_STAGES.iter().map(|(_, b)| Stage::Block(l, *b)));
        }
        v.push(Stage::OutputNorm);
        v.push(Stage::Logits);
        v.push(Stage::SampleProbs);
        v
    }

    /// The stages a model computes, in execution order: the vocabulary less
    /// the per-head q/k norms when the architecture has none, and less
    /// `sample_probs` unless the run samples at random.
    pub fn of_model(cfg: &crate::model::ModelConfig, random_sampling: bool) -> Vec<Stage> {
        let deepstack = cfg.vision.as_ref().map_or(0, |v| v.deepstack.len());
        let mut v: Vec<Stage> = match &cfg.vision {
            Some(vc) if vc.llava.is_some() => VisionStage::all_llava(vc.depth).into_iter().map(Stage::Vision).collect(),
            Some(vc) => VisionStage::all(vc.depth, deepstack, vc.pos_embeds.is_some())
                .into_iter()
                .map(Stage::Vision)
                .collect(),
            None => Vec::new(),
        };
        v.extend(Stage::all(cfg.layers).into_iter().filter(|s| match s {
            Stage::Vision(_) => false,
            Stage::InputsEmbeds => cfg.vision.is_some(),
            // M-RoPE's (t, h, w) ids; LLaVA's positions are the plain ones.
            Stage::Positions => cfg.mrope.is_some(),
            Stage::Block(l, BlockStage::Deepstack) => *l < deepstack,
            _ => true,
        }));
        v.into_iter()
            .filter(|s| match s {
                Stage::Block(l, b) => has_mlp_stage(cfg, *l, *b),
                _ => true,
            })
            .filter(|s| cfg.qk_norm || !matches!(s, Stage::Block(_, BlockStage::QNorm | BlockStage::KNorm)))
            .filter(|s| {
                cfg.post_norms || !matches!(s, Stage::Block(_, BlockStage::AttnPostNorm | BlockStage::FfnPostNorm))
            })
            .filter(|s| random_sampling || *s != Stage::SampleProbs)
            .collect()
    }

    pub fn parse(s: &str) -> Option<Stage> {
        match s {
            "embed" => Some(Stage::Embed),
            "output_norm" => Some(Stage::OutputNorm),
            "logits" => Some(Stage::Logits),
            "sample_probs" => Some(Stage::SampleProbs),
            "inputs_embeds" => Some(Stage::InputsEmbeds),
            "positions" => Some(Stage::Positions),
            _ => {
                if let Some(rest) = s.strip_prefix("vision.") {
                    return VisionStage::parse(rest).map(Stage::Vision);
                }
                let rest = s.strip_prefix("blk.")?;
                let (layer, name) = rest.split_once('.')?;
                if layer.is_empty() || !layer.bytes().all(|b| b.is_ascii_digit()) {
                    return None;
                }
                Some(Stage::Block(layer.parse().ok()?, BlockStage::parse(name)?))
            }
        }
    }

    /// Stages that exist at the prefill only: a VLM's tower encodes the
    /// image once, and its features are fused into the prompt's rows (and
    /// Qwen3-VL's deepstack features added to them) in the prefill; a decode
    /// step's single text token has none of them.
    pub fn prefill_only(self) -> bool {
        matches!(
            self,
            Stage::Vision(_) | Stage::InputsEmbeds | Stage::Block(_, BlockStage::Deepstack)
        )
    }

    pub fn layer(self) -> Option<usize> {
        match self {
            Stage::Block(l, _) => Some(l),
            _ => None,
        }
    }

    /// The stage name with the layer replaced by `*` (`blk.*.q`), used for
    /// patterns and "did you mean" suggestions.
    pub fn generic_name(self) -> String {
        match self {
            Stage::Block(_, b) => format!("blk.*.{}", b.name()),
            Stage::Vision(VisionStage::Block(_, b)) => format!("vision.blk.*.{}", b.name()),
            Stage::Vision(VisionStage::Deepstack(_)) => "vision.deepstack.*".into(),
            other => other.to_string(),
        }
    }
}

impl fmt::Display for Stage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Stage::Vision(v) => v.fmt(f),
            Stage::Embed => f.write_str("embed"),
            Stage::InputsEmbeds => f.write_str("inputs_embeds"),
            Stage::Positions => f.write_str("positions"),
            Stage::Block(l, b) => write!(f, "blk.{l}.{}", b.name()),
            Stage::OutputNorm => f.write_str("output_norm"),
            Stage::Logits => f.write_str("logits"),
            Stage::SampleProbs => f.write_str("sample_probs"),
        }
    }
}

/// Whether layer `l`'s MLP has stage `b`: a routed layer has the `ffn_moe_*`
/// stages (and `ffn_shexp_out` with a shared expert) instead of the dense
/// MLP's gate, up and activation; a dense layer has no routing stage.
fn has_mlp_stage(cfg: &crate::model::ModelConfig, l: usize, b: BlockStage) -> bool {
    use BlockStage::*;
    let moe = cfg.moe.as_ref().filter(|m| m.is_sparse(l));
    match b {
        FfnGate | FfnUp | FfnAct => moe.is_none(),
        FfnMoeLogits | FfnMoeProbs | FfnMoeTopk | FfnMoeWeights | FfnMoeOut => moe.is_some(),
        FfnShexpOut => moe.is_some_and(|m| m.shared_ffn.is_some()),
        _ => true,
    }
}

/// Every generic stage name (`embed`, `blk.*.q`, ..., `logits`).
pub fn generic_stage_names() -> Vec<String> {
    let mut v = VisionStage::generic_names();
    v.extend(["embed", "inputs_embeds", "positions"].map(String::from));
    v.extend(BLOCK_STAGES.iter().map(|(n, _)| format!("blk.*.{n}")));
    v.push("output_norm".into());
    v.push("logits".into());
    v.push("sample_probs".into());
    v
}

/// A forward pass of a run: the prompt (`prefill`) or the n-th single-token
/// decode step (`decode1`, `decode2`, ...). Ordered in execution order.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Step {
    Prefill,
    Decode(usize),
}

impl Step {
    pub fn parse(s: &str) -> Option<Step> {
        if s == "prefill" {
            return Some(Step::Prefill);
        }
        let n = s.strip_prefix("decode")?;
        if n.is_empty() || !n.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        match n.parse().ok()? {
            0 => None,
            n => Some(Step::Decode(n)),
        }
    }
    /// prefill, decode1, ..., decode{n}.
    pub fn sequence(decode_steps: usize) -> Vec<Step> {
        std::iter::once(Step::Prefill)
            .chain((1..=decode_steps).map(Step::Decode))
            .collect()
    }
    /// Index in the run: prefill = 0, decodeN = N.
    pub fn index(self) -> usize {
        match self {
            Step::Prefill => 0,
            Step::Decode(n) => n,
        }
    }
}

impl fmt::Display for Step {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Step::Prefill => f.write_str("prefill"),
            Step::Decode(n) => write!(f, "decode{n}"),
        }
    }
}

/// `<step>/<stage>`: the key of a tensor in captures and golden files.
pub fn key(step: Step, stage: Stage) -> String {
    format!("{step}/{stage}")
}

/// Parses a `<step>/<stage>` key.
pub fn parse_key(k: &str) -> Option<(Step, Stage)> {
    let (s, st) = k.split_once('/')?;
    Some((Step::parse(s)?, Stage::parse(st)?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_in_execution_order() {
        let all = Stage::all(2);
        // Qwen-VL's tower, LLaVA's five more (pre_norm, features, the
        // projector's three), the language model.
        assert_eq!(all.len(), (3 + 2 * 15 + 2 + 2) + 5 + 3 + 2 * 28 + 3);
        let mut sorted = all.clone();
        sorted.sort();
        assert_eq!(all, sorted, "derived Ord must be execution order");
        for s in all {
            assert_eq!(Stage::parse(&s.to_string()), Some(s));
        }
        assert_eq!(Stage::parse("blk.x.q"), None);
        assert_eq!(Stage::parse("blk.0.nope"), None);
    }

    #[test]
    fn steps_parse_and_order() {
        assert_eq!(Step::parse("decode12"), Some(Step::Decode(12)));
        assert_eq!(Step::parse("decode0"), None);
        assert!(Step::Prefill < Step::Decode(1));
        assert_eq!(
            parse_key("decode2/blk.1.attn_probs"),
            Some((Step::Decode(2), Stage::Block(1, BlockStage::AttnProbs)))
        );
    }
}
