//! What a pending golden changes, for review before `accept`: whether the files
//! are byte-identical, per step the largest change over its stages, per stage
//! (changed ones) the max abs change and NMSE from the same comparator the
//! checks use (pending as actual, current as expected), token-id changes, and
//! the provenance key by key; and where a reference's free-running greedy
//! picks left HF's, that disagreement and both margins.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::path::Path;

use serde_json::Value;

use crate::compare::{compare, sci, Tolerance};
use crate::error::Result;
use crate::stage::parse_key;
use crate::tensor::io::read_safetensors;

/// The review lines for a golden whose recorder's greedy picks differ from
/// HF's (provenance `greedy_disagreement`, written by `record_llamacpp.py`):
/// both picks, both margins, and what it means. None when they agree.
pub fn greedy_disagreement(source: &str, provenance: &Value) -> Option<String> {
    let d = provenance.get("greedy_disagreement")?;
    let num = |k: &str| d.get(k).and_then(Value::as_f64);
    let id = |k: &str| {
        d.get(k)
            .and_then(Value::as_u64)
            .map_or("?".to_string(), |v| v.to_string())
    };
    let margin = |k: &str| num(k).map_or("not recorded".to_string(), |m| format!("{m:.4}"));
    Some(format!(
        "  greedy picks differ from HF's at {} (token {}): `{source}` picks {} by a margin of {} over HF's {}; HF's \
         margin the other way {}. A near-tie its arithmetic resolves otherwise: both goldens stay fed HF's tokens, \
         and `greedy_tokens: {source}` judges an engine against `{source}`'s picks only\n",
        d.get("step").and_then(Value::as_str).unwrap_or("?"),
        id("index"),
        id("llamacpp_id"),
        margin("llamacpp_margin"),
        id("hf_id"),
        margin("hf_margin"),
    ))
}

/// The review's line for a recorder whose forward went non-finite
/// (provenance `overflow`: step, stage, dtype, how many values, the largest
/// finite |x| there and the oracle's), empty for one that did not. An
/// overflowing reference is data: what came before is recorded, nothing after.
pub fn overflow(source: &str, provenance: &Value) -> String {
    let Some(o) = provenance.get("overflow") else {
        return String::new();
    };
    let text = |k: &str| o.get(k).and_then(Value::as_str).unwrap_or("?").to_string();
    let num = |k: &str| o.get(k).and_then(Value::as_f64);
    let dtype = text("dtype");
    let limit = match dtype.as_str() {
        "float16" => Some(65504.0),
        "bfloat16" => Some(3.3895313892515355e38),
        _ => None,
    };
    let oracle = match (num("oracle_max_abs"), limit) {
        (Some(m), Some(l)) if m > l => format!("; the oracle's largest |x| there is {m:.4e}, beyond {dtype}'s {l:e}"),
        (Some(m), _) => format!("; the oracle's largest |x| there is {m:.4e}"),
        (None, _) => "; the oracle does not hold that stage".to_string(),
    };
    format!(
        "  OVERFLOW: `{source}`'s {dtype} forward went non-finite at {}/{} ({} non-finite value(s), the largest finite \
         |x| there {}{oracle}): the golden holds every stage before it and none after, and no check after it is \
         planned against `{source}`\n",
        text("step"),
        text("stage"),
        num("nonfinite").map_or("?".to_string(), |n| format!("{n:.0}")),
        num("max_abs_finite_before").map_or("?".to_string(), |m| format!("{m:.4e}")),
    )
}

