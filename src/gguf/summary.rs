//! `touchstone inspect FILE.gguf`: version, alignment, metadata (arrays
//! summarised: element type, length, first items), then the whole tensor table
//! with GGUF type, row-major shape and data offset, the same statistics as for
//! safetensors files when the type can be read (`-` when it cannot: the table
//! is shown whatever the types), and a last line counting tensors per type.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::path::Path;

use crate::error::Result;
use crate::tensor::stats::Stats;

use super::{GgmlType, GgufFile};

/// Items of an array shown (token lists are long).
const ARRAY_ITEMS: usize = 8;
/// Characters of a string shown.
const STRING_CHARS: usize = 96;

pub fn render(path: &Path) -> Result<String> {
    let f = GgufFile::open(path)?;
    let mut out = String::new();
    let _ = writeln!(out, "{}", path.display());
    let _ = writeln!(
        out,
        "GGUF version {}, alignment {}, {} metadata entries, {} tensors, data at offset {}",
        f.version,
        f.alignment,
        f.metadata.len(),
        f.tensors.len(),
        f.data_offset
    );
    for (k, v) in &f.metadata {
        let _ = writeln!(
            out,
            "metadata {k} ({}): {}",
            v.type_name(),
            v.summary(ARRAY_ITEMS, STRING_CHARS)
        );
    }
    let width = f.tensors.iter().map(|t| t.name.len()).max().unwrap_or(4).max(4);
    let tw = f
        .tensors
        .iter()
        .map(|t| t.ggml_type.name().len())
        .max()
        .unwrap_or(4)
        .max(5);
    let _ = writeln!(
        out,
        "{:<width$} {:<tw$} {:<14} {:>12} {:>11} {:>11} {:>11} {:>11} {:>6}",
        "name", "type", "shape", "offset", "min", "max", "mean", "std", "nonfin"
    );
    let mut counts: BTreeMap<GgmlType, (usize, u64)> = BTreeMap::new();
    for info in &f.tensors {
        let c = counts.entry(info.ggml_type).or_default();
        c.0 += 1;
        c.1 += info.size;
        let head = format!(
            "{:<width$} {:<tw$} {:<14} {:>12}",
            info.name,
            info.ggml_type.name(),
            format!("{:?}", info.shape()),
            info.offset,
        );
        if !info.ggml_type.readable() {
            let _ = writeln!(out, "{head} {:>11} {:>11} {:>11} {:>11} {:>6}", "-", "-", "-", "-", "-");
            continue;
        }
        let s = Stats::of(&f.read_tensor(info)?);
        let _ = writeln!(
            out,
            "{head} {:>11.4e} {:>11.4e} {:>11.4e} {:>11.4e} {:>6}",
            s.min, s.max, s.mean, s.std, s.non_finite
        );
    }
    let per_type: Vec<String> = counts
        .iter()
        .map(|(ty, (n, bytes))| format!("{n} {} ({})", ty.name(), mib(*bytes)))
        .collect();
    let unreadable: usize = counts.iter().filter(|(t, _)| !t.readable()).map(|(_, c)| c.0).sum();
    let _ = writeln!(
        out,
        "{} tensors by type: {}{}",
        f.tensors.len(),
        per_type.join(", "),
        match unreadable {
            0 => String::new(),
            n => format!("; {n} cannot be read (no dequantisation for their type; stats shown as -)"),
        }
    );
    Ok(out)
}

fn mib(bytes: u64) -> String {
    format!("{:.1} MiB", bytes as f64 / (1024.0 * 1024.0))
}
