//! `names:` in a spec: an engine's own tensor names mapped onto canonical
//! stages, so dumps and protocol output can use whatever the engine calls
//! them (`"layers.{i}.attn.q_proj.out": "blk.{i}.q"`). Canonical names always
//! pass through unmapped. With `reshape: true` a tensor holding the right
//! number of values in another shape (`[T, H·D]` for q) is viewed in the
//! canonical shape; without it, its shape is checked as it is.

use crate::stage::pattern::StageTemplate;
use crate::stage::Stage;

#[derive(Clone, Debug, PartialEq)]
pub struct NameRule {
    /// The engine's name, `{i}` standing for the layer (at most once).
    pub pattern: String,
    pub stage: StageTemplate,
    pub reshape: bool,
}

#[derive(Clone, Debug, Default, PartialEq)]
pub struct NameMap {
    rules: Vec<NameRule>,
}

impl NameMap {
    /// Validates the rules: `{i}` at most once in a pattern, and on both sides
    /// or neither (a per-layer name cannot map onto one fixed stage).
    pub fn new(rules: Vec<NameRule>) -> Result<NameMap, String> {
        for r in &rules {
            let n = r.pattern.matches("{i}").count();
            if n > 1 {
                return Err(format!("names: `{}` has `{{i}}` more than once", r.pattern));
            }
            let templated = r.stage.as_str().contains("{i}");
            if (n == 1) != templated {
                return Err(format!(
                    "names: `{}` → `{}`: use `{{i}}` on both sides or on neither",
                    r.pattern,
                    r.stage.as_str()
                ));
            }
            if r.pattern.is_empty() || r.pattern.contains('/') {
                return Err(format!(
                    "names: `{}` must be a tensor name without its `<step>/` prefix",
                    r.pattern
                ));
            }
        }
        Ok(NameMap { rules })
    }

    pub fn is_empty(&self) -> bool {
        self.rules.is_empty()
    }

    /// The canonical stage an engine's tensor name stands for (and whether to
    /// reshape it), or `None` for a name neither canonical nor mapped.
    pub fn resolve(&self, name: &str) -> Option<(Stage, bool)> {
        if let Some(s) = Stage::parse(name) {
            return Some((s, false));
        }
        self.rules.iter().find_map(|r| {
            let layer = match_layer(&r.pattern, name)?;
            r.stage.resolve(layer).map(|s| (s, r.reshape))
        })
    }
}

/// The layer `{i}` matched in `name` (0 when the pattern has none).
fn match_layer(pattern: &str, name: &str) -> Option<usize> {
    match pattern.split_once("{i}") {
        None => (pattern == name).then_some(0),
        Some((pre, post)) => {
            let mid = name.strip_prefix(pre)?.strip_suffix(post)?;
            if mid.is_empty() || !mid.bytes().all(|b| b.is_ascii_digit()) || mid.len() > 6 {
                return None;
            }
            mid.parse().ok()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::stage::BlockStage;

    fn map(rules: &[(&str, &str, bool)]) -> Result<NameMap, String> {
        NameMap::new(
            rules
                .iter()
                .map(|(p, s, r)| NameRule {
                    pattern: p.to_string(),
                    stage: StageTemplate::parse(s).unwrap(),
                    reshape: *r,
                })
                .collect(),
        )
    }

    #[test]
    fn engine_names_map_onto_canonical_stages() {
        let m = map(&[
            ("layers.{i}.attn.q_proj.out", "blk.{i}.q", true),
            ("final_norm", "output_norm", false),
        ])
        .unwrap();
        assert_eq!(
            m.resolve("layers.12.attn.q_proj.out"),
            Some((Stage::Block(12, BlockStage::Q), true))
        );
        assert_eq!(m.resolve("final_norm"), Some((Stage::OutputNorm, false)));
        assert_eq!(
            m.resolve("blk.0.k"),
            Some((Stage::Block(0, BlockStage::K), false)),
            "canonical passes"
        );
        assert_eq!(m.resolve("layers.x.attn.q_proj.out"), None);
        assert_eq!(m.resolve("layers..attn.q_proj.out"), None);
        assert_eq!(m.resolve("something_else"), None);
    }

    #[test]
    fn bad_rules_are_refused() {
        assert!(map(&[("a.{i}.{i}", "blk.{i}.q", false)]).is_err());
        assert!(map(&[("layers.{i}.q", "output_norm", false)]).is_err());
        assert!(map(&[("final", "blk.{i}.q", false)]).is_err());
        assert!(map(&[("prefill/x", "embed", false)]).is_err());
    }
}
