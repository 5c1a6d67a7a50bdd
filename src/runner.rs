//! Runs a plan on one engine and turns every check instance into an outcome.
//! The engine runs once with taps on every stage a check reads; stage checks are
//! then evaluated in parallel; run checks (determinism, KV cache, greedy tokens)
//! run the engine again as they need.

use std::path::Path;

use rayon::prelude::*;

use crate::checks::{invariants, run as run_checks, scaled, Verdict};
use crate::compare::{compare, Tolerance};
use crate::engine::select::EngineSel;
use crate::engine::{Availability, Engine, EngineKind, RunOutput, RunRequest, TapSet};
use crate::error::Result;
use crate::golden::GoldenSet;
use crate::plan::{CheckInstance, CheckKind, Plan, StageCheckKind, Target, ORACLE};
use crate::report::{Outcome, SuiteRun};
use crate::stage::{BlockStage, Stage, Step};
use crate::tensor::Tensor;

/// Which check instances to run: `None` runs all; otherwise an id must contain
/// one of the filters (matched against `<engine>::<spec>::<id>`).
#[derive(Clone, Debug, Default)]
pub struct Filter(pub Option<Vec<String>>);

impl Filter {
    /// A filter without `*` or `?` matches ids containing it; with them it is
    /// a glob that may match any part of the id (`decode2/blk.1.*`).
    pub fn accepts(&self, full_id: &str) -> bool {
        self.0.as_ref().is_none_or(|fs| {
            fs.iter().any(|f| {
                if f.contains(['*', '?']) {
                    glob_within(f.as_bytes(), full_id.as_bytes())
                } else {
                    full_id.contains(f.as_str())
                }
            })
        })
    }
}

/// Whether `pat` (`*` any run, `?` one byte) matches some substring of `text`:
/// the pattern with an implicit `*` at both ends. Iterative, with the usual
/// single backtrack point, so O(|pat|·|text|) at worst.
fn glob_within(pat: &[u8], text: &[u8]) -> bool {
    let (mut p, mut t) = (0usize, 0usize);
    // Implicit leading `*`: the star at "position -1" with backtrack start 0.
    let (mut star, mut mark) = (Some(0usize), 0usize);
    let mut star_p = 0usize;
    loop {
        if p == pat.len() {
            return true; // implicit trailing `*`
        }
        if t < text.len() && (pat[p] == b'?' || pat[p] == text[t]) {
            p += 1;
            t += 1;
        } else if pat[p] == b'*' {
            star = Some(p);
            star_p = p + 1;
            mark = t;
            p += 1;
        } else if let Some(s) = star {
            let _ = s;
            mark += 1;
            if mark > text.len() {
                return false;
            }
            t = mark;
            p = star_p;
        } else {
            return false;
        }
    }
}

/// The checks of `plan` the filter keeps, matched as `<engine>::<spec>::<id>`.
fn select<'a>(plan: &'a Plan, engine: &str, filter: &Filter) -> Vec<&'a CheckInstance> {
    let spec = plan.spec.name.as_str();
    plan.checks
        .iter()
        .filter(|c| filter.accepts(&format!("{engine}::{spec}::{}", c.id)))
        .collect()
}

/// Runs `plan` on `kind`. `Err` only for bad input (the model cannot be loaded);
/// an engine failing mid-run fails the affected checks instead.
pub fn run_plan(plan: &Plan, sel: &EngineSel, filter: &Filter, model_override: Option<&Path>) -> Result<SuiteRun> {
    run_plan_to(plan, sel, filter, model_override, None)
}

