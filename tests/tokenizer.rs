//! Our token ids against the references' on committed fixtures
//! (`tests/fixtures/tokenizer.json`, made by
//! `goldens/recorders/make_tokenizer_fixtures.py`: HF transformers from the
//! model folder and from the GGUF, and llama.cpp's `llama_tokenize`).
//!
//! One trial per (model, loader, text), named
//! `tokenizer::<model>::<loader>::<plain|chat|decode>::<text>` (under
//! cargo-nextest one per name without its text, every text in one process:
//! `grouped` below):
//! - loader `dir` (the folder's tokenizer.json) must give `hf_dir`'s ids;
//! - loader `gguf` (the GGUF's own vocabulary) must give `llamacpp`'s ids (the
//!   GGUF's runtime) and `hf_gguf`'s, except where the two references differ
//!   from each other, listed in `KNOWN` with the reason and the exact shape of
//!   the difference (checked, so a changed reference is caught);
//! - `chat`: our rendering of the chat template is HF's, byte for byte, and
//!   its ids are HF's and llama.cpp's;
//! - `decode`: our text for HF's ids is HF's decoded text.
//!
//! `qwen2-tiny-chat` is the tiny Qwen2 tokenizer.json with the real model's
//! chat template in its tokenizer_config.json (rebuilt from the fixture): the
//! folder's template path, checked against HF's `apply_chat_template`.
//!
//! `tokenizer::<model>::references` checks which texts the references
//! disagree on, so the fixture's disagreements are stated here, not hidden.
//!
//! The real model (Qwen2.5-Coder-0.5B-Instruct Q4_K_M, fetched by
//! ci/fetch_real_model.py into `$TOUCHSTONE_CACHE/models`) is not committed:
//! without it, its trials are reported ignored with the reason.
//!
//! SentencePiece (`tokenizer.ggml.model` = `llama`), section `spm` of the
//! fixture: `tokenizer::spm::<vocabulary>::<plain|decode>::<text>`, our ids
//! for each text against llama.cpp's, and our decoding of llama.cpp's ids
//! against `llama_detokenize`'s text (all ids, and the ids between the BOS
//! and EOS it added). The vocabularies: two tiny ones committed under
//! tests/fixtures/tokenizer-spm/ (`add_space_prefix` true and false), and
//! Gemma 3 270M's, read from `$TOUCHSTONE_CACHE/models` (not committed;
//! without it, its trials are reported ignored with the reason).
//! `tokenizer::spm::<vocabulary>::round_trip` states which texts llama.cpp
//! does not give back, and why (`SPM_NOT_ROUND_TRIP`).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

use grouped::Trial;
use libtest_mimic::{Arguments, Completion, Failed};
use serde_json::Value;
use touchstone::golden::provenance::HashCache;
use touchstone::tokenizer::Tokenizer;

const FIXTURE: &str = "tests/fixtures/tokenizer.json";
const REAL: &str = "qwen2.5-coder-0.5b-instruct-q4_k_m";

/// Where the references themselves disagree, and why. `(model, source)`: the
/// exact relation between our ids (= llama.cpp's) and that source's.
#[derive(Clone, Copy)]
enum Known {
    /// Ours = `[id] ++ theirs`: llama.cpp prepends a BOS the other does not.
    LeadingBos(u32),
}
const KNOWN: [(&str, &str, Known, &str); 1] = [(
    "llama-tiny",
    "hf_gguf",
    Known::LeadingBos(11),
    "the GGUF says pre `llama-bpe` with no `add_bos_token` and no `bos_token_id`: llama.cpp then adds a BOS \
     (its llama-bpe default) with id 11 (its gpt2 default), transformers' GGUF conversion adds none",
)];

/// Texts on which the HF folder (`hf_dir`) and the GGUF references disagree,
/// per model, with the reason: checked by the `references` trial.
const NFC_TEXTS: [&str; 1] = ["combining_accents"];
const NFC_REASON: &str = "HF's tokenizer.json normalises to NFC (e + U+0301 -> é); llama.cpp and transformers' \
                          GGUF conversion do not normalise";

