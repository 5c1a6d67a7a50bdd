//! Vision-language specs as a user runs them: the shipped ones pass with
//! their VLM invariants in the report, and every bad image input — missing,
//! not a PNG, a size the processor would resample, another image than the
//! goldens were recorded with, a text without its placeholder, an image for
//! a text model, a LLaVA-NeXT image whose base image would be resampled —
//! is one typed error naming the file and exit 2, never a
//! panic and never a wall of mismatches.

mod common;
use common::*;
use std::path::{Path, PathBuf};

/// specs/qwen2-vl-tiny.yaml with absolute paths, after `edit`, in `dir`.
fn vlm_spec(dir: &Path, edit: impl Fn(String) -> String) -> PathBuf {
    let text = std::fs::read_to_string(root().join("specs/qwen2-vl-tiny.yaml")).unwrap();
    let text = text.replace("../goldens", &root().join("goldens").display().to_string());
    write(dir, "vlm.yaml", &edit(text))
}

/// An 8-bit RGB PNG of `h × w` whose pixels are `f(y, x)`.
fn png(path: &Path, h: u32, w: u32, f: impl Fn(u32, u32) -> [u8; 3]) {
    let file = std::fs::File::create(path).unwrap();
    let mut enc = png::Encoder::new(std::io::BufWriter::new(file), w, h);
    enc.set_color(png::ColorType::Rgb);
    enc.set_depth(png::BitDepth::Eight);
    let f = &f;
    let data: Vec<u8> = (0..h).flat_map(|y| (0..w).flat_map(move |x| f(y, x))).collect();
    enc.write_header().unwrap().write_image_data(&data).unwrap();
}

fn expect_exit2(spec: &Path, needles: &[&str]) {
    let o = touchstone(&["run", &spec.display().to_string()]);
    assert_eq!(o.code, 2, "expected exit 2:\n{}", o.all());
    for n in needles {
        assert!(o.stderr.contains(n), "stderr lacks {n:?}:\n{}", o.stderr);
    }
}

#[test]
fn the_vlm_specs_pass_with_their_invariants_in_the_report() {
    for spec in ["qwen2-vl-tiny", "qwen3-vl-tiny"] {
        let o = touchstone(&["run", &format!("specs/{spec}.yaml"), "-v"]);
        assert_eq!(o.code, 0, "{spec}:\n{}", o.all());
        assert!(o.stdout.contains("PASSED"), "{}", o.stdout);
        // The stage table runs from the processor's pixels to the logits.
        for stage in [
            "vision.pixels",
            "vision.patch_embed",
            "vision.merger",
            "inputs_embeds",
            "positions",
            "logits",
        ] {
            assert!(
                o.stdout.contains(&format!("prefill  {stage} ")),
                "{spec}: no row for {stage}:\n{}",
                o.stdout
            );
        }
        let json = tempfile::NamedTempFile::new().unwrap();
        let o = touchstone(&[
            "run",
            &format!("specs/{spec}.yaml"),
            "--json",
            &json.path().display().to_string(),
        ]);
        assert_eq!(o.code, 0, "{}", o.all());
        let report = std::fs::read_to_string(json.path()).unwrap();
        for id in [
            "prefill/vision.merger::image_tokens",
            "prefill/inputs_embeds::fusion",
            "prefill/positions::mrope",
            "decode1/positions::mrope",
            "prefill/vision.blk.0.attn_probs::bidirectional",
        ] {
            assert!(report.contains(id), "{spec}: the report lacks {id}");
        }
    }
}

#[test]
fn a_missing_image_names_the_file() {
    let d = tempfile::tempdir().unwrap();
    let missing = d.path().join("nope.png");
    let s = vlm_spec(d.path(), |t| {
        t.replace(
            &root().join("goldens/images/grid-112x168.png").display().to_string(),
            &missing.display().to_string(),
        )
    });
    expect_exit2(&s, &[&missing.display().to_string()]);
}

#[test]
fn an_image_that_is_not_a_png_is_refused() {
    let d = tempfile::tempdir().unwrap();
    let bad = write(d.path(), "bad.png", "this is not an image");
    let s = vlm_spec(d.path(), |t| {
        t.replace(
            &root().join("goldens/images/grid-112x168.png").display().to_string(),
            &bad.display().to_string(),
        )
    });
    expect_exit2(&s, &[&bad.display().to_string(), "not a readable PNG"]);
}

#[test]
fn an_image_the_processor_would_resample_says_the_size_to_give() {
    let d = tempfile::tempdir().unwrap();
    let img = d.path().join("small.png");
    png(&img, 100, 100, |y, x| [y as u8, x as u8, 7]);
    let s = vlm_spec(d.path(), |t| {
        t.replace(
            &root().join("goldens/images/grid-112x168.png").display().to_string(),
            &img.display().to_string(),
        )
    });
    expect_exit2(&s, &["100×100", "resize it to 112×112", "does not resample"]);
}

#[test]
fn another_image_than_the_goldens_is_a_stale_golden() {
    let d = tempfile::tempdir().unwrap();
    let img = d.path().join("other.png");
    png(&img, 112, 168, |y, x| [(x * 3) as u8, (y * 2) as u8, 200]);
    let s = vlm_spec(d.path(), |t| {
        t.replace(
            &root().join("goldens/images/grid-112x168.png").display().to_string(),
            &img.display().to_string(),
        )
    });
    expect_exit2(&s, &["was recorded with an image", "goldens regen"]);
}

