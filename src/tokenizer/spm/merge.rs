//! The SentencePiece merge loop of llama.cpp (`llm_tokenizer_spm_session`):
//! the text (spaces already U+2581) starts as one symbol per character;
//! every adjacent pair whose concatenation is a token is queued by that
//! token's score; the best pair (highest score, leftmost on a tie) is merged
//! and its new neighbours queued, until no pair is left; each final symbol
//! is its token, or its UTF-8 bytes as `<0xXX>` byte tokens.
//!
//! Written out rather than built from the `tokenizers` crate: HF's BPE
//! needs merges between tokens (llama.cpp merges any two symbols whose
//! concatenation is a token, even when a part is no token, such as `q` in a
//! vocabulary with `qu`), and its Unigram model is a Viterbi search, not
//! this greedy loop; neither reproduces llama.cpp's ids.

use std::cmp::Ordering;
use std::collections::BinaryHeap;

/// One symbol: a byte range of the text, linked to its live neighbours.
#[derive(Clone, Copy)]
struct Symbol {
    start: usize,
    /// 0 once merged into its left neighbour.
    len: usize,
    prev: Option<usize>,
    next: Option<usize>,
}

/// A candidate merge of symbols `left` and `right` into a token of `score`.
struct Bigram {
    left: usize,
    right: usize,
    score: f32,
    /// Bytes the merged text had when queued: a stale entry (a side merged
    /// since) no longer adds up to it and is skipped.
    size: usize,
}

/// Max-heap order: higher score first, then the smaller `left` (llama.cpp's
/// comparator). `total_cmp` so that a NaN score cannot break the heap.
impl Ord for Bigram {
    fn cmp(&self, other: &Self) -> Ordering {
        self.score
            .total_cmp(&other.score)
            .then_with(|| other.left.cmp(&self.left))
    }
}
impl PartialOrd for Bigram {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl PartialEq for Bigram {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}
impl Eq for Bigram {}

/// What the loop needs of the vocabulary.
pub(super) trait Vocab {
    /// The id of a token text.
    fn id(&self, text: &str) -> Option<u32>;
    fn score(&self, id: u32) -> f32;
    /// The token of one byte (`<0xXX>`, or the byte itself as a token).
    fn byte(&self, b: u8) -> Option<u32>;
}

/// Appends the ids of `text` to `out`; `Err(byte)`: a byte that has to fall
/// back and has no token (llama.cpp throws there).
pub(super) fn tokenize(vocab: &impl Vocab, text: &str, out: &mut Vec<u32>) -> Result<(), u8> {
    let mut symbols: Vec<Symbol> = Vec::with_capacity(text.len());
    for (start, c) in text.char_indices() {
        let i = symbols.len();
        symbols.push(Symbol {
            start,
            len: c.len_utf8(),
            prev: i.checked_sub(1),
            next: None,
        });
        if i > 0 {
            symbols[i - 1].next = Some(i);
        }
    }
    let mut queue = BinaryHeap::new();
    let try_add = |queue: &mut BinaryHeap<Bigram>, symbols: &[Symbol], left: Option<usize>, right: Option<usize>| {
        let (Some(left), Some(right)) = (left, right) else {
            return;
        };
        let (l, r) = (symbols[left], symbols[right]);
        let piece = &text[l.start..l.start + l.len + r.len];
        if let Some(id) = vocab.id(piece) {
            queue.push(Bigram {
                left,
                right,
                score: vocab.score(id),
                size: piece.len(),
            });
        }
    };
    for i in 1..symbols.len() {
        try_add(&mut queue, &symbols, Some(i - 1), Some(i));
    }
    while let Some(b) = queue.pop() {
        let (l, r) = (symbols[b.left], symbols[b.right]);
        if l.len == 0 || r.len == 0 || l.len + r.len != b.size {
            continue;
        }
        symbols[b.left].len += r.len;
        symbols[b.right].len = 0;
        symbols[b.left].next = r.next;
        if let Some(n) = r.next {
            symbols[n].prev = Some(b.left);
        }
        try_add(&mut queue, &symbols, symbols[b.left].prev, Some(b.left));
        try_add(&mut queue, &symbols, Some(b.left), symbols[b.left].next);
    }
    // The chain from the first symbol, which a merge never removes. (llama.cpp's
    // `resegment` also looks a symbol up among the queued pairs' texts: every
    // merged symbol is a token, and a single character is never such a pair,
    // so that lookup cannot succeed and is left out.)
    let mut at = (!symbols.is_empty()).then_some(0);
    while let Some(i) = at {
        let s = symbols[i];
        let piece = &text[s.start..s.start + s.len];
        match vocab.id(piece) {
            Some(id) => out.push(id),
            None => {
                for &b in piece.as_bytes() {
                    out.push(vocab.byte(b).ok_or(b)?);
                }
            }
        }
        at = s.next;
    }
    Ok(())
}
