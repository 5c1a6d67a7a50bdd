//! Vision-language models (Qwen2-VL, Qwen3-VL): the vision tower's
//! hyper-parameters, the language model's multimodal RoPE (M-RoPE), the image
//! grid, and the multimodal position ids (HF's `get_rope_index`). Read from
//! an HF `config.json` whose `text_config` is the decoder `ModelConfig` reads
//! as usual and whose `vision_config` is the tower.
//!
//! Everything here is arithmetic on integers shared by every engine and by the
//! invariant checks (how many image tokens a grid gives, where each image
//! token sits in the (t, h, w) position space), so it lives with the config,
//! not in an engine.

use serde_json::Value;

use super::llava::LlavaConfig;

/// Which tower: they differ in the patch embedding's bias, learned position
/// embeddings, block MLP names and activation, the merger, deepstack
/// features, and how M-RoPE interleaves its sections.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum VisionFamily {
    Qwen2Vl,
    Qwen3Vl,
    /// LLaVA-1.5 and LLaVA-NeXT: a CLIP tower and a two-layer projector
    /// (`VisionConfig::llava` holds the rest).
    Llava,
    LlavaNext,
}

/// The vision blocks' MLP activation.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum VisionAct {
    /// `x·σ(1.702·x)` (HF `quick_gelu`, Qwen2-VL).
    QuickGelu,
    /// GELU-tanh (HF `gelu_pytorch_tanh`, Qwen3-VL).
    GeluTanh,
}

/// The vision tower of a VLM.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct VisionConfig {
    pub family: VisionFamily,
    pub depth: usize,
    /// Ev: the tower's width.
    pub hidden: usize,
    pub heads: usize,
    /// Fv: the blocks' MLP width.
    pub ffn: usize,
    pub patch: usize,
    pub temporal_patch: usize,
    /// m: each image token merges an m×m window of patches.
    pub merge: usize,
    pub in_channels: usize,
    /// E: the merger's output width (the language model's hidden size).
    pub out_hidden: usize,
    pub act: VisionAct,
    /// Qwen3-VL: the learned position table (a √n × √n grid, resampled
    /// bilinearly to each image's grid).
    pub pos_embeds: Option<usize>,
    /// Qwen3-VL: after vision block `deepstack[j]`, merger j's output is added
    /// to the image rows of the hidden state after decoder layer j.
    pub deepstack: Vec<usize>,
    /// The 2-D vision rotary's base (10000 in every Qwen-VL).
    pub rope_theta: f64,
    /// LayerNorm epsilon (1e-6 in HF's code for every norm of the tower).
    pub ln_eps: f64,
    /// `<|image_pad|>`: the placeholder the merger's rows replace.
    pub image_token: u32,
    /// `<|vision_start|>` (precedes each image's placeholders; only M-RoPE
    /// reads it: LLaVA has none and gives its `<image>` id here).
    pub vision_start_token: u32,
    /// LLaVA: the CLIP tower's feature layer, select strategy, projector and
    /// NeXT's pinpoints.
    pub llava: Option<LlavaConfig>,
}

impl VisionConfig {
    /// LLaVA's tower in the engines' common terms: one tower image is a
    /// grid of (S/P)² patches of width 3·P·P, `merge` 1 (each feature row
    /// is one patch), the projector's output the language model's width `e`.
    pub fn of_llava(lc: LlavaConfig, e: usize) -> VisionConfig {
        let t = &lc.tower;
        VisionConfig {
            family: if lc.pinpoints.is_some() { VisionFamily::LlavaNext } else { VisionFamily::Llava },
            depth: t.layers,
            hidden: t.hidden,
            heads: t.heads,
            ffn: t.ffn,
            patch: t.patch,
            temporal_patch: 1,
            merge: 1,
            in_channels: t.channels,
            out_hidden: e,
            act: VisionAct::QuickGelu,
            pos_embeds: None,
            deepstack: Vec::new(),
            rope_theta: 0.0,
            ln_eps: t.ln_eps,
            image_token: lc.image_token,
            vision_start_token: lc.image_token,
            llava: Some(lc),
        }
    }