fn run_plan_to(
    plan: &Plan,
    sel: &EngineSel,
    filter: &Filter,
    model_override: Option<&Path>,
    save: Option<&Path>,
) -> Result<SuiteRun> {
    let spec_name = plan.spec.name.as_str();
    let spec_path = plan.spec.path.display().to_string();
    let name = sel.name();
    let selected = select(plan, &name, filter);
    let rerun = |id: &str| rerun_command(plan, sel, id, model_override);
    let at = |c: &CheckInstance| match c.target {
        Target::Stage { step, stage } => Some((step, stage)),
        Target::Run => None,
    };
    // Every selected check with one verdict: an engine that cannot run here
    // (skipped), or an external one that could not start (failed).
    let all_with = |verdict: Verdict, skipped: Option<String>| {
        let outcomes = selected
            .iter()
            .map(|c| Outcome::new(spec_name, &name, &c.id, at(c), verdict.clone(), rerun(&c.id)))
            .collect();
        SuiteRun::new(spec_name, &spec_path, &name, outcomes, skipped)
            .with_storage(plan.load_options.storage)
            .with_text(texts(plan, None).0, None)
    };

    if let Availability::Unavailable(reason) = sel.availability() {
        return Ok(all_with(Verdict::skip(&reason), Some(reason)));
    }
    let engine = match sel.load(&plan.model, &plan.load_options, &plan.spec) {
        Ok(e) => e,
        // An external engine that cannot start fails its own checks; the other
        // engines' results are still reported.
        Err(e) if !sel.is_builtin() => {
            return Ok(all_with(
                Verdict::fail(format!("the engine could not be loaded: {e}")),
                None,
            ))
        }
        Err(e) => return Err(e),
    };
    let (run, saved) = run_plan_inner(plan, engine.as_ref(), filter, &rerun, save);
    saved.map(|_| run)
}

/// `run_plan`, also writing the main run's captures and tokens to `path`
/// (`run --save-captures`): what `--engine dumps:PATH` checks again.
pub fn run_plan_saving(
    plan: &Plan,
    sel: &EngineSel,
    filter: &Filter,
    model_override: Option<&Path>,
    path: &Path,
) -> Result<SuiteRun> {
    run_plan_to(plan, sel, filter, model_override, Some(path))
}

/// Runs the checks of `plan` that `filter` selects on an engine already
/// loaded (any `Engine`: the built-in ones, or one a test or another crate
/// made). `rerun` gives the command that reruns one check id.
pub fn run_plan_on(
    plan: &Plan,
    engine: &dyn Engine,
    filter: &Filter,
    rerun: &(dyn Fn(&str) -> String + Sync),
) -> SuiteRun {
    run_plan_inner(plan, engine, filter, rerun, None).0
}

