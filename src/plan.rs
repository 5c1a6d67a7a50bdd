//! A plan: a spec expanded against its model into concrete check instances, one
//! per (step, stage, check) plus the run checks, each with its canonical id
//! (`prefill/blk.0.attn_probs::softmax_rows`, `run::determinism`). Building a plan
//! reads the model's config and the golden files, so every reference the spec
//! makes is resolved before any engine runs.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::error::{Error, Result};
use crate::golden::GoldenSet;
use crate::model::{self, LoadOptions, ModelConfig};
use crate::spec::{RunCheck, Spec, StageCheck};
use crate::stage::shape::canonical_shape;
use crate::stage::{BlockStage, Stage, Step};

/// The source name of the spec's `oracle:` in check ids and messages.
pub const ORACLE: &str = "oracle";

#[derive(Clone, Debug, PartialEq)]
pub enum Target {
    Stage { step: Step, stage: Stage },
    Run,
}

/// A stage check with every default resolved.
#[derive(Clone, Debug, PartialEq)]
pub enum StageCheckKind {
    Finite,
    Shape,
    SoftmaxRows {
        tol: f64,
    },
    Causal,
    Rope {
        input: Stage,
        style: crate::stage::RopeStyle,
        tol: f64,
    },
    Golden {
        source: String,
        atol: Option<f64>,
        rtol: Option<f64>,
    },
    /// Golden `other` compared with golden `base` (no engine involved).
    ReferencesAgree {
        base: String,
        other: String,
        atol: Option<f64>,
        rtol: Option<f64>,
    },
}

#[derive(Clone, Debug, PartialEq)]
pub enum CheckKind {
    Stage(StageCheckKind),
    Run(RunCheck),
}

#[derive(Clone, Debug, PartialEq)]
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
}

#[derive(Debug)]
pub struct Plan {
    pub spec: Spec,
    /// The model the plan runs (the spec's, or `--model`).
    pub model: PathBuf,
    pub config: ModelConfig,
    /// How engines load the model (default: faithfully; see `LoadOptions`).
    pub load_options: LoadOptions,
    pub goldens: BTreeMap<String, Arc<GoldenSet>>,
    /// The spec's `oracle:` (float64 recording), checked to be one.
    pub oracle: Option<Arc<GoldenSet>>,
    pub prompt: Vec<u32>,
    pub decode_steps: usize,
    /// Tokens fed at decode steps (teacher forcing) when the prompt comes from a golden.
    pub forced: Option<Vec<u32>>,
    pub checks: Vec<CheckInstance>,
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
        let config = model::read_config(&model)?;
        let mut goldens = BTreeMap::new();
        for (source, path) in &spec.goldens {
            goldens.insert(source.clone(), Arc::new(GoldenSet::load(source, path)?));
        }
        let invalid = |msg: String| Error::SpecInvalid {
            path: spec.path.clone(),
            msg,
        };
        let oracle = match &spec.oracle {
            None => None,
            Some(path) => {
                let g = GoldenSet::load(ORACLE, path)?;
                let dtype = g.provenance.get("dtype").and_then(|v| v.as_str()).unwrap_or("unknown");
                if dtype != "float64" {
                    return Err(invalid(format!(
                        "oracle {} was recorded in {dtype}, not float64 (provenance `dtype`): an oracle must be \
                         the float64 forward pass (`record_hf.py --dtype float64`) to measure f32 errors against",
                        path.display()
                    )));
                }
                Some(Arc::new(g))
            }
        };

        // Text is tokenised with the model's own tokenizer; with a golden too,
        // it must give the golden's prompt (checked below), so the text is
        // what a reader sees and the ids are what is compared.
        let text_ids = match &spec.prompt.text {
            Some(text) => Some(crate::tokenizer::encode_prompt(&model, text, spec.prompt.chat)?),
            None => None,
        };
        let explicit = spec.prompt.tokens.clone().or(text_ids.clone());
        let (prompt, decode_steps, forced) = match (&explicit, &spec.prompt.golden) {
            (Some(tokens), None) => (tokens.clone(), spec.prompt.decode_steps.unwrap_or(0), None),
            (_, Some(src)) => {
                let g = &goldens[src];
                let recorded = g.decode_steps();
                let n = spec.prompt.decode_steps.unwrap_or(recorded);
                if n > recorded {
                    return Err(invalid(format!(
                        "prompt.decode_steps is {n} but golden `{src}` ({}) recorded only {recorded}",
                        g.path.display()
                    )));
                }
                let forced = g
                    .forced(n)
                    .ok_or_else(|| invalid(format!("golden `{src}` lacks decode-step tokens")))?;
                if let Some(ids) = &text_ids {
                    if ids.as_slice() != g.prompt() {
                        return Err(invalid(format!(
                            "prompt.text tokenises to {} ids {:?}, but golden `{src}` ({}) recorded the prompt {:?}: \
                             the golden was recorded for another text or tokenizer (regenerate it: touchstone goldens \
                             regen {})",
                            ids.len(),
                            ids,
                            g.path.display(),
                            g.prompt(),
                            spec.path.display()
                        )));
                    }
                }
                (g.prompt().to_vec(), n, Some(forced))
            }
            (None, None) => unreachable!("Spec::parse requires text, tokens or golden"),
        };
        // Goldens recorded for another model or prompt: one clear error, not a wall of mismatches.
        // The oracle is held to the same rule: an exact answer for another model is no answer.
        let mut recorded = goldens.clone();
        if let Some(o) = &oracle {
            recorded.insert(ORACLE.to_string(), o.clone());
        }
        crate::golden::provenance::check_fresh(&model, &config, &recorded, spec.prompt.tokens.as_deref())?;
        // ... and it must have been fed the tokens the references were.
        if let Some(o) = &oracle {
            for (src, g) in &goldens {
                for (step, toks) in &o.tokens {
                    if g.tokens.get(step).is_some_and(|t| t != toks) {
                        return Err(invalid(format!(
                            "the oracle ({}) was recorded with tokens {toks:?} at {step}, golden `{src}` ({}) with {:?}: \
                             record both with the same prompt",
                            o.path.display(),
                            g.path.display(),
                            g.tokens[step]
                        )));
                    }
                }
            }
        }
        if let Some(&bad) = prompt.iter().find(|&&t| t as usize >= config.vocab) {
            return Err(invalid(format!(
                "prompt token {bad} is outside the model's vocabulary of {}",
                config.vocab
            )));
        }

