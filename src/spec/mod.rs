//! Specs: YAML files that say, per stage, what must hold, plus checks on whole
//! runs. Parsing (`parse`) rejects unknown keys, unknown stage and check names
//! (with a suggestion) and reports every problem as
//! `file:line:col: key.path: message`; cross-references serde cannot see are
//! checked after (`validate`). Paths inside a spec are relative to the spec
//! file. The check vocabulary itself lives in `checks`; `rules` reads it.

pub mod limits;
mod parse;
mod renamed;
pub mod rules;
mod validate;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde::Deserialize;

pub use crate::stage::pattern::{StagePattern, StageTemplate};
pub use rules::{RuleItem, RunItem};

use crate::checks::kind::{RuleEnv, RunRule};
use crate::checks::params::TolSpec;
use crate::checks::scaled::ScaledSpec;
use crate::engine::registry::{Declared, EngineDecl};
use crate::error::{Error, Result};
use crate::sampling::Sampling;
use crate::tensor::DType;

/// A parsed, validated spec with paths resolved against the spec's folder.
#[derive(Clone, Debug)]
pub struct Spec {
    pub path: PathBuf,
    /// Display name (default: the file stem), used in trial ids.
    pub name: String,
    pub model: PathBuf,
    /// The name after `cache:` when the spec's model lives in touchstone's
    /// cache (`crate::model::cache`), for the "how to fetch it" hint.
    pub cached_model: Option<String>,
    /// Golden source name (`hf`, `llama.cpp`, ...) → golden file.
    pub goldens: BTreeMap<String, PathBuf>,
    /// A float64 recording of the same model, prompt and steps (`oracle:`):
    /// the exact answer every reference and the engine are measured against.
    /// With it, golden checks without explicit atol/rtol use `scaled`.
    pub oracle: Option<PathBuf>,
    /// The scaled tolerance policy's parameters (`scaled:`).
    pub scaled: ScaledSpec,
    pub prompt: PromptSpec,
    pub sampling: Sampling,
    pub seed: u64,
    /// The storage dtype engines run in (`storage:`, default f32): weights and
    /// stage outputs rounded to it, all arithmetic in f32. `--storage` overrides it.
    pub storage: DType,
    /// Per-dtype default golden tolerances overriding the built-in ones.
    pub tolerance: BTreeMap<DType, TolSpec>,
    /// Stage rules in file order; for the same check on the same stage a later
    /// rule replaces an earlier one, so write general rules (`*`) first.
    pub stages: Vec<(StagePattern, Vec<RuleItem>)>,
    pub run_checks: Vec<Arc<dyn RunRule>>,
    /// What `goldens regen` records (default: every step and stage, all rows).
    pub record: RecordSpec,
    /// Engines this spec can run besides the built-in ones (`engines:`):
    /// programs speaking the subprocess protocol, by name.
    pub engines: BTreeMap<String, EngineDecl>,
    /// An engine's own tensor names → canonical stages (`names:`), for
    /// protocol output and dumps.
    pub names: crate::engine::names::NameMap,
    /// Whether `--engine all` (and so `cargo test`'s conformance trials)
    /// includes `cuda-emu`, the CUDA engine on the emulated device (`emulate:`,
    /// default true). A model too large to emulate in CI time says `false`;
    /// `--engine cuda-emu` still runs it.
    pub emulate: bool,
    /// `config:`: HF config keys that replace the model's own (e.g. Qwen's
    /// documented YaRN `rope_scaling`), as its users override them. The
    /// engines, the recorders (`--config-override`) and the goldens'
    /// provenance (`config_override`) all see the same override.
    pub config: Option<serde_json::Value>,
    /// `reference_rules`: golden sources that compute by another rule than
    /// the config's from a position on (llama.cpp without Qwen2's sliding
    /// window, YaRN always truncated, LongRoPE's factors by the context).
    /// Such a golden is judged only before that position; beyond it the
    /// difference is measured and must be seen (`run::reference_rule:<src>`).
    pub reference_rules: BTreeMap<String, ReferenceRule>,
}

