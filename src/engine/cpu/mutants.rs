//! Planted bugs in the CPU engine, for tests that prove the checks catch
//! them and localise them to the right stage. A mutant can only be switched on
//! in test builds (`cfg(test)`): in any other build `Mutants::is` is a
//! constant `false` and the planted branches compile away.

/// One planted bug: the bugs hand-written engines actually ship.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(not(test), allow(dead_code))]
pub enum Mutant {
    /// Softmax without the division by the sum.
    SoftmaxUnnormalised,
    /// Each query also sees the key after it.
    CausalOffByOne,
    /// RoPE with theta 10000 whatever the config says.
    RopeThetaWrong,
    /// Decode steps rotated at the first decode position, every step.
    RopePositionFrozenInDecode,
    /// RoPE tables that wrap after 24 positions (`pos % 24`).
    RopeTableWrapping,
    /// A decode step's key and value written into the slot before their own.
    KvWrittenOneSlotOff,
    /// Attention reads only the first 32 keys of the cache.
    KvReadShort,
    /// GQA maps query head h to KV head h % KV instead of h / (H / KV).
    GqaModulo,
    /// Scores scaled by 1/D instead of 1/sqrt(D).
    AttnScaleOverD,
    /// RMSNorm with eps 1e-5 whatever the config says (a common default).
    RmsEpsWrong,
    /// RMSNorm dividing the sum of squares by width - 1.
    RmsLengthWrong,
    /// RMSNorm without its weight.
    RmsWeightMissing,
    /// The q/k/v projection biases are not added.
    QkvBiasDropped,
    /// SiLU applied to up instead of gate.
    SiluOnUp,
    /// The attention residual is not added (ffn_inp = attn_out).
    ResidualMissing,
    /// The LM head taken from the embeddings although the model has its own.
    LmHeadTiedWhenUntied,
    /// The run's seed never reaches the sampler.
    SeedIgnored,
    /// Temperature T applied as T²/2.
    TemperatureMisapplied,
    /// Greedy takes the last of tied maxima (torch and HF take the first).
    ArgmaxTieLast,
    /// The last head's share of the output projection is 1e-3 too large.
    OProjHeadShareOff,
    /// Qwen3's per-head q/k RMSNorm is not applied (q_norm = q, k_norm = k),
    /// as an engine that treats Qwen3 as Qwen2 would.
    SkipQkNorm,
    /// Gemma: the embedding rows are not multiplied by √hidden.
    EmbedNotScaled,
    /// Gemma 3: local layers rotate with the global RoPE base.
    LocalRopeGlobalBase,
    /// Gemma: RMSNorm multiplies by w instead of 1 + w.
    NormWithoutPlusOne,
    /// The untapped fast path scales scores by 1/D (an engine whose fused
    /// kernel differs from the one its taps run): every stage check sees the
    /// tapped path, so only `tap_invariance` can catch it.
    UntappedAttnScale,
    /// VLM: image tokens counted with merge size m + 1 (the merger's rows cut
    /// to that count, the rest of the image-pad rows left as text embeddings).
    MergeSizeOff,
    /// VLM: the image features written one row early (over `<|vision_start|>`
    /// and all but the last image-pad row).
    FusionOneRowEarly,
    /// VLM: M-RoPE fed 1-D positions (0..T on every axis) for image tokens too.
    MropeOneD,
    /// VLM: vision attention masked causally.
    VisionAttnCausal,
    /// VLM: the vision rotary built with the language model's RoPE base.
    VisionRopeTextTheta,
    // LLaVA (issue 39).
    /// The features taken from the tower's last layer instead of
    /// `vision_feature_layer` (−2).
    LlavaFeatureLastLayer,
    /// The CLS row kept although the select strategy is `default`.
    LlavaClsKept,
    /// CLIP's `pre_layrnorm` skipped.
    LlavaPreNormSkipped,
    /// The tower's MLP activation the erf GELU instead of quick_gelu.
    LlavaTowerErfGelu,
    /// One image token short: the image rows cut by one, the last `<image>`
    /// row left as its text embedding.
    LlavaImageTokenShort,
    /// LLaVA-NeXT without `image_newline` after each grid row.
    NextNewlineMissing,
    /// LLaVA-NeXT's unpadding with its padding rounded up instead of down.
    NextUnpadRoundedOther,
    // Serving bugs (batches, paged KV, repeats): only the serving run
    // checks can see them, each in its own mode (`SERVING`).
    /// A batched softmax also sums the padding slots (score 0) up to the
    /// longest sequence of the step.
    SoftmaxOverPaddedLength,
    /// A batched decode step reads its first KV block from the next
    /// sequence's block table.
    DecodeReadsNeighbourKv,
    /// A later prefill chunk's first row is rotated at position 0.
    ChunkRopeOffsetDropped,
    /// A prefix hit reuses one position fewer than it claims: the last
    /// reused slot is whatever the fresh block holds.
    PrefixHitOneShort,
    /// The p·v loop reads one slot past the sequence (with p = 0 there).
    ReadsOneSlotPast,
    /// The first sequence slot's cache is not cleared between requests.
    CacheNotCleared,
    /// Every request leaks one KV block's worth of memory.
    BufferLeakedPerRequest,
    // Long-context bugs (issue 37): each on the spec of its scaling.
    /// LongRoPE's long factors chosen by the allocated context (the model's
    /// max_position_embeddings) instead of the pass's length, as llama.cpp
    /// picks them by `n_ctx`.
    LongropeByContext,
    /// YaRN's cos and sin not multiplied by its attention factor.
    YarnNoAttentionFactor,
    /// YaRN's correction range floored/ceiled although the config says
    /// `truncate: false`.
    YarnTruncatedAnyway,
    /// Llama 3's smoothing band one pair too wide: the last high-frequency
    /// pair blended as if it were inside the band.
    Llama3BandOffByOne,
    /// The sliding window one position too wide (keys p − window ≤ j ≤ p).
    WindowOneTooWide,
    /// Dynamic NTK's base formula applied from position 0: without HF's
    /// `max(seq_len, max_position_embeddings)`, short passes are rescaled too.
    DynamicFromZero,
    // Routing bugs (issue 38): each on the spec of the family it changes.
    /// The weights a softmax over the chosen experts' logits, where the
    /// family's softmax runs over all experts (a difference only without
    /// renormalisation: Qwen2-MoE).
    SoftmaxOverTopkOnly,
    /// The chosen weights not renormalised although `norm_topk_prob` says so.
    TopkNotRenormalised,
    /// DeepSeek-V3's correction bias added into the weights, not only into
    /// the choice.
    BiasInWeights,
    /// DeepSeek-V3's group-limited routing ignored (top-k over all experts).
    GroupMaskIgnored,
    /// DeepSeek-V3's `routed_scaling_factor` not applied.
    RoutedScalingMissing,
    /// Qwen2-MoE's shared expert scaled by its gate logit, not σ(logit).
    SharedGateNoSigmoid,
    /// Equal selection scores resolved to the higher expert id.
    RouteTieToHigherId,
    /// The expert after the chosen one computed (ids reported right).
    ExpertIdOffByOne,
    /// DeepSeek's latent attention rotates the first `rope` dims of each
    /// head (its no-RoPE part) instead of the last.
    MlaRopeWrongPart,
    /// gpt-oss's attention sinks left out of the softmax (rows sum to 1).
    SinksIgnored,
}

