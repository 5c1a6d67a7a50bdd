//! Pending goldens and the only two ways files under `goldens/` change.
//!
//! `regen` never touches a committed golden: it writes `<golden>.new` beside it
//! with [`write_atomic`] (a temporary file in the same folder, written, fsynced,
//! then renamed, then the folder fsynced), so a reader — or a kill at any
//! moment — sees the old pending file or the new one, never half of one.
//! `accept` checks every pending file (a next-token folder also as the set it
//! would become), then replaces the golden with its pending file by one
//! `rename(2)`, which is atomic on POSIX file systems; `reject` deletes the pending file.

use std::collections::BTreeMap;
use std::fs::{self, File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};

use crate::checks::run::next_token_set::{read_source, NextTokenSet, Source};
use crate::error::{Error, Result};
use crate::golden::{GoldenSet, ORACLE};

/// Test hook: milliseconds to sleep after the temporary file is written and
/// fsynced, before the rename (lets a test SIGKILL a writer mid-write).
pub const PAUSE_ENV: &str = "TOUCHSTONE_TEST_PAUSE_BEFORE_RENAME_MS";

/// `<golden>.new`: `hf.safetensors` -> `hf.safetensors.new`.
pub fn pending_path(golden: &Path) -> PathBuf {
    let mut s = golden.as_os_str().to_owned();
    s.push(".new");
    PathBuf::from(s)
}

/// Prefix of the temporary files `write_atomic` leaves behind if it is killed.
fn temp_prefix(target: &Path) -> String {
    format!(
        ".{}.tmp.",
        target
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default()
    )
}

/// Writes `bytes` to `target` atomically: temp file in the same folder
/// (`.<name>.tmp.<pid>`), write, fsync, rename over `target`, fsync the folder.
pub fn write_atomic(target: &Path, bytes: &[u8]) -> Result<()> {
    let dir = parent(target);
    // A new spec's golden folder is made on its first regen (the recording
    // took minutes; failing here for a missing folder would waste them).
    fs::create_dir_all(&dir).map_err(|e| Error::io(&dir, e))?;
    let tmp = dir.join(format!("{}{}", temp_prefix(target), std::process::id()));
    let mut f = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .open(&tmp)
        .map_err(|e| Error::io(&tmp, e))?;
    let written = f.write_all(bytes).and_then(|_| f.sync_all());
    drop(f);
    if let Err(e) = written {
        let _ = fs::remove_file(&tmp);
        return Err(Error::io(&tmp, e));
    }
    if let Some(ms) = std::env::var(PAUSE_ENV).ok().and_then(|v| v.parse::<u64>().ok()) {
        eprintln!(
            "touchstone: test hook: {} written, pausing {ms} ms before rename",
            tmp.display()
        );
        std::thread::sleep(std::time::Duration::from_millis(ms));
    }
    rename_durable(&tmp, target)
}

/// `rename(2)` then fsync of the destination folder so the rename survives a crash.
pub fn rename_durable(from: &Path, to: &Path) -> Result<()> {
    fs::rename(from, to).map_err(|e| Error::io(to, e))?;
    if let Ok(d) = File::open(parent(to)) {
        let _ = d.sync_all();
    }
    Ok(())
}

fn parent(p: &Path) -> PathBuf {
    match p.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    }
}

/// Temporary files an interrupted `write_atomic` left beside `target`.
pub fn leftovers(target: &Path) -> Vec<PathBuf> {
    let prefix = temp_prefix(target);
    let Ok(rd) = fs::read_dir(parent(target)) else {
        return Vec::new();
    };
    let mut v: Vec<PathBuf> = rd
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().starts_with(&prefix))
        .map(|e| e.path())
        .collect();
    v.sort();
    v
}

/// What kind of file a golden is, for validating it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GoldenKind {
    /// A stage golden of `goldens:` or `oracle:` (record_hf.py, record_llamacpp.py).
    Stage,
    /// One source's file of a `next_token` check's folder (record_next_token.py).
    NextToken,
}

/// One golden a spec declares, with where its pending file goes.
#[derive(Clone, Debug)]
pub struct GoldenRef {
    pub spec: String,
    pub source: String,
    pub golden: PathBuf,
    pub kind: GoldenKind,
}

impl GoldenRef {
    pub fn pending(&self) -> PathBuf {
        pending_path(&self.golden)
    }
    /// How messages name it: "SPEC `SOURCE`", or "SPEC next-token `SOURCE`".
    pub fn label(&self) -> String {
        match self.kind {
            GoldenKind::Stage => format!("{} `{}`", self.spec, self.source),
            GoldenKind::NextToken => format!("{} next-token `{}`", self.spec, self.source),
        }
    }
}

/// `touchstone goldens status`: one line per golden with a pending file.
pub fn status(goldens: &[GoldenRef]) -> String {
    status_count(goldens).0
}

