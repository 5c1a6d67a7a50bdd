//! Runs a plan on one engine: it schedules the engine runs and their taps,
//! and nothing else. The engine runs once with taps on every stage a selected
//! check reads; each stage check then judges its (step, stage) in parallel;
//! each run check runs the engine again as it needs. Verdicts are the checks'
//! own (`checks`); triage into a first divergence is the report's
//! (`report::SuiteRun::new`). The CLI, `cargo test` and engine crates
//! (`harness`) all run plans through `run`.

pub mod filter;
#[cfg(test)]
mod mutant_tests;
pub mod overflow;
#[cfg(test)]
mod serving_mutant_tests;
#[cfg(test)]
mod vlm_tests;

use std::path::Path;

use rayon::prelude::*;

pub use filter::Filter;

use crate::checks::kind::At;
use crate::checks::{divergence, floor, Family};
use crate::checks::{run as run_checks, Verdict};
use crate::engine::registry::EngineSel;
use crate::engine::{Availability, Engine, RunOutput, RunRequest, TapSet};
use crate::error::{Error, Result};
use crate::plan::{CheckInstance, CheckKind, Plan};
use crate::report::{Outcome, SuiteRun};
use crate::stage::{Stage, Step};

/// Where the runner gets its engine: the registry's selection (`EngineSel`),
/// or an engine crate's own loader (`harness`).
pub trait EngineSource: Sync {
    /// The name in trial ids and reports.
    fn name(&self) -> String;
    fn availability(&self) -> Availability;
    /// Loads the plan's model into the engine.
    fn load(&self, plan: &Plan) -> Result<Box<dyn Engine>>;
    /// Whether a failure to load is the engine's own (its checks fail and
    /// other engines still run) rather than bad input (the run stops).
    fn owns_load_failures(&self) -> bool;
}

impl EngineSource for EngineSel {
    fn name(&self) -> String {
        EngineSel::name(self)
    }
    fn availability(&self) -> Availability {
        EngineSel::availability(self)
    }
    fn load(&self, plan: &Plan) -> Result<Box<dyn Engine>> {
        EngineSel::load(self, &plan.model, &plan.load_options, &plan.spec.names)
    }
    /// An external engine that cannot start fails its own checks; a built-in
    /// one that cannot load the model means the input is bad.
    fn owns_load_failures(&self) -> bool {
        !self.is_builtin()
    }
}

/// How to run: which checks, how to rerun one, and where to save the main
/// run's captures (`run --save-captures`).
pub struct RunOptions<'a> {
    pub filter: &'a Filter,
    /// The command that reruns one check id as this run ran it.
    pub rerun: &'a (dyn Fn(&str) -> String + Sync),
    pub save: Option<&'a Path>,
    /// Only the stage checks of this step at this stage or a later one
    /// (None: every check the filter keeps).
    pub from: Option<(Step, Stage)>,
}

/// Runs the checks of `plan` that `opts.filter` selects on the engine
/// `source` gives. `Err` only for bad input (the model cannot be loaded into
/// a built-in engine, the captures cannot be saved); an engine failing
/// mid-run fails the affected checks instead.
pub fn run(plan: &Plan, source: &dyn EngineSource, opts: &RunOptions) -> Result<SuiteRun> {
    let name = source.name();
    let selected = select(plan, &name, opts);
    // Every selected check with one verdict: an engine that cannot run here
    // (skipped), or an external one that could not start (failed).
    let all_with = |verdict: Verdict, skipped: Option<String>| {
        let outcomes = selected
            .iter()
            .map(|c| outcome(plan, &name, c, verdict.clone(), opts))
            .collect();
        SuiteRun::new(&plan.spec.name, &spec_path(plan), &name, outcomes, skipped)
            .with_storage(plan.load_options.storage)
            .with_text(texts(plan, None).0, None)
    };
    if let Availability::Unavailable(reason) = source.availability() {
        return Ok(all_with(Verdict::skip(&reason), Some(reason)));
    }
    let engine = match source.load(plan) {
        Ok(e) => e,
        Err(e) if source.owns_load_failures() => {
            return Ok(all_with(
                Verdict::fail(format!("the engine could not be loaded: {e}")),
                None,
            ))
        }
        Err(e) => return Err(e),
    };
    let (run, saved) = run_loaded(plan, engine.as_ref(), opts);
    saved.map(|_| run)
}

/// `run` on an engine the caller already loaded (a test's planted bug, a
/// wrapper around another engine); nothing is saved.
pub fn run_on(plan: &Plan, engine: &dyn Engine, filter: &Filter, rerun: &(dyn Fn(&str) -> String + Sync)) -> SuiteRun {
    run_on_from(plan, engine, filter, None, rerun)
}

/// `run_on`, judging only the stage checks of `from`'s step at its stage or
/// a later one.
pub fn run_on_from(
    plan: &Plan,
    engine: &dyn Engine,
    filter: &Filter,
    from: Option<(Step, Stage)>,
    rerun: &(dyn Fn(&str) -> String + Sync),
) -> SuiteRun {
    let opts = RunOptions {
        filter,
        rerun,
        save: None,
        from,
    };
    run_loaded(plan, engine, &opts).0
}

