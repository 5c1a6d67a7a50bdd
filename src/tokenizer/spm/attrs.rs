//! Token attributes as llama.cpp derives them when it loads a vocabulary
//! (`llama_vocab::impl::load` in the pinned llama-vocab.cpp). The GGUF's
//! `token_type` is only the start: llama.cpp then makes some tokens control
//! tokens by their text (end-of-generation and fill-in-the-middle markers a
//! converter left NORMAL), turns a few back (gpt-oss, Gemma 4), and gives
//! Phi-3's special tokens `rstrip`. Which tokens are control or user-defined
//! decides what the special-token partition cuts out of a prompt, so these
//! rules change ids, not just names.

use std::collections::HashMap;

use super::super::meta::{TYPE_BYTE, TYPE_CONTROL, TYPE_NORMAL, TYPE_UNKNOWN, TYPE_UNUSED, TYPE_USER_DEFINED};

/// `llama_token_attr` bits (only those the tokenizer reads).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub(crate) struct Attr(u16);

impl Attr {
    pub const UNDEFINED: Attr = Attr(0);
    pub const UNKNOWN: Attr = Attr(1 << 0);
    pub const UNUSED: Attr = Attr(1 << 1);
    pub const NORMAL: Attr = Attr(1 << 2);
    pub const CONTROL: Attr = Attr(1 << 3);
    pub const USER_DEFINED: Attr = Attr(1 << 4);
    pub const BYTE: Attr = Attr(1 << 5);
    pub const RSTRIP: Attr = Attr(1 << 8);

    /// Any of `other`'s bits set.
    pub fn has(self, other: Attr) -> bool {
        self.0 & other.0 != 0
    }
    fn with(self, other: Attr) -> Attr {
        Attr(self.0 | other.0)
    }
    /// Matched in the text before tokenising (`cache_special_tokens`).
    pub fn is_special(self) -> bool {
        self.has(Attr(Self::CONTROL.0 | Self::USER_DEFINED.0 | Self::UNKNOWN.0))
    }

    /// The attribute of a GGUF token type; an unknown type is UNDEFINED, as
    /// in llama.cpp (such a token decodes to nothing).
    pub fn from_type(t: i64) -> Attr {
        match t {
            TYPE_UNKNOWN => Self::UNKNOWN,
            TYPE_UNUSED => Self::UNUSED,
            TYPE_NORMAL => Self::NORMAL,
            TYPE_CONTROL => Self::CONTROL,
            TYPE_USER_DEFINED => Self::USER_DEFINED,
            TYPE_BYTE => Self::BYTE,
            _ => Self::UNDEFINED,
        }
    }
}

/// End-of-generation texts: llama.cpp makes each of these a control token
/// whatever its type (the `special_eog_ids` loop; its end-of-turn and
/// end-of-message lists are subsets of this one).
const EOG_TEXTS: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "<|flush|>",
    "<|calls|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "</s>",
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "[EOS]",
    "<|end_of_text|>",
    "<end_of_utterance>",
    "<eos>",
    "<turn|>",
    "<|tool_response>",
    "<｜end▁of▁sentence｜>",
    "[e~[",
];

/// Fill-in-the-middle markers by role, with the metadata keys that name the
/// role's token: without any of them llama.cpp takes a token with one of
/// these texts as that role's token and makes it a control token.
const FIM: &[(&[&str], &[&str])] = &[
    (
        &["tokenizer.ggml.fim_pre_token_id", "tokenizer.ggml.prefix_token_id"],
        &[
            "<|fim_prefix|>",
            "<fim-prefix>",
            "<fim_prefix>",
            "<｜fim▁begin｜>",
            "<PRE>",
            "▁<PRE>",
            "<|code_prefix|>",
            "<|prefix|>",
        ],
    ),
    (
        &["tokenizer.ggml.fim_suf_token_id", "tokenizer.ggml.suffix_token_id"],
        &[
            "<|fim_suffix|>",
            "<fim-suffix>",
            "<fim_suffix>",
            "<｜fim▁hole｜>",
            "<SUF>",
            "▁<SUF>",
            "<|code_suffix|>",
            "<|suffix|>",
        ],
    ),
    (
        &["tokenizer.ggml.fim_mid_token_id", "tokenizer.ggml.middle_token_id"],
        &[
            "<|fim_middle|>",
            "<fim-middle>",
            "<fim_middle>",
            "<｜fim▁end｜>",
            "<MID>",
            "▁<MID>",
            "<|code_middle|>",
            "<|middle|>",
        ],
    ),
    (
        &["tokenizer.ggml.fim_pad_token_id"],
        &["<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"],
    ),
    (
        &["tokenizer.ggml.fim_rep_token_id"],
        &["<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"],
    ),
    (&["tokenizer.ggml.fim_sep_token_id"], &["<|file_sep|>"]),
];

