//! A plan: a spec expanded against its model into concrete check instances, one
//! per (step, stage, check) plus the run checks, each with its canonical id
//! (`prefill/blk.0.attn_probs::softmax_rows`, `run::determinism`). Building a plan
//! reads the model's config and the golden files, so every reference the spec
//! makes is resolved before any engine runs.

mod prompt;
mod stages;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::arithmetic::Arithmetic;
use crate::checks::kind::{RunCheck, StageCheck};
use crate::checks::memo::Memo;
use crate::checks::{Facts, Family, Metric};
use crate::error::{Error, Result};
use crate::golden::{GoldenSet, ORACLE};
use crate::model::file_tensors::FileTensors;
use crate::model::{self, LoadOptions, ModelConfig};
use crate::sampling::Sampling;
use crate::spec::Spec;
use crate::stage::{Stage, Step};

#[derive(Clone, Debug, PartialEq)]
pub enum Target {
    Stage { step: Step, stage: Stage },
    Run,
}

/// A planned check: at a stage of a step, or on whole runs.
#[derive(Clone, Debug)]
pub enum CheckKind {
    Stage(Arc<dyn StageCheck>),
    Run(Arc<dyn RunCheck>),
}

#[derive(Clone, Debug)]
pub struct CheckInstance {
    /// `<step>/<stage>::<check>` or `run::<check>`; unique within a plan.
    pub id: String,
    pub target: Target,
    pub kind: CheckKind,
}

impl CheckInstance {
    pub fn check_name(&self) -> &str {
        self.id.rsplit("::").next().unwrap_or(&self.id)
    }

    pub fn family(&self) -> Family {
        match &self.kind {
            CheckKind::Stage(c) => c.family(),
            CheckKind::Run(_) => Family::Run,
        }
    }

    /// The metric that is the check's error.
    pub fn metric(&self) -> Option<Metric> {
        match &self.kind {
            CheckKind::Stage(c) => c.metric(),
            CheckKind::Run(c) => c.metric(),
        }
    }

    /// Its (step, stage), for a stage check.
    pub fn at(&self) -> Option<(Step, Stage)> {
        match self.target {
            Target::Stage { step, stage } => Some((step, stage)),
            Target::Run => None,
        }
    }
}

#[derive(Debug)]
pub struct Plan {
    pub spec: Spec,
    /// The model the plan runs (the spec's, or `--model`).
    pub model: PathBuf,
    pub config: ModelConfig,
    /// The model file's tensors, for checks that recompute a stage.
    pub file: FileTensors,
    /// How engines load the model (default: faithfully; see `LoadOptions`).
    pub load_options: LoadOptions,
    pub goldens: BTreeMap<String, Arc<GoldenSet>>,
    /// The spec's `oracle:` (float64 recording), checked to be one.
    pub oracle: Option<Arc<GoldenSet>>,
    pub prompt: Vec<u32>,
    pub decode_steps: usize,
    /// Tokens fed at decode steps (teacher forcing) when the prompt comes from a golden.
    pub forced: Option<Vec<u32>>,
    /// A VLM prompt's image (`prompt.image`, or a golden's recorded pixels).
    pub image: Option<Arc<crate::engine::ImageInput>>,
    pub checks: Vec<CheckInstance>,
    /// What every run of this plan shares (`Facts::shared`).
    pub memo: Memo,
}

