//! Every shipped spec names a damaged golden where it is damaged: +1e-3
//! relative on one block (32 values around the largest of the last row) of
//! one mid-model stage of a copy of the spec's first golden makes the run
//! fail exactly there, as a suspect golden, with no engine failure and no
//! first divergence. The damaged reference is beyond its own allowance
//! there (`references_agree`, which every shipped spec checks) and so widens
//! no engine allowance (the engine is judged by the other references and
//! its own floor).
//!
//! Only the checks that read goldens run (`golden`, `references_agree`):
//! no other check reads a golden's stage tensors, so no other verdict can
//! move. One engine run serves the untampered and the tampered goldens
//! (replayed). A spec on a real model whose file is absent is ignored with
//! the reason (the test command fetches it).
//!
//! One libtest trial per spec: `suspect_goldens::<spec>`.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use libtest_mimic::{Arguments, Completion, Failed, Trial};

use touchstone::checks::Status;
use touchstone::engine::cpu::CpuEngine;
use touchstone::engine::replay::Replay;
use touchstone::golden::GoldenSet;
use touchstone::plan::Plan;
use touchstone::runner::{run_on, Filter};
use touchstone::spec::Spec;
use touchstone::stage::{BlockStage, Stage, Step};
use touchstone::tensor::io::{read_safetensors, write_safetensors};

fn specs() -> Vec<PathBuf> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("specs");
    let mut v: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap()
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "yaml"))
        .collect();
    v.sort();
    v
}

/// The spec's first golden source as written (`goldens:`' first key).
fn first_source(path: &Path) -> Result<String, Failed> {
    let v: serde_yaml::Value =
        serde_yaml::from_str(&std::fs::read_to_string(path).map_err(|e| e.to_string())?).map_err(|e| e.to_string())?;
    v.get("goldens")
        .and_then(|g| g.as_mapping())
        .and_then(|m| m.keys().next())
        .and_then(|k| k.as_str())
        .map(String::from)
        .ok_or_else(|| format!("{} has no goldens", path.display()).into())
}

/// The stage to damage: `ffn_out` (else the first recorded block stage) of
/// the recorded layer nearest the middle, at the prefill; the logits where
/// the golden records no block stage.
fn mid_stage(g: &GoldenSet, layers: usize) -> Option<(Step, Stage)> {
    // The stages it records for checking (not those kept for the floors).
    let recorded: Vec<(Step, Stage)> = g
        .keys()
        .copied()
        .filter(|(s, st)| *s == Step::Prefill && g.records(*s, *st))
        .collect();
    let layer_of = |st: &Stage| match st {
        Stage::Block(l, _) => Some(*l),
        _ => None,
    };
    let mid = layers / 2;
    let best = recorded
        .iter()
        .filter_map(|(_, st)| layer_of(st))
        .min_by_key(|l| (l.abs_diff(mid), *l));
    match best {
        Some(l) => recorded
            .iter()
            .copied()
            .find(|(_, st)| *st == Stage::Block(l, BlockStage::FfnOut))
            .or_else(|| recorded.iter().copied().find(|(_, st)| layer_of(st) == Some(l))),
        None => recorded.iter().copied().find(|(_, st)| *st == Stage::Logits),
    }
}

