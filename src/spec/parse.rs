//! From YAML text to a `Spec`: the raw serde shape (`RawSpec`), paths
//! resolved against the spec's folder, and errors located as a compiler
//! locates them (`file:line:col`), including the ones serde_yaml places
//! badly (duplicate keys, top-level scalars, map keys).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::de::{self, Deserializer};
use serde::Deserialize;

use super::rules::{RunItem, StageRules};
use super::{limits, PromptSpec, RecordSpec, Spec, StagePattern, StageTemplate};
use crate::checks::params::TolSpec;
use crate::checks::scaled::ScaledSpec;
use crate::engine::registry::EngineDecl;
use crate::error::{Error, Result};
use crate::sampling::Sampling;
use crate::tensor::DType;

/// `names:` values: a stage template, or `{stage: …, reshape: true}`.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(untagged)]
enum NameTarget {
    Stage(String),
    Full(NameTargetFull),
}

#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
struct NameTargetFull {
    stage: String,
    #[serde(default)]
    reshape: bool,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawSpec {
    name: Option<String>,
    model: PathBuf,
    #[serde(default)]
    goldens: BTreeMap<String, PathBuf>,
    oracle: Option<PathBuf>,
    scaled: Option<ScaledSpec>,
    prompt: PromptSpec,
    #[serde(default = "greedy")]
    sampling: Sampling,
    #[serde(default)]
    seed: u64,
    /// Text here, checked in `Spec::parse`: serde_yaml locates a custom error
    /// in a top-level scalar at 1:1, so a bad dtype is located by searching.
    storage: Option<String>,
    #[serde(default)]
    tolerance: BTreeMap<DTypeKey, TolSpec>,
    stages: StageRules,
    #[serde(default)]
    run_checks: Vec<RunItem>,
    #[serde(default)]
    record: RecordSpec,
    #[serde(default)]
    engines: BTreeMap<String, EngineDecl>,
    #[serde(default)]
    names: BTreeMap<String, NameTarget>,
    emulate: Option<bool>,
    /// Checked in `parse`: a mapping of HF config keys.
    config: Option<serde_yaml::Value>,
    #[serde(default)]
    reference_rules: BTreeMap<String, super::ReferenceRule>,
}

/// `names:` as a validated map; errors are located at the offending name.
fn name_map(path: &Path, text: &str, raw: BTreeMap<String, NameTarget>) -> Result<crate::engine::names::NameMap> {
    use crate::engine::names::{NameMap, NameRule};
    let err = |name: &str, msg: String| error_at(path, locate(text, name), msg);
    let mut rules = Vec::new();
    for (pattern, target) in raw {
        let (stage, reshape) = match target {
            NameTarget::Stage(s) => (s, false),
            NameTarget::Full(f) => (f.stage, f.reshape),
        };
        let stage = StageTemplate::parse(&stage).map_err(|m| err(&pattern, format!("names.{pattern}: {m}")))?;
        rules.push(NameRule {
            pattern: pattern.clone(),
            stage,
            reshape,
        });
    }
    NameMap::new(rules).map_err(|m| Error::SpecInvalid {
        path: path.to_path_buf(),
        msg: m,
    })
}

fn greedy() -> Sampling {
    Sampling::Greedy
}

#[derive(PartialEq, Eq, PartialOrd, Ord)]
struct DTypeKey(DType);
impl<'de> Deserialize<'de> for DTypeKey {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        DType::parse(&s)
            .map(DTypeKey)
            .ok_or_else(|| de::Error::custom(format!("unknown dtype `{s}` (known: f32, f16, bf16)")))
    }
}

/// `config:` as JSON: a non-empty mapping of HF config keys (what
/// `crate::model::ConfigOverride` accepts is checked when the model is read).
fn config_override(v: serde_yaml::Value) -> std::result::Result<serde_json::Value, String> {
    let j: serde_json::Value = serde_json::to_value(&v)
        .map_err(|e| format!("config: not representable as a model config (JSON): {e}"))?;
    match j.as_object() {
        Some(m) if !m.is_empty() => Ok(j),
        _ => Err("config: expected a non-empty mapping of HF config keys (e.g. `rope_scaling: {type: yarn, \
                  factor: 4.0, original_max_position_embeddings: 32768}`)"
            .into()),
    }
}