/// `run_plan_on`, saving the main run to `save` when given; the second value
/// is the result of saving (Ok when nothing was to be saved).
fn run_plan_inner(
    plan: &Plan,
    engine: &dyn Engine,
    filter: &Filter,
    rerun: &(dyn Fn(&str) -> String + Sync),
    save: Option<&Path>,
) -> (SuiteRun, Result<()>) {
    let spec_name = plan.spec.name.as_str();
    let spec_path = plan.spec.path.display().to_string();
    let selected = select(plan, engine.name(), filter);

    let mut taps = TapSet::none();
    for c in &selected {
        if let (Target::Stage { stage, .. }, CheckKind::Stage(k)) = (&c.target, &c.kind) {
            taps.insert(*stage);
            if let StageCheckKind::Rope { input, .. } = k {
                taps.insert(*input);
            }
        }
    }
    let main_run = if taps.is_empty() {
        None
    } else {
        let req = RunRequest {
            prompt: plan.prompt.clone(),
            decode_steps: plan.decode_steps,
            sampling: plan.spec.sampling.to_sampling(),
            seed: plan.spec.seed,
            forced: plan.forced.clone(),
        };
        Some(engine.run(&req, &taps).map_err(|e| e.to_string()))
    };
    let saved = match (save, &main_run) {
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
        (Some(p), Some(Err(e))) => Err(crate::error::Error::engine(
            engine.name(),
            format!("nothing saved to {}: the engine failed: {e}", p.display()),
        )),
        (Some(p), None) => Err(crate::error::Error::Usage(format!(
            "nothing saved to {}: no selected check taps a stage",
            p.display()
        ))),
    };

    let mut outcomes: Vec<Outcome> = selected
        .par_iter()
        .filter(|c| matches!(c.target, Target::Stage { .. }))
        .map(|c| {
            let Target::Stage { step, stage } = c.target else {
                unreachable!("filtered to stage targets")
            };
            let CheckKind::Stage(kind) = &c.kind else {
                unreachable!("stage targets carry stage checks")
            };
            let verdict = match main_run.as_ref().expect("stage checks imply taps") {
                Ok(out) => stage_verdict(plan, out, step, stage, kind),
                Err(e) => Verdict::fail(format!("the engine failed: {e}")),
            };
            Outcome::new(
                spec_name,
                engine.name(),
                &c.id,
                Some((step, stage)),
                verdict,
                rerun(&c.id),
            )
        })
        .collect();
    attach_budget(&mut outcomes);
    for c in selected.iter().filter(|c| c.target == Target::Run) {
        let CheckKind::Run(rc) = &c.kind else {
            unreachable!("run targets carry run checks")
        };
        let verdict = run_checks::evaluate(plan, engine, rc);
        outcomes.push(Outcome::new(
            spec_name,
            engine.name(),
            &c.id,
            None,
            verdict,
            rerun(&c.id),
        ));
    }
    let sampled = main_run
        .as_ref()
        .and_then(|r| r.as_ref().ok())
        .map(|o| o.sampled.as_slice());
    let (prompt_text, continuation_text) = texts(plan, sampled);
    let run = SuiteRun::new(spec_name, &spec_path, engine.name(), outcomes, None)
        .with_storage(plan.load_options.storage)
        .with_text(prompt_text, continuation_text);
    (run, saved)
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

/// The error budget of a stage is how far the references are from each other
/// there: an engine error well inside it is noise, one far outside it is a bug.
/// Golden outcomes get it as `budget_max_abs` beside their own `max_abs`.
fn attach_budget(outcomes: &mut [Outcome]) {
    let mut budget: std::collections::BTreeMap<(Step, Stage), f64> = Default::default();
    for o in outcomes.iter().filter(|o| o.check.starts_with("references_agree")) {
        if let (Some(at), Some(v)) = (o.at, o.metrics.get("max_abs")) {
            let e = budget.entry(at).or_insert(0.0);
            *e = e.max(*v);
        }
    }
    for o in outcomes.iter_mut().filter(|o| o.is_golden()) {
        if let Some(b) = o.at.and_then(|at| budget.get(&at)) {
            o.metrics.insert("budget_max_abs".into(), *b);
        }
    }
}

/// The command that reruns one check as this run ran it: the same spec, engine,
/// model, and storage when `--storage` overrode the spec's.
fn rerun_command(plan: &Plan, sel: &EngineSel, id: &str, model: Option<&Path>) -> String {
    let model = model.map(|m| format!(" --model {}", m.display())).unwrap_or_default();
    let opts = &plan.load_options;
    let keep = if opts.keep_gguf_qk_permutation {
        " --keep-gguf-qk-permutation"
    } else {
        ""
    };
    let storage = if opts.storage != plan.spec.storage {
        format!(" --storage {}", opts.storage)
    } else {
        String::new()
    };
    format!(
        "touchstone run {} --engine {}{model}{keep}{storage} --only '{id}'",
        plan.spec.path.display(),
        sel.cli_arg()
    )
}

fn stage_verdict(plan: &Plan, out: &RunOutput, step: Step, stage: Stage, kind: &StageCheckKind) -> Verdict {
    if let StageCheckKind::ReferencesAgree {
        base,
        other,
        atol,
        rtol,
    } = kind
    {
        return references_verdict(plan, step, stage, base, other, *atol, *rtol);
    }
    let Some(t) = out.captures.get(step, stage) else {
        let hint = if out.unmapped.is_empty() {
            String::new()
        } else {
            let shown: Vec<&str> = out.unmapped.iter().take(8).map(String::as_str).collect();
            format!(
                "; its output holds {} tensor(s) touchstone cannot map ({}{}): name them canonically or map them \
                 with `names:` in the spec",
                out.unmapped.len(),
                shown.join(", "),
                if out.unmapped.len() > shown.len() { ", …" } else { "" }
            )
        };
        return Verdict::fail(format!(
            "the engine did not capture {step}/{stage} although it was tapped{hint}"
        ));
    };
    let positions = &out.positions[step.index()];
    match kind {
        StageCheckKind::Finite => invariants::finite(t),
        StageCheckKind::Shape => invariants::shape(t, &plan.expected_shape(step, stage)),
        StageCheckKind::SoftmaxRows { tol } => invariants::softmax_rows(t, *tol),
        StageCheckKind::Causal => invariants::causal(t, positions),
        StageCheckKind::Rope { input, style, tol } => match out.captures.get(step, *input) {
            Some(i) => invariants::rope(i, t, positions, *style, *tol, plan.config.rope_theta),
            None => Verdict::fail(format!(
                "the engine returned no capture for the rope input {step}/{input}"
            )),
        },
        StageCheckKind::Golden { source, atol, rtol } => {
            golden_verdict(plan, out, step, stage, t, source, *atol, *rtol)
        }
        StageCheckKind::ReferencesAgree { .. } => unreachable!("handled above"),
    }
}

/// The tolerance for comparing `actual` with `expected`: per-check overrides,
/// else the spec's per-dtype table, else the built-in default for the dtype.
fn tolerance(plan: &Plan, actual: &Tensor, expected: &Tensor, atol: Option<f64>, rtol: Option<f64>) -> Tolerance {
    let dtype = actual.dtype().coarser(expected.dtype());
    let base = plan
        .spec
        .tolerance
        .get(&dtype)
        .map(|t| Tolerance::new(t.atol, t.rtol))
        .unwrap_or_else(|| Tolerance::default_for(dtype));
    Tolerance::new(atol.unwrap_or(base.atol), rtol.unwrap_or(base.rtol))
}

/// Two golden sources compared with each other at one stage: where the
/// references disagree, no engine can be judged against them.
fn references_verdict(
    plan: &Plan,
    step: Step,
    stage: Stage,
    base: &str,
    other: &str,
    atol: Option<f64>,
    rtol: Option<f64>,
) -> Verdict {
    let (Some(b), Some(o)) = (plan.source(base), plan.source(other)) else {
        return Verdict::fail(format!("golden source `{base}` or `{other}` is not loaded"));
    };
    let (Some(expected), Some(actual)) = (b.get(step, stage), o.get(step, stage)) else {
        let missing = if b.get(step, stage).is_none() { b } else { o };
        return Verdict::fail(format!(
            "golden `{}` ({}) has no tensor `{step}/{stage}`",
            missing.source,
            missing.path.display()
        ));
    };
    if b.tokens.get(&step) != o.tokens.get(&step) {
        return Verdict::fail(format!(
            "goldens `{base}` and `{other}` were recorded with different tokens at {step}: {:?} vs {:?}",
            b.tokens.get(&step),
            o.tokens.get(&step)
        ));
    }
    let (actual, expected) = (
        &last_row_if(actual, expected, stage, b.logits_last_row()),
        &last_row_if(expected, actual, stage, o.logits_last_row()),
    );
    if base == ORACLE && atol.is_none() && rtol.is_none() {
        return scaled_reference_verdict(plan, step, stage, other, actual, expected);
    }
    let tol = tolerance(plan, actual, expected, atol, rtol);
    match compare(actual, expected, tol) {
        Err(m) => Verdict::fail(format!("`{other}` vs `{base}`: {m}")).metric("shape_mismatch", 1.0),
        Ok(c) => {
            let message = if c.passed() {
                format!("`{other}` agrees with `{base}`: {}", c.summary())
            } else {
                format!(
                    "the references disagree: `{other}` ({}) vs `{base}` ({}):\n{}",
                    o.path.display(),
                    b.path.display(),
                    c.explain()
                )
            };
            let mut v = Verdict::check(c.passed(), message);
            v.metrics = c.metrics();
            v
        }
    }
}

#[allow(clippy::too_many_arguments)]
fn golden_verdict(
    plan: &Plan,
    out: &RunOutput,
    step: Step,
    stage: Stage,
    actual: &Tensor,
    source: &str,
    atol: Option<f64>,
    rtol: Option<f64>,
) -> Verdict {
    let golden = &plan.goldens[source];
    let file = golden.path.display();
    let Some(expected) = golden.get(step, stage) else {
        return Verdict::fail(format!("golden `{source}` ({file}) has no tensor `{step}/{stage}`"));
    };
    // A comparison is only meaningful if both sides were fed the same tokens.
    let fed = fed_tokens(plan, out, step);
    if let Some(recorded) = golden.tokens.get(&step) {
        if *recorded != fed {
            return Verdict::fail(format!(
                "inputs differ at {step}: the engine was fed tokens {fed:?}, golden `{source}` was recorded with {recorded:?}"
            ));
        }
    }
    let actual = &last_row_if(actual, expected, stage, golden.logits_last_row());
    // The scaled policy is measured for f32 runs (the references' arithmetic);
    // a 16-bit storage run keeps the per-dtype table measured for it
    // (`tolerance:`, e.g. specs/qwen2-tiny-bf16.yaml).
    if atol.is_none() && rtol.is_none() && plan.load_options.storage == crate::tensor::DType::F32 {
        if let Some(o) = plan.oracle.as_ref().filter(|o| o.records(step, stage)) {
            return scaled_golden_verdict(plan, step, stage, actual, source, expected, o, &fed);
        }
    }
    let tol = tolerance(plan, actual, expected, atol, rtol);
    match compare(actual, expected, tol) {
        Err(m) => Verdict::fail(format!("{m} (golden `{source}`: {file})")).metric("shape_mismatch", 1.0),
        Ok(c) => {
            let message = if c.passed() {
                format!("within tolerance of golden `{source}`: {}", c.summary())
            } else {
                format!("differs from golden `{source}` ({file}):\n{}", c.explain())
            };
            let mut v = Verdict::check(c.passed(), message);
            v.metrics = c.metrics();
            v
        }
    }
}

/// The scaled policy's inputs at (step, stage): the oracle tensor (last row
/// when `like` is a last-row logits tensor), K and M.
fn oracle_at<'a>(
    plan: &Plan,
    oracle: &'a GoldenSet,
    step: Step,
    stage: Stage,
    like: &Tensor,
) -> Result<(std::borrow::Cow<'a, Tensor>, scaled::FloorModel), String> {
    let o = oracle
        .get(step, stage)
        .ok_or_else(|| format!("the oracle ({}) has no tensor `{step}/{stage}`", oracle.path.display()))?;
    let like_last = like.shape().first() == Some(&1) && stage == Stage::Logits;
    let o = last_row_if(o, like, stage, like_last);
    let m = scaled::max_abs_value(&o);
    Ok((o, floor_model(plan, oracle, step, stage, m)))
}