fn trial(path: PathBuf) -> Result<(), Failed> {
    let spec = Spec::load(&path).map_err(|e| e.to_string())?;
    let plan = Plan::build(spec.clone(), None).map_err(|e| e.to_string())?;
    let source = first_source(&path)?;
    let cpu = CpuEngine::load_with(&plan.model, &plan.load_options).map_err(|e| e.to_string())?;
    let engine = Replay::new(&cpu);
    let filter = Filter(Some(vec!["*::golden:*".into(), "*::references_agree:*".into()]));
    let base = run_on(&plan, &engine, &filter, &|id| id.to_string());
    let failed: Vec<&str> = base
        .outcomes
        .iter()
        .filter(|o| o.status == Status::Fail)
        .map(|o| o.id.as_str())
        .collect();
    if !failed.is_empty() {
        return Err(format!("the untampered goldens fail: {failed:?}").into());
    }
    // The damaged copy of the first golden.
    let golden = &plan.goldens[&source];
    let (step, stage) = mid_stage(golden, plan.config.layers).ok_or("no stage to damage")?;
    let key = format!("{step}/{stage}");
    let mut file = read_safetensors(&golden.path).map_err(|e| e.to_string())?;
    let t = file
        .floats
        .get_mut(&key)
        .ok_or_else(|| format!("{key} not in the golden"))?;
    let row = *t.shape().last().unwrap();
    let last = t.numel() - row;
    let big = (last..t.numel())
        .max_by(|a, b| t.data()[*a].abs().total_cmp(&t.data()[*b].abs()))
        .unwrap();
    let data = t.data_mut();
    let start = last + (big - last) / 32 * 32;
    let end = (start + 32).min(data.len());
    for x in &mut data[start..end] {
        *x *= 1.0 + 1e-3;
    }
    let tmp = tempfile::tempdir().map_err(|e| e.to_string())?;
    let damaged = tmp.path().join("damaged.safetensors");
    write_safetensors(&damaged, &file.floats, &file.ints, &file.metadata).map_err(|e| e.to_string())?;
    let mut plan = plan;
    plan.goldens.insert(
        source.clone(),
        Arc::new(GoldenSet::load(&source, &damaged).map_err(|e| e.to_string())?),
    );
    let run = run_on(&plan, &engine, &filter, &|id| id.to_string());
    let failing: Vec<String> = run
        .outcomes
        .iter()
        .filter(|o| o.status == Status::Fail)
        .map(|o| o.id.clone())
        .collect();
    let d = run
        .suspect_golden
        .as_ref()
        .ok_or_else(|| format!("no suspect golden; failures {failing:?}"))?;
    if (d.step.as_str(), d.stage.as_str()) != (step.to_string().as_str(), stage.to_string().as_str()) {
        return Err(format!(
            "suspect golden at {}/{}, damaged {key}; failures {failing:?}",
            d.step, d.stage
        )
        .into());
    }
    let engine_fails: Vec<&String> = failing.iter().filter(|id| id.contains("::golden:")).collect();
    if !engine_fails.is_empty() || run.first_divergence.is_some() {
        return Err(format!(
            "engine failures {engine_fails:?}, first divergence {:?}",
            run.first_divergence
        )
        .into());
    }
    // The damaged source's own check: against the oracle (`oracle~SOURCE`),
    // or, in a spec without one, against the first source or by it.
    let own = |id: &String| {
        id.starts_with(&format!("{key}::references_agree:"))
            && (id.ends_with(&format!("~{source}")) || id.contains(&format!(":{source}~")))
    };
    if failing.is_empty() || !failing.iter().all(own) {
        return Err(format!("failures {failing:?}, expected only `{source}`'s references_agree at {key}").into());
    }
    eprintln!(
        "{}: {key} damaged in `{source}` (values {start}..{}): suspect golden there, nothing else",
        spec.name,
        start + 32
    );
    Ok(())
}

fn main() {
    let args = Arguments::from_args();
    let trials = specs()
        .into_iter()
        .map(|path| {
            let name = format!("suspect_goldens::{}", path.file_stem().unwrap().to_string_lossy());
            let spec = Spec::load(&path);
            match spec {
                Ok(s) if s.cached_model.is_some() && !s.model.exists() => {
                    let why = touchstone::model::cache::fetch_hint(s.cached_model.as_deref().unwrap());
                    Trial::ignorable_test(name, move || Ok(Completion::ignored_with(why)))
                }
                _ => Trial::test(name, move || trial(path)),
            }
        })
        .collect();
    libtest_mimic::run(&args, trials).exit();
}