#[test]
fn a_text_without_its_image_placeholder_is_refused() {
    let d = tempfile::tempdir().unwrap();
    let s = vlm_spec(d.path(), |t| {
        t.replace("<|vision_start|><|image_pad|><|vision_end|>", "")
    });
    expect_exit2(&s, &["prompt.text", "0 image placeholder(s)"]);
}

#[test]
fn an_image_for_a_text_model_is_refused() {
    let d = tempfile::tempdir().unwrap();
    let image = root().join("goldens/images/grid-112x168.png");
    let text = std::fs::read_to_string(root().join("specs/qwen2-tiny.yaml"))
        .unwrap()
        .replace("../goldens", &root().join("goldens").display().to_string())
        .replace(
            "prompt: {golden: hf}",
            &format!("prompt: {{golden: hf, image: {}}}", image.display()),
        );
    let s = write(d.path(), "text.yaml", &text);
    expect_exit2(&s, &["has no vision tower"]);
}

#[test]
fn a_vlm_runs_a_text_prompt_without_vision_stages() {
    let d = tempfile::tempdir().unwrap();
    let model = root().join("goldens/qwen2-vl-tiny/model");
    let s = write(
        d.path(),
        "text.yaml",
        &format!(
            "model: {}\nprompt: {{text: \"Describe the picture in one word.\", chat: true, decode_steps: 2}}\n\
             stages:\n  \"*\": [finite, shape]\n  \"positions\": [mrope]\nrun_checks: [determinism, kv_cache]\n",
            model.display()
        ),
    );
    let o = touchstone(&["run", &s.display().to_string(), "-v"]);
    assert_eq!(o.code, 0, "{}", o.all());
    assert!(
        !o.stdout.contains("vision."),
        "no vision stage without an image:\n{}",
        o.stdout
    );
    assert!(o.stdout.contains("prefill  positions"), "{}", o.stdout);
}

#[test]
fn a_golden_prompt_brings_the_pixels_it_was_recorded_with() {
    let d = tempfile::tempdir().unwrap();
    // No `text` and no `image`: tokens, pixels and grid come from the golden.
    let s = vlm_spec(d.path(), |t| {
        let start = t.find("prompt:\n").unwrap();
        let end = t[start..].find("sampling:").unwrap() + start;
        format!("{}prompt: {{golden: hf}}\n{}", &t[..start], &t[end..])
    });
    let o = touchstone(&["run", &s.display().to_string()]);
    assert_eq!(o.code, 0, "{}", o.all());
    assert!(o.stdout.contains("PASSED"), "{}", o.stdout);
}

/// The LLaVA specs pass with their stage table from the pixels to the
/// logits (no M-RoPE `positions`), and their invariants in the report.
#[test]
fn the_llava_specs_pass_with_their_invariants_in_the_report() {
    for spec in ["llava-tiny", "llava-next-tiny"] {
        let json = tempfile::NamedTempFile::new().unwrap();
        let o = touchstone(&[
            "run",
            &format!("specs/{spec}.yaml"),
            "-v",
            "--json",
            &json.path().display().to_string(),
        ]);
        assert_eq!(o.code, 0, "{spec}:\n{}", o.all());
        for stage in [
            "vision.pixels",
            "vision.pos_embed",
            "vision.pre_norm",
            "vision.features",
            "vision.projector",
            "vision.merger",
            "inputs_embeds",
            "logits",
        ] {
            assert!(o.stdout.contains(&format!("prefill  {stage} ")), "{spec}: no row for {stage}:\n{}", o.stdout);
        }
        assert!(!o.stdout.contains("prefill  positions "), "{spec}: LLaVA has plain positions");
        let report = std::fs::read_to_string(json.path()).unwrap();
        for id in [
            "prefill/vision.features::feature_select",
            "prefill/vision.merger::image_tokens",
            "prefill/vision.merger::packing",
            "prefill/inputs_embeds::fusion",
            "prefill/vision.blk.0.attn_probs::bidirectional",
        ] {
            assert!(report.contains(id), "{spec}: the report lacks {id}");
        }
    }
}

/// LLaVA-NeXT squashes the whole image to the tower's size for its base
/// image: any image that is not that size would be resampled, and is refused
/// with the size to give.
#[test]
fn a_llava_next_image_whose_base_image_would_be_resampled_is_refused() {
    let d = tempfile::tempdir().unwrap();
    let img = d.path().join("wide.png");
    png(&img, 56, 70, |y, x| [y as u8, x as u8, 9]);
    let text = std::fs::read_to_string(root().join("specs/llava-next-tiny.yaml")).unwrap();
    let text = text
        .replace("../goldens", &root().join("goldens").display().to_string())
        .replace(&root().join("goldens/images/grid-56x56.png").display().to_string(), &img.display().to_string());
    let s = write(d.path(), "next.yaml", &text);
    expect_exit2(&s, &[&img.display().to_string(), "base image", "does not resample"]);
}