/// One entry of `reference_rules`.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReferenceRule {
    /// The first position where the reference's rule gives other numbers.
    pub from_position: usize,
    /// What the reference does instead, in words (shown in the report).
    pub rule: String,
}

/// `record:` — a subset of what the recorders write, so that a real model's
/// goldens stay a few MB. Checks are planned only where a golden holds the
/// (step, stage); the logits of a last-row golden are compared on that row.
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RecordSpec {
    /// Steps to record (`prefill`, `decode1`, ...); default all.
    pub steps: Option<Vec<String>>,
    /// Stage patterns to record (`embed`, `blk.0.*`, `logits`); default all.
    pub stages: Option<Vec<String>>,
    /// `all` (default) or `last`: record only the last row of each step's logits.
    #[serde(default)]
    pub logits: LogitsRows,
    /// Token rows to record of every stage with a token axis (`[0, -1]`: the
    /// first and the last; negative rows count from the end); default all.
    /// The engine's tensor is compared with a golden on the golden's rows.
    pub rows: Option<Vec<i64>>,
    /// Stage patterns recorded at one step only, beside `stages`
    /// (`{decode2: ["blk.*.attn_scores"]}`: a long prompt's decode-step
    /// scores, without every step's).
    #[serde(default)]
    pub stages_at: std::collections::BTreeMap<String, Vec<String>>,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LogitsRows {
    #[default]
    All,
    Last,
}

impl LogitsRows {
    pub fn as_str(self) -> &'static str {
        match self {
            LogitsRows::All => "all",
            LogitsRows::Last => "last",
        }
    }
}

#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PromptSpec {
    /// Explicit prompt token ids.
    pub tokens: Option<Vec<u32>>,
    /// Prompt text, tokenised with the model's own tokenizer (`tokenizer.json`
    /// beside the weights, or a GGUF's vocabulary and merges).
    pub text: Option<String>,
    /// Wrap `text` in the model's chat template as one user message followed
    /// by the assistant's generation prompt (the model must have a template).
    #[serde(default)]
    pub chat: bool,
    /// Take the prompt, and the tokens fed at each decode step (teacher forcing),
    /// from this golden source's recording.
    pub golden: Option<String>,
    /// Decode steps after the prefill (default: as many as the golden recorded).
    pub decode_steps: Option<usize>,
    /// A vision-language model's image (a PNG, relative to the spec): its
    /// features replace the `<|image_pad|>` of `text`, which the processor
    /// expands to the image's token count.
    pub image: Option<std::path::PathBuf>,
}

impl Spec {
    pub fn load(path: &Path) -> Result<Spec> {
        let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
        Spec::parse(path, &text)
    }

    /// Parses spec text; `path` names the file in errors and anchors relative paths.
    pub fn parse(path: &Path, text: &str) -> Result<Spec> {
        parse::parse(path, text)
    }

    /// The engines this spec declares, for `EngineSel::resolve`.
    pub fn declared(&self) -> Declared<'_> {
        Declared {
            engines: &self.engines,
            dir: self.path.parent().unwrap_or(Path::new("")),
            emulate: self.emulate,
            spec_path: &self.path,
        }
    }

    /// What check rules see of the spec: its golden sources and whether it has an oracle.
    pub fn rule_env(&self) -> RuleEnv {
        RuleEnv {
            goldens: self.goldens.keys().cloned().collect(),
            has_oracle: self.oracle.is_some(),
            layers: None,
            post_norms: false,
            vlm_deepstack: None,
            vision_pos_embed: false,
            llava_feature_layer: None,
            routed_shared: Vec::new(),
            routed: Vec::new(),
            attn_sinks: false,
            dir: self.path.parent().unwrap_or(Path::new("")).to_path_buf(),
        }
    }
}

#[cfg(test)]
mod tests;
