//! Stage patterns (`*`, `blk.*.attn_probs`, `blk.1.q`, `logits`) and stage
//! templates (`blk.{i}.q`, used by a check that reads a second stage of the same
//! layer). Both are validated when the spec is parsed, so a typo is reported at
//! its line:col with a suggestion, before any model is loaded.

use crate::stage::{generic_stage_names, Stage};
use crate::suggest;

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StagePattern {
    text: String,
}

impl StagePattern {
    pub fn parse(text: &str) -> Result<StagePattern, String> {
        let p = StagePattern { text: text.to_string() };
        // A pattern must be able to match something. Every layer has the same
        // stages, so the index it names (`blk.3.q`, `vision.blk.3.q`) is
        // tried as 0 against a one-layer model: a pattern naming layer 10⁹
        // must not enumerate 10⁹ layers (found by the spec-parser fuzz run).
        let index_at = match (p.named_layer(), p.named_vision_index()) {
            (Some(l), _) => Some((1, l)),
            (None, Some(i)) => Some((2, i)),
            _ => None,
        };
        let probe = match index_at {
            Some((at, i)) => {
                let mut parts: Vec<&str> = p.text.split('.').collect();
                // Only the canonical spelling (`blk.007.q` names no stage).
                if parts[at] == i.to_string() {
                    parts[at] = "0";
                }
                StagePattern { text: parts.join(".") }
            }
            None => p.clone(),
        };
        if Stage::all(1).into_iter().any(|s| probe.matches(s)) {
            return Ok(p);
        }
        let generic = generic_stage_names();
        let shown = text.replace(|c: char| c.is_ascii_digit(), "*");
        let hint = suggest::hint(&shown, generic.iter().map(String::as_str));
        Err(format!(
            "unknown stage pattern `{text}`{hint} (stages: {}; `*` matches any one part, a bare `*` every stage)",
            generic.join(", ")
        ))
    }

    pub fn as_str(&self) -> &str {
        &self.text
    }

    /// Dot-separated parts match one for one; `*` matches any single part; a bare
    /// `*` matches every stage.
    pub fn matches(&self, stage: Stage) -> bool {
        if self.text == "*" {
            return true;
        }
        let name = stage.to_string();
        let (mut pat, mut parts) = (self.text.split('.'), name.split('.'));
        loop {
            match (pat.next(), parts.next()) {
                (None, None) => return true,
                (Some(p), Some(s)) if p == "*" || p == s => {}
                _ => return false,
            }
        }
    }

    /// The vision block or deepstack index the pattern names explicitly
    /// (`vision.blk.3.q`, `vision.deepstack.1`).
    pub fn named_vision_index(&self) -> Option<usize> {
        let mut it = self.text.split('.');
        (it.next() == Some("vision")).then_some(())?;
        matches!(it.next(), Some("blk" | "deepstack")).then_some(())?;
        it.next()?.parse().ok()
    }

    /// The layer index the pattern names explicitly (`blk.3.q` → 3).
    pub fn named_layer(&self) -> Option<usize> {
        let mut it = self.text.split('.');
        (it.next() == Some("blk")).then_some(())?;
        it.next()?.parse().ok()
    }
}

/// A stage name in which `{i}` stands for the layer of the stage being checked.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StageTemplate {
    text: String,
}

impl StageTemplate {
    pub fn parse(text: &str) -> Result<StageTemplate, String> {
        let t = StageTemplate { text: text.to_string() };
        if Stage::parse(&text.replace("{i}", "0")).is_none() {
            let generic = generic_stage_names();
            let hint = suggest::hint(&text.replace("{i}", "*"), generic.iter().map(String::as_str));
            return Err(format!(
                "`{text}` is not a stage name (use `{{i}}` for the layer, e.g. `blk.{{i}}.q`){hint}"
            ));
        }
        Ok(t)
    }

    pub fn as_str(&self) -> &str {
        &self.text
    }

    /// The stage for layer `layer` (`None` only if the result names no stage,
    /// which `parse` rules out for valid layers).
    pub fn resolve(&self, layer: usize) -> Option<Stage> {
        Stage::parse(&self.text.replace("{i}", &layer.to_string()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::stage::BlockStage;

    #[test]
    fn patterns_match_and_typos_are_suggested() {
        let p = StagePattern::parse("blk.*.attn_probs").unwrap();
        assert!(p.matches(Stage::Block(1, BlockStage::AttnProbs)));
        assert!(!p.matches(Stage::Block(1, BlockStage::Q)));
        assert!(StagePattern::parse("*").unwrap().matches(Stage::Logits));
        assert!(StagePattern::parse("blk.*.*")
            .unwrap()
            .matches(Stage::Block(0, BlockStage::Out)));
        assert_eq!(StagePattern::parse("blk.7.q").unwrap().named_layer(), Some(7));
        let err = StagePattern::parse("blk.*.attn_prob").unwrap_err();
        assert!(err.contains("did you mean `blk.*.attn_probs`"), "{err}");
        let err = StagePattern::parse("blk.2.qrope").unwrap_err();
        assert!(err.contains("did you mean `blk.*.q_rope`"), "{err}");
    }

    /// Validation does not grow with the index a pattern names (a fuzz input
    /// naming layer 10⁹ once enumerated 10⁹ layers' stages); a non-canonical
    /// index names no stage.
    #[test]
    fn a_huge_or_odd_layer_index_is_judged_without_enumerating_layers() {
        let t = std::time::Instant::now();
        assert!(StagePattern::parse("blk.4000000000.q").is_ok());
        assert!(StagePattern::parse("vision.blk.4000000000.attn_probs").is_ok());
        assert!(StagePattern::parse("vision.deepstack.123456789").is_ok());
        assert!(t.elapsed() < std::time::Duration::from_millis(200), "{:?}", t.elapsed());
        assert!(StagePattern::parse("blk.007.q").is_err());
        assert!(StagePattern::parse("blk.7.nope").is_err());
        assert!(StagePattern::parse("vision.blk.3.pre_norm").is_err());
        assert!(StagePattern::parse("vision.pre_norm").is_ok());
    }

    #[test]
    fn templates_resolve_per_layer() {
        let t = StageTemplate::parse("blk.{i}.q").unwrap();
        assert_eq!(t.resolve(3), Some(Stage::Block(3, BlockStage::Q)));
        assert!(StageTemplate::parse("blk.{i}.qq").unwrap_err().contains("did you mean"));
    }
}