    /// The image tokens (placeholder rows) one image gives: Qwen-VL's
    /// t·h·w/m² for its grid; LLaVA-1.5's feature rows of its one tower
    /// image; LLaVA-NeXT's packed sequence for an image of `size` (H, W).
    pub fn image_tokens(&self, grid: ImageGrid, size: Option<(usize, usize)>) -> Result<usize, String> {
        match &self.llava {
            None => Ok(grid.tokens(self.merge)),
            Some(lc) if lc.pinpoints.is_none() => Ok(lc.rows_per_image()),
            Some(lc) => {
                let (h, w) = size.ok_or("LLaVA-NeXT needs the image's size (H, W) to count its tokens")?;
                Ok(super::llava::packed_rows(lc, h, w)?.len())
            }
        }
    }

    /// Dv.
    pub fn head_dim(&self) -> usize {
        self.hidden / self.heads
    }
    /// C·T·P·P: the width of one processed patch.
    pub fn patch_width(&self) -> usize {
        self.in_channels * self.temporal_patch * self.patch * self.patch
    }
    /// The processor's resize factor (patch × merge): image sides are
    /// multiples of it.
    pub fn factor(&self) -> usize {
        self.patch * self.merge
    }
}

/// How the language model's RoPE splits its D/2 frequencies between the
/// temporal, height and width position ids.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct MRope {
    /// Frequencies per axis (t, h, w), summing to head_dim/2.
    pub section: [usize; 3],
    /// Qwen3-VL: frequency j takes h when j%3 = 1 and j < 3·section[1], w when
    /// j%3 = 2 and j < 3·section[2], else t. Qwen2-VL: consecutive sections.
    pub interleaved: bool,
}

impl MRope {
    /// The axis (0 t, 1 h, 2 w) whose position frequency `j` (< D/2) rotates by.
    pub fn axis_of(&self, j: usize) -> usize {
        let [t, h, w] = self.section;
        if self.interleaved {
            if j % 3 == 1 && j < 3 * h {
                1
            } else if j % 3 == 2 && j < 3 * w {
                2
            } else {
                0
            }
        } else if j < t {
            0
        } else if j < t + h {
            1
        } else {
            let _ = w;
            2
        }
    }
}

/// What the shapes of an image's stages depend on: its grid and, for
/// LLaVA-NeXT's packed rows, its size (H, W) as given.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ImageDims {
    pub grid: ImageGrid,
    pub size: Option<(usize, usize)>,
}

/// One image's patch grid (`image_grid_thw`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub struct ImageGrid {
    pub t: usize,
    pub h: usize,
    pub w: usize,
}

impl ImageGrid {
    pub fn patches(&self) -> usize {
        self.t * self.h * self.w
    }
    /// The image tokens the merger gives: t·h·w / m².
    pub fn tokens(&self, merge: usize) -> usize {
        self.patches() / (merge * merge)
    }
    /// (h, w) of every patch in the processor's order (t, h/m, w/m, m, m):
    /// the vision rotary's positions (HF `get_vision_position_ids`).
    pub fn patch_hw(&self, merge: usize) -> Vec<(usize, usize)> {
        let mut v = Vec::with_capacity(self.patches());
        for _ in 0..self.t {
            for bh in 0..self.h / merge {
                for bw in 0..self.w / merge {
                    for ih in 0..merge {
                        for iw in 0..merge {
                            v.push((bh * merge + ih, bw * merge + iw));
                        }
                    }
                }
            }
        }
        v
    }
}

impl std::fmt::Display for ImageGrid {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "[t {}, h {}, w {}]", self.t, self.h, self.w)
    }
}

