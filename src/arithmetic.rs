//! An arithmetic: how a source (an engine or a reference) computes, as far
//! as rounding is concerned. The scaled policy's floors are built from its
//! unit roundoffs (`checks::floor`), and an engine is judged against the
//! references of its own arithmetic.
//!
//! Written in a spec as a name — `f32`, `f16`, `bf16` (storage of weights,
//! stage outputs and the KV cache), `q8_0`, `q8_k` (f32 storage, activations
//! quantised to 8 bits in blocks of 32 or 256 before each matmul, as
//! llama.cpp does for quantised weights) — or as a map
//! `{storage: f32, activations: q8_k, kv: f16}` (llama.cpp's defaults on a
//! K-quant model: its KV cache is f16), with `act: f16` where the gated
//! activation is evaluated at a coarser precision than the storage
//! (llama.cpp's CPU GELU rounds its input to f16 and reads an f16 table),
//! and `patch: f16` where a VLM's patch embedding reads its pixels rounded
//! coarser than storage (ggml's im2col holds them in f16 for an f32 kernel).

use std::fmt;

use serde::de::{self, Deserializer};
use serde::Deserialize;
use serde_json::Value;

use crate::tensor::DType;

/// How matmul inputs are held.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Activations {
    /// At the storage dtype, unquantised.
    #[default]
    Exact,
    /// 8-bit integers with one scale per block of `block` values (Q8_0: 32,
    /// Q8_K: 256): each value is off by up to half a step, amax/254.
    Q8 { block: usize },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Arithmetic {
    /// Weights and stage outputs are held in this dtype; sums accumulate in
    /// f32 (every engine and reference here does, HF's 16-bit CPU kernels too).
    pub storage: DType,
    pub activations: Activations,
    /// The KV cache's element type (k and v are rounded to it once).
    pub kv: DType,
    /// The precision the MLP's gate activation is evaluated at: its input
    /// and its result rounded to it (the storage's, unless a source says
    /// otherwise).
    pub act: DType,
    /// The precision a VLM's patch embedding reads its pixels at (the
    /// storage's, unless a source says otherwise).
    pub patch: DType,
}

/// f32's unit roundoff: the accumulation's.
pub const U_ACC: f64 = 1.0 / 16_777_216.0;

impl Arithmetic {
    /// Plain arithmetic at a storage dtype (what `--storage` says).
    pub fn of_storage(storage: DType) -> Arithmetic {
        Arithmetic {
            storage,
            activations: Activations::Exact,
            kv: storage,
            act: storage,
            patch: storage,
        }
    }

    pub const F32: Arithmetic = Arithmetic {
        storage: DType::F32,
        activations: Activations::Exact,
        kv: DType::F32,
        act: DType::F32,
        patch: DType::F32,
    };

    /// Unit roundoff of a stored stage output.
    pub fn u_store(&self) -> f64 {
        self.storage.unit_roundoff()
    }

    /// Unit roundoff of a stored weight: 0 at f32, where the weights are the
    /// model's (dequantised) values exactly, as the oracle's are.
    pub fn u_weight(&self) -> f64 {
        match self.storage {
            DType::F32 => 0.0,
            d => d.unit_roundoff(),
        }
    }

    /// Unit roundoff of a KV cache entry beyond the stored stage output (0
    /// when the cache holds the stage's own dtype).
    pub fn u_kv(&self) -> f64 {
        if self.kv == self.storage {
            0.0
        } else {
            self.kv.unit_roundoff()
        }
    }

    /// Unit roundoff of the gate activation beyond the stored stage output
    /// (0 when it is evaluated at the storage's precision).
    pub fn u_act(&self) -> f64 {
        if self.act == self.storage {
            0.0
        } else {
            self.act.unit_roundoff()
        }
    }

    /// Unit roundoff of the patch embedding's input beyond storage (0 when
    /// the pixels are read at the storage's precision).
    pub fn u_patch(&self) -> f64 {
        if self.patch == self.storage {
            0.0
        } else {
            self.patch.unit_roundoff()
        }
    }

    pub fn quantises(&self) -> bool {
        matches!(self.activations, Activations::Q8 { .. })
    }

    /// A name as a spec writes it: `f32`, `q8_k`, or the map form.
    pub fn name(&self) -> String {
        let base = Arithmetic {
            patch: self.storage,
            ..*self
        }
        .name_without_patch();
        if self.patch == self.storage {
            return base;
        }
        let map = if base.starts_with('{') {
            base.trim_end_matches('}').to_string()
        } else {
            format!(
                "{{storage: {}, activations: {}, kv: {}",
                self.storage,
                activations_name(self.activations),
                self.kv
            )
        };
        format!("{map}, patch: {}}}", self.patch)
    }

    fn name_without_patch(&self) -> String {
        let plain = self.kv == self.storage && self.act == self.storage;
        match (self.activations, plain) {
            (Activations::Exact, true) => self.storage.to_string(),
            (Activations::Q8 { block: 32 }, true) if self.storage == DType::F32 => "q8_0".into(),
            (Activations::Q8 { block: 256 }, true) if self.storage == DType::F32 => "q8_k".into(),
            (a, _) if self.act == self.storage => format!(
                "{{storage: {}, activations: {}, kv: {}}}",
                self.storage,
                activations_name(a),
                self.kv
            ),
            (a, _) => format!(
                "{{storage: {}, activations: {}, kv: {}, act: {}}}",
                self.storage,
                activations_name(a),
                self.kv,
                self.act
            ),
        }
    }

