//! llama.cpp's BPE pre-tokenizers by their GGUF name (`tokenizer.ggml.pre`):
//! the regexes `llm_tokenizer_bpe` splits the text with, in order (each one
//! splits the pieces the previous left, matches and the text between them
//! both kept), and the defaults `llama_vocab::load` sets with the name
//! (`ignore_merges`, BOS added). Transcribed from llama-vocab.cpp of the
//! pinned llama.cpp (the llama-cpp-python sdist `build_llamacpp.py` builds);
//! the regexes are llama.cpp's adapted ones where it adapts (`(?i:…)`
//! contractions spelled out), so that we split as llama.cpp does, not as the
//! model's tokenizer.json would. Every name is checked against llama.cpp's
//! own tokenizer on fixtures (`tests/tokenizer.rs`, section
//! `pre_tokenizers`). `clean_spaces` is not here: it affects only decoding.
//! Non-ASCII characters of a class are written `\x{…}` (as llama.cpp's
//! source holds them: a literal would be at the mercy of Unicode
//! normalisation, which turns e.g. U+212A KELVIN SIGN into `K`).
//! The contraction alternative `(?:'[sS]|'[tT]|…)` is llama.cpp's spelling of
//! tokenizer.json's `(?i:'s|'t|…)`, inlined because `concat!` takes literals.

/// How one pre-tokenizer splits and what it adds.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Pre {
    /// Applied in order, each to the pieces of the previous.
    pub regexes: &'static [&'static str],
    /// A word that is itself a token is taken whole, not merged.
    pub ignore_merges: bool,
    /// BOS is prepended unless the GGUF says otherwise.
    pub add_bos: bool,
}

/// GPT-2's split (also the second regex of several others).
const GPT2: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)";

const LLAMA3: &str = concat!(
    "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])",
    r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
);

const QWEN2: &str = concat!(
    "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])",
    r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
);

const SEED_CODER: &str = concat!(
    "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])",
    r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+|\s+(?!\S)|\s+"
);

const DEEPSEEK_LLM: &[&str] = &[
    r"[\x{d}\x{a}]",
    r"\s?[A-Za-z\x{b5}\x{c0}-\x{d6}\x{d8}-\x{f6}\x{f8}-\x{1ba}\x{1bc}-\x{1bf}\x{1c4}-\x{293}\x{295}-\x{2af}\x{370}-\x{373}\x{376}\x{377}\x{37b}-\x{37d}\x{37f}\x{386}\x{388}-\x{38a}\x{38c}\x{38e}-\x{3a1}\x{3a3}-\x{3f5}\x{3f7}-\x{481}\x{48a}-\x{52f}\x{531}-\x{556}\x{10a0}-\x{10c5}\x{13a0}-\x{13f5}\x{13f8}-\x{13fd}\x{1c90}-\x{1cba}\x{1cbd}-\x{1cbf}\x{1d00}-\x{1d2b}\x{1d6b}-\x{1d77}\x{1d79}-\x{1d9a}\x{1e00}-\x{1f15}\x{1f18}-\x{1f1d}\x{1f20}-\x{1f45}\x{1f48}-\x{1f4d}\x{1f50}-\x{1f57}\x{1f59}\x{1f5b}\x{1f5d}\x{1f5f}-\x{1f7d}\x{1f80}-\x{1fb4}\x{1fb6}-\x{1fbc}\x{1fbe}\x{1fc2}-\x{1fc4}\x{1fc6}-\x{1fcc}\x{1fd0}-\x{1fd3}\x{1fd6}-\x{1fdb}\x{1fe0}-\x{1fec}\x{1ff2}-\x{1ff4}\x{1ff6}-\x{1ffc}\x{2102}\x{2107}\x{210a}-\x{2113}\x{2115}\x{2119}-\x{211d}\x{2124}\x{2126}\x{2128}\x{212a}-\x{212d}\x{212f}-\x{2134}\x{2139}\x{213c}-\x{213f}\x{2145}-\x{2149}\x{214e}\x{2183}\x{2184}\x{2c00}-\x{2c7b}\x{2c7e}-\x{2ce4}\x{2ceb}-\x{2cee}\x{2cf2}\x{2cf3}\x{a640}-\x{a66d}\x{a680}-\x{a69b}\x{a722}-\x{a76f}\x{a771}-\x{a787}\x{a78b}-\x{a78e}\x{ab70}-\x{abbf}\x{fb00}-\x{fb06}\x{fb13}-\x{fb17}\x{ff21}-\x{ff3a}\x{ff41}-\x{ff5a}\x{10400}-\x{1044f}\x{104b0}-\x{104d3}\x{104d8}-\x{104fb}\x{10c80}-\x{10cb2}\x{10cc0}-\x{10cf2}\x{118a0}-\x{118df}\x{1e900}-\x{1e943}]+",
    r"\s?[!-/:-~\x{ff01}-\x{ff0f}\x{ff1a}-\x{ff5e}\x{2018}-\x{201f}\x{3000}-\x{3002}]+",
    r"\s+$",
    r"[\x{4e00}-\x{9fa5}\x{800}-\x{4e00}\x{ac00}-\x{d7ff}]+",
    r"\p{N}+",
];

