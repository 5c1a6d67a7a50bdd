//! How a spec writes its checks: `stages:` maps a stage pattern to a list of
//! checks, each a bare name (`finite`) or a one-key map with its parameters
//! (`{softmax_rows: {tol: 1e-6}}`, `{golden: hf}`), or an exclusion
//! (`{exclude: [golden, references_agree]}`) that takes checks earlier rules
//! planned off the stages the pattern matches. `run_checks:` lists run checks
//! the same way. The names come from the check tables (`checks::stage`,
//! `checks::run`); unknown names and parameters are errors with a suggestion,
//! located by serde_yaml at their line:col.

use std::fmt;
use std::sync::Arc;

use serde::de::{self, Deserialize, Deserializer, MapAccess, Visitor};

use crate::checks::kind::{RunRule, StageRule};
use crate::checks::params::unknown;
use crate::checks::{run, stage};

/// The name of the exclusion item in a stage rule's list.
pub const EXCLUDE: &str = "exclude";

/// One item of a stage rule's list.
#[derive(Clone, Debug)]
pub enum RuleItem {
    /// A check planned at every stage the pattern matches.
    Check(Arc<dyn StageRule>),
    /// Checks taken off the matched stages, by name (`golden`: every golden
    /// check; `golden:llama.cpp`: that source's only).
    Exclude(Vec<String>),
}

impl RuleItem {
    /// Whether this exclusion takes the check with id `id` off.
    pub fn excludes(names: &[String], id: &str) -> bool {
        names
            .iter()
            .any(|n| id == n || id.strip_prefix(n.as_str()).is_some_and(|rest| rest.starts_with(':')))
    }
}

/// `exclude: golden` or `exclude: [golden, references_agree]`; each name is a
/// stage check's name, optionally with its argument (`golden:hf`).
fn exclusion<'de, A: MapAccess<'de>>(map: &mut A) -> Result<Vec<String>, A::Error> {
    #[derive(serde::Deserialize)]
    #[serde(untagged)]
    enum OneOrMany {
        One(String),
        Many(Vec<String>),
    }
    let names = match map.next_value::<OneOrMany>().map_err(|_| {
        de::Error::custom("exclude: expected a check name or a list of check names, e.g. [golden, references_agree]")
    })? {
        OneOrMany::One(n) => vec![n],
        OneOrMany::Many(v) => v,
    };
    if names.is_empty() {
        return Err(de::Error::custom("exclude: the list is empty"));
    }
    for n in &names {
        let kind = n.split_once(':').map_or(n.as_str(), |(k, _)| k);
        if !stage::NAMES.contains(&kind) {
            return Err(unknown("check", kind, stage::NAMES));
        }
    }
    Ok(names)
}

impl<'de> Deserialize<'de> for RuleItem {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = RuleItem;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                write!(
                    f,
                    "a check name ({}) or a one-key map of a check and its parameters, or {{{EXCLUDE}: [CHECK, …]}}",
                    stage::NAMES.join(", ")
                )
            }
            fn visit_str<E: de::Error>(self, s: &str) -> Result<RuleItem, E> {
                stage::bare(s)
                    .map(RuleItem::Check)
                    .ok_or_else(|| unknown("check", s, stage::NAMES))
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<RuleItem, A::Error> {
                let name: String = map
                    .next_key()?
                    .ok_or_else(|| de::Error::custom("empty map: expected one check name as its key"))?;
                let item = if name == EXCLUDE {
                    RuleItem::Exclude(exclusion(&mut map)?)
                } else {
                    match stage::with_value(&name, &mut map)? {
                        Some(rule) => RuleItem::Check(rule),
                        None => return Err(unknown("check", &name, stage::NAMES)),
                    }
                };
                if let Some(extra) = map.next_key::<String>()? {
                    return Err(de::Error::custom(format!(
                        "one check per list item: found `{extra}` beside `{name}`; write them as two items"
                    )));
                }
                Ok(item)
            }
        }
        d.deserialize_any(V)
    }
}

/// One item of `run_checks:`.
#[derive(Clone, Debug)]
pub struct RunItem(pub Arc<dyn RunRule>);

impl<'de> Deserialize<'de> for RunItem {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = RunItem;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                write!(
                    f,
                    "a run check name ({}) or a one-key map with its parameters",
                    run::NAMES.join(", ")
                )
            }
            fn visit_str<E: de::Error>(self, s: &str) -> Result<RunItem, E> {
                run::bare(s)
                    .map(RunItem)
                    .ok_or_else(|| unknown("run check", s, run::NAMES))
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<RunItem, A::Error> {
                let name: String = map
                    .next_key()?
                    .ok_or_else(|| de::Error::custom("empty map: expected one run check name as its key"))?;
                let Some(rule) = run::with_value(&name, &mut map)? else {
                    return Err(unknown("run check", &name, run::NAMES));
                };
                if let Some(extra) = map.next_key::<String>()? {
                    return Err(de::Error::custom(format!(
                        "one run check per list item: found `{extra}` beside `{name}`"
                    )));
                }
                Ok(RunItem(rule))
            }
        }
        d.deserialize_any(V)
    }
}

/// The `stages:` map, kept in file order (later rules override earlier ones).
/// Patterns stay text here and are validated in `Spec::parse`: serde_yaml
/// reports errors on any key after the first at the previous line, so pattern
/// errors are located by searching the text instead.
pub struct StageRules(pub Vec<(String, Vec<RuleItem>)>);

impl<'de> Deserialize<'de> for StageRules {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = StageRules;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a map from stage pattern to a list of checks")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<StageRules, A::Error> {
                let mut rules = Vec::new();
                while let Some(p) = map.next_key::<String>()? {
                    let checks: Vec<RuleItem> = map.next_value()?;
                    rules.push((p, checks));
                }
                Ok(StageRules(rules))
            }
        }
        d.deserialize_map(V)
    }
}
