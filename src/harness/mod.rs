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

pub mod shared_run;
pub mod unit;
use shared_run::{SharedRun, Verdicts};
use unit::{Granularity, Verdict};

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
        self.trials_for(None)
    }

    /// The trials, or for `--exact <engine>::<spec>::<id>` only those of
    /// that spec (`exact_target`), read from the published run where another
    /// trial process ran it.
    fn trials_for(&self, exact: Option<(String, String, String)>) -> Vec<Trial> {
        let mut trials = Vec::new();
        for path in &self.specs {
            let spec = match Spec::load(path) {
                Ok(s) => s,
                Err(e) => {
                    trials.push(broken_spec(path, e.to_string()));
                    continue;
                }
            };
            if let Some((engine, name, id)) = &exact {
                if *engine != self.name || *name != spec.name {
                    continue;
                }
                if let Some(t) = published_trial(engine, &spec, id) {
                    trials.extend(t);
                    continue;
                }
            }
            let plan = match Plan::build(spec, None) {
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
        let trials = self.trials_for(exact_target(&args));
        libtest_mimic::run(&args, trials).exit()
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
/// available one runs the whole plan once, on the first trial that needs it
/// — once per process, and once per test run where trials run one per
/// process (cargo-nextest: `shared_run`).
pub fn plan_trials(engine: &str, plan: Arc<Plan>, availability: Availability, run: Arc<PlanRunner>) -> Vec<Trial> {
    let g = Granularity::from_env();
    let cell: Arc<OnceLock<Verdicts>> = Arc::new(OnceLock::new());
    let shared = Arc::new(SharedRun::new(&plan.spec, engine, g));
    let mut units: Vec<&str> = Vec::new();
    for check in &plan.checks {
        let u = g.unit(&check.id);
        if !units.contains(&u) {
            units.push(u);
        }
    }
    units
        .into_iter()
        .map(|unit| {
            let name = format!("{engine}::{}::{unit}", plan.spec.name);
            match &availability {
                Availability::Unavailable(reason) => {
                    let reason = reason.clone();
                    let t = Trial::ignorable_test(name, move || Ok(Completion::ignored_with(reason)));
                    // Under nextest every trial is a process: ignored at
                    // listing, none is spawned only to say why (nextest
                    // shows no reasons; `--run-ignored all` still shows it).
                    t.with_ignored_flag(unit::under_nextest())
                }
                Availability::Available => {
                    let (plan, cell, run, shared, unit) = (
                        plan.clone(),
                        cell.clone(),
                        run.clone(),
                        shared.clone(),
                        unit.to_string(),
                    );
                    Trial::ignorable_test(name, move || {
                        let fresh = || verdicts(&run(&plan), g);
                        let v = cell.get_or_init(|| match shared.as_ref() {
                            Some(s) => s.get_or_run(fresh),
                            None => fresh(),
                        });
                        completion(v, &unit)
                    })
                }
            }
        })
        .collect()
}

/// The trial `id` (a check, or a stage: `unit`) of a (spec, engine) group
/// that another trial process has already run (nextest's `--exact NAME`): its published
/// verdict, without planning the spec. `None` when no process has run the
/// group yet, or trials do not run one per process; `Some(vec![])` when the
/// group has no such check.
pub fn published_trial(engine: &str, spec: &Spec, id: &str) -> Option<Vec<Trial>> {
    let shared = SharedRun::new(spec, engine, Granularity::from_env())?;
    let verdict = shared.verdict(id)?;
    let name = format!("{engine}::{}::{id}", spec.name);
    Some(
        verdict
            .map(|v| Trial::ignorable_test(name, move || complete(&v)))
            .into_iter()
            .collect(),
    )
}

/// The spec an `--exact` filter names (`<engine>::<spec>::<id>`), with its
/// engine and check id: a process run for one trial (nextest runs each as
/// `BINARY --exact NAME`) plans only that spec.
pub fn exact_target(args: &Arguments) -> Option<(String, String, String)> {
    if !args.exact || args.list {
        return None;
    }
    let name = args.filter.as_deref()?;
    let (engine, rest) = name.split_once("::")?;
    let (spec, id) = rest.split_once("::")?;
    Some((engine.to_string(), spec.to_string(), id.to_string()))
}

/// Every trial's verdict from one run of a plan.
pub fn verdicts(run: &std::result::Result<SuiteRun, String>, g: Granularity) -> Verdicts {
    let run = run.as_ref().map_err(|e| e.to_string())?;
    let checks: Vec<(String, Verdict)> = run.outcomes.iter().map(|o| (o.id.clone(), verdict_of(o))).collect();
    Ok(unit::combine(g, &checks))
}

/// What the trial of one outcome reports.
fn verdict_of(o: &crate::report::Outcome) -> Verdict {
    match o.status {
        Status::Pass => Verdict::Pass,
        // A check with nothing to check is reported as ignored, with its reason.
        Status::Skip | Status::NotApplicable => Verdict::Ignored(o.message.clone()),
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
            Verdict::Fail(msg)
        }
    }
}

/// A trial's result: trial `id`'s verdict in a group's verdicts.
fn completion(v: &Verdicts, id: &str) -> std::result::Result<Completion, Failed> {
    let map = v
        .as_ref()
        .map_err(|e| Failed::from(format!("the spec could not run: {e}")))?;
    complete(
        map.get(id)
            .ok_or_else(|| Failed::from(format!("no outcome for {id}")))?,
    )
}

/// A trial's result from its verdict.
fn complete(verdict: &Verdict) -> std::result::Result<Completion, Failed> {
    match verdict {
        Verdict::Pass => Ok(Completion::Completed),
        Verdict::Ignored(reason) => Ok(Completion::ignored_with(reason)),
        Verdict::Fail(msg) => Err(msg.as_str().into()),
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