/// The command that reruns one check as a `touchstone run` ran it: the same
/// spec, engine, model, and storage when `--storage` overrode the spec's.
pub fn rerun_command(plan: &Plan, sel: &EngineSel, id: &str, model: Option<&Path>) -> String {
    let model = model.map(|m| format!(" --model {}", m.display())).unwrap_or_default();
    let opts = &plan.load_options;
    let keep = if opts.keep_gguf_qk_permutation {
        " --keep-gguf-qk-permutation"
    } else {
        ""
    };
    let mut storage = if opts.storage != plan.spec.storage {
        format!(" --storage {}", opts.storage)
    } else {
        String::new()
    };
    if let crate::arithmetic::Activations::Q8 { block } = opts.activations {
        storage.push_str(if block == 32 {
            " --activations q8_0"
        } else {
            " --activations q8_k"
        });
    }
    format!(
        "touchstone run {} --engine {}{model}{keep}{storage} --only '{id}'",
        plan.spec.path.display(),
        sel.cli_arg()
    )
}

fn spec_path(plan: &Plan) -> String {
    plan.spec.path.display().to_string()
}

/// The checks of `plan` the filter keeps, matched as `<engine>::<spec>::<id>`
/// (and of `opts.from`'s step at its stage or later, when given).
fn select<'a>(plan: &'a Plan, engine: &str, opts: &RunOptions) -> Vec<&'a CheckInstance> {
    let spec = plan.spec.name.as_str();
    plan.checks
        .iter()
        .filter(|c| opts.filter.accepts(&format!("{engine}::{spec}::{}", c.id)))
        .filter(|c| {
            opts.from
                .is_none_or(|(step, stage)| c.at().is_some_and(|(s, t)| s == step && t >= stage))
        })
        .collect()
}

fn outcome(plan: &Plan, engine: &str, c: &CheckInstance, verdict: Verdict, opts: &RunOptions) -> Outcome {
    Outcome::new(
        &plan.spec.name,
        engine,
        &c.id,
        c.at(),
        c.family(),
        verdict,
        (opts.rerun)(&c.id),
    )
    .with_error_metric(c.metric())
}

/// The selected checks on an engine already loaded; the second value is the
/// result of saving the main run (Ok when nothing was to be saved).
fn run_loaded(plan: &Plan, engine: &dyn Engine, opts: &RunOptions) -> (SuiteRun, Result<()>) {
    let selected = select(plan, engine.name(), opts);
    // A vision-language spec on an engine that takes no image: said once.
    if let (Some(_), Some(why)) = (&plan.image, engine.capabilities().no_images) {
        let reason = format!(
            "the {} engine cannot run this vision-language spec: {why}",
            engine.name()
        );
        let outcomes = selected
            .iter()
            .map(|c| outcome(plan, engine.name(), c, Verdict::skip(&reason), opts))
            .collect();
        let run = SuiteRun::new(&plan.spec.name, &spec_path(plan), engine.name(), outcomes, Some(reason))
            .with_storage(plan.load_options.storage)
            .with_text(texts(plan, None).0, None);
        return (run, Ok(()));
    }
    // What the checks of this run share (this engine's captures).
    let memo = crate::checks::memo::Memo::default();
    let mut facts = plan.facts();
    facts.memo = Some(&memo);
    // The engine's arithmetic: what it declares, else plain at its storage.
    if let Some(a) = engine.arithmetic() {
        facts.arithmetic = a;
    }
    // Checks reading a stage the engine cannot tap are not applicable to it
    // (`engine::capabilities`): judged by nothing, never tapped.
    let caps = engine.capabilities();
    let not_applicable = |c: &CheckInstance| -> Option<String> {
        let (CheckKind::Stage(check), Some((_, stage))) = (&c.kind, c.at()) else {
            return None;
        };
        check.reads(stage).into_iter().find_map(|s| caps.why_not(s))
    };
    let mut taps = TapSet::none();
    for c in selected.iter().filter(|c| not_applicable(c).is_none()) {
        if let (CheckKind::Stage(check), Some((_, stage))) = (&c.kind, c.at()) {
            check.reads(stage).into_iter().for_each(|s| taps.insert(s));
            // A golden check's floor reads the engine's errors at the stage's
            // inputs and, at attention, its KV cache (`checks::floor`).
            if matches!(check.family(), Family::Golden { .. }) && plan.oracle.is_some() {
                floor::floor_reads(&plan.config, stage)
                    .into_iter()
                    .filter(|s| caps.why_not(*s).is_none())
                    .for_each(|s| taps.insert(s));
            }
        }
    }
    let main_run = (!taps.is_empty()).then(|| {
        let req = RunRequest {
            prompt: plan.prompt.clone(),
            decode_steps: plan.decode_steps,
            sampling: plan.sampling(),
            seed: plan.spec.seed,
            forced: plan.forced.clone(),
            image: plan.image.clone(),
        };
        engine.run(&req, &taps).map_err(|e| e.to_string())
    });
    let saved = save(plan, engine, opts.save, main_run.as_ref());
    // A storage the model's values overflow: said once, its checks skipped.
    let overflow = overflow::storage_overflow(plan, facts.storage);
    let past = |c: &CheckInstance| match (&overflow, c.at(), &c.kind) {
        (Some(o), Some(at), _) => o.covers(at),
        // Run checks read the forward's values, but for the weights held
        // and the tokenizer.
        (Some(_), None, CheckKind::Run(rc)) => !matches!(rc.id().as_str(), "weights" | "tokenizer"),
        _ => false,
    };
    let skip_reason = overflow.as_ref().map(|o| {
        format!(
            "storage {} overflows before this check (the run's note says where)",
            o.storage
        )
    });

    let mut outcomes: Vec<Outcome> = selected
        .par_iter()
        .filter_map(|c| {
            let (CheckKind::Stage(check), Some((step, stage))) = (&c.kind, c.at()) else {
                return None;
            };
            let verdict = match (&main_run, not_applicable(c)) {
                _ if past(c) => Verdict::skip(skip_reason.as_deref().unwrap_or_default()),
                (_, Some(why)) => Verdict::not_applicable(why),
                (Some(Err(e)), None) => Verdict::fail(format!("the engine failed: {e}")),
                (Some(Ok(out)), None) => check.judge(
                    &facts,
                    &At {
                        step,
                        stage,
                        run: Some(out),
                    },
                ),
                (None, None) => check.judge(&facts, &At { step, stage, run: None }),
            };
            Some(outcome(plan, engine.name(), c, verdict, opts))
        })
        .collect();
    attach_budget(&mut outcomes);
    for c in &selected {
        if let CheckKind::Run(rc) = &c.kind {
            let verdict = if past(c) {
                Verdict::skip(skip_reason.as_deref().unwrap_or_default())
            } else {
                run_checks::evaluate(rc.as_ref(), &facts, engine)
            };
            outcomes.push(outcome(plan, engine.name(), c, verdict, opts));
        }
    }
    let sampled = main_run
        .as_ref()
        .and_then(|r| r.as_ref().ok())
        .map(|o| o.sampled.as_slice());
    let (prompt_text, continuation_text) = texts(plan, sampled);
    let skipped = selected.iter().filter(|c| past(c)).count();
    let mut run = SuiteRun::new(&plan.spec.name, &spec_path(plan), engine.name(), outcomes, None)
        .with_storage(plan.load_options.storage)
        .with_text(prompt_text, continuation_text);
    if let Some(o) = &overflow {
        run = run.with_note(o.sentence(skipped));
    }
    (run, saved)
}

