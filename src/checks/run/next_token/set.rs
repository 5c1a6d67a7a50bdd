//! The next-token goldens of a prompt set: one file per source (the float64
//! oracle and each reference) in one folder, written by
//! `goldens/recorders/record_next_token.py` (`touchstone-next-token/1`).
//!
//! Per prompt `N`, in the set's order: `N/tokens` I64 [T]; `N/top_ids` I64
//! [T, K], the source's own top-K tokens at each position (the distribution
//! of the token after tokens[0..=t]), by descending probability;
//! `N/top_logprobs` F64 [T, K] at those ids; `N/at_oracle` F64 [T, K] (every
//! source but the oracle): its log-probabilities at the oracle's `top_ids`;
//! `N/logit_max` F64 [T], max |logit| over the vocabulary. Only what the
//! check needs: a few hundred KB for a real model, not a 152k-wide row per
//! position.
//!
//! The files are read here rather than by `tensor::io` because they hold
//! float64 values: the KL divergence of an f32 engine from the oracle is
//! ~1e-10, far below what log-probabilities rounded to f32 could resolve.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use safetensors::{Dtype, SafeTensors};
use serde_json::Value;

use crate::error::{Error, Result};
use crate::golden::ORACLE;

pub const FORMAT: &str = "touchstone-next-token/1";

/// One prompt as one source recorded it.
#[derive(Debug, Clone)]
pub struct PromptRec {
    pub name: String,
    pub tokens: Vec<u32>,
    /// [T][K] the source's own top K.
    pub top_ids: Vec<Vec<u32>>,
    pub top_logprobs: Vec<Vec<f64>>,
    /// [T][K] at the oracle's top ids (None for the oracle).
    pub at_oracle: Option<Vec<Vec<f64>>>,
    /// [T] max |logit| of the source's own logits.
    pub logit_max: Vec<f64>,
}

#[derive(Debug)]
pub struct Source {
    pub name: String,
    pub path: PathBuf,
    pub provenance: Value,
    pub prompts: Vec<PromptRec>,
    /// Prompts its forward overflowed on (provenance `overflow.prompts`):
    /// left out of the file, named with their tokens and where it went
    /// non-finite. An overflowing reference is data, not a broken file.
    pub overflowed: Vec<Overflowed>,
}

/// A prompt a source's forward went non-finite on.
#[derive(Debug, Clone)]
pub struct Overflowed {
    pub name: String,
    pub tokens: Vec<u32>,
    /// `stage at position N` as the recorder saw it.
    pub at: String,
}

impl Source {
    /// The source's record of prompt `name`, if it has one.
    pub fn prompt(&self, name: &str) -> Option<&PromptRec> {
        self.prompts.iter().find(|p| p.name == name)
    }
}

/// Every source's file of one prompt set, checked against each other.
#[derive(Debug)]
pub struct NextTokenSet {
    pub oracle: Source,
    pub refs: Vec<Source>,
    /// K, the tokens kept per position.
    pub k: usize,
}

impl NextTokenSet {
    /// Reads every `*.safetensors` of `dir`; exactly one must be the oracle.
    pub fn load(dir: &Path) -> Result<NextTokenSet> {
        let entries = std::fs::read_dir(dir).map_err(|e| {
            if e.kind() == std::io::ErrorKind::NotFound {
                Error::golden(
                    dir,
                    "no such folder of next-token goldens: record them with `touchstone goldens regen SPEC`, review, \
                     then `touchstone goldens accept SPEC`",
                )
            } else {
                Error::io(dir, e)
            }
        })?;
        let mut files: Vec<PathBuf> = entries
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
            .collect();
        files.sort();
        NextTokenSet::from_files(dir, &files)
    }

    /// The set of these files (one folder's, as `load` lists them, or as
    /// `goldens accept` would leave it): exactly one must be the oracle, and
    /// every other must agree with it.
    pub(crate) fn from_files(dir: &Path, files: &[PathBuf]) -> Result<NextTokenSet> {
        let mut oracle = None;
        let mut refs = Vec::new();
        for f in files {
            let s = read_source(f)?;
            if s.name == ORACLE {
                if oracle.is_some() {
                    return Err(Error::golden(f, format!("a second `{ORACLE}` source in {}", dir.display())));
                }
                oracle = Some(s);
            } else {
                refs.push(s);
            }
        }
        let oracle = oracle.ok_or_else(|| {
            Error::golden(
                dir,
                format!(
                    "no file with source `{ORACLE}` (the float64 oracle every source is measured against): record it \
                     with `touchstone goldens regen SPEC` (it records the spec's `next_token` goldens, the oracle \
                     first), review, then `touchstone goldens accept SPEC`"
                ),
            )
        })?;
        let k = oracle.prompts.first().and_then(|p| p.top_ids.first()).map_or(0, Vec::len);
        for r in &refs {
            agree(&oracle, r, k)?;
        }
        if oracle.prompts.iter().any(|p| p.at_oracle.is_some()) {
            return Err(Error::golden(&oracle.path, "the oracle's file holds `at_oracle` tensors".to_string()));
        }
        Ok(NextTokenSet { oracle, refs, k })
    }
}

