//! Unit tests of the SentencePiece tokenizer on vocabularies made here: the
//! merge order, byte fallback, the space prefix, special tokens, decoding,
//! and every malformed key as a typed error naming it. The expected ids were
//! checked with the pinned llama.cpp on the same vocabularies; the fixture
//! equality with llama.cpp is tests/tokenizer.rs.

use std::path::PathBuf;

use super::super::partition::{partition, sort_longest_first, Fragment, Special};
use super::super::Tokenizer;
use crate::gguf::writer::GgufWriter;
use crate::gguf::{Value, ValueType};

/// A vocabulary: `<unk> <s> </s> <eot>(control) <u>(user-defined)`, the
/// 256 byte tokens (ids 5..=260), then `pieces` with their scores from 261 on.
fn vocab(pieces: &[(&str, f32)], edit: impl FnOnce(&mut Vec<(String, Value)>)) -> (tempfile::TempDir, PathBuf) {
    let mut tokens: Vec<String> = ["<unk>", "<s>", "</s>", "<eot>", "<u>"].map(String::from).to_vec();
    let mut types = vec![2, 3, 3, 3, 4];
    let mut scores = vec![0.0f32; 5];
    for b in 0..=255u8 {
        tokens.push(format!("<0x{b:02X}>"));
        types.push(6);
        scores.push(0.0);
    }
    for (p, s) in pieces {
        tokens.push(p.to_string());
        types.push(1);
        scores.push(*s);
    }
    let mut kv: Vec<(String, Value)> = vec![
        ("tokenizer.ggml.model".into(), Value::String("llama".into())),
        (
            "tokenizer.ggml.tokens".into(),
            Value::Array(ValueType::String, tokens.into_iter().map(Value::String).collect()),
        ),
        (
            "tokenizer.ggml.scores".into(),
            Value::Array(ValueType::F32, scores.into_iter().map(Value::F32).collect()),
        ),
        (
            "tokenizer.ggml.token_type".into(),
            Value::Array(ValueType::I32, types.into_iter().map(Value::I32).collect()),
        ),
    ];
    edit(&mut kv);
    let mut w = GgufWriter::new();
    for (k, v) in kv {
        w.kv(&k, v);
    }
    let d = tempfile::tempdir().unwrap();
    let p = d.path().join("spm.gguf");
    w.write(&p).unwrap();
    (d, p)
}

fn set(kv: &mut Vec<(String, Value)>, key: &str, v: Option<Value>) {
    kv.retain(|(k, _)| k != key);
    if let Some(v) = v {
        kv.push((key.into(), v));
    }
}

fn no_prefix(kv: &mut Vec<(String, Value)>) {
    set(kv, "tokenizer.ggml.add_space_prefix", Some(Value::Bool(false)));
}

/// Id of the n-th piece.
const P: u32 = 261;
/// Id of the byte token of `b`.
fn byte(b: u8) -> u32 {
    5 + u32::from(b)
}

#[test]
fn the_best_scored_pair_merges_first_and_ties_go_to_the_leftmost() {
    // "abc": "ab" (score -2) loses to "bc" (-1), so a + bc.
    let (_d, p) = vocab(
        &[("a", -9.0), ("b", -9.0), ("c", -9.0), ("ab", -2.0), ("bc", -1.0)],
        no_prefix,
    );
    let t = Tokenizer::load(&p).unwrap();
    assert_eq!(t.encode("abc").unwrap(), [1, P, P + 4]);
    // Equal scores: "aaa" is aa + a, not a + aa.
    let (_d, p) = vocab(&[("a", -9.0), ("aa", -1.0)], no_prefix);
    let t = Tokenizer::load(&p).unwrap();
    assert_eq!(t.encode("aaa").unwrap(), [1, P + 1, P]);
    assert_eq!(t.encode("aaaa").unwrap(), [1, P + 1, P + 1]);
}

