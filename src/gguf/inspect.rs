//! `touchstone inspect FILE.gguf`: version, alignment, metadata (arrays
//! summarised: element type, length, first items), then the tensor table with
//! GGUF type, row-major shape, data offset and the same statistics as for
//! safetensors files.

use std::fmt::Write;
use std::path::Path;

use crate::error::Result;
use crate::inspect::Stats;

use super::GgufFile;

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
    let _ = writeln!(
        out,
        "{:<width$} {:<5} {:<14} {:>12} {:>11} {:>11} {:>11} {:>11} {:>6}",
        "name", "type", "shape", "offset", "min", "max", "mean", "std", "nonfin"
    );
    for info in &f.tensors {
        let t = f.read_tensor(info)?;
        let s = Stats::of(&t);
        let _ = writeln!(
            out,
            "{:<width$} {:<5} {:<14} {:>12} {:>11.4e} {:>11.4e} {:>11.4e} {:>11.4e} {:>6}",
            info.name,
            info.ggml_type.name(),
            format!("{:?}", info.shape()),
            info.offset,
            s.min,
            s.max,
            s.mean,
            s.std,
            s.non_finite
        );
    }
    Ok(out)
}
