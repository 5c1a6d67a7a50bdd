//! Specs: YAML files that say, per stage, what must hold, plus checks on whole
//! runs. Parsing rejects unknown keys, unknown stage and check names (with a
//! suggestion) and reports every problem as `file:line:col: key.path: message`.
//! Paths inside a spec are relative to the spec file.

pub mod checks;
pub mod limits;

use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};

use serde::de::{self, Deserializer, MapAccess, Visitor};
use serde::Deserialize;

pub use crate::stage::pattern::{StagePattern, StageTemplate};
pub use checks::{DeterminismSpec, KvCacheSpec, RunCheck, StageCheck};

use crate::error::{Error, Result};
use crate::sampling::Sampling;
use crate::tensor::DType;

/// A parsed, validated spec with paths resolved against the spec's folder.
#[derive(Clone, Debug, PartialEq)]
pub struct Spec {
    pub path: PathBuf,
    /// Display name (default: the file stem), used in trial ids.
    pub name: String,
    pub model: PathBuf,
    /// The name after `cache:` when the spec's model lives in touchstone's
    /// cache (`crate::model::cache`), for the "how to fetch it" hint.
    pub cached_model: Option<String>,
    /// Golden source name (`hf`, `llama.cpp`, ...) → golden file.
    pub goldens: BTreeMap<String, PathBuf>,
    /// A float64 recording of the same model, prompt and steps (`oracle:`):
    /// the exact answer every reference and the engine are measured against.
    /// With it, golden checks without explicit atol/rtol use `scaled`.
    pub oracle: Option<PathBuf>,
    /// The scaled tolerance policy's parameters (`scaled:`).
    pub scaled: ScaledSpec,
    pub prompt: PromptSpec,
    pub sampling: SamplingSpec,
    pub seed: u64,
    /// The storage dtype engines run in (`storage:`, default f32): weights and
    /// stage outputs rounded to it, all arithmetic in f32. `--storage` overrides it.
    pub storage: DType,
    /// Per-dtype default golden tolerances overriding the built-in ones.
    pub tolerance: BTreeMap<DType, TolSpec>,
    /// Stage rules in file order; for the same check on the same stage a later
    /// rule replaces an earlier one, so write general rules (`*`) first.
    pub stages: Vec<(StagePattern, Vec<StageCheck>)>,
    pub run_checks: Vec<RunCheck>,
    /// What `goldens regen` records (default: every step and stage, all rows).
    pub record: RecordSpec,
    /// Engines this spec can run besides the built-in ones (`engines:`):
    /// programs speaking the subprocess protocol, by name.
    pub engines: BTreeMap<String, EngineDecl>,
    /// An engine's own tensor names → canonical stages (`names:`), for
    /// protocol output and dumps.
    pub names: crate::engine::names::NameMap,
    /// Whether `--engine all` (and so `cargo test`'s conformance trials)
    /// includes `cuda-emu`, the CUDA engine on the emulated device (`emulate:`,
    /// default true). A model too large to emulate in CI time says `false`;
    /// `--engine cuda-emu` still runs it.
    pub emulate: bool,
}

/// `engines: {NAME: {exec: [COMMAND, ARGS…], timeout_s: 60}}`.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EngineDecl {
    /// The command and its arguments; it runs in the spec's folder.
    pub exec: Vec<String>,
    /// Per-request deadline in seconds (default 120).
    #[serde(default, deserialize_with = "checks::opt_tol_value")]
    pub timeout_s: Option<f64>,
}

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

/// `scaled:` — how the scaled policy turns errors against the oracle into
/// verdicts (see `checks::scaled`, which derives the defaults).
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ScaledSpec {
    /// The engine may be this many times farther from the oracle than the
    /// closest reference is (or than the floor, where that is larger).
    #[serde(default = "default_scaled_factor", deserialize_with = "checks::tol_value")]
    pub factor: f64,
    /// The floor's constant c in c·u·M·(√K + 1): the least error allowed at a
    /// stage of reduction length K and magnitude M, in rounding units u.
    #[serde(default = "default_scaled_floor", deserialize_with = "checks::tol_value")]
    pub floor: f64,
    /// Golden source → the unit roundoff of its arithmetic, for a reference that
    /// computes in a coarser precision by design (llama.cpp quantising
    /// activations to 8 bits: 2^-8); default f32's 2^-24. It sets that
    /// reference's own floor and never widens the engine's allowance against
    /// another reference.
    #[serde(default)]
    pub unit_roundoff: BTreeMap<String, f64>,
}

