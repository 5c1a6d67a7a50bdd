//! LLaVA-1.5 and LLaVA-NeXT as HF's `LlavaConfig` / `LlavaNextConfig`
//! describe them: the CLIP vision tower, which of its hidden states feeds
//! the projector (`vision_feature_layer`, the select strategy), the
//! two-layer projector, and NeXT's anyres arithmetic (the best resolution
//! among the pinpoints, the tile grid, `unpad_image`'s kept rows or columns,
//! and where `image_newline` rows go in the packed sequence).
//!
//! Everything here is integer arithmetic every engine and check shares, as
//! `model::vision` is for Qwen-VL; it is written after transformers 5.23's
//! `select_best_resolution`, `get_anyres_image_grid_shape`, `unpad_image`
//! and `LlavaNextModel.pack_image_features`, whose Python rounding it keeps.

use serde_json::Value;

/// The CLIP vision tower (`CLIPVisionConfig`).
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct ClipTower {
    /// Ev.
    pub hidden: usize,
    pub heads: usize,
    /// The blocks' MLP width.
    pub ffn: usize,
    pub layers: usize,
    pub patch: usize,
    /// The square side every image (or tile) the tower sees has.
    pub image_size: usize,
    pub channels: usize,
    pub ln_eps: f64,
}

impl ClipTower {
    /// Patches per side of one image.
    pub fn side(&self) -> usize {
        self.image_size / self.patch
    }
    /// N: the patches of one image (its rows in the tower are N + 1, CLS first).
    pub fn patches(&self) -> usize {
        self.side() * self.side()
    }
}

/// Which rows of the chosen hidden state feed the projector.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Select {
    /// Drop CLS (row 0): N rows per image.
    Default,
    /// Keep every row: N + 1.
    Full,
}

/// A LLaVA model's vision side.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct LlavaConfig {
    pub tower: ClipTower,
    /// Index into the tower's hidden states (0: `pre_layrnorm`'s output,
    /// i: after block i − 1), `vision_feature_layer` resolved (−2: the
    /// output of the last block but one).
    pub feature_layer: usize,
    pub select: Select,
    /// `multimodal_projector_bias`.
    pub projector_bias: bool,
    /// The placeholder token the image's feature rows replace.
    pub image_token: u32,
    /// LLaVA-NeXT: the candidate resolutions (height, width), in the
    /// config's order.
    pub pinpoints: Option<Vec<(usize, usize)>>,
}