/// gpt-oss's markers, which llama.cpp always renders (USER_DEFINED, not control).
const ALWAYS_USER_DEFINED: &[&str] = &["<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"];

/// What the rules read besides the tokens.
pub(super) struct Context<'a> {
    /// Whether the GGUF has this metadata key.
    pub has_key: &'a dyn Fn(&str) -> bool,
    /// `general.name`, for the per-model rules.
    pub model_name: Option<&'a str>,
    /// The EOS token's text, if any.
    pub eos_text: Option<&'a str>,
}

/// The attributes of the tokens (by id) from their GGUF `types`, after
/// llama.cpp's rules by text; `ids` is the text-to-id map (llama.cpp's
/// `token_to_id`: a text's last id). (llama.cpp also marks control tokens
/// named `unused` UNUSED: that changes neither ids nor decoded text, so it
/// is not done here.)
pub(super) fn derive(types: &[i64], ids: &HashMap<String, u32>, ctx: &Context) -> Vec<Attr> {
    let mut attrs: Vec<Attr> = types.iter().map(|&t| Attr::from_type(t)).collect();
    let id_of = |text: &str| ids.get(text).map(|&i| i as usize);
    let force = |attrs: &mut Vec<Attr>, text: &str| {
        if let Some(i) = id_of(text) {
            attrs[i] = attrs[i].with(Attr::CONTROL);
        }
    };
    for (keys, texts) in FIM {
        if !keys.iter().any(|k| (ctx.has_key)(k)) {
            // (llama.cpp takes one of them, the first its hash map yields:
            // a vocabulary with two candidates for one role is not pinned down.)
            for text in *texts {
                force(&mut attrs, text);
            }
        }
    }
    for text in EOG_TEXTS {
        force(&mut attrs, text);
    }
    for text in ALWAYS_USER_DEFINED {
        if let Some(i) = id_of(text) {
            attrs[i] = Attr::USER_DEFINED;
        }
    }
    // o200k_harmony / solar-open: `<|end|>` ends a message, not generation.
    let has = |text: &str| id_of(text).is_some();
    if has("<|end|>") && ((has("<|return|>") && has("<|call|>")) || (has("<|calls|>") && has("<|flush|>"))) {
        if let Some(i) = id_of("<|end|>") {
            attrs[i] = Attr::USER_DEFINED;
        }
    }
    // Gemma 4 and PLaMo: `</s>` is a normal token beside their own end marker.
    if has("<|tool_response>") || ctx.eos_text == Some("<|plamo:eos|>") {
        if let Some(i) = id_of("</s>") {
            attrs[i] = Attr::NORMAL;
        }
    }
    // Phi-3: special tokens swallow the whitespace after them, except these.
    let name = ctx.model_name.unwrap_or_default().to_lowercase();
    if name.contains("phi-3") || name.contains("phi3") {
        for a in attrs.iter_mut().filter(|a| a.is_special()) {
            *a = a.with(Attr::RSTRIP);
        }
        if let Some(i) = id_of("</s>") {
            attrs[i] = attrs[i].with(Attr::RSTRIP);
        }
        for text in ["<unk>", "<s>", "<|endoftext|>"] {
            if let Some(i) = id_of(text) {
                attrs[i] = Attr(attrs[i].0 & !Attr::RSTRIP.0);
            }
        }
    }
    attrs
}
