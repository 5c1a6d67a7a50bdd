//! The sha256 of a model file, computed once and remembered across runs.
//!
//! The stale-golden check hashes the model under test on every run, which is
//! a second of CPU for a 2 GB model. The hash is kept in touchstone's cache
//! folder (outside any checkout), one small JSON file per model file:
//! `<cache>/hashes/<sha256 of the canonical path>.json`, holding the path, the
//! file's identity and the hash. It is reused only while the file is provably
//! the one hashed: same canonical path, size, mtime and ctime (nanoseconds),
//! inode and device. Any of them differing means the file is hashed again.
//! ctime is in the key because no user tool can set it: a same-size rewrite
//! that puts back the old mtime (`cp -p`, `touch -d`) still changes it.
//!
//! Timestamps are only as fine as the file system's clock tick, so a file
//! changed twice within one tick could keep its mtime and ctime. A hash is
//! therefore stored only for a file that had *settled*: its mtime and ctime
//! at least `SETTLE` older than the moment it was examined, so that any later
//! change stamps a newer time (git's "racily clean" rule). A file modified
//! while it was being hashed is not stored either.
//!
//! Files under `MIN_SIZE` are hashed every time: that takes milliseconds, and
//! the cache then holds only models worth remembering, not one entry per
//! temporary folder a test suite creates.
//!
//! The cache can only save time, never fail a run or change a verdict: an
//! absent, stale, corrupt or unreadable entry means hashing the file, and an
//! unwritable cache folder means hashing it again next time. Trouble other
//! than a missing entry is reported once per process, as a warning.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, SystemTime};

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use super::sha256_file;
use crate::error::Result;

/// How much older than "now" a file's timestamps must be for its hash to be
/// stored: above any file system's timestamp granularity (FAT's is 2 s).
const SETTLE: Duration = Duration::from_secs(3);

/// Files smaller than this are not worth a cache entry (16 MiB hash in ~10 ms).
const MIN_SIZE: u64 = 16 << 20;

/// Where hashes are remembered, and which.
pub struct HashCache {
    dir: PathBuf,
    settle: Duration,
    min_size: u64,
}

/// What identifies one version of a file: if all of it is unchanged, so are
/// the bytes (short of someone forging ctime, which needs root and a clock
/// change).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
struct Identity {
    path: PathBuf,
    size: u64,
    mtime_ns: i128,
    ctime_ns: i128,
    inode: u64,
    device: u64,
}

/// One cache file.
#[derive(Debug, Serialize, Deserialize)]
struct Entry {
    file: Identity,
    sha256: String,
}

impl HashCache {
    /// The cache under touchstone's cache folder (`cache::dir()/hashes`).
    pub fn in_cache_dir() -> HashCache {
        HashCache::at(crate::model::cache::dir().join("hashes"))
    }

    /// A cache kept in `dir` (created when first written).
    pub fn at(dir: PathBuf) -> HashCache {
        HashCache {
            dir,
            settle: SETTLE,
            min_size: MIN_SIZE,
        }
    }

    /// sha256 of `path` (lowercase hex), from the cache when the file is the
    /// one hashed before, else hashed now (and stored when settled). Errors
    /// are those of hashing the file: the cache never adds one.
    pub fn sha256(&self, path: &Path) -> Result<String> {
        let Some(before) = identity(path).filter(|f| f.size >= self.min_size) else {
            return sha256_file(path);
        };
        let entry_path = self.entry_path(&before.path);
        match self.lookup(&entry_path, &before) {
            Ok(Some(hash)) => return Ok(hash),
            Ok(None) => {}
            Err(e) => warn_once(&format!("cannot read {}: {e}", entry_path.display())),
        }
        let examined = SystemTime::now();
        let hash = sha256_file(path)?;
        if identity(path).as_ref() == Some(&before) && settled(&before, examined, self.settle) {
            let entry = Entry {
                file: before,
                sha256: hash.clone(),
            };
            if let Err(e) = self.store(&entry_path, &entry) {
                warn_once(&format!("cannot write {}: {e}", entry_path.display()));
            }
        }
        Ok(hash)
    }

    /// `<dir>/<sha256 of the canonical path>.json`: one entry per file,
    /// whatever characters its path holds.
    fn entry_path(&self, canonical: &Path) -> PathBuf {
        let key = Sha256::digest(canonical.as_os_str().as_encoded_bytes());
        self.dir.join(format!("{key:x}.json"))
    }

    /// The stored hash if the entry is for this very file version. A missing
    /// or unusable entry is `Ok(None)`; only an I/O failure other than a
    /// missing file is an error (worth a warning: the folder is unusable).
    fn lookup(&self, entry_path: &Path, now: &Identity) -> std::io::Result<Option<String>> {
        let text = match std::fs::read(entry_path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(e),
        };
        // A corrupt entry (a crash cannot leave one, `store` renames into
        // place, but a disk or a person can) is as good as none: it is
        // replaced after hashing.
        let Ok(entry) = serde_json::from_slice::<Entry>(&text) else {
            return Ok(None);
        };
        let well_formed = entry.sha256.len() == 64 && entry.sha256.bytes().all(|b| b.is_ascii_hexdigit());
        Ok((entry.file == *now && well_formed).then_some(entry.sha256))
    }

    /// Writes an entry atomically: a temp file beside it, then a rename, so
    /// a concurrent run reads the old entry or the new one, never a part.
    fn store(&self, entry_path: &Path, entry: &Entry) -> std::io::Result<()> {
        std::fs::create_dir_all(&self.dir)?;
        let mut tmp = tempfile::NamedTempFile::new_in(&self.dir)?;
        serde_json::to_writer(&mut tmp, entry)?;
        tmp.persist(entry_path).map_err(|e| e.error)?;
        Ok(())
    }
}

/// The identity of the file `path` names now, or None where it cannot be
/// had (a missing file: hashing it reports the error; a platform without
/// inodes: no caching).
#[cfg(unix)]
fn identity(path: &Path) -> Option<Identity> {
    use std::os::unix::fs::MetadataExt;
    let path = std::fs::canonicalize(path).ok()?;
    let m = std::fs::metadata(&path).ok()?;
    let ns = |secs: i64, nanos: i64| secs as i128 * 1_000_000_000 + nanos as i128;
    Some(Identity {
        size: m.size(),
        mtime_ns: ns(m.mtime(), m.mtime_nsec()),
        ctime_ns: ns(m.ctime(), m.ctime_nsec()),
        inode: m.ino(),
        device: m.dev(),
        path,
    })
}

#[cfg(not(unix))]
fn identity(_path: &Path) -> Option<Identity> {
    None
}

/// Whether both timestamps are at least `settle` before `examined`.
fn settled(file: &Identity, examined: SystemTime, settle: Duration) -> bool {
    let Ok(now) = examined.duration_since(SystemTime::UNIX_EPOCH) else {
        return false;
    };
    let limit = now.as_nanos() as i128 - settle.as_nanos() as i128;
    file.mtime_ns <= limit && file.ctime_ns <= limit
}

fn warn_once(msg: &str) {
    static WARNED: AtomicBool = AtomicBool::new(false);
    if !WARNED.swap(true, Ordering::Relaxed) {
        eprintln!("touchstone: warning: hash cache: {msg}; hashing the model file instead");
    }
}

#[cfg(test)]
mod tests;
