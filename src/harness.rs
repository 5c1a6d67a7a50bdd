//! Specs as `cargo test` trials, for any engine. An engine crate adds one
//! test target with `harness = false`:
//!
//! ```toml
//! [[test]]
//! name = "touchstone"
//! harness = false
//! ```
//!
//! ```no_run
//! // tests/touchstone.rs
//! # struct MyEngine;
//! # impl MyEngine { fn load(_: &std::path::Path) -> touchstone::error::Result<MyEngine> { Ok(MyEngine) } }
//! # impl touchstone::engine::Engine for MyEngine {
//! #   fn name(&self) -> &str { "my-engine" }
//! #   fn config(&self) -> &touchstone::model::ModelConfig { unimplemented!() }
//! #   fn run(&self, _: &touchstone::engine::RunRequest, _: &touchstone::engine::TapSet)
//! #       -> touchstone::error::Result<touchstone::engine::RunOutput> { unimplemented!() }
//! # }
//! fn main() {
//!     touchstone::harness::Harness::new("my-engine", |model, _opts| MyEngine::load(model))
//!         .spec("specs/qwen2-tiny.yaml")
//!         .run();
//! }
//! ```
//!
//! Every check of every spec becomes one trial named
//! `<engine>::<spec>::<step>/<stage>::<check>` (or `…::run::<check>`), so
//! `cargo test --test touchstone -- blk.0` filters, `-- --list` lists and
//! `-- --exact NAME` reruns one, exactly as touchstone's own conformance
//! suite. Each (spec, engine) runs once, when its first trial needs it; a
//! failing trial prints the check's full message, whether it is the first
//! divergence or at a suspect golden, and the command that reruns it.

use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

use libtest_mimic::{Arguments, Completion, Failed, Trial};

use crate::checks::Status;
use crate::engine::{Availability, Engine};
use crate::error::Result;
use crate::model::LoadOptions;
use crate::plan::Plan;
use crate::report::SuiteRun;
use crate::runner::{self, EngineSource, Filter, RunOptions};
use crate::spec::Spec;

/// Loads a model into an engine.
pub type Loader = dyn Fn(&Path, &LoadOptions) -> Result<Box<dyn Engine>> + Send + Sync;

/// Runs one plan on one engine (all its checks).
pub type PlanRunner = dyn Fn(&Plan) -> std::result::Result<SuiteRun, String> + Send + Sync;

/// Specs run as libtest trials against one engine.
pub struct Harness {
    name: String,
    loader: Arc<Loader>,
    specs: Vec<PathBuf>,
}

impl Harness {
    /// An engine by name and how to load a model into it (an HF folder or a
    /// `.gguf` file; `opts.storage` is the spec's storage dtype).
    pub fn new<E, F>(name: &str, load: F) -> Harness
    where
        E: Engine + 'static,
        F: Fn(&Path, &LoadOptions) -> Result<E> + Send + Sync + 'static,
    {
        Harness {
            name: name.to_string(),
            loader: Arc::new(move |m: &Path, o: &LoadOptions| load(m, o).map(|e| Box::new(e) as Box<dyn Engine>)),
            specs: Vec::new(),
        }
    }

    /// Adds a spec file, or every `*.yaml` in a folder.
    pub fn spec(mut self, path: impl AsRef<Path>) -> Harness {
        let p = path.as_ref();
        if p.is_dir() {
            let mut v: Vec<PathBuf> = std::fs::read_dir(p)
                .map(|d| d.filter_map(|e| e.ok().map(|e| e.path())).collect())
                .unwrap_or_default();
            v.retain(|f| f.extension().is_some_and(|x| x == "yaml"));
            v.sort();
            self.specs.extend(v);
        } else {
            self.specs.push(p.to_path_buf());
        }
        self
    }

