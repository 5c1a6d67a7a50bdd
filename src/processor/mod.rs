//! A vision-language model's image processor: a PNG file into the pixels and
//! grid the vision tower reads (the `vision.pixels` stage), as HF's
//! Qwen2-VL image processor computes them (Qwen3-VL uses the same one):
//! RGB, `smart_resize` to sides that are multiples of patch × merge within the
//! pixel bounds, rescale by 1/255 (in f64, rounded to f32), normalise by the
//! mean and std in f32, then cut into patches in merge-window order, each
//! patch repeated over the temporal patch size and flattened as (C, T, P, P).
//!
//! Resampling is not implemented: an image whose size `smart_resize` would
//! change is refused with the size to give it, because a resampler that
//! differs from PIL's bicubic by a rounding would make every golden check of
//! the tower judge a different input. Goldens record the processor's output
//! (`vision.pixels`), so an engine can also be fed exactly those pixels
//! (`prompt: {golden: SOURCE}`).

use std::path::Path;

use serde_json::Value;

use crate::engine::ImageInput;
use crate::error::{Error, Result};
use crate::model::{ImageGrid, ModelConfig};
use crate::tensor::Tensor;

pub mod clip;

/// The settings of `preprocessor_config.json` the maths depends on.
#[derive(Clone, Debug, PartialEq)]
pub struct ProcessorConfig {
    pub patch: usize,
    pub temporal_patch: usize,
    pub merge: usize,
    pub min_pixels: usize,
    pub max_pixels: usize,
    pub rescale: Option<f64>,
    pub normalize: Option<([f32; 3], [f32; 3])>,
}

impl ProcessorConfig {
    /// Reads `<model>/preprocessor_config.json` (an HF model folder).
    pub fn load(model: &Path) -> Result<ProcessorConfig> {
        let path = model.join("preprocessor_config.json");
        let text = std::fs::read_to_string(&path).map_err(|e| Error::io(&path, e))?;
        let v: Value = serde_json::from_str(&text).map_err(|e| Error::model(&path, format!("not valid JSON: {e}")))?;
        Self::from_json(&v).map_err(|m| Error::model(&path, m))
    }

    pub fn from_json(v: &Value) -> std::result::Result<ProcessorConfig, String> {
        let n = |k: &str| -> std::result::Result<usize, String> {
            v.get(k)
                .and_then(Value::as_u64)
                .map(|x| x as usize)
                .ok_or_else(|| format!("missing or non-integer key `{k}`"))
        };
        // transformers 5 writes `size: {shortest_edge, longest_edge}` (pixel
        // counts); older processors `min_pixels` / `max_pixels`.
        let bound = |size_key: &str, old: &str| -> std::result::Result<usize, String> {
            v.get("size")
                .and_then(|s| s.get(size_key))
                .or_else(|| v.get(old))
                .and_then(Value::as_u64)
                .map(|x| x as usize)
                .ok_or_else(|| format!("missing `size.{size_key}` (or `{old}`)"))
        };
        let flag = |k: &str| v.get(k).and_then(Value::as_bool).unwrap_or(true);
        let triple = |k: &str| -> std::result::Result<[f32; 3], String> {
            let a = v
                .get(k)
                .and_then(Value::as_array)
                .filter(|a| a.len() == 3)
                .ok_or_else(|| format!("`{k}` must list 3 numbers"))?;
            let mut out = [0.0f32; 3];
            for (o, x) in out.iter_mut().zip(a) {
                *o = x.as_f64().ok_or_else(|| format!("`{k}` must list 3 numbers"))? as f32;
            }
            Ok(out)
        };
        Ok(ProcessorConfig {
            patch: n("patch_size")?,
            temporal_patch: n("temporal_patch_size")?,
            merge: n("merge_size")?,
            min_pixels: bound("shortest_edge", "min_pixels")?,
            max_pixels: bound("longest_edge", "max_pixels")?,
            rescale: flag("do_rescale").then(|| v.get("rescale_factor").and_then(Value::as_f64).unwrap_or(1.0 / 255.0)),
            normalize: if flag("do_normalize") {
                Some((triple("image_mean")?, triple("image_std")?))
            } else {
                None
            },
        })
    }
}