impl LlavaConfig {
    /// Reads the vision side of a `llava` or `llava_next` config; unknown
    /// values of a field that changes the maths are refused by name.
    pub fn from_json(v: &Value) -> Result<LlavaConfig, String> {
        let mt = v.get("model_type").and_then(Value::as_str).unwrap_or("");
        if !matches!(mt, "llava" | "llava_next") {
            return Err(format!("`{mt}` is not a LLaVA model_type"));
        }
        let vis = v.get("vision_config").ok_or("missing object `vision_config`")?;
        if let Some(t) = vis.get("model_type").and_then(Value::as_str).filter(|t| *t != "clip_vision_model") {
            return Err(format!("`vision_config.model_type` is \"{t}\": only CLIP's vision tower is implemented"));
        }
        // LlavaConfig's defaults for its CLIP tower (llava-1.5-7b's), then
        // CLIPVisionConfig's: transformers may leave either out of the file.
        let n = |k: &str, default: usize| -> Result<usize, String> {
            match vis.get(k) {
                None | Some(Value::Null) => Ok(default),
                Some(x) => x
                    .as_u64()
                    .map(|n| n as usize)
                    .ok_or_else(|| format!("`vision_config.{k}` is {x}, expected an integer")),
            }
        };
        let tower = ClipTower {
            hidden: n("hidden_size", 1024)?,
            heads: n("num_attention_heads", 16)?,
            ffn: n("intermediate_size", 4096)?,
            layers: n("num_hidden_layers", 24)?,
            patch: n("patch_size", 14)?,
            image_size: n("image_size", 336)?,
            channels: n("num_channels", 3)?,
            ln_eps: match vis.get("layer_norm_eps") {
                None | Some(Value::Null) => 1e-5,
                Some(x) => x.as_f64().ok_or_else(|| format!("`vision_config.layer_norm_eps` is {x}"))?,
            },
        };
        if let Some(a) = vis.get("hidden_act").and_then(Value::as_str).filter(|a| *a != "quick_gelu") {
            return Err(format!("`vision_config.hidden_act` is \"{a}\": CLIP's quick_gelu is the one implemented"));
        }
        if tower.patch == 0 || tower.heads == 0 || !tower.image_size.is_multiple_of(tower.patch) {
            return Err(format!(
                "image_size {} is not a multiple of patch_size {} (or a size is 0)",
                tower.image_size, tower.patch
            ));
        }
        if !tower.hidden.is_multiple_of(tower.heads) || tower.layers == 0 || tower.channels != 3 {
            return Err(format!(
                "hidden {} over {} heads, {} layers, {} channels: not a tower touchstone computes",
                tower.hidden, tower.heads, tower.layers, tower.channels
            ));
        }
        let layer = match v.get("vision_feature_layer") {
            None | Some(Value::Null) => -2,
            Some(x) => x.as_i64().ok_or_else(|| {
                format!("`vision_feature_layer` is {x}: one layer index is implemented (not a list of layers)")
            })?,
        };
        // hidden_states has layers + 1 entries (pre_layrnorm's output first).
        let states = tower.layers as i64 + 1;
        let feature_layer = if layer < 0 { states + layer } else { layer };
        if !(0..states).contains(&feature_layer) {
            return Err(format!("`vision_feature_layer` {layer} is outside the tower's {states} hidden states"));
        }
        let select = match v.get("vision_feature_select_strategy").and_then(Value::as_str) {
            None | Some("default") => Select::Default,
            Some("full") => Select::Full,
            Some(s) => return Err(format!("`vision_feature_select_strategy` is \"{s}\": expected default or full")),
        };
        if let Some(a) = v.get("projector_hidden_act").and_then(Value::as_str).filter(|a| *a != "gelu") {
            return Err(format!("`projector_hidden_act` is \"{a}\": the projector's erf GELU is the one implemented"));
        }
        let image_token = v
            .get("image_token_index")
            .or_else(|| v.get("image_token_id"))
            .map(|x| x.as_u64().ok_or_else(|| format!("`image_token_index` is {x}, expected an integer")))
            .transpose()?
            .unwrap_or(32000) as u32;
        let pinpoints = match mt {
            "llava_next" => Some(read_pinpoints(v.get("image_grid_pinpoints"), tower.image_size)?),
            _ => None,
        };
        Ok(LlavaConfig {
            feature_layer: feature_layer as usize,
            select,
            projector_bias: v.get("multimodal_projector_bias").and_then(Value::as_bool).unwrap_or(true),
            image_token,
            pinpoints,
            tower,
        })
    }

    /// Feature rows one image (or tile) gives: N, or N + 1 with CLS kept.
    pub fn rows_per_image(&self) -> usize {
        self.tower.patches() + usize::from(self.select == Select::Full)
    }
}

/// The language model's config: `text_config` (LlavaConfig's default is
/// Llama's), with the keys transformers keeps at the top level of a
/// multimodal config copied in when the text config lacks them.
pub fn text_config(v: &Value) -> Result<Value, String> {
    let mut text = v.get("text_config").cloned().ok_or("missing object `text_config`")?;
    if !text.is_object() {
        return Err("`text_config` is not an object".into());
    }
    if text.get("model_type").and_then(Value::as_str).is_none() {
        text["model_type"] = "llama".into();
    }
    for k in ["tie_word_embeddings"] {
        if text.get(k).is_none() {
            if let Some(x) = v.get(k) {
                text[k] = x.clone();
            }
        }
    }
    Ok(text)
}