    /// The arithmetic a golden's provenance states: `arithmetic` (a name or
    /// map, as in a spec) or HF's `dtype` (float32, bfloat16, float16; the
    /// oracle's float64 has none). None when it says neither.
    pub fn of_provenance(p: &Value) -> Result<Option<Arithmetic>, String> {
        if let Some(a) = p.get("arithmetic") {
            return serde_json::from_value::<Arithmetic>(a.clone())
                .map(Some)
                .map_err(|e| format!("provenance `arithmetic`: {e}"));
        }
        Ok(match p.get("dtype").and_then(Value::as_str) {
            Some("float32") => Some(Arithmetic::F32),
            Some("bfloat16") => Some(Arithmetic::of_storage(DType::BF16)),
            Some("float16") => Some(Arithmetic::of_storage(DType::F16)),
            _ => None,
        })
    }
}

impl fmt::Display for Arithmetic {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.name())
    }
}

fn activations_name(a: Activations) -> String {
    match a {
        Activations::Exact => "exact".into(),
        Activations::Q8 { block: 32 } => "q8_0".into(),
        Activations::Q8 { block: 256 } => "q8_k".into(),
        Activations::Q8 { block } => format!("q8 (block {block})"),
    }
}

fn parse_dtype(s: &str) -> Option<DType> {
    match s {
        "f32" => Some(DType::F32),
        "f16" => Some(DType::F16),
        "bf16" => Some(DType::BF16),
        _ => None,
    }
}

fn parse_activations(s: &str) -> Option<Activations> {
    match s {
        "exact" | "f32" | "f16" | "bf16" => Some(Activations::Exact),
        "q8_0" => Some(Activations::Q8 { block: 32 }),
        "q8_k" => Some(Activations::Q8 { block: 256 }),
        _ => None,
    }
}

const NAMES: &str = "f32, f16, bf16, q8_0, q8_k, or {storage, activations, kv, act, patch}";

/// A name: a storage dtype, or f32 storage with 8-bit activations.
fn parse_name(s: &str) -> Option<Arithmetic> {
    if let Some(d) = parse_dtype(s) {
        return Some(Arithmetic::of_storage(d));
    }
    match s {
        "q8_0" | "q8_k" => Some(Arithmetic {
            activations: parse_activations(s)?,
            ..Arithmetic::F32
        }),
        _ => None,
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Full {
    storage: String,
    #[serde(default)]
    activations: Option<String>,
    #[serde(default)]
    kv: Option<String>,
    #[serde(default)]
    act: Option<String>,
    #[serde(default)]
    patch: Option<String>,
}

impl<'de> Deserialize<'de> for Arithmetic {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Either {
            Name(String),
            Full(Full),
        }
        let bad = |what: &str, got: &str, expected: &str| {
            de::Error::custom(format!("arithmetic: unknown {what} `{got}` (expected {expected})"))
        };
        match Either::deserialize(d).map_err(|_| de::Error::custom(format!("arithmetic: expected {NAMES}")))? {
            Either::Name(s) => parse_name(&s).ok_or_else(|| bad("name", &s, NAMES)),
            Either::Full(f) => {
                let storage = parse_dtype(&f.storage).ok_or_else(|| bad("storage", &f.storage, "f32, f16 or bf16"))?;
                let activations = match f.activations.as_deref() {
                    None => Activations::Exact,
                    Some(a) => parse_activations(a).ok_or_else(|| bad("activations", a, "exact, q8_0 or q8_k"))?,
                };
                let kv = match f.kv.as_deref() {
                    None => storage,
                    Some(k) => parse_dtype(k).ok_or_else(|| bad("kv", k, "f32, f16 or bf16"))?,
                };
                let act = match f.act.as_deref() {
                    None => storage,
                    Some(k) => parse_dtype(k).ok_or_else(|| bad("act", k, "f32, f16 or bf16"))?,
                };
                let patch = match f.patch.as_deref() {
                    None => storage,
                    Some(k) => parse_dtype(k).ok_or_else(|| bad("patch", k, "f32, f16 or bf16"))?,
                };
                Ok(Arithmetic {
                    storage,
                    activations,
                    kv,
                    act,
                    patch,
                })
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn yaml(s: &str) -> Result<Arithmetic, String> {
        serde_yaml::from_str(s).map_err(|e| e.to_string())
    }

    #[test]
    fn names_and_maps_parse_and_print_back() {
        assert_eq!(yaml("f32").unwrap(), Arithmetic::F32);
        assert_eq!(yaml("bf16").unwrap().storage, DType::BF16);
        let q = yaml("q8_k").unwrap();
        assert_eq!(q.activations, Activations::Q8 { block: 256 });
        assert_eq!(q.name(), "q8_k");
        let d = yaml("{storage: f32, activations: q8_0, kv: f16}").unwrap();
        assert_eq!(d.kv, DType::F16);
        assert!(d.u_kv() > 0.0 && Arithmetic::F32.u_kv() == 0.0);
        assert_eq!(yaml(&d.name()).unwrap(), d);
        assert!(yaml("q4").unwrap_err().contains("expected"));
        assert!(yaml("{storage: f32, activations: int4}").unwrap_err().contains("int4"));
    }

    #[test]
    fn provenance_states_the_arithmetic() {
        let p = serde_json::json!({"dtype": "bfloat16"});
        assert_eq!(Arithmetic::of_provenance(&p).unwrap().unwrap().storage, DType::BF16);
        let p = serde_json::json!({"arithmetic": {"storage": "f32", "activations": "q8_k", "kv": "f16"}});
        assert!(Arithmetic::of_provenance(&p).unwrap().unwrap().quantises());
        assert_eq!(
            Arithmetic::of_provenance(&serde_json::json!({"dtype": "float64"})).unwrap(),
            None
        );
    }
}