impl Default for ScaledSpec {
    fn default() -> ScaledSpec {
        ScaledSpec {
            factor: default_scaled_factor(),
            floor: default_scaled_floor(),
            unit_roundoff: BTreeMap::new(),
        }
    }
}

fn default_scaled_factor() -> f64 {
    crate::checks::scaled::DEFAULT_FACTOR
}
fn default_scaled_floor() -> f64 {
    crate::checks::scaled::DEFAULT_FLOOR
}

/// `record:` — a subset of what the recorders write, so that a real model's
/// goldens stay a few MB. Checks are planned only where a golden holds the
/// (step, stage); the logits of a last-row golden are compared on that row.
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RecordSpec {
    /// Steps to record (`prefill`, `decode1`, ...); default all.
    pub steps: Option<Vec<String>>,
    /// Stage patterns to record (`embed`, `blk.0.*`, `logits`); default all.
    pub stages: Option<Vec<String>>,
    /// `all` (default) or `last`: record only the last row of each step's logits.
    #[serde(default)]
    pub logits: LogitsRows,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LogitsRows {
    #[default]
    All,
    Last,
}

impl LogitsRows {
    pub fn as_str(self) -> &'static str {
        match self {
            LogitsRows::All => "all",
            LogitsRows::Last => "last",
        }
    }
}

#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PromptSpec {
    /// Explicit prompt token ids.
    pub tokens: Option<Vec<u32>>,
    /// Prompt text, tokenised with the model's own tokenizer (`tokenizer.json`
    /// beside the weights, or a GGUF's vocabulary and merges).
    pub text: Option<String>,
    /// Wrap `text` in the model's chat template as one user message followed
    /// by the assistant's generation prompt (the model must have a template).
    #[serde(default)]
    pub chat: bool,
    /// Take the prompt, and the tokens fed at each decode step (teacher forcing),
    /// from this golden source's recording.
    pub golden: Option<String>,
    /// Decode steps after the prefill (default: as many as the golden recorded).
    pub decode_steps: Option<usize>,
}

#[derive(Clone, Copy, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TolSpec {
    #[serde(deserialize_with = "checks::tol_value")]
    pub atol: f64,
    #[serde(deserialize_with = "checks::tol_value")]
    pub rtol: f64,
}

/// `greedy` or `{temperature: 0.8, top_k: 40, top_p: 0.95}`.
#[derive(Clone, Debug, PartialEq)]
pub enum SamplingSpec {
    Greedy,
    Random {
        temperature: f32,
        top_k: Option<usize>,
        top_p: Option<f32>,
    },
}

impl SamplingSpec {
    pub fn to_sampling(&self) -> Sampling {
        match *self {
            SamplingSpec::Greedy => Sampling::Greedy,
            SamplingSpec::Random {
                temperature,
                top_k,
                top_p,
            } => Sampling::Random {
                temperature,
                top_k,
                top_p,
            },
        }
    }
}

impl<'de> Deserialize<'de> for SamplingSpec {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(deny_unknown_fields)]
        struct Random {
            temperature: f32,
            top_k: Option<usize>,
            top_p: Option<f32>,
        }
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = SamplingSpec;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("`greedy` or a map {temperature, top_k, top_p}")
            }
            fn visit_str<E: de::Error>(self, s: &str) -> std::result::Result<SamplingSpec, E> {
                match s {
                    "greedy" => Ok(SamplingSpec::Greedy),
                    other => Err(E::custom(format!(
                        "unknown sampling `{other}`: use `greedy` or {{temperature, top_k, top_p}}"
                    ))),
                }
            }
            fn visit_map<A: MapAccess<'de>>(self, map: A) -> std::result::Result<SamplingSpec, A::Error> {
                let r = Random::deserialize(de::value::MapAccessDeserializer::new(map))?;
                if !(r.temperature.is_finite() && r.temperature >= 0.0) {
                    return Err(de::Error::custom("temperature must be a finite number >= 0"));
                }
                if let Some(p) = r.top_p {
                    if !(p > 0.0 && p <= 1.0) {
                        return Err(de::Error::custom("top_p must be in (0, 1]"));
                    }
                }
                if r.top_k == Some(0) {
                    return Err(de::Error::custom("top_k must be at least 1"));
                }
                Ok(SamplingSpec::Random {
                    temperature: r.temperature,
                    top_k: r.top_k,
                    top_p: r.top_p,
                })
            }
        }
        d.deserialize_any(V)
    }
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
    sampling: SamplingSpec,
    #[serde(default)]
    seed: u64,
    /// Text here, checked in `Spec::parse`: serde_yaml locates a custom error
    /// in a top-level scalar at 1:1, so a bad dtype is located by searching.
    storage: Option<String>,
    #[serde(default)]
    tolerance: BTreeMap<DTypeKey, TolSpec>,
    stages: StageRules,
    #[serde(default)]
    run_checks: Vec<RunCheck>,
    #[serde(default)]
    record: RecordSpec,
    #[serde(default)]
    engines: BTreeMap<String, EngineDecl>,
    #[serde(default)]
    names: BTreeMap<String, NameTarget>,
    emulate: Option<bool>,
}