/// A reference must hold the oracle's prompts (but those its forward
/// overflowed on, which it names), tokens and K, with `at_oracle`.
fn agree(oracle: &Source, r: &Source, k: usize) -> Result<()> {
    let bad = |m: String| Error::golden(&r.path, m);
    let names = |s: &Source| s.prompts.iter().map(|p| p.name.clone()).collect::<Vec<_>>();
    let expected: Vec<String> = names(oracle)
        .into_iter()
        .filter(|n| !r.overflowed.iter().any(|o| &o.name == n))
        .collect();
    if names(r) != expected || r.overflowed.iter().any(|o| oracle.prompt(&o.name).is_none()) {
        return Err(bad(format!(
            "its prompts {:?} (and {:?} it overflowed on) are not the oracle's {:?} ({}): record them together",
            names(r),
            r.overflowed.iter().map(|o| o.name.as_str()).collect::<Vec<_>>(),
            names(oracle),
            oracle.path.display()
        )));
    }
    for o in &r.overflowed {
        let want = &oracle.prompt(&o.name).expect("checked above").tokens;
        if &o.tokens != want {
            return Err(bad(format!(
                "prompt `{}` (which it overflowed on) names other tokens than the oracle's: {:?} vs {want:?}",
                o.name, o.tokens
            )));
        }
    }
    for p in &r.prompts {
        let o = oracle.prompt(&p.name).expect("checked above");
        if p.tokens != o.tokens {
            return Err(bad(format!(
                "prompt `{}` was recorded with other tokens than the oracle's: {:?} vs {:?}",
                p.name, p.tokens, o.tokens
            )));
        }
        if p.at_oracle.is_none() {
            return Err(bad(format!(
                "prompt `{}` has no `at_oracle` (its log-probabilities at the oracle's top ids)",
                p.name
            )));
        }
        if p.top_ids.first().map_or(0, Vec::len) != k {
            return Err(bad(format!("K differs from the oracle's {k}")));
        }
    }
    Ok(())
}

