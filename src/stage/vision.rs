//! The vision tower's stages (`vision.*`) of a vision-language model, in
//! execution order: the processed pixels, the patch embedding (plus Qwen3-VL's
//! learned position embedding), each vision block, the merger, and Qwen3-VL's
//! deepstack mergers; LLaVA's CLIP tower adds `pre_norm` and, between the
//! blocks and the merger, the selected features and the projector. They exist at the prefill only (the image is encoded
//! once); shapes and meanings are in docs/stages-and-checks.md.

/// Per vision block stages in execution order, with their canonical suffix.
pub const VISION_BLOCK_STAGES: [(&str, VBlock); 15] = [
    ("norm1", VBlock::Norm1),
    ("q", VBlock::Q),
    ("k", VBlock::K),
    ("v", VBlock::V),
    ("q_rope", VBlock::QRope),
    ("k_rope", VBlock::KRope),
    ("attn_probs", VBlock::AttnProbs),
    ("attn_ctx", VBlock::AttnCtx),
    ("attn_out", VBlock::AttnOut),
    ("mlp_inp", VBlock::MlpInp),
    ("norm2", VBlock::Norm2),
    ("mlp_fc1", VBlock::MlpFc1),
    ("mlp_act", VBlock::MlpAct),
    ("mlp_out", VBlock::MlpOut),
    ("out", VBlock::Out),
];

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum VBlock {
    /// `[N, Ev]` LayerNorm of the block input.
    Norm1,
    /// `[N, Hv, Dv]` from the fused qkv (bias included), before the rotary.
    Q,
    K,
    V,
    /// `[N, Hv, Dv]` after the 2-D (h, w) rotary.
    QRope,
    KRope,
    /// `[Hv, N, N]`: bidirectional within the image (no causal zeros).
    AttnProbs,
    /// `[N, Hv·Dv]`: the input of the output projection.
    AttnCtx,
    /// `[N, Ev]`: the output projection.
    AttnOut,
    /// `[N, Ev]`: block input + attn_out.
    MlpInp,
    Norm2,
    /// `[N, Fv]`: fc1 output, and its activation.
    MlpFc1,
    MlpAct,
    /// `[N, Ev]`: fc2 output.
    MlpOut,
    /// `[N, Ev]`: mlp_inp + mlp_out.
    Out,
}

impl VBlock {
    pub fn name(self) -> &'static str {
        VISION_BLOCK_STAGES
            .iter()
            .find(|(_, s)| *s == self)
            .map(|(n, _)| *n)
            .expect("every vision block stage is in VISION_BLOCK_STAGES")
    }
    pub fn parse(s: &str) -> Option<VBlock> {
        VISION_BLOCK_STAGES.iter().find(|(n, _)| *n == s).map(|(_, b)| *b)
    }
}

/// One stage of the vision tower. The derived `Ord` is execution order
/// (deepstack mergers, which run inside the tower, come after the main merger:
/// their inputs are block outputs, which are ordered before).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum VisionStage {
    /// `[N, C·T·P·P]`: the processor's flattened patches (merge-window order).
    Pixels,
    /// `[N, Ev]`: the Conv3d patch embedding (a matmul over each patch).
    PatchEmbed,
    /// `[N, Ev]`: Qwen3-VL: patch_embed + the resampled learned position table.
    /// LLaVA: `[P·(N+1), Ev]`, each image's CLS row then its patches, plus
    /// the learned positions.
    PosEmbed,
    /// `[P·(N+1), Ev]`: LLaVA: CLIP's `pre_layrnorm` (the blocks' input).
    PreNorm,
    Block(usize, VBlock),
    /// `[N, Ev]`: the merger's LayerNorm, before each m×m window is
    /// concatenated into one row.
    MergerNorm,
    /// `[P·N, Ev]`: LLaVA: the chosen hidden state (`vision_feature_layer`)
    /// with each image's CLS row dropped: the projector's input.
    Features,
    /// `[P·N, E]`: LLaVA: the projector's linear_1, its GELU, its linear_2.
    ProjFc1,
    ProjAct,
    Projector,
    /// `[M, E]`: the image tokens' features (M = N / m²; LLaVA-1.5: the
    /// projector's rows; LLaVA-NeXT: the packed base, grid and newline rows).
    Merger,
    /// `[M, E]`: Qwen3-VL: deepstack merger j's output.
    Deepstack(usize),
}