/// `image_grid_pinpoints`: a list of [height, width], each a multiple of the
/// tower's image size (every tile is one tower image).
fn read_pinpoints(x: Option<&Value>, side: usize) -> Result<Vec<(usize, usize)>, String> {
    let list = x
        .and_then(Value::as_array)
        .filter(|a| !a.is_empty())
        .ok_or("LLaVA-NeXT needs `image_grid_pinpoints`, a list of [height, width]")?;
    list.iter()
        .map(|p| {
            let hw = p.as_array().filter(|a| a.len() == 2).and_then(|a| Some((a[0].as_u64()?, a[1].as_u64()?)));
            match hw {
                Some((h, w)) if h > 0 && w > 0 && (h as usize).is_multiple_of(side) && (w as usize).is_multiple_of(side) => {
                    Ok((h as usize, w as usize))
                }
                _ => Err(format!("`image_grid_pinpoints` entry {p} is not [height, width] in multiples of {side}")),
            }
        })
        .collect()
}

/// HF's `select_best_resolution`: the pinpoint (h, w) that keeps the most of
/// an `h`×`w` image once scaled to fit it, the least wasted area breaking
/// ties, the first in order after that.
pub fn best_resolution(h: usize, w: usize, pinpoints: &[(usize, usize)]) -> (usize, usize) {
    let (mut best, mut most, mut least_waste) = (pinpoints[0], 0usize, usize::MAX);
    for &(ph, pw) in pinpoints {
        let scale = (pw as f64 / w as f64).min(ph as f64 / h as f64);
        // Python's int() truncates toward zero.
        let (dw, dh) = ((w as f64 * scale) as usize, (h as f64 * scale) as usize);
        let effective = (dw * dh).min(w * h);
        let waste = ph * pw - effective;
        if effective > most || (effective == most && waste < least_waste) {
            (best, most, least_waste) = ((ph, pw), effective, waste);
        }
    }
    best
}

/// The kept range of the padded tile grid's rows and columns
/// (`unpad_image`): the grid is `cur_h`×`cur_w` patches for an image of
/// `h`×`w` pixels; the side the image did not fill loses ⌊pad/2⌋ from each
/// end (so an odd difference keeps one padding row or column).
pub fn unpadded(h: usize, w: usize, cur_h: usize, cur_w: usize) -> (std::ops::Range<usize>, std::ops::Range<usize>) {
    let (oh, ow, ch, cw) = (h as f64, w as f64, cur_h as f64, cur_w as f64);
    if ow / oh > cw / ch {
        let new_h = round7(oh * (cw / ow)) as usize;
        let pad = cur_h.saturating_sub(new_h) / 2;
        (pad..cur_h - pad, 0..cur_w)
    } else {
        let new_w = round7(ow * (ch / oh)) as usize;
        let pad = cur_w.saturating_sub(new_w) / 2;
        (0..cur_h, pad..cur_w - pad)
    }
}

/// Python's `round(x, 7)` for the non-negative sizes `unpadded` meets, then
/// `int()`: round half to even at the seventh decimal.
fn round7(x: f64) -> f64 {
    let s = x * 1e7;
    let r = s.round();
    let r = if (s - s.trunc()).abs() == 0.5 && r % 2.0 != 0.0 { r - 1.0 } else { r };
    (r / 1e7).trunc()
}