fn ids(v: &Value) -> Option<Vec<u32>> {
    v.as_array()?.iter().map(|x| x.as_u64().map(|n| n as u32)).collect()
}

fn real_model_path() -> PathBuf {
    cached_model(REAL)
}

/// `$TOUCHSTONE_CACHE/models/<name>.gguf` (default cache `~/.cache/touchstone`).
fn cached_model(name: &str) -> PathBuf {
    let base = std::env::var_os("TOUCHSTONE_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(std::env::var_os("HOME").unwrap_or_default())
                .join(".cache")
                .join("touchstone")
        });
    base.join("models").join(format!("{name}.gguf"))
}

/// A tokenizer loaded once for all trials that use it; the files are first
/// checked against the sha256 the fixture was recorded with.
struct Loaded {
    path: PathBuf,
    files: Vec<(PathBuf, String)>,
    cell: OnceLock<Result<Tokenizer, String>>,
}

impl Loaded {
    fn get(&self) -> Result<&Tokenizer, Failed> {
        self.cell
            .get_or_init(|| {
                for (file, want) in &self.files {
                    // Remembered across processes (the hash cache): under
                    // nextest every trial is a process, and hashing the real
                    // model each time would cost seconds per trial.
                    let have = HashCache::in_cache_dir()
                        .sha256(file)
                        .map_err(|e| format!("{}: {e}", file.display()))?;
                    if &have != want {
                        return Err(format!(
                            "{} has sha256 {have}, the fixture was recorded from {want}: regenerate {FIXTURE} \
                             (goldens/recorders/make_tokenizer_fixtures.py)",
                            file.display()
                        ));
                    }
                }
                Tokenizer::load(&self.path).map_err(|e| e.to_string())
            })
            .as_ref()
            .map_err(|e| Failed::from(e.as_str()))
    }
}

fn check(ok: bool, msg: impl FnOnce() -> String) -> Result<(), Failed> {
    if ok {
        Ok(())
    } else {
        Err(msg().into())
    }
}

