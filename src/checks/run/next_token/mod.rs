//! `next_token`: logits-only verdicts over a prompt set. Serving engines may
//! show nothing but logits; the field judges them end to end on their
//! next-token distributions (vLLM's model tests compare top-k log-probs with
//! HF's; llama.cpp's perplexity tool reports KL divergence and top-token
//! agreement against a reference). This check does that against the
//! float64 oracle, with allowances derived from the references of the
//! engine's own arithmetic (`judge`), over a committed set of prompts (code
//! and prose) whose goldens keep only each position's top-K log-probs
//! (`set`).
//!
//! Each prompt of T tokens is run teacher-forced on its own tokens: a
//! prefill of the first T − D, then D decode steps fed the rest
//! (`decode_steps`, so the KV-cache path is judged too), tapping the logits
//! (or, with `taps: all`, every stage the engine can tap, to show a bug
//! hurts the tapped and the untapped path alike). Position t's distribution
//! is the engine's prediction of the token after tokens[0..=t].

mod dist;
mod judge;
mod report;
pub(crate) mod set;

use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

use serde::de::{Deserialize, Deserializer};

use self::judge::{Allowance, Measured};
use self::report::{clip_front, explain, pct, sci, step_of, Totals};
use self::set::{NextTokenSet, PromptRec};
use super::run_engine;
use crate::arithmetic::{Arithmetic, U_ACC};
use crate::checks::facts::Facts;
use crate::checks::kind::{Count, Kind, Limit, Located, RuleEnv, RunCheck, RunRule};
use crate::checks::verdict::Verdict;
use crate::engine::{Engine, RunRequest, TapSet};
use crate::sampling::Sampling;
use crate::stage::{Stage, Step};

/// Failing prompts explained in full; the rest are counted.
const SHOWN_PROMPTS: usize = 4;

/// Which stages the check's runs tap.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Taps {
    /// Only the logits: the closest to the engine's production path.
    #[default]
    Logits,
    /// Every stage the engine can tap.
    All,
}

#[derive(Clone, Debug, PartialEq, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NextToken {
    /// The prompt set (YAML) the goldens were recorded from; its sha256 must
    /// be the one their provenance names.
    pub prompts: Option<PathBuf>,
    /// The folder of next-token goldens (`oracle.safetensors` and one file
    /// per reference).
    pub goldens: Option<PathBuf>,
    /// Tokens of each prompt fed as decode steps (default 2).
    #[serde(default = "default_decode")]
    pub decode_steps: usize,
    /// The k of the top-k rule (default 5; below the goldens' K).
    #[serde(default = "default_k")]
    pub top_k: usize,
    #[serde(default)]
    pub taps: Taps,
}

fn default_decode() -> usize {
    2
}

fn default_k() -> usize {
    5
}

impl Kind for NextToken {
    const NAME: &'static str = "next_token";
    const PARAMS: &'static str = "prompts (the prompt set file), goldens (its next-token goldens' folder), decode_steps \
                                  (2), top_k (5), taps (logits | all)";
    const ABOUT: &'static str = "teacher-forced over a prompt set, the engine's next-token distributions are within \
                                 factor (factor² for KL) of the references of its arithmetic from the float64 \
                                 oracle's, and it picks the oracle's top-1 and keeps its top-k but for near-ties";
    fn bare() -> Self {
        NextToken {
            prompts: None,
            goldens: None,
            decode_steps: default_decode(),
            top_k: default_k(),
            taps: Taps::Logits,
        }
    }
    fn parse<'de, D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        Ok(Option::<NextToken>::deserialize(d)?.unwrap_or_else(Self::bare))
    }
    fn check_params(&self) -> Result<(), String> {
        if self.top_k == 0 {
            return Err("next_token.top_k must be at least 1".into());
        }
        Ok(())
    }
}