const DEEPSEEK3_LLM: &[&str] = &[
    r"\p{N}{1,3}",
    r"[一-龥぀-ゟ゠-ヿ]+",
    r##"[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"##,
];

const FALCON: &[&str] = &[r"[\p{P}\$\+<=>\^~\|`]+", GPT2, r"[0-9][0-9][0-9]"];

/// starcoder, refact, command-r, smollm, codeshell, exaone, minerva.
const STARCODER: &[&str] = &[r"\p{N}", GPT2];

const PORO: &[&str] = &[r" ?[^(\s|.,!?…。，、।۔،)]+"];

const TEKKEN: &str = concat!(
    r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+",
    r"|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*",
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
);

const GPT4O: &str = concat!(
    r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+",
    "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?",
    r"|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*",
    "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?",
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
);

const fn pre(regexes: &'static [&'static str], ignore_merges: bool, add_bos: bool) -> Pre {
    Pre {
        regexes,
        ignore_merges,
        add_bos,
    }
}

/// Every name implemented, with what it means (llama.cpp's mapping).
pub const TABLE: &[(&str, Pre)] = &[
    ("qwen2", pre(&[QWEN2], false, false)),
    ("deepseek-r1-qwen", pre(&[QWEN2], false, false)),
    ("stablelm2", pre(&[QWEN2], false, false)),
    ("megrez", pre(&[QWEN2], false, false)),
    ("llama3", pre(&[LLAMA3], true, true)),
    ("llama-v3", pre(&[LLAMA3], true, true)),
    ("llama-bpe", pre(&[LLAMA3], true, true)),
    ("falcon3", pre(&[LLAMA3], true, true)),
    ("pixtral", pre(&[LLAMA3], true, true)),
    ("dbrx", pre(&[LLAMA3], false, false)),
    ("smaug-bpe", pre(&[LLAMA3], false, false)),
    ("chatglm-bpe", pre(&[LLAMA3], false, false)),
    ("gpt-2", pre(&[GPT2], false, false)),
    ("phi-2", pre(&[GPT2], false, false)),
    ("mpt", pre(&[GPT2], false, false)),
    ("olmo", pre(&[GPT2], false, false)),
    ("jais", pre(&[GPT2], false, false)),
    ("deepseek-llm", pre(DEEPSEEK_LLM, false, false)),
    ("deepseek-v3", pre(DEEPSEEK3_LLM, false, false)),
    ("falcon", pre(FALCON, false, false)),
    ("starcoder", pre(STARCODER, false, false)),
    ("refact", pre(STARCODER, false, false)),
    ("command-r", pre(STARCODER, false, false)),
    ("smollm", pre(STARCODER, false, false)),
    ("codeshell", pre(STARCODER, false, false)),
    ("exaone", pre(STARCODER, false, false)),
    ("minerva-7b", pre(STARCODER, false, false)),
    ("poro-chat", pre(PORO, false, false)),
    ("bloom", pre(PORO, false, false)),
    ("gpt3-finnish", pre(PORO, false, false)),
    ("tekken", pre(&[TEKKEN], true, true)),
    ("gpt-4o", pre(&[GPT4O], false, false)),
    ("llama4", pre(&[GPT4O], false, false)),
    ("seed-coder", pre(&[SEED_CODER], false, false)),
];

/// The pre-tokenizer llama.cpp selects for `name`, if implemented.
pub fn by_name(name: &str) -> Option<Pre> {
    TABLE.iter().find(|(n, _)| *n == name).map(|(_, p)| *p)
}

/// The implemented names, for an error listing them.
pub fn names() -> Vec<&'static str> {
    TABLE.iter().map(|(n, _)| *n).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_regex_compiles_and_names_are_unique() {
        let mut seen = std::collections::BTreeSet::new();
        for (name, p) in TABLE {
            assert!(seen.insert(*name), "{name} twice");
            for r in p.regexes {
                tokenizers::pre_tokenizers::split::Split::new(
                    tokenizers::pre_tokenizers::split::SplitPattern::Regex(r.to_string()),
                    tokenizers::SplitDelimiterBehavior::Isolated,
                    false,
                )
                .unwrap_or_else(|e| panic!("{name}: {e}"));
            }
        }
    }
}
