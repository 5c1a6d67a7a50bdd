//! Text prompts: a spec's `prompt.text` becomes token ids with the model's own
//! tokenizer, and token ids become text again for the report.
//!
//! - An HF folder: its `tokenizer.json`, loaded by HF's `tokenizers` crate (the
//!   library `transformers` itself runs), so the ids are HF's by construction.
//! - A `.gguf` file: the vocabulary in its metadata, read as llama.cpp reads
//!   it ([`gguf`]). A byte-level BPE one (`gpt2`) is built into a
//!   `tokenizers` BPE ([`bpe`]: the pre-tokenizer regex named by
//!   `tokenizer.ggml.pre`, BOS as llama.cpp adds it, control tokens matched
//!   in the text); a SentencePiece one (`llama`) is tokenised by our own
//!   transcription of llama.cpp's SPM tokenizer ([`spm`]: `▁` for spaces, the
//!   space prefix, merges by score, byte fallback, special tokens cut out
//!   first).
//! - `chat: true` renders the model's chat template ([`chat`]) with one user
//!   message and the generation prompt, as `apply_chat_template` does, and
//!   tokenises that with special tokens parsed and nothing added (the template
//!   writes any BOS itself).
//! - [`TextStream`] turns generated ids into text incrementally, holding back
//!   the bytes of a UTF-8 character split across tokens. A SentencePiece
//!   vocabulary decodes as llama.cpp's `llama_detokenize` with special tokens
//!   written out: `▁` is a space, `<0xXX>` its byte, and with
//!   `add_space_prefix` the first token loses one leading space.
//!
//! Plain-text prompts are encoded as both references encode a prompt: special
//! tokens written in the text (`<|im_start|>`) are parsed as special tokens, and
//! the model's own additions (a BOS) are made. `tests/tokenizer.rs` checks the
//! ids against HF transformers and llama.cpp on committed fixtures.

mod bpe;
mod chat;
mod decode;
mod gguf;
mod meta;
mod partition;
pub mod pre;
mod spm;
#[cfg(test)]
mod tests;

use std::path::{Path, PathBuf};

pub use decode::TextStream;

use crate::error::{Error, Result};

/// A model's tokenizer, loaded once and kept (the runner decodes with it).
pub struct Tokenizer {
    backend: Backend,
    /// The file it came from (`tokenizer.json` or the `.gguf`), for errors.
    source: PathBuf,
    /// The chat template and the special-token strings it may refer to.
    chat: Option<chat::ChatTemplate>,
}

/// What turns text into ids.
enum Backend {
    /// HF's `tokenizers`: a `tokenizer.json`, or a `gpt2` GGUF vocabulary.
    Hf {
        inner: Box<tokenizers::Tokenizer>,
        /// Token strings are GPT-2 byte-level encoded (every `gpt2` GGUF; most
        /// modern `tokenizer.json`s): ids map to exact bytes.
        byte_level: bool,
    },
    /// A SentencePiece GGUF vocabulary, tokenised as llama.cpp does.
    Spm(Box<spm::Spm>),
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("source", &self.source)
            .field("vocab", &self.vocab_size())
            .field("chat_template", &self.chat.is_some())
            .finish()
    }
}

/// Token ids of `text` for the model at `model` (`chat`: wrapped in the
/// model's chat template as one user message plus the generation prompt).
pub fn encode_prompt(model: &Path, text: &str, chat: bool) -> Result<Vec<u32>> {
    let t = Tokenizer::load(model)?;
    if chat {
        t.encode_chat(text)
    } else {
        t.encode(text)
    }
}

impl Tokenizer {
    /// The tokenizer of a model: an HF folder (`tokenizer.json`, chat template
    /// from `chat_template.jinja` or `tokenizer_config.json`) or a `.gguf` file.
    pub fn load(model: &Path) -> Result<Tokenizer> {
        if model.is_dir() {
            Self::from_hf_dir(model)
        } else if crate::gguf::is_gguf_path(model) {
            gguf::from_gguf(model)
        } else if !model.exists() {
            Err(Error::model(model, "model not found (no such file or folder)"))
        } else {
            Err(Error::model(
                model,
                "no tokenizer: expected an HF model folder (with tokenizer.json) or a .gguf file",
            ))
        }
    }

    fn from_hf_dir(dir: &Path) -> Result<Tokenizer> {
        let file = dir.join("tokenizer.json");
        if !file.is_file() {
            return Err(Error::model(
                dir,
                "no tokenizer.json in the model folder: a text prompt needs the model's tokenizer \
                 (give `prompt.tokens` instead, or add the tokenizer.json the model was published with)",
            ));
        }
        let bytes = std::fs::read(&file).map_err(|e| Error::io(&file, e))?;
        let inner = tokenizers::Tokenizer::from_bytes(&bytes).map_err(|e| {
            Error::model(
                &file,
                format!("not a tokenizer.json the tokenizers library can load: {e}"),
            )
        })?;
        let byte_level = matches!(inner.get_decoder(), Some(tokenizers::DecoderWrapper::ByteLevel(_)));
        let chat = chat::ChatTemplate::from_hf_dir(dir)?;
        Ok(Tokenizer {
            backend: Backend::Hf {
                inner: Box::new(inner),
                byte_level,
            },
            source: file,
            chat,
        })
    }

    /// The file the tokenizer was read from.
    pub fn source(&self) -> &Path {
        &self.source
    }

