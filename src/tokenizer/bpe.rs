//! A `gpt2` (byte-level BPE) GGUF vocabulary built into a `tokenizers`
//! model the way llama.cpp reads it (llama-vocab.cpp in the pinned sources):
//!
//! - `merges` are the BPE merges by rank (`"a b"`, split at the first space
//!   after the first character, as llama.cpp splits them).
//! - `tokenizer.ggml.pre` selects the pre-tokenizer: its regexes, whether
//!   `ignore_merges` is on (a word that is itself a token is not merged) and
//!   whether BOS is added by default (`super::pre`, llama.cpp's table).
//! - `token_type` CONTROL (3), USER_DEFINED (4) and UNKNOWN (2) tokens are
//!   matched in the text before BPE (llama.cpp's special-token partition with
//!   `parse_special`, as for a prompt).
//! - No normaliser: llama.cpp applies none to BPE vocabularies (HF's Qwen2
//!   `tokenizer.json` applies NFC; the fixtures show the difference).
//! - BOS is prepended when `tokenizer.ggml.add_bos_token` says so, or, without
//!   that key, when the pre-tokenizer's default does; its id is
//!   `tokenizer.ggml.bos_token_id`, or llama.cpp's gpt2 default 11. EOS alike
//!   with `add_eos_token` (default off).

use tokenizers::models::bpe::BPE;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::processors::template::TemplateProcessing;
use tokenizers::{AddedToken, PreTokenizerWrapper, SplitDelimiterBehavior};

use super::meta::{Meta, TYPE_CONTROL, TYPE_UNKNOWN, TYPE_USER_DEFINED};
use crate::error::Result;

/// The default BOS/EOS id llama.cpp assumes for a `gpt2` vocabulary whose GGUF
/// names none (`special_bos_id = 11` in llama-vocab.cpp).
const GPT2_DEFAULT_SPECIAL_ID: u32 = 11;

/// The BPE tokenizer of a `gpt2` vocabulary (`tokens` and their `types`
/// already read).
pub(super) fn from_meta(m: &Meta, tokens: &[&str], types: &[i64]) -> Result<tokenizers::Tokenizer> {
    let pre_key = "tokenizer.ggml.pre";
    let pre = m.string(pre_key, m.required(pre_key, "pre-tokenizer name")?)?;
    let super::pre::Pre {
        regexes,
        ignore_merges,
        add_bos: default_bos,
    } = super::pre::by_name(pre).ok_or_else(|| {
        m.err(format!(
            "metadata key `{pre_key}` is {pre:?}, a pre-tokenizer this harness does not implement (supported: \
             {}; give `prompt.tokens` instead)",
            super::pre::names().join(", ")
        ))
    })?;

    let merges_key = "tokenizer.ggml.merges";
    let merges: Vec<(String, String)> = m
        .strings(merges_key, m.required(merges_key, "BPE merges")?)?
        .into_iter()
        .enumerate()
        .map(|(i, line)| {
            // llama.cpp: `word.find(' ', 1)` on bytes, so a merge may start
            // with a space (a space byte is never inside a UTF-8 character).
            match line.bytes().skip(1).position(|b| b == b' ').map(|p| p + 1) {
                Some(p) => Ok((line[..p].to_string(), line[p + 1..].to_string())),
                None => Err(m.err(format!(
                    "metadata key `{merges_key}`: merge {i} ({line:?}) has no space"
                ))),
            }
        })
        .collect::<Result<_>>()?;
    // A duplicate token string keeps its last id, as llama.cpp's token_to_id does.
    let vocab: tokenizers::models::bpe::Vocab = tokens
        .iter()
        .enumerate()
        .map(|(i, t)| (t.to_string(), i as u32))
        .collect();
    let bpe = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .ignore_merges(ignore_merges)
        .build()
        .map_err(|e| m.err(format!("the vocabulary and merges do not form a BPE model: {e}")))?;
    let mut inner = tokenizers::Tokenizer::new(bpe);
    // Each regex splits the pieces the previous one left (llama.cpp's
    // `unicode_regex_split`), then the bytes are mapped to BPE's alphabet.
    let mut steps = Vec::new();
    for regex in regexes {
        let split = Split::new(
            SplitPattern::Regex(regex.to_string()),
            SplitDelimiterBehavior::Isolated,
            false,
        )
        .map_err(|e| m.err(format!("pre-tokenizer regex for {pre:?} does not compile: {e}")))?;
        steps.push(PreTokenizerWrapper::Split(split));
    }
    steps.push(PreTokenizerWrapper::ByteLevel(ByteLevel::new(false, false, false)));
    inner.with_pre_tokenizer(Some(Sequence::new(steps)));
    inner.with_decoder(Some(ByteLevel::default()));

    // Tokens matched in the text before BPE. HF's added-token matcher takes
    // the leftmost-longest match; llama.cpp partitions by the longest token
    // first: the same for vocabularies where no special token contains another.
    let specials: Vec<AddedToken> = tokens
        .iter()
        .zip(types)
        .filter(|(_, t)| matches!(**t, TYPE_CONTROL | TYPE_USER_DEFINED | TYPE_UNKNOWN))
        .map(|(s, t)| AddedToken::from(s.to_string(), *t != TYPE_USER_DEFINED).normalized(false))
        .collect();
    inner
        .add_special_tokens(specials)
        .map_err(|e| m.err(format!("cannot add the control tokens: {e}")))?;

    let n = tokens.len();
    let add_bos = m.opt_bool("tokenizer.ggml.add_bos_token")?.unwrap_or(default_bos);
    let add_eos = m.opt_bool("tokenizer.ggml.add_eos_token")?.unwrap_or(false);
    let bos = m.opt_id("tokenizer.ggml.bos_token_id", n)?;
    let eos = m.opt_id("tokenizer.ggml.eos_token_id", n)?;
    if add_bos || add_eos {
        let name = |id: u32| tokens.get(id as usize).map(|s| s.to_string());
        let mut single = Vec::new();
        let mut specials = Vec::new();
        for (on, id) in [(add_bos, bos), (add_eos, eos)] {
            if !on {
                continue;
            }
            let id = id.unwrap_or(GPT2_DEFAULT_SPECIAL_ID);
            let t = name(id)
                .ok_or_else(|| m.err(format!("the default special token id {id} is outside the vocabulary")))?;
            specials.push((t.clone(), id));
            single.push(t);
        }
        // "$A" between BOS and EOS.
        let mut pieces: Vec<String> = Vec::new();
        if add_bos {
            pieces.push(single[0].clone());
        }
        pieces.push("$A".into());
        if add_eos {
            pieces.push(single[single.len() - 1].clone());
        }
        let post = TemplateProcessing::builder()
            .try_single(pieces)
            .and_then(|b| b.special_tokens(specials).build().map_err(|e| e.to_string()))
            .map_err(|e| m.err(format!("cannot build the BOS/EOS template: {e}")))?;
        inner.with_post_processor(Some(post));
    }

    Ok(inner)
}
