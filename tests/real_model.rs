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

mod common;
use common::perturb;

use std::path::{Path, PathBuf};

use libtest_mimic::{Arguments, Completion, Failed, Trial};
use sha2::{Digest, Sha256};

use touchstone::checks::Status;
use touchstone::engine::cpu::CpuEngine;
use touchstone::engine::replay::Replay;
use touchstone::engine::Engine;
use touchstone::model::{self, LoadOptions};
use touchstone::plan::Plan;
use touchstone::runner::{run_on, Filter};
use touchstone::spec::Spec;
use touchstone::tensor::io::{read_safetensors, write_safetensors};

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
    let out = touchstone::cmd::inspect::render(p).map_err(|e| e.to_string())?;
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
        let hf = touchstone::model::gguf::hf_name(gguf).ok_or_else(|| format!("no HF name for {gguf}"))?;
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
    for (name, shape, required) in touchstone::model::gguf::expected_tensors(&cfg) {
        let hf = touchstone::model::gguf::hf_name(&name).unwrap_or_default();
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

/// Issue 10's acceptance on the real model: with both references and the
/// oracle under the default (scaled) policy the run passes, and a 1e-3
/// relative perturbation of one block of one stage of a copy of the HF golden
/// is the run's earliest failure, at exactly that stage, as a suspect golden
/// (two sources vote: HF and the oracle), never as the engine's divergence.
fn tampered_goldens(p: &Path) -> Result<(), Failed> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let spec_path = root.join("specs/qwen2.5-0.5b.yaml");
    let spec = Spec::load(&spec_path).map_err(|e| e.to_string())?;
    let plan = Plan::build(spec.clone(), Some(p)).map_err(|e| e.to_string())?;
    // One engine run serves every golden copy (replayed).
    let cpu = CpuEngine::load_with(&plan.model, &plan.load_options).map_err(|e| e.to_string())?;
    let engine = Replay::new(&cpu);
    // Stage checks only: one engine run serves every golden copy.
    let filter = Filter(Some(vec!["*::golden:*".into(), "*::references_agree:*".into()]));
    let base = run_on(&plan, &engine, &filter, &|id| id.to_string());
    let failed: Vec<&str> = base
        .outcomes
        .iter()
        .filter(|o| o.status == Status::Fail)
        .map(|o| o.id.as_str())
        .collect();
    check(failed.is_empty(), || format!("the untampered goldens fail: {failed:?}"))?;
    eprintln!("untampered: {} checks pass", base.outcomes.len());

    let hf = spec.goldens["hf"].clone();
    let tmp = tempfile::tempdir().map_err(|e| e.to_string())?;
    type Block = Box<dyn Fn(&[usize]) -> bool>;
    let cases: [(&str, &str, Block); 7] = [
        (
            "prefill/blk.0.q_rope",
            "head 3 at every position",
            Box::new(|i| i[1] == 3),
        ),
        // The golden keeps rows 0 and 18 of the prefill (`record.rows`):
        // its row 1 is the last prompt token's.
        (
            "prefill/blk.11.attn_out",
            "the last token's row",
            Box::new(|i| i[0] == 1),
        ),
        ("decode4/blk.11.ffn_out", "the step's row", Box::new(|_| true)),
        // A middle layer's output, recorded for every layer: the golden
        // suspect is named at exactly that layer, whichever token row. The
        // last row's values are far below the first token's outlier
        // features: its change is found by the row floors of a residual add
        // (checks::row_judge), under the stage-wide floor the first row sets.
        ("prefill/blk.11.out", "the first token's row", Box::new(|i| i[0] == 0)),
        ("prefill/blk.11.out", "the last token's row", Box::new(|i| i[0] == 1)),
        // One block of 32 values of the last row.
        (
            "prefill/blk.11.out",
            "32 values of the last token's row",
            Box::new(|i| i[0] == 1 && (64..96).contains(&i[1])),
        ),
        // And at the decode step the golden records (every layer's output
        // is recorded at prefill and decode4).
        ("decode4/blk.11.out", "the step's row", Box::new(|_| true)),
    ];
    for (key, what, block) in cases {
        let f = read_safetensors(&hf).map_err(|e| e.to_string())?;
        let mut floats = f.floats;
        let t = floats
            .get_mut(key)
            .ok_or_else(|| format!("the HF golden has no {key}"))?;
        let n = perturb(t, 1e-3, block.as_ref());
        let copy = tmp.path().join("hf.safetensors");
        write_safetensors(&copy, &floats, &f.ints, &f.metadata).map_err(|e| e.to_string())?;
        let mut s = spec.clone();
        s.goldens.insert("hf".into(), copy);
        let plan = Plan::build(s, Some(p)).map_err(|e| e.to_string())?;
        let r = run_on(&plan, &engine, &filter, &|id| id.to_string());
        let failed: Vec<&touchstone::report::Outcome> =
            r.outcomes.iter().filter(|o| o.status == Status::Fail).collect();
        let (step, stage) = key.split_once('/').unwrap();
        let suspect = r.suspect_golden.as_ref().map(|d| (d.step.as_str(), d.stage.as_str()));
        check(suspect == Some((step, stage)), || {
            format!(
                "{key} ({what}, {n} values) x1.001: suspect golden {suspect:?}, failures {:?}",
                failed.iter().map(|o| &o.id).collect::<Vec<_>>()
            )
        })?;
        check(r.first_divergence.is_none(), || {
            format!("{key}: the engine is blamed: {:?}", r.first_divergence)
        })?;
        check(failed.iter().all(|o| o.id.starts_with(&format!("{key}::"))), || {
            format!(
                "{key}: failures elsewhere: {:?}",
                failed.iter().map(|o| &o.id).collect::<Vec<_>>()
            )
        })?;
        let ra = failed
            .iter()
            .find(|o| o.check == "references_agree:oracle~hf")
            .ok_or("no references_agree failure")?;
        // A row judged past its own allowance (checks::row_judge) names it.
        let (scope, e, allowed) = match ra.metrics.get("row") {
            Some(row) => (
                format!("token row {row}"),
                ra.metrics["row_error"],
                ra.metrics["row_allowed"],
            ),
            None => (
                "the stage".to_string(),
                ra.metrics["error_vs_oracle"],
                ra.metrics["allowed"],
            ),
        };
        eprintln!(
            "{key} ({what}, {n} values) x1.001: earliest failure {key}::{} (golden suspect), hf's error over {scope} {e:.3e} > allowed {allowed:.3e}",
            ra.check
        );
    }
    Ok(())
}

