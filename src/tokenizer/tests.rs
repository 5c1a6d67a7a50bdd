//! Unit tests: loading errors (typed, naming file and key, never a panic),
//! incremental decoding across split characters, chat rendering. The equality
//! with HF and llama.cpp is tests/tokenizer.rs (fixtures).

use std::path::{Path, PathBuf};

use super::*;
use crate::gguf::writer::GgufWriter;
use crate::gguf::{Value, ValueType};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn qwen_dir() -> PathBuf {
    root().join("goldens/qwen2-tiny/model")
}

fn err(r: Result<Tokenizer>) -> String {
    match r {
        Ok(t) => panic!("expected an error, loaded {t:?}"),
        Err(e) => e.to_string(),
    }
}

/// A copy of the tiny Qwen2 folder's tokenizer files, with `config` as its
/// tokenizer_config.json.
fn folder_with_config(config: &serde_json::Value) -> tempfile::TempDir {
    let d = tempfile::tempdir().unwrap();
    std::fs::copy(qwen_dir().join("tokenizer.json"), d.path().join("tokenizer.json")).unwrap();
    std::fs::write(d.path().join("tokenizer_config.json"), config.to_string()).unwrap();
    d
}

// ---- incremental decoding ----

#[test]
fn a_character_split_across_byte_tokens_is_held_back_until_complete() {
    let t = Tokenizer::load(&qwen_dir()).unwrap();
    // The tiny vocabulary has no merge for the robot emoji: one token per byte.
    let ids = t.encode("🤖").unwrap();
    assert_eq!(ids.len(), 4, "{ids:?}: expected the 4 bytes of U+1F916 as 4 tokens");
    let mut s = t.stream();
    let pieces: Vec<String> = ids.iter().map(|&id| s.push(id)).collect();
    assert_eq!(pieces, ["", "", "", "🤖"]);
    assert_eq!(s.finish(), "");

    // Mixed text: no piece ever holds U+FFFD, and the pieces add up.
    let text = "Hi 👋🏽! 世界 re\u{301}sume\u{301} 🤖\n";
    let ids = t.encode(text).unwrap();
    let mut s = t.stream();
    let mut out = String::new();
    for &id in &ids {
        let piece = s.push(id);
        assert!(!piece.contains('\u{FFFD}'), "token {id} printed {piece:?}");
        out.push_str(&piece);
    }
    out.push_str(&s.finish());
    assert_eq!(out, text.nfc_like_hf());
}

/// HF's tokenizer.json for Qwen2 normalises to NFC before encoding.
trait Nfc {
    fn nfc_like_hf(&self) -> String;
}
impl Nfc for &str {
    fn nfc_like_hf(&self) -> String {
        self.replace("e\u{301}", "é")
    }
}

#[test]
fn a_character_cut_off_at_the_end_is_shown_as_replacement_once() {
    let t = Tokenizer::load(&qwen_dir()).unwrap();
    let ids = t.encode("🤖").unwrap();
    let mut s = t.stream();
    for &id in &ids[..2] {
        assert_eq!(s.push(id), "");
    }
    assert_eq!(s.finish(), "\u{FFFD}");
    assert_eq!(t.decode(&ids[..2]), "\u{FFFD}");
    // The report shows the bytes instead.
    assert_eq!(t.decode_display(&ids[..2]), "<incomplete UTF-8: f0 9f>");
    let mut with_text = t.encode("hi ").unwrap();
    with_text.extend_from_slice(&ids[..3]);
    assert_eq!(t.decode_display(&with_text), "hi <incomplete UTF-8: f0 9f a4>");
    // A byte that no character starts with (a stray continuation byte, 0x98).
    let stray = t.encode("\u{98}").unwrap(); // U+0098 is c2 98: two byte tokens
    assert_eq!(stray.len(), 2, "{stray:?}");
    assert_eq!(t.decode_display(&stray[1..]), "<invalid UTF-8: 98>");
    assert_eq!(t.decode(&stray[1..]), "\u{FFFD}");
}

#[test]
fn an_id_outside_the_vocabulary_is_shown_not_dropped() {
    let t = Tokenizer::load(&qwen_dir()).unwrap();
    let hi = t.encode("hi").unwrap();
    let mut ids = hi.clone();
    ids.push(99_999);
    assert_eq!(t.decode(&ids), "hi<id 99999>");
}