/// Writes the main run's captures and tokens to `path` when asked: what
/// `--engine dumps:PATH` checks again.
fn save(
    plan: &Plan,
    engine: &dyn Engine,
    path: Option<&Path>,
    main_run: Option<&std::result::Result<RunOutput, String>>,
) -> Result<()> {
    match (path, main_run) {
        (None, _) => Ok(()),
        (Some(p), Some(Ok(out))) => {
            let meta = [
                ("format".to_string(), "touchstone-run/1".to_string()),
                ("spec".to_string(), plan.spec.name.clone()),
                ("engine".to_string(), engine.name().to_string()),
            ]
            .into_iter()
            .collect();
            crate::engine::output::write_run(p, out, &meta)
        }
        (Some(p), Some(Err(e))) => Err(Error::engine(
            engine.name(),
            format!("nothing saved to {}: the engine failed: {e}", p.display()),
        )),
        (Some(p), None) => Err(Error::Usage(format!(
            "nothing saved to {}: no selected check taps a stage",
            p.display()
        ))),
    }
}

/// Golden outcomes get the references' spread at their stage as
/// `budget_max_abs`, beside their own `max_abs` (`divergence::budgets`).
fn attach_budget(outcomes: &mut [Outcome]) {
    let budget = divergence::budgets(
        outcomes
            .iter()
            .map(|o| (o.at, &o.family, o.metrics.get("max_abs").copied())),
    );
    for o in outcomes.iter_mut().filter(|o| o.is_golden()) {
        if let Some(b) = o.at.and_then(|at| budget.get(&at)) {
            o.metrics.insert("budget_max_abs".into(), *b);
        }
    }
}

/// The prompt and the engine's continuation (its sampled token at every step)
/// as text, for the report. A model without a tokenizer shows no text: the
/// ids are still what every check compares.
fn texts(plan: &Plan, sampled: Option<&[u32]>) -> (Option<String>, Option<String>) {
    let Ok(tok) = crate::tokenizer::Tokenizer::load(&plan.model) else {
        return (None, None);
    };
    (
        Some(tok.decode_display(&plan.prompt)),
        sampled.map(|s| tok.decode_display(s)),
    )
}

/// Every check of `plan` on `sel`, with `touchstone run` rerun commands.
pub fn run_all(plan: &Plan, sel: &EngineSel) -> Result<SuiteRun> {
    let rerun = |id: &str| rerun_command(plan, sel, id, None);
    run(
        plan,
        sel,
        &RunOptions {
            filter: &Filter::default(),
            rerun: &rerun,
            save: None,
            from: None,
        },
    )
}