/// HF's `smart_resize`: the size an image of `h × w` is resized to.
pub fn smart_resize(
    h: usize,
    w: usize,
    factor: usize,
    min: usize,
    max: usize,
) -> std::result::Result<(usize, usize), String> {
    if h == 0 || w == 0 {
        return Err(format!("the image is {h}×{w}"));
    }
    let (hf, wf) = (h as f64, w as f64);
    if hf.max(wf) / hf.min(wf) > 200.0 {
        return Err(format!("aspect ratio {}:{} is above 200", h.max(w), h.min(w)));
    }
    let f = factor as f64;
    // Python's round() rounds halves to even.
    let round = |x: f64| -> f64 {
        let r = x.round();
        if (x - x.trunc()).abs() == 0.5 && r % 2.0 != 0.0 {
            r - x.signum()
        } else {
            r
        }
    };
    let (mut hb, mut wb) = (round(hf / f) * f, round(wf / f) * f);
    if hb * wb > max as f64 {
        let beta = (hf * wf / max as f64).sqrt();
        hb = f.max((hf / beta / f).floor() * f);
        wb = f.max((wf / beta / f).floor() * f);
    } else if hb * wb < min as f64 {
        let beta = (min as f64 / (hf * wf)).sqrt();
        hb = (hf * beta / f).ceil() * f;
        wb = (wf * beta / f).ceil() * f;
    }
    Ok((hb as usize, wb as usize))
}

/// Decodes a PNG to 8-bit RGB, row-major `[H, W, 3]`.
pub(super) fn read_png(path: &Path) -> Result<(usize, usize, Vec<u8>)> {
    let bad = |msg: String| Error::tensor_file(path, msg);
    let file = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
    let mut dec = png::Decoder::new(std::io::BufReader::new(file));
    dec.set_transformations(png::Transformations::EXPAND | png::Transformations::STRIP_16);
    let mut reader = dec
        .read_info()
        .map_err(|e| bad(format!("not a readable PNG image: {e}")))?;
    let mut buf = vec![0u8; reader.output_buffer_size()];
    let info = reader
        .next_frame(&mut buf)
        .map_err(|e| bad(format!("the PNG image data is corrupt or truncated: {e}")))?;
    let (w, h) = (info.width as usize, info.height as usize);
    let px = &buf[..info.buffer_size()];
    // HF converts to RGB (PIL's convert("RGB"): grey repeated, alpha dropped).
    let rgb: Vec<u8> = match info.color_type {
        png::ColorType::Rgb => px.to_vec(),
        png::ColorType::Rgba => px.chunks_exact(4).flat_map(|p| [p[0], p[1], p[2]]).collect(),
        png::ColorType::Grayscale => px.iter().flat_map(|&g| [g, g, g]).collect(),
        png::ColorType::GrayscaleAlpha => px.chunks_exact(2).flat_map(|p| [p[0], p[0], p[0]]).collect(),
        png::ColorType::Indexed => return Err(bad("an indexed PNG was not expanded".into())),
    };
    Ok((h, w, rgb))
}

/// The processed image at `path` for `cfg`'s vision tower, with the settings
/// of the model folder's `preprocessor_config.json`.
pub fn process(path: &Path, model: &Path, cfg: &ModelConfig) -> Result<ImageInput> {
    let bad = |msg: String| Error::tensor_file(path, msg);
    let Some(vc) = &cfg.vision else {
        return Err(bad(format!(
            "the prompt has an image but the model ({}) has no vision tower",
            cfg.arch
        )));
    };
    if !model.is_dir() {
        return Err(bad(
            "the model is not an HF folder: its image processor settings (preprocessor_config.json) are needed".into(),
        ));
    }
    if let Some(lc) = &vc.llava {
        let c = clip::process(path, model, lc)?;
        let side = lc.tower.side();
        return Ok(ImageInput {
            grid: ImageGrid {
                t: c.pixels.shape()[0],
                h: side,
                w: side,
            },
            pixels: c.pixels,
            size: Some(c.size),
            path: Some(path.to_path_buf()),
            origin: path.display().to_string(),
        });
    }
    let pc = ProcessorConfig::load(model)?;
    if (pc.patch, pc.temporal_patch, pc.merge) != (vc.patch, vc.temporal_patch, vc.merge) {
        return Err(Error::model(
            model.join("preprocessor_config.json"),
            format!(
                "patch {}, temporal {}, merge {} disagree with the vision config's {}, {}, {}",
                pc.patch, pc.temporal_patch, pc.merge, vc.patch, vc.temporal_patch, vc.merge
            ),
        ));
    }
    let (h, w, rgb) = read_png(path)?;
    let (rh, rw) = smart_resize(h, w, vc.factor(), pc.min_pixels, pc.max_pixels).map_err(&bad)?;
    if (rh, rw) != (h, w) {
        return Err(bad(format!(
            "the image is {h}×{w} (H×W); the processor would resize it to {rh}×{rw}, and touchstone's processor \
             does not resample (PIL's bicubic would have to be matched bit for bit): give the image at {rh}×{rw}, \
             or take its pixels from a golden (`prompt: {{golden: SOURCE}}`)"
        )));
    }
    Ok(ImageInput {
        pixels: patchify(&normalise(&rgb, h, w, &pc), h, w, vc.patch, vc.temporal_patch, vc.merge),
        grid: ImageGrid {
            t: 1,
            h: h / vc.patch,
            w: w / vc.patch,
        },
        size: Some((h, w)),
        path: Some(path.to_path_buf()),
        origin: path.display().to_string(),
    })
}