        // Every run the checks make must fit the model's context (and a
        // sliding window in force): steps beyond it compute nothing faithful.
        let mut runs = vec![("the prompt plus prompt.decode_steps", decode_steps)];
        for rc in &spec.run_checks {
            match rc {
                RunCheck::Determinism(d) => runs.push(("the prompt plus determinism.decode_steps", d.decode_steps)),
                RunCheck::KvCache(k) => runs.push((
                    "the prompt plus kv_cache.decode_steps",
                    k.decode_steps.unwrap_or(decode_steps),
                )),
                _ => {}
            }
        }
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
        let random = matches!(spec.sampling, crate::spec::SamplingSpec::Random { .. });
        let stages = Stage::of_model(&config, random);
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

        // (stage, check id) -> kind; a later rule replaces an earlier one.
        let mut per_stage: BTreeMap<Stage, Vec<(String, StageCheckKind)>> = BTreeMap::new();
        for (pattern, checks) in &spec.stages {
            for &stage in stages.iter().filter(|s| pattern.matches(**s)) {
                for check in checks {
                    for kind in resolve(check, stage, &spec).map_err(invalid)? {
                        let id = kind.id();
                        let list = per_stage.entry(stage).or_default();
                        match list.iter_mut().find(|(i, _)| *i == id) {
                            Some(slot) => slot.1 = kind,
                            None => list.push((id, kind)),
                        }
                    }
                }
            }
        }
        let mut checks = Vec::new();
        for step in Step::sequence(decode_steps) {
            for (stage, list) in &per_stage {
                for (id, kind) in list {
                    // A single-token step has no future positions: `causal` would
                    // check nothing there, so it is not planned (never a vacuous pass).
                    if *kind == StageCheckKind::Causal && step != Step::Prefill {
                        continue;
                    }
                    // A compact golden (`record:`) plans checks only where it
                    // recorded; a tensor it claims but lacks still fails.
                    let recorded = |src: &str| match src {
                        ORACLE => oracle.as_ref().is_some_and(|o| o.records(step, *stage)),
                        _ => goldens[src].records(step, *stage),
                    };
                    let unrecorded = match kind {
                        StageCheckKind::Golden { source, .. } => !recorded(source),
                        StageCheckKind::ReferencesAgree { base, other, .. } => !recorded(base) || !recorded(other),
                        _ => false,
                    };
                    if unrecorded {
                        continue;
                    }
                    checks.push(CheckInstance {
                        id: format!("{step}/{stage}::{id}"),
                        target: Target::Stage { step, stage: *stage },
                        kind: CheckKind::Stage(kind.clone()),
                    });
                }
            }
        }
        for rc in &spec.run_checks {
            let rc = match rc {
                RunCheck::GreedyTokens { source: None } => RunCheck::GreedyTokens {
                    source: spec.goldens.keys().next().cloned(),
                },
                other => other.clone(),
            };
            let id = format!("run::{}", rc.id());
            if checks.iter().any(|c| c.id == id) {
                return Err(invalid(format!("run check `{}` is listed twice", rc.id())));
            }
            checks.push(CheckInstance {
                id,
                target: Target::Run,
                kind: CheckKind::Run(rc),
            });
        }
        // The spec's storage dtype; `touchstone run --storage` overrides it.
        let load_options = LoadOptions {
            storage: spec.storage,
            ..LoadOptions::default()
        };
        Ok(Plan {
            spec,
            model,
            config,
            load_options,
            goldens,
            oracle,
            prompt,
            decode_steps,
            forced,
            checks,
        })
    }

    /// A golden source by name, the oracle included.
    pub fn source(&self, name: &str) -> Option<&GoldenSet> {
        match name {
            ORACLE => self.oracle.as_deref(),
            _ => self.goldens.get(name).map(|g| g.as_ref()),
        }
    }

    /// Tokens in a step and KV positions after it: (T, S).
    pub fn step_dims(&self, step: Step) -> (usize, usize) {
        let p = self.prompt.len();
        match step {
            Step::Prefill => (p, p),
            Step::Decode(n) => (1, p + n),
        }
    }

    /// The canonical shape of a stage at a step (DESIGN.md's table).
    pub fn expected_shape(&self, step: Step, stage: Stage) -> Vec<usize> {
        let (t, s) = self.step_dims(step);
        canonical_shape(&self.config, stage, t, s)
    }

    /// Absolute positions processed by a step.
    pub fn positions(&self, step: Step) -> Vec<usize> {
        let (t, s) = self.step_dims(step);
        (s - t..s).collect()
    }
}