impl RunRule for NextToken {
    fn kind(&self) -> &'static str {
        Self::NAME
    }
    fn validate(&self, env: &RuleEnv) -> Result<(), Located> {
        let located = |msg: String| Located {
            needle: Self::NAME.into(),
            msg,
        };
        let (Some(p), Some(g)) = (&self.prompts, &self.goldens) else {
            return Err(located(
                "next_token needs `prompts:` (the prompt set file) and `goldens:` (the folder its next-token goldens \
                 were recorded into), e.g. {next_token: {prompts: ../goldens/prompt-sets/code-and-prose.yaml, \
                 goldens: ../goldens/MODEL/next-token}}"
                    .into(),
            ));
        };
        if !env.dir.join(p).is_file() {
            return Err(located(format!("next_token.prompts: no file {}", env.dir.join(p).display())));
        }
        // A folder not recorded yet is no spec error (`goldens regen` records
        // into it); `Plan::build` refuses to run without it.
        let folder = env.dir.join(g);
        if folder.exists() && !folder.is_dir() {
            return Err(located(format!("next_token.goldens: {} is not a folder", folder.display())));
        }
        Ok(())
    }
    fn next_token_files(&self, dir: &Path) -> Option<(PathBuf, PathBuf)> {
        Some((dir.join(self.prompts.as_ref()?), dir.join(self.goldens.as_ref()?)))
    }
    fn counts(&self) -> Vec<Count> {
        vec![Count {
            key: "decode_steps",
            what: "next_token.decode_steps",
            n: self.decode_steps,
            limit: Limit::DecodeSteps,
        }]
    }
    fn expand(&self, env: &RuleEnv) -> Arc<dyn RunCheck> {
        let at = |p: &Option<PathBuf>| p.as_ref().map(|p| env.dir.join(p)).unwrap_or_default();
        Arc::new(NextTokenCheck {
            rule: self.clone(),
            prompts: at(&self.prompts),
            goldens: at(&self.goldens),
            set: OnceLock::new(),
        })
    }
}

/// The planned check: its files resolved, the goldens read on first use and
/// shared by every engine.
#[derive(Debug)]
pub struct NextTokenCheck {
    rule: NextToken,
    prompts: PathBuf,
    goldens: PathBuf,
    set: OnceLock<Result<Arc<NextTokenSet>, String>>,
}

impl RunCheck for NextTokenCheck {
    fn id(&self) -> String {
        match self.rule.taps {
            Taps::Logits => NextToken::NAME.into(),
            Taps::All => format!("{}:tapped", NextToken::NAME),
        }
    }
    fn reruns(&self) -> bool {
        true
    }
    fn evaluate(&self, facts: &Facts, engine: &dyn Engine) -> Verdict {
        evaluate(self, facts, engine).unwrap_or_else(Verdict::fail)
    }
}

impl NextTokenCheck {
    fn set(&self) -> Result<Arc<NextTokenSet>, String> {
        self.set
            .get_or_init(|| NextTokenSet::load(&self.goldens).map(Arc::new).map_err(|e| e.to_string()))
            .clone()
    }
}

/// The prompt set file must be the one the goldens were recorded from.
fn same_prompt_set(file: &Path, set: &NextTokenSet) -> Result<(), String> {
    let want = set
        .oracle
        .provenance
        .pointer("/prompt_set/sha256")
        .and_then(|v| v.as_str())
        .ok_or_else(|| format!("{}: the provenance names no prompt_set.sha256", set.oracle.path.display()))?;
    let have = crate::golden::provenance::sha256_file(file).map_err(|e| e.to_string())?;
    if have != want {
        let named = set.oracle.provenance.pointer("/prompt_set/path").and_then(|v| v.as_str()).unwrap_or("?");
        return Err(format!(
            "the prompt set {} (sha256 {have}) is not the one the next-token goldens in {} were recorded from \
             ({named}, sha256 {want}): name that set in `prompts:`, or re-record the goldens from this one with \
             `touchstone goldens regen`",
            file.display(),
            set.oracle.path.parent().unwrap_or(Path::new("")).display()
        ));
    }
    Ok(())
}

/// A reference's arithmetic: the spec's `scaled.arithmetic`, else its
/// provenance's, else f32 (as for stage goldens).
fn arithmetic_of(facts: &Facts, s: &set::Source) -> Result<Arithmetic, String> {
    if let Some(a) = facts.scaled.arithmetic.get(&s.name) {
        return Ok(*a);
    }
    Arithmetic::of_provenance(&s.provenance)
        .map(|a| a.unwrap_or(Arithmetic::F32))
        .map_err(|e| format!("{}: {e}", s.path.display()))
}