#[test]
fn special_tokens_decode_to_their_text() {
    let t = Tokenizer::load(&qwen_dir()).unwrap();
    let ids = t.encode("<|im_start|>user\n").unwrap();
    assert_eq!(ids[0], 1, "<|im_start|> is added token 1 in the tiny vocabulary");
    assert_eq!(t.decode(&ids), "<|im_start|>user\n");
}

#[test]
fn byte_level_alphabet_round_trips_every_byte() {
    // GPT-2's table: 'Ġ' is the space, 'Ċ' the newline, printable ASCII is itself.
    assert_eq!(decode::byte_level_bytes("Ġhello"), b" hello");
    assert_eq!(decode::byte_level_bytes("Ċ"), b"\n");
    assert_eq!(decode::byte_level_bytes("ðŁ¤ĸ"), "🤖".as_bytes());
    // Not in the alphabet (an added token with a CJK literal): its own UTF-8.
    assert_eq!(decode::byte_level_bytes("<世>"), "<世>".as_bytes());
}

// ---- tokenizer.json folders ----

#[test]
fn a_folder_without_tokenizer_json_is_a_clear_error() {
    let d = tempfile::tempdir().unwrap();
    let e = err(Tokenizer::load(d.path()));
    assert!(e.contains("no tokenizer.json"), "{e}");
    assert!(e.contains(&d.path().display().to_string()), "{e}");
}

#[test]
fn a_malformed_tokenizer_json_names_the_file() {
    let d = tempfile::tempdir().unwrap();
    std::fs::write(
        d.path().join("tokenizer.json"),
        r#"{"model": {"type": "BPE", "vocab": 3}}"#,
    )
    .unwrap();
    let e = err(Tokenizer::load(d.path()));
    assert!(e.contains("tokenizer.json: not a tokenizer.json"), "{e}");
    std::fs::write(d.path().join("tokenizer.json"), "not json").unwrap();
    let e = err(Tokenizer::load(d.path()));
    assert!(e.contains("tokenizer.json"), "{e}");
}

#[test]
fn a_missing_model_or_a_file_that_is_not_one_is_a_clear_error() {
    let e = err(Tokenizer::load(Path::new("/nonexistent/model")));
    assert!(e.contains("model not found"), "{e}");
    let f = tempfile::NamedTempFile::new().unwrap();
    let e = err(Tokenizer::load(f.path()));
    assert!(e.contains("no tokenizer"), "{e}");
}

#[test]
fn chat_without_a_template_is_a_clear_error() {
    let e = encode_prompt(&qwen_dir(), "hi", true).unwrap_err().to_string();
    assert!(e.contains("no chat template") && e.contains("tokenizer.json"), "{e}");
    let gguf = root().join("goldens/qwen2-tiny/model.gguf");
    let e = encode_prompt(&gguf, "hi", true).unwrap_err().to_string();
    assert!(e.contains("no chat template") && e.contains("model.gguf"), "{e}");
}

/// Qwen2.5's template (abridged to its non-tool branch), with trim_blocks /
/// lstrip_blocks whitespace and a pycompat method.
const QWEN_TEMPLATE: &str = "{%- if messages[0]['role'] == 'system' %}\n    {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n{%- else %}\n    {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}\n{%- endif %}\n{%- for message in messages %}\n    {%- if message.role == \"user\" %}\n        {{- '<|im_start|>' + message.role + '\\n' + message.content.strip() + '<|im_end|>' + '\\n' }}\n    {%- endif %}\n{%- endfor %}\n{%- if add_generation_prompt %}\n    {{- '<|im_start|>assistant\\n' }}\n{%- endif %}\n";

