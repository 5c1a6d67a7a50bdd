//! LLaVA's image processors, as HF's PIL backends compute them
//! (`CLIPImageProcessorPil` for LLaVA-1.5, `LlavaNextImageProcessorPil`):
//! RGB, resize (shortest edge, or NeXT's fit into the best pinpoint), centre
//! crop, rescale by 1/255 (f64, rounded to f32), normalise by the CLIP mean
//! and std in f32, channel-first. NeXT cuts the padded best-resolution image
//! into tower-sized tiles (row-major) after the whole image resized to the
//! tower's size: `[base, tiles…]`; its padding is zeros before rescaling.
//!
//! As for Qwen-VL (`processor`), resampling is not implemented: a step that
//! would resize the image (PIL's bicubic, matched bit for bit or not at all)
//! is refused naming the size that needs none, and a spec can take the
//! pixels from a golden instead.

use std::path::Path;

use serde_json::Value;

use crate::error::{Error, Result};
use crate::model::llava::{best_resolution, LlavaConfig};
use crate::tensor::Tensor;

/// The settings of a LLaVA model's `preprocessor_config.json` the maths reads.
#[derive(Clone, Debug, PartialEq)]
pub struct ClipProcessor {
    /// `size.shortest_edge` (or `size.height` = `size.width`).
    pub shortest_edge: usize,
    /// `crop_size` (height, width), when `do_center_crop`.
    pub crop: Option<(usize, usize)>,
    pub rescale: Option<f64>,
    pub normalize: Option<([f32; 3], [f32; 3])>,
}

impl ClipProcessor {
    pub fn from_json(v: &Value) -> std::result::Result<ClipProcessor, String> {
        let flag = |k: &str| v.get(k).and_then(Value::as_bool).unwrap_or(true);
        let size = v.get("size").ok_or("missing `size`")?;
        let shortest_edge = size
            .get("shortest_edge")
            .or_else(|| size.get("height").filter(|h| size.get("width") == Some(*h)))
            .and_then(Value::as_u64)
            .ok_or("`size` must give `shortest_edge` (or equal `height` and `width`)")? as usize;
        let crop = match flag("do_center_crop") {
            true => {
                let c = v.get("crop_size").ok_or("missing `crop_size`")?;
                let hw = |k: &str| c.get(k).and_then(Value::as_u64).map(|x| x as usize);
                Some((hw("height").ok_or("missing `crop_size.height`")?, hw("width").ok_or("missing `crop_size.width`")?))
            }
            false => None,
        };
        let triple = |k: &str| -> std::result::Result<[f32; 3], String> {
            let a = v.get(k).and_then(Value::as_array).filter(|a| a.len() == 3);
            let a = a.ok_or_else(|| format!("`{k}` must list 3 numbers"))?;
            let mut out = [0.0f32; 3];
            for (o, x) in out.iter_mut().zip(a) {
                *o = x.as_f64().ok_or_else(|| format!("`{k}` must list 3 numbers"))? as f32;
            }
            Ok(out)
        };
        Ok(ClipProcessor {
            shortest_edge,
            crop,
            rescale: flag("do_rescale").then(|| v.get("rescale_factor").and_then(Value::as_f64).unwrap_or(1.0 / 255.0)),
            normalize: match flag("do_normalize") {
                true => Some((triple("image_mean")?, triple("image_std")?)),
                false => None,
            },
        })
    }

    pub fn load(model: &Path) -> Result<ClipProcessor> {
        let path = model.join("preprocessor_config.json");
        let text = std::fs::read_to_string(&path).map_err(|e| Error::io(&path, e))?;
        let v: Value = serde_json::from_str(&text).map_err(|e| Error::model(&path, format!("not valid JSON: {e}")))?;
        Self::from_json(&v).map_err(|m| Error::model(&path, m))
    }
}

/// What the tower reads of one image: `[P, 3, S, S]` pixels (LLaVA-1.5: one
/// image; NeXT: the base image, then the tiles) and the image's size.
#[derive(Clone, Debug)]
pub struct ClipPixels {
    pub pixels: Tensor,
    /// (height, width) of the image as given (NeXT's unpadding reads it).
    pub size: (usize, usize),
}

/// An `h`×`w` RGB image (`[H, W, 3]` bytes).
struct Rgb {
    h: usize,
    w: usize,
    px: Vec<u8>,
}

impl Rgb {
    /// The `ch`×`cw` window at (top, left).
    fn window(&self, top: usize, left: usize, ch: usize, cw: usize) -> Rgb {
        let mut px = Vec::with_capacity(ch * cw * 3);
        for y in top..top + ch {
            px.extend_from_slice(&self.px[(y * self.w + left) * 3..(y * self.w + left + cw) * 3]);
        }
        Rgb { h: ch, w: cw, px }
    }

    /// HF's `center_crop`: the window at ((h − ch) / 2, (w − cw) / 2),
    /// halves rounded down; a crop larger than the image is refused (HF pads).
    fn center_crop(&self, ch: usize, cw: usize) -> std::result::Result<Rgb, String> {
        if ch > self.h || cw > self.w {
            return Err(format!("the crop {ch}×{cw} is larger than the {}×{} image (HF would pad it)", self.h, self.w));
        }
        Ok(self.window((self.h - ch) / 2, (self.w - cw) / 2, ch, cw))
    }