fn evaluate(c: &NextTokenCheck, facts: &Facts, engine: &dyn Engine) -> Result<Verdict, String> {
    let caps = engine.capabilities();
    if let Some(why) = caps.why_not(Stage::Logits) {
        return Ok(Verdict::not_applicable(why));
    }
    let set = c.set()?;
    same_prompt_set(&c.prompts, &set)?;
    let k = c.rule.top_k;
    if k >= set.k {
        return Err(format!(
            "next_token.top_k {k} must be below the {} tokens per position the goldens keep (the top-k rule compares \
             with the oracle's (k+1)-th)",
            set.k
        ));
    }
    let mine = facts.arithmetic;
    let mut peers = Vec::new();
    let mut others = Vec::new();
    let mut overflowed = Vec::new();
    for r in &set.refs {
        let a = arithmetic_of(facts, r)?;
        if a == mine && r.prompts.is_empty() {
            // Its forward overflowed on every prompt: no measure of anything.
            overflowed.push(format!("{} overflowed on every prompt (first at {})", r.name, r.overflowed[0].at));
        } else if a == mine {
            peers.push(r);
        } else {
            others.push((r, a));
        }
    }
    if peers.is_empty() && !overflowed.is_empty() {
        return Ok(Verdict::not_applicable(format!(
            "not applicable: the references of the engine's arithmetic {mine} are no measure here: {}",
            overflowed.join("; ")
        )));
    }
    if peers.is_empty() {
        let have: Vec<String> = others.iter().map(|(r, a)| format!("{} ({a})", r.name)).collect();
        return Ok(Verdict::not_applicable(format!(
            "not applicable: no reference of the engine's arithmetic {mine} recorded the prompt set (recorded: {}), \
             so there is no measured allowance to judge it by",
            if have.is_empty() { "none".to_string() } else { have.join(", ") }
        )));
    }
    let taps: TapSet = match c.rule.taps {
        Taps::Logits => [Stage::Logits].into_iter().collect(),
        Taps::All => caps.tappable(facts.config, false),
    };
    let tok = crate::tokenizer::Tokenizer::load(facts.model).ok();
    let show = |ids: &[u32]| match &tok {
        Some(t) => format!("{:?}", clip_front(&t.decode_display(ids), 40)),
        None => format!("{ids:?}"),
    };
    let factor = facts.scaled.factor;
    // Every prompt's runs first: the references' error scale is taken over
    // the whole set (as a stage's is over its whole tensor), since one
    // prompt's few dozen positions are a noisy sample of what the
    // arithmetic does; each prompt is then judged against it.
    let mut measured = Vec::new();
    for o in set.oracle.prompts.iter() {
        let rows = engine_rows(c, facts, engine, o, &taps).map_err(|e| format!("prompt `{}`: {e}", o.name))?;
        let e = Measured::of_rows(o, &rows, k);
        // A peer that overflowed on this prompt measures nothing here.
        let peer_m: Vec<(&str, Measured)> = peers
            .iter()
            .filter_map(|r| r.prompt(&o.name).map(|p| (r.name.as_str(), Measured::of_reference(o, p, k))))
            .collect();
        measured.push((o, e, peer_m));
    }
    let all_peers: Vec<&Measured> = measured.iter().flat_map(|(_, _, p)| p.iter().map(|(_, m)| m)).collect();
    let m_max = set.oracle.prompts.iter().flat_map(|o| o.logit_max.iter().copied()).fold(0.0, f64::max);
    let a = Allowance::new(factor, &all_peers, floor_delta(facts, m_max));
    let mut report = Vec::new();
    let mut failures = Vec::new();
    let (mut positions, mut worst_ratio) = (0usize, 0.0f64);
    let mut totals = Totals::default();
    for (o, e, peer_m) in &measured {
        positions += e.kl.len();
        let (kl, kt) = Measured::worst(&e.kl);
        let (mm, mt) = Measured::worst(&e.margin);
        worst_ratio = worst_ratio.max(kl / a.kl).max(mm / a.margin);
        totals.add(e, o, k, &peer_m.iter().map(|(n, m)| (*n, m)).collect::<Vec<_>>());
        let d = c.rule.decode_steps.min(o.tokens.len() - 1);
        let step = |t: usize| step_of(t, o.tokens.len() - d);
        let r_kl = peer_m.iter().map(|(_, m)| Measured::worst(&m.kl).0).fold(0.0, f64::max);
        let r_m = peer_m.iter().map(|(_, m)| Measured::worst(&m.margin).0).fold(0.0, f64::max);
        report.push(format!(
            "  `{}` ({} tokens): KL {} at {} (references {}), margin error {} at {} (references {})",
            o.name,
            o.tokens.len(),
            sci(kl),
            step(kt),
            sci(r_kl),
            sci(mm),
            step(mt),
            sci(r_m)
        ));
        let b = judge::breaches(o, e, &a, k);
        if !b.is_empty() {
            failures.push(explain(o, e, &a, &b, &step, &show, k));
        }
    }
    let allowed = format!(
        "allowed over the set: KL {} = {}² × max({} {}, δ²/2 {}), margin error {} = {} × max({}, 2δ {}); δ {} = c {} \
         · M {:.3} · (u·√E + u_store + u_w), arithmetic {}",
        sci(a.kl),
        factor,
        peers.iter().map(|r| r.name.as_str()).collect::<Vec<_>>().join("/"),
        sci(a.r_kl),
        sci(a.delta * a.delta / 2.0),
        sci(a.margin),
        factor,
        sci(a.r_margin),
        sci(2.0 * a.delta),
        sci(a.delta),
        facts.scaled.floor,
        m_max,
        facts.arithmetic
    );
    let peers_named: Vec<&str> = peers.iter().map(|r| r.name.as_str()).collect();
    let head = format!(
        "{} prompts, {positions} positions ({} of each as forced decode steps, {} tapped), engine arithmetic {mine}, \
         judged beside {} and the float64 oracle: worst KL {} (prompt `{}`), top-1 agreement {} ({}), top-{k} \
         overlap {} ({}); largest share of an allowance used {:.3}",
        set.oracle.prompts.len(),
        c.rule.decode_steps,
        match c.rule.taps {
            Taps::Logits => "the logits",
            Taps::All => "every stage",
        },
        peers_named.join(", "),
        sci(totals.worst_kl.0),
        totals.worst_kl.1,
        pct(totals.top1()),
        totals.peer_rates(|p| p.0),
        pct(totals.overlap()),
        totals.peer_rates(|p| p.1),
        worst_ratio
    );
    let v = if failures.is_empty() {
        Verdict::pass(format!("{head}\n{allowed}\n{}", report.join("\n")))
    } else {
        // A broken engine breaks every prompt: the first few say enough.
        let more = failures.len().saturating_sub(SHOWN_PROMPTS);
        Verdict::fail(format!(
            "{head}\n{allowed}\n{}\n{} of {} prompts break a rule:\n{}{}",
            report.join("\n"),
            failures.len(),
            set.oracle.prompts.len(),
            failures[..failures.len() - more].join("\n"),
            if more > 0 { format!("\n… and {more} more prompts (their worst positions are in the table above)") } else { String::new() }
        ))
    };
    Ok(v.metric("kl", totals.worst_kl.0)
        .metric("top1", totals.top1())
        .metric("topk_overlap", totals.overlap())
        .metric("ratio", worst_ratio))
}

