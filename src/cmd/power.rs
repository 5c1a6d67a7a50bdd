//! `touchstone power`: the detection power of a spec's stage checks, measured
//! rather than assumed. The engine runs once; then one token row (the step's
//! last, which every row subset keeps) of one stage of its captures is
//! scaled by 1 + δ for δ from 10% down to 1e-6, and the stage checks are
//! judged again each time. The claim printed is the smallest δ from which
//! every larger δ of the grid makes that very stage the run's earliest
//! failure: the smallest change of one block of one stage the policy
//! localises, at the engine's storage and arithmetic.
//!
//! A trial judges only the stage checks of the changed step at the changed
//! stage or a later one: a stage check reads captures of its own step only,
//! its stage and that stage's inputs (a forward pass reads only what it has
//! computed), so every other check's verdict is the unchanged run's, a pass
//! (the run must pass unchanged). The earliest failure and the count of
//! failures are therefore those of a full judgement, at a fraction of its
//! cost.

use std::path::PathBuf;

use super::specs::specs_or_default;
use super::Outcome;
use crate::checks::Status;
use crate::engine::registry::EngineSel;
use crate::engine::replay::{Replay, RowScale};
use crate::error::{Error, Result};
use crate::plan::Plan;
use crate::report::SuiteRun;
use crate::runner::{run_on, run_on_from, EngineSource, Filter};
use crate::spec::Spec;
use crate::stage::{parse_key, Stage, Step};
use crate::tensor::DType;

/// The relative changes tried, largest first (1-2-5 steps per decade).
const DELTAS: [f64; 16] = [
    1e-1, 5e-2, 2e-2, 1e-2, 5e-3, 2e-3, 1e-3, 5e-4, 2e-4, 1e-4, 5e-5, 2e-5, 1e-5, 5e-6, 2e-6, 1e-6,
];

pub struct PowerArgs {
    pub spec: Option<PathBuf>,
    pub at: String,
    pub engine: String,
    pub storage: Option<DType>,
    pub model: Option<PathBuf>,
}

/// The measurement at one δ.
pub struct Trial {
    pub delta: f64,
    pub failed: usize,
    /// `<step>/<stage>` and check of the earliest failure, if any.
    pub earliest: Option<(String, String)>,
    pub localised: bool,
}

/// How much of the δ grid a measurement judges.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Grid {
    /// Every δ: the table `touchstone power` prints.
    Full,
    /// Down to the first δ not localised: the claim (`smallest`) needs no
    /// more, and each δ costs a judgement of every later stage.
    UntilLost,
}

/// The grid's trials and the claim: the smallest δ localised together with
/// every larger one (None when even 10% is not).
pub struct Power {
    pub trials: Vec<Trial>,
    pub smallest: Option<f64>,
}

pub fn run(args: PowerArgs) -> Result<Outcome> {
    let (step, stage) = parse_key(&args.at).ok_or_else(|| {
        Error::Usage(format!(
            "--at {:?}: expected STEP/STAGE, e.g. prefill/blk.11.ffn_act",
            args.at
        ))
    })?;
    let spec_path = match args.spec {
        Some(p) => p,
        None => specs_or_default(Vec::new())?.remove(0),
    };
    let mut plan = Plan::build(Spec::load(&spec_path)?, args.model.as_deref())?;
    if let Some(s) = args.storage {
        plan.load_options.storage = s;
    }
    let sels = EngineSel::resolve(&args.engine, &plan.spec.declared())?;
    let [sel] = sels.as_slice() else {
        return Err(Error::Usage(format!(
            "--engine {}: power measures one engine (got {})",
            args.engine,
            sels.len()
        )));
    };
    if let crate::engine::Availability::Unavailable(why) = sel.availability() {
        return Err(Error::Usage(format!("the {} engine is unavailable: {why}", sel.name())));
    }
    let engine = EngineSource::load(sel, &plan)?;
    let p = measure(&plan, engine.as_ref(), step, stage, Grid::Full)?;
    println!(
        "detection power of {} on engine {}, storage {}: one token row (the last) of {step}/{stage} scaled by 1 + δ",
        plan.spec.name,
        engine.name(),
        plan.load_options.storage
    );
    println!("{:>8}  {:>7}  {:<10}  earliest failure", "δ", "failed", "localised");
    for t in &p.trials {
        let at = t
            .earliest
            .as_ref()
            .map_or("none (not caught)".to_string(), |(at, check)| format!("{at} ({check})"));
        println!(
            "{:>8.0e}  {:>7}  {:<10}  {at}",
            t.delta,
            t.failed,
            if t.localised { "yes" } else { "no" }
        );
    }
    match p.smallest {
        Some(d) => {
            println!("smallest relative change localised at {step}/{stage}: {d:.0e} (and every larger one tried)");
            Ok(Outcome::Passed)
        }
        None => {
            println!("not localised at {step}/{stage} even at {:.0e}", DELTAS[0]);
            Ok(Outcome::Failed)
        }
    }
}