#[test]
fn chat_renders_the_template_and_parses_its_special_tokens() {
    let d = folder_with_config(&serde_json::json!({"chat_template": QWEN_TEMPLATE, "eos_token": "<|endoftext|>"}));
    let t = Tokenizer::load(d.path()).unwrap();
    let rendered = t.render_chat("  def fib(n):  ").unwrap();
    assert_eq!(
        rendered,
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\ndef fib(n):<|im_end|>\n<|im_start|>assistant\n"
    );
    let ids = t.encode_chat("  def fib(n):  ").unwrap();
    // <|im_start|> = 1, <|im_end|> = 2: parsed as special tokens, not spelt out.
    assert_eq!(ids[0], 1);
    assert_eq!(ids.iter().filter(|&&i| i == 1).count(), 3, "{ids:?}");
    assert_eq!(ids.iter().filter(|&&i| i == 2).count(), 2, "{ids:?}");
    assert_eq!(t.decode(&ids), rendered);
}

#[test]
fn chat_template_from_a_jinja_file_a_named_list_and_special_token_variables() {
    let d = folder_with_config(&serde_json::json!({
        "chat_template": [{"name": "tool_use", "template": "x"}, {"name": "default", "template": "{{ bos_token }}[{{ messages[0].content }}]"}],
        "bos_token": {"content": "<|im_start|>", "special": true},
    }));
    let t = Tokenizer::load(d.path()).unwrap();
    assert_eq!(t.render_chat("a").unwrap(), "<|im_start|>[a]");
    // chat_template.jinja wins over tokenizer_config.json (as in transformers).
    std::fs::write(
        d.path().join("chat_template.jinja"),
        "J{{ messages | length }}{{ messages[0] | tojson }}",
    )
    .unwrap();
    let t = Tokenizer::load(d.path()).unwrap();
    assert_eq!(t.render_chat("<a>").unwrap(), r#"J1{"role": "user", "content": "<a>"}"#);
}

#[test]
fn chat_template_errors_are_reported_not_panicked() {
    for (template, want) in [
        ("{% if %}", "does not parse"),
        (
            "{{ raise_exception('only user/assistant roles') }}",
            "only user/assistant roles",
        ),
        ("{{ strftime_now('%Y') }}", "today's date"),
    ] {
        let d = folder_with_config(&serde_json::json!({ "chat_template": template }));
        let e = encode_prompt(d.path(), "x", true).unwrap_err().to_string();
        assert!(e.contains(want), "{template}: {e}");
    }
    let d = folder_with_config(&serde_json::json!({ "chat_template": 3 }));
    let e = err(Tokenizer::load(d.path()));
    assert!(
        e.contains("tokenizer_config.json") && e.contains("`chat_template` is a number"),
        "{e}"
    );
}

// ---- GGUF vocabularies ----

fn strings(items: &[&str]) -> Value {
    Value::Array(
        ValueType::String,
        items.iter().map(|s| Value::String(s.to_string())).collect(),
    )
}

/// A minimal gpt2 vocabulary: bytes of "ab ", merges a+b, Ġ+ab; one control token.
fn tiny_gguf(edit: impl FnOnce(&mut Vec<(String, Value)>)) -> (tempfile::TempDir, PathBuf) {
    let mut kv: Vec<(String, Value)> = vec![
        ("tokenizer.ggml.model".into(), Value::String("gpt2".into())),
        ("tokenizer.ggml.pre".into(), Value::String("qwen2".into())),
        (
            "tokenizer.ggml.tokens".into(),
            strings(&["<|x|>", "a", "b", "Ġ", "ab", "Ġab"]),
        ),
        ("tokenizer.ggml.merges".into(), strings(&["a b", "Ġ ab"])),
        (
            "tokenizer.ggml.token_type".into(),
            Value::Array(ValueType::I32, [3, 1, 1, 1, 1, 1].map(Value::I32).to_vec()),
        ),
    ];
    edit(&mut kv);
    let mut w = GgufWriter::new();
    for (k, v) in kv {
        w.kv(&k, v);
    }
    let d = tempfile::tempdir().unwrap();
    let p = d.path().join("m.gguf");
    w.write(&p).unwrap();
    (d, p)
}

fn set(kv: &mut Vec<(String, Value)>, key: &str, v: Option<Value>) {
    kv.retain(|(k, _)| k != key);
    if let Some(v) = v {
        kv.push((key.into(), v));
    }
}

#[test]
fn a_gguf_vocabulary_encodes_with_merges_control_tokens_and_bos() {
    let (_d, p) = tiny_gguf(|_| {});
    let t = Tokenizer::load(&p).unwrap();
    assert_eq!(t.encode("ab ab").unwrap(), [4, 5]);
    assert_eq!(t.encode("ab<|x|>ab").unwrap(), [4, 0, 4]);
    assert_eq!(t.decode(&[4, 0, 5]), "ab<|x|> ab");
    // add_bos_token with a bos id: prepended to a prompt, not to chat text.
    let (_d, p) = tiny_gguf(|kv| {
        set(kv, "tokenizer.ggml.add_bos_token", Some(Value::Bool(true)));
        set(kv, "tokenizer.ggml.bos_token_id", Some(Value::U32(0)));
        set(
            kv,
            "tokenizer.chat_template",
            Some(Value::String("{{ bos_token }}{{ messages[0].content }}".into())),
        );
    });
    let t = Tokenizer::load(&p).unwrap();
    assert_eq!(t.encode("ab").unwrap(), [0, 4]);
    assert_eq!(
        t.encode_chat("ab").unwrap(),
        [0, 4],
        "the template writes the BOS, encode adds none"
    );
}

#[test]
fn gguf_tokenizer_errors_name_the_file_and_the_key() {
    type Edit = Box<dyn FnOnce(&mut Vec<(String, Value)>)>;
    let cases: Vec<(Edit, &str)> = vec![
        (
            Box::new(|kv| set(kv, "tokenizer.ggml.tokens", None)),
            "`tokenizer.ggml.tokens` is missing",
        ),
        (
            Box::new(|kv| set(kv, "tokenizer.ggml.model", None)),
            "`tokenizer.ggml.model` is missing",
        ),
        (
            Box::new(|kv| set(kv, "tokenizer.ggml.tokens", Some(Value::U32(3)))),
            "`tokenizer.ggml.tokens` is a u32, expected an array of strings",
        ),
        (
            Box::new(|kv| set(kv, "tokenizer.ggml.model", Some(Value::String("bert".into())))),
            "`tokenizer.ggml.model` is \"bert\": the tokenizer models supported for text prompts are \"gpt2\" \
             (byte-level BPE) and \"llama\" (SentencePiece)",
        ),
        (
            Box::new(|kv| set(kv, "tokenizer.ggml.pre", Some(Value::String("kimi-k2".into())))),
            "`tokenizer.ggml.pre` is \"kimi-k2\", a pre-tokenizer this harness does not implement (supported: qwen2",
        ),
        (
            Box::new(|kv| set(kv, "tokenizer.ggml.pre", None)),
            "`tokenizer.ggml.pre` is missing",
        ),
        (
            Box::new(|kv| set(kv, "tokenizer.ggml.merges", Some(strings(&["ab"])))),
            "merge 0 (\"ab\") has no space",
        ),
        (
            Box::new(|kv| set(kv, "tokenizer.ggml.merges", Some(strings(&["a zz"])))),
            "do not form a BPE model",
        ),
        (
            Box::new(|kv| {
                set(
                    kv,
                    "tokenizer.ggml.token_type",
                    Some(Value::Array(ValueType::I32, vec![Value::I32(1)])),
                )
            }),
            "`tokenizer.ggml.token_type` has 1 entries but `tokenizer.ggml.tokens` has 6",
        ),
        (
            Box::new(|kv| {
                set(kv, "tokenizer.ggml.add_bos_token", Some(Value::Bool(true)));
                set(kv, "tokenizer.ggml.bos_token_id", Some(Value::U32(600)));
            }),
            "`tokenizer.ggml.bos_token_id` is 600, outside the vocabulary of 6",
        ),
        (
            Box::new(|kv| set(kv, "tokenizer.ggml.add_bos_token", Some(Value::U8(1)))),
            "`tokenizer.ggml.add_bos_token` is a u8, expected a bool",
        ),
        (
            Box::new(|kv| set(kv, "tokenizer.chat_template", Some(Value::I32(1)))),
            "`tokenizer.chat_template` is a i32, expected a string",
        ),
    ];
    for (edit, want) in cases {
        let (_d, p) = tiny_gguf(edit);
        let e = err(Tokenizer::load(&p));
        assert!(e.contains(want), "expected {want:?} in: {e}");
        assert!(e.contains("m.gguf"), "the file is named: {e}");
    }
}

#[test]
fn a_truncated_gguf_is_an_error_not_a_panic() {
    let (_d, p) = tiny_gguf(|_| {});
    let bytes = std::fs::read(&p).unwrap();
    // (Cuts inside the metadata: the tokenizer reads nothing after it.)
    for cut in [0, 3, 10, 30, bytes.len() / 2] {
        std::fs::write(&p, &bytes[..cut]).unwrap();
        let e = err(Tokenizer::load(&p));
        assert!(e.contains("m.gguf"), "cut at {cut}: {e}");
    }
}

#[test]
fn llama_bpe_adds_llama_cpp_default_bos_and_ignores_merges_for_whole_words() {
    // pre llama-bpe without add_bos_token: llama.cpp adds a BOS, with id 11
    // (its gpt2 default) when the GGUF names none. "abc" is a token that no
    // merge builds: llama-bpe (ignore_merges) takes it whole, qwen2 does not.
    let toks = ["<|x|>", "a", "b", "Ġ", "ab", "Ġab", "c", "abc", "e", "f", "g", "h"];
    let make = |pre: &str| {
        tiny_gguf(|kv| {
            set(kv, "tokenizer.ggml.pre", Some(Value::String(pre.into())));
            set(kv, "tokenizer.ggml.tokens", Some(strings(&toks)));
            set(kv, "tokenizer.ggml.token_type", None);
        })
    };
    let (_d, l) = make("llama-bpe");
    assert_eq!(Tokenizer::load(&l).unwrap().encode("abc").unwrap(), [11, 7]);
    let (_e, q) = make("qwen2");
    assert_eq!(Tokenizer::load(&q).unwrap().encode("abc").unwrap(), [4, 6]);
    // With an explicit add_bos_token = false, no BOS.
    let (_f, p) = tiny_gguf(|kv| {
        set(kv, "tokenizer.ggml.pre", Some(Value::String("llama-bpe".into())));
        set(kv, "tokenizer.ggml.add_bos_token", Some(Value::Bool(false)));
    });
    assert_eq!(Tokenizer::load(&p).unwrap().encode("ab").unwrap(), [4]);
}

#[test]
fn the_qwen2_and_llama3_splits_differ_on_digit_runs() {
    // One digit per piece (qwen2) vs groups of three (llama-bpe): with a
    // vocabulary holding "12", only llama-bpe can merge the 1 and the 2.
    let vocab = ["1", "2", "3", "12"];
    let make = |pre: &str| {
        tiny_gguf(|kv| {
            set(kv, "tokenizer.ggml.pre", Some(Value::String(pre.into())));
            set(kv, "tokenizer.ggml.add_bos_token", Some(Value::Bool(false)));
            set(kv, "tokenizer.ggml.tokens", Some(strings(&vocab)));
            set(kv, "tokenizer.ggml.merges", Some(strings(&["1 2"])));
            set(kv, "tokenizer.ggml.token_type", None);
        })
    };
    let (_d, q) = make("qwen2");
    let (_e, l) = make("llama-bpe");
    assert_eq!(Tokenizer::load(&q).unwrap().encode("123").unwrap(), [0, 1, 2]);
    assert_eq!(Tokenizer::load(&l).unwrap().encode("123").unwrap(), [3, 2]);
}

#[test]
fn chat_whitespace_follows_trim_blocks_and_lstrip_blocks_as_in_transformers() {
    // Qwen's template strips whitespace itself ({%- -%}); older templates rely
    // on the environment. Expected output rendered by Jinja2 3.1.6 with
    // transformers' settings (ImmutableSandboxedEnvironment(trim_blocks=True,
    // lstrip_blocks=True, extensions=[loopcontrols])).
    let template = "{% for m in messages %}\n  {% if m.role == \"user\" %}\n[{{ m.content }}]\n  {% endif %}\n{% endfor %}\n{% if add_generation_prompt %}\n    <gen>\n{% endif %}\n";
    let d = folder_with_config(&serde_json::json!({ "chat_template": template }));
    let t = Tokenizer::load(d.path()).unwrap();
    assert_eq!(t.render_chat("a").unwrap(), "[a]\n    <gen>\n");
}