fn main() {
    let args = Arguments::from_args();
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let text = std::fs::read_to_string(root.join(FIXTURE)).expect("the committed fixture");
    let doc: Value = serde_json::from_str(&text).expect("fixture is JSON");
    let texts: BTreeMap<String, String> = serde_json::from_value(doc["texts"].clone()).expect("texts");
    let texts = Arc::new(texts);
    let mut trials = Vec::new();

    let models = doc["models"].as_object().expect("models");
    let real_missing = (!models.contains_key(REAL)).then(|| format!("{FIXTURE} has no `{REAL}` section"));
    for (name, m) in models {
        let m = Arc::new(m.clone());
        let files = |keys: &[&str], base: &Path| -> Vec<(PathBuf, String)> {
            keys.iter()
                .filter_map(|k| {
                    let sha = m["files"][*k].as_str()?;
                    let p = if *k == "gguf" { base.to_path_buf() } else { base.join(k) };
                    Some((p, sha.to_string()))
                })
                .collect()
        };
        // (loader name, loader, reason to ignore)
        let mut loaders: Vec<(&str, Arc<Loaded>, Option<String>)> = Vec::new();
        if name == REAL {
            let gguf = real_model_path();
            let ignore = (!gguf.exists()).then(|| {
                format!(
                    "the real model is not at {} (fetch it: python3 ci/fetch_real_model.py)",
                    gguf.display()
                )
            });
            let f = files(&["gguf"], &gguf);
            loaders.push((
                "gguf",
                Arc::new(Loaded {
                    path: gguf,
                    files: f,
                    cell: OnceLock::new(),
                }),
                ignore,
            ));
        } else if let Some(config) = m.get("tokenizer_config") {
            // qwen2-tiny-chat: the tiny Qwen2 tokenizer.json with the real
            // model's chat template in tokenizer_config.json, checks the
            // folder's template path against HF (the fixture holds the config).
            let dir = root.join("goldens").join("qwen2-tiny");
            // (Under cargo's per-target scratch folder, rewritten each run:
            // libtest-mimic exits the process, so a TempDir would never be removed.)
            let tmp = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("tokenizer-{name}"));
            // Every process writes them (nextest runs each trial in its own, at
            // once): written beside and renamed into place, a reader never sees
            // a half-written file.
            std::fs::create_dir_all(&tmp).expect("a scratch folder");
            let tokenizer = std::fs::read(dir.join("model/tokenizer.json")).expect("the tiny tokenizer.json");
            write_atomic(&tmp.join("tokenizer.json"), &tokenizer);
            write_atomic(&tmp.join("tokenizer_config.json"), config.to_string().as_bytes());
            let f = files(&["model/tokenizer.json"], &dir);
            loaders.push((
                "dir",
                Arc::new(Loaded {
                    path: tmp,
                    files: f,
                    cell: OnceLock::new(),
                }),
                None,
            ));
        } else {
            let dir = root.join("goldens").join(name);
            let folder = dir.join("model");
            let f = files(&["model/tokenizer.json", "model/tokenizer_config.json"], &dir);
            loaders.push((
                "dir",
                Arc::new(Loaded {
                    path: folder,
                    files: f,
                    cell: OnceLock::new(),
                }),
                None,
            ));
            let gguf = dir.join("model.gguf");
            let f = files(&["gguf"], &gguf);
            loaders.push((
                "gguf",
                Arc::new(Loaded {
                    path: gguf,
                    files: f,
                    cell: OnceLock::new(),
                }),
                None,
            ));
        }

        for (loader, tok, ignore) in &loaders {
            let mut add = |kind: &str, key: &str, f: Box<dyn FnOnce() -> Result<(), Failed> + Send>| {
                let tname = format!("tokenizer::{name}::{loader}::{kind}::{key}");
                match ignore {
                    Some(r) => {
                        let r = r.clone();
                        trials.push(Trial::ignorable_test(tname, move || Ok(Completion::ignored_with(r))))
                    }
                    None => trials.push(Trial::test(tname, f)),
                }
            };
            let plain = m["plain"].as_object().cloned().unwrap_or_default();
            for (key, row) in plain {
                let (tok, texts, loader, model) = (tok.clone(), texts.clone(), loader.to_string(), name.clone());
                let label = key.clone();
                add(
                    "plain",
                    &label,
                    Box::new(move || {
                        let text = texts.get(&key).ok_or("text missing from the fixture")?;
                        let ours = tok.get()?.encode(text).map_err(|e| e.to_string())?;
                        let wanted: &[&str] = if loader == "dir" {
                            &["hf_dir"]
                        } else {
                            &["llamacpp", "hf_gguf"]
                        };
                        for src in wanted {
                            let theirs = ids(&row[*src]).ok_or_else(|| {
                                format!("fixture lacks source `{src}` for {model}/{key}: regenerate {FIXTURE}")
                            })?;
                            let known = KNOWN.iter().find(|(km, ks, _, _)| *km == model && ks == src);
                            match known {
                                None => check(ours == theirs, || format!("{text:?}: ours {ours:?}\n{src} {theirs:?}"))?,
                                Some((_, _, Known::LeadingBos(bos), why)) => {
                                    let expect: Vec<u32> =
                                        std::iter::once(*bos).chain(theirs.iter().copied()).collect();
                                    check(ours == expect, || {
                                        format!(
                                            "{text:?}: ours {ours:?}\n{src} {theirs:?}\nexpected ours = [{bos}] + {src} ({why})"
                                        )
                                    })?
                                }
                            }
                        }
                        Ok(())
                    }),
                );
            }
            let chat = m["chat"].as_object().cloned().unwrap_or_default();
            for (key, row) in chat {
                let (tok, texts, m) = (tok.clone(), texts.clone(), m.clone());
                let label = key.clone();
                add(
                    "chat",
                    &label,
                    Box::new(move || {
                        let text = texts.get(&key).ok_or("text missing from the fixture")?;
                        let t = tok.get()?;
                        let rendered = t.render_chat(text).map_err(|e| e.to_string())?;
                        let want = m["rendered"][&key].as_str().ok_or("rendered text missing")?;
                        check(rendered == want, || {
                            format!("rendered:\n{rendered:?}\nHF rendered:\n{want:?}")
                        })?;
                        let ours = t.encode_chat(text).map_err(|e| e.to_string())?;
                        for (src, v) in row.as_object().ok_or("chat row")? {
                            let theirs = ids(v).ok_or("ids")?;
                            check(ours == theirs, || {
                                format!("chat {text:?}: ours {ours:?}\n{src} {theirs:?}")
                            })?;
                        }
                        Ok(())
                    }),
                );
            }
            // HF decoded its own first source's ids: decode those with the loader that matches it.
            let decoded = m["decoded"].as_object().cloned().unwrap_or_default();
            for (key, row) in decoded {
                let Some((src, want)) = row.as_object().and_then(|o| o.iter().next()) else {
                    continue;
                };
                let matches = (src == "hf_dir" && *loader == "dir") || (src == "hf_gguf" && *loader == "gguf");
                if !matches {
                    continue;
                }
                let (tok, m, src, want) = (
                    tok.clone(),
                    m.clone(),
                    src.clone(),
                    want.as_str().unwrap_or("").to_string(),
                );
                let label = key.clone();
                add(
                    "decode",
                    &label,
                    Box::new(move || {
                        let theirs = ids(&m["plain"][&key][&src]).ok_or("ids")?;
                        let ours = tok.get()?.decode(&theirs);
                        check(ours == want, || {
                            format!("decode {theirs:?}:\nours {ours:?}\nHF   {want:?}")
                        })
                    }),
                );
            }
        }

        // Which texts the references disagree on, stated.
        let (model, m2) = (name.clone(), m.clone());
        let tname = format!("tokenizer::{name}::references");
        let f = move || -> Result<(), Failed> {
            let mut problems = Vec::new();
            for (key, row) in m2["plain"].as_object().ok_or("plain")? {
                let get = |s: &str| ids(&row[s]);
                if let (Some(a), Some(b)) = (get("llamacpp"), get("hf_gguf")) {
                    let bos = KNOWN.iter().find(|(km, ks, _, _)| *km == model && *ks == "hf_gguf");
                    let expect_a = match bos {
                        Some((_, _, Known::LeadingBos(id), _)) => {
                            std::iter::once(*id).chain(b.iter().copied()).collect()
                        }
                        None => b.clone(),
                    };
                    if a != expect_a {
                        problems.push(format!("{key}: llamacpp {a:?} vs hf_gguf {b:?}"));
                    }
                }
                if let (Some(d), Some(g)) = (get("hf_dir"), get("hf_gguf")) {
                    let nfc = NFC_TEXTS.contains(&key.as_str());
                    if (d == g) == nfc {
                        problems.push(format!(
                            "{key}: hf_dir {d:?} vs hf_gguf {g:?}: expected them to {} ({NFC_REASON})",
                            if nfc { "differ" } else { "agree" }
                        ));
                    }
                }
            }
            check(problems.is_empty(), || problems.join("\n"))
        };
        // Fixture data only: runs whether or not the real model is here.
        trials.push(Trial::test(tname, f));
    }
    trials.extend(pre_tokenizer_trials(root, &doc, &texts));
    trials.extend(spm_trials(root, &doc));
    trials.push(Trial::test(
        "tokenizer::report::prompt_and_continuation_as_text",
        move || report_text(root),
    ));
    if let Some(r) = real_missing {
        trials.push(Trial::test(
            format!("tokenizer::{REAL}::fixture"),
            move || Err(r.into()),
        ));
    }
    libtest_mimic::run(&args, grouped::into_trials(trials)).exit();
}

