//! What serde cannot check about a spec, checked once it is parsed: golden
//! sources named by checks and the prompt are declared, the scaled policy is
//! coherent, engine names are usable, `record:` names real steps and stages,
//! and every count is within the fixed limits. Errors are located by
//! searching the text for the offending name.

use super::parse::{locate, locate_value};
use super::rules::RuleItem;
use super::{limits, Spec, StagePattern};
use crate::checks::kind::{Limit, Located};
use crate::error::{Error, Result};

impl Spec {
    /// Engine names must not shadow the built-in names or the `exec:`/`dumps:`
    /// forms, must be usable in trial ids, and need a command.
    pub(super) fn validate_engines(&self, text: &str) -> Result<()> {
        for (name, d) in &self.engines {
            let ok_chars = !name.is_empty()
                && name
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.'));
            let why = if crate::engine::registry::RESERVED.contains(&name.as_str()) {
                Some(format!("`{name}` is a built-in engine name; choose another"))
            } else if !ok_chars {
                Some(format!("engine name `{name}`: use letters, digits, `_`, `-` and `.`"))
            } else if d.exec.is_empty() || d.exec[0].is_empty() {
                Some(format!(
                    "engines.{name}.exec needs a command, e.g. [python3, my_engine.py]"
                ))
            } else if d.timeout_s == Some(0.0) {
                Some(format!("engines.{name}.timeout_s is 0: every request would time out"))
            } else {
                None
            };
            if let Some(msg) = why {
                return Err(self.located(text, name, msg));
            }
        }
        Ok(())
    }

    /// `oracle` is a reserved source name; `scaled:` needs an oracle and
    /// names only declared sources; a factor below 1 would fail the oracle's
    /// closest reference itself.
    pub(super) fn validate_scaled(&self, text: &str, scaled_given: bool) -> Result<()> {
        if self.goldens.contains_key("oracle") {
            return Err(self.located(
                text,
                "oracle",
                "`oracle` is not a golden source name: give the float64 recording as the top-level `oracle:`".into(),
            ));
        }
        if scaled_given && self.oracle.is_none() {
            return Err(self.located(
                text,
                "scaled",
                "`scaled:` sets the policy that measures errors against the oracle, but the spec has no `oracle:`"
                    .into(),
            ));
        }
        if self.scaled.factor < 1.0 {
            return Err(self.located(
                text,
                "factor",
                format!(
                    "scaled.factor is {}: below 1 the closest reference would fail its own allowance",
                    self.scaled.factor
                ),
            ));
        }
        for src in self.scaled.arithmetic.keys() {
            if !self.goldens.contains_key(src) {
                let hint = crate::suggest::hint(src, self.goldens.keys().map(String::as_str));
                return Err(self.located(
                    text,
                    src,
                    format!("scaled.arithmetic names `{src}`, which is not declared under `goldens:`{hint}"),
                ));
            }
        }
        Ok(())
    }

    /// Cross-references serde cannot see: golden sources named by checks must be
    /// declared under `goldens:`. Located by searching the text for the name.
    pub(super) fn validate_references(&self, text: &str) -> Result<()> {
        let env = self.rule_env();
        let at = |l: Located| self.located(text, &l.needle, l.msg);
        for (_, items) in &self.stages {
            for item in items {
                if let RuleItem::Check(rule) = item {
                    rule.validate(&env).map_err(at)?;
                }
            }
        }
        for rule in &self.run_checks {
            rule.validate(&env).map_err(at)?;
        }
        if let Some(g) = &self.prompt.golden {
            env.require_source("prompt", g).map_err(at)?;
        }
        for src in self.reference_rules.keys() {
            if !self.goldens.contains_key(src) {
                return Err(self.located(
                    text,
                    &format!("{src}:"),
                    format!(
                        "reference_rules: `{src}` is not one of the spec's goldens ({})",
                        self.goldens.keys().cloned().collect::<Vec<_>>().join(", ")
                    ),
                ));
            }
        }
        if !self.reference_rules.is_empty() && self.reference_rules.len() >= self.goldens.len() {
            return Err(self.located(
                text,
                "reference_rules:",
                "reference_rules: every golden is declared to follow another rule; at least one reference must \
                 compute the config's (the one the others' differences are measured against)"
                    .into(),
            ));
        }
        let p = &self.prompt;
        if p.chat && p.text.is_none() {
            return Err(self.located(text, "chat", "prompt.chat needs `text:` (the user message)".into()));
        }
        match (&p.tokens, &p.text, &p.golden) {
            (Some(_), Some(_), _) => Err(self.located(
                text,
                "prompt",
                "prompt: give either `tokens` or `text`, not both".into(),
            )),
            (Some(_), None, Some(_)) => Err(self.located(
                text,
                "prompt",
                "prompt: give either `tokens` or `golden`, not both (with `text` and `golden`, the text must \
                 tokenise to the golden's prompt)"
                    .into(),
            )),
            (None, None, None) => Err(self.located(
                text,
                "prompt",
                "prompt: give `text: \"...\"`, `tokens: [ids...]` or `golden: SOURCE`".into(),
            )),
            (Some(t), None, None) if t.is_empty() => Err(self.located(text, "tokens", "prompt.tokens is empty".into())),
            (None, Some(t), _) if t.is_empty() => Err(self.located(text, "text", "prompt.text is empty".into())),
            (_, _, None) if p.decode_steps.is_none() => Err(self.located(
                text,
                "prompt",
                "prompt.decode_steps is required unless the prompt comes from a golden".into(),
            )),
            _ => Ok(()),
        }
    }

