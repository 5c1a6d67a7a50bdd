//! The real model: Qwen2.5-Coder-0.5B-Instruct, Q4_K_M GGUF (Q5_0, Q8_0, Q4_K,
//! Q6_K and F32 tensors), fetched by `python3 ci/fetch_real_model.py` into a
//! cache outside the checkout (never committed). Its path: `TOUCHSTONE_REAL_MODEL`,
//! else `$TOUCHSTONE_CACHE/models/<name>`, else `~/.cache/touchstone/models/<name>`.
//!
//! Trials (libtest-mimic, like `tests/conformance.rs`): without the file they
//! are reported as ignored with the reason, never as passed. With
//! `TOUCHSTONE_REAL_MODEL` set to a missing file they fail: a path given on
//! purpose must exist.
//!
//! - `real_model::config`: the config from the GGUF metadata.
//! - `real_model::inspect`: the whole tensor table, 291 tensors with their types.
//! - `real_model::load`: `model::load` returns every weight, finite, and the
//!   dequantised values of a few tensors of different types hash (sha256 of the
//!   little-endian f32 bytes) to what gguf-py's own dequantisation gave
//!   (`tests/fixtures/quant/real_model_tensors.json`, written by
//!   `goldens/recorders/make_quant_fixtures.py --real-model`).

use std::path::{Path, PathBuf};

use libtest_mimic::{Arguments, Completion, Failed, Trial};
use sha2::{Digest, Sha256};
use touchstone::model::{self, LoadOptions};

const NAME: &str = "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf";
const SIZE: u64 = 491_400_064;

/// The model's path, or why it is absent (`Err`), and whether the path was
/// given explicitly.
fn model_path() -> (Result<PathBuf, String>, bool) {
    if let Some(p) = std::env::var_os("TOUCHSTONE_REAL_MODEL") {
        let p = PathBuf::from(p);
        let r = if p.is_file() {
            Ok(p)
        } else {
            Err(format!("TOUCHSTONE_REAL_MODEL={} does not exist", p.display()))
        };
        return (r, true);
    }
    let base = std::env::var_os("TOUCHSTONE_CACHE")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| Path::new(&h).join(".cache/touchstone")));
    let Some(base) = base else {
        return (
            Err("no TOUCHSTONE_CACHE and no HOME to find the real model".into()),
            false,
        );
    };
    let p = base.join("models").join(NAME);
    if p.is_file() {
        (Ok(p), false)
    } else {
        (
            Err(format!(
                "real model not found at {} (run `python3 ci/fetch_real_model.py`, or set TOUCHSTONE_REAL_MODEL)",
                p.display()
            )),
            false,
        )
    }
}

fn fixture() -> serde_json::Value {
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/quant/real_model_tensors.json");
    serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap()
}

fn check(cond: bool, msg: impl FnOnce() -> String) -> Result<(), Failed> {
    if cond {
        Ok(())
    } else {
        Err(msg().into())
    }
}

fn config(p: &Path) -> Result<(), Failed> {
    let c = model::read_config(p).map_err(|e| e.to_string())?;
    let got = (
        c.arch.as_str(),
        c.hidden,
        c.layers,
        c.heads,
        c.kv_heads,
        c.head_dim,
        c.ffn,
        c.vocab,
        c.rope_theta,
        c.tie_embeddings,
    );
    let want = ("qwen2", 896, 24, 14, 2, 64, 4864, 151936, 1e6, false);
    check(got == want, || format!("config {got:?}, expected {want:?}"))
}

fn inspect(p: &Path) -> Result<(), Failed> {
    let out = touchstone::inspect::render(p).map_err(|e| e.to_string())?;
    let lines: Vec<&str> = out.lines().collect();
    let header = lines
        .iter()
        .position(|l| l.starts_with("name "))
        .ok_or("no table header")?;
    let rows = &lines[header + 1..lines.len() - 1];
    check(rows.len() == 291, || format!("{} table rows, expected 291", rows.len()))?;
    let summary = lines[lines.len() - 1];
    for needle in [
        "291 tensors by type: 121 F32 (",
        ", 133 Q5_0 (",
        ", 13 Q8_0 (",
        ", 12 Q4_K (",
        ", 12 Q6_K (",
    ] {
        check(summary.contains(needle), || {
            format!("summary lacks {needle:?}: {summary}")
        })?;
    }
    check(!summary.contains("cannot be read"), || summary.to_string())?;
    // Every row has statistics (every type is readable) and no non-finite value.
    for r in rows {
        let cells: Vec<&str> = r.split_whitespace().collect();
        check(cells.last() == Some(&"0") && !cells.contains(&"-"), || {
            format!("row: {r}")
        })?;
    }
    let row = rows
        .iter()
        .find(|r| r.starts_with("blk.0.ffn_down.weight "))
        .ok_or("no blk.0.ffn_down")?;
    check(row.contains(" Q6_K ") && row.contains("[896, 4864]"), || {
        row.to_string()
    })
}