/// `names:` as a validated map; errors are located at the offending name.
fn name_map(path: &Path, text: &str, raw: BTreeMap<String, NameTarget>) -> Result<crate::engine::names::NameMap> {
    use crate::engine::names::{NameMap, NameRule};
    let err = |name: &str, msg: String| match locate(text, name) {
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
    };
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

fn greedy() -> SamplingSpec {
    SamplingSpec::Greedy
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

/// The `stages:` map, kept in file order (later rules override earlier ones).
/// Patterns stay text here and are validated in `Spec::parse`: serde_yaml
/// reports errors on any key after the first at the previous line, so pattern
/// errors are located by searching the text instead.
struct StageRules(Vec<(String, Vec<StageCheck>)>);

impl<'de> Deserialize<'de> for StageRules {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = StageRules;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a map from stage pattern to a list of checks")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> std::result::Result<StageRules, A::Error> {
                let mut rules = Vec::new();
                while let Some(p) = map.next_key::<String>()? {
                    let checks: Vec<StageCheck> = map.next_value()?;
                    rules.push((p, checks));
                }
                Ok(StageRules(rules))
            }
        }
        d.deserialize_map(V)
    }
}

impl Spec {
    pub fn load(path: &Path) -> Result<Spec> {
        let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
        Spec::parse(path, &text)
    }

