//! The check vocabulary of a spec and how each check is written in YAML: a bare
//! name (`finite`) or a one-key map with parameters (`{softmax_rows: {tol: 1e-6}}`,
//! `{golden: hf}`). Unknown names and parameters are errors with a suggestion;
//! serde_yaml adds the line:col.

use std::collections::BTreeMap;
use std::fmt;

use serde::de::{self, Deserializer, MapAccess, Visitor};
use serde::Deserialize;

use super::SamplingSpec;
use crate::stage::pattern::StageTemplate;
use crate::stage::RopeStyle;
use crate::suggest;

pub const STAGE_CHECKS: [&str; 7] = [
    "finite",
    "shape",
    "softmax_rows",
    "causal",
    "rope",
    "golden",
    "references_agree",
];
pub const RUN_CHECKS: [&str; 4] = ["determinism", "kv_cache", "greedy_tokens", "weights"];

/// A check applied to each (step, stage) a pattern matches.
#[derive(Clone, Debug, PartialEq)]
pub enum StageCheck {
    Finite,
    Shape,
    SoftmaxRows {
        tol: f64,
    },
    Causal,
    Rope {
        input: Option<StageTemplate>,
        style: RopeStyle,
        tol: f64,
    },
    /// The golden sources agree with each other at this stage (validates the
    /// goldens themselves; their distance is the engine's error budget).
    ReferencesAgree {
        atol: Option<f64>,
        rtol: Option<f64>,
    },
    /// `source: None` = every golden source the spec declares.
    Golden {
        source: Option<String>,
        atol: Option<f64>,
        rtol: Option<f64>,
    },
}

/// A check on a whole run rather than one stage.
#[derive(Clone, Debug, PartialEq)]
pub enum RunCheck {
    Determinism(DeterminismSpec),
    KvCache(KvCacheSpec),
    GreedyTokens {
        source: Option<String>,
    },
    /// The engine's weights equal the model file's, all finite, all used.
    Weights,
}

impl RunCheck {
    /// The check's name in ids; greedy_tokens carries its source
    /// (`greedy_tokens:hf`) so each source can be checked.
    pub fn id(&self) -> String {
        match self {
            RunCheck::Determinism(_) => "determinism".into(),
            RunCheck::KvCache(_) => "kv_cache".into(),
            RunCheck::GreedyTokens { source: Some(s) } => format!("greedy_tokens:{s}"),
            RunCheck::GreedyTokens { source: None } => "greedy_tokens".into(),
            RunCheck::Weights => "weights".into(),
        }
    }
}

#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DeterminismSpec {
    /// Runs with the same seed that must agree bitwise (at least 3).
    #[serde(default = "default_runs")]
    pub runs: usize,
    /// Sampling for these runs; must have temperature > 0 so a different seed
    /// is expected to change the tokens.
    #[serde(default = "default_determinism_sampling")]
    pub sampling: SamplingSpec,
    /// Seed of the repeated runs (default: the spec's seed).
    pub seed: Option<u64>,
    /// A second seed that must change the sampled tokens (default: seed + 1).
    pub other_seed: Option<u64>,
    /// Decode steps per run (default 8: enough draws that two seeds differ).
    #[serde(default = "default_determinism_steps")]
    pub decode_steps: usize,
}

#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KvCacheSpec {
    #[serde(default = "default_kv_atol", deserialize_with = "tol_value")]
    pub atol: f64,
    #[serde(default, deserialize_with = "tol_value")]
    pub rtol: f64,
    /// Decode steps to generate (default: the prompt's decode_steps).
    pub decode_steps: Option<usize>,
}

fn default_runs() -> usize {
    3
}
fn default_determinism_steps() -> usize {
    8
}
fn default_kv_atol() -> f64 {
    1e-5
}
fn default_determinism_sampling() -> SamplingSpec {
    SamplingSpec::Random {
        temperature: 1.0,
        top_k: Some(50),
        top_p: Some(0.95),
    }
}
/// A tolerance: a finite number >= 0. NaN makes every comparison false (a
/// check that cannot fail), infinity accepts everything, and a negative bound
/// rejects everything: each is a spec error, located at its value.
pub(crate) fn tol_value<'de, D: Deserializer<'de>>(d: D) -> Result<f64, D::Error> {
    let v = f64::deserialize(d)?;
    if v.is_finite() && v >= 0.0 {
        Ok(v)
    } else {
        Err(de::Error::custom(format!(
            "a tolerance must be a finite number >= 0, got {v} (NaN or infinity would make the check unable to \
             fail, a negative one unable to pass)"
        )))
    }
}