/// M-RoPE position ids `[3][T]` of a prompt and its rope delta (HF
/// `get_rope_index` for images): text tokens count up on all three axes; the
/// k-th run of `image_token`s is image k, whose tokens take (st + t, st + h,
/// st + w) over its merged grid, st being the position after the text before
/// it; text after an image resumes at st + max(t, h/m, w/m). The delta is
/// max + 1 − T: decode step n sits at T + n − 1 + delta on every axis.
/// Errors when the placeholders do not match the grids (count or run length).
pub fn mrope_positions(
    tokens: &[u32],
    image_token: u32,
    grids: &[ImageGrid],
    merge: usize,
) -> Result<([Vec<i64>; 3], i64), String> {
    let mut pos: [Vec<i64>; 3] = [Vec::new(), Vec::new(), Vec::new()];
    let mut cur: i64 = 0;
    let mut i = 0;
    let mut images = grids.iter();
    while i < tokens.len() {
        if tokens[i] != image_token {
            for p in &mut pos {
                p.push(cur);
            }
            cur += 1;
            i += 1;
            continue;
        }
        let run = tokens[i..].iter().take_while(|&&t| t == image_token).count();
        let k = grids.len() - images.len();
        let g = images
            .next()
            .ok_or_else(|| format!("the prompt has more image-pad runs than the {} image(s)", grids.len()))?;
        let (gt, gh, gw) = (g.t, g.h / merge, g.w / merge);
        if run != gt * gh * gw {
            return Err(format!(
                "image {k}: {run} image-pad token(s) at token {i}, but its grid {g} with merge {merge} gives {}",
                gt * gh * gw
            ));
        }
        for a in 0..gt {
            for b in 0..gh {
                for c in 0..gw {
                    pos[0].push(cur + a as i64);
                    pos[1].push(cur + b as i64);
                    pos[2].push(cur + c as i64);
                }
            }
        }
        cur += gt.max(gh).max(gw) as i64;
        i += run;
    }
    if images.len() != 0 {
        return Err(format!(
            "the prompt has {} image-pad run(s) for {} image(s)",
            grids.len() - images.len(),
            grids.len()
        ));
    }
    let max = pos.iter().flat_map(|p| p.iter().copied()).max().unwrap_or(-1);
    Ok((pos, max + 1 - tokens.len() as i64))
}

/// A VLM weight's name in the layout the engines read: the language model
/// under `model.` (as a text model's) and the tower under `visual.`.
/// transformers 5 saves `model.language_model.*` and `model.visual.*`;
/// checkpoints saved by transformers 4 already use `model.*` and `visual.*`.
pub fn canonical_name(name: &str) -> String {
    if let Some(rest) = name.strip_prefix("model.language_model.") {
        format!("model.{rest}")
    } else if let Some(rest) = name.strip_prefix("model.visual.") {
        format!("visual.{rest}")
    } else {
        name.to_string()
    }
}

/// The M-RoPE positions of one step of `tokens` whose first sits at cache
/// position `pos0`, and the run's delta: at the prefill (`pos0` 0) the
/// prompt's (`mrope_positions`, which sets the delta); after it the cache
/// position plus `delta` on every axis (HF's `cache_position +
/// rope_deltas`). The one rule the engines and the checks share.
pub fn step_positions(
    tokens: &[u32],
    pos0: usize,
    image_token: u32,
    grids: &[ImageGrid],
    merge: usize,
    delta: i64,
) -> Result<([Vec<i64>; 3], i64), String> {
    if pos0 == 0 {
        return mrope_positions(tokens, image_token, grids, merge);
    }
    let p: Vec<i64> = (0..tokens.len()).map(|i| (pos0 + i) as i64 + delta).collect();
    Ok(([p.clone(), p.clone(), p], delta))
}