    /// Vocabulary size including added tokens.
    pub fn vocab_size(&self) -> usize {
        match &self.backend {
            Backend::Hf { inner, .. } => inner.get_vocab_size(true),
            Backend::Spm(v) => v.len(),
        }
    }

    /// Ids of a plain-text prompt: special tokens in the text parsed, the
    /// model's own additions (BOS, ...) made.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        self.encode_with(text, true)
    }

    /// Ids of `text` as one user message in the model's chat template, with
    /// the generation prompt: `apply_chat_template(..., add_generation_prompt=True,
    /// tokenize=True)`, which encodes the rendered text without adding special
    /// tokens (the template writes any BOS itself).
    pub fn encode_chat(&self, text: &str) -> Result<Vec<u32>> {
        let rendered = self.render_chat(text)?;
        self.encode_with(&rendered, false)
    }

    /// The chat template rendered for one user message plus the generation prompt.
    pub fn render_chat(&self, user: &str) -> Result<String> {
        let Some(t) = &self.chat else {
            return Err(Error::model(
                &self.source,
                "prompt.chat is true but the model has no chat template (no `chat_template` in \
                 tokenizer_config.json or chat_template.jinja, or `tokenizer.chat_template` in the GGUF)",
            ));
        };
        t.render_user(user).map_err(|msg| Error::model(&self.source, msg))
    }

    fn encode_with(&self, text: &str, add_special: bool) -> Result<Vec<u32>> {
        let ids = match &self.backend {
            Backend::Hf { inner, .. } => inner
                .encode(text, add_special)
                .map(|enc| enc.get_ids().to_vec())
                .map_err(|e| e.to_string()),
            Backend::Spm(v) => v.encode(text, add_special),
        };
        ids.map_err(|e| Error::model(&self.source, format!("cannot tokenise the prompt {text:?}: {e}")))
    }

    /// The exact bytes token `id` stands for (`None`: not in the vocabulary).
    /// Byte-level vocabularies map each character of the token string back
    /// to its byte (HF's `ByteLevel` decoder rule: a token with a character
    /// outside the byte alphabet, such as an added token, is its UTF-8 text);
    /// SentencePiece ones turn `▁` into a space and `<0xXX>` into its byte.
    pub fn token_bytes(&self, id: u32) -> Option<Vec<u8>> {
        match &self.backend {
            Backend::Hf { inner, byte_level } => {
                let s = inner.id_to_token(id)?;
                Some(if *byte_level {
                    decode::byte_level_bytes(&s)
                } else {
                    s.into_bytes()
                })
            }
            Backend::Spm(v) => v.piece(id),
        }
    }

    /// Every token is an exact run of bytes ([`token_bytes`](Self::token_bytes)):
    /// decoding concatenates them. Otherwise (a `tokenizer.json` with its own
    /// decoder) the tokenizer decodes.
    fn tokens_are_bytes(&self) -> bool {
        match &self.backend {
            Backend::Hf { byte_level, .. } => *byte_level,
            Backend::Spm(_) => true,
        }
    }

    /// HF's decoding of `ids` (special tokens kept), for a tokenizer whose
    /// tokens are not exact bytes; `None` when it fails.
    fn hf_decode(&self, ids: &[u32]) -> Option<String> {
        match &self.backend {
            Backend::Hf { inner, .. } => inner.decode(ids, false).ok(),
            Backend::Spm(_) => None,
        }
    }

    /// Decoding drops one leading space of the first token: llama.cpp's
    /// `llama_detokenize` for a vocabulary that adds a space prefix.
    fn strips_first_space(&self) -> bool {
        matches!(&self.backend, Backend::Spm(v) if v.add_space_prefix())
    }

    /// An incremental decoder: push ids, get text that never ends in half a
    /// character. It continues a text, so nothing is stripped from the first
    /// token (unlike [`decode`](Self::decode) of a whole text).
    pub fn stream(&self) -> TextStream<'_> {
        TextStream::new(self)
    }

    /// `ids` as text for a report: like [`decode`](Self::decode), but a
    /// character the tokens stop in the middle of (a generation cut off after
    /// the first byte tokens of an emoji) is shown as its bytes,
    /// `<incomplete UTF-8: f0 9f>`, rather than as U+FFFD, which would look
    /// like a decoding bug; a byte that cannot start or continue a character
    /// (a model generating a stray byte token) as `<invalid UTF-8: 98>`.
    pub fn decode_display(&self, ids: &[u32]) -> String {
        let mut s = TextStream::whole_text(self).show_invalid_bytes();
        let mut out: String = ids.iter().map(|&id| s.push(id)).collect();
        let tail = s.pending();
        if !tail.is_empty() {
            let hex: Vec<String> = tail.iter().map(|b| format!("{b:02x}")).collect();
            out.push_str(&format!("<incomplete UTF-8: {}>", hex.join(" ")));
        }
        out
    }

    /// All of `ids` as text (special tokens written out, e.g. `<|im_end|>`),
    /// as a whole text: a SentencePiece vocabulary with `add_space_prefix`
    /// drops the first token's leading space, as `llama_detokenize` does.
    pub fn decode(&self, ids: &[u32]) -> String {
        let mut s = TextStream::whole_text(self);
        let mut out: String = ids.iter().map(|&id| s.push(id)).collect();
        out.push_str(&s.finish());
        out
    }
}
