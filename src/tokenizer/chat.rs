//! Chat templates: the model's Jinja template rendered for one user message
//! with the generation prompt, as transformers' `apply_chat_template` renders
//! it. transformers uses a sandboxed Jinja2 environment with `trim_blocks` and
//! `lstrip_blocks`, the `loopcontrols` extension, its own `tojson` filter and
//! the globals `raise_exception` and `strftime_now`, and passes the
//! tokenizer's special tokens (`bos_token`, `eos_token`, ...) as variables.
//! minijinja (by Jinja2's author) implements the same language; its contrib
//! `pycompat` adds the Python string and dict methods templates call
//! (`.strip()`, `.startswith()`, `.items()`, ...).

use std::collections::BTreeMap;
use std::path::Path;

use minijinja::value::{Kwargs, Value};
use minijinja::{Environment, ErrorKind};

use crate::error::{Error, Result};

pub(crate) struct ChatTemplate {
    source: String,
    /// `bos_token`, `eos_token`, ... as the template sees them.
    special: BTreeMap<&'static str, String>,
}

/// The special-token variables transformers passes to a template
/// (`special_tokens_map`, those that are set).
pub(crate) const SPECIAL_NAMES: [&str; 7] = [
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
];

impl ChatTemplate {
    pub(crate) fn new(source: String, special: BTreeMap<&'static str, String>) -> ChatTemplate {
        ChatTemplate { source, special }
    }

    /// From an HF folder: `chat_template.jinja` (where transformers 4.43+
    /// saves it, and which it prefers), else `tokenizer_config.json`'s
    /// `chat_template` (a string, or a list of named templates: `default`).
    pub(crate) fn from_hf_dir(dir: &Path) -> Result<Option<ChatTemplate>> {
        let cfg_path = dir.join("tokenizer_config.json");
        let cfg: serde_json::Value = match std::fs::read_to_string(&cfg_path) {
            Ok(text) => {
                serde_json::from_str(&text).map_err(|e| Error::model(&cfg_path, format!("not valid JSON: {e}")))?
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => serde_json::Value::Null,
            Err(e) => return Err(Error::io(&cfg_path, e)),
        };
        let jinja = dir.join("chat_template.jinja");
        let source = if jinja.is_file() {
            Some(std::fs::read_to_string(&jinja).map_err(|e| Error::io(&jinja, e))?)
        } else {
            match cfg.get("chat_template") {
                None | Some(serde_json::Value::Null) => None,
                Some(serde_json::Value::String(s)) => Some(s.clone()),
                Some(serde_json::Value::Array(list)) => {
                    let named = list
                        .iter()
                        .find(|t| t.get("name").and_then(|n| n.as_str()) == Some("default"));
                    match named.and_then(|t| t.get("template")).and_then(|t| t.as_str()) {
                        Some(s) => Some(s.to_string()),
                        None => {
                            return Err(Error::model(
                                &cfg_path,
                                "`chat_template` is a list without a {name: \"default\", template: \"...\"} entry",
                            ))
                        }
                    }
                }
                Some(other) => {
                    return Err(Error::model(
                        &cfg_path,
                        format!("`chat_template` is a {}, expected a string", json_type(other)),
                    ))
                }
            }
        };
        let Some(source) = source else { return Ok(None) };
        // A special token is a string or an AddedToken dict {"content": ...}.
        let mut special = BTreeMap::new();
        for name in SPECIAL_NAMES {
            let v = match cfg.get(name) {
                Some(serde_json::Value::String(s)) => Some(s.clone()),
                Some(serde_json::Value::Object(o)) => o.get("content").and_then(|c| c.as_str()).map(String::from),
                _ => None,
            };
            if let Some(v) = v {
                special.insert(name, v);
            }
        }
        Ok(Some(ChatTemplate { source, special }))
    }

    /// One user message, then the assistant's turn opened.
    pub(crate) fn render_user(&self, user: &str) -> std::result::Result<String, String> {
        let mut env = Environment::new();
        env.set_syntax(
            minijinja::syntax::SyntaxConfig::builder()
                .trim_blocks(true)
                .lstrip_blocks(true)
                .build()
                .expect("the default delimiters are valid"),
        );
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function(
            "raise_exception",
            |msg: String| -> std::result::Result<Value, minijinja::Error> {
                Err(minijinja::Error::new(ErrorKind::InvalidOperation, msg))
            },
        );
        // A prompt that depends on today's date would make goldens stale the next day.
        env.add_function(
            "strftime_now",
            |_fmt: String| -> std::result::Result<Value, minijinja::Error> {
                Err(minijinja::Error::new(
                    ErrorKind::InvalidOperation,
                    "strftime_now: the template writes today's date into the prompt, which would change the \
                 prompt (and its goldens) every day; give `prompt.tokens` instead",
                ))
            },
        );
        env.add_filter("tojson", tojson);
        let tmpl = env
            .template_from_str(&self.source)
            .map_err(|e| format!("the chat template does not parse: {}", describe(&e)))?;
        let mut ctx: BTreeMap<&str, Value> = self
            .special
            .iter()
            .map(|(k, v)| (*k, Value::from(v.as_str())))
            .collect();
        ctx.insert(
            "messages",
            Value::from(vec![Value::from_pairs([
                ("role", Value::from("user")),
                ("content", Value::from(user)),
            ])]),
        );
        ctx.insert("add_generation_prompt", Value::from(true));
        ctx.insert("tools", Value::from(()));
        ctx.insert("documents", Value::from(()));
        tmpl.render(ctx)
            .map_err(|e| format!("the chat template failed to render: {}", describe(&e)))
    }
}

fn describe(e: &minijinja::Error) -> String {
    let mut s = e.to_string();
    let mut src = std::error::Error::source(e);
    while let Some(inner) = src {
        s.push_str(&format!(": {inner}"));
        src = inner.source();
    }
    s
}

fn json_type(v: &serde_json::Value) -> &'static str {
    match v {
        serde_json::Value::Null => "null",
        serde_json::Value::Bool(_) => "bool",
        serde_json::Value::Number(_) => "number",
        serde_json::Value::String(_) => "string",
        serde_json::Value::Array(_) => "list",
        serde_json::Value::Object(_) => "dict",
    }
}