/// Reads a VLM config (`model_type` `qwen2_vl` / `qwen3_vl`): the text
/// decoder's JSON (to be read as `arch`), the tower, and the M-RoPE sections.
pub fn split_config(v: &Value) -> Result<(Value, &'static str, VisionConfig, MRope), String> {
    let mt = v.get("model_type").and_then(Value::as_str).unwrap_or("");
    let (family, text_arch) = match mt {
        "qwen2_vl" => (VisionFamily::Qwen2Vl, "qwen2"),
        "qwen3_vl" => (VisionFamily::Qwen3Vl, "qwen3"),
        other => return Err(format!("`{other}` is not a Qwen-VL model_type")),
    };
    let text = v.get("text_config").ok_or("missing object `text_config`")?;
    let vis = v.get("vision_config").ok_or("missing object `vision_config`")?;
    let mut text = text.clone();
    text["model_type"] = text_arch.into();
    // Fields transformers keeps at the top level of a VLM config.
    for k in ["tie_word_embeddings"] {
        if text.get(k).is_none() {
            if let Some(x) = v.get(k) {
                text[k] = x.clone();
            }
        }
    }
    let n = |o: &Value, k: &str, what: &str| -> Result<usize, String> {
        o.get(k)
            .and_then(Value::as_u64)
            .map(|n| n as usize)
            .ok_or_else(|| format!("missing or non-integer key `{what}.{k}`"))
    };
    let id = |k: &str| -> Result<u32, String> {
        v.get(k)
            .and_then(Value::as_u64)
            .map(|n| n as u32)
            .ok_or_else(|| format!("missing or non-integer key `{k}`"))
    };
    let act_name = vis.get("hidden_act").and_then(Value::as_str).unwrap_or("");
    let act = match (family, act_name) {
        (_, "quick_gelu") => VisionAct::QuickGelu,
        (_, "gelu_pytorch_tanh") => VisionAct::GeluTanh,
        (_, other) => {
            return Err(format!(
                "`vision_config.hidden_act` is \"{other}\": only quick_gelu and gelu_pytorch_tanh are implemented"
            ))
        }
    };
    let vc = match family {
        VisionFamily::Qwen2Vl => {
            let hidden = n(vis, "embed_dim", "vision_config")?;
            let ratio = vis
                .get("mlp_ratio")
                .and_then(Value::as_f64)
                .ok_or("missing number key `vision_config.mlp_ratio`")?;
            VisionConfig {
                family,
                depth: n(vis, "depth", "vision_config")?,
                hidden,
                heads: n(vis, "num_heads", "vision_config")?,
                ffn: (hidden as f64 * ratio) as usize,
                patch: n(vis, "patch_size", "vision_config")?,
                temporal_patch: n(vis, "temporal_patch_size", "vision_config")?,
                merge: n(vis, "spatial_merge_size", "vision_config")?,
                in_channels: n(vis, "in_channels", "vision_config")?,
                out_hidden: n(vis, "hidden_size", "vision_config")?,
                act,
                pos_embeds: None,
                deepstack: Vec::new(),
                rope_theta: vision_theta(vis)?,
                ln_eps: 1e-6,
                image_token: id("image_token_id")?,
                vision_start_token: id("vision_start_token_id")?,
                llava: None,
            }
        }
        VisionFamily::Llava | VisionFamily::LlavaNext => unreachable!("split_config reads only Qwen-VL model_types"),
        VisionFamily::Qwen3Vl => VisionConfig {
            family,
            depth: n(vis, "depth", "vision_config")?,
            hidden: n(vis, "hidden_size", "vision_config")?,
            heads: n(vis, "num_heads", "vision_config")?,
            ffn: n(vis, "intermediate_size", "vision_config")?,
            patch: n(vis, "patch_size", "vision_config")?,
            temporal_patch: n(vis, "temporal_patch_size", "vision_config")?,
            merge: n(vis, "spatial_merge_size", "vision_config")?,
            in_channels: n(vis, "in_channels", "vision_config")?,
            out_hidden: n(vis, "out_hidden_size", "vision_config")?,
            act,
            pos_embeds: Some(n(vis, "num_position_embeddings", "vision_config")?),
            deepstack: vis
                .get("deepstack_visual_indexes")
                .and_then(Value::as_array)
                .map(|a| a.iter().filter_map(Value::as_u64).map(|x| x as usize).collect())
                .unwrap_or_default(),
            rope_theta: vision_theta(vis)?,
            ln_eps: 1e-6,
            image_token: id("image_token_id")?,
            vision_start_token: id("vision_start_token_id")?,
            llava: None,
        },
    };
    let rp = text
        .get("rope_parameters")
        .or_else(|| text.get("rope_scaling"))
        .ok_or("missing `text_config.rope_parameters` (its `mrope_section`)")?;
    let sec: Vec<usize> = rp
        .get("mrope_section")
        .and_then(Value::as_array)
        .map(|a| a.iter().filter_map(Value::as_u64).map(|x| x as usize).collect())
        .unwrap_or_default();
    if sec.len() != 3 {
        return Err("`text_config.rope_parameters.mrope_section` must list 3 integers (t, h, w)".into());
    }
    let interleaved =
        family == VisionFamily::Qwen3Vl || rp.get("mrope_interleaved").and_then(Value::as_bool) == Some(true);
    let mrope = MRope {
        section: [sec[0], sec[1], sec[2]],
        interleaved,
    };
    // The text decoder reads its RoPE as a plain base: drop the sections
    // (and a transformers-4 `rope_scaling` that only carried them).
    if let Some(o) = text.get_mut("rope_parameters").and_then(Value::as_object_mut) {
        o.remove("mrope_section");
        o.remove("mrope_interleaved");
    }
    if text.get("rope_scaling").and_then(|r| r.get("mrope_section")).is_some() {
        text["rope_scaling"] = Value::Null;
    }
    validate(&vc, &mrope)?;
    Ok((text, text_arch, vc, mrope))
}

