//! The shape of a check kind. A kind is one type in one file (`stage/`,
//! `run/`) registered by one line in its table: it says how the spec writes
//! it (`Kind`), what it plans (`StageRule`/`RunRule`: one check instance per
//! golden source, say) and how each instance judges (`StageCheck`/`RunCheck`:
//! its id, family, error metric, the stages it taps, its verdict).

use std::fmt::Debug;
use std::sync::Arc;

use serde::de::Deserializer;

use super::facts::Facts;
use super::family::{Family, Metric};
use super::verdict::Verdict;
use crate::engine::{Engine, RunOutput};
use crate::stage::{Stage, Step};
use crate::tensor::Tensor;

/// How the spec writes a kind: its name, bare (`- finite`) or with a value
/// (`- {softmax_rows: {tol: 1e-6}}`).
pub trait Kind: Sized + Send + Sync + Debug + 'static {
    /// The name in specs, and the first part of every instance's id.
    const NAME: &'static str;
    /// Its parameters and their defaults, as a spec writes them (`touchstone checks`).
    const PARAMS: &'static str;
    /// What must hold for it to pass, in one sentence (`touchstone checks`).
    const ABOUT: &'static str;
    /// The kind written bare: every parameter at its default.
    fn bare() -> Self;
    /// The kind written `{NAME: VALUE}`: VALUE parsed in place, so errors
    /// carry the spec's line:col.
    fn parse<'de, D: Deserializer<'de>>(d: D) -> Result<Self, D::Error>;
    /// What serde cannot check about the parameters (`runs >= 3`, …).
    fn check_params(&self) -> Result<(), String> {
        Ok(())
    }
}

/// What a rule can see of the spec when it is validated or expanded.
#[derive(Clone, Debug, Default)]
pub struct RuleEnv {
    /// The golden sources declared under `goldens:`, sorted.
    pub goldens: Vec<String>,
    /// Whether the spec names a float64 `oracle:`.
    pub has_oracle: bool,
    /// The model's layer count, once a plan knows the model (None while a
    /// spec is validated alone): a check whose input stage depends on it
    /// (`rms_norm` at output_norm reads the last block's `out`) needs it.
    pub layers: Option<usize>,
    /// Whether the model has post norms (Gemma), once a plan knows the
    /// model: its residual adds then sum the normed branches, and its MLP's
    /// input norm is `pre_feedforward_layernorm`.
    pub post_norms: bool,
    /// The spec's folder: paths a rule names are relative to it.
    pub dir: std::path::PathBuf,
    /// A vision-language model, once a plan knows the model: its deepstack
    /// feature count (0 for Qwen2-VL). Block 0 then reads the fused
    /// `inputs_embeds`, and a block followed by a deepstack add hands on
    /// `blk.{i}.deepstack`.
    pub vlm_deepstack: Option<usize>,
    /// A VLM tower with learned position embeddings (Qwen3-VL): vision block 0
    /// reads `vision.pos_embed`, else `vision.patch_embed`.
    pub vision_pos_embed: bool,
    /// LLaVA, once a plan knows the model: the resolved
    /// `vision_feature_layer` (the hidden state `vision.features` copies);
    /// its vision block 0 reads `vision.pre_norm`.
    pub llava_feature_layer: Option<usize>,
    /// Per layer, once a plan knows the model: true where the MLP routes and
    /// has a shared expert, so `ffn_out` = ffn_moe_out + ffn_shexp_out.
    pub routed_shared: Vec<bool>,
    /// Per layer, once a plan knows the model: true where the MLP routes.
    pub routed: Vec<bool>,
    /// The model's attention has sinks (gpt-oss), once a plan knows it: an
    /// `attn_probs` row then sums to 1 less its sink's share.
    pub attn_sinks: bool,
}

/// A problem found in a spec, and the text to locate it by.
#[derive(Clone, Debug, PartialEq)]
pub struct Located {
    pub needle: String,
    pub msg: String,
}

impl RuleEnv {
    /// The residual stream entering block `l` (`l` = layers: the final norm's input).
    pub fn block_input(&self, l: usize) -> Stage {
        match (l, self.vlm_deepstack) {
            (0, Some(_)) => Stage::InputsEmbeds,
            (0, None) => Stage::Embed,
            (l, Some(n)) if l - 1 < n => Stage::Block(l - 1, crate::stage::BlockStage::Deepstack),
            (l, _) => Stage::Block(l - 1, crate::stage::BlockStage::Out),
        }
    }

    /// `source` must be declared; else the message names what named it and
    /// suggests the closest declared source.
    pub fn require_source(&self, what: &str, source: &str) -> Result<(), Located> {
        if self.goldens.iter().any(|g| g == source) {
            return Ok(());
        }
        let hint = crate::suggest::hint(source, self.goldens.iter().map(String::as_str));
        let declared = if self.goldens.is_empty() {
            "none".to_string()
        } else {
            self.goldens.join(", ")
        };
        Err(Located {
            needle: source.to_string(),
            msg: format!(
                "{what} names golden source `{source}`, which is not declared under `goldens:`{hint} (declared: \
                 {declared})"
            ),
        })
    }
}

/// A count a rule asks for, checked against the spec's fixed limit of its kind.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Count {
    /// The key to locate it by (`decode_steps`).
    pub key: &'static str,
    /// What it is, in messages (`determinism.decode_steps`).
    pub what: &'static str,
    pub n: usize,
    pub limit: Limit,
}