#[cfg_attr(not(test), allow(dead_code))]
impl Mutant {
    /// The serving mutants, with the serving check that must catch each.
    pub const SERVING: [(Mutant, &'static str); 7] = [
        (Mutant::SoftmaxOverPaddedLength, "batch_invariance"),
        (Mutant::DecodeReadsNeighbourKv, "batch_invariance"),
        (Mutant::ChunkRopeOffsetDropped, "chunked_prefill"),
        (Mutant::PrefixHitOneShort, "prefix_reuse"),
        (Mutant::ReadsOneSlotPast, "poisoned_memory"),
        (Mutant::CacheNotCleared, "repeat"),
        (Mutant::BufferLeakedPerRequest, "repeat"),
    ];

    /// Every mutant, for the self-test (the Gemma ones are scored on the
    /// Gemma spec, the vision-language ones on the VLM specs, where they
    /// change the model).
    pub const ALL: [Mutant; 53] = [
        Mutant::SoftmaxUnnormalised,
        Mutant::CausalOffByOne,
        Mutant::RopeThetaWrong,
        Mutant::RopePositionFrozenInDecode,
        Mutant::RopeTableWrapping,
        Mutant::KvWrittenOneSlotOff,
        Mutant::KvReadShort,
        Mutant::GqaModulo,
        Mutant::AttnScaleOverD,
        Mutant::RmsEpsWrong,
        Mutant::RmsLengthWrong,
        Mutant::RmsWeightMissing,
        Mutant::QkvBiasDropped,
        Mutant::SiluOnUp,
        Mutant::ResidualMissing,
        Mutant::LmHeadTiedWhenUntied,
        Mutant::SeedIgnored,
        Mutant::TemperatureMisapplied,
        Mutant::ArgmaxTieLast,
        Mutant::OProjHeadShareOff,
        Mutant::SkipQkNorm,
        Mutant::EmbedNotScaled,
        Mutant::LocalRopeGlobalBase,
        Mutant::NormWithoutPlusOne,
        Mutant::UntappedAttnScale,
        Mutant::MergeSizeOff,
        Mutant::FusionOneRowEarly,
        Mutant::MropeOneD,
        Mutant::VisionAttnCausal,
        Mutant::VisionRopeTextTheta,
        Mutant::LlavaFeatureLastLayer,
        Mutant::LlavaClsKept,
        Mutant::LlavaPreNormSkipped,
        Mutant::LlavaTowerErfGelu,
        Mutant::LlavaImageTokenShort,
        Mutant::NextNewlineMissing,
        Mutant::NextUnpadRoundedOther,
        Mutant::LongropeByContext,
        Mutant::YarnNoAttentionFactor,
        Mutant::YarnTruncatedAnyway,
        Mutant::Llama3BandOffByOne,
        Mutant::WindowOneTooWide,
        Mutant::DynamicFromZero,
        Mutant::SoftmaxOverTopkOnly,
        Mutant::TopkNotRenormalised,
        Mutant::BiasInWeights,
        Mutant::GroupMaskIgnored,
        Mutant::RoutedScalingMissing,
        Mutant::SharedGateNoSigmoid,
        Mutant::RouteTieToHigherId,
        Mutant::ExpertIdOffByOne,
        Mutant::MlaRopeWrongPart,
        Mutant::SinksIgnored,
    ];
}

/// The mutants switched on for an engine (none outside tests).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Mutants {
    #[cfg(test)]
    on: Option<Mutant>,
}