/// One trial per vocabulary and pre-tokenizer name of the fixture's
/// `pre_tokenizers` section: the GGUF vocabulary under that `tokenizer.ggml.pre`
/// (metadata only, rewritten here as the fixture script rewrote it for
/// llama.cpp) must tokenise every text to llama.cpp's ids. A name we do not
/// implement would fail to load: every name in the fixture is claimed.
fn pre_tokenizer_trials(root: &Path, doc: &Value, texts: &Arc<BTreeMap<String, String>>) -> Vec<Trial> {
    let Some(vocabularies) = doc.get("pre_tokenizers").and_then(Value::as_object) else {
        return vec![Trial::test("tokenizer::pre_tokenizers", || {
            Err(format!("{FIXTURE} has no `pre_tokenizers` section: regenerate it with llama.cpp").into())
        })];
    };
    let mut trials = Vec::new();
    for (vocab, section) in vocabularies {
        let src = if vocab == REAL {
            real_model_path()
        } else {
            root.join("goldens").join(vocab).join("model.gguf")
        };
        trials.extend(pre_trials_of(vocab, src, section, texts));
    }
    trials
}

/// The trials of one vocabulary (ignored, with why, when its GGUF is absent).
fn pre_trials_of(vocab: &str, src: PathBuf, section: &Value, texts: &Arc<BTreeMap<String, String>>) -> Vec<Trial> {
    use touchstone::gguf::writer::GgufWriter;
    use touchstone::gguf::{GgufFile, Value as Gv};
    let keys: Vec<String> = serde_json::from_value(section["texts"].clone()).unwrap_or_default();
    let want_sha = section["gguf"].as_str().unwrap_or_default().to_string();
    let by_name = section["ids"].as_object().cloned().unwrap_or_default();
    by_name
        .into_iter()
        .map(|(pre, by_text)| {
            let name = format!("tokenizer::pre_tokenizers::{vocab}::{pre}");
            if !src.exists() {
                let why = format!(
                    "{} is not here (fetch it: python3 ci/fetch_real_model.py)",
                    src.display()
                );
                return Trial::ignorable_test(name, move || Ok(Completion::ignored_with(why)));
            }
            let (src, keys, texts, want_sha) = (src.clone(), keys.clone(), texts.clone(), want_sha.clone());
            Trial::test(name, move || {
                let have = HashCache::in_cache_dir()
                    .sha256(&src)
                    .map_err(|e| format!("{}: {e}", src.display()))?;
                check(have == want_sha, || {
                    format!(
                        "{} changed since the fixture was recorded: regenerate {FIXTURE}",
                        src.display()
                    )
                })?;
                let f = GgufFile::open(&src).map_err(|e| e.to_string())?;
                let mut w = GgufWriter::new();
                for (k, v) in &f.metadata {
                    let v = if k == "tokenizer.ggml.pre" {
                        Gv::String(pre.clone())
                    } else {
                        v.clone()
                    };
                    w.kv(k, v);
                }
                let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
                let path = dir.path().join(format!("pre-{pre}.gguf"));
                w.write(&path).map_err(|e| e.to_string())?;
                let tok = Tokenizer::load(&path).map_err(|e| e.to_string())?;
                let mut problems = Vec::new();
                for key in &keys {
                    let text = texts.get(key).ok_or("text missing from the fixture")?;
                    let want = ids(&by_text[key]).ok_or("ids missing from the fixture")?;
                    let got = tok.encode(text).map_err(|e| e.to_string())?;
                    if got != want {
                        problems.push(format!("{key} ({text:?}): ours {got:?}, llama.cpp {want:?}"));
                    }
                }
                check(problems.is_empty(), || {
                    format!("pre-tokenizer {pre}:\n{}", problems.join("\n"))
                })
            })
        })
        .collect()
}