pub fn parse(path: &Path, text: &str) -> Result<Spec> {
    limits::check_text(text).map_err(|(line, col, msg)| Error::SpecSyntax {
        path: path.to_path_buf(),
        line,
        col,
        msg,
    })?;
    // A duplicate key anywhere is an error (serde's maps are last-wins, so
    // `goldens: {hf: a, hf: b}` would silently check against b): the
    // generic YAML value refuses duplicates at every depth, with location.
    let value = serde_yaml::from_str::<serde_yaml::Value>(text).map_err(|e| duplicate_error(path, text, &e))?;
    // A key an earlier touchstone read, refused with what replaced it.
    if let Some((key, msg)) = super::renamed::find(&value) {
        return Err(error_at(path, locate(text, &format!("{key}:")), msg));
    }
    let raw: RawSpec = serde_yaml::from_str(text).map_err(|e| yaml_error(path, &e))?;
    let dir = path.parent().unwrap_or(Path::new("."));
    let name = raw
        .name
        .unwrap_or_else(|| path.file_stem().and_then(|s| s.to_str()).unwrap_or("spec").to_string());
    let mut stages = Vec::with_capacity(raw.stages.0.len());
    for (text_pattern, checks) in raw.stages.0 {
        let p = StagePattern::parse(&text_pattern).map_err(|msg| {
            let quoted = format!("\"{text_pattern}\"");
            let loc = locate(text, &quoted)
                .map(|(l, c)| (l, c + 1))
                .or_else(|| locate(text, &format!("{text_pattern}:")));
            error_at(path, loc, format!("stages: {msg}"))
        })?;
        stages.push((p, checks));
    }
    let spec = Spec {
        path: path.to_path_buf(),
        name,
        model: match raw
            .model
            .to_str()
            .and_then(|m| m.strip_prefix(crate::model::cache::MODEL_PREFIX))
        {
            Some(name) => crate::model::cache::model_path(name),
            None => dir.join(&raw.model),
        },
        cached_model: raw
            .model
            .to_str()
            .and_then(|m| m.strip_prefix(crate::model::cache::MODEL_PREFIX))
            .map(str::to_string),
        goldens: raw.goldens.into_iter().map(|(k, v)| (k, dir.join(v))).collect(),
        oracle: raw.oracle.map(|o| dir.join(o)),
        scaled: raw.scaled.clone().unwrap_or_default(),
        prompt: PromptSpec {
            image: raw.prompt.image.as_ref().map(|i| dir.join(i)),
            ..raw.prompt
        },
        sampling: raw.sampling,
        seed: raw.seed,
        storage: match &raw.storage {
            None => DType::F32,
            Some(s) => DType::parse(s).ok_or_else(|| {
                let msg = format!("storage: unknown dtype `{s}` (known: f32, f16, bf16)");
                error_at(path, locate_value(text, "storage:", s), msg)
            })?,
        },
        tolerance: raw.tolerance.into_iter().map(|(k, v)| (k.0, v)).collect(),
        stages,
        run_checks: raw.run_checks.into_iter().map(|r| r.0).collect(),
        record: raw.record,
        engines: raw.engines,
        names: name_map(path, text, raw.names)?,
        emulate: raw.emulate.unwrap_or(true),
        reference_rules: raw.reference_rules,
        config: match raw.config {
            None => None,
            Some(v) => Some(config_override(v).map_err(|msg| error_at(path, locate(text, "config:"), msg))?),
        },
    };
    spec.validate_references(text)?;
    spec.validate_scaled(text, raw.scaled.is_some())?;
    spec.validate_engines(text)?;
    spec.validate_record(text)?;
    spec.validate_counts(text)?;
    Ok(spec)
}

/// A spec error at `loc` (line, col), or for the whole file when unknown.
pub(super) fn error_at(path: &Path, loc: Option<(usize, usize)>, msg: String) -> Error {
    match loc {
        Some((line, col)) => Error::SpecSyntax {
            path: path.to_path_buf(),
            line,
            col,
            msg,
        },
        None => Error::SpecInvalid {
            path: path.to_path_buf(),
            msg,
        },
    }
}

/// 1-based line and column of the first occurrence of `needle` outside comments.
pub(super) fn locate(text: &str, needle: &str) -> Option<(usize, usize)> {
    text.lines().enumerate().find_map(|(i, line)| {
        let code = line.split('#').next().unwrap_or("");
        code.find(needle).map(|c| (i + 1, c + 1))
    })
}

/// 1-based line and column of `value` after the first `key` outside comments.
pub(super) fn locate_value(text: &str, key: &str, value: &str) -> Option<(usize, usize)> {
    let (line, col) = locate(text, key)?;
    let rest = &text.lines().nth(line - 1)?[col - 1 + key.len()..];
    rest.find(value).map(|c| (line, col + key.len() + c))
}

/// serde_yaml's message ends in " at line L column C"; we move that to the
/// front as `file:L:C:` like a compiler does.
/// A YAML error from the duplicate-key pass. serde_yaml locates a duplicate
/// key one entry early (at the entry before it), so the duplicate itself is
/// found by searching on from there for the key's second definition.
fn duplicate_error(path: &Path, text: &str, e: &serde_yaml::Error) -> Error {
    let msg = e.to_string();
    let key = msg
        .split("duplicate entry with key \"")
        .nth(1)
        .and_then(|r| r.split('"').next())
        .map(str::to_string);
    match (key, e.location()) {
        (Some(key), Some(loc)) => {
            let defines = |l: &str| {
                let t = l.trim_start().trim_start_matches("- ");
                t.starts_with(&format!("{key}:")) || t.starts_with(&format!("\"{key}\":"))
            };
            let lines: Vec<&str> = text.lines().collect();
            let from = loc.line().saturating_sub(1);
            let hits: Vec<usize> = (from..lines.len()).filter(|&i| defines(lines[i])).take(2).collect();
            let at = if hits.len() == 2 && defines(lines[from]) {
                hits[1]
            } else {
                hits.first().copied().unwrap_or(from)
            };
            let col = lines.get(at).map_or(1, |l| l.len() - l.trim_start().len() + 1);
            let suffix = format!(" at line {} column {}", loc.line(), loc.column());
            Error::SpecSyntax {
                path: path.to_path_buf(),
                line: at + 1,
                col,
                msg: format!("{} (keys must be unique)", msg.strip_suffix(&suffix).unwrap_or(&msg)),
            }
        }
        _ => yaml_error(path, e),
    }
}

fn yaml_error(path: &Path, e: &serde_yaml::Error) -> Error {
    let msg = e.to_string();
    match e.location() {
        Some(loc) => {
            let suffix = format!(" at line {} column {}", loc.line(), loc.column());
            let msg = msg.strip_suffix(&suffix).unwrap_or(&msg).to_string();
            Error::SpecSyntax {
                path: path.to_path_buf(),
                line: loc.line(),
                col: loc.column(),
                msg,
            }
        }
        None => Error::SpecInvalid {
            path: path.to_path_buf(),
            msg,
        },
    }
}
