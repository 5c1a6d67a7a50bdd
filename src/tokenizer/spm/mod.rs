//! A SentencePiece GGUF vocabulary (`tokenizer.ggml.model` = `llama`: Llama 2,
//! Mistral v0.1, Gemma, Phi-3, ...) tokenised as llama.cpp does
//! (`llama_vocab::impl::tokenize`, SPM case, in the pinned llama-vocab.cpp):
//!
//! 1. Control, user-defined and unknown tokens written in the text are cut
//!    out first ([`super::partition`]), after llama.cpp's attribute rules
//!    ([`attrs`]).
//! 2. Each remaining piece of text gets a leading space when
//!    `tokenizer.ggml.add_space_prefix` is true (llama.cpp's SPM default;
//!    Gemma 3 says false) and it starts the prompt or follows a special
//!    token; then every space becomes U+2581 (`▁`).
//! 3. The piece is merged by score ([`merge`]); what is no token falls back
//!    to its bytes as `<0xXX>` tokens.
//! 4. BOS is prepended when `add_bos_token` says so (default: yes), EOS
//!    appended when `add_eos_token` does (default: no); their ids are
//!    `bos_token_id`/`eos_token_id`, or llama.cpp's SPM defaults 1 and 2.
//!
//! Decoding is `token_to_piece` with special tokens written out: `▁` is a
//! space again, a byte token its byte, a control/user-defined/unknown token
//! its text, an unused or undefined one nothing.

mod attrs;
mod merge;
#[cfg(test)]
mod tests;

use std::collections::HashMap;

use self::attrs::Attr;
use super::meta::{Meta, TYPES_KEY};
use super::partition::{self, Fragment, Special};
use crate::error::Result;

/// What a space is written as inside SentencePiece tokens.
const SPACE: &str = "\u{2581}";

const SCORES_KEY: &str = "tokenizer.ggml.scores";

/// llama.cpp's BOS and EOS ids for an SPM vocabulary whose GGUF names none.
const DEFAULT_BOS: u32 = 1;
const DEFAULT_EOS: u32 = 2;

/// A loaded SentencePiece vocabulary.
pub(crate) struct Spm {
    /// Token texts by id (an empty one renamed `[EMPTY_<id>]`, as llama.cpp does).
    texts: Vec<String>,
    scores: Vec<f32>,
    attrs: Vec<Attr>,
    /// Text to id; a duplicated text keeps its last id (llama.cpp's `token_to_id`).
    ids: HashMap<String, u32>,
    /// The token of each byte, for the fallback.
    bytes: [Option<u32>; 256],
    /// Cut out of the text before merging, longest first.
    specials: Vec<Special>,
    /// Added in front / at the end by `encode(.., add_special = true)`.
    bos: Option<u32>,
    eos: Option<u32>,
    add_space_prefix: bool,
}

impl merge::Vocab for Spm {
    fn id(&self, text: &str) -> Option<u32> {
        self.ids.get(text).copied()
    }
    fn score(&self, id: u32) -> f32 {
        self.scores[id as usize]
    }
    fn byte(&self, b: u8) -> Option<u32> {
        self.bytes[b as usize]
    }
}

impl Spm {
    /// The vocabulary of a GGUF whose model is `llama` (`tokens` and their
    /// `types` already read). Every malformed key is an error naming it.
    pub(super) fn from_meta(m: &Meta, tokens: &[&str], types: &[i64]) -> Result<Spm> {
        let n = tokens.len();
        let texts: Vec<String> = tokens
            .iter()
            .enumerate()
            .map(|(i, t)| {
                if t.is_empty() {
                    format!("[EMPTY_{i}]")
                } else {
                    t.to_string()
                }
            })
            .collect();
        let scores = read_scores(m, n)?;
        let mut ids = HashMap::with_capacity(n);
        for (i, t) in texts.iter().enumerate() {
            ids.insert(t.clone(), i as u32);
        }

        let bos_id = m.opt_id("tokenizer.ggml.bos_token_id", n)?;
        let eos_id = m.opt_id("tokenizer.ggml.eos_token_id", n)?;
        let eos_text = eos_id
            .or_else(|| default_id(DEFAULT_EOS, n))
            .map(|id| texts[id as usize].as_str());
        let has_key = |k: &str| m.get(k).is_some();
        let model_name = m.opt_string("general.name")?;
        let attrs = attrs::derive(
            types,
            &ids,
            &attrs::Context {
                has_key: &has_key,
                model_name,
                eos_text,
            },
        );

        let mut bytes = [None; 256];
        for (i, (t, a)) in texts.iter().zip(&attrs).enumerate() {
            if a.has(Attr::BYTE) && byte_of(t).is_none() {
                return Err(m.err(format!(
                    "metadata key `{TYPES_KEY}`: token {i} ({t:?}) is a byte token but not written <0xXX>"
                )));
            }
        }
        for (b, slot) in bytes.iter_mut().enumerate() {
            // llama.cpp's `byte_to_token`: `<0xXX>` (upper-case hex), else the
            // byte itself as a one-character token.
            let hex = format!("<0x{b:02X}>");
            let plain = char::from_u32(b as u32).filter(char::is_ascii).map(String::from);
            *slot = ids.get(&hex).or_else(|| plain.and_then(|p| ids.get(&p))).copied();
        }

        let mut specials: Vec<Special> = texts
            .iter()
            .zip(&attrs)
            .enumerate()
            .filter(|(_, (_, a))| a.is_special())
            .map(|(i, (t, a))| Special {
                id: i as u32,
                text: t.clone(),
                rstrip: a.has(Attr::RSTRIP),
            })
            .collect();
        partition::sort_longest_first(&mut specials);

        let add_bos = m.opt_bool("tokenizer.ggml.add_bos_token")?.unwrap_or(true);
        let add_eos = m.opt_bool("tokenizer.ggml.add_eos_token")?.unwrap_or(false);
        let bos = added(m, add_bos, bos_id, DEFAULT_BOS, n, "tokenizer.ggml.bos_token_id")?;
        let eos = added(m, add_eos, eos_id, DEFAULT_EOS, n, "tokenizer.ggml.eos_token_id")?;
        let add_space_prefix = m.opt_bool("tokenizer.ggml.add_space_prefix")?.unwrap_or(true);
        Ok(Spm {
            texts,
            scores,
            attrs,
            ids,
            bytes,
            specials,
            bos,
            eos,
            add_space_prefix,
        })
    }

