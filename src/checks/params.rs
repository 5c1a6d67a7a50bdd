//! How check parameters are written in a spec, shared by every kind: a
//! tolerance is a finite number >= 0; a parameter block may be a bare string
//! (`golden: hf`) or a map (`golden: {source: hf, atol: 1e-4}`); a kind
//! without parameters accepts `{}` or null. serde_yaml locates each error at
//! its line:col because every value is parsed in place (`registry::Seed`).

use std::fmt;
use std::marker::PhantomData;

use serde::de::{self, Deserializer, MapAccess, Visitor};
use serde::Deserialize;

/// A tolerance: a finite number >= 0. NaN makes every comparison false (a
/// check that cannot fail), infinity accepts everything, and a negative bound
/// rejects everything: each is a spec error, located at its value.
pub fn tol_value<'de, D: Deserializer<'de>>(d: D) -> Result<f64, D::Error> {
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
pub fn opt_tol_value<'de, D: Deserializer<'de>>(d: D) -> Result<Option<f64>, D::Error> {
    tol_value(d).map(Some)
}

/// One entry of a spec's per-dtype `tolerance:` table.
#[derive(Clone, Copy, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TolSpec {
    #[serde(deserialize_with = "tol_value")]
    pub atol: f64,
    #[serde(deserialize_with = "tol_value")]
    pub rtol: f64,
}

/// `atol`/`rtol` overrides, both optional.
#[derive(Clone, Copy, Debug, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TolOverride {
    #[serde(default, deserialize_with = "opt_tol_value")]
    pub atol: Option<f64>,
    #[serde(default, deserialize_with = "opt_tol_value")]
    pub rtol: Option<f64>,
}

impl TolOverride {
    pub fn is_set(&self) -> bool {
        self.atol.is_some() || self.rtol.is_some()
    }
}

/// A parameter block written either as a bare string (`golden: hf`) or as a
/// map (`golden: {source: hf, atol: 1e-4}`). Hand-written rather than
/// `#[serde(untagged)]` because untagged enums lose the precise error.
pub enum StrOrMap<T> {
    Str(String),
    Map(T),
}

impl<'de, T: Deserialize<'de>> Deserialize<'de> for StrOrMap<T> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V<T>(PhantomData<T>);
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
        d.deserialize_any(V(PhantomData))
    }
}

/// Accepts `{}` or null as "no parameters" for kinds that take none.
pub struct Empty;

impl<'de> Deserialize<'de> for Empty {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(deny_unknown_fields)]
        struct NoFields {}
        Option::<NoFields>::deserialize(d).map(|_| Empty)
    }
}

/// `unknown check `x`; did you mean `y`? (known: …)`.
pub fn unknown<E: de::Error>(kind: &str, name: &str, known: &[&str]) -> E {
    E::custom(format!(
        "unknown {kind} `{name}`{} (known: {})",
        crate::suggest::hint(name, known.iter().copied()),
        known.join(", ")
    ))
}