/// Runs `engine` once on `plan`'s stage checks, which must all pass, then
/// judges them again with the change planted at each δ of the grid.
pub fn measure(plan: &Plan, engine: &dyn crate::engine::Engine, step: Step, stage: Stage, grid: Grid) -> Result<Power> {
    let mut p = measure_each(plan, engine, &[(step, stage)], grid)?;
    Ok(p.remove(0))
}

/// `measure` at each of `targets`, from one engine run and one judgement of
/// the unchanged run (a caller asking about several stages pays for those
/// once).
pub fn measure_each(
    plan: &Plan,
    engine: &dyn crate::engine::Engine,
    targets: &[(Step, Stage)],
    grid: Grid,
) -> Result<Vec<Power>> {
    let replay = Replay::new(engine);
    // Stage checks only (ids `<step>/<stage>::<check>`): one engine run
    // serves every judgement; run checks would run the engine again.
    let filter = Filter(Some(vec!["::prefill/".into(), "::decode".into()]));
    let base = run_on(plan, &replay, &filter, &|id| id.to_string());
    if let Some(o) = base.outcomes.iter().find(|o| o.status == Status::Fail) {
        return Err(Error::Usage(format!(
            "the unchanged run already fails {} stage check(s), first {}: power is measured from a passing run",
            base.outcomes.iter().filter(|o| o.status == Status::Fail).count(),
            o.id
        )));
    }
    let mut out = Vec::new();
    for &(step, stage) in targets {
        if !base.outcomes.iter().any(|o| o.at == Some((step, stage))) {
            return Err(Error::Usage(format!(
                "spec `{}` plans no stage check at {step}/{stage} (`touchstone list` shows the checks)",
                plan.spec.name
            )));
        }
        out.push(trials_at(plan, &replay, &filter, step, stage, grid));
    }
    replay.set_edit(None);
    Ok(out)
}

/// The grid's trials at one (step, stage), on a replay that has run.
fn trials_at(plan: &Plan, replay: &Replay, filter: &Filter, step: Step, stage: Stage, grid: Grid) -> Power {
    let row = plan.facts().step_dims(step).0 - 1;
    let mut trials = Vec::new();
    for delta in DELTAS {
        replay.set_edit(Some(RowScale {
            step,
            stage,
            row,
            factor: (1.0 + delta) as f32,
        }));
        let r = run_on_from(plan, replay, filter, Some((step, stage)), &|id| id.to_string());
        let earliest = earliest_failure(&r);
        trials.push(Trial {
            delta,
            failed: r.outcomes.iter().filter(|o| o.status == Status::Fail).count(),
            localised: earliest
                .as_ref()
                .is_some_and(|(at, _)| *at == format!("{step}/{stage}")),
            earliest,
        });
        if grid == Grid::UntilLost && trials.last().is_some_and(|t| !t.localised) {
            break;
        }
    }
    let smallest = trials.iter().take_while(|t| t.localised).last().map(|t| t.delta);
    Power { trials, smallest }
}

/// `<step>/<stage>` and check of the run's earliest failure in execution order.
fn earliest_failure(r: &SuiteRun) -> Option<(String, String)> {
    r.outcomes
        .iter()
        .filter(|o| o.status == Status::Fail && o.at.is_some())
        .min_by_key(|o| o.at)
        .map(|o| {
            let (step, stage) = o.at.expect("filtered");
            (format!("{step}/{stage}"), o.check.clone())
        })
}