/// A LLaVA checkpoint's tensor under one name whatever its layout:
/// published llava-hf checkpoints (`vision_tower.vision_model.*`,
/// `language_model.model.*`, `language_model.lm_head.*`), what
/// transformers 5 saves (`vision_tower.*`, the same language-model names)
/// and its in-memory names (`model.vision_tower.*`, `model.language_model.*`,
/// `model.multi_modal_projector.*`, `model.image_newline`) all become
/// `vision_tower.*` (no `vision_model.`), `multi_modal_projector.*`,
/// `image_newline`, and the decoder's Llama names (`model.*`, `lm_head.*`).
pub fn canonical_name(name: &str) -> String {
    let name = name.strip_prefix("model.").filter(|r| !r.starts_with("layers.") && !r.starts_with("embed_tokens.") && !r.starts_with("norm.")).unwrap_or(name);
    if let Some(rest) = name.strip_prefix("language_model.model.") {
        format!("model.{rest}")
    } else if let Some(rest) = name.strip_prefix("language_model.lm_head.") {
        format!("lm_head.{rest}")
    } else if let Some(rest) = name.strip_prefix("language_model.") {
        format!("model.{rest}")
    } else if let Some(rest) = name.strip_prefix("vision_tower.vision_model.") {
        format!("vision_tower.{rest}")
    } else {
        name.to_string()
    }
}

/// One row of NeXT's packed image sequence.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Packed {
    /// Row `i` of the base image's features (tower image 0).
    Base(usize),
    /// The feature of patch (`r`, `c`) of the whole tile grid (row-major
    /// over the grid of tiles × patches), held by projector row `row`.
    Grid { r: usize, c: usize, row: usize },
    /// `image_newline`, after each kept grid row.
    Newline,
}

impl Packed {
    /// The projector row this packed row copies (None: `image_newline`).
    pub fn projector_row(self) -> Option<usize> {
        match self {
            Packed::Base(i) | Packed::Grid { row: i, .. } => Some(i),
            Packed::Newline => None,
        }
    }
}

/// The patch grid (rows, columns) of the tiles of pinpoint `best` (h, w).
pub fn patch_grid(cfg: &LlavaConfig, best: (usize, usize)) -> (usize, usize) {
    let (s, side) = (cfg.tower.image_size, cfg.tower.side());
    (best.0 / s * side, best.1 / s * side)
}

/// NeXT's packed sequence given the kept `rows` and `cols` of pinpoint
/// `best`'s patch grid: the base image's N rows, then per kept row its kept
/// columns and one newline row. Patch (r, c) is tile (r / side, c / side),
/// tower image 1 + the tile's row-major index (the processor's order).
pub fn pack_order(
    cfg: &LlavaConfig,
    best: (usize, usize),
    rows: std::ops::Range<usize>,
    cols: std::ops::Range<usize>,
) -> Vec<Packed> {
    let (n, side) = (cfg.tower.patches(), cfg.tower.side());
    let tiles_w = best.1 / cfg.tower.image_size;
    let mut out: Vec<Packed> = (0..n).map(Packed::Base).collect();
    for r in rows {
        out.extend(cols.clone().map(|c| {
            let tile = 1 + (r / side) * tiles_w + c / side;
            Packed::Grid { r, c, row: tile * n + (r % side) * side + c % side }
        }));
        out.push(Packed::Newline);
    }
    out
}