/// A bug confined to one middle layer: the engine's layer 11 reads layer
/// 12's `v_proj` weights (a loader that swapped the two, planted with the
/// test aid `LoadOptions::plant`). Every layer's output is recorded, so the
/// first divergence is in layer 11, at its `v`, not at the last layer.
fn middle_layer_bug(p: &Path) -> Result<(), Failed> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let spec = Spec::load(&root.join("specs/qwen2.5-0.5b.yaml")).map_err(|e| e.to_string())?;
    let plan = Plan::build(spec, Some(p)).map_err(|e| e.to_string())?;
    let mut opts = plan.load_options.clone();
    opts.plant = Some(model::LoaderBug::Swap(
        "model.layers.11.self_attn.v_proj.weight".into(),
        "model.layers.12.self_attn.v_proj.weight".into(),
    ));
    let cpu = CpuEngine::load_with(&plan.model, &opts).map_err(|e| e.to_string())?;
    let filter = Filter(Some(vec!["*::golden:*".into(), "*::references_agree:*".into()]));
    let r = run_on(&plan, &cpu, &filter, &|id| id.to_string());
    let fd = r.first_divergence.as_ref().ok_or("the swapped v_proj is not caught")?;
    eprintln!(
        "layer 11 reading layer 12's v_proj: first divergence {}/{} ({})",
        fd.step, fd.stage, fd.check
    );
    check(fd.stage.starts_with("blk.11."), || {
        format!("first divergence {}/{}, expected in layer 11", fd.step, fd.stage)
    })?;
    check(r.suspect_golden.is_none(), || {
        format!("a golden is blamed: {:?}", r.suspect_golden)
    })
}