/// The review text for `pending` against `current` (absent for a new golden).
/// Returns the text and whether anything changed (bytes differ).
pub fn describe(current: &Path, pending: &Path) -> Result<(String, bool)> {
    let mut out = String::new();
    let new_bytes = std::fs::read(pending).map_err(|e| crate::Error::io(pending, e))?;
    let Ok(old_bytes) = std::fs::read(current) else {
        let _ = writeln!(
            out,
            "  no current golden at {}: the pending file is new",
            current.display()
        );
        return Ok((out, true));
    };
    let identical = old_bytes == new_bytes;
    let old = read_safetensors(current)?;
    let new = read_safetensors(pending)?;

    // Per-stage comparison; keys in execution order (step, stage).
    let mut keys: Vec<&String> = old.floats.keys().chain(new.floats.keys()).collect();
    keys.sort_by_key(|k| (parse_key(k), k.to_string()));
    keys.dedup();
    let exact = Tolerance::new(0.0, 0.0);
    struct Row {
        step: String,
        key: String,
        max_abs: f64,
        nmse: f64,
        changed: usize,
        numel: usize,
        note: String,
    }
    let mut rows = Vec::new();
    for k in keys {
        let step = k.split('/').next().unwrap_or("").to_string();
        let row = |max_abs, nmse, changed, numel, note: &str| Row {
            step: step.clone(),
            key: k.clone(),
            max_abs,
            nmse,
            changed,
            numel,
            note: note.to_string(),
        };
        rows.push(match (new.floats.get(k), old.floats.get(k)) {
            (Some(a), Some(e)) => match compare(a, e, exact) {
                Ok(c) => row(c.max_abs.map_or(0.0, |(d, _)| d), c.nmse, c.mismatched, c.numel, ""),
                Err(m) => row(f64::INFINITY, f64::INFINITY, a.numel(), a.numel(), &m.to_string()),
            },
            (Some(a), None) => row(f64::NAN, f64::NAN, a.numel(), a.numel(), "added"),
            (None, Some(e)) => row(f64::NAN, f64::NAN, e.numel(), e.numel(), "removed"),
            (None, None) => unreachable!("key comes from one side"),
        });
    }
    let f = |x: f64| if x.is_nan() { "-".to_string() } else { sci(x) };
    let _ = writeln!(
        out,
        "  {:<8} {:>7} {:>8} {:>14} {:>10}",
        "step", "stages", "changed", "max|Δ| change", "max NMSE"
    );
    let mut steps: Vec<&str> = Vec::new();
    for r in &rows {
        if !steps.contains(&r.step.as_str()) {
            steps.push(&r.step);
        }
    }
    for s in &steps {
        let rs: Vec<&Row> = rows.iter().filter(|r| r.step == *s).collect();
        let changed = rs.iter().filter(|r| r.changed > 0 || !r.note.is_empty()).count();
        let max_abs = rs.iter().map(|r| r.max_abs).fold(0.0, f64::max);
        let nmse = rs.iter().map(|r| r.nmse).fold(0.0, f64::max);
        let _ = writeln!(
            out,
            "  {:<8} {:>7} {:>8} {:>14} {:>10}",
            s,
            rs.len(),
            changed,
            f(max_abs),
            f(nmse)
        );
    }
    let changed: Vec<&Row> = rows.iter().filter(|r| r.changed > 0 || !r.note.is_empty()).collect();
    if changed.is_empty() {
        let _ = writeln!(out, "  every stage unchanged: max abs change 0, NMSE 0");
    } else {
        let _ = writeln!(
            out,
            "\n  {:<32} {:>14} {:>10} {:>16}  note",
            "changed stage", "max|Δ| change", "NMSE", "elements changed"
        );
        for r in changed {
            let _ = writeln!(
                out,
                "  {:<32} {:>14} {:>10} {:>16}  {}",
                r.key,
                f(r.max_abs),
                f(r.nmse),
                format!("{}/{}", r.changed, r.numel),
                r.note
            );
        }
    }

    // Integer tensors (tokens, positions).
    let mut ikeys: Vec<&String> = old.ints.keys().chain(new.ints.keys()).collect();
    ikeys.sort();
    ikeys.dedup();
    for k in ikeys {
        match (old.ints.get(k), new.ints.get(k)) {
            (Some(a), Some(b)) if a == b => {}
            (a, b) => {
                let _ = writeln!(
                    out,
                    "  {k}: {} -> {}",
                    a.map_or("(absent)".into(), |v| format!("{:?}", v.1)),
                    b.map_or("(absent)".into(), |v| format!("{:?}", v.1))
                );
            }
        }
    }

    // Provenance, key by key (flattened to dotted paths).
    let prov = |m: &BTreeMap<String, String>| -> BTreeMap<String, String> {
        let mut flat = BTreeMap::new();
        if let Some(v) = m.get("provenance").and_then(|p| serde_json::from_str::<Value>(p).ok()) {
            flatten("", &v, &mut flat);
        }
        for (k, v) in m.iter().filter(|(k, _)| k.as_str() != "provenance") {
            flat.insert(format!("metadata.{k}"), v.clone());
        }
        flat
    };
    let (po, pn) = (prov(&old.metadata), prov(&new.metadata));
    provenance_changes(&mut out, &po, &pn);
    let _ = writeln!(
        out,
        "  file: {}",
        if identical {
            "byte-identical to the current golden"
        } else {
            "DIFFERS from the current golden"
        }
    );
    Ok((out, !identical))
}

/// A JSON value as dotted paths to leaves (provenance, compared key by key).
pub(super) fn flatten(prefix: &str, v: &Value, out: &mut BTreeMap<String, String>) {
    match v {
        Value::Object(m) if !m.is_empty() => {
            for (k, x) in m {
                let p = if prefix.is_empty() {
                    k.clone()
                } else {
                    format!("{prefix}.{k}")
                };
                flatten(&p, x, out);
            }
        }
        other => {
            out.insert(prefix.to_string(), other.to_string());
        }
    }
}

/// Writes the keys of two flattened provenances that differ, old -> new, or
/// that none did (every review of a recording ends with this).
pub fn provenance_changes(out: &mut String, po: &BTreeMap<String, String>, pn: &BTreeMap<String, String>) {
    let mut keys: Vec<&String> = po.keys().chain(pn.keys()).collect();
    keys.sort();
    keys.dedup();
    let changes: Vec<String> = keys
        .into_iter()
        .filter(|k| po.get(*k) != pn.get(*k))
        .map(|k| {
            format!(
                "    {k}: {} -> {}",
                po.get(k).map_or("(absent)", String::as_str),
                pn.get(k).map_or("(absent)", String::as_str)
            )
        })
        .collect();
    if changes.is_empty() {
        let _ = writeln!(out, "  provenance: unchanged ({} keys)", po.len());
    } else {
        let _ = writeln!(out, "  provenance: {} key(s) changed:", changes.len());
        for l in changes {
            let _ = writeln!(out, "{l}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_greedy_disagreement_is_reviewed_with_both_picks_and_margins() {
        let prov: Value = serde_json::from_str(
            r#"{"greedy_disagreement": {"step": "decode2", "index": 2, "hf_id": 57, "llamacpp_id": 504,
                "llamacpp_margin": 0.0125, "hf_margin": null}}"#,
        )
        .unwrap();
        let t = greedy_disagreement("llama.cpp", &prov).unwrap();
        assert!(
            t.contains("at decode2 (token 2): `llama.cpp` picks 504 by a margin of 0.0125 over HF's 57"),
            "{t}"
        );
        assert!(t.contains("HF's margin the other way not recorded"), "{t}");
        assert!(greedy_disagreement("hf", &serde_json::json!({"greedy_ids": [1]})).is_none());
    }
}