impl StageCheckKind {
    /// The check's name in ids; golden checks carry their source (`golden:hf`),
    /// so two sources are two checks.
    pub fn id(&self) -> String {
        match self {
            StageCheckKind::Finite => "finite".into(),
            StageCheckKind::Shape => "shape".into(),
            StageCheckKind::SoftmaxRows { .. } => "softmax_rows".into(),
            StageCheckKind::Causal => "causal".into(),
            StageCheckKind::Rope { .. } => "rope".into(),
            StageCheckKind::Golden { source, .. } => format!("golden:{source}"),
            StageCheckKind::ReferencesAgree { base, other, .. } => format!("references_agree:{base}~{other}"),
        }
    }
}

/// Resolves a spec check for one stage: `golden` without a source becomes one
/// check per declared source; `rope` without an input reads the pre-RoPE stage.
fn resolve(check: &StageCheck, stage: Stage, spec: &Spec) -> std::result::Result<Vec<StageCheckKind>, String> {
    Ok(match check {
        StageCheck::Finite => vec![StageCheckKind::Finite],
        StageCheck::Shape => vec![StageCheckKind::Shape],
        StageCheck::SoftmaxRows { tol } => vec![StageCheckKind::SoftmaxRows { tol: *tol }],
        StageCheck::Causal => {
            if !matches!(stage, Stage::Block(_, BlockStage::AttnProbs)) {
                return Err(format!("`causal` applies to blk.*.attn_probs, not `{stage}`"));
            }
            vec![StageCheckKind::Causal]
        }
        StageCheck::Rope { input, style, tol } => {
            let input = match (input, stage) {
                (Some(t), Stage::Block(l, _)) => t
                    .resolve(l)
                    .ok_or_else(|| format!("rope input `{}` does not resolve for layer {l}", t.as_str()))?,
                (None, Stage::Block(l, BlockStage::QRope)) => Stage::Block(l, BlockStage::Q),
                (None, Stage::Block(l, BlockStage::KRope)) => Stage::Block(l, BlockStage::K),
                _ => {
                    return Err(format!(
                        "`rope` on `{stage}` needs `input:` (the pre-RoPE stage, e.g. `blk.{{i}}.q`)"
                    ))
                }
            };
            vec![StageCheckKind::Rope {
                input,
                style: *style,
                tol: *tol,
            }]
        }
        StageCheck::ReferencesAgree { atol, rtol } if spec.oracle.is_some() => {
            // With an oracle, each reference is measured against the exact answer.
            if spec.goldens.is_empty() {
                return Err("`references_agree` needs a golden source besides the oracle".into());
            }
            spec.goldens
                .keys()
                .map(|other| StageCheckKind::ReferencesAgree {
                    base: ORACLE.to_string(),
                    other: other.clone(),
                    atol: *atol,
                    rtol: *rtol,
                })
                .collect()
        }
        StageCheck::ReferencesAgree { atol, rtol } => {
            // Every other source against the first (sources sort by name).
            let mut sources = spec.goldens.keys();
            let base = sources
                .next()
                .ok_or("`references_agree` needs two golden sources; the spec declares none")?;
            let others: Vec<StageCheckKind> = sources
                .map(|other| StageCheckKind::ReferencesAgree {
                    base: base.clone(),
                    other: other.clone(),
                    atol: *atol,
                    rtol: *rtol,
                })
                .collect();
            if others.is_empty() {
                return Err(format!(
                    "`references_agree` needs two golden sources; the spec declares only `{base}`"
                ));
            }
            others
        }
        StageCheck::Golden { source, atol, rtol } => {
            let sources: Vec<String> = match source {
                Some(s) => vec![s.clone()],
                None => spec.goldens.keys().cloned().collect(),
            };
            sources
                .into_iter()
                .map(|source| StageCheckKind::Golden {
                    source,
                    atol: *atol,
                    rtol: *rtol,
                })
                .collect()
        }
    })
}
