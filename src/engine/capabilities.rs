//! Which stages an engine can tap. Real engines are not built like the CPU
//! engine: flash attention never materialises the scores or probabilities,
//! a fused kernel skips q/k before RoPE, a serving engine shows only logits.
//! A check that reads a stage the engine cannot tap is not applicable to it:
//! reported with the reason, never passed, never failed, never a first
//! divergence. A stage the engine claims and then does not write still fails.

use crate::stage::pattern::StagePattern;
use crate::stage::Stage;

/// What an engine says it can tap (`Engine::capabilities`; a protocol
/// engine's load answer `"taps"` / `"cannot_tap"` / `"why"`).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Capabilities {
    /// The stages it can tap (None: every stage).
    pub taps: Option<Vec<StagePattern>>,
    /// Stages it cannot tap, whatever `taps` says.
    pub cannot_tap: Vec<StagePattern>,
    /// Why, in the engine's words (e.g. "flash attention").
    pub why: Option<String>,
    /// Why the engine cannot take an image (a text-only engine given a
    /// vision-language spec): None when it can. A VLM run on such an engine
    /// is skipped once with this reason, not failed check by check.
    pub no_images: Option<String>,
    /// Batches (`Engine::run_batch`): None when the engine does not take
    /// them; the serving run checks are then not applicable to it.
    pub serving: Option<crate::engine::batch::Serving>,
}

impl Capabilities {
    /// Every stage, and images (the built-in CPU and CUDA engines).
    pub fn all() -> Capabilities {
        Capabilities::default()
    }

    /// Every stage of a text model: what an engine that says nothing about
    /// images gets (`Engine::capabilities`' default). Taking an image is
    /// declared, never assumed: an engine written for text decoders would
    /// otherwise be handed a vision-language spec and fail every check.
    pub fn text_only() -> Capabilities {
        Capabilities {
            no_images: Some(
                "it does not declare that it takes images (a Rust engine: `Engine::capabilities` with \
                 `no_images: None`; a protocol engine: `\"images\": true` in its load answer)"
                    .into(),
            ),
            ..Capabilities::default()
        }
    }

    /// The engine's batch declaration, or why the serving checks are not
    /// applicable to it.
    pub fn serving_or_why(&self) -> Result<&crate::engine::batch::Serving, String> {
        self.serving.as_ref().ok_or_else(|| {
            "not applicable: the engine does not declare batches (a Rust engine: `Capabilities::serving` and \
             `Engine::run_batch`; a protocol engine: `\"batches\"` in its load answer)"
                .to_string()
        })
    }

    /// None when `stage` can be tapped; else why not, for the report.
    pub fn why_not(&self, stage: Stage) -> Option<String> {
        let listed = self.taps.as_ref().is_none_or(|t| t.iter().any(|p| p.matches(stage)));
        let refused = self.cannot_tap.iter().find(|p| p.matches(stage));
        if listed && refused.is_none() {
            return None;
        }
        let how = match refused {
            Some(p) => format!("its `cannot_tap` has `{}`", p.as_str()),
            None => "it is not among the stages its `taps` lists".to_string(),
        };
        let why = self.why.as_deref().map(|w| format!(": {w}")).unwrap_or_default();
        Some(format!("not applicable: the engine cannot tap {stage} ({how}{why})"))
    }

    /// Every stage of the model the engine can tap (`sample_probs` only with
    /// random sampling): what the run checks that tap everything ask for.
    pub fn tappable(&self, cfg: &crate::model::ModelConfig, random_sampling: bool) -> super::TapSet {
        Stage::of_model(cfg, random_sampling)
            .into_iter()
            .filter(|s| self.why_not(*s).is_none())
            .collect()
    }

