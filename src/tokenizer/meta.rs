//! A GGUF file's metadata as the tokenizers read it: typed accessors whose
//! errors name the file and the key (never a panic on a malformed value),
//! and the per-token arrays both vocabulary kinds share
//! (`tokenizer.ggml.tokens`, `tokenizer.ggml.token_type`).

use std::collections::BTreeMap;
use std::path::Path;

use crate::error::{Error, Result};
use crate::gguf::{Value, ValueType};

/// llama.cpp's token types (`llama_token_type`).
pub(super) const TYPE_NORMAL: i64 = 1;
pub(super) const TYPE_UNKNOWN: i64 = 2;
pub(super) const TYPE_CONTROL: i64 = 3;
pub(super) const TYPE_USER_DEFINED: i64 = 4;
pub(super) const TYPE_UNUSED: i64 = 5;
pub(super) const TYPE_BYTE: i64 = 6;

pub(super) const TOKENS_KEY: &str = "tokenizer.ggml.tokens";
pub(super) const TYPES_KEY: &str = "tokenizer.ggml.token_type";

/// The metadata of one GGUF file, with errors that name the file and the key.
pub(super) struct Meta<'a> {
    path: &'a Path,
    kv: BTreeMap<&'a str, &'a Value>,
}

impl<'a> Meta<'a> {
    pub(super) fn new(path: &'a Path, metadata: &'a [(String, Value)]) -> Meta<'a> {
        Meta {
            path,
            kv: metadata.iter().map(|(k, v)| (k.as_str(), v)).collect(),
        }
    }
    pub(super) fn err(&self, msg: String) -> Error {
        Error::model(self.path, msg)
    }
    pub(super) fn get(&self, key: &str) -> Option<&'a Value> {
        self.kv.get(key).copied()
    }
    pub(super) fn required(&self, key: &str, what: &str) -> Result<&'a Value> {
        self.get(key).ok_or_else(|| {
            self.err(format!(
                "metadata key `{key}` is missing: a text prompt needs the model's {what} (give `prompt.tokens` instead)"
            ))
        })
    }
    pub(super) fn wrong_type(&self, key: &str, v: &Value, expected: &str) -> Error {
        self.err(format!(
            "metadata key `{key}` is a {}, expected {expected}",
            v.type_name()
        ))
    }
    pub(super) fn string(&self, key: &str, v: &'a Value) -> Result<&'a str> {
        v.as_str().ok_or_else(|| self.wrong_type(key, v, "a string"))
    }
    pub(super) fn strings(&self, key: &str, v: &'a Value) -> Result<Vec<&'a str>> {
        match v.as_array() {
            Some((ValueType::String, items)) => Ok(items.iter().filter_map(Value::as_str).collect()),
            _ => Err(self.wrong_type(key, v, "an array of strings")),
        }
    }
    pub(super) fn opt_bool(&self, key: &str) -> Result<Option<bool>> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(v) => Err(self.wrong_type(key, v, "a bool")),
        }
    }
    pub(super) fn opt_string(&self, key: &str) -> Result<Option<&'a str>> {
        self.get(key).map(|v| self.string(key, v)).transpose()
    }
    /// A token id key, checked against the vocabulary size.
    pub(super) fn opt_id(&self, key: &str, n_vocab: usize) -> Result<Option<u32>> {
        let Some(v) = self.get(key) else { return Ok(None) };
        let id = v
            .as_u64()
            .ok_or_else(|| self.wrong_type(key, v, "an unsigned integer"))?;
        if id as usize >= n_vocab {
            return Err(self.err(format!(
                "metadata key `{key}` is {id}, outside the vocabulary of {n_vocab} tokens"
            )));
        }
        Ok(Some(id as u32))
    }
    /// `tokenizer.ggml.tokens`: present, strings, not empty.
    pub(super) fn tokens(&self) -> Result<Vec<&'a str>> {
        let tokens = self.strings(TOKENS_KEY, self.required(TOKENS_KEY, "vocabulary")?)?;
        if tokens.is_empty() {
            return Err(self.err(format!("metadata key `{TOKENS_KEY}` is empty")));
        }
        Ok(tokens)
    }
    /// `tokenizer.ggml.token_type`, one integer per token; without the key,
    /// all normal (as llama.cpp treats it).
    pub(super) fn token_types(&self, n_tokens: usize) -> Result<Vec<i64>> {
        let Some(v) = self.get(TYPES_KEY) else {
            return Ok(vec![TYPE_NORMAL; n_tokens]);
        };
        let items = self.numbers(TYPES_KEY, v, n_tokens, "an array of integers")?;
        items
            .iter()
            .map(|t| t.as_f64().map(|f| f as i64))
            .collect::<Option<_>>()
            .ok_or_else(|| self.wrong_type(TYPES_KEY, v, "an array of integers"))
    }
    /// The elements of a numeric per-token array, which must have one entry
    /// per token.
    pub(super) fn numbers(&self, key: &str, v: &'a Value, n_tokens: usize, expected: &str) -> Result<&'a [Value]> {
        match v.as_array() {
            Some((ValueType::String | ValueType::Array, _)) | None => Err(self.wrong_type(key, v, expected)),
            Some((_, items)) if items.len() != n_tokens => Err(self.err(format!(
                "metadata key `{key}` has {} entries but `{TOKENS_KEY}` has {n_tokens}",
                items.len()
            ))),
            Some((_, items)) => Ok(items),
        }
    }
}