/// Which of the spec's limits bounds a count.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Limit {
    DecodeSteps,
    Runs,
}

/// A stage check as the spec writes it, before it meets a stage.
pub trait StageRule: Send + Sync + Debug {
    /// The kind's name (`Kind::NAME`).
    fn kind(&self) -> &'static str;
    /// Cross-references serde cannot see (golden sources it names).
    fn validate(&self, env: &RuleEnv) -> Result<(), Located> {
        let _ = env;
        Ok(())
    }
    /// The check instances this rule plans at `stage` (one per golden source
    /// for a sourceless `golden`), or why it cannot apply there.
    fn expand(&self, stage: Stage, env: &RuleEnv) -> Result<Vec<Arc<dyn StageCheck>>, String>;
}

/// Where a stage check is judged: its step and stage, and the engine's run
/// when the check reads one (`None` for checks on the goldens alone).
#[derive(Clone, Copy)]
pub struct At<'a> {
    pub step: Step,
    pub stage: Stage,
    pub run: Option<&'a RunOutput>,
}

impl<'a> At<'a> {
    /// The engine's capture of `stage` at this step, or the failure saying it
    /// was tapped and not written (and which tensors of an external engine's
    /// output touchstone could not map).
    pub fn capture_of(&self, stage: Stage) -> Result<&'a Tensor, Verdict> {
        let step = self.step;
        let run = self
            .run
            .ok_or_else(|| Verdict::fail(format!("no engine run to read {step}/{stage} from")))?;
        run.captures.get(step, stage).ok_or_else(|| {
            let hint = if run.unmapped.is_empty() {
                String::new()
            } else {
                let shown: Vec<&str> = run.unmapped.iter().take(8).map(String::as_str).collect();
                format!(
                    "; its output holds {} tensor(s) touchstone cannot map ({}{}): name them canonically or map \
                     them with `names:` in the spec",
                    run.unmapped.len(),
                    shown.join(", "),
                    if run.unmapped.len() > shown.len() { ", …" } else { "" }
                )
            };
            Verdict::fail(format!(
                "the engine did not capture {step}/{stage} although it was tapped{hint}"
            ))
        })
    }

    /// The capture of the check's own stage.
    pub fn capture(&self) -> Result<&'a Tensor, Verdict> {
        self.capture_of(self.stage)
    }

    /// Absolute positions the engine processed at this step.
    pub fn positions(&self) -> &'a [usize] {
        self.run.map_or(&[], |r| r.positions[self.step.index()].as_slice())
    }
}

/// One planned check at one (step, stage).
pub trait StageCheck: Send + Sync + Debug {
    /// The check's name in ids (`softmax_rows`, `golden:hf`).
    fn id(&self) -> String;
    fn family(&self) -> Family;
    /// The metric that is this check's error, if it has one.
    fn metric(&self) -> Option<Metric> {
        None
    }
    /// Engine stages to tap for it at `stage`: the stage itself for most, a
    /// second stage for some (RoPE's input), none for a check of the goldens.
    fn reads(&self, stage: Stage) -> Vec<Stage> {
        vec![stage]
    }
    /// Whether the check is planned at (step, stage): a check with nothing to
    /// look at there (a golden that did not record it) is left out, never
    /// passed.
    fn planned(&self, step: Step, stage: Stage, facts: &Facts) -> bool {
        let _ = (step, stage, facts);
        true
    }
    /// The golden sources (the oracle by `ORACLE`) it reads at a stage.
    fn goldens(&self, facts: &Facts) -> Vec<String> {
        let _ = facts;
        self.family().sources().into_iter().map(str::to_string).collect()
    }
    fn judge(&self, facts: &Facts, at: &At) -> Verdict;
}

/// A run check as the spec writes it.
pub trait RunRule: Send + Sync + Debug {
    fn kind(&self) -> &'static str;
    fn validate(&self, env: &RuleEnv) -> Result<(), Located> {
        let _ = env;
        Ok(())
    }
    /// Counts the spec must hold within its fixed limits.
    fn counts(&self) -> Vec<Count> {
        Vec::new()
    }
    /// The check as planned (defaults resolved against the spec).
    fn expand(&self, env: &RuleEnv) -> Arc<dyn RunCheck>;
    /// The prompt set file and the folder of next-token goldens a
    /// `next_token` item names, resolved against the spec's folder `dir`
    /// (what `goldens regen` records from and into); None for other kinds.
    fn next_token_files(&self, dir: &std::path::Path) -> Option<(std::path::PathBuf, std::path::PathBuf)> {
        let _ = dir;
        None
    }
}

/// A planned check on whole runs of the engine.
pub trait RunCheck: Send + Sync + Debug {
    fn id(&self) -> String;
    fn metric(&self) -> Option<Metric> {
        None
    }
    /// The decode steps of the runs it makes beyond the main one, with what
    /// they are called, so the plan can check they fit the model's context.
    fn steps(&self, decode_steps: usize) -> Option<(&'static str, usize)> {
        let _ = decode_steps;
        None
    }
    /// Whether it needs the engine to run more than once (skipped, with the
    /// engine's reason, on one that cannot).
    fn reruns(&self) -> bool {
        false
    }
    fn evaluate(&self, facts: &Facts, engine: &dyn Engine) -> Verdict;
}
