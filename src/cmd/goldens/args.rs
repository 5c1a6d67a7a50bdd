//! What `goldens regen` tells each recorder: the spec's prompt (or the one
//! the current golden was recorded with), its `record:` subset, and the
//! auxiliary stages a compact recording keeps for the floors (`aux`).

use std::path::Path;

use super::job::RecordArgs;
use crate::error::{Error, Result};
use crate::golden::GoldenSet;

/// The prompt arguments of the HF recorder (llama.cpp's is fed the HF
/// golden's tokens): the spec's prompt (token ids as given, or text), else
/// the one the current golden was recorded with, so a regen records the same
/// prompt and number of decode steps. With neither, regen refuses: a
/// recorder's default prompt is never substituted for the spec's.
pub(super) fn prompt_args(spec: &str, golden: &Path, args: &RecordArgs) -> Result<Vec<String>> {
    let current = GoldenSet::load("current", golden).ok();
    let recorded = |ptr: &str| current.as_ref().and_then(|g| g.provenance.pointer(ptr).cloned());
    let mut out = Vec::new();
    let given_ids = |ids: &[u32]| ids.iter().map(u32::to_string).collect::<Vec<_>>().join(",");
    if let Some(ids) = &args.tokens {
        out.extend(["--prompt-tokens".to_string(), given_ids(ids)]);
    } else if let Some(t) = &args.prompt {
        out.extend(["--prompt".to_string(), t.clone()]);
        if args.chat {
            out.push("--chat".to_string());
        }
    } else if recorded("/prompt/given")
        .and_then(|v| v.as_str().map(String::from))
        .as_deref()
        == Some("tokens")
    {
        let ids: Vec<u32> = recorded("/prompt/token_ids")
            .and_then(|v| serde_json::from_value(v).ok())
            .unwrap_or_default();
        out.extend(["--prompt-tokens".to_string(), given_ids(&ids)]);
    } else if let Some(t) = recorded("/prompt/text").and_then(|v| v.as_str().map(String::from)) {
        out.extend(["--prompt".to_string(), t]);
        if recorded("/prompt/chat").and_then(|v| v.as_bool()).unwrap_or(false) {
            out.push("--chat".to_string());
        }
    } else {
        return Err(Error::Usage(format!(
            "spec `{spec}` gives no prompt to record (`prompt: {{text: ...}}` or `prompt: {{tokens: [...]}}`) and \
             {} records none to record again: give the spec a prompt",
            if current.is_some() {
                format!("its golden {}", golden.display())
            } else {
                format!("its golden {} does not exist yet, so it", golden.display())
            }
        )));
    }
    if let Some(n) = decode_steps(golden, args) {
        out.extend(["--decode-steps".to_string(), n.to_string()]);
    }
    Ok(out)
}

/// record_vlm.py's arguments: the spec's text (with its one
/// `<|image_pad|>`), image, chat flag and decode steps. A VLM spec records
/// every stage of every step; a `record:` subset is refused, not ignored.
pub(super) fn vlm_args(spec: &str, golden: &Path, args: &RecordArgs) -> Result<Vec<String>> {
    let (Some(text), Some(image)) = (&args.prompt, &args.image) else {
        return Err(Error::Usage(format!(
            "spec `{spec}` has `prompt.image` but no `prompt.text`: a vision-language golden is recorded from the text \
             (holding the model's image placeholder once: Qwen-VL's `<|image_pad|>`, LLaVA's `<image>`) and the image"
        )));
    };
    if args.config_override.is_some() {
        return Err(Error::Usage(format!(
            "spec `{spec}`: `config:` overrides are not supported for vision-language goldens (record_vlm.py does \
             not apply them)"
        )));
    }
    if args.steps.is_some()
        || args.stages.is_some()
        || args.rows.is_some()
        || args.logits_last
        || !args.stages_at.is_empty()
    {
        return Err(Error::Usage(format!(
            "spec `{spec}`: `record:` subsets are not supported for vision-language goldens (record_vlm.py records \
             every stage)"
        )));
    }
    let mut out = vec![
        "--prompt".to_string(),
        text.clone(),
        "--image".to_string(),
        image.display().to_string(),
    ];
    if args.chat {
        out.push("--chat".into());
    }
    // Without `prompt.decode_steps`, the current golden's count (as text specs).
    let current = GoldenSet::load("current", golden).ok();
    let steps = args.decode_steps.map(|n| n as u64).or_else(|| {
        current
            .as_ref()
            .and_then(|g| g.provenance.get("decode_steps").and_then(|v| v.as_u64()))
    });
    if let Some(n) = steps {
        out.extend(["--decode-steps".to_string(), n.to_string()]);
    }
    Ok(out)
}

/// The subset arguments (`record:`), the same for both recorders, and the
/// spec's config override, which both apply.
pub(super) fn subset_args(args: &RecordArgs) -> Vec<String> {
    let mut out = Vec::new();
    if let Some(c) = &args.config_override {
        out.extend(["--config-override".to_string(), c.clone()]);
    }
    if let Some(s) = &args.steps {
        out.extend(["--steps".to_string(), s.join(",")]);
    }
    if let Some(s) = &args.stages {
        out.extend(["--stages".to_string(), s.join(",")]);
    }
    for (step, pats) in &args.stages_at {
        out.extend(["--stages-at".to_string(), format!("{step}={}", pats.join(","))]);
    }
    if args.logits_last {
        out.extend(["--logits".to_string(), "last".to_string()]);
    }
    if let Some(rows) = &args.rows {
        let rows: Vec<String> = rows.iter().map(i64::to_string).collect();
        out.extend(["--rows".to_string(), rows.join(",")]);
    }
    out
}

/// The decode steps a recording makes: the spec's `prompt.decode_steps`,
/// else the current golden's.
pub(super) fn decode_steps(golden: &Path, args: &RecordArgs) -> Option<u64> {
    args.decode_steps.map(|n| n as u64).or_else(|| {
        GoldenSet::load("current", golden)
            .ok()
            .and_then(|g| g.provenance.get("decode_steps").and_then(|v| v.as_u64()))
    })
}
