//! `touchstone compare A B`: two tensor files (safetensors, .npy, .npz), tensor by
//! tensor, with the same comparator as the golden checks. Tensors are matched by
//! name (a lone .npy is named after its file stem, so `a/x.npy` vs `b/x.npy`
//! match); names present on one side only are listed. Integer tensors (token
//! ids, positions) must be equal. Fails when any matched tensor fails, or when
//! the files have no tensor name in common (nothing was compared).

use std::fmt::Write;
use std::path::Path;

use crate::compare::{compare, sci, Tolerance};
use crate::error::Result;
use crate::tensor::io::TensorFile;

pub struct FileComparison {
    pub text: String,
    pub passed: bool,
}

/// `atol`/`rtol` override the dtype defaults (`Tolerance::for_pair`) when given.
pub fn compare_files(a: &Path, b: &Path, atol: Option<f64>, rtol: Option<f64>) -> Result<FileComparison> {
    let mut fa = TensorFile::read(a)?;
    let mut fb = TensorFile::read(b)?;
    // Two single-tensor files (two .npy dumps of one stage, say) are compared
    // with each other whatever their names: a .npy tensor is named after its
    // file, so matching by name would compare nothing.
    if fa.floats.len() == 1 && fb.floats.len() == 1 && fa.ints.is_empty() && fb.ints.is_empty() {
        let (na, nb) = (
            fa.floats.keys().next().cloned().unwrap(),
            fb.floats.keys().next().cloned().unwrap(),
        );
        if na != nb {
            let joined = format!("{na} ~ {nb}");
            let ta = fa.floats.remove(&na).unwrap();
            let tb = fb.floats.remove(&nb).unwrap();
            fa.floats.insert(joined.clone(), ta);
            fb.floats.insert(joined, tb);
        }
    }
    let mut out = String::new();
    let _ = writeln!(out, "A: {}\nB: {}", a.display(), b.display());
    let _ = writeln!(
        out,
        "{:<32} {:<14} {:<5} {:<5} {:>10} {:>9} {:>10} {:>12}",
        "tensor", "shape", "dtype", "result", "max|Δ|", "nmse", "cosine", "mismatched"
    );
    let (mut compared, mut failed) = (0usize, 0usize);
    let mut details = Vec::new();
    for (name, ta) in &fa.floats {
        let Some(tb) = fb.floats.get(name) else { continue };
        compared += 1;
        let base = Tolerance::for_pair(ta, tb);
        let tol = Tolerance::new(atol.unwrap_or(base.atol), rtol.unwrap_or(base.rtol));
        let dtype = ta.dtype().coarser(tb.dtype());
        match compare(ta, tb, tol) {
            Err(m) => {
                failed += 1;
                let _ = writeln!(
                    out,
                    "{name:<32} {:<14} {dtype:<5} FAIL   {m}",
                    format!("{:?}", ta.shape())
                );
            }
            Ok(c) => {
                let status = if c.passed() { "pass" } else { "FAIL" };
                let _ = writeln!(
                    out,
                    "{:<32} {:<14} {:<5} {:<5} {:>10} {:>9} {:>10.7} {:>12}",
                    name,
                    format!("{:?}", c.shape),
                    dtype.name(),
                    status,
                    c.max_abs.as_ref().map_or("-".into(), |(d, _)| sci(*d)),
                    sci(c.nmse),
                    c.cosine,
                    format!("{}/{}", c.mismatched, c.numel)
                );
                if !c.passed() {
                    failed += 1;
                    details.push(format!(
                        "--- FAIL {name} (A actual, B expected)\n{}",
                        indent(&c.explain())
                    ));
                }
            }
        }
    }
    for (name, (sa, va)) in &fa.ints {
        let Some((sb, vb)) = fb.ints.get(name) else { continue };
        compared += 1;
        let same = sa == sb && va == vb;
        if !same {
            failed += 1;
            details.push(format!(
                "--- FAIL {name} (integer tensor): A {sa:?} {va:?} vs B {sb:?} {vb:?}"
            ));
        }
        let _ = writeln!(
            out,
            "{:<32} {:<14} {:<5} {:<5} {:>10}",
            name,
            format!("{sa:?}"),
            "i64",
            if same { "pass" } else { "FAIL" },
            if same { "equal" } else { "differ" }
        );
    }
    let names = |f: &TensorFile| -> Vec<String> { f.floats.keys().chain(f.ints.keys()).cloned().collect() };
    let (na, nb) = (names(&fa), names(&fb));
    let only_a: Vec<&String> = na.iter().filter(|n| !nb.contains(n)).collect();
    let only_b: Vec<&String> = nb.iter().filter(|n| !na.contains(n)).collect();
    // A float in one file and an integer of the same name in the other: say so.
    for n in na.iter().filter(|n| nb.contains(n)) {
        if fa.floats.contains_key(n) != fb.floats.contains_key(n) {
            failed += 1;
            details.push(format!(
                "--- FAIL {n}: floating point on one side, integer on the other"
            ));
        }
    }
    for d in &details {
        let _ = writeln!(out, "\n{d}");
    }
    if !only_a.is_empty() {
        let _ = writeln!(out, "\nonly in A ({}): {}", only_a.len(), join(&only_a));
    }
    if !only_b.is_empty() {
        let _ = writeln!(out, "\nonly in B ({}): {}", only_b.len(), join(&only_b));
    }
    let passed = failed == 0 && compared > 0;
    let verdict = if compared == 0 {
        "FAILED: no tensor name in common, nothing compared".to_string()
    } else if failed > 0 {
        format!("FAILED: {failed} of {compared} tensors differ")
    } else {
        format!("PASSED: {compared} tensors match")
    };
    let _ = writeln!(
        out,
        "\ncompare: {verdict} ({} only in A, {} only in B)",
        only_a.len(),
        only_b.len()
    );
    Ok(FileComparison { text: out, passed })
}

fn indent(s: &str) -> String {
    s.lines().map(|l| format!("    {l}")).collect::<Vec<_>>().join("\n")
}

fn join(v: &[&String]) -> String {
    v.iter().map(|s| s.as_str()).collect::<Vec<_>>().join(", ")
}
