//! The hash cache reuses a hash only for the very file it hashed, and never
//! fails or falsifies a hash because of its own state. Every test keeps its
//! cache in a temp folder (never the user's), caches files of any size and
//! (except where the settling rule is the subject) files of any age.
//!
//! Reuse is proved with a sentinel: the stored hash is replaced by one no
//! file has; getting it back means the file was not hashed again.

use std::fs;
use std::time::{Duration, SystemTime};

use super::*;

const SENTINEL: &str = "5e5e5e5e5e5e5e5e5e5e5e5e5e5e5e5e5e5e5e5e5e5e5e5e5e5e5e5e5e5e5e5e";

fn cache_in(dir: &Path) -> HashCache {
    HashCache {
        dir: dir.join("hashes"),
        settle: Duration::ZERO,
        min_size: 0,
    }
}

fn entry_file(cache: &HashCache, file: &Path) -> PathBuf {
    cache.entry_path(&fs::canonicalize(file).unwrap())
}

/// Replaces the stored hash of `file` by the sentinel, its identity kept.
fn plant_sentinel(cache: &HashCache, file: &Path) {
    let p = entry_file(cache, file);
    let mut e: Entry = serde_json::from_slice(&fs::read(&p).unwrap()).unwrap();
    e.sha256 = SENTINEL.into();
    fs::write(p, serde_json::to_vec(&e).unwrap()).unwrap();
}

/// A file with `content`, last modified an hour ago.
fn old_file(dir: &Path, name: &str, content: &[u8]) -> PathBuf {
    let p = dir.join(name);
    fs::write(&p, content).unwrap();
    set_mtime(&p, SystemTime::now() - Duration::from_secs(3600));
    p
}

fn set_mtime(p: &Path, t: SystemTime) {
    fs::File::options()
        .write(true)
        .open(p)
        .unwrap()
        .set_modified(t)
        .unwrap();
}

fn mtime(p: &Path) -> SystemTime {
    fs::metadata(p).unwrap().modified().unwrap()
}

/// A file's ctime moves on the file system's clock tick: wait one out
/// before a change that only ctime reveals.
fn next_tick() {
    std::thread::sleep(Duration::from_millis(50));
}

#[test]
fn an_unchanged_file_is_not_hashed_again() {
    let d = tempfile::tempdir().unwrap();
    let cache = cache_in(d.path());
    let f = old_file(d.path(), "model.gguf", b"weights");
    let want = sha256_file(&f).unwrap();
    assert_eq!(cache.sha256(&f).unwrap(), want);
    assert!(entry_file(&cache, &f).is_file(), "stored");
    plant_sentinel(&cache, &f);
    assert_eq!(cache.sha256(&f).unwrap(), SENTINEL, "reused, not rehashed");
    // Another spelling of the same path is the same file.
    let other = d.path().join(".").join("model.gguf");
    assert_eq!(cache.sha256(&other).unwrap(), SENTINEL);
}

#[test]
fn a_rewrite_a_touch_or_a_replacement_is_hashed_again() {
    let d = tempfile::tempdir().unwrap();
    let cache = cache_in(d.path());
    let f = old_file(d.path(), "model.gguf", b"weights");
    let original = mtime(&f);
    cache.sha256(&f).unwrap();

    // Rewritten in place, same size: a new mtime.
    plant_sentinel(&cache, &f);
    fs::write(&f, b"WEIGHTS").unwrap();
    assert_eq!(cache.sha256(&f).unwrap(), sha256_file(&f).unwrap());

    // Rewritten again with the old mtime put back (`cp -p`): ctime tells.
    plant_sentinel(&cache, &f);
    next_tick();
    fs::write(&f, b"weights").unwrap();
    set_mtime(&f, original);
    assert_eq!(mtime(&f), original);
    assert_eq!(cache.sha256(&f).unwrap(), sha256_file(&f).unwrap());

    // Touched: same bytes, but nothing proves it without hashing.
    plant_sentinel(&cache, &f);
    set_mtime(&f, original + Duration::from_secs(1));
    let h = cache.sha256(&f).unwrap();
    assert_eq!(h, sha256_file(&f).unwrap());
    assert_ne!(h, SENTINEL);

    // Replaced by another file (a new inode) with the same size and mtime.
    plant_sentinel(&cache, &f);
    let g = d.path().join("new.gguf");
    fs::write(&g, b"weighTs").unwrap();
    set_mtime(&g, mtime(&f));
    fs::rename(&g, &f).unwrap();
    assert_eq!(cache.sha256(&f).unwrap(), sha256_file(&f).unwrap());
}