/// `status` and the number of things that need attention (pending files and
/// leftovers of interrupted writes), for `goldens status --check`.
pub fn status_count(goldens: &[GoldenRef]) -> (String, usize) {
    let mut out = String::new();
    let mut n = 0;
    let mut left = 0;
    for g in goldens {
        let p = g.pending();
        if p.exists() {
            n += 1;
            let same = match (fs::read(&p), fs::read(&g.golden)) {
                (Ok(a), Ok(b)) if a == b => "byte-identical to the current golden",
                (Ok(_), Ok(_)) => "DIFFERS from the current golden",
                (Ok(_), Err(_)) => "NEW (no current golden)",
                _ => "unreadable",
            };
            out += &format!("pending {} ({}): {same}\n", p.display(), g.label());
        }
        for l in leftovers(&p) {
            left += 1;
            out += &format!(
                "leftover {} (an interrupted write; `touchstone goldens reject` removes it)\n",
                l.display()
            );
        }
    }
    if n == 0 {
        out += "no pending goldens\n";
    } else {
        out += &format!(
            "{n} pending golden(s): review with `touchstone goldens regen` output or `touchstone compare NEW CURRENT`; \
             then `touchstone goldens accept` or `touchstone goldens reject`\n"
        );
    }
    (out, n + left)
}

/// `touchstone goldens accept`: validates each pending file as a golden, then
/// renames it over the current golden (atomic). Returns what was done.
pub fn accept(goldens: &[GoldenRef]) -> Result<String> {
    let mut out = String::new();
    // Validate everything first so a bad pending file accepts nothing.
    let todo: Vec<&GoldenRef> = goldens.iter().filter(|g| g.pending().exists()).collect();
    for g in &todo {
        match g.kind {
            GoldenKind::Stage => {
                GoldenSet::load(&g.source, &g.pending())?;
            }
            GoldenKind::NextToken => {
                check_next_token_file(&g.pending(), &g.source)?;
            }
        }
    }
    // A next-token folder must stay one consistent set (same prompts and
    // tokens as its oracle's) once these are in it.
    check_next_token_sets(&todo)?;
    for g in &todo {
        rename_durable(&g.pending(), &g.golden)?;
        out += &format!("accepted {} -> {}\n", g.pending().display(), g.golden.display());
    }
    if todo.is_empty() {
        out += "no pending goldens to accept\n";
    }
    Ok(out)
}

/// One next-token file checked on its own: readable, of source `source`, with
/// `at_oracle` exactly where it belongs (every source but the oracle).
pub fn check_next_token_file(path: &Path, source: &str) -> Result<Source> {
    let s = read_source(path)?;
    if s.name != source {
        return Err(Error::golden(
            path,
            format!(
                "records source `{}`, but it is the `{source}` next-token golden",
                s.name
            ),
        ));
    }
    let with = s.prompts.iter().filter(|p| p.at_oracle.is_some()).count();
    let want = if source == ORACLE { 0 } else { s.prompts.len() };
    if with != want {
        return Err(Error::golden(
            path,
            format!(
                "{with} of its {} prompts hold `at_oracle` (expected {want}: every source but the oracle's)",
                s.prompts.len()
            ),
        ));
    }
    Ok(s)
}

/// Each next-token folder among `todo` as `accept` would leave it (its
/// current files, the pending ones in their place) must be one set: an
/// oracle, and every other file of its prompts, tokens and K.
pub fn check_next_token_sets(todo: &[&GoldenRef]) -> Result<()> {
    let mut folders: BTreeMap<PathBuf, Vec<&GoldenRef>> = BTreeMap::new();
    for g in todo.iter().filter(|g| g.kind == GoldenKind::NextToken) {
        let folder = g.golden.parent().map(Path::to_path_buf).unwrap_or_default();
        folders.entry(folder).or_default().push(g);
    }
    for (folder, gs) in folders {
        let mut files: BTreeMap<PathBuf, PathBuf> = BTreeMap::new();
        if let Ok(rd) = std::fs::read_dir(&folder) {
            for p in rd.filter_map(|e| e.ok().map(|e| e.path())) {
                if p.extension().is_some_and(|x| x == "safetensors") {
                    files.insert(p.clone(), p);
                }
            }
        }
        for g in gs {
            files.insert(g.golden.clone(), g.pending());
        }
        let files: Vec<PathBuf> = files.into_values().collect();
        NextTokenSet::from_files(&folder, &files).map_err(|e| {
            Error::golden(
                &folder,
                format!(
                    "accepting its pending next-token goldens would leave the folder inconsistent ({e}); nothing \
                     was accepted: regen its files together, then accept them together"
                ),
            )
        })?;
    }
    Ok(())
}

/// `touchstone goldens reject`: deletes pending files and interrupted-write leftovers.
pub fn reject(goldens: &[GoldenRef]) -> Result<String> {
    let mut out = String::new();
    let mut n = 0;
    for g in goldens {
        let p = g.pending();
        for f in leftovers(&p).into_iter().chain(p.exists().then(|| p.clone())) {
            fs::remove_file(&f).map_err(|e| Error::io(&f, e))?;
            out += &format!("rejected {}\n", f.display());
            n += 1;
        }
    }
    if n == 0 {
        out += "no pending goldens to reject\n";
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pending_golden_of_a_new_spec_gets_its_folder() {
        let d = tempfile::tempdir().unwrap();
        let target = pending_path(&d.path().join("new-model/hf.safetensors"));
        write_atomic(&target, b"golden").unwrap();
        assert_eq!(fs::read(&target).unwrap(), b"golden");
        let left: Vec<_> = fs::read_dir(target.parent().unwrap()).unwrap().collect();
        assert_eq!(left.len(), 1, "no temporary file is left beside it");
    }
}