fn load(p: &Path) -> Result<(), Failed> {
    let size = std::fs::metadata(p).map_err(|e| e.to_string())?.len();
    check(size == SIZE, || {
        format!("{} is {size} bytes, not the pinned model's {SIZE}", p.display())
    })?;
    let t0 = std::time::Instant::now();
    let (cfg, mut ws) = model::load(p, &LoadOptions::default()).map_err(|e| e.to_string())?;
    // For the record (not checked: it depends on the machine).
    let peak = std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| s.lines().find(|l| l.starts_with("VmHWM:")).map(str::to_string))
        .unwrap_or_default();
    eprintln!(
        "model::load: {:.2} s; peak RSS so far {peak}",
        t0.elapsed().as_secs_f64()
    );
    let fx = fixture();
    let mut taken = Vec::new();
    for t in fx["tensors"].as_array().ok_or("fixture: tensors")? {
        let gguf = t["name"].as_str().ok_or("fixture: name")?;
        let hf = touchstone::gguf::model::hf_name(gguf).ok_or_else(|| format!("no HF name for {gguf}"))?;
        let shape: Vec<usize> = t["shape"]
            .as_array()
            .ok_or("fixture: shape")?
            .iter()
            .map(|n| n.as_u64().unwrap_or(0) as usize)
            .collect();
        let w = ws.take(&hf, &shape).map_err(|e| e.to_string())?;
        let bytes: Vec<u8> = w.data().iter().flat_map(|x| x.to_le_bytes()).collect();
        let got = format!("{:x}", Sha256::digest(&bytes));
        let want = t["sha256_f32_le"].as_str().ok_or("fixture: sha256")?;
        check(got == want, || {
            let hex = |b: u32| format!("{b:#010x}");
            let first: Vec<String> = w.data()[..4].iter().map(|x| hex(x.to_bits())).collect();
            let theirs: Vec<String> = t["first_bits"]
                .as_array()
                .map(|a| a.iter().map(|b| hex(b.as_u64().unwrap_or(0) as u32)).collect())
                .unwrap_or_default();
            format!(
                "{gguf} ({}): sha256 of the dequantised f32 {got}, gguf-py {want}; first values' bits {first:?}, \
                 gguf-py {theirs:?}",
                t["type"]
            )
        })?;
        eprintln!(
            "{gguf} ({}, {shape:?}): identical to gguf-py's dequantisation",
            t["type"]
        );
        taken.push(hf);
    }
    // Every other weight is there with its expected shape, and finite.
    for (name, shape, required) in touchstone::gguf::model::expected_tensors(&cfg) {
        let hf = touchstone::gguf::model::hf_name(&name).unwrap_or_default();
        if taken.contains(&hf) {
            continue;
        }
        match ws.take_opt(&hf, &shape).map_err(|e| e.to_string())? {
            None => check(!required, || format!("missing {name}"))?,
            Some(t) => {
                check(t.data().iter().all(|x| x.is_finite()), || {
                    format!("{name}: a non-finite value")
                })?;
                taken.push(hf);
            }
        }
    }
    let left: Vec<&str> = ws.remaining().collect();
    check(left.is_empty(), || format!("tensors left over: {left:?}"))?;
    check(taken.len() == 291, || format!("{} tensors, expected 291", taken.len()))
}

type Check = fn(&Path) -> Result<(), Failed>;

fn main() {
    let args = Arguments::from_args();
    let (path, explicit) = model_path();
    let trials: [(&str, Check); 3] = [("config", config), ("inspect", inspect), ("load", load)];
    let trials = trials
        .into_iter()
        .map(|(name, f)| {
            let name = format!("real_model::{name}");
            match (&path, explicit) {
                (Ok(p), _) => {
                    let p = p.clone();
                    Trial::test(name, move || f(&p))
                }
                (Err(why), true) => {
                    let why = why.clone();
                    Trial::test(name, move || Err(why.into()))
                }
                (Err(why), false) => {
                    let why = why.clone();
                    Trial::ignorable_test(name, move || Ok(Completion::ignored_with(why)))
                }
            }
        })
        .collect();
    libtest_mimic::run(&args, trials).exit();
}