/// The floor model of (step, stage): its reduction length and magnitude, and
/// for attn_probs the oracle's score magnitude at the same step (when the
/// oracle recorded the scores).
fn floor_model(plan: &Plan, oracle: &GoldenSet, step: Step, stage: Stage, m: f64) -> scaled::FloorModel {
    let k = scaled::reduction_len(&plan.config, stage, plan.step_dims(step).1);
    let softmax_input = match stage {
        Stage::Block(l, BlockStage::AttnProbs) => oracle
            .get(step, Stage::Block(l, BlockStage::AttnScores))
            .map(|s| (plan.config.head_dim, scaled::max_abs_value(s))),
        _ => None,
    };
    let rope_position = match stage {
        Stage::Block(_, BlockStage::QRope | BlockStage::KRope) => Some(plan.step_dims(step).1.saturating_sub(1)),
        _ => None,
    };
    scaled::FloorModel {
        k,
        m,
        softmax_input,
        rope_position,
    }
}

fn policy(plan: &Plan) -> scaled::Policy {
    scaled::Policy {
        factor: plan.spec.scaled.factor,
        floor: plan.spec.scaled.floor,
    }
}

/// The engine against reference `source` under the scaled policy: its error
/// against the oracle within `factor` times the reference's own (or the floor).
#[allow(clippy::too_many_arguments)]
fn scaled_golden_verdict(
    plan: &Plan,
    step: Step,
    stage: Stage,
    actual: &Tensor,
    source: &str,
    reference: &Tensor,
    oracle: &GoldenSet,
    fed: &[u32],
) -> Verdict {
    if let Some(recorded) = oracle.tokens.get(&step) {
        if recorded != fed {
            return Verdict::fail(format!(
                "inputs differ at {step}: the engine was fed tokens {fed:?}, the oracle ({}) was recorded with {recorded:?}",
                oracle.path.display()
            ));
        }
    }
    let (o, fm) = match oracle_at(plan, oracle, step, stage, actual) {
        Ok(x) => x,
        Err(e) => return Verdict::fail(e),
    };
    let actual = &*last_row_if(actual, &o, stage, oracle.logits_last_row());
    // The reference error the engine is measured by: the largest among the
    // references of the same arithmetic as `source` (the same unit roundoff),
    // each a correct implementation whose spread is the honest error scale.
    // A reference coarser by design has another unit, so it never widens this.
    let unit = |src: &str| {
        plan.spec
            .scaled
            .unit_roundoff
            .get(src)
            .copied()
            .unwrap_or(scaled::U_F32)
    };
    let mut r = 0.0f64;
    let mut peers = Vec::new();
    for (name, g) in plan.goldens.iter().filter(|(n, _)| unit(n) == unit(source)) {
        let t = if name == source {
            Some(reference)
        } else {
            g.get(step, stage)
        };
        let Some(t) = t else { continue };
        let t = last_row_if(t, &o, stage, o.shape().first() == Some(&1));
        match scaled::max_error(&t, &o) {
            Ok((e, _)) => {
                r = r.max(e);
                peers.push(format!("{name} {}", sci(e)));
            }
            Err(e) => {
                return Verdict::fail(format!("golden `{name}` vs the oracle: {e}")).metric("shape_mismatch", 1.0)
            }
        }
    }
    let u_store = scaled::storage_unit(plan.load_options.storage);
    let e = match scaled::max_error(actual, &o) {
        Ok((e, _)) => e,
        Err(e) => {
            return Verdict::fail(format!("{e} (the oracle: {})", oracle.path.display())).metric("shape_mismatch", 1.0)
        }
    };
    let j = scaled::judge_engine(policy(plan), e, r, &fm, u_store);
    // The comparator at the allowance gives the failure its count, worst
    // element with both values, NMSE and cosine (engine vs oracle).
    let c = compare(actual, &o, Tolerance::new(j.allowed, 0.0)).expect("shapes matched above");
    let head = format!(
        "engine error {} (max|engine − oracle|), reference error {} (max|reference − oracle| of {}), floor {} \
         ({}, c {}): ratio {} {} factor {}",
        sci(j.error),
        sci(r),
        peers.join(", "),
        sci(j.floor),
        fm.describe(),
        plan.spec.scaled.floor,
        ratio_text(j.ratio()),
        if j.passed() { "<=" } else { ">" },
        j.factor
    );
    let message = if j.passed() {
        head
    } else {
        format!(
            "further from the exact answer than `{source}` allows (oracle {}):\n{head}\n{}",
            oracle.path.display(),
            c.explain()
        )
    };
    scaled_verdict(j.passed() && c.passed(), message, &c, &j)
}

