//! A tokenizer from a GGUF file's own vocabulary, read as llama.cpp reads it
//! (llama-vocab.cpp in the pinned llama.cpp sources) so that our ids are the
//! ids llama.cpp feeds the model. This file reads what both kinds of
//! vocabulary share ([`super::meta`]) and picks the kind by
//! `tokenizer.ggml.model`:
//!
//! - `gpt2`: byte-level BPE, built into a `tokenizers` model ([`super::bpe`]);
//! - `llama`: SentencePiece, tokenised by our transcription of llama.cpp's
//!   `llm_tokenizer_spm` ([`super::spm`]).
//!
//! Any other model (`bert`, `t5`, `rwkv`, ...) is refused, naming the two.
//! `tokenizer.ggml.tokens` are the vocabulary by id; `token_type` gives each
//! token llama.cpp's type (a vocabulary without it is all normal); a
//! `tokenizer.chat_template` is kept for `prompt.chat`.

use std::collections::BTreeMap;
use std::path::Path;

use super::chat::ChatTemplate;
use super::meta::Meta;
use super::{Backend, Tokenizer};
use crate::error::Result;
use crate::gguf::GgufFile;

pub(super) fn from_gguf(path: &Path) -> Result<Tokenizer> {
    let metadata = GgufFile::read_metadata(path)?;
    let m = Meta::new(path, &metadata);

    let model_key = "tokenizer.ggml.model";
    let model = m.string(model_key, m.required(model_key, "vocabulary")?)?;
    let tokens = m.tokens()?;
    let types = m.token_types(tokens.len())?;
    let backend = match model {
        "gpt2" => Backend::Hf {
            inner: Box::new(super::bpe::from_meta(&m, &tokens, &types)?),
            byte_level: true,
        },
        "llama" => Backend::Spm(Box::new(super::spm::Spm::from_meta(&m, &tokens, &types)?)),
        other => {
            return Err(m.err(format!(
                "metadata key `{model_key}` is {other:?}: the tokenizer models supported for text prompts are \
                 \"gpt2\" (byte-level BPE) and \"llama\" (SentencePiece) (give `prompt.tokens` instead)"
            )))
        }
    };
    let chat = chat_template(&m, &tokens)?;
    Ok(Tokenizer {
        backend,
        source: path.to_path_buf(),
        chat,
    })
}

/// `tokenizer.chat_template`, with the special-token strings it may refer to.
fn chat_template(m: &Meta, tokens: &[&str]) -> Result<Option<ChatTemplate>> {
    let key = "tokenizer.chat_template";
    let Some(v) = m.get(key) else { return Ok(None) };
    let source = m.string(key, v)?.to_string();
    let mut special = BTreeMap::new();
    for (name, key) in [
        ("bos_token", "tokenizer.ggml.bos_token_id"),
        ("eos_token", "tokenizer.ggml.eos_token_id"),
        ("unk_token", "tokenizer.ggml.unknown_token_id"),
        ("sep_token", "tokenizer.ggml.seperator_token_id"),
        ("pad_token", "tokenizer.ggml.padding_token_id"),
        ("mask_token", "tokenizer.ggml.mask_token_id"),
    ] {
        if let Some(id) = m.opt_id(key, tokens.len())? {
            special.insert(name, tokens[id as usize].to_string());
        }
    }
    Ok(Some(ChatTemplate::new(source, special)))
}