    /// Parses spec text; `path` names the file in errors and anchors relative paths.
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
        serde_yaml::from_str::<serde_yaml::Value>(text).map_err(|e| duplicate_error(path, text, &e))?;
        let raw: RawSpec = serde_yaml::from_str(text).map_err(|e| yaml_error(path, &e))?;
        let dir = path.parent().unwrap_or(Path::new("."));
        let name = raw
            .name
            .unwrap_or_else(|| path.file_stem().and_then(|s| s.to_str()).unwrap_or("spec").to_string());
        let mut stages = Vec::with_capacity(raw.stages.0.len());
        for (text_pattern, checks) in raw.stages.0 {
            let p = StagePattern::parse(&text_pattern).map_err(|msg| {
                let quoted = format!("\"{text_pattern}\"");
                let (line, col) = locate(text, &quoted)
                    .map(|(l, c)| (l, c + 1))
                    .or_else(|| locate(text, &format!("{text_pattern}:")))
                    .unwrap_or((0, 0));
                if line == 0 {
                    Error::SpecInvalid {
                        path: path.to_path_buf(),
                        msg: format!("stages: {msg}"),
                    }
                } else {
                    Error::SpecSyntax {
                        path: path.to_path_buf(),
                        line,
                        col,
                        msg: format!("stages: {msg}"),
                    }
                }
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
            prompt: raw.prompt,
            sampling: raw.sampling,
            seed: raw.seed,
            storage: match &raw.storage {
                None => DType::F32,
                Some(s) => DType::parse(s).ok_or_else(|| {
                    let msg = format!("storage: unknown dtype `{s}` (known: f32, f16, bf16)");
                    match locate_value(text, "storage:", s) {
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
                })?,
            },
            tolerance: raw.tolerance.into_iter().map(|(k, v)| (k.0, v)).collect(),
            stages,
            run_checks: raw.run_checks,
            record: raw.record,
            engines: raw.engines,
            names: name_map(path, text, raw.names)?,
            emulate: raw.emulate.unwrap_or(true),
        };
        spec.validate_references(text)?;
        spec.validate_scaled(text, raw.scaled.is_some())?;
        spec.validate_engines(text)?;
        spec.validate_record(text)?;
        spec.validate_counts(text)?;
        Ok(spec)
    }

    /// Engine names must not shadow the built-in names or the `exec:`/`dumps:`
    /// forms, must be usable in trial ids, and need a command.
    fn validate_engines(&self, text: &str) -> Result<()> {
        for (name, d) in &self.engines {
            let ok_chars = !name.is_empty()
                && name
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.'));
            let why = if matches!(name.as_str(), "cpu" | "cuda" | "cuda-emu" | "all" | "exec" | "dumps") {
                Some(format!("`{name}` is a built-in engine name; choose another"))
            } else if !ok_chars {
                Some(format!("engine name `{name}`: use letters, digits, `_`, `-` and `.`"))
            } else if d.exec.is_empty() || d.exec[0].is_empty() {
                Some(format!(
                    "engines.{name}.exec needs a command, e.g. [python3, my_engine.py]"
                ))
            } else if d.timeout_s == Some(0.0) {
                Some(format!("engines.{name}.timeout_s is 0: every request would time out"))
            } else {
                None
            };
            if let Some(msg) = why {
                return Err(self.located(text, name, msg));
            }
        }
        Ok(())
    }

    /// `oracle` is a reserved source name; `scaled:` needs an oracle and
    /// names only declared sources; a factor below 1 would fail the oracle's
    /// closest reference itself.
    fn validate_scaled(&self, text: &str, scaled_given: bool) -> Result<()> {
        if self.goldens.contains_key("oracle") {
            return Err(self.located(
                text,
                "oracle",
                "`oracle` is not a golden source name: give the float64 recording as the top-level `oracle:`".into(),
            ));
        }
        if scaled_given && self.oracle.is_none() {
            return Err(self.located(
                text,
                "scaled",
                "`scaled:` sets the policy that measures errors against the oracle, but the spec has no `oracle:`"
                    .into(),
            ));
        }
        if self.scaled.factor < 1.0 {
            return Err(self.located(
                text,
                "factor",
                format!(
                    "scaled.factor is {}: below 1 the closest reference would fail its own allowance",
                    self.scaled.factor
                ),
            ));
        }
        for (src, u) in &self.scaled.unit_roundoff {
            if !self.goldens.contains_key(src) {
                let hint = crate::suggest::hint(src, self.goldens.keys().map(String::as_str));
                return Err(self.located(
                    text,
                    src,
                    format!("scaled.unit_roundoff names `{src}`, which is not declared under `goldens:`{hint}"),
                ));
            }
            if !(u.is_finite() && *u > 0.0 && *u < 1.0) {
                return Err(self.located(
                    text,
                    src,
                    format!("scaled.unit_roundoff.{src} is {u}: a unit roundoff is in (0, 1), e.g. 2^-8 = 0.0039"),
                ));
            }
        }
        Ok(())
    }

    /// Cross-references serde cannot see: golden sources named by checks must be
    /// declared under `goldens:`. Located by searching the text for the name.
    fn validate_references(&self, text: &str) -> Result<()> {
        let declared: Vec<&str> = self.goldens.keys().map(String::as_str).collect();
        let mut named: Vec<(&str, &str)> = Vec::new();
        for (_, checks) in &self.stages {
            for c in checks {
                match c {
                    StageCheck::Golden { source: Some(s), .. } => named.push((s, "golden check")),
                    StageCheck::Golden { source: None, .. } if declared.is_empty() => {
                        return Err(self.located(
                            text,
                            "golden",
                            "a `golden` check needs a golden source, but the spec declares no `goldens:`".into(),
                        ))
                    }
                    _ => {}
                }
            }
        }
        for rc in &self.run_checks {
            if let RunCheck::GreedyTokens { source } = rc {
                match source {
                    Some(s) => named.push((s, "greedy_tokens check")),
                    None if declared.len() != 1 => {
                        return Err(self.located(
                            text,
                            "greedy_tokens",
                            format!(
                                "greedy_tokens needs `source:` when the spec declares {} golden sources",
                                declared.len()
                            ),
                        ))
                    }
                    None => {}
                }
            }
        }
        if let Some(g) = &self.prompt.golden {
            named.push((g, "prompt"));
        }
        for (s, what) in named {
            if !declared.contains(&s) {
                let hint = crate::suggest::hint(s, declared.iter().copied());
                return Err(self.located(
                    text,
                    s,
                    format!(
                        "{what} names golden source `{s}`, which is not declared under `goldens:`{hint} (declared: {})",
                        if declared.is_empty() {
                            "none".to_string()
                        } else {
                            declared.join(", ")
                        }
                    ),
                ));
            }
        }
        let p = &self.prompt;
        if p.chat && p.text.is_none() {
            return Err(self.located(text, "chat", "prompt.chat needs `text:` (the user message)".into()));
        }
        match (&p.tokens, &p.text, &p.golden) {
            (Some(_), Some(_), _) => Err(self.located(
                text,
                "prompt",
                "prompt: give either `tokens` or `text`, not both".into(),
            )),
            (Some(_), None, Some(_)) => Err(self.located(
                text,
                "prompt",
                "prompt: give either `tokens` or `golden`, not both (with `text` and `golden`, the text must \
                 tokenise to the golden's prompt)"
                    .into(),
            )),
            (None, None, None) => Err(self.located(
                text,
                "prompt",
                "prompt: give `text: \"...\"`, `tokens: [ids...]` or `golden: SOURCE`".into(),
            )),
            (Some(t), None, None) if t.is_empty() => Err(self.located(text, "tokens", "prompt.tokens is empty".into())),
            (None, Some(t), _) if t.is_empty() => Err(self.located(text, "text", "prompt.text is empty".into())),
            (_, _, None) if p.decode_steps.is_none() => Err(self.located(
                text,
                "prompt",
                "prompt.decode_steps is required unless the prompt comes from a golden".into(),
            )),
            _ => Ok(()),
        }
    }

    /// Every count within the fixed limits (`limits`); the model's context
    /// length bounds steps further when the plan is built.
    fn validate_counts(&self, text: &str) -> Result<()> {
        let mut checks: Vec<(&str, &str, usize, usize)> = Vec::new();
        if let Some(n) = self.prompt.decode_steps {
            checks.push(("decode_steps", "prompt.decode_steps", n, limits::MAX_DECODE_STEPS));
        }
        if let Some(t) = &self.prompt.tokens {
            checks.push(("tokens", "prompt.tokens (length)", t.len(), limits::MAX_PROMPT_TOKENS));
        }
        for rc in &self.run_checks {
            match rc {
                RunCheck::Determinism(d) => {
                    checks.push(("runs", "determinism.runs", d.runs, limits::MAX_RUNS));
                    checks.push((
                        "decode_steps",
                        "determinism.decode_steps",
                        d.decode_steps,
                        limits::MAX_DECODE_STEPS,
                    ));
                }
                RunCheck::KvCache(k) => {
                    if let Some(n) = k.decode_steps {
                        checks.push(("decode_steps", "kv_cache.decode_steps", n, limits::MAX_DECODE_STEPS));
                    }
                }
                _ => {}
            }
        }
        for (needle, what, n, max) in checks {
            if let Err(msg) = limits::count(what, n, max) {
                let loc = locate_value(text, &format!("{needle}:"), &n.to_string()).or_else(|| locate(text, needle));
                return Err(self.error_at(loc, msg));
            }
        }
        Ok(())
    }

    /// `record:` names real steps and stage patterns.
    fn validate_record(&self, text: &str) -> Result<()> {
        if let Some(steps) = &self.record.steps {
            if steps.is_empty() {
                return Err(self.located(
                    text,
                    "steps",
                    "record.steps is empty (leave it out to record every step)".into(),
                ));
            }
            for s in steps {
                if crate::stage::Step::parse(s).is_none() {
                    return Err(self.located(
                        text,
                        s,
                        format!("record.steps: `{s}` is not a step (expected `prefill` or `decodeN`, N >= 1)"),
                    ));
                }
            }
        }
        if let Some(stages) = &self.record.stages {
            if stages.is_empty() {
                return Err(self.located(
                    text,
                    "stages",
                    "record.stages is empty (leave it out to record every stage)".into(),
                ));
            }
            for s in stages {
                StagePattern::parse(s).map_err(|msg| self.located(text, s, format!("record.stages: {msg}")))?;
            }
        }
        Ok(())
    }

    fn located(&self, text: &str, needle: &str, msg: String) -> Error {
        self.error_at(locate(text, needle), msg)
    }

    /// A spec error at `loc` (line, col), or for the whole file when unknown.
    fn error_at(&self, loc: Option<(usize, usize)>, msg: String) -> Error {
        match loc {
            Some((line, col)) => Error::SpecSyntax {
                path: self.path.clone(),
                line,
                col,
                msg,
            },
            None => Error::SpecInvalid {
                path: self.path.clone(),
                msg,
            },
        }
    }
}

/// 1-based line and column of the first occurrence of `needle` outside comments.
fn locate(text: &str, needle: &str) -> Option<(usize, usize)> {
    text.lines().enumerate().find_map(|(i, line)| {
        let code = line.split('#').next().unwrap_or("");
        code.find(needle).map(|c| (i + 1, c + 1))
    })
}

/// 1-based line and column of `value` after the first `key` outside comments.
fn locate_value(text: &str, key: &str, value: &str) -> Option<(usize, usize)> {
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

#[cfg(test)]
mod tests;