fn vision_theta(vis: &Value) -> Result<f64, String> {
    Ok(vis
        .get("rope_parameters")
        .and_then(|p| p.get("rope_theta"))
        .and_then(Value::as_f64)
        .unwrap_or(10000.0))
}

fn validate(vc: &VisionConfig, m: &MRope) -> Result<(), String> {
    for (name, x, max) in [
        ("vision_config.depth", vc.depth, 1024),
        ("vision_config.hidden_size", vc.hidden, 1 << 16),
        ("vision_config.num_heads", vc.heads, 1024),
        ("vision_config intermediate size", vc.ffn, 1 << 18),
        ("vision_config.patch_size", vc.patch, 1024),
        ("vision_config.temporal_patch_size", vc.temporal_patch, 64),
        ("vision_config.spatial_merge_size", vc.merge, 64),
        ("vision_config.in_channels", vc.in_channels, 64),
        ("vision_config out hidden size", vc.out_hidden, 1 << 20),
    ] {
        if x == 0 || x > max {
            return Err(format!("`{name}` is {x}: expected 1..={max}"));
        }
    }
    if !vc.hidden.is_multiple_of(vc.heads) || !vc.head_dim().is_multiple_of(4) {
        return Err(format!(
            "vision hidden {} over {} heads must give a head dim that is a multiple of 4 (the 2-D rotary)",
            vc.hidden, vc.heads
        ));
    }
    if let Some(p) = vc.pos_embeds {
        let side = (p as f64).sqrt() as usize;
        if side * side != p || side < 2 {
            return Err(format!(
                "`vision_config.num_position_embeddings` is {p}: expected a square ≥ 4"
            ));
        }
    }
    if let Some(&d) = vc.deepstack.iter().find(|&&d| d >= vc.depth) {
        return Err(format!(
            "deepstack index {d} is not a vision block (depth {})",
            vc.depth
        ));
    }
    let _ = m;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mrope_axes_follow_hf_sections() {
        let q2 = MRope {
            section: [2, 3, 3],
            interleaved: false,
        };
        let axes: Vec<usize> = (0..8).map(|j| q2.axis_of(j)).collect();
        assert_eq!(axes, [0, 0, 1, 1, 1, 2, 2, 2]);
        // Qwen3-VL's [24, 20, 20] over 64: t h w t h w ... then t from 60.
        let q3 = MRope {
            section: [24, 20, 20],
            interleaved: true,
        };
        let axes: Vec<usize> = (0..64).map(|j| q3.axis_of(j)).collect();
        assert_eq!(&axes[..6], &[0, 1, 2, 0, 1, 2]);
        assert_eq!(&axes[57..], &[0, 1, 2, 0, 0, 0, 0]);
        assert_eq!(axes.iter().filter(|&&a| a == 1).count(), 20);
        assert_eq!(axes.iter().filter(|&&a| a == 2).count(), 20);
    }

    #[test]
    fn positions_follow_the_grid_and_text_resumes_after_the_image() {
        let img = 9;
        // 2 text, a 1×4×6 grid merged by 2 (2×3 = 6 tokens), 2 text.
        let toks = [1, 2, img, img, img, img, img, img, 3, 4];
        let g = ImageGrid { t: 1, h: 4, w: 6 };
        let ([t, h, w], delta) = mrope_positions(&toks, img, &[g], 2).unwrap();
        assert_eq!(t, [0, 1, 2, 2, 2, 2, 2, 2, 5, 6]);
        assert_eq!(h, [0, 1, 2, 2, 2, 3, 3, 3, 5, 6]);
        assert_eq!(w, [0, 1, 2, 3, 4, 2, 3, 4, 5, 6]);
        assert_eq!(delta, 7 - 10);
        let err = mrope_positions(&toks[..7], img, &[g], 2).unwrap_err();
        assert!(err.contains("5 image-pad"), "{err}");
        assert!(mrope_positions(&[1, 2], img, &[g], 2)
            .unwrap_err()
            .contains("0 image-pad run"));
    }

    #[test]
    fn patch_order_is_merge_window_major() {
        let g = ImageGrid { t: 1, h: 2, w: 4 };
        assert_eq!(
            g.patch_hw(2),
            [(0, 0), (0, 1), (1, 0), (1, 1), (0, 2), (0, 3), (1, 2), (1, 3)]
        );
    }
}