    pub(super) fn len(&self) -> usize {
        self.texts.len()
    }

    /// Whether decoding drops one leading space of the first token
    /// (llama.cpp's `llama_detokenize` undoes the space prefix that way).
    pub(super) fn add_space_prefix(&self) -> bool {
        self.add_space_prefix
    }

    /// Ids of `text`, special tokens in it parsed; `add_special`: BOS/EOS as
    /// the vocabulary adds them. `Err`: a byte with no token to fall back to.
    pub(super) fn encode(&self, text: &str, add_special: bool) -> std::result::Result<Vec<u32>, String> {
        let mut out = Vec::new();
        // A piece of text at the start, or after a special token, gets the
        // space prefix (llama.cpp's `is_prev_special`).
        let mut after_special = true;
        if add_special {
            out.extend(self.bos);
        }
        for fragment in partition::partition(text, &self.specials) {
            match fragment {
                Fragment::Token(id) => {
                    out.push(id);
                    after_special = true;
                }
                Fragment::Text(t) => {
                    let prefix = if self.add_space_prefix && after_special {
                        " "
                    } else {
                        ""
                    };
                    let escaped = format!("{prefix}{t}").replace(' ', SPACE);
                    merge::tokenize(self, &escaped, &mut out).map_err(|b| {
                        format!(
                            "byte 0x{b:02X} of {t:?} is in no token of the vocabulary and has no byte token \
                             <0x{b:02X}> to fall back to"
                        )
                    })?;
                    after_special = false;
                }
            }
        }
        if add_special {
            out.extend(self.eos);
        }
        Ok(out)
    }

    /// The bytes token `id` decodes to (`None`: not in the vocabulary).
    pub(super) fn piece(&self, id: u32) -> Option<Vec<u8>> {
        let i = id as usize;
        let (text, attr) = (self.texts.get(i)?, self.attrs[i]);
        Some(if attr.is_special() {
            text.as_bytes().to_vec()
        } else if attr.has(Attr::NORMAL) {
            text.replace(SPACE, " ").into_bytes()
        } else if attr.has(Attr::BYTE) {
            // Checked when loading: every byte token is `<0xXX>`.
            byte_of(text).map(|b| vec![b]).unwrap_or_default()
        } else {
            Vec::new()
        })
    }
}

/// `tokenizer.ggml.scores`: one f32 (or i32, as llama.cpp also reads) per
/// token. Required: a SentencePiece vocabulary merges by score.
fn read_scores(m: &Meta, n: usize) -> Result<Vec<f32>> {
    let v = m.required(SCORES_KEY, "SentencePiece token scores")?;
    let expected = "an array of f32 (or i32)";
    if !matches!(
        v.as_array(),
        Some((crate::gguf::ValueType::F32 | crate::gguf::ValueType::I32, _))
    ) {
        return Err(m.wrong_type(SCORES_KEY, v, expected));
    }
    let items = m.numbers(SCORES_KEY, v, n, expected)?;
    items
        .iter()
        .map(|x| x.as_f64().map(|f| f as f32))
        .collect::<Option<_>>()
        .ok_or_else(|| m.wrong_type(SCORES_KEY, v, expected))
}

/// `default` when it is inside a vocabulary of `n` tokens (llama.cpp
/// disables an out-of-range default).
fn default_id(default: u32, n: usize) -> Option<u32> {
    ((default as usize) < n).then_some(default)
}

/// The id of a token the vocabulary adds (`add`), or `None` when it adds
/// none; adding one that does not exist is an error (llama.cpp aborts).
fn added(m: &Meta, add: bool, id: Option<u32>, default: u32, n: usize, key: &str) -> Result<Option<u32>> {
    if !add {
        return Ok(None);
    }
    match id.or_else(|| default_id(default, n)) {
        Some(id) => Ok(Some(id)),
        None => Err(m.err(format!(
            "metadata key `{key}` is missing and llama.cpp's default {default} is outside the vocabulary of {n} \
             tokens, but the vocabulary adds that token"
        ))),
    }
}

/// The byte of a byte token's text, `<0xXX>`.
fn byte_of(text: &str) -> Option<u8> {
    let hex = text.strip_prefix("<0x")?.strip_suffix('>')?;
    if hex.len() != 2 || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    u8::from_str_radix(hex, 16).ok()
}