#[test]
fn characters_merge_even_when_a_part_is_no_token() {
    // `q` is no token but `qu` is: the merge joins characters, not tokens.
    let (_d, p) = vocab(&[("u", -9.0), ("qu", -1.0)], no_prefix);
    let t = Tokenizer::load(&p).unwrap();
    assert_eq!(t.encode("qu").unwrap(), [1, P + 1]);
    // Alone, `q` falls back to its byte.
    assert_eq!(t.encode("uq").unwrap(), [1, P, byte(b'q')]);
}

#[test]
fn a_character_outside_the_vocabulary_falls_back_to_its_utf8_bytes() {
    let (_d, p) = vocab(&[("a", -9.0)], no_prefix);
    let t = Tokenizer::load(&p).unwrap();
    let ids = t.encode("a🤖").unwrap();
    assert_eq!(ids, [1, P, byte(0xF0), byte(0x9F), byte(0xA4), byte(0x96)]);
    // The bytes decode back to the character, held back until complete.
    assert_eq!(t.decode(&ids), "<s>a🤖");
    let mut s = t.stream();
    let pieces: Vec<String> = ids[1..].iter().map(|&i| s.push(i)).collect();
    assert_eq!(pieces, ["a", "", "", "", "🤖"]);
    assert_eq!(t.decode_display(&ids[..4]), "<s>a<incomplete UTF-8: f0 9f>");
}

#[test]
fn spaces_become_the_escape_and_the_prefix_follows_add_space_prefix() {
    let pieces = [("\u{2581}", -9.0), ("a", -9.0), ("\u{2581}a", -1.0)];
    // Default (llama.cpp's SPM default): a space is prefixed.
    let (_d, p) = vocab(&pieces, |_| {});
    let t = Tokenizer::load(&p).unwrap();
    assert_eq!(t.encode("a a").unwrap(), [1, P + 2, P + 2]);
    // Decoding a whole text drops that prefix again; a continuation keeps it.
    assert_eq!(t.decode(&[P + 2, P + 2]), "a a");
    assert_eq!(
        t.decode(&[1, P + 2]),
        "<s> a",
        "the BOS takes the strip, as in llama.cpp"
    );
    assert_eq!(t.stream().push(P + 2), " a");
    let (_d, p) = vocab(&pieces, no_prefix);
    let t = Tokenizer::load(&p).unwrap();
    assert_eq!(t.encode("a a").unwrap(), [1, P + 1, P + 2]);
    assert_eq!(t.decode(&[P + 1, P + 2]), "a a");
}

#[test]
fn special_tokens_are_cut_out_and_the_text_after_them_is_prefixed() {
    let pieces = [("\u{2581}", -9.0), ("a", -9.0), ("\u{2581}a", -1.0)];
    let (_d, p) = vocab(&pieces, |_| {});
    let t = Tokenizer::load(&p).unwrap();
    // <eot> (control) and <u> (user-defined) are tokens in the text; the text
    // after each is a new piece with its own space prefix.
    assert_eq!(t.encode("a<eot>a<u>a").unwrap(), [1, P + 2, 3, P + 2, 4, P + 2]);
    assert_eq!(t.encode("<unk></s>").unwrap(), [1, 0, 2]);
    assert_eq!(t.decode(&[3, 4, 0]), "<eot><u><unk>");
    // The empty text is only what the vocabulary adds.
    assert_eq!(t.encode("").unwrap(), [1]);
    assert_eq!(t.encode_with("", false).unwrap(), Vec::<u32>::new());
}

#[test]
fn bos_and_eos_follow_the_metadata_and_llama_cpp_defaults() {
    let (_d, p) = vocab(&[("a", -9.0)], |kv| {
        no_prefix(kv);
        set(kv, "tokenizer.ggml.add_bos_token", Some(Value::Bool(false)));
        set(kv, "tokenizer.ggml.add_eos_token", Some(Value::Bool(true)));
        set(kv, "tokenizer.ggml.eos_token_id", Some(Value::U32(3)));
    });
    let t = Tokenizer::load(&p).unwrap();
    assert_eq!(t.encode("a").unwrap(), [P, 3]);
    // Default EOS id 2 when the key is absent.
    let (_d, p) = vocab(&[("a", -9.0)], |kv| {
        no_prefix(kv);
        set(kv, "tokenizer.ggml.add_eos_token", Some(Value::Bool(true)));
        set(kv, "tokenizer.ggml.bos_token_id", Some(Value::U32(4)));
    });
    assert_eq!(Tokenizer::load(&p).unwrap().encode("a").unwrap(), [4, P, 2]);
}

