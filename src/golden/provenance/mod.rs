//! Stale-golden detection. A golden recorded for another model or another prompt
//! does not "almost match": every stage differs, and a run would report
//! thousands of mismatches that all mean one thing. So before any engine runs,
//! the plan compares each golden's provenance with what is about to be tested
//! and stops with one message naming both sides.
//!
//! What is compared, and why:
//! - **Weights hash, only when the formats match.** HF goldens record
//!   `model_sha256`, the sha256 of the HF folder's `model.safetensors`. A GGUF
//!   converted from the same weights has a different file hash, so the hash is
//!   compared only when the model under test is in the format the golden
//!   hashed: an HF folder against `model_sha256` of a golden whose provenance
//!   `source` is `hf` (or against `hf_model_sha256` if another recorder writes
//!   it), a single file (e.g. `.gguf`) against `gguf_sha256`. A sharded HF folder
//!   (no single `model.safetensors`) is not hashed either.
//! - **Config dims, always** (when recorded): the golden's `model_config` (the HF
//!   `config.json`) must give the same vocab, hidden, FFN, layers, heads, KV heads
//!   and head dim as the model under test. This is the fallback that still
//!   catches "another model" when the hashes cannot be compared.
//! - **Prompt token ids**: when the spec gives its own `prompt.tokens`, they must
//!   be the golden's recorded `prefill/tokens`. (With `prompt: {golden: …}` the
//!   prompt *is* the golden's, so there is nothing to compare.)
//!
//! A mismatch is `Error::Golden` (exit 2, bad input): the inputs of the run are
//! inconsistent, no check result would mean anything.

use std::collections::BTreeMap;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde_json::Value;
use sha2::{Digest, Sha256};

use crate::error::{Error, Result};
use crate::golden::GoldenSet;
use crate::model::ModelConfig;

mod hash_cache;
pub use hash_cache::HashCache;

const REGEN: &str = "regenerate with `touchstone goldens regen`";

/// sha256 of a file, streamed (model weights can be large).
pub fn sha256_file(path: &Path) -> Result<String> {
    let mut f = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf).map_err(|e| Error::io(path, e))?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    Ok(format!("{:x}", h.finalize()))
}

/// The file whose hash a golden may have recorded for `model`, and the
/// provenance keys that hold such a hash, by format.
fn hashed_file(model: &Path, prov: &Value) -> Option<(PathBuf, Vec<&'static str>)> {
    if model.is_dir() {
        let weights = model.join("model.safetensors");
        let keys = if prov.get("source").and_then(Value::as_str) == Some("hf") {
            vec!["model_sha256", "hf_model_sha256"]
        } else {
            vec!["hf_model_sha256"]
        };
        weights.is_file().then_some((weights, keys))
    } else {
        Some((model.to_path_buf(), vec!["gguf_sha256"]))
    }
}

/// Checks every golden of a plan against the model and prompt under test.
pub fn check_fresh(
    model: &Path,
    config: &ModelConfig,
    goldens: &BTreeMap<String, Arc<GoldenSet>>,
    spec_tokens: Option<&[u32]>,
) -> Result<()> {
    // Hash each file at most once per plan, and a large one once for as long
    // as it is unchanged (`HashCache`).
    let cache = HashCache::in_cache_dir();
    let mut hashes: BTreeMap<PathBuf, String> = BTreeMap::new();
    for (source, g) in goldens {
        let gpath = g.path.display();
        if let Some((file, keys)) = hashed_file(model, &g.provenance) {
            if let Some((key, recorded)) = keys
                .iter()
                .find_map(|k| g.provenance.get(*k).and_then(Value::as_str).map(|v| (*k, v)))
            {
                let actual = match hashes.get(&file) {
                    Some(h) => h.clone(),
                    None => {
                        let h = cache.sha256(&file)?;
                        hashes.insert(file.clone(), h.clone());
                        h
                    }
                };
                if actual != recorded {
                    return Err(Error::golden(
                        &g.path,
                        format!(
                            "stale golden: golden `{source}` ({gpath}) was recorded for a model with {key} {recorded}, \
                             but the model under test ({}) has sha256 {actual} ({}) — {REGEN}, or point the spec at the \
                             model the golden was recorded for",
                            model.display(),
                            file.display()
                        ),
                    ));
                }
            }
        }
        if let Some(recorded) = g.provenance.get("model_config") {
            if let Ok(rc) = ModelConfig::from_json(recorded) {
                let dims = |c: &ModelConfig| {
                    [
                        ("vocab", c.vocab),
                        ("hidden", c.hidden),
                        ("ffn", c.ffn),
                        ("layers", c.layers),
                        ("heads", c.heads),
                        ("kv_heads", c.kv_heads),
                        ("head_dim", c.head_dim),
                    ]
                };
                let diffs: Vec<String> = dims(&rc)
                    .iter()
                    .zip(dims(config))
                    .filter(|(a, b)| a.1 != b.1)
                    .map(|(a, b)| format!("{} {} vs {}", a.0, a.1, b.1))
                    .collect();
                if !diffs.is_empty() {
                    return Err(Error::golden(
                        &g.path,
                        format!(
                            "stale golden: golden `{source}` ({gpath}) was recorded for a model with other dimensions \
                             than the model under test ({}): {} (golden vs model) — {REGEN}",
                            model.display(),
                            diffs.join(", ")
                        ),
                    ));
                }
            }
        }
        if let Some(tokens) = spec_tokens {
            if tokens != g.prompt() {
                return Err(Error::golden(
                    &g.path,
                    format!(
                        "stale golden: golden `{source}` ({gpath}) was recorded for prompt tokens {:?}, but the spec's \
                         prompt is {tokens:?} — {REGEN} (it records the golden's prompt text; use `prompt: {{golden: \
                         {source}}}` to run the golden's prompt)",
                        g.prompt()
                    ),
                ));
            }
        }
    }
    Ok(())
}