/// Issue 22: a loader bug confined to the last layer (layer 23 reading layer
/// 22's v_proj) fails the logits-only `next_token` check over the prompt
/// set, whether the engine's runs tap only the logits or every stage; the
/// same engine without the bug passes both.
fn last_layer_bug(p: &Path) -> Result<(), Failed> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let path = root.join("specs/qwen2.5-0.5b.yaml");
    let text = std::fs::read_to_string(&path).map_err(|e| e.to_string())?;
    // The spec's next_token line, once more with every stage tapped.
    let line = text
        .lines()
        .find(|l| l.trim_start().starts_with("- {next_token:"))
        .ok_or("specs/qwen2.5-0.5b.yaml has no `- {next_token: …}` run check")?;
    let tapped = line.replacen("}}", ", taps: all}}", 1);
    let spec = Spec::parse(&path, &format!("{text}\n{tapped}\n")).map_err(|e| e.to_string())?;
    let plan = Plan::build(spec, Some(p)).map_err(|e| e.to_string())?;
    let filter = Filter(Some(vec!["*::run::next_token*".into()]));
    let verdicts = |opts: &LoadOptions| -> Result<Vec<(String, Status, String)>, Failed> {
        let cpu = CpuEngine::load_with(&plan.model, opts).map_err(|e| e.to_string())?;
        let r = run_on(&plan, &cpu, &filter, &|id| id.to_string());
        Ok(r.outcomes
            .iter()
            .map(|o| (o.id.clone(), o.status, o.message.clone()))
            .collect())
    };
    let clean = verdicts(&plan.load_options)?;
    check(clean.len() == 2, || {
        format!("expected next_token and next_token:tapped, got {clean:?}")
    })?;
    for (id, status, msg) in &clean {
        check(*status == Status::Pass, || {
            format!("the correct engine fails {id}: {msg}")
        })?;
    }
    let mut opts = plan.load_options.clone();
    opts.plant = Some(model::LoaderBug::Swap(
        "model.layers.23.self_attn.v_proj.weight".into(),
        "model.layers.22.self_attn.v_proj.weight".into(),
    ));
    let buggy = verdicts(&opts)?;
    for (id, status, msg) in &buggy {
        eprintln!("layer 23 reading layer 22's v_proj, {id}: {status:?}\n{msg}");
        check(*status == Status::Fail, || {
            format!("{id} passes the last-layer bug: {msg}")
        })?;
    }
    Ok(())
}

/// Issue 20: an engine that quantises every matmul input to 8 bits (the CPU
/// engine's q8_k mode, llama.cpp's arithmetic on this K-quant model) passes
/// every golden and references_agree check when it declares that
/// arithmetic, and fails when it declares f32: its quantisation error is far
/// beyond f32's floors, and declaring it never loosens an f32 engine's.
fn q8_engine(p: &Path) -> Result<(), Failed> {
    use touchstone::arithmetic::{Activations, Arithmetic};
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let spec = Spec::load(&root.join("specs/qwen2.5-0.5b.yaml")).map_err(|e| e.to_string())?;
    let mut plan = Plan::build(spec, Some(p)).map_err(|e| e.to_string())?;
    plan.load_options.activations = Activations::Q8 { block: 256 };
    let cpu = CpuEngine::load_with(&plan.model, &plan.load_options).map_err(|e| e.to_string())?;
    let engine = Replay::new(&cpu);
    check(engine.arithmetic().is_some_and(|a| a.quantises()), || {
        "the q8 mode does not declare its arithmetic".into()
    })?;
    let filter = Filter(Some(vec!["*::golden:*".into(), "*::references_agree:*".into()]));
    let r = run_on(&plan, &engine, &filter, &|id| id.to_string());
    let failed: Vec<&str> = r
        .outcomes
        .iter()
        .filter(|o| o.status == Status::Fail)
        .map(|o| o.id.as_str())
        .collect();
    check(failed.is_empty(), || format!("declared q8_k, it fails: {failed:?}"))?;
    let worst = r
        .outcomes
        .iter()
        .filter(|o| o.check.starts_with("golden:"))
        .filter_map(|o| o.metrics.get("ratio").map(|v| (*v, o.id.clone())))
        .fold((0.0f64, String::new()), |a, b| if b.0 > a.0 { b } else { a });
    eprintln!(
        "declared q8_k: {} checks pass, largest engine ratio {:.3} at {}",
        r.outcomes.len(),
        worst.0,
        worst.1
    );

    // The same engine declaring f32.
    plan.load_options.declare = Some(Arithmetic::F32);
    let lying = CpuEngine::load_with(&plan.model, &plan.load_options).map_err(|e| e.to_string())?;
    let r = run_on(&plan, &lying, &filter, &|id| id.to_string());
    let failed: Vec<&str> = r
        .outcomes
        .iter()
        .filter(|o| o.status == Status::Fail)
        .map(|o| o.id.as_str())
        .collect();
    check(!failed.is_empty(), || "declared f32, the 8-bit engine passes".into())?;
    let first = r.first_divergence.as_ref().map(|d| format!("{}/{}", d.step, d.stage));
    eprintln!("declared f32: {} failures, first divergence {first:?}", failed.len());
    Ok(())
}