/// Reference `other` against the oracle under the scaled policy: within
/// `factor` times its own floor (its arithmetic's unit roundoff), else the
/// golden is suspect here.
fn scaled_reference_verdict(
    plan: &Plan,
    step: Step,
    stage: Stage,
    other: &str,
    reference: &Tensor,
    oracle: &Tensor,
) -> Verdict {
    let m = scaled::max_abs_value(oracle);
    let Some(og) = plan.oracle.as_deref() else {
        return Verdict::fail("the spec has no oracle".to_string());
    };
    let fm = floor_model(plan, og, step, stage, m);
    let u = plan
        .spec
        .scaled
        .unit_roundoff
        .get(other)
        .copied()
        .unwrap_or(scaled::U_F32);
    let c = match compare(reference, oracle, Tolerance::new(0.0, 0.0)) {
        Ok(c) => c,
        Err(e) => return Verdict::fail(format!("`{other}` vs the oracle: {e}")).metric("shape_mismatch", 1.0),
    };
    let r = if c.non_finite() > 0 {
        f64::INFINITY
    } else {
        c.max_abs.as_ref().map_or(0.0, |(v, _)| *v)
    };
    let j = scaled::judge_reference(policy(plan), r, &fm, u);
    let c = compare(reference, oracle, Tolerance::new(j.allowed, 0.0)).expect("shapes matched above");
    let head = format!(
        "`{other}`'s error {} (max|{other} − oracle|), its floor {} ({}, u = u_store {}, c {}): ratio {} {} factor {}",
        sci(r),
        sci(j.floor),
        fm.describe(),
        sci(u),
        plan.spec.scaled.floor,
        ratio_text(j.ratio()),
        if j.passed() { "<=" } else { ">" },
        j.factor
    );
    let message = if j.passed() {
        head
    } else {
        format!(
            "golden `{other}` is suspect here: further from the exact answer than its arithmetic allows:\n{head}\n{}",
            c.explain()
        )
    };
    scaled_verdict(j.passed(), message, &c, &j)
}

