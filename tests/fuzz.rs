//! Fuzz targets for every parser of user input (specs, safetensors, .npy,
//! GGUF, config.json, `diff` reports), driven by bolero on the stable
//! toolchain. Each execution takes bolero's random bytes as a *mutation
//! recipe* applied to one seed of the committed corpus (`tests/fuzz/corpus/
//! <target>/`; how each seed was made: `tests/fuzz/README.md`): byte flips,
//! overwrites with boundary values, insertions, deletions, truncation and
//! splices, so inputs stay close to real files and reach deep into each
//! parser, and one in eight is the raw random bytes alone.
//!
//! Under `cargo test` each target runs BOLERO_RANDOM_ITERATIONS executions
//! (ci/test.sh sets 3000) and fails on a panic; an abort ends the test process
//! (a failed CI run); an execution over its time budget fails, and a watchdog
//! aborts the process, naming the target, if one ever hangs. No parser may
//! panic on any input: every failure must be a typed error.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Once;
use std::time::{Duration, Instant};

/// The most any one input may take: the parsers are linear in their input, so
/// even a 1 MiB input is far inside this; exponential nesting is not.
const BUDGET: Duration = Duration::from_secs(2);
/// The watchdog aborts the process when one execution exceeds this (a hang).
const HANG: Duration = Duration::from_secs(30);

static STARTED_MS: AtomicU64 = AtomicU64::new(0);
static WATCHDOG: Once = Once::new();

fn now_ms() -> u64 {
    use std::time::{SystemTime, UNIX_EPOCH};
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

fn watchdog() {
    WATCHDOG.call_once(|| {
        std::thread::spawn(|| loop {
            std::thread::sleep(Duration::from_millis(200));
            let s = STARTED_MS.load(Ordering::SeqCst);
            if s != 0 && now_ms().saturating_sub(s) > HANG.as_millis() as u64 {
                eprintln!("fuzz: an execution has run for over {HANG:?}: a hang; aborting");
                std::process::abort();
            }
        });
    });
}

fn corpus(target: &str) -> Vec<Vec<u8>> {
    let dir: PathBuf = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fuzz/corpus")
        .join(target);
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("seed corpus {}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .collect();
    files.sort();
    let seeds: Vec<Vec<u8>> = files.iter().map(|p| std::fs::read(p).unwrap()).collect();
    assert!(!seeds.is_empty(), "no seeds in {}", dir.display());
    seeds
}

/// One input from a seed and a recipe (see the module comment).
fn mutate(seeds: &[Vec<u8>], recipe: &[u8]) -> Vec<u8> {
    let Some((&head, mut r)) = recipe.split_first() else {
        return seeds[0].clone();
    };
    if head % 8 == 7 {
        return recipe.to_vec();
    }
    let mut out = seeds[head as usize % seeds.len()].clone();
    let mut take = |n: usize| -> Option<&[u8]> {
        (r.len() >= n).then(|| {
            let (a, b) = r.split_at(n);
            r = b;
            a
        })
    };
    const BOUNDARY: [u8; 8] = [0x00, 0x01, 0x7f, 0x80, 0xff, b'[', b'{', b'-'];
    while let Some(op) = take(3) {
        let len = out.len().max(1);
        let at = (u16::from_le_bytes([op[1], op[2]]) as usize * 7919) % len;
        match op[0] % 7 {
            0 if !out.is_empty() => {
                let i = at % out.len();
                out[i] ^= 1 << (op[1] % 8);
            }
            1 if !out.is_empty() => {
                let i = at % out.len();
                out[i] = BOUNDARY[op[2] as usize % BOUNDARY.len()];
            }
            2 => out.insert(at.min(out.len()), op[1]),
            3 if !out.is_empty() => {
                out.remove(at % out.len());
            }
            4 => out.truncate(at),
            5 => {
                // Overwrite 8 bytes with a little-endian count (lengths, dims).
                let v = [0u64, 1, 255, 65_536, u32::MAX as u64, i64::MAX as u64, u64::MAX][op[2] as usize % 7];
                for (k, b) in v.to_le_bytes().iter().enumerate() {
                    if let Some(x) = out.get_mut(at + k) {
                        *x = *b;
                    }
                }
            }
            _ => {
                // Splice: repeat a slice (nesting, duplicate keys, tables).
                let end = (at + 1 + op[1] as usize).min(out.len());
                let piece = out[at.min(end)..end].to_vec();
                let reps = 1 + op[2] as usize % 32;
                for _ in 0..reps {
                    out.splice(end..end, piece.iter().copied());
                }
            }
        }
    }
    out
}

/// Runs `target` over the corpus seeds, then over mutations of them.
fn fuzz(target: &'static str, run: impl Fn(&[u8]) + std::panic::RefUnwindSafe) {
    watchdog();
    let seeds = corpus(target);
    let execs = AtomicUsize::new(0);
    let exec = |input: &[u8]| {
        STARTED_MS.store(now_ms(), Ordering::SeqCst);
        let t = Instant::now();
        run(input);
        let took = t.elapsed();
        STARTED_MS.store(0, Ordering::SeqCst);
        execs.fetch_add(1, Ordering::Relaxed);
        assert!(
            took < BUDGET,
            "{target}: an input of {} bytes took {took:?} (budget {BUDGET:?}); first bytes {:?}",
            input.len(),
            &input[..input.len().min(64)]
        );
    };
    for s in &seeds {
        exec(s);
    }
    bolero::check!().for_each(|recipe: &[u8]| exec(&mutate(&seeds, recipe)));
    eprintln!(
        "fuzz {target}: {} executions, 0 panics, 0 over budget",
        execs.load(Ordering::Relaxed)
    );
}

#[test]
fn spec_parser() {
    fuzz("spec_parser", |input| {
        let _ = touchstone::spec::Spec::parse(Path::new("fuzz/spec.yaml"), &String::from_utf8_lossy(input));
    });
}

#[test]
fn safetensors_reader() {
    fuzz("safetensors_reader", |input| {
        let _ = touchstone::tensor::io::parse_safetensors(input, Path::new("fuzz.safetensors"));
    });
}

#[test]
fn npy_reader() {
    fuzz("npy_reader", |input| {
        let _ = touchstone::tensor::io::parse_npy(input, Path::new("fuzz.npy"));
    });
}

#[test]
fn gguf_reader() {
    fuzz("gguf_reader", |input| {
        if let Ok(f) = touchstone::gguf::GgufFile::from_bytes(Path::new("fuzz.gguf"), input) {
            // Every tensor the table declares is read (dequantised) too, and
            // the model view is built from the file.
            for info in &f.tensors {
                let _ = f.read_tensor(info);
            }
            if let Ok(cfg) = touchstone::model::gguf::config(&f) {
                let _ = touchstone::model::gguf::weights(&f, &cfg, &Default::default());
            }
        }
    });
}

#[test]
fn config_json() {
    fuzz("config_json", |input| {
        if let Ok(v) = serde_json::from_slice::<serde_json::Value>(input) {
            let _ = touchstone::model::ModelConfig::from_json(&v);
        }
    });
}

#[test]
fn diff_report() {
    fuzz("diff_report", |input| {
        let _ = touchstone::diff::parse_report(&String::from_utf8_lossy(input), Path::new("fuzz.json"));
    });
}