impl Mutants {
    /// An engine with `m` planted (tests only).
    #[cfg(test)]
    pub fn with(m: Mutant) -> Mutants {
        Mutants { on: Some(m) }
    }

    /// Whether `m` is planted: always false outside test builds.
    #[inline(always)]
    pub fn is(self, m: Mutant) -> bool {
        #[cfg(test)]
        {
            self.on == Some(m)
        }
        #[cfg(not(test))]
        {
            let _ = m;
            false
        }
    }
}

/// Argmax taking the last of tied maxima (the `ArgmaxTieLast` mutant).
pub fn argmax_last(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &x) in logits.iter().enumerate() {
        if x >= logits[best] {
            best = i;
        }
    }
    best as u32
}

/// The RoPE tables of a planted scaling bug that holds for every pass (the
/// YaRN and Llama 3 mutants), or None.
#[cfg(test)]
pub fn planted_tables(m: Mutant, cfg: &crate::model::ModelConfig) -> Option<super::ops::Rope> {
    use super::ops::Rope;
    use crate::model::rope_scaling::RopeScaling;
    let (d, theta) = (cfg.rope_dim(), cfg.rope_theta);
    match (m, cfg.rope_scaling.as_ref()?) {
        (Mutant::YarnNoAttentionFactor, s @ RopeScaling::Yarn { .. }) => {
            Some(Rope::from_parts(s.inv_freq_f32(d, theta, 0), 1.0))
        }
        (Mutant::YarnTruncatedAnyway, RopeScaling::Yarn { .. }) => {
            let mut s = cfg.rope_scaling.clone()?;
            if let RopeScaling::Yarn { truncate, .. } = &mut s {
                *truncate = true;
            }
            Some(Rope::scaled(d, theta, Some(&s), 0))
        }
        (
            Mutant::Llama3BandOffByOne,
            s @ RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original,
            },
        ) => {
            // Blend the pair just before the band as if it were inside it.
            let plain = Rope::new(d, theta);
            let mut inv = s.inv_freq_f32(d, theta, 0);
            let high_w = (*original as f64 / high_freq_factor) as f32;
            let two_pi = (2.0 * std::f64::consts::PI) as f32;
            let w = |f: f32| (1.0f32 / f) * two_pi;
            let last_high = plain.inv_freq().iter().rposition(|&f| w(f) < high_w)?;
            let f0 = plain.inv_freq()[last_high];
            let sm = ((1.0f32 / w(f0)) * *original as f32 - *low_freq_factor as f32)
                / (high_freq_factor - low_freq_factor) as f32;
            inv[last_high] = (1.0 - sm) * f0 / *factor as f32 + sm * f0;
            Some(Rope::from_parts(inv, 1.0))
        }
        _ => None,
    }
}