/// A text-prompt spec on the tiny Qwen2: the plan's prompt is the text's ids,
/// and the report shows the prompt and the engine's continuation as text
/// (terminal lines and JSON fields), the continuation being the decoding of
/// the engine's sampled tokens.
fn report_text(root: &Path) -> Result<(), Failed> {
    use touchstone::engine::registry::EngineSel;
    use touchstone::plan::Plan;
    use touchstone::report::{json, terminal, Report};
    use touchstone::spec::Spec;

    let spec_path = root.join("specs").join("text-prompt-test.yaml");
    let yaml = "model: ../goldens/qwen2-tiny/model\nprompt: {text: \"def fib(n):\\n\", decode_steps: 3}\nsampling: greedy\nseed: 1\nstages:\n  \"logits\": [finite]\n";
    let spec = Spec::parse(&spec_path, yaml).map_err(|e| e.to_string())?;
    let plan = Plan::build(spec, None).map_err(|e| e.to_string())?;
    let tok = Tokenizer::load(&root.join("goldens/qwen2-tiny/model")).map_err(|e| e.to_string())?;
    let ids = tok.encode("def fib(n):\n").map_err(|e| e.to_string())?;
    check(plan.prompt == ids, || {
        format!("plan prompt {:?}, tokenizer {ids:?}", plan.prompt)
    })?;
    let run = touchstone::runner::run_all(&plan, &EngineSel::Cpu).map_err(|e| e.to_string())?;
    check(run.prompt_text.as_deref() == Some("def fib(n):\n"), || {
        format!("prompt_text {:?}", run.prompt_text)
    })?;
    let cont = run.continuation_text.clone().ok_or("no continuation_text")?;
    check(!cont.is_empty() && !cont.contains('\u{FFFD}'), || {
        format!("continuation {cont:?}")
    })?;
    let report = Report { runs: vec![run] };
    let text = terminal::render(&report);
    check(text.contains("\nprompt: \"def fib(n):\\n\"\n"), || text.clone())?;
    check(text.contains(&format!("\ncontinuation: {cont:?}\n")), || text.clone())?;
    let doc: Value = serde_json::from_str(&json::to_string(&report)).map_err(|e| e.to_string())?;
    check(doc["runs"][0]["prompt_text"] == "def fib(n):\n", || {
        doc["runs"][0].to_string()
    })?;
    check(doc["runs"][0]["continuation_text"] == cont.as_str(), || {
        doc["runs"][0].to_string()
    })
}