/// One source's file, checked on its own (format, shapes, finite
/// log-probabilities <= 0); `NextTokenSet` checks the sources agree.
pub(crate) fn read_source(path: &Path) -> Result<Source> {
    let bad = |m: String| Error::golden(path, m);
    let bytes = std::fs::read(path).map_err(|e| Error::io(path, e))?;
    let (_, meta) = SafeTensors::read_metadata(&bytes).map_err(|e| bad(format!("not a valid safetensors file: {e}")))?;
    let st = SafeTensors::deserialize(&bytes).map_err(|e| bad(format!("not a valid safetensors file: {e}")))?;
    let md: BTreeMap<String, String> = meta.metadata().clone().map(|m| m.into_iter().collect()).unwrap_or_default();
    match md.get("format").map(String::as_str) {
        Some(FORMAT) => {}
        other => {
            return Err(bad(format!(
                "format {other:?} is not `{FORMAT}` (a next-token golden of record_next_token.py)"
            )))
        }
    }
    let provenance: Value = md
        .get("provenance")
        .ok_or_else(|| bad("no `provenance` metadata".into()))
        .and_then(|p| serde_json::from_str(p).map_err(|e| bad(format!("`provenance` is not JSON: {e}"))))?;
    let name = provenance
        .get("source")
        .and_then(Value::as_str)
        .ok_or_else(|| bad("the provenance has no `source` name".into()))?
        .to_string();
    let order: Vec<String> = provenance
        .get("prompts")
        .and_then(Value::as_array)
        .ok_or_else(|| bad("the provenance has no `prompts` list".into()))?
        .iter()
        .map(|v| v.as_str().map(str::to_string).ok_or_else(|| bad(format!("prompt name {v} is not a string"))))
        .collect::<Result<_>>()?;
    let get = |key: String, want: Dtype| -> Result<(Vec<usize>, &[u8])> {
        let v = st.tensor(&key).map_err(|_| bad(format!("no tensor `{key}`")))?;
        if v.dtype() != want {
            return Err(bad(format!("`{key}` is {:?}, expected {want:?}", v.dtype())));
        }
        Ok((v.shape().to_vec(), v.data()))
    };
    let mut prompts = Vec::new();
    for n in &order {
        let (ts, tb) = get(format!("{n}/tokens"), Dtype::I64)?;
        let tokens: Vec<u32> = i64s(tb)
            .into_iter()
            .map(|v| u32::try_from(v).map_err(|_| bad(format!("`{n}/tokens` holds token id {v}"))))
            .collect::<Result<_>>()?;
        let t = tokens.len();
        if ts.len() != 1 || t == 0 {
            return Err(bad(format!("`{n}/tokens` has shape {ts:?}, expected [T], T >= 1")));
        }
        let (is, ib) = get(format!("{n}/top_ids"), Dtype::I64)?;
        let k = is.get(1).copied().unwrap_or(0);
        if is.len() != 2 || is[0] != t || k == 0 {
            return Err(bad(format!("`{n}/top_ids` has shape {is:?}, expected [{t}, K], K >= 1")));
        }
        let ids: Vec<u32> = i64s(ib)
            .into_iter()
            .map(|v| u32::try_from(v).map_err(|_| bad(format!("`{n}/top_ids` holds token id {v}"))))
            .collect::<Result<_>>()?;
        let rows = |key: &str| -> Result<Option<Vec<Vec<f64>>>> {
            let full = format!("{n}/{key}");
            if st.tensor(&full).is_err() && key == "at_oracle" {
                return Ok(None);
            }
            let (s, b) = get(full.clone(), Dtype::F64)?;
            if s != [t, k] {
                return Err(bad(format!("`{full}` has shape {s:?}, expected [{t}, {k}]")));
            }
            let v = f64s(b);
            if let Some(i) = v.iter().position(|x| !(x.is_finite() && *x <= 0.0)) {
                return Err(bad(format!(
                    "`{full}` holds {} at [{}, {}]: a log-probability must be finite and <= 0",
                    v[i],
                    i / k,
                    i % k
                )));
            }
            Ok(Some(v.chunks(k).map(<[f64]>::to_vec).collect()))
        };
        let top_logprobs = rows("top_logprobs")?.expect("required above");
        let at_oracle = rows("at_oracle")?;
        let (ms, mb) = get(format!("{n}/logit_max"), Dtype::F64)?;
        let logit_max = f64s(mb);
        if ms != [t] || logit_max.iter().any(|x| !x.is_finite()) {
            return Err(bad(format!("`{n}/logit_max` has shape {ms:?} or a non-finite value, expected [{t}] finite")));
        }
        prompts.push(PromptRec {
            name: n.clone(),
            tokens,
            top_ids: ids.chunks(k).map(<[u32]>::to_vec).collect(),
            top_logprobs,
            at_oracle,
            logit_max,
        });
    }
    let overflowed = overflowed(&provenance).map_err(bad)?;
    if prompts.is_empty() && overflowed.is_empty() {
        return Err(bad("the provenance lists no prompts".into()));
    }
    Ok(Source {
        name,
        path: path.to_path_buf(),
        provenance,
        prompts,
        overflowed,
    })
}

/// `overflow.prompts` of a provenance: each `{prompt, tokens, stage,
/// position, …}` the recorder left out.
fn overflowed(prov: &Value) -> std::result::Result<Vec<Overflowed>, String> {
    let Some(list) = prov.pointer("/overflow/prompts") else {
        return Ok(Vec::new());
    };
    let list = list.as_array().ok_or("provenance `overflow.prompts` is not a list")?;
    list.iter()
        .map(|e| {
            let name = e
                .get("prompt")
                .and_then(Value::as_str)
                .ok_or("an `overflow.prompts` entry has no `prompt` name")?;
            let tokens = e
                .get("tokens")
                .and_then(Value::as_array)
                .and_then(|a| a.iter().map(|v| v.as_u64().and_then(|x| u32::try_from(x).ok())).collect::<Option<Vec<u32>>>())
                .ok_or(format!("`overflow.prompts` entry `{name}` has no token list"))?;
            let stage = e.get("stage").and_then(Value::as_str).unwrap_or("?");
            let pos = e.get("position").and_then(Value::as_u64).map_or("?".to_string(), |p| p.to_string());
            Ok(Overflowed {
                name: name.to_string(),
                tokens,
                at: format!("{stage} at position {pos}"),
            })
        })
        .collect()
}

fn i64s(b: &[u8]) -> Vec<i64> {
    b.chunks_exact(8).map(|c| i64::from_le_bytes(c.try_into().expect("8 bytes"))).collect()
}

fn f64s(b: &[u8]) -> Vec<f64> {
    b.chunks_exact(8).map(|c| f64::from_le_bytes(c.try_into().expect("8 bytes"))).collect()
}