    /// Zero padding to `th`×`tw`, the image centred (⌊pad/2⌋ before).
    fn pad_to(&self, th: usize, tw: usize) -> Rgb {
        let (top, left) = ((th - self.h) / 2, (tw - self.w) / 2);
        let mut px = vec![0u8; th * tw * 3];
        for y in 0..self.h {
            let at = ((top + y) * tw + left) * 3;
            px[at..at + self.w * 3].copy_from_slice(&self.px[y * self.w * 3..(y + 1) * self.w * 3]);
        }
        Rgb { h: th, w: tw, px }
    }
}

/// HF's shortest-edge resize target: the short side becomes `edge`, the
/// long one `int(edge · long / short)`.
fn shortest_edge_size(h: usize, w: usize, edge: usize) -> (usize, usize) {
    let (short, long) = (h.min(w), h.max(w));
    let other = (edge as f64 * long as f64 / short as f64) as usize;
    if h <= w {
        (edge, other)
    } else {
        (other, edge)
    }
}

/// The pixels of the image at `path` for LLaVA model `cfg` (folder `model`).
pub fn process(path: &Path, model: &Path, cfg: &LlavaConfig) -> Result<ClipPixels> {
    let bad = |msg: String| Error::tensor_file(path, msg);
    let pc = ClipProcessor::load(model)?;
    let (h, w, px) = super::read_png(path)?;
    let img = Rgb { h, w, px };
    let side = cfg.tower.image_size;
    let no_resample = |what: &str, to: (usize, usize)| {
        bad(format!(
            "the image is {h}×{w} (H×W); the processor would resize {what} to {}×{}, and touchstone's processor does \
             not resample (PIL's bicubic would have to be matched bit for bit): give an image that needs no resize, \
             or take its pixels from a golden (`prompt: {{golden: SOURCE}}`)",
            to.0, to.1
        ))
    };
    // The tower's view of one image: resize (the identity or refused),
    // centre crop, rescale and normalise.
    let tower_image = |im: &Rgb, what: &str| -> Result<Vec<f32>> {
        let to = shortest_edge_size(im.h, im.w, pc.shortest_edge);
        if to != (im.h, im.w) {
            return Err(no_resample(what, to));
        }
        let im = match pc.crop {
            Some((ch, cw)) => im.center_crop(ch, cw).map_err(&bad)?,
            None => im.window(0, 0, im.h, im.w),
        };
        if (im.h, im.w) != (side, side) {
            return Err(bad(format!("{what} is {}×{} after cropping; the tower takes {side}×{side}", im.h, im.w)));
        }
        Ok(super::normalise_with(&im.px, im.h, im.w, pc.rescale, pc.normalize))
    };
    let mut images = Vec::new();
    match &cfg.pinpoints {
        None => images.push(tower_image(&img, "it")?),
        Some(pins) => {
            // The base image: the whole image resized to side × side.
            if (h, w) != (side, side) {
                return Err(no_resample("the base image", (side, side)));
            }
            images.push(tower_image(&img, "the base image")?);
            let (bh, bw) = best_resolution(h, w, pins);
            let scale = (bw as f64 / w as f64).min(bh as f64 / h as f64);
            if scale != 1.0 {
                let fit = ((h as f64 * scale) as usize, (w as f64 * scale) as usize);
                return Err(no_resample(&format!("it to fit the best resolution {bh}×{bw}"), fit));
            }
            let padded = img.pad_to(bh, bw);
            for ty in 0..bh / side {
                for tx in 0..bw / side {
                    let tile = padded.window(ty * side, tx * side, side, side);
                    images.push(tower_image(&tile, "a tile")?);
                }
            }
        }
    }
    let p = images.len();
    Ok(ClipPixels {
        pixels: Tensor::new(vec![p, 3, side, side], images.concat()),
        size: (h, w),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crops_and_padding_centre_the_image_as_hf() {
        let img = Rgb { h: 2, w: 5, px: (0..30).map(|i| i as u8).collect() };
        // (5 − 2) / 2 = 1: columns 1..3.
        let c = img.center_crop(2, 2).unwrap();
        assert_eq!(c.px, [3, 4, 5, 6, 7, 8, 18, 19, 20, 21, 22, 23]);
        assert!(img.center_crop(3, 2).is_err());
        let p = Rgb { h: 1, w: 1, px: vec![9, 9, 9] }.pad_to(2, 3);
        // ⌊1/2⌋ = 0 rows above, ⌊2/2⌋ = 1 column left.
        assert_eq!(p.px[3..6], [9, 9, 9]);
        assert_eq!(p.px.iter().filter(|&&v| v == 9).count(), 3);
        assert_eq!(shortest_edge_size(56, 70, 56), (56, 70));
        assert_eq!(shortest_edge_size(70, 56, 28), (35, 28));
    }
}