/// Gemma 3 270M (Q4_K_M GGUF), whose SentencePiece vocabulary the `spm`
/// section records; not committed, read from the cache when it is there.
const GEMMA: &str = "gemma-3-270m-q4_k_m";

/// Texts llama.cpp does not give back from its own ids (`decoded_body` is
/// not the text), per vocabulary, and why: checked against the fixture by
/// `tokenizer::spm::<vocabulary>::round_trip`, so every such text is stated
/// here. Our decoding equals llama.cpp's on every text (the `decode` trials),
/// so ours round-trips exactly where llama.cpp's does.
const SPM_NOT_ROUND_TRIP: &[(&str, &[&str], &str)] = &[
    (
        "*",
        &["literal_escape_char"],
        "the text holds U+2581 itself, which SentencePiece cannot tell from an escaped space: it decodes as a space",
    ),
    (
        "spm-tiny-prefix",
        &[
            "python_code",
            "leading_trailing_spaces",
            "empty_line_run",
            "only_newlines",
            "real_spec_prompt",
            "space_runs",
            "gemma_chat",
            "specials_inline",
            "forced_control",
            "user_defined_runs",
        ],
        "with add_space_prefix, each piece of text after a special token (control or user-defined, such as the \
         vocabulary's `  ` and `\\n\\n` tokens) gets its own space prefix, and decoding drops only the first token's",
    ),
    (
        GEMMA,
        &["forced_control"],
        "`\u{2581}<PRE>` is written with U+2581, which decodes as a space (Gemma has no such token)",
    ),
];

