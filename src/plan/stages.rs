//! Stage checks planned from the spec's `stages:` rules: each rule's checks
//! expanded at every stage of the model its pattern matches (a later rule's
//! check replaces an earlier one's of the same id; an exclusion takes checks
//! off), then instantiated at every step where each check has something to
//! look at. A golden that lacks a whole stage a rule checks (recorded before
//! the stage existed) is one clear error per golden, not a failure per check.

use std::collections::BTreeMap;
use std::sync::Arc;

use super::{CheckInstance, CheckKind, Target};
use crate::checks::kind::{RuleEnv, StageCheck};
use crate::checks::Facts;
use crate::error::{Error, Result};
use crate::spec::{RuleItem, Spec};
use crate::stage::{Stage, Step};

/// A check planned at a stage, by its id.
type Planned = (String, Arc<dyn StageCheck>);

/// The stage check instances of `spec`, in execution order: step, stage,
/// then the order the rules name the checks in.
pub fn plan(spec: &Spec, facts: &Facts) -> Result<Vec<CheckInstance>> {
    let invalid = |msg: String| Error::SpecInvalid {
        path: spec.path.clone(),
        msg,
    };
    let config = facts.config;
    let random = facts_random(spec);
    let stages = Stage::of_model(config, random);
    for (pattern, _) in &spec.stages {
        if let Some(l) = pattern.named_layer() {
            if l >= config.layers {
                return Err(invalid(format!(
                    "stage pattern `{}` names layer {l}, but the model has {} layers (0..{})",
                    pattern.as_str(),
                    config.layers,
                    config.layers - 1
                )));
            }
        }
    }
    let env = RuleEnv {
        layers: Some(config.layers),
        post_norms: config.post_norms,
        vlm_deepstack: config.vision.as_ref().map(|v| v.deepstack.len()),
        vision_pos_embed: config.vision.as_ref().is_some_and(|v| v.pos_embeds.is_some()),
        llava_feature_layer: config.vision.as_ref().and_then(|v| v.llava.as_ref()).map(|l| l.feature_layer),
        routed_shared: (0..config.layers)
            .map(|l| config.moe.as_ref().is_some_and(|m| m.is_sparse(l) && m.shared_ffn.is_some()))
            .collect(),
        routed: (0..config.layers)
            .map(|l| config.moe.as_ref().is_some_and(|m| m.is_sparse(l)))
            .collect(),
        attn_sinks: config.attn_sinks,
        ..spec.rule_env()
    };
    // stage -> [(check id, check)]; a later rule replaces an earlier one.
    let mut per_stage: BTreeMap<Stage, Vec<Planned>> = BTreeMap::new();
    for (pattern, items) in &spec.stages {
        for &stage in stages.iter().filter(|s| pattern.matches(**s)) {
            for item in items {
                match item {
                    RuleItem::Check(rule) => {
                        for check in rule.expand(stage, &env).map_err(invalid)? {
                            let id = check.id();
                            let list = per_stage.entry(stage).or_default();
                            match list.iter_mut().find(|(i, _)| *i == id) {
                                Some(slot) => slot.1 = check,
                                None => list.push((id, check)),
                            }
                        }
                    }
                    RuleItem::Exclude(names) => {
                        if let Some(list) = per_stage.get_mut(&stage) {
                            list.retain(|(id, _)| !RuleItem::excludes(names, id));
                        }
                    }
                }
            }
        }
    }
    let mut checks = Vec::new();
    let mut missing = Missing::default();
    for step in Step::sequence(facts.decode_steps) {
        for (stage, list) in &per_stage {
            // The image is encoded once: a decode step has no vision stages,
            // and a VLM run without an image (a text prompt) none at all.
            if step != Step::Prefill && stage.prefill_only() {
                continue;
            }
            if facts.image.is_none() && matches!(stage, Stage::Vision(_)) {
                continue;
            }
            for (id, check) in list {
                if !check.planned(step, *stage, facts) {
                    continue;
                }
                missing.note(facts, step, *stage, id, check.as_ref());
                checks.push(CheckInstance {
                    id: format!("{step}/{stage}::{id}"),
                    target: Target::Stage { step, stage: *stage },
                    kind: CheckKind::Stage(check.clone()),
                });
            }
        }
    }
    missing.error(spec)?;
    Ok(checks)
}

/// Whether the main run samples at random (it then has `sample_probs`).
fn facts_random(spec: &Spec) -> bool {
    matches!(spec.sampling, crate::sampling::Sampling::Random { .. })
}

/// Goldens that lack a whole stage a planned check reads: golden source ->
/// generic stage (`blk.*.attn_scores`) -> (planned checks, their names).
#[derive(Default)]
struct Missing {
    by_golden: BTreeMap<String, BTreeMap<String, (usize, Vec<String>)>>,
}

impl Missing {
    /// Records `check` at (step, stage) if a golden it reads claims the stage
    /// (its `record`) yet holds no tensor of it at any step or layer: it was
    /// recorded without the stage. One missing tensor among recorded ones is
    /// not this (the check itself fails, naming the tensor).
    fn note(&mut self, facts: &Facts, step: Step, stage: Stage, id: &str, check: &dyn StageCheck) {
        for src in check.goldens(facts) {
            let Some(g) = facts.source(&src) else { continue };
            if g.get(step, stage).is_some() || !g.records(step, stage) {
                continue;
            }
            let generic = stage.generic_name();
            if g.keys().any(|(_, s)| s.generic_name() == generic) {
                continue;
            }
            let entry = self.by_golden.entry(src).or_default().entry(generic).or_default();
            entry.0 += 1;
            if !entry.1.iter().any(|c| c == id) {
                entry.1.push(id.to_string());
            }
        }
    }

    /// One message per golden naming the stages it lacks, how to regenerate
    /// it, and how to take the stages out of the spec's rules instead.
    fn error(self, spec: &Spec) -> Result<()> {
        if self.by_golden.is_empty() {
            return Ok(());
        }
        let mut lines = Vec::new();
        let mut example = None;
        for (src, stages) in &self.by_golden {
            let path = spec
                .goldens
                .get(src)
                .or(spec.oracle.as_ref())
                .map_or_else(String::new, |p| format!(" ({})", p.display()));
            let listed: Vec<String> = stages
                .iter()
                .map(|(generic, (n, ids))| format!("`{generic}` ({n} planned checks: {})", ids.join(", ")))
                .collect();
            lines.push(format!(
                "golden `{src}`{path} holds no tensor of {} at any step, yet the spec checks it there",
                listed.join("; ")
            ));
            if example.is_none() {
                let (generic, (_, ids)) = stages.iter().next().expect("non-empty");
                let mut kinds: Vec<&str> = ids.iter().map(|i| i.split(':').next().unwrap_or(i)).collect();
                kinds.dedup();
                example = Some(format!("{generic}: [{{exclude: [{}]}}]", kinds.join(", ")));
            }
        }
        Err(Error::SpecInvalid {
            path: spec.path.clone(),
            msg: format!(
                "{}\n  the golden was recorded before the stage existed, or without it: regenerate it \
                 (`touchstone goldens regen {}`), or take the stage out of the rules that check it, e.g. \
                 `{}` under `stages:`",
                lines.join("\n  "),
                spec.path.display(),
                example.unwrap_or_default()
            ),
        })
    }
}