#[test]
fn a_just_modified_or_small_file_is_hashed_but_not_stored() {
    let d = tempfile::tempdir().unwrap();
    let settling = HashCache {
        settle: SETTLE,
        ..cache_in(d.path())
    };
    let f = d.path().join("fresh.gguf");
    fs::write(&f, b"weights").unwrap();
    assert_eq!(settling.sha256(&f).unwrap(), sha256_file(&f).unwrap());
    assert!(
        !entry_file(&settling, &f).exists(),
        "a file this recent could change unseen"
    );
    // Once settled, it is stored.
    set_mtime(&f, SystemTime::now() - Duration::from_secs(3600));
    let settled = HashCache {
        settle: Duration::ZERO,
        ..settling
    };
    settled.sha256(&f).unwrap();
    assert!(entry_file(&settled, &f).exists());

    let sized = HashCache::at(d.path().join("sized"));
    let small = old_file(d.path(), "small.gguf", b"tiny");
    assert_eq!(sized.sha256(&small).unwrap(), sha256_file(&small).unwrap());
    assert!(!d.path().join("sized").exists(), "below MIN_SIZE nothing is stored");
}

#[test]
fn a_corrupt_or_foreign_entry_is_ignored_and_replaced() {
    let d = tempfile::tempdir().unwrap();
    let cache = cache_in(d.path());
    let f = old_file(d.path(), "model.gguf", b"weights");
    let want = sha256_file(&f).unwrap();
    cache.sha256(&f).unwrap();
    let entry = entry_file(&cache, &f);
    let stored: Entry = serde_json::from_slice(&fs::read(&entry).unwrap()).unwrap();

    let other_size = Entry {
        file: Identity {
            size: stored.file.size + 1,
            ..stored.file.clone()
        },
        sha256: SENTINEL.into(),
    };
    let not_hex = Entry {
        file: stored.file.clone(),
        sha256: "z".repeat(64),
    };
    for bad in [
        b"{ not json".to_vec(),
        Vec::new(),
        serde_json::to_vec(&other_size).unwrap(),
        serde_json::to_vec(&not_hex).unwrap(),
    ] {
        fs::write(&entry, &bad).unwrap();
        assert_eq!(cache.sha256(&f).unwrap(), want);
        let now: Entry = serde_json::from_slice(&fs::read(&entry).unwrap()).unwrap();
        assert_eq!((now.file, now.sha256), (stored.file.clone(), want.clone()), "replaced");
    }
}

#[test]
fn an_unusable_cache_folder_never_fails_the_hash() {
    let d = tempfile::tempdir().unwrap();
    let f = old_file(d.path(), "model.gguf", b"weights");
    let want = sha256_file(&f).unwrap();
    // The cache folder is a file: nothing can be created in it.
    fs::write(d.path().join("hashes"), b"in the way").unwrap();
    let cache = cache_in(d.path());
    assert_eq!(cache.sha256(&f).unwrap(), want);
    assert_eq!(cache.sha256(&f).unwrap(), want);
    // The entry is a folder: it can be neither read nor replaced.
    let e = tempfile::tempdir().unwrap();
    let cache = cache_in(e.path());
    fs::create_dir_all(entry_file(&cache, &f).join("x")).unwrap();
    assert_eq!(cache.sha256(&f).unwrap(), want);
}

#[test]
fn a_missing_file_fails_as_hashing_it_does() {
    let d = tempfile::tempdir().unwrap();
    let cache = cache_in(d.path());
    let missing = d.path().join("missing.gguf");
    assert_eq!(
        cache.sha256(&missing).unwrap_err().to_string(),
        sha256_file(&missing).unwrap_err().to_string()
    );
    assert!(!d.path().join("hashes").exists());
}