/// A scaled check's verdict: the comparator's metrics at the allowance plus
/// the judgement's (error, floor, allowed, factor, ratio).
fn scaled_verdict(ok: bool, message: String, c: &crate::compare::Comparison, j: &scaled::Judgement) -> Verdict {
    let mut v = Verdict::check(ok, message);
    v.metrics = c.metrics();
    for (name, value) in j.metrics() {
        v.metrics.insert(name.to_string(), value);
    }
    v
}

fn sci(x: f64) -> String {
    if x == 0.0 {
        "0".into()
    } else if x.is_finite() {
        format!("{x:.2e}")
    } else {
        format!("{x}")
    }
}

fn ratio_text(r: f64) -> String {
    if r.is_finite() {
        format!("{r:.3}")
    } else {
        "inf".into()
    }
}

/// Logits against a last-row golden (`record.logits: last`, shape `[1, V]`):
/// the last row of `t`, which is what the golden recorded. Anything else is
/// compared as it is (so a wrong shape still fails the shape comparison).
fn last_row_if<'a>(
    t: &'a Tensor,
    other: &Tensor,
    stage: Stage,
    other_is_last_row: bool,
) -> std::borrow::Cow<'a, Tensor> {
    let (ts, os) = (t.shape(), other.shape());
    if other_is_last_row
        && stage == Stage::Logits
        && ts.len() == 2
        && os.len() == 2
        && os[0] == 1
        && ts[0] > 1
        && ts[1] == os[1]
    {
        let v = ts[1];
        let row = t.data()[(ts[0] - 1) * v..].to_vec();
        std::borrow::Cow::Owned(Tensor::new(vec![1, v], row).with_dtype(t.dtype()))
    } else {
        std::borrow::Cow::Borrowed(t)
    }
}

