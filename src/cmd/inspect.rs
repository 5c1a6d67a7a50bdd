//! `touchstone inspect FILE`: what is in a tensor file (GGUF files: see
//! `gguf::inspect`) — provenance, then every
//! tensor's dtype, shape and basic statistics, with non-finite values counted
//! (a NaN in a golden is the first thing a user should see).

use std::fmt::Write;
use std::path::Path;

use crate::error::Result;
use crate::tensor::io::TensorFile;
use crate::tensor::stats::Stats;

pub fn render(path: &Path) -> Result<String> {
    if crate::gguf::is_gguf_path(path) {
        return crate::gguf::summary::render(path);
    }
    let file = TensorFile::read(path)?;
    let mut out = String::new();
    let _ = writeln!(out, "{}", path.display());
    for (k, v) in &file.metadata {
        // Provenance is JSON: pretty-print it so it can be read.
        match serde_json::from_str::<serde_json::Value>(v) {
            Ok(j) if j.is_object() => {
                let pretty = serde_json::to_string_pretty(&j).unwrap_or_else(|_| v.clone());
                let _ = writeln!(out, "metadata {k}:");
                for l in pretty.lines() {
                    let _ = writeln!(out, "  {l}");
                }
            }
            _ => {
                let _ = writeln!(out, "metadata {k}: {v}");
            }
        }
    }
    let _ = writeln!(
        out,
        "{} float tensors, {} integer tensors\n{:<28} {:<5} {:<14} {:>11} {:>11} {:>11} {:>11} {:>6}",
        file.floats.len(),
        file.ints.len(),
        "name",
        "dtype",
        "shape",
        "min",
        "max",
        "mean",
        "std",
        "nonfin"
    );
    for (name, t) in &file.floats {
        let s = Stats::of(t);
        let _ = writeln!(
            out,
            "{:<28} {:<5} {:<14} {:>11.4e} {:>11.4e} {:>11.4e} {:>11.4e} {:>6}",
            name,
            t.dtype().name(),
            format!("{:?}", t.shape()),
            s.min,
            s.max,
            s.mean,
            s.std,
            s.non_finite
        );
    }
    for (name, (shape, v)) in &file.ints {
        let shown: Vec<String> = v.iter().take(16).map(i64::to_string).collect();
        let more = if v.len() > 16 { ", ..." } else { "" };
        let _ = writeln!(
            out,
            "{:<28} {:<5} {:<14} [{}{more}]",
            name,
            file.int_dtypes.get(name).copied().unwrap_or("i64"),
            format!("{shape:?}"),
            shown.join(", ")
        );
    }
    Ok(out)
}
