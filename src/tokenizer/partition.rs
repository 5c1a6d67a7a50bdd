//! Special tokens cut out of a prompt before it is tokenised, as llama.cpp's
//! `tokenizer_st_partition` does with `parse_special` (how its programs
//! tokenise a prompt): for each special token in turn, longest text first,
//! every occurrence in the text not yet cut becomes that token, and the text
//! between occurrences is left for the tokenizer. A token with `rstrip`
//! also swallows the whitespace after it (llama.cpp's `lstrip`, set only for
//! some BERT-style vocabularies' `<mask>`, is not carried).
//!
//! Used for SentencePiece vocabularies ([`super::spm`]); the byte-level BPE
//! ones use the `tokenizers` crate's added-token matcher, which gives the
//! same cuts for the vocabularies the fixtures hold.

/// One special token to look for.
#[derive(Clone, Debug)]
pub(crate) struct Special {
    pub id: u32,
    pub text: String,
    pub rstrip: bool,
}

/// A piece of the prompt: text to tokenise, or a token already decided.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Fragment<'a> {
    Text(&'a str),
    Token(u32),
}

/// `specials` in the order llama.cpp tries them: longest text first. (Its
/// `std::sort` is not stable; equal lengths keep id order here, which
/// matters only for two equally long tokens that overlap in one text.)
pub(crate) fn sort_longest_first(specials: &mut [Special]) {
    specials.sort_by(|a, b| b.text.len().cmp(&a.text.len()).then(a.id.cmp(&b.id)));
}

/// C's `isspace` in the "C" locale, which llama.cpp's strip uses.
fn is_c_space(b: u8) -> bool {
    matches!(b, b' ' | b'\t' | b'\n' | b'\x0b' | b'\x0c' | b'\r')
}

/// `text` cut at every occurrence of every special token (`specials` in
/// [`sort_longest_first`] order). An empty text has no fragments.
pub(crate) fn partition<'a>(text: &'a str, specials: &[Special]) -> Vec<Fragment<'a>> {
    let mut fragments = if text.is_empty() {
        Vec::new()
    } else {
        vec![Fragment::Text(text)]
    };
    for special in specials {
        // Cheap exit for the many special tokens a prompt does not hold.
        let found = fragments
            .iter()
            .any(|f| matches!(f, Fragment::Text(t) if t.contains(special.text.as_str())));
        if !found {
            continue;
        }
        let mut next = Vec::with_capacity(fragments.len() + 2);
        for fragment in fragments {
            match fragment {
                Fragment::Token(_) => next.push(fragment),
                Fragment::Text(t) => cut(t, special, &mut next),
            }
        }
        fragments = next;
    }
    fragments
}

/// One text fragment cut at each occurrence of one special token.
fn cut<'a>(mut rest: &'a str, special: &Special, out: &mut Vec<Fragment<'a>>) {
    let needle = special.text.as_str();
    while let Some(at) = rest.find(needle) {
        let left = &rest[..at];
        if !left.is_empty() {
            out.push(Fragment::Text(left));
        }
        out.push(Fragment::Token(special.id));
        rest = &rest[at + needle.len()..];
        if special.rstrip {
            rest = rest.trim_start_matches(|c: char| c.is_ascii() && is_c_space(c as u8));
        }
    }
    if !rest.is_empty() {
        out.push(Fragment::Text(rest));
    }
}
