//! Ids back to text, one token at a time. A byte-level BPE token is a run of
//! bytes, not of characters, and so is a SentencePiece byte-fallback token
//! (`<0xF0>`): an emoji is often two or more tokens, each holding part of
//! its four UTF-8 bytes. Decoding each token on its own would
//! print U+FFFD for every part; [`TextStream`] keeps the bytes of an
//! unfinished character until the token that completes it arrives.

use std::sync::LazyLock;

use super::Tokenizer;

/// GPT-2's byte-to-character table (`bytes_to_unicode`), inverted: the
/// printable Latin-1 bytes stand for themselves, the other 68 bytes were moved
/// to U+0100.. so that every byte has a visible, non-space character.
static CHAR_TO_BYTE: LazyLock<std::collections::HashMap<char, u8>> = LazyLock::new(|| {
    let visible = |b: u8| matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
    let mut next = 256u32;
    (0..=255u8)
        .map(|b| {
            let c = if visible(b) {
                b as u32
            } else {
                next += 1;
                next - 1
            };
            (char::from_u32(c).expect("U+0000..U+0143 are chars"), b)
        })
        .collect()
});

/// The bytes of a byte-level token string; a string with any character
/// outside the byte alphabet (an added token such as `<|im_end|>` written
/// with a space, or a non-Latin literal) is taken as its own UTF-8, which is
/// what HF's `ByteLevel` decoder does.
pub(crate) fn byte_level_bytes(token: &str) -> Vec<u8> {
    token
        .chars()
        .map(|c| CHAR_TO_BYTE.get(&c).copied())
        .collect::<Option<Vec<u8>>>()
        .unwrap_or_else(|| token.as_bytes().to_vec())
}

/// Incremental decoding: [`push`](TextStream::push) returns the text that one
/// more token completes, [`finish`](TextStream::finish) whatever is left.
pub struct TextStream<'a> {
    tok: &'a Tokenizer,
    /// Byte-level: bytes of a character not yet complete.
    pending: Vec<u8>,
    /// Other vocabularies: every id so far and how much text was returned.
    ids: Vec<u32>,
    emitted: usize,
    /// Show bytes that cannot be UTF-8 as `<invalid UTF-8: 98>` (for a
    /// report) instead of U+FFFD (HF's `decode`).
    show_invalid: bool,
    /// Drop one leading space of the next token (the first of a whole text
    /// from a vocabulary that adds a space prefix; see `whole_text`).
    strip_space: bool,
}

impl<'a> TextStream<'a> {
    pub(crate) fn new(tok: &'a Tokenizer) -> Self {
        TextStream {
            tok,
            pending: Vec::new(),
            ids: Vec::new(),
            emitted: 0,
            show_invalid: false,
            strip_space: false,
        }
    }

    /// A decoder for a whole text rather than a continuation: with a
    /// SentencePiece vocabulary that adds a space prefix, the first token's
    /// leading space is the prefix and is dropped (llama.cpp's
    /// `llama_detokenize`: `remove_space`, one space, whatever the token).
    pub(crate) fn whole_text(tok: &'a Tokenizer) -> Self {
        let mut s = Self::new(tok);
        s.strip_space = tok.strips_first_space();
        s
    }

    /// Invalid bytes shown as hex rather than as U+FFFD.
    pub fn show_invalid_bytes(mut self) -> Self {
        self.show_invalid = true;
        self
    }

    /// The text completed by token `id`: possibly empty (the token ends inside
    /// a character), never a U+FFFD for a character that a later token finishes.
    /// An id outside the vocabulary is shown as `<id N>` rather than dropped.
    pub fn push(&mut self, id: u32) -> String {
        if !self.tok.tokens_are_bytes() {
            return self.push_redecode(id);
        }
        let strip = std::mem::take(&mut self.strip_space);
        match self.tok.token_bytes(id) {
            Some(b) => {
                let b = match b.split_first() {
                    Some((b' ', rest)) if strip => rest,
                    _ => &b[..],
                };
                self.pending.extend_from_slice(b)
            }
            None => {
                let mut s = self.take_valid(true);
                s.push_str(&format!("<id {id}>"));
                return s;
            }
        }
        self.take_valid(false)
    }

    /// Bytes held back: the start of a character no token has finished yet.
    pub fn pending(&self) -> &[u8] {
        &self.pending
    }

    /// What is left: a character still incomplete when the tokens ended is
    /// shown as U+FFFD (the text really is cut there).
    pub fn finish(mut self) -> String {
        if !self.tok.tokens_are_bytes() {
            return String::new();
        }
        self.take_valid(true)
    }

    /// The longest prefix of the pending bytes that is whole characters;
    /// invalid bytes (not a prefix of any character) become U+FFFD at once,
    /// an incomplete character at the end stays pending unless `flush`.
    fn take_valid(&mut self, flush: bool) -> String {
        let mut out = String::new();
        let mut rest: &[u8] = &self.pending;
        loop {
            match std::str::from_utf8(rest) {
                Ok(s) => {
                    out.push_str(s);
                    rest = &[];
                    break;
                }
                Err(e) => {
                    let (good, bad) = rest.split_at(e.valid_up_to());
                    out.push_str(std::str::from_utf8(good).expect("valid up to here"));
                    match e.error_len() {
                        Some(n) => {
                            if self.show_invalid {
                                let hex: Vec<String> = bad[..n].iter().map(|b| format!("{b:02x}")).collect();
                                out.push_str(&format!("<invalid UTF-8: {}>", hex.join(" ")));
                            } else {
                                out.push(char::REPLACEMENT_CHARACTER);
                            }
                            rest = &bad[n..];
                        }
                        None if flush => {
                            out.push(char::REPLACEMENT_CHARACTER);
                            rest = &[];
                            break;
                        }
                        None => {
                            rest = bad;
                            break;
                        }
                    }
                }
            }
        }
        self.pending = rest.to_vec();
        out
    }

    /// A `tokenizer.json` that is not byte-level (e.g. SentencePiece with
    /// byte fallback, in HF's form): decode all ids again with its own
    /// decoder and return the new suffix, unless it ends in U+FFFD (a
    /// byte-fallback character not finished yet), as HF's `DecodeStream` does.
    fn push_redecode(&mut self, id: u32) -> String {
        self.ids.push(id);
        let Some(text) = self.tok.hf_decode(&self.ids) else {
            return format!("<id {id}>");
        };
        if text.ends_with(char::REPLACEMENT_CHARACTER) || text.len() < self.emitted {
            return String::new();
        }
        let new = text.get(self.emitted..).unwrap_or_default().to_string();
        self.emitted = text.len();
        new
    }
}