/// NeXT's packed sequence for an `h`×`w` image (`pack_image_features`, the
/// default strategy): `pack_order` over the rows and columns `unpad_image`
/// keeps of the best pinpoint's patch grid.
pub fn packed_rows(cfg: &LlavaConfig, h: usize, w: usize) -> Result<Vec<Packed>, String> {
    let pins = cfg.pinpoints.as_ref().ok_or("not a LLaVA-NeXT model")?;
    if cfg.select != Select::Default {
        return Err("LLaVA-NeXT's packing with the `full` strategy is not implemented".into());
    }
    let best = best_resolution(h, w, pins);
    let (gh, gw) = patch_grid(cfg, best);
    let (rows, cols) = unpadded(h, w, gh, gw);
    Ok(pack_order(cfg, best, rows, cols))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn next_config() -> LlavaConfig {
        LlavaConfig::from_json(&serde_json::json!({
            "model_type": "llava_next",
            "vision_config": {"model_type": "clip_vision_model", "hidden_size": 32, "num_attention_heads": 2,
                              "intermediate_size": 64, "num_hidden_layers": 3, "patch_size": 14, "image_size": 56},
            "image_grid_pinpoints": [[56, 112], [112, 56], [112, 112]],
            "image_token_index": 5
        }))
        .unwrap()
    }

    #[test]
    fn the_feature_layer_and_defaults_follow_hf() {
        let c = next_config();
        // -2 of 4 hidden states (pre_layrnorm's output and 3 blocks): index 2.
        assert_eq!((c.feature_layer, c.select, c.rows_per_image()), (2, Select::Default, 16));
        assert_eq!((c.tower.side(), c.image_token, c.projector_bias), (4, 5, true));
        let bad = serde_json::json!({"model_type": "llava", "vision_config": {"hidden_act": "gelu"}});
        assert!(LlavaConfig::from_json(&bad).unwrap_err().contains("quick_gelu"));
        let bad = serde_json::json!({"model_type": "llava", "vision_config": {}, "vision_feature_layer": -30});
        assert!(LlavaConfig::from_json(&bad).unwrap_err().contains("outside"));
    }

    #[test]
    fn every_llava_layout_maps_to_one_set_of_names() {
        for (from, to) in [
            ("vision_tower.vision_model.pre_layrnorm.weight", "vision_tower.pre_layrnorm.weight"),
            ("vision_tower.pre_layrnorm.weight", "vision_tower.pre_layrnorm.weight"),
            ("model.vision_tower.pre_layrnorm.weight", "vision_tower.pre_layrnorm.weight"),
            ("language_model.model.layers.0.mlp.up_proj.weight", "model.layers.0.mlp.up_proj.weight"),
            ("model.language_model.layers.0.mlp.up_proj.weight", "model.layers.0.mlp.up_proj.weight"),
            ("language_model.lm_head.weight", "lm_head.weight"),
            ("lm_head.weight", "lm_head.weight"),
            ("model.multi_modal_projector.linear_1.bias", "multi_modal_projector.linear_1.bias"),
            ("model.image_newline", "image_newline"),
            ("model.norm.weight", "model.norm.weight"),
        ] {
            assert_eq!(canonical_name(from), to, "{from}");
        }
    }

    #[test]
    fn best_resolution_and_unpadding_match_hf() {
        let pins = [(56, 112), (112, 56), (112, 112)];
        // Values from transformers' select_best_resolution.
        assert_eq!(best_resolution(56, 70, &pins), (56, 112));
        assert_eq!(best_resolution(112, 56, &pins), (112, 56));
        assert_eq!(best_resolution(100, 100, &pins), (112, 112));
        // 56×70 on a 4×8 grid: new width round(70·4/56) = 5, 3 padding
        // columns, ⌊3/2⌋ = 1 off each end: columns 1..7 kept.
        assert_eq!(unpadded(56, 70, 4, 8), (0..4, 1..7));
        // Exactly filled: nothing removed.
        assert_eq!(unpadded(56, 112, 4, 8), (0..4, 0..8));
        // Taller than the grid: rows go.
        assert_eq!(unpadded(70, 56, 8, 4), (1..7, 0..4));
    }

    #[test]
    fn packed_rows_put_a_newline_after_each_kept_grid_row() {
        let c = next_config();
        let p = packed_rows(&c, 56, 70).unwrap();
        // 16 base rows, then 4 grid rows of 6 kept columns and a newline each.
        assert_eq!(p.len(), 16 + 4 * 7);
        // Columns 1..7 of the 4×8 grid: tile 0's patch (0, 1) is projector
        // row 16 + 1 (after the base image's 16), tile 1's (0, 6) row 32 + 2.
        assert_eq!(p[16], Packed::Grid { r: 0, c: 1, row: 17 });
        assert_eq!(p[21], Packed::Grid { r: 0, c: 6, row: 34 });
        assert_eq!(p[22], Packed::Newline);
        assert_eq!(p[23], Packed::Grid { r: 1, c: 1, row: 21 });
        assert_eq!(p.iter().filter(|r| **r == Packed::Newline).count(), 4);
    }
}