/// The `spm` section's trials: per vocabulary, each text's ids and decoding
/// against llama.cpp's, and the round-trip statement.
fn spm_trials(root: &Path, doc: &Value) -> Vec<Trial> {
    let Some(spm) = doc.get("spm").filter(|v| v.is_object()) else {
        return vec![Trial::test("tokenizer::spm", || {
            Err(format!("{FIXTURE} has no `spm` section: regenerate it with llama.cpp").into())
        })];
    };
    let texts: Arc<BTreeMap<String, String>> =
        Arc::new(serde_json::from_value(spm["texts"].clone()).unwrap_or_default());
    let vocabularies = spm["vocabularies"].as_object().cloned().unwrap_or_default();
    let mut trials = Vec::new();
    if !vocabularies.contains_key(GEMMA) {
        trials.push(Trial::test(format!("tokenizer::spm::{GEMMA}::fixture"), || {
            Err(format!("{FIXTURE} has no `spm` vocabulary `{GEMMA}`: regenerate it with --gemma-gguf").into())
        }));
    }
    for (vocab, v) in vocabularies {
        let v = Arc::new(v);
        let path = if vocab == GEMMA {
            cached_model(GEMMA)
        } else {
            root.join(v["gguf"].as_str().unwrap_or_default())
        };
        let ignore = (vocab == GEMMA && !path.exists()).then(|| {
            format!(
                "the Gemma 3 270M GGUF is not at {} (ci/fetch_real_model.py does not fetch it; put {GEMMA}.gguf there)",
                path.display()
            )
        });
        let sha = v["sha256"].as_str().unwrap_or_default().to_string();
        let tok = Arc::new(Loaded {
            path: path.clone(),
            files: vec![(path, sha)],
            cell: OnceLock::new(),
        });
        let (bos, eos) = (v["bos"].as_u64(), v["eos"].as_u64());
        for key in texts.keys() {
            let plain = {
                let (tok, texts, v, key) = (tok.clone(), texts.clone(), v.clone(), key.clone());
                move || -> Result<(), Failed> {
                    let text = &texts[&key];
                    let want = ids(&v["ids"][&key]).ok_or("ids missing from the fixture")?;
                    let ours = tok.get()?.encode(text).map_err(|e| e.to_string())?;
                    check(ours == want, || format!("{text:?}: ours {ours:?}\nllama.cpp {want:?}"))
                }
            };
            let decode = {
                let (tok, v, key) = (tok.clone(), v.clone(), key.clone());
                move || -> Result<(), Failed> {
                    let all = ids(&v["ids"][&key]).ok_or("ids missing from the fixture")?;
                    let mut body: &[u32] = &all;
                    if let (Some(b), Some((&first, rest))) = (bos, body.split_first()) {
                        body = if u64::from(first) == b { rest } else { body };
                    }
                    if let (Some(e), Some((&last, rest))) = (eos, body.split_last()) {
                        body = if u64::from(last) == e { rest } else { body };
                    }
                    let t = tok.get()?;
                    for (ids, field) in [(&all[..], "decoded"), (body, "decoded_body")] {
                        let want = v[field][&key].as_str().ok_or("decoded text missing from the fixture")?;
                        let ours = t.decode(ids);
                        check(ours == want, || {
                            format!("decode {ids:?}:\nours      {ours:?}\nllama.cpp {want:?}")
                        })?;
                    }
                    Ok(())
                }
            };
            for (kind, f) in [
                (
                    "plain",
                    Box::new(plain) as Box<dyn FnOnce() -> Result<(), Failed> + Send>,
                ),
                ("decode", Box::new(decode)),
            ] {
                let name = format!("tokenizer::spm::{vocab}::{kind}::{key}");
                trials.push(match &ignore {
                    Some(r) => {
                        let r = r.clone();
                        Trial::ignorable_test(name, move || Ok(Completion::ignored_with(r)))
                    }
                    None => Trial::test(name, f),
                });
            }
        }
        // Fixture data only: runs whether or not the model is here.
        let (texts, vocab2) = (texts.clone(), vocab.clone());
        trials.push(Trial::test(format!("tokenizer::spm::{vocab}::round_trip"), move || {
            let mut problems = Vec::new();
            for (key, text) in texts.iter() {
                let back = v["decoded_body"][key]
                    .as_str()
                    .ok_or("decoded_body missing from the fixture")?;
                let listed = SPM_NOT_ROUND_TRIP
                    .iter()
                    .find(|(vs, keys, _)| (*vs == "*" || *vs == vocab2) && keys.contains(&key.as_str()));
                match (back == text, listed) {
                    (true, Some((_, _, why))) => {
                        problems.push(format!("{key}: llama.cpp gives it back, yet it is listed ({why})"))
                    }
                    (false, None) => problems.push(format!(
                        "{key}: llama.cpp decodes {text:?} to {back:?}: list it in SPM_NOT_ROUND_TRIP with why"
                    )),
                    _ => {}
                }
            }
            check(problems.is_empty(), || problems.join("\n"))
        }));
    }
    trials
}

