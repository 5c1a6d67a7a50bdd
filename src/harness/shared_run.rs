//! One engine run per (spec, engine) shared by trials in separate processes.
//!
//! cargo-nextest runs every trial in a process of its own. In one process the
//! trials of a (spec, engine) share one run of the whole plan (a `OnceLock`);
//! across processes they share it here: the first trial process to need the
//! group takes the group's lock, runs the plan, and publishes every check's
//! verdict (a directory renamed into place, so a reader sees all or nothing);
//! every other trial process reads its own verdict file. What is shared is
//! the verdict each trial reports (pass, ignored with its reason, or the
//! failure message with its rerun command), so a trial under nextest says
//! exactly what it says under `cargo test`.
//!
//! Scope: a verdict is reused only inside one test run. Under nextest that is
//! its run (`NEXTEST_RUN_ID`, set for listing and running since nextest
//! 0.9.138), kept under the test binary's target folder
//! (`target/<profile>/touchstone-run-cache/<run id>/`); `TOUCHSTONE_RUN_CACHE`
//! names another scope folder instead (e.g. one shared by several partitions
//! run one after another on one machine; its owner clears it). A fresh scope
//! never reuses an earlier run's verdicts: rerunning the suite reruns the
//! engines. Within a scope, a group's key is content-addressed: the test
//! binary (path, size, mtime), the spec (path and text: prompt, storage, seed,
//! checks), the size and mtime of its model, goldens and oracle, and the
//! engine's name — an edit between two runs in one explicit scope is a miss,
//! not a stale verdict.

use std::collections::BTreeMap;
use std::fs::{self, File};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use sha2::{Digest, Sha256};

use super::unit::{Granularity, Verdict};
use crate::spec::Spec;

/// Every trial's verdict of one (spec, engine) run, by trial (`unit`); `Err` when
/// the spec could not run at all (every trial reports that).
pub type Verdicts = std::result::Result<BTreeMap<String, Verdict>, String>;

/// The environment variable naming an explicit scope folder.
pub const SCOPE_VAR: &str = "TOUCHSTONE_RUN_CACHE";

/// Scope folders of earlier nextest runs older than this are removed when a
/// new run starts its own.
const STALE: Duration = Duration::from_secs(24 * 3600);

/// The cache place of one (spec, engine) group.
pub struct SharedRun {
    dir: PathBuf,
}

impl SharedRun {
    /// The group's place, when trials run one per process (nextest, or an
    /// explicit `TOUCHSTONE_RUN_CACHE` scope); `None` otherwise.
    pub fn new(spec: &Spec, engine: &str, g: Granularity) -> Option<SharedRun> {
        let scope = scope()?;
        Some(SharedRun {
            dir: scope.join(group_key(spec, engine, g)),
        })
    }

    /// The published verdicts, if some process has run the group.
    pub fn published(&self) -> Option<Verdicts> {
        read_group(&self.dir)
    }

    /// The group's verdicts: published ones, or else `run`'s, published for
    /// the other processes. Exactly one process runs a group: the others
    /// wait on the lock. A cache that cannot be written is not an error of
    /// the checks: the verdicts are returned all the same, and the other
    /// processes run the group themselves.
    pub fn get_or_run(&self, run: impl FnOnce() -> Verdicts) -> Verdicts {
        if let Some(v) = self.published() {
            return v;
        }
        let lock = self.lock();
        if let Some(v) = self.published() {
            return v;
        }
        let v = run();
        if let Err(e) = publish(&self.dir, &v) {
            eprintln!("touchstone: cannot share this run with the other trial processes ({e}); each will run it");
        }
        drop(lock);
        v
    }

    /// One check's verdict from the published group: `None` when no
    /// process has run the group yet, `Some(None)` when the group has no
    /// such check.
    pub fn verdict(&self, id: &str) -> Option<Option<Verdict>> {
        if let Ok(e) = fs::read_to_string(self.dir.join("error")) {
            return Some(Some(Verdict::Fail(format!("the spec could not run: {e}"))));
        }
        if !self.dir.join("ids").exists() {
            return None;
        }
        Some(read_verdict(&self.dir, id))
    }