#[test]
fn llama_cpp_makes_end_of_generation_texts_control_tokens() {
    // `<|im_end|>` and `▁<PRE>` are NORMAL in the GGUF; llama.cpp cuts them
    // out of the text all the same (EOG text; FIM text without a fim key).
    let pieces = [("x", -9.0), ("<|im_end|>", -5.0), ("\u{2581}<PRE>", -5.0)];
    let (_d, p) = vocab(&pieces, no_prefix);
    let t = Tokenizer::load(&p).unwrap();
    assert_eq!(
        t.encode("x<|im_end|>x\u{2581}<PRE>x").unwrap(),
        [1, P, P + 1, P, P + 2, P]
    );
    // With a fim_pre key the FIM text stays an ordinary piece (bytes here).
    let (_d, p) = vocab(&pieces, |kv| {
        no_prefix(kv);
        set(kv, "tokenizer.ggml.fim_pre_token_id", Some(Value::U32(3)));
    });
    let ids = Tokenizer::load(&p).unwrap().encode("\u{2581}<PRE>").unwrap();
    let bytes: Vec<u32> = "\u{2581}<PRE>".bytes().map(byte).collect();
    assert_eq!(ids[1..], bytes);
}

#[test]
fn phi3_special_tokens_swallow_the_whitespace_after_them() {
    // (llama.cpp refuses a Phi-3 vocabulary without `<|endoftext|>`.)
    let pieces = [
        ("\u{2581}", -9.0),
        ("a", -9.0),
        ("\u{2581}a", -1.0),
        ("<|endoftext|>", -5.0),
    ];
    let make = |name: &'static str| {
        vocab(&pieces, move |kv| {
            no_prefix(kv);
            set(kv, "general.name", Some(Value::String(name.into())));
        })
    };
    let (_d, p) = make("Phi-3 mini");
    assert_eq!(
        Tokenizer::load(&p).unwrap().encode("<eot> \n a").unwrap(),
        [1, 3, P + 1]
    );
    let (_d, p) = make("other");
    let ids = Tokenizer::load(&p).unwrap().encode("<eot> a").unwrap();
    assert_eq!(ids, [1, 3, P + 2]);
    let ids = Tokenizer::load(&p).unwrap().encode("<eot>  a").unwrap();
    assert_eq!(ids, [1, 3, P, P + 2]);
}

#[test]
fn unused_and_undefined_tokens_decode_to_nothing() {
    let (_d, p) = vocab(&[("a", -9.0), ("b", -9.0)], |kv| {
        let types: Vec<Value> = (0..263)
            .map(|i| match i {
                0 => 2,
                1..=3 => 3,
                4 => 4,
                5..=260 => 6,
                261 => 5,
                _ => 0,
            })
            .map(Value::I32)
            .collect();
        set(
            kv,
            "tokenizer.ggml.token_type",
            Some(Value::Array(ValueType::I32, types)),
        );
    });
    let t = Tokenizer::load(&p).unwrap();
    assert_eq!(t.decode(&[P, P + 1, byte(b'z')]), "z");
}

#[test]
fn the_partition_cuts_longest_first_and_keeps_text_between() {
    let mut specials = vec![
        Special {
            id: 1,
            text: "<a>".into(),
            rstrip: false,
        },
        Special {
            id: 2,
            text: "<a><a>".into(),
            rstrip: false,
        },
        Special {
            id: 3,
            text: "!".into(),
            rstrip: true,
        },
    ];
    sort_longest_first(&mut specials);
    use Fragment::{Text, Token};
    assert_eq!(
        partition("x<a><a><a>y! \tz!", &specials),
        [Text("x"), Token(2), Token(1), Text("y"), Token(3), Text("z"), Token(3)]
    );
    assert_eq!(partition("", &specials), []);
    assert_eq!(partition("plain", &specials), [Text("plain")]);
}