    /// One trial per check of every spec.
    pub fn trials(&self) -> Vec<Trial> {
        let mut trials = Vec::new();
        for path in &self.specs {
            let plan = match Spec::load(path).and_then(|s| Plan::build(s, None)) {
                Ok(p) => Arc::new(p),
                Err(e) => {
                    trials.push(broken_spec(path, e.to_string()));
                    continue;
                }
            };
            let source = Loaded {
                name: self.name.clone(),
                loader: self.loader.clone(),
            };
            let run: Arc<PlanRunner> = Arc::new(move |plan: &Plan| {
                let rerun = |id: &str| rerun_hint(&format!("{}::{}::{id}", source.name, plan.spec.name));
                let opts = RunOptions {
                    filter: &Filter::default(),
                    rerun: &rerun,
                    save: None,
                    from: None,
                };
                runner::run(plan, &source, &opts).map_err(|e| e.to_string())
            });
            trials.extend(plan_trials(&self.name, plan, Availability::Available, run));
        }
        trials
    }

    /// Runs the trials as the test binary's `main` (parsing libtest's
    /// arguments: filters, `--list`, `--exact`, `--ignored`, …) and exits.
    pub fn run(self) -> ! {
        let args = Arguments::from_args();
        libtest_mimic::run(&args, self.trials()).exit()
    }
}

/// An engine crate's loader as the runner's engine source: always available;
/// a model it cannot load stops the spec (every trial says why).
struct Loaded {
    name: String,
    loader: Arc<Loader>,
}

impl EngineSource for Loaded {
    fn name(&self) -> String {
        self.name.clone()
    }
    fn availability(&self) -> Availability {
        Availability::Available
    }
    fn load(&self, plan: &Plan) -> Result<Box<dyn Engine>> {
        (self.loader)(&plan.model, &plan.load_options)
    }
    fn owns_load_failures(&self) -> bool {
        false
    }
}

/// A spec that cannot be planned: one failing trial, not a panic.
pub fn broken_spec(path: &Path, msg: String) -> Trial {
    Trial::test(format!("spec::{}", path.display()), move || Err(msg.into()))
}

/// The trials of one plan on one engine, named `<engine>::<spec>::<id>`. An
/// unavailable engine's trials are ignored with the reason, never passed; an
/// available one runs the whole plan once, on the first trial that needs it.
pub fn plan_trials(engine: &str, plan: Arc<Plan>, availability: Availability, run: Arc<PlanRunner>) -> Vec<Trial> {
    let cell: Arc<OnceLock<std::result::Result<SuiteRun, String>>> = Arc::new(OnceLock::new());
    plan.checks
        .iter()
        .map(|check| {
            let name = format!("{engine}::{}::{}", plan.spec.name, check.id);
            match &availability {
                Availability::Unavailable(reason) => {
                    let reason = reason.clone();
                    Trial::ignorable_test(name, move || Ok(Completion::ignored_with(reason)))
                }
                Availability::Available => {
                    let (plan, cell, run, id) = (plan.clone(), cell.clone(), run.clone(), check.id.clone());
                    Trial::ignorable_test(name, move || verdict(cell.get_or_init(|| run(&plan)), &id))
                }
            }
        })
        .collect()
}

/// A trial's result from the run's outcome for check `id`.
pub fn verdict(run: &std::result::Result<SuiteRun, String>, id: &str) -> std::result::Result<Completion, Failed> {
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
        Status::Skip | Status::NotApplicable => Ok(Completion::ignored_with(&o.message)),
        Status::Fail => {
            let mut msg = o.message.clone();
            if o.first_divergence {
                msg.push_str("\nthis is the FIRST DIVERGENCE of the run");
            } else if o.at_suspect_golden {
                msg.push_str("\nthe golden is SUSPECT here: the references are outside their own allowance");
            } else if let Some(d) = &o.downstream_of {
                msg.push_str(&format!("\ndownstream of the first divergence at {d}"));
            }
            msg.push_str(&format!("\nrerun: {}", o.rerun));
            Err(msg.into())
        }
    }
}

/// `cargo test --test <this test target> -- --exact '<trial>'`.
fn rerun_hint(trial: &str) -> String {
    let target = std::env::args()
        .next()
        .and_then(|a| {
            Path::new(&a)
                .file_stem()
                .and_then(|s| s.to_str())
                .map(|s| s.rsplit_once('-').map_or(s, |(n, _)| n).to_string())
        })
        .unwrap_or_else(|| "touchstone".into());
    format!("cargo test --test {target} -- --exact '{trial}'")
}