/// `bytes` into `path` through a file of this process renamed over it.
fn write_atomic(path: &Path, bytes: &[u8]) {
    let part = path.with_extension(format!("part-{}", std::process::id()));
    std::fs::write(&part, bytes).expect("write a scratch file");
    std::fs::rename(&part, path).expect("rename a scratch file into place");
}

/// The trials of this file, one per case under `cargo test` and one per
/// group of cases under cargo-nextest, where every trial is a process: the
/// cases of one (model, loader, kind) share a tokenizer loaded once (a
/// real model's vocabulary takes 0.1 to 0.2 s to load), and 414 processes
/// cost more than the cases they run. A group is a name without its last
/// `::` part (`tokenizer::spm::gemma-3-270m::plain`); a group of one keeps
/// its case's name. A failing group prints every failing case's message.
mod grouped {
    use std::collections::BTreeMap;

    use libtest_mimic::{Completion, Failed};
    use touchstone::harness::unit::{combined, under_nextest, Verdict};

    type Run = Box<dyn FnOnce() -> Result<Completion, Failed> + Send>;

    /// A case, built as libtest-mimic's `Trial` is.
    pub struct Trial {
        name: String,
        run: Run,
    }

    impl Trial {
        pub fn test(name: impl Into<String>, f: impl FnOnce() -> Result<(), Failed> + Send + 'static) -> Trial {
            Trial {
                name: name.into(),
                run: Box::new(move || f().map(|()| Completion::Completed)),
            }
        }
        pub fn ignorable_test(
            name: impl Into<String>,
            f: impl FnOnce() -> Result<Completion, Failed> + Send + 'static,
        ) -> Trial {
            Trial {
                name: name.into(),
                run: Box::new(f),
            }
        }
    }

    pub fn into_trials(cases: Vec<Trial>) -> Vec<libtest_mimic::Trial> {
        if !under_nextest() {
            return cases
                .into_iter()
                .map(|c| libtest_mimic::Trial::ignorable_test(c.name, c.run))
                .collect();
        }
        let mut groups: BTreeMap<String, Vec<Trial>> = BTreeMap::new();
        for c in cases {
            let group = c.name.rsplit_once("::").map_or(c.name.as_str(), |(g, _)| g).to_string();
            groups.entry(group).or_default().push(c);
        }
        groups
            .into_iter()
            .map(|(group, mut members)| {
                if members.len() == 1 {
                    let c = members.pop().expect("one member");
                    return libtest_mimic::Trial::ignorable_test(c.name, c.run);
                }
                libtest_mimic::Trial::ignorable_test(group, move || run_all(members))
            })
            .collect()
    }

    /// Every member, in order, judged as the conformance harness judges a
    /// trial of several checks (`harness::unit::combined`).
    fn run_all(members: Vec<Trial>) -> Result<Completion, Failed> {
        let verdicts: Vec<(String, Verdict)> = members
            .into_iter()
            .map(|c| {
                let v = match (c.run)() {
                    Ok(Completion::Completed) => Verdict::Pass,
                    Ok(Completion::Ignored { reason }) => Verdict::Ignored(reason.unwrap_or_default()),
                    Err(e) => Verdict::Fail(e.message().unwrap_or("(no message)").to_string()),
                };
                (c.name, v)
            })
            .collect();
        let refs: Vec<(&str, &Verdict)> = verdicts.iter().map(|(n, v)| (n.as_str(), v)).collect();
        match combined(&refs) {
            Verdict::Pass => Ok(Completion::Completed),
            Verdict::Ignored(why) => Ok(Completion::ignored_with(why)),
            Verdict::Fail(msg) => Err(msg.into()),
        }
    }
}