/// The engine's log-probability rows at every position of one prompt.
fn engine_rows(
    c: &NextTokenCheck,
    facts: &Facts,
    engine: &dyn Engine,
    o: &PromptRec,
    taps: &TapSet,
) -> Result<Vec<Vec<f64>>, String> {
    let t = o.tokens.len();
    let d = c.rule.decode_steps.min(t - 1);
    let split = t - d;
    let out = run_engine(
        engine,
        &RunRequest {
            prompt: o.tokens[..split].to_vec(),
            decode_steps: d,
            sampling: Sampling::Greedy,
            seed: facts.seed,
            forced: Some(o.tokens[split..].to_vec()),
            image: None,
        },
        taps,
    )?;
    let v = facts.config.vocab;
    if let Some(bad) = o.top_ids.iter().flatten().find(|&&i| i as usize >= v) {
        return Err(format!("the goldens name token {bad}, outside the model's {v} tokens"));
    }
    let mut rows = Vec::with_capacity(t);
    for step in Step::sequence(d) {
        let l = out
            .captures
            .get(step, Stage::Logits)
            .ok_or_else(|| format!("the engine did not capture {step}/logits although it was tapped"))?;
        let want = if step == Step::Prefill { split } else { 1 };
        if l.shape() != [want, v] {
            return Err(format!(
                "{step}/logits has shape {:?}, expected [{want}, {v}] (every row of the step)",
                l.shape()
            ));
        }
        rows.extend(l.data().chunks(v).map(dist::log_softmax));
    }
    Ok(rows)
}

/// δ: the LM head's own rounding on this prompt's logits, c·M·(u·√E +
/// u_store + u_w), M the oracle's largest |logit| over the set. The
/// rounding floor of a correct implementation; quantised activations are
/// not in it, because a quantising engine is judged beside a reference of
/// its own arithmetic, whose measured distance carries them.
fn floor_delta(facts: &Facts, m: f64) -> f64 {
    let a = facts.arithmetic;
    let e = facts.config.hidden as f64;
    facts.scaled.floor * m * (U_ACC * e.sqrt() + a.u_store() + a.u_weight())
}

