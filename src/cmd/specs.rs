//! Which specs a command runs: those named (a folder stands for every spec
//! in it), or, with none named, the nearest `specs/` folder up from the
//! working directory.

use std::path::{Path, PathBuf};

use crate::error::{Error, Result};

/// The spec run when none is given, in a touchstone checkout.
pub const DEFAULT_SPEC: &str = "specs/qwen2-tiny.yaml";

/// With no SPEC: the nearest `specs/` folder from the working directory up
/// through its parents; its default spec (`qwen2-tiny.yaml`, touchstone's own
/// checkout) when it has one, else every spec in it. Says on stderr which it
/// used. Never a path compiled into the binary: a run from elsewhere must not
/// silently check touchstone's own spec.
fn discover_specs() -> Result<Vec<PathBuf>> {
    let cwd = std::env::current_dir().map_err(|e| Error::Usage(format!("cannot read the working directory: {e}")))?;
    for (up, abs) in cwd.ancestors().enumerate() {
        if !abs.join("specs").is_dir() {
            continue;
        }
        // Shown relative to the working directory (`specs/…`, `../specs/…`).
        let dir: PathBuf = std::iter::repeat_n("..", up).collect();
        let specs = dir.join("specs");
        let default = dir.join(DEFAULT_SPEC);
        let chosen = if default.is_file() {
            vec![default]
        } else {
            spec_files_in(&specs)?
        };
        if chosen.is_empty() {
            continue;
        }
        let shown: Vec<String> = chosen.iter().map(|p| p.display().to_string()).collect();
        eprintln!("touchstone: no SPEC given; using {}", shown.join(", "));
        return Ok(chosen);
    }
    Err(Error::Usage(format!(
        "no SPEC given and no specs/ folder with a spec in {} or its parents: name a spec file or a folder of specs",
        cwd.display()
    )))
}

/// The `*.yaml` / `*.yml` files of a folder, sorted.
pub fn spec_files_in(dir: &Path) -> Result<Vec<PathBuf>> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(|e| Error::io(dir, e))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.is_file() && p.extension().is_some_and(|x| x == "yaml" || x == "yml"))
        .collect();
    v.sort();
    Ok(v)
}

/// The specs named (a folder stands for every spec in it), or the discovered
/// default when none is named.
pub fn specs_or_default(specs: Vec<PathBuf>) -> Result<Vec<PathBuf>> {
    if specs.is_empty() {
        return discover_specs();
    }
    let mut out = Vec::new();
    for p in specs {
        if p.is_dir() {
            let files = spec_files_in(&p)?;
            if files.is_empty() {
                return Err(Error::Usage(format!(
                    "{}: a folder with no *.yaml spec in it",
                    p.display()
                )));
            }
            out.extend(files);
        } else {
            out.push(p);
        }
    }
    Ok(out)
}
