//! Every check instance of every spec in `specs/`, on every engine, as one
//! libtest trial named `<engine>::<spec>::<step>/<stage>::<check>`, so
//! `cargo test --test conformance -- blk.0` filters and `-- --list` lists.
//! An engine that cannot run here (no GPU) has its trials reported as ignored
//! with the reason — never as passed. Each (spec, engine) runs once, on the
//! first trial that needs it.

use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

use libtest_mimic::{Arguments, Completion, Failed, Trial};
use touchstone::checks::Status;
use touchstone::engine::{Availability, EngineKind};
use touchstone::plan::Plan;
use touchstone::report::SuiteRun;
use touchstone::runner::run_all;
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
    let mut trials = Vec::new();
    for path in spec_files() {
        // A spec on a model from touchstone's cache (the real model, fetched by
        // the test command) whose file is absent cannot plan its checks (the
        // config is in the file): one trial per engine, ignored with the reason.
        if let Ok(spec) = Spec::load(&path) {
            if let Some(name) = spec.cached_model.as_ref().filter(|_| !spec.model.exists()) {
                for kind in EngineKind::ALL {
                    let reason = touchstone::cache::fetch_hint(name);
                    trials.push(Trial::ignorable_test(
                        format!("{}::{}::*", kind.name(), spec.name),
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
                let msg = e.to_string();
                trials.push(Trial::test(
                    format!("spec::{}", path.display()),
                    move || Err(msg.into()),
                ));
                continue;
            }
        };
        for kind in EngineKind::ALL {
            let cell: Arc<OnceLock<Result<SuiteRun, String>>> = Arc::new(OnceLock::new());
            for check in &plan.checks {
                let name = format!("{}::{}::{}", kind.name(), plan.spec.name, check.id);
                match kind.availability() {
                    Availability::Unavailable(reason) => {
                        // Printed as "ignored (<reason>)" and counted as ignored.
                        trials.push(Trial::ignorable_test(name, move || {
                            Ok(Completion::ignored_with(reason))
                        }));
                    }
                    Availability::Available => {
                        let (plan, cell, id) = (plan.clone(), cell.clone(), check.id.clone());
                        trials.push(Trial::ignorable_test(name, move || {
                            let run = cell.get_or_init(|| run_all(&plan, kind).map_err(|e| e.to_string()));
                            verdict(run, &id)
                        }));
                    }
                }
            }
        }
    }
    libtest_mimic::run(&args, trials).exit();
}

fn verdict(run: &Result<SuiteRun, String>, id: &str) -> Result<Completion, Failed> {
    let run = run
        .as_ref()
        .map_err(|e| Failed::from(format!("the spec could not run: {e}")))?;
    let o = run
        .outcomes
        .iter()
        .find(|o| o.id == id)
        .ok_or_else(|| Failed::from(format!("no outcome for {id}")))?;
    match o.status {
        Status::Pass => Ok(Completion::Completed),
        // A check with nothing to check is reported as ignored, with its reason.
        Status::Skip => Ok(Completion::ignored_with(&o.message)),
        Status::Fail => {
            let mut msg = o.message.clone();
            if o.first_divergence {
                msg.push_str("\nthis is the FIRST DIVERGENCE of the run");
            } else if let Some(d) = &o.downstream_of {
                msg.push_str(&format!("\ndownstream of the first divergence at {d}"));
            }
            msg.push_str(&format!(
                "\nrerun: cargo test --test conformance -- --exact '{}'\n   or: {}",
                o.full_id(),
                o.rerun
            ));
            Err(msg.into())
        }
    }
}