impl VisionStage {
    pub fn parse(s: &str) -> Option<VisionStage> {
        match s {
            "pixels" => Some(VisionStage::Pixels),
            "patch_embed" => Some(VisionStage::PatchEmbed),
            "pos_embed" => Some(VisionStage::PosEmbed),
            "merger_norm" => Some(VisionStage::MergerNorm),
            "pre_norm" => Some(VisionStage::PreNorm),
            "features" => Some(VisionStage::Features),
            "proj_fc1" => Some(VisionStage::ProjFc1),
            "proj_act" => Some(VisionStage::ProjAct),
            "projector" => Some(VisionStage::Projector),
            "merger" => Some(VisionStage::Merger),
            _ => {
                if let Some(j) = s.strip_prefix("deepstack.") {
                    return index(j).map(VisionStage::Deepstack);
                }
                let (layer, name) = s.strip_prefix("blk.")?.split_once('.')?;
                Some(VisionStage::Block(index(layer)?, VBlock::parse(name)?))
            }
        }
    }

    /// The block or deepstack index, for patterns that name one.
    pub fn index(self) -> Option<usize> {
        match self {
            VisionStage::Block(i, _) | VisionStage::Deepstack(i) => Some(i),
            _ => None,
        }
    }

    /// Every vision stage of a tower of `depth` blocks with `deepstack`
    /// deepstack mergers (with Qwen3-VL's `pos_embed` when `pos_embed`).
    pub fn all(depth: usize, deepstack: usize, pos_embed: bool) -> Vec<VisionStage> {
        let mut v = vec![VisionStage::Pixels, VisionStage::PatchEmbed];
        if pos_embed {
            v.push(VisionStage::PosEmbed);
        }
        for i in 0..depth {
            v.extend(VISION_BLOCK_STAGES.iter().map(|(_, b)| VisionStage::Block(i, *b)));
        }
        v.push(VisionStage::MergerNorm);
        v.push(VisionStage::Merger);
        v.extend((0..deepstack).map(VisionStage::Deepstack));
        v
    }

    /// Every vision stage of LLaVA's CLIP tower of `depth` blocks (no rotary)
    /// and its projector.
    pub fn all_llava(depth: usize) -> Vec<VisionStage> {
        let mut v = vec![VisionStage::Pixels, VisionStage::PatchEmbed, VisionStage::PosEmbed, VisionStage::PreNorm];
        for i in 0..depth {
            v.extend(
                VISION_BLOCK_STAGES
                    .iter()
                    .filter(|(_, b)| !matches!(b, VBlock::QRope | VBlock::KRope))
                    .map(|(_, b)| VisionStage::Block(i, *b)),
            );
        }
        v.extend([
            VisionStage::Features,
            VisionStage::ProjFc1,
            VisionStage::ProjAct,
            VisionStage::Projector,
            VisionStage::Merger,
        ]);
        v
    }

    /// Generic names (`vision.blk.*.q`), for suggestions.
    pub fn generic_names() -> Vec<String> {
        let mut v: Vec<String> = ["vision.pixels", "vision.patch_embed", "vision.pos_embed", "vision.pre_norm"]
            .map(String::from)
            .to_vec();
        v.extend(VISION_BLOCK_STAGES.iter().map(|(n, _)| format!("vision.blk.*.{n}")));
        v.extend(
            [
                "vision.merger_norm",
                "vision.features",
                "vision.proj_fc1",
                "vision.proj_act",
                "vision.projector",
                "vision.merger",
                "vision.deepstack.*",
            ]
            .map(String::from),
        );
        v
    }
}

fn index(s: &str) -> Option<usize> {
    if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    s.parse().ok()
}

impl std::fmt::Display for VisionStage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            VisionStage::Pixels => f.write_str("vision.pixels"),
            VisionStage::PatchEmbed => f.write_str("vision.patch_embed"),
            VisionStage::PosEmbed => f.write_str("vision.pos_embed"),
            VisionStage::Block(i, b) => write!(f, "vision.blk.{i}.{}", b.name()),
            VisionStage::PreNorm => f.write_str("vision.pre_norm"),
            VisionStage::MergerNorm => f.write_str("vision.merger_norm"),
            VisionStage::Features => f.write_str("vision.features"),
            VisionStage::ProjFc1 => f.write_str("vision.proj_fc1"),
            VisionStage::ProjAct => f.write_str("vision.proj_act"),
            VisionStage::Projector => f.write_str("vision.projector"),
            VisionStage::Merger => f.write_str("vision.merger"),
            VisionStage::Deepstack(j) => write!(f, "vision.deepstack.{j}"),
        }
    }
}