    /// Reads a load answer's `taps`, `cannot_tap` (lists of stage patterns)
    /// and `why`; absent keys mean every stage.
    pub fn from_answer(answer: &serde_json::Value) -> Result<Capabilities, String> {
        let patterns = |key: &str| -> Result<Option<Vec<StagePattern>>, String> {
            let Some(v) = answer.get(key) else { return Ok(None) };
            let items = v
                .as_array()
                .ok_or_else(|| format!("`{key}` is {v}, expected a list of stage patterns"))?;
            items
                .iter()
                .map(|x| {
                    let s = x
                        .as_str()
                        .ok_or_else(|| format!("`{key}` holds {x}, expected a stage pattern string"))?;
                    StagePattern::parse(s).map_err(|e| format!("`{key}`: {e}"))
                })
                .collect::<Result<Vec<_>, _>>()
                .map(Some)
        };
        let why = match answer.get("why") {
            None => None,
            Some(w) => Some(
                w.as_str()
                    .ok_or_else(|| format!("`why` is {w}, expected a string"))?
                    .to_string(),
            ),
        };
        // `"images": true` declares that the engine takes images; false (or
        // nothing) that it runs text-only models.
        let no_images = match answer.get("images") {
            Some(serde_json::Value::Bool(true)) => None,
            None => Capabilities::text_only().no_images,
            Some(serde_json::Value::Bool(false)) => Some(format!(
                "the engine answered `\"images\": false`: it runs text-only models{}",
                why.as_deref().map(|w| format!(" ({w})")).unwrap_or_default()
            )),
            Some(v) => return Err(format!("`images` is {v}, expected true or false")),
        };
        Ok(Capabilities {
            taps: patterns("taps")?,
            cannot_tap: patterns("cannot_tap")?.unwrap_or_default(),
            why,
            no_images,
            serving: match answer.get("batches") {
                None | Some(serde_json::Value::Null) => None,
                Some(b) => Some(serving_from_answer(b)?),
            },
        })
    }
}

/// A load answer's `"batches": {"block_size", "invariant", "poison",
/// "max_batch"}` (block_size may be null: a cache that is not paged).
fn serving_from_answer(b: &serde_json::Value) -> Result<crate::engine::batch::Serving, String> {
    let obj = b
        .as_object()
        .ok_or_else(|| format!("`batches` is {b}, expected an object {{block_size, invariant, poison, max_batch}}"))?;
    if let Some(k) = obj
        .keys()
        .find(|k| !["block_size", "invariant", "poison", "max_batch"].contains(&k.as_str()))
    {
        return Err(format!(
            "`batches` has an unknown key `{k}` (known: block_size, invariant, poison, max_batch)"
        ));
    }
    let flag = |k: &str| match obj.get(k) {
        None => Ok(false),
        Some(serde_json::Value::Bool(v)) => Ok(*v),
        Some(v) => Err(format!("`batches.{k}` is {v}, expected true or false")),
    };
    let count = |k: &str| -> Result<Option<usize>, String> {
        match obj.get(k) {
            None | Some(serde_json::Value::Null) => Ok(None),
            Some(v) => v
                .as_u64()
                .filter(|&n| n > 0)
                .map(|n| Some(n as usize))
                .ok_or_else(|| format!("`batches.{k}` is {v}, expected a positive integer")),
        }
    };
    Ok(crate::engine::batch::Serving {
        block_size: count("block_size")?,
        invariant: flag("invariant")?,
        poison: flag("poison")?,
        max_batch: count("max_batch")?
            .ok_or("`batches` needs `max_batch`, the most sequences one request may carry")?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::stage::BlockStage;
    use serde_json::json;

    #[test]
    fn a_flash_attention_engine_cannot_tap_scores_and_probs_only() {
        let c = Capabilities::from_answer(&json!({"cannot_tap": ["blk.*.attn_scores", "blk.*.attn_probs"],
                                                  "why": "flash attention"}))
        .unwrap();
        assert!(c.why_not(Stage::Block(3, BlockStage::AttnCtx)).is_none());
        let w = c.why_not(Stage::Block(3, BlockStage::AttnProbs)).unwrap();
        assert!(w.contains("blk.3.attn_probs") && w.contains("flash attention"), "{w}");
        let logits_only = Capabilities::from_answer(&json!({"taps": ["logits"]})).unwrap();
        assert!(logits_only.why_not(Stage::Logits).is_none());
        assert!(logits_only.why_not(Stage::Embed).unwrap().contains("`taps`"));
        assert!(Capabilities::all().why_not(Stage::Embed).is_none());
        let b = Capabilities::from_answer(&json!({"batches": {"block_size": 16, "invariant": true, "max_batch": 8}}))
            .unwrap();
        let sv = b.serving_or_why().unwrap();
        assert_eq!(
            (sv.block_size, sv.invariant, sv.poison, sv.max_batch),
            (Some(16), true, false, 8)
        );
        assert!(Capabilities::all()
            .serving_or_why()
            .unwrap_err()
            .contains("does not declare batches"));
        for bad in [
            json!({"batches": {"max_batch": 0}}),
            json!({"batches": {"max_batch": 2, "paged": true}}),
            json!({"batches": {"invariant": "yes", "max_batch": 2}}),
            json!({"batches": true}),
            json!({"taps": "logits"}),
            json!({"cannot_tap": [3]}),
            json!({"cannot_tap": ["blk.x.q"]}),
        ] {
            assert!(Capabilities::from_answer(&bad).is_err(), "{bad}");
        }
    }
}