    /// Every count within the fixed limits (`limits`); the model's context
    /// length bounds steps further when the plan is built.
    pub(super) fn validate_counts(&self, text: &str) -> Result<()> {
        let mut checks: Vec<(&str, &str, usize, usize)> = Vec::new();
        if let Some(n) = self.prompt.decode_steps {
            checks.push(("decode_steps", "prompt.decode_steps", n, limits::MAX_DECODE_STEPS));
        }
        if let Some(t) = &self.prompt.tokens {
            checks.push(("tokens", "prompt.tokens (length)", t.len(), limits::MAX_PROMPT_TOKENS));
        }
        for c in self.run_checks.iter().flat_map(|r| r.counts()) {
            let max = match c.limit {
                Limit::DecodeSteps => limits::MAX_DECODE_STEPS,
                Limit::Runs => limits::MAX_RUNS,
            };
            checks.push((c.key, c.what, c.n, max));
        }
        for (needle, what, n, max) in checks {
            if let Err(msg) = limits::count(what, n, max) {
                let loc = locate_value(text, &format!("{needle}:"), &n.to_string()).or_else(|| locate(text, needle));
                return Err(self.error_at(loc, msg));
            }
        }
        Ok(())
    }

    /// `record:` names real steps and stage patterns.
    pub(super) fn validate_record(&self, text: &str) -> Result<()> {
        if let Some(steps) = &self.record.steps {
            if steps.is_empty() {
                return Err(self.located(
                    text,
                    "steps",
                    "record.steps is empty (leave it out to record every step)".into(),
                ));
            }
            for s in steps {
                if crate::stage::Step::parse(s).is_none() {
                    return Err(self.located(
                        text,
                        s,
                        format!("record.steps: `{s}` is not a step (expected `prefill` or `decodeN`, N >= 1)"),
                    ));
                }
            }
        }
        if let Some(stages) = &self.record.stages {
            if stages.is_empty() {
                return Err(self.located(
                    text,
                    "stages",
                    "record.stages is empty (leave it out to record every stage)".into(),
                ));
            }
            for s in stages {
                StagePattern::parse(s).map_err(|msg| self.located(text, s, format!("record.stages: {msg}")))?;
            }
        }
        for (step, pats) in &self.record.stages_at {
            if crate::stage::Step::parse(step).is_none() {
                return Err(self.located(
                    text,
                    step,
                    format!("record.stages_at: `{step}` is not a step (expected `prefill` or `decodeN`, N >= 1)"),
                ));
            }
            if pats.is_empty() {
                return Err(self.located(text, step, format!("record.stages_at.{step} is empty")));
            }
            for s in pats {
                StagePattern::parse(s).map_err(|msg| self.located(text, s, format!("record.stages_at: {msg}")))?;
            }
        }
        if let Some(rows) = &self.record.rows {
            let twice = rows.iter().enumerate().find(|(i, r)| rows[..*i].contains(r));
            if rows.is_empty() || twice.is_some() {
                return Err(self.located(
                    text,
                    "rows",
                    "record.rows: give each token row once, at least one (e.g. [0, -1]: the first and the last; leave it out to record every row)"
                        .into(),
                ));
            }
        }
        Ok(())
    }

    fn located(&self, text: &str, needle: &str, msg: String) -> Error {
        self.error_at(locate(text, needle), msg)
    }

    /// A spec error at `loc` (line, col), or for the whole file when unknown.
    fn error_at(&self, loc: Option<(usize, usize)>, msg: String) -> Error {
        super::parse::error_at(&self.path, loc, msg)
    }
}