    /// Holds the group's lock (released on drop); `None` when the lock file
    /// cannot be made (then two processes may both run the group: slower,
    /// never wrong, since publishing is an atomic rename).
    fn lock(&self) -> Option<File> {
        let parent = self.dir.parent()?;
        fs::create_dir_all(parent).ok()?;
        let f = File::options()
            .create(true)
            .truncate(false)
            .write(true)
            .open(self.dir.with_extension("lock"))
            .ok()?;
        f.lock().ok()?;
        Some(f)
    }
}

/// The scope folder: `TOUCHSTONE_RUN_CACHE`, or the nextest run's folder
/// beside the test binary (made, and earlier runs' stale ones removed).
fn scope() -> Option<PathBuf> {
    if let Some(dir) = std::env::var_os(SCOPE_VAR).filter(|v| !v.is_empty()) {
        return Some(PathBuf::from(dir));
    }
    let run_id = std::env::var("NEXTEST_RUN_ID").ok().filter(|s| !s.is_empty())?;
    // target/<profile>/deps/<test binary> -> target/<profile>/touchstone-run-cache
    let exe = std::env::current_exe().ok()?;
    let root = exe.parent()?.parent()?.join("touchstone-run-cache");
    let dir = root.join(sanitize(&run_id));
    if !dir.exists() {
        prune(&root);
    }
    Some(dir)
}

/// Removes scope folders of nextest runs older than a day.
fn prune(root: &Path) {
    let Ok(entries) = fs::read_dir(root) else { return };
    for e in entries.flatten() {
        let old = e
            .metadata()
            .and_then(|m| m.modified())
            .ok()
            .and_then(|t| SystemTime::now().duration_since(t).ok())
            .is_some_and(|age| age > STALE);
        if old {
            let _ = fs::remove_dir_all(e.path());
        }
    }
}

fn sanitize(s: &str) -> String {
    s.chars()
        .map(|c| if c.is_ascii_alphanumeric() || c == '-' { c } else { '_' })
        .collect()
}

/// The content address of a (spec, engine) group (see the module docs).
fn group_key(spec: &Spec, engine: &str, g: Granularity) -> String {
    let mut h = Sha256::new();
    let mut field = |name: &str, bytes: &[u8]| {
        h.update(name.as_bytes());
        h.update((bytes.len() as u64).to_le_bytes());
        h.update(bytes);
    };
    field("engine", engine.as_bytes());
    field("trials", format!("{g:?}").as_bytes());
    if let Ok(exe) = std::env::current_exe() {
        field("exe", stat(&exe).as_bytes());
    }
    field("spec", spec.path.to_string_lossy().as_bytes());
    field("text", &fs::read(&spec.path).unwrap_or_default());
    field("model", stat(&spec.model).as_bytes());
    for (name, p) in &spec.goldens {
        field(name, stat(p).as_bytes());
    }
    if let Some(o) = &spec.oracle {
        field("oracle", stat(o).as_bytes());
    }
    let hex: String = h.finalize().iter().take(12).map(|b| format!("{b:02x}")).collect();
    format!("{}-{}-{hex}", sanitize(&spec.name), sanitize(engine))
}

/// A file's path, size and modification time, or its path alone.
fn stat(p: &Path) -> String {
    let m = fs::metadata(p).ok();
    let len = m.as_ref().map_or(0, |m| m.len());
    let mtime = m
        .and_then(|m| m.modified().ok())
        .and_then(|t| t.duration_since(SystemTime::UNIX_EPOCH).ok())
        .map_or(0, |d| d.as_nanos());
    format!("{}|{len}|{mtime}", p.display())
}

/// The file of one check's verdict in a group's folder.
fn verdict_file(dir: &Path, id: &str) -> PathBuf {
    let hex: String = Sha256::digest(id.as_bytes())
        .iter()
        .take(10)
        .map(|b| format!("{b:02x}"))
        .collect();
    dir.join(format!("v-{hex}"))
}