/// Tokens the engine was fed at `step`: the prompt, or the decode token (forced
/// from the golden, or sampled at the previous step).
fn fed_tokens(plan: &Plan, out: &RunOutput, step: Step) -> Vec<u32> {
    match step {
        Step::Prefill => plan.prompt.clone(),
        Step::Decode(n) => match &plan.forced {
            Some(f) => vec![f[n - 1]],
            None => vec![out.sampled[n - 1]],
        },
    }
}

/// Convenience for callers that want every check of a plan on one engine.
pub fn run_all(plan: &Plan, kind: EngineKind) -> Result<SuiteRun> {
    run_plan(plan, &EngineSel::Builtin(kind), &Filter::default(), None)
}

/// Used by run checks: one engine run, with errors as strings for messages.
pub(crate) fn run_engine(
    engine: &dyn Engine,
    req: &RunRequest,
    taps: &TapSet,
) -> std::result::Result<RunOutput, String> {
    engine.run(req, taps).map_err(|e| e.to_string())
}

#[cfg(test)]
mod filter_tests {
    use super::*;

    #[test]
    fn plain_filters_are_substrings_and_globs_match_within_the_id() {
        let id = "cpu::qwen2-tiny::decode2/blk.1.q::golden:hf";
        let f = |s: &str| Filter(Some(vec![s.to_string()])).accepts(id);
        assert!(f("blk.1.q::golden"));
        assert!(f("decode2/blk.1.*"));
        assert!(f("decode?/blk.*.q::*hf"));
        assert!(f("*"));
        assert!(!f("decode1/blk.1.*"));
        assert!(!f("decode2/blk.0.*"));
        assert!(!f("blk.1.q::golden:llama*"));
        assert!(Filter(None).accepts(id));
        // Matching is linear-ish: a pathological glob returns at once.
        let long = "a".repeat(10_000);
        assert!(!Filter(Some(vec!["*a*a*a*a*a*b".into()])).accepts(&long));
    }
}