/// The RoPE table of a pass reaching `seq_len` positions under a planted
/// length bug (LongRoPE by the allocated context, dynamic NTK from 0), or None.
pub fn planted_pass_table(mx: Mutants, cfg: &crate::model::ModelConfig, seq_len: usize) -> Option<super::ops::Rope> {
    use super::ops::Rope;
    use crate::model::rope_scaling::RopeScaling;
    let (d, theta) = (cfg.rope_dim(), cfg.rope_theta);
    match cfg.rope_scaling.as_ref()? {
        s @ RopeScaling::Longrope { .. } if mx.is(Mutant::LongropeByContext) => {
            Some(Rope::scaled(d, theta, Some(s), cfg.context_length.unwrap_or(seq_len)))
        }
        RopeScaling::Dynamic { factor, max_positions } if mx.is(Mutant::DynamicFromZero) => {
            let (f, m) = (*factor as f32, *max_positions as f32);
            let grow = ((f * seq_len as f32) / m - (*factor - 1.0) as f32).powf((d as f64 / (d as f64 - 2.0)) as f32);
            let base = theta as f32 * grow;
            let inv = (0..d / 2).map(|j| 1.0f32 / base.powf((2 * j) as f32 / d as f32)).collect();
            Some(Rope::from_parts(inv, 1.0))
        }
        _ => None,
    }
}

/// `NextUnpadRoundedOther`'s packed rows: `model::llava::packed_rows` with
/// unpad_image's padding ⌈d/2⌉ instead of ⌊d/2⌋ (an odd difference d then
/// keeps one row or column fewer on each side).
pub fn next_rows_padding_rounded_up(
    cfg: &crate::model::llava::LlavaConfig,
    h: usize,
    w: usize,
) -> Vec<crate::model::llava::Packed> {
    use crate::model::llava::{best_resolution, pack_order, patch_grid};
    let best = best_resolution(h, w, cfg.pinpoints.as_deref().unwrap_or(&[]));
    let (ch, cw) = patch_grid(cfg, best);
    let (oh, ow) = (h as f64, w as f64);
    let (rows, cols) = if ow / oh > cw as f64 / ch as f64 {
        let pad = (ch - (oh * (cw as f64 / ow)).round() as usize).div_ceil(2);
        (pad..ch - pad, 0..cw)
    } else {
        let pad = (cw - (ow * (ch as f64 / oh)).round() as usize).div_ceil(2);
        (0..ch, pad..cw - pad)
    };
    pack_order(cfg, best, rows, cols)
}
