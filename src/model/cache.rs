//! touchstone's cache folder, outside any checkout: large files that are
//! fetched or built, never committed (the real model, the recorders' Python
//! environment and llama.cpp build). `$TOUCHSTONE_CACHE`, default
//! `~/.cache/touchstone`. A spec names a cached model as
//! `model: cache:<file name>`, which resolves to `<cache>/models/<file name>`.

use std::path::PathBuf;

/// The prefix of a spec's `model:` that names a file in the model cache.
pub const MODEL_PREFIX: &str = "cache:";

/// The cache folder (`$TOUCHSTONE_CACHE`, default `~/.cache/touchstone`).
pub fn dir() -> PathBuf {
    if let Some(d) = std::env::var_os("TOUCHSTONE_CACHE").filter(|d| !d.is_empty()) {
        return PathBuf::from(d);
    }
    let home = std::env::var_os("HOME")
        .map(PathBuf::from)
        .unwrap_or_else(std::env::temp_dir);
    home.join(".cache").join("touchstone")
}

/// Where a cached model named `name` lives.
pub fn model_path(name: &str) -> PathBuf {
    dir().join("models").join(name)
}

/// How to get a cached model that is missing (the fetch script knows the
/// models the shipped specs use).
pub fn fetch_hint(name: &str) -> String {
    format!(
        "`{MODEL_PREFIX}{name}` is a model in touchstone's cache ({}), which does not hold it: fetch it with \
         `python3 ci/fetch_real_model.py` (the test command does), or set TOUCHSTONE_CACHE to the folder whose \
         `models/` holds it",
        dir().display()
    )
}