/// `tol_value` for an optional tolerance.
pub(crate) fn opt_tol_value<'de, D: Deserializer<'de>>(d: D) -> Result<Option<f64>, D::Error> {
    tol_value(d).map(Some)
}

fn default_softmax_tol() -> f64 {
    1e-5
}
fn default_rope_tol() -> f64 {
    1e-5
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct SoftmaxParams {
    #[serde(default = "default_softmax_tol", deserialize_with = "tol_value")]
    tol: f64,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RopeParams {
    input: Option<TemplateText>,
    #[serde(default = "default_style")]
    style: StyleName,
    #[serde(default = "default_rope_tol", deserialize_with = "tol_value")]
    tol: f64,
}

#[derive(Deserialize)]
#[serde(rename_all = "lowercase")]
enum StyleName {
    Neox,
    Interleaved,
}
fn default_style() -> StyleName {
    StyleName::Neox
}

/// A parameter block written either as a bare string (`golden: hf`) or as a map
/// (`golden: {source: hf, atol: 1e-4}`). Hand-written rather than
/// `#[serde(untagged)]` because untagged enums lose the precise error.
enum StrOrMap<T> {
    Str(String),
    Map(T),
}

impl<'de, T: Deserialize<'de>> Deserialize<'de> for StrOrMap<T> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V<T>(std::marker::PhantomData<T>);
        impl<'de, T: Deserialize<'de>> Visitor<'de> for V<T> {
            type Value = StrOrMap<T>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a golden source name or a map of parameters")
            }
            fn visit_str<E: de::Error>(self, s: &str) -> Result<Self::Value, E> {
                Ok(StrOrMap::Str(s.to_string()))
            }
            fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Self::Value, A::Error> {
                T::deserialize(de::value::MapAccessDeserializer::new(map)).map(StrOrMap::Map)
            }
        }
        d.deserialize_any(V(std::marker::PhantomData))
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct GoldenFull {
    source: Option<String>,
    #[serde(default, deserialize_with = "opt_tol_value")]
    atol: Option<f64>,
    #[serde(default, deserialize_with = "opt_tol_value")]
    rtol: Option<f64>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ToleranceParams {
    #[serde(default, deserialize_with = "opt_tol_value")]
    atol: Option<f64>,
    #[serde(default, deserialize_with = "opt_tol_value")]
    rtol: Option<f64>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct GreedyParams {
    source: Option<String>,
}

struct TemplateText(StageTemplate);
impl<'de> Deserialize<'de> for TemplateText {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        StageTemplate::parse(&s).map(TemplateText).map_err(de::Error::custom)
    }
}

fn unknown<E: de::Error>(kind: &str, name: &str, known: &[&str]) -> E {
    E::custom(format!(
        "unknown {kind} `{name}`{} (known: {})",
        suggest::hint(name, known.iter().copied()),
        known.join(", ")
    ))
}

fn stage_check_with<'de, A: MapAccess<'de>>(name: &str, map: &mut A) -> Result<StageCheck, A::Error> {
    Ok(match name {
        "finite" | "shape" | "causal" => {
            let _: Empty = map.next_value()?;
            stage_check_bare(name).expect("bare-able names")
        }
        "softmax_rows" => StageCheck::SoftmaxRows {
            tol: map.next_value::<SoftmaxParams>()?.tol,
        },
        "rope" => {
            let p: RopeParams = map.next_value()?;
            StageCheck::Rope {
                input: p.input.map(|t| t.0),
                style: match p.style {
                    StyleName::Neox => RopeStyle::Neox,
                    StyleName::Interleaved => RopeStyle::Interleaved,
                },
                tol: p.tol,
            }
        }
        "references_agree" => {
            let p: Option<ToleranceParams> = map.next_value()?;
            let p = p.unwrap_or(ToleranceParams { atol: None, rtol: None });
            StageCheck::ReferencesAgree {
                atol: p.atol,
                rtol: p.rtol,
            }
        }
        "golden" => match map.next_value::<StrOrMap<GoldenFull>>()? {
            StrOrMap::Str(s) => StageCheck::Golden {
                source: Some(s),
                atol: None,
                rtol: None,
            },
            StrOrMap::Map(g) => StageCheck::Golden {
                source: g.source,
                atol: g.atol,
                rtol: g.rtol,
            },
        },
        other => return Err(unknown("check", other, &STAGE_CHECKS)),
    })
}

fn stage_check_bare(name: &str) -> Option<StageCheck> {
    Some(match name {
        "finite" => StageCheck::Finite,
        "shape" => StageCheck::Shape,
        "causal" => StageCheck::Causal,
        "softmax_rows" => StageCheck::SoftmaxRows {
            tol: default_softmax_tol(),
        },
        "rope" => StageCheck::Rope {
            input: None,
            style: RopeStyle::Neox,
            tol: default_rope_tol(),
        },
        "references_agree" => StageCheck::ReferencesAgree { atol: None, rtol: None },
        "golden" => StageCheck::Golden {
            source: None,
            atol: None,
            rtol: None,
        },
        _ => return None,
    })
}

/// Accepts `{}` or null as "no parameters" for checks that take none.
struct Empty;
impl<'de> Deserialize<'de> for Empty {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(deny_unknown_fields)]
        struct NoFields {}
        Option::<NoFields>::deserialize(d).map(|_| Empty)
    }
}

