//! The prompt a plan runs: the spec's token ids, its text tokenised with the
//! model's own tokenizer, or a golden's recorded prompt with the tokens it fed
//! at each decode step (teacher forcing); and the checks that the references
//! were recorded for this model and these tokens.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

use crate::engine::ImageInput;
use crate::error::{Error, Result};
use crate::golden::{GoldenSet, ORACLE};
use crate::model::ModelConfig;
use crate::spec::Spec;

/// The prompt, the decode steps of the main run and the forced tokens.
pub struct Prompt {
    pub ids: Vec<u32>,
    pub decode_steps: usize,
    pub forced: Option<Vec<u32>>,
    /// A VLM prompt's processed image: from `prompt.image` through
    /// touchstone's processor, or the pixels a golden recorded.
    pub image: Option<Arc<ImageInput>>,
}

/// Resolves the spec's prompt against its model and goldens.
pub fn resolve(
    spec: &Spec,
    model: &Path,
    config: &ModelConfig,
    goldens: &BTreeMap<String, Arc<GoldenSet>>,
) -> Result<Prompt> {
    let invalid = |msg: String| Error::SpecInvalid {
        path: spec.path.clone(),
        msg,
    };
    let mut image = match &spec.prompt.image {
        Some(path) => Some(Arc::new(crate::processor::process(path, model, config)?)),
        None => None,
    };
    // Text is tokenised with the model's own tokenizer; with a golden too,
    // it must give the golden's prompt (checked below), so the text is
    // what a reader sees and the ids are what is compared.
    let text_ids = match &spec.prompt.text {
        Some(text) => {
            let ids = crate::tokenizer::encode_prompt(model, text, spec.prompt.chat)?;
            Some(match (&image, &config.vision) {
                (Some(img), Some(vc)) => {
                    let count = vc.image_tokens(img.grid, img.size).map_err(|m| invalid(format!("prompt.image: {m}")))?;
                    let write = match vc.llava {
                        Some(_) => "`<image>`",
                        None => "`<|vision_start|><|image_pad|><|vision_end|>`",
                    };
                    expand_image_pad(&ids, vc.image_token, count, write)
                        .map_err(|m| invalid(format!("prompt.text: {m}")))?
                }
                _ => ids,
            })
        }
        None => None,
    };
    let explicit = spec.prompt.tokens.clone().or(text_ids.clone());
    let (prompt, decode_steps, forced) = match (&explicit, &spec.prompt.golden) {
        (Some(tokens), None) => (tokens.clone(), spec.prompt.decode_steps.unwrap_or(0), None),
        (_, Some(src)) => {
            let g = &goldens[src];
            let recorded = g.decode_steps();
            let n = spec.prompt.decode_steps.unwrap_or(recorded);
            if n > recorded {
                return Err(invalid(format!(
                    "prompt.decode_steps is {n} but golden `{src}` ({}) recorded only {recorded}",
                    g.path.display()
                )));
            }
            let forced = g
                .forced(n)
                .ok_or_else(|| invalid(format!("golden `{src}` lacks decode-step tokens")))?;
            if let Some(ids) = &text_ids {
                if ids.as_slice() != g.prompt() {
                    return Err(invalid(format!(
                        "prompt.text tokenises to {} ids {:?}, but golden `{src}` ({}) recorded the prompt {:?}: \
                         the golden was recorded for another text or tokenizer (regenerate it: touchstone goldens \
                         regen {})",
                        ids.len(),
                        ids,
                        g.path.display(),
                        g.prompt(),
                        spec.path.display()
                    )));
                }
            }
            // A VLM golden's prompt comes with the pixels it was recorded with.
            if let (None, Some(vc)) = (&image, &config.vision) {
                image = golden_image(g, vc);
            }
            (g.prompt().to_vec(), n, Some(forced))
        }
        (None, None) => unreachable!("Spec::parse requires text, tokens or golden"),
    };
    Ok(Prompt {
        ids: prompt,
        decode_steps,
        forced,
        image,
    })
}

/// The image a golden recorded: `prefill/vision.pixels` with Qwen-VL's
/// `vision.grid`, or LLaVA's `[P, 3, S, S]` tower images with the image's
/// size from the provenance (`image.size`, [H, W]).
fn golden_image(g: &GoldenSet, vc: &crate::model::VisionConfig) -> Option<Arc<ImageInput>> {
    let pixels = g.get(
        crate::stage::Step::Prefill,
        crate::stage::Stage::Vision(crate::stage::VisionStage::Pixels),
    )?;
    let size = g.provenance.pointer("/image/size").and_then(|s| {
        let a = s.as_array().filter(|a| a.len() == 2)?;
        Some((a[0].as_u64()? as usize, a[1].as_u64()? as usize))
    });
    let grid = match &vc.llava {
        Some(lc) => crate::model::ImageGrid {
            t: *pixels.shape().first()?,
            h: lc.tower.side(),
            w: lc.tower.side(),
        },
        None => g.grid?,
    };
    Some(Arc::new(ImageInput {
        pixels: pixels.clone(),
        grid,
        size,
        path: None,
        origin: format!("the pixels golden `{}` recorded ({})", g.source, g.path.display()),
    }))
}

