//! What `goldens regen` records, as planned by `jobs()` and run by `regen`:
//! one golden (`GoldenRef`), the model it is recorded from, the recorder
//! (`Recorder`: HF, HF at 16 bits, llama.cpp, the float64 oracle, or one
//! source of a `next_token` folder) and what the spec asks of it
//! (`RecordArgs`).

use std::path::PathBuf;

use super::pending::GoldenRef;
use crate::golden::ORACLE;

/// Which recorders to run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Recorder {
    Hf,
    /// HF transformers with the weights cast to a 16-bit dtype (`hf-bf16`,
    /// `hf-f16`): a reference of a GPU engine's arithmetic, fed the `hf`
    /// golden's tokens (teacher forcing), since a 16-bit greedy pick may
    /// differ from the f32 one and every source must see the same inputs.
    HfHalf(Half),
    LlamaCpp,
    /// HF transformers in float64: the spec's `oracle:`.
    Oracle,
    /// record_next_token.py: one source's file of a `next_token` check's
    /// folder of goldens.
    NextToken(NtSource),
}

/// The 16-bit dtype of an `hf-bf16` / `hf-f16` golden.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Half {
    Bf16,
    F16,
}

impl Half {
    /// record_hf.py's `--dtype` value.
    pub(super) fn torch_name(self) -> &'static str {
        match self {
            Half::Bf16 => "bfloat16",
            Half::F16 => "float16",
        }
    }
}

impl Recorder {
    /// The recorder for a golden source name as specs spell it.
    pub fn for_source(source: &str) -> Option<Recorder> {
        match source {
            "hf" => Some(Recorder::Hf),
            "hf-bf16" => Some(Recorder::HfHalf(Half::Bf16)),
            "hf-f16" => Some(Recorder::HfHalf(Half::F16)),
            "llama.cpp" | "llamacpp" | "llama_cpp" => Some(Recorder::LlamaCpp),
            ORACLE => Some(Recorder::Oracle),
            _ => None,
        }
    }
    /// The recorder scripts a job runs (any of them missing: regen refuses).
    pub(super) fn scripts(self) -> &'static [&'static str] {
        match self {
            Recorder::Hf | Recorder::HfHalf(_) | Recorder::Oracle => &["record_hf.py"],
            Recorder::LlamaCpp => &["convert_gguf.py", "record_llamacpp.py"],
            Recorder::NextToken(NtSource::LlamaCpp) => &["convert_gguf.py", "record_next_token.py"],
            Recorder::NextToken(_) => &["record_next_token.py"],
        }
    }
    /// The recording order: the stage HF goldens first (the 16-bit HF and
    /// llama.cpp ones are fed their tokens), then the other stage goldens,
    /// then next-token goldens in regen.sh's order (the oracle, `hf`
    /// measured against it, then the sources fed `hf`'s tokens).
    pub(super) fn order(self) -> u8 {
        match self {
            Recorder::Hf => 0,
            Recorder::Oracle => 1,
            Recorder::HfHalf(_) | Recorder::LlamaCpp => 2,
            Recorder::NextToken(s) => 3 + s.rank(),
        }
    }
}

/// What a spec asks the recorders to record (its `prompt:` and `record:`).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RecordArgs {
    /// The spec's `config:` override as JSON (`--config-override`): every
    /// recorder applies it to the model's config before it computes.
    pub config_override: Option<String>,
    /// `prompt.tokens`: the ids recorded exactly as given.
    pub tokens: Option<Vec<u32>>,
    /// `prompt.text`; without it (and without `tokens`) the current golden's
    /// prompt is recorded again.
    pub prompt: Option<String>,
    /// `prompt.chat`: render the text with the model's chat template.
    pub chat: bool,
    /// `prompt.decode_steps`; without it the current golden's count.
    pub decode_steps: Option<usize>,
    /// `prompt.image`: a vision-language spec, recorded by record_vlm.py.
    pub image: Option<PathBuf>,
    /// `record.steps` (default: every step).
    pub steps: Option<Vec<String>>,
    /// `record.stages` patterns (default: every stage).
    pub stages: Option<Vec<String>>,
    /// `record.stages_at`: step → stage patterns recorded there only.
    pub stages_at: std::collections::BTreeMap<String, Vec<String>>,
    /// `record.logits: last`: only the last row of each step's logits.
    pub logits_last: bool,
    /// `record.rows`: the token rows kept of every stage.
    pub rows: Option<Vec<i64>>,
    /// The K/V cache type llama.cpp records with (`f16` where the spec's
    /// arithmetic for that source says kv f16; else f32, closest to HF).
    pub kv_f16: bool,
    /// `TEMPERATURE,TOP_K,TOP_P` of a spec with random sampling: the HF
    /// recorders also record `sample_probs` with HF's logits processors.
    pub sample_probs: Option<String>,
    /// The spec's `hf` golden: the token ids a llama.cpp recording is fed
    /// when no HF golden is recorded in the same run.
    pub hf_golden: Option<PathBuf>,
    /// The spec's `oracle:`: where a 16-bit HF recording that overflows
    /// reads the exact answer's magnitude, when none is recorded in the run.
    pub oracle: Option<PathBuf>,
    /// A next-token job's prompt set (the `next_token` item's `prompts:`).
    pub prompt_set: Option<PathBuf>,
    /// llama.cpp's arithmetic as the spec declares it, as JSON (a next-token
    /// recording of a quantised GGUF needs it).
    pub arithmetic: Option<String>,
}

/// A golden to regenerate: the ref plus the model it is recorded from.
#[derive(Clone, Debug)]
pub struct Job {
    pub golden: GoldenRef,
    pub model: PathBuf,
    pub recorder: Recorder,
    pub args: RecordArgs,
}

/// One source of a next-token golden folder.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NtSource {
    /// HF in float64: recorded first, every other source is measured against it.
    Oracle,
    /// HF in float32: tokenises as the oracle does; the 16-bit HF sources and
    /// llama.cpp are fed its tokens.
    Hf,
    HfHalf(Half),
    LlamaCpp,
}

impl NtSource {
    /// Every source, in recording order (as regen.sh records them).
    pub const ALL: [NtSource; 5] = [
        NtSource::Oracle,
        NtSource::Hf,
        NtSource::HfHalf(Half::Bf16),
        NtSource::HfHalf(Half::F16),
        NtSource::LlamaCpp,
    ];

    /// record_next_token.py's `--source`, and the golden source name.
    pub fn name(self) -> &'static str {
        match self {
            NtSource::Oracle => ORACLE,
            NtSource::Hf => "hf",
            NtSource::HfHalf(Half::Bf16) => "hf-bf16",
            NtSource::HfHalf(Half::F16) => "hf-f16",
            NtSource::LlamaCpp => "llama.cpp",
        }
    }

    /// Its file in the golden folder.
    pub fn file(self) -> &'static str {
        match self {
            NtSource::Oracle => "oracle.safetensors",
            NtSource::Hf => "hf.safetensors",
            NtSource::HfHalf(Half::Bf16) => "hf-bf16.safetensors",
            NtSource::HfHalf(Half::F16) => "hf-f16.safetensors",
            NtSource::LlamaCpp => "llamacpp.safetensors",
        }
    }

    /// Its place in the recording order.
    pub fn rank(self) -> u8 {
        NtSource::ALL.iter().position(|s| *s == self).unwrap_or(0) as u8
    }
}
