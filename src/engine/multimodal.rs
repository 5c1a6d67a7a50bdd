//! What every engine checks of a run's image before encoding it: the model
//! has a vision tower, the grid fits the tower's merge size, and the pixel
//! tensor is the grid's patches at the tower's patch width. Shared so that
//! all engines refuse the same images with the same words.

use super::ImageInput;
use crate::error::{Error, Result};
use crate::model::ModelConfig;

pub fn check_image(cfg: &ModelConfig, img: &ImageInput, engine: &str) -> Result<()> {
    let bad = |msg: String| Error::engine(engine, format!("image ({}): {msg}", img.origin));
    let Some(vc) = &cfg.vision else {
        return Err(bad(format!(
            "the model ({}) has no vision tower: a text model cannot take an image",
            cfg.arch
        )));
    };
    if let Some(lc) = &vc.llava {
        return check_llava(lc, img, &bad);
    }
    let g = img.grid;
    if g.t == 0 || g.h == 0 || g.w == 0 || !g.h.is_multiple_of(vc.merge) || !g.w.is_multiple_of(vc.merge) {
        return Err(bad(format!(
            "grid {g} is not a non-empty grid whose h and w are multiples of the merge size {}",
            vc.merge
        )));
    }
    let want = [g.patches(), vc.patch_width()];
    if img.pixels.shape() != want {
        return Err(bad(format!(
            "pixels have shape {:?}; grid {g} at patch width C·T·P·P = {} needs {want:?}",
            img.pixels.shape(),
            vc.patch_width()
        )));
    }
    if let Some(i) = img.pixels.data().iter().position(|v| !v.is_finite()) {
        return Err(bad(format!("pixel value {i} is {}", img.pixels.data()[i])));
    }
    Ok(())
}

/// LLaVA's tower images: `[P, 3, S, S]` finite pixels, P = 1 for LLaVA-1.5
/// and 1 + the best pinpoint's tiles for LLaVA-NeXT (which needs the image's
/// size to know them).
fn check_llava(
    lc: &crate::model::llava::LlavaConfig,
    img: &ImageInput,
    bad: &dyn Fn(String) -> Error,
) -> Result<()> {
    let s = lc.tower.image_size;
    let p = match (&lc.pinpoints, img.size) {
        (None, _) => 1,
        (Some(pins), Some((h, w))) => {
            let (bh, bw) = crate::model::llava::best_resolution(h, w, pins);
            1 + (bh / s) * (bw / s)
        }
        (Some(_), None) => {
            return Err(bad(
                "LLaVA-NeXT needs the image's size (H, W) for its tiles and unpadding; these pixels come without it"
                    .into(),
            ))
        }
    };
    let want = [p, 3, s, s];
    if img.pixels.shape() != want || img.grid.t != p {
        return Err(bad(format!(
            "pixels have shape {:?} (grid t {}); the tower takes {p} image(s) of 3×{s}×{s}: {want:?}",
            img.pixels.shape(),
            img.grid.t
        )));
    }
    if let Some(i) = img.pixels.data().iter().position(|v| !v.is_finite()) {
        return Err(bad(format!("pixel value {i} is {}", img.pixels.data()[i])));
    }
    Ok(())
}