/// Channel-first `[3, H, W]` f32 values: rescaled in f64 then rounded (HF's
/// `rescale`), then `(x − mean) / std` in f32 (HF's `normalize`).
fn normalise(rgb: &[u8], h: usize, w: usize, pc: &ProcessorConfig) -> Vec<f32> {
    normalise_with(rgb, h, w, pc.rescale, pc.normalize)
}

/// `normalise` with the rescale factor and (mean, std) given.
pub(super) fn normalise_with(
    rgb: &[u8],
    h: usize,
    w: usize,
    rescale: Option<f64>,
    normalize: Option<([f32; 3], [f32; 3])>,
) -> Vec<f32> {
    let mut out = vec![0.0f32; 3 * h * w];
    for (i, px) in rgb.chunks_exact(3).enumerate() {
        for c in 0..3 {
            let mut v = match rescale {
                Some(s) => (px[c] as f64 * s) as f32,
                None => px[c] as f32,
            };
            if let Some((mean, std)) = normalize {
                v = (v - mean[c]) / std[c];
            }
            out[c * h * w + i] = v;
        }
    }
    out
}

/// `[3, H, W]` into `[N, C·T·P·P]` patches in merge-window order.
fn patchify(img: &[f32], h: usize, w: usize, p: usize, t: usize, m: usize) -> Tensor {
    let (gh, gw) = (h / p, w / p);
    let width = 3 * t * p * p;
    let mut out = Vec::with_capacity(gh * gw * width);
    for bh in 0..gh / m {
        for bw in 0..gw / m {
            for ih in 0..m {
                for iw in 0..m {
                    let (ph, pw) = (bh * m + ih, bw * m + iw);
                    for c in 0..3 {
                        for _ in 0..t {
                            for y in 0..p {
                                let row = c * h * w + (ph * p + y) * w + pw * p;
                                out.extend_from_slice(&img[row..row + p]);
                            }
                        }
                    }
                }
            }
        }
    }
    Tensor::new(vec![gh * gw, width], out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn smart_resize_matches_hf() {
        // Values computed with transformers' smart_resize.
        assert_eq!(smart_resize(112, 168, 28, 3136, 12845056).unwrap(), (112, 168));
        assert_eq!(smart_resize(100, 100, 28, 3136, 12845056).unwrap(), (112, 112));
        assert_eq!(smart_resize(224, 320, 32, 65536, 16777216).unwrap(), (224, 320));
        assert_eq!(smart_resize(64, 96, 32, 65536, 16777216).unwrap(), (224, 320));
        // round(1.5) = 2, round(2.5) = 2 (half to even).
        assert_eq!(smart_resize(42, 70, 28, 1, 1 << 30).unwrap(), (56, 56));
        assert!(smart_resize(1, 300, 28, 1, 1 << 30)
            .unwrap_err()
            .contains("aspect ratio"));
    }

    #[test]
    fn patches_are_in_merge_window_order_and_repeat_over_time() {
        // 1 channel-plane per colour: value = c·100 + y·10 + x on a 4×4 image,
        // patch 1, merge 2, temporal 2.
        let (h, w) = (2, 4);
        let mut img = vec![0.0f32; 3 * h * w];
        for c in 0..3 {
            for y in 0..h {
                for x in 0..w {
                    img[c * h * w + y * w + x] = (c * 100 + y * 10 + x) as f32;
                }
            }
        }
        let t = patchify(&img, h, w, 1, 2, 2);
        assert_eq!(t.shape(), [8, 6]);
        // Patch order (y, x): (0,0) (0,1) (1,0) (1,1) (0,2) (0,3) (1,2) (1,3).
        let firsts: Vec<f32> = t.data().chunks(6).map(|p| p[0]).collect();
        assert_eq!(firsts, [0.0, 1.0, 10.0, 11.0, 2.0, 3.0, 12.0, 13.0]);
        // Within a patch: (C, T): c0 t0, c0 t1, c1 t0, ...
        assert_eq!(&t.data()[6..12], &[1.0, 1.0, 101.0, 101.0, 201.0, 201.0]);
    }
}