impl<'de> Deserialize<'de> for StageCheck {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = StageCheck;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                write!(
                    f,
                    "a check name ({}) or a one-key map of a check and its parameters",
                    STAGE_CHECKS.join(", ")
                )
            }
            fn visit_str<E: de::Error>(self, s: &str) -> Result<StageCheck, E> {
                stage_check_bare(s).ok_or_else(|| unknown("check", s, &STAGE_CHECKS))
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<StageCheck, A::Error> {
                let name: String = map
                    .next_key()?
                    .ok_or_else(|| de::Error::custom("empty map: expected one check name as its key"))?;
                let check = stage_check_with(&name, &mut map)?;
                if let Some(extra) = map.next_key::<String>()? {
                    return Err(de::Error::custom(format!(
                        "one check per list item: found `{extra}` beside `{name}`; write them as two items"
                    )));
                }
                Ok(check)
            }
        }
        d.deserialize_any(V)
    }
}

impl<'de> Deserialize<'de> for RunCheck {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = RunCheck;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                write!(
                    f,
                    "a run check name ({}) or a one-key map with its parameters",
                    RUN_CHECKS.join(", ")
                )
            }
            fn visit_str<E: de::Error>(self, s: &str) -> Result<RunCheck, E> {
                match s {
                    "determinism" => Ok(RunCheck::Determinism(serde_yaml::from_str("{}").expect("defaults"))),
                    "kv_cache" => Ok(RunCheck::KvCache(serde_yaml::from_str("{}").expect("defaults"))),
                    "greedy_tokens" => Ok(RunCheck::GreedyTokens { source: None }),
                    "weights" => Ok(RunCheck::Weights),
                    other => Err(unknown("run check", other, &RUN_CHECKS)),
                }
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<RunCheck, A::Error> {
                let name: String = map
                    .next_key()?
                    .ok_or_else(|| de::Error::custom("empty map: expected one run check name as its key"))?;
                let check = match name.as_str() {
                    "determinism" => {
                        let d: DeterminismSpec = map
                            .next_value::<Option<DeterminismSpec>>()?
                            .unwrap_or_else(|| serde_yaml::from_str("{}").expect("defaults"));
                        if d.runs < 3 {
                            return Err(de::Error::custom(format!(
                                "determinism needs runs >= 3, got {}",
                                d.runs
                            )));
                        }
                        if !matches!(d.sampling, SamplingSpec::Random { temperature, .. } if temperature > 0.0) {
                            return Err(de::Error::custom(
                                "determinism needs sampling with temperature > 0 (greedy cannot show that the seed matters)",
                            ));
                        }
                        RunCheck::Determinism(d)
                    }
                    "kv_cache" => RunCheck::KvCache(
                        map.next_value::<Option<KvCacheSpec>>()?
                            .unwrap_or_else(|| serde_yaml::from_str("{}").expect("defaults")),
                    ),
                    "greedy_tokens" => RunCheck::GreedyTokens {
                        source: match map.next_value::<Option<StrOrMap<GreedyParams>>>()? {
                            None => None,
                            Some(StrOrMap::Str(s)) => Some(s),
                            Some(StrOrMap::Map(p)) => p.source,
                        },
                    },
                    "weights" => {
                        // `{weights: null}` or `{weights: {}}`: no parameters.
                        match map.next_value::<Option<BTreeMap<String, serde_yaml::Value>>>()? {
                            Some(m) if !m.is_empty() => {
                                return Err(de::Error::custom(format!(
                                    "weights takes no parameters, got: {}",
                                    m.keys().cloned().collect::<Vec<_>>().join(", ")
                                )))
                            }
                            _ => RunCheck::Weights,
                        }
                    }
                    other => return Err(unknown("run check", other, &RUN_CHECKS)),
                };
                if let Some(extra) = map.next_key::<String>()? {
                    return Err(de::Error::custom(format!(
                        "one run check per list item: found `{extra}` beside `{name}`"
                    )));
                }
                Ok(check)
            }
        }
        d.deserialize_any(V)
    }
}