/// transformers' `tojson`: `json.dumps(x, ensure_ascii=False, indent=indent,
/// separators=separators, sort_keys=sort_keys)`: Python's separators (`", "`
/// and `": "`), no HTML escaping (minijinja's built-in escapes `<` for HTML
/// pages, which would change a prompt).
fn tojson(value: Value, kwargs: Kwargs) -> std::result::Result<Value, minijinja::Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    // `separators` is accepted for compatibility; Python's defaults are used.
    let _: Option<Value> = kwargs.get("separators")?;
    kwargs.assert_all_used()?;
    let mut out = String::new();
    write_py_json(&mut out, &value, indent, sort_keys.unwrap_or(false), 0)?;
    Ok(Value::from(out))
}

/// Python's `json.dumps` layout, walking the template value itself so that
/// a dict keeps its insertion order, as in Python.
fn write_py_json(
    out: &mut String,
    v: &Value,
    indent: Option<usize>,
    sort: bool,
    depth: usize,
) -> std::result::Result<(), minijinja::Error> {
    use minijinja::value::ValueKind as K;
    let newline = |out: &mut String, d: usize| {
        if let Some(n) = indent {
            out.push('\n');
            out.push_str(&" ".repeat(n * d));
        }
    };
    let item_sep = if indent.is_some() { "," } else { ", " };
    let quote = |s: &str| serde_json::to_string(s).expect("a string serialises");
    match v.kind() {
        K::Undefined | K::None => out.push_str("null"),
        K::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
        K::Number => out.push_str(&v.to_string()),
        K::String => out.push_str(&quote(v.as_str().unwrap_or_default())),
        K::Map => {
            let mut keys: Vec<Value> = v.try_iter()?.collect();
            if sort {
                keys.sort();
            }
            if keys.is_empty() {
                out.push_str("{}");
                return Ok(());
            }
            out.push('{');
            for (i, k) in keys.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline(out, depth + 1);
                out.push_str(&quote(&k.to_string()));
                out.push_str(": ");
                write_py_json(out, &v.get_item(k)?, indent, sort, depth + 1)?;
            }
            newline(out, depth);
            out.push('}');
        }
        _ => {
            let items: Vec<Value> = v.try_iter()?.collect();
            if items.is_empty() {
                out.push_str("[]");
                return Ok(());
            }
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline(out, depth + 1);
                write_py_json(out, item, indent, sort, depth + 1)?;
            }
            newline(out, depth);
            out.push(']');
        }
    }
    Ok(())
}