/// A published group: `ids` (one check id a line) and a verdict file per
/// id, or `error` (the spec could not run).
fn read_group(dir: &Path) -> Option<Verdicts> {
    if let Ok(e) = fs::read_to_string(dir.join("error")) {
        return Some(Err(e));
    }
    let ids = fs::read_to_string(dir.join("ids")).ok()?;
    let mut out = BTreeMap::new();
    for id in ids.lines() {
        out.insert(id.to_string(), read_verdict(dir, id)?);
    }
    Some(Ok(out))
}

/// One check's verdict; `None` when the group holds no such check.
fn read_verdict(dir: &Path, id: &str) -> Option<Verdict> {
    let text = fs::read_to_string(verdict_file(dir, id)).ok()?;
    // kind, the id again (a hash collision then reads as a miss), message.
    let mut parts = text.splitn(3, '\n');
    let (kind, stored_id, msg) = (parts.next()?, parts.next()?, parts.next().unwrap_or(""));
    if stored_id != id {
        return None;
    }
    match kind {
        "pass" => Some(Verdict::Pass),
        "ignored" => Some(Verdict::Ignored(msg.to_string())),
        "fail" => Some(Verdict::Fail(msg.to_string())),
        _ => None,
    }
}

/// Writes a group into a private folder and renames it into place.
fn publish(dir: &Path, v: &Verdicts) -> std::io::Result<()> {
    let tmp = dir.with_extension(format!("tmp{}", std::process::id()));
    let _ = fs::remove_dir_all(&tmp);
    fs::create_dir_all(&tmp)?;
    match v {
        Err(e) => fs::write(tmp.join("error"), e)?,
        Ok(map) => {
            let mut ids = String::new();
            for (id, verdict) in map {
                let (kind, msg) = match verdict {
                    Verdict::Pass => ("pass", ""),
                    Verdict::Ignored(r) => ("ignored", r.as_str()),
                    Verdict::Fail(m) => ("fail", m.as_str()),
                };
                let mut f = File::create(verdict_file(&tmp, id))?;
                write!(f, "{kind}\n{id}\n{msg}")?;
                ids.push_str(id);
                ids.push('\n');
            }
            fs::write(tmp.join("ids"), ids)?;
        }
    }
    match fs::rename(&tmp, dir) {
        Ok(()) => Ok(()),
        // Another process published first (possible only without the lock).
        Err(_) if dir.exists() => fs::remove_dir_all(&tmp),
        Err(e) => Err(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn published_verdicts_read_back_exactly() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("g");
        let mut map = BTreeMap::new();
        map.insert("prefill/embed::finite".to_string(), Verdict::Pass);
        map.insert("run::kv_cache".to_string(), Verdict::Ignored("no logits\ntap".into()));
        map.insert(
            "decode2/blk.0.q::golden:hf".to_string(),
            Verdict::Fail("max abs 1e-2\nrerun: x".into()),
        );
        publish(&dir, &Ok(map.clone())).unwrap();
        assert_eq!(read_group(&dir), Some(Ok(map)));
        let g = SharedRun { dir: dir.clone() };
        assert_eq!(
            g.verdict("run::kv_cache"),
            Some(Some(Verdict::Ignored("no logits\ntap".into())))
        );
        // A check the group does not have: the group is known, the check is not.
        assert_eq!(g.verdict("run::nothing"), Some(None));
        // An unpublished group is unknown.
        let other = SharedRun {
            dir: tmp.path().join("h"),
        };
        assert_eq!(other.verdict("run::kv_cache"), None);
    }

    #[test]
    fn a_run_error_is_every_trials_verdict() {
        let tmp = tempfile::tempdir().unwrap();
        let g = SharedRun {
            dir: tmp.path().join("g"),
        };
        let v = g.get_or_run(|| Err("model missing".into()));
        assert_eq!(v, Err("model missing".into()));
        assert_eq!(g.published(), Some(Err("model missing".into())));
        // A second process reads it without running.
        let again = g.get_or_run(|| panic!("ran twice"));
        assert_eq!(again, Err("model missing".into()));
    }
}