#[test]
fn a_byte_with_no_token_is_an_error_not_a_panic() {
    // Remove the byte tokens: "é" (c3 a9) has nothing to fall back to.
    let (_d, p) = vocab(&[("a", -9.0)], |kv| {
        no_prefix(kv);
        let tokens = ["<unk>", "<s>", "</s>", "a"].map(|s| Value::String(s.into())).to_vec();
        set(
            kv,
            "tokenizer.ggml.tokens",
            Some(Value::Array(ValueType::String, tokens)),
        );
        set(
            kv,
            "tokenizer.ggml.scores",
            Some(Value::Array(ValueType::F32, vec![Value::F32(0.0); 4])),
        );
        set(
            kv,
            "tokenizer.ggml.token_type",
            Some(Value::Array(ValueType::I32, [2, 3, 3, 1].map(Value::I32).to_vec())),
        );
    });
    let t = Tokenizer::load(&p).unwrap();
    let e = t.encode("aé").unwrap_err().to_string();
    assert!(e.contains("byte 0xC3") && e.contains("spm.gguf"), "{e}");
    // ASCII falls back to the byte itself when that is a token.
    assert_eq!(t.encode("aaa").unwrap(), [1, 3, 3, 3]);
}

#[test]
fn malformed_spm_metadata_is_a_typed_error_naming_the_key() {
    type Edit = Box<dyn FnOnce(&mut Vec<(String, Value)>)>;
    let cases: Vec<(Edit, &str)> = vec![
        (
            Box::new(|kv| set(kv, "tokenizer.ggml.scores", None)),
            "`tokenizer.ggml.scores` is missing",
        ),
        (
            Box::new(|kv| {
                set(
                    kv,
                    "tokenizer.ggml.scores",
                    Some(Value::Array(ValueType::F32, vec![Value::F32(0.0)])),
                )
            }),
            "`tokenizer.ggml.scores` has 1 entries but `tokenizer.ggml.tokens` has 262",
        ),
        (
            Box::new(|kv| set(kv, "tokenizer.ggml.scores", Some(Value::F32(0.0)))),
            "`tokenizer.ggml.scores` is a f32, expected an array of f32 (or i32)",
        ),
        (
            Box::new(|kv| {
                set(
                    kv,
                    "tokenizer.ggml.scores",
                    Some(Value::Array(ValueType::String, vec![Value::String("x".into()); 262])),
                )
            }),
            "`tokenizer.ggml.scores` is a array<string>, expected an array of f32",
        ),
        (
            Box::new(|kv| {
                set(
                    kv,
                    "tokenizer.ggml.token_type",
                    Some(Value::Array(ValueType::I32, vec![Value::I32(1)])),
                )
            }),
            "`tokenizer.ggml.token_type` has 1 entries but `tokenizer.ggml.tokens` has 262",
        ),
        (
            Box::new(|kv| set(kv, "tokenizer.ggml.add_space_prefix", Some(Value::U8(1)))),
            "`tokenizer.ggml.add_space_prefix` is a u8, expected a bool",
        ),
        (
            Box::new(|kv| set(kv, "tokenizer.ggml.bos_token_id", Some(Value::U32(9999)))),
            "`tokenizer.ggml.bos_token_id` is 9999, outside the vocabulary of 262",
        ),
        (
            Box::new(|kv| set(kv, "tokenizer.ggml.eos_token_id", Some(Value::String("2".into())))),
            "`tokenizer.ggml.eos_token_id` is a string, expected an unsigned integer",
        ),
        (
            Box::new(|kv| set(kv, "general.name", Some(Value::U32(3)))),
            "`general.name` is a u32, expected a string",
        ),
        (
            Box::new(|kv| {
                // Token 261 ("a") typed BYTE but not written <0xXX>.
                let types: Vec<Value> = (0..262)
                    .map(|i| Value::I32(if (5..=261).contains(&i) { 6 } else { 3 }))
                    .collect();
                set(
                    kv,
                    "tokenizer.ggml.token_type",
                    Some(Value::Array(ValueType::I32, types)),
                );
            }),
            "token 261 (\"a\") is a byte token but not written <0xXX>",
        ),
        (
            Box::new(|kv| {
                // Two tokens only: llama.cpp's default EOS id 2 is outside.
                let two = |v: Value| Value::Array(v.value_type(), vec![v.clone(), v]);
                set(kv, "tokenizer.ggml.tokens", Some(two(Value::String("a".into()))));
                set(kv, "tokenizer.ggml.scores", Some(two(Value::F32(0.0))));
                set(kv, "tokenizer.ggml.token_type", Some(two(Value::I32(1))));
                set(kv, "tokenizer.ggml.add_eos_token", Some(Value::Bool(true)));
            }),
            "`tokenizer.ggml.eos_token_id` is missing and llama.cpp's default 2 is outside the vocabulary of 2",
        ),
        (
            Box::new(|kv| set(kv, "tokenizer.ggml.model", Some(Value::String("rwkv".into())))),
            "`tokenizer.ggml.model` is \"rwkv\": the tokenizer models supported for text prompts are \"gpt2\" \
             (byte-level BPE) and \"llama\" (SentencePiece)",
        ),
    ];
    for (edit, want) in cases {
        let (_d, p) = vocab(&[("a", -9.0)], edit);
        let e = match Tokenizer::load(&p) {
            Ok(t) => panic!("expected {want:?}, loaded {t:?}"),
            Err(e) => e.to_string(),
        };
        assert!(e.contains(want), "expected {want:?} in: {e}");
        assert!(e.contains("spm.gguf"), "the file is named: {e}");
    }
}

