//! Every check instance of every spec in `specs/`, on every engine (the
//! built-in ones and those a spec declares under `engines:`), as one
//! libtest trial named `<engine>::<spec>::<step>/<stage>::<check>`, so
//! `cargo test --test conformance -- blk.0` filters and `-- --list` lists.
//! An engine that cannot run here (no GPU) has its trials reported as ignored
//! with the reason — never as passed. Each (spec, engine) runs once, on the
//! first trial that needs it.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use libtest_mimic::{Arguments, Completion, Trial};
use touchstone::engine::registry::EngineSel;
use touchstone::harness;
use touchstone::plan::Plan;
use touchstone::runner::{self, rerun_command, Filter, RunOptions};
use touchstone::spec::Spec;

fn spec_files() -> Vec<PathBuf> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("specs");
    let mut v: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", dir.display()))
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "yaml"))
        .collect();
    v.sort();
    v
}

fn main() {
    let args = Arguments::from_args();
    // `--exact <engine>::<spec>::<id>` (how nextest runs each trial, in a
    // process of its own): only that spec is planned, and not even that
    // where another trial process already ran the (spec, engine).
    let exact = harness::exact_target(&args);
    let mut trials = Vec::new();
    for path in spec_files() {
        if let Some((engine, name, id)) = &exact {
            match Spec::load(&path) {
                Ok(spec) if spec.name != *name => continue,
                Ok(spec) => {
                    if let Some(t) = harness::published_trial(engine, &spec, id) {
                        trials.extend(t);
                        continue;
                    }
                }
                Err(_) => {}
            }
        }
        // A spec on a model from touchstone's cache (the real model, fetched by
        // the test command) whose file is absent cannot plan its checks (the
        // config is in the file): one trial per engine, ignored with the reason.
        if let Ok(spec) = Spec::load(&path) {
            if let Some(name) = spec.cached_model.as_ref().filter(|_| !spec.model.exists()) {
                for sel in EngineSel::resolve("all", &spec.declared()).unwrap_or_default() {
                    let reason = touchstone::model::cache::fetch_hint(name);
                    trials.push(Trial::ignorable_test(
                        format!("{}::{}::*", sel.name(), spec.name),
                        move || Ok(Completion::ignored_with(reason)),
                    ));
                }
                continue;
            }
        }
        let plan = match Spec::load(&path).and_then(|s| Plan::build(s, None)) {
            Ok(p) => Arc::new(p),
            Err(e) => {
                // A broken shipped spec is one failing trial, not a panic.
                trials.push(harness::broken_spec(&path, e.to_string()));
                continue;
            }
        };
        // The built-in engines and every engine the spec declares (`engines:`).
        let sels = match EngineSel::resolve("all", &plan.spec.declared()) {
            Ok(s) => s,
            Err(e) => {
                trials.push(harness::broken_spec(&path, e.to_string()));
                continue;
            }
        };
        for sel in sels {
            let name = sel.name();
            let availability = sel.availability();
            let run: Arc<harness::PlanRunner> = Arc::new(move |plan: &Plan| {
                let rerun = |id: &str| rerun_command(plan, &sel, id, None);
                let opts = RunOptions {
                    filter: &Filter::default(),
                    rerun: &rerun,
                    save: None,
                    from: None,
                };
                runner::run(plan, &sel, &opts).map_err(|e| e.to_string())
            });
            trials.extend(harness::plan_trials(&name, plan.clone(), availability, run));
        }
    }
    libtest_mimic::run(&args, trials).exit();
}