/// The processor's expansion: the text's one image placeholder (token
/// `pad`; `write` says what to write for it) becomes the image's `count`
/// image tokens.
pub fn expand_image_pad(ids: &[u32], pad: u32, count: usize, write: &str) -> std::result::Result<Vec<u32>, String> {
    let at: Vec<usize> = (0..ids.len()).filter(|&i| ids[i] == pad).collect();
    if at.len() != 1 {
        return Err(format!(
            "the text has {} image placeholder(s) (token {pad}) for one image: write {write} once where the image goes",
            at.len()
        ));
    }
    let mut out = ids[..at[0]].to_vec();
    out.extend(std::iter::repeat_n(pad, count));
    out.extend_from_slice(&ids[at[0] + 1..]);
    Ok(out)
}

/// The references fit the run: recorded for this model and prompt, and the
/// oracle fed the tokens the references were.
pub fn check_references(
    spec: &Spec,
    model: &Path,
    config: &ModelConfig,
    goldens: &BTreeMap<String, Arc<GoldenSet>>,
    oracle: Option<&Arc<GoldenSet>>,
    prompt: &[u32],
) -> Result<()> {
    let invalid = |msg: String| Error::SpecInvalid {
        path: spec.path.clone(),
        msg,
    };
    // Goldens recorded for another model or prompt: one clear error, not a wall of mismatches.
    // The oracle is held to the same rule: an exact answer for another model is no answer.
    let mut recorded = goldens.clone();
    if let Some(o) = &oracle {
        recorded.insert(ORACLE.to_string(), Arc::clone(o));
    }
    crate::golden::provenance::check_fresh(model, config, &recorded, spec.prompt.tokens.as_deref())?;
    // Every reference recorded with the spec's `config:` override, and none
    // with one the spec does not make: the override changes the model.
    for (src, g) in &recorded {
        let had = g.provenance.get("config_override").filter(|v| !v.is_null());
        if had != spec.config.as_ref() {
            let show = |v: Option<&serde_json::Value>| v.map_or("none".to_string(), |v| v.to_string());
            return Err(Error::golden(
                &g.path,
                format!(
                    "stale golden: `{src}` was recorded with config override {} but the spec's `config:` is {} — \
                     regenerate with `touchstone goldens regen {}`",
                    show(had),
                    show(spec.config.as_ref()),
                    spec.path.display()
                ),
            ));
        }
    }
    // A VLM golden recorded from another image, or with other processor
    // settings, describes another input: one clear error, not a wall of
    // mismatches from vision.pixels on.
    if let Some(image) = &spec.prompt.image {
        let sha = crate::golden::provenance::sha256_file(image)?;
        let pre = model.join("preprocessor_config.json");
        let pre_sha = crate::golden::provenance::sha256_file(&pre).ok();
        for (src, g) in &recorded {
            let stale = |what: &str, recorded: &str, now: &str| {
                invalid(format!(
                    "golden `{src}` ({}) was recorded with {what} of sha256 {recorded}, the spec's is {now}: it \
                     describes another input (regenerate it: touchstone goldens regen {})",
                    g.path.display(),
                    spec.path.display()
                ))
            };
            if let Some(r) = g.provenance.pointer("/image/sha256").and_then(|v| v.as_str()) {
                if r != sha {
                    return Err(stale(&format!("an image ({})", image.display()), r, &sha));
                }
            }
            if let (Some(r), Some(now)) = (
                g.provenance.get("preprocessor_sha256").and_then(|v| v.as_str()),
                &pre_sha,
            ) {
                if r != now {
                    return Err(stale("a preprocessor_config.json", r, now));
                }
            }
        }
    }
    // ... and it must have been fed the tokens the references were.
    if let Some(o) = &oracle {
        for (src, g) in goldens {
            for (step, toks) in &o.tokens {
                if g.tokens.get(step).is_some_and(|t| t != toks) {
                    return Err(invalid(format!(
                        "the oracle ({}) was recorded with tokens {toks:?} at {step}, golden `{src}` ({}) with {:?}: \
                         record both with the same prompt",
                        o.path.display(),
                        g.path.display(),
                        g.tokens[step]
                    )));
                }
            }
        }
    }
    // Every reference that kept a row subset (`record.rows`) kept the same
    // one at each step, so an engine's tensor has one view to be compared on.
    let mut kept: Option<(&str, &GoldenSet)> = None;
    for (src, g) in &recorded {
        if g.row_subsets().is_empty() {
            continue;
        }
        if let Some((first, f)) = kept {
            for (step, rows) in g.row_subsets() {
                if let Some(other) = f.row_subsets().get(step).filter(|o| *o != rows) {
                    return Err(invalid(format!(
                        "goldens `{first}` ({}) and `{src}` ({}) kept different token rows at {step} ({other:?} vs \
                         {rows:?}): record them with the same `record.rows`",
                        f.path.display(),
                        g.path.display()
                    )));
                }
            }
        } else {
            kept = Some((src, g));
        }
    }
    if let Some(&bad) = prompt.iter().find(|&&t| t as usize >= config.vocab) {
        return Err(invalid(format!(
            "prompt token {bad} is outside the model's vocabulary of {}",
            config.vocab
        )));
    }

    Ok(())
}