#[test]
fn integer_scores_and_an_empty_token_load_as_in_llama_cpp() {
    // i32 scores are read as numbers; an empty token text is renamed
    // `[EMPTY_<id>]` and so never matches the text.
    let (_d, p) = vocab(&[("a", -9.0), ("", -1.0), ("aa", -1.0)], |kv| {
        no_prefix(kv);
        let scores: Vec<Value> = (0..264).map(|i| Value::I32(if i == 263 { -1 } else { -9 })).collect();
        set(kv, "tokenizer.ggml.scores", Some(Value::Array(ValueType::I32, scores)));
    });
    let t = Tokenizer::load(&p).unwrap();
    assert_eq!(t.encode("aa").unwrap(), [1, P + 2]);
    assert_eq!(t.decode(&[P + 1]), "[EMPTY_262]");
    assert_eq!(t.vocab_size(), 264);
}

#[test]
fn any_text_without_the_escape_character_round_trips_without_a_space_prefix() {
    // Without a space prefix nothing is added, and every piece decodes to
    // its own text (special tokens to theirs), so decode(encode(t)) == t for
    // every t not holding U+2581 itself: pseudo-random texts over characters
    // in and out of the committed tiny vocabulary, special-token texts too.
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tokenizer-spm/spm-tiny-no-prefix.gguf");
    let t = Tokenizer::load(&p).unwrap();
    let alphabet = [
        "a",
        "b",
        "q",
        "u",
        " ",
        "  ",
        "\n",
        "\n\n",
        "\t",
        "é",
        "e\u{301}",
        "世",
        "界",
        "🤖",
        "<s>",
        "<",
        "s",
        ">",
        "</s>",
        "<end_of_turn>",
        "<|im_end|>",
        "1",
        "2",
        "\u{0}",
        "ö",
        "the",
        " quick",
    ];
    let mut state: u64 = 0x2545_f491_4f6c_dd1d;
    let mut next = move |n: usize| {
        state = state
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        (state >> 33) as usize % n
    };
    for _ in 0..2000 {
        let text: String = (0..next(16)).map(|_| alphabet[next(alphabet.len())]).collect();
        let ids = t.encode_with(&text, false).unwrap();
        assert_eq!(t.decode(&ids), text, "{ids:?}");
    }
}