impl Plan {
    pub fn build(spec: Spec, model_override: Option<&Path>) -> Result<Plan> {
        let model = model_override
            .map(Path::to_path_buf)
            .unwrap_or_else(|| spec.model.clone());
        if !model.exists() {
            let why = match (&spec.cached_model, model_override) {
                (Some(name), None) => format!("model not found: {}", crate::model::cache::fetch_hint(name)),
                _ => "model not found (no such file or folder)".to_string(),
            };
            return Err(Error::model(&model, why));
        }
        let config = model::read_config_with(&model, spec.config.as_ref())?;
        let mut goldens = BTreeMap::new();
        for (source, path) in &spec.goldens {
            let mut g = GoldenSet::load(source, path)?;
            // A reference the spec declares to follow another rule from a
            // position on is judged only before it (`reference_rules`).
            if let Some(r) = spec.reference_rules.get(source) {
                g = g.departing_from(r.from_position);
            }
            goldens.insert(source.clone(), Arc::new(g));
        }
        let oracle = load_oracle(&spec)?;
        let p = prompt::resolve(&spec, &model, &config, &goldens)?;
        prompt::check_references(&spec, &model, &config, &goldens, oracle.as_ref(), &p.ids)?;

        let env = spec.rule_env();
        // A `next_token` check's goldens, as a stage golden, must be there
        // to run (a spec naming a folder not recorded yet still loads, so
        // that `goldens regen` can record it).
        for (_, folder) in spec.run_checks.iter().filter_map(|r| r.next_token_files(&env.dir)) {
            if !folder.is_dir() {
                return Err(Error::golden(
                    &folder,
                    format!(
                        "no such folder of next-token goldens (the spec's `next_token.goldens`): record them with \
                         `touchstone goldens regen {}`, review, then `touchstone goldens accept {0}`",
                        spec.path.display()
                    ),
                ));
            }
        }
        let run_checks: Vec<Arc<dyn RunCheck>> = spec.run_checks.iter().map(|r| r.expand(&env)).collect();
        check_context(&spec, &config, &p.ids, p.decode_steps, &run_checks)?;
        // The spec's storage dtype; `touchstone run --storage` overrides it.
        let load_options = LoadOptions {
            storage: spec.storage,
            config: spec.config.clone(),
            ..LoadOptions::default()
        };
        let file = FileTensors::new(&model, &config);
        let facts = Facts {
            model: &model,
            config: &config,
            file: &file,
            prompt: &p.ids,
            image: p.image.as_ref(),
            decode_steps: p.decode_steps,
            forced: p.forced.as_deref(),
            seed: spec.seed,
            sampling: &spec.sampling,
            storage: load_options.storage,
            arithmetic: Arithmetic::of_storage(load_options.storage),
            goldens: &goldens,
            oracle: oracle.as_deref(),
            tolerance: &spec.tolerance,
            scaled: &spec.scaled,
            memo: None,
            shared: None,
        };
        let mut checks = stages::plan(&spec, &facts)?;
        let rules = spec.reference_rules.iter().map(|(source, rule)| {
            Arc::new(crate::checks::run::reference_rule::ReferenceRuleCheck {
                source: source.clone(),
                from_position: rule.from_position,
                rule: rule.rule.clone(),
            }) as Arc<dyn RunCheck>
        });
        for rc in run_checks.into_iter().chain(rules) {
            let id = format!("run::{}", rc.id());
            if checks.iter().any(|c| c.id == id) {
                return Err(Error::SpecInvalid {
                    path: spec.path.clone(),
                    msg: format!("run check `{}` is listed twice", rc.id()),
                });
            }
            checks.push(CheckInstance {
                id,
                target: Target::Run,
                kind: CheckKind::Run(rc),
            });
        }
        Ok(Plan {
            spec,
            model,
            config,
            file,
            load_options,
            goldens,
            oracle,
            prompt: p.ids,
            decode_steps: p.decode_steps,
            forced: p.forced,
            image: p.image,
            checks,
            memo: Memo::default(),
        })
    }

    /// What the checks judge against: a view of this plan.
    pub fn facts(&self) -> Facts<'_> {
        Facts {
            model: &self.model,
            config: &self.config,
            file: &self.file,
            prompt: &self.prompt,
            image: self.image.as_ref(),
            decode_steps: self.decode_steps,
            forced: self.forced.as_deref(),
            seed: self.spec.seed,
            sampling: &self.spec.sampling,
            storage: self.load_options.storage,
            arithmetic: Arithmetic::of_storage(self.load_options.storage),
            goldens: &self.goldens,
            oracle: self.oracle.as_deref(),
            tolerance: &self.spec.tolerance,
            scaled: &self.spec.scaled,
            memo: None,
            shared: Some(&self.memo),
        }
    }

    /// Tokens in a step and KV positions after it: (T, S).
    pub fn step_dims(&self, step: Step) -> (usize, usize) {
        self.facts().step_dims(step)
    }

    /// The sampling of the main run.
    pub fn sampling(&self) -> Sampling {
        self.spec.sampling.clone()
    }
}

/// The spec's `oracle:`, which must be a float64 recording.
fn load_oracle(spec: &Spec) -> Result<Option<Arc<GoldenSet>>> {
    let Some(path) = &spec.oracle else { return Ok(None) };
    let g = GoldenSet::load(ORACLE, path)?;
    let dtype = g.provenance.get("dtype").and_then(|v| v.as_str()).unwrap_or("unknown");
    if dtype != "float64" {
        return Err(Error::SpecInvalid {
            path: spec.path.clone(),
            msg: format!(
                "oracle {} was recorded in {dtype}, not float64 (provenance `dtype`): an oracle must be the float64 \
                 forward pass (`record_hf.py --dtype float64`) to measure f32 errors against",
                path.display()
            ),
        });
    }
    Ok(Some(Arc::new(g)))
}

/// Every run the checks make must fit the model's context (and a sliding
/// window in force): steps beyond it compute nothing faithful.
fn check_context(
    spec: &Spec,
    config: &ModelConfig,
    prompt: &[u32],
    decode_steps: usize,
    run_checks: &[Arc<dyn RunCheck>],
) -> Result<()> {
    let invalid = |msg: String| Error::SpecInvalid {
        path: spec.path.clone(),
        msg,
    };
    let mut runs = vec![("the prompt plus prompt.decode_steps", decode_steps)];
    runs.extend(run_checks.iter().filter_map(|rc| rc.steps(decode_steps)));
    for (what, steps) in runs {
        let total = prompt.len() + steps;
        if let Some(ctx) = config.context_length.filter(|&c| total > c) {
            return Err(invalid(format!(
                "{what} reach {total} positions ({} + {steps}), but the model's context is {ctx} positions \
                 (max_position_embeddings / context_length)",
                prompt.len()
            )));
        }
        if let Some(why) = config.unfaithful_beyond(total) {
            return Err(invalid(why));
        }
    }
    Ok(())
}