/// Issue 20: detection power measured, not assumed. On the real model at
/// each storage, one token row of a mid-model stage is scaled by 1 + δ
/// (`touchstone power`): the smallest δ from which that stage is the run's
/// earliest failure must be at most 1e-3 at f32 and 1e-2 at f16 (bf16 is
/// printed: its unit roundoff is 3.9e-3). blk.11.out is checked by the
/// golden policy and by `residual` (the sum recomputed from the engine's
/// own captures); blk.11.ffn_act by the golden policy and by `swiglu`
/// (silu(gate)·up recomputed from the engine's own captures).
fn detection_power(p: &Path) -> Result<(), Failed> {
    use touchstone::cmd::power::{measure_each, Grid};
    use touchstone::stage::parse_key;
    use touchstone::tensor::DType;
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let spec = Spec::load(&root.join("specs/qwen2.5-0.5b.yaml")).map_err(|e| e.to_string())?;
    for (storage, bound) in [(DType::F32, Some(1e-3)), (DType::F16, Some(1e-2)), (DType::BF16, None)] {
        let mut plan = Plan::build(spec.clone(), Some(p)).map_err(|e| e.to_string())?;
        plan.load_options.storage = storage;
        let cpu = CpuEngine::load_with(&plan.model, &plan.load_options).map_err(|e| e.to_string())?;
        // One forward pass and one judgement of it per storage serve both
        // keys (`measure_each`).
        let engine = Replay::new(&cpu);
        // Both a block's output and a stage inside it (ffn_act, which the
        // swiglu recompute judges at every storage).
        let keys = ["prefill/blk.11.out", "prefill/blk.11.ffn_act"];
        let targets = keys
            .iter()
            .map(|k| parse_key(k).ok_or(format!("bad key {k}")))
            .collect::<Result<Vec<_>, _>>()?;
        let powers = measure_each(&plan, &engine, &targets, Grid::UntilLost).map_err(|e| e.to_string())?;
        for (key, power) in keys.iter().zip(powers) {
            let smallest = power.smallest;
            eprintln!(
                "{storage}: one row of {key} scaled by 1 + δ is the earliest failure from δ = {}",
                smallest.map_or("none (not even 1e-1)".into(), |d| format!("{d:.0e}"))
            );
            if let Some(b) = bound {
                check(smallest.is_some_and(|d| d <= b), || {
                    format!("{storage}: {key} localised only from {smallest:?}, the claim is <= {b:e}")
                })?;
            }
        }
    }
    Ok(())
}

type Check = fn(&Path) -> Result<(), Failed>;

fn main() {
    let args = Arguments::from_args();
    let (path, explicit) = model_path();
    let trials: [(&str, Check); 8] = [
        ("config", config),
        ("inspect", inspect),
        ("load", load),
        ("tampered_goldens", tampered_goldens),
        ("q8_engine", q8_engine),
        ("middle_layer_bug", middle_layer_bug),
        ("last_layer_bug", last_layer_bug),
        ("detection_power", detection_power),
    ];
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
