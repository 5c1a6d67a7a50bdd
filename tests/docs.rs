//! Every command the docs show is checked here, so the docs cannot drift from
//! the binary: one trial per command, named `docs::<file>:<line>`.
//!
//! The docs are `README.md` and `docs/*.md`. Shell examples are fenced
//! ```` ```console ```` blocks; each line starting with `$ ` is a command, and
//! the lines after it are what it prints (not compared). Right after a command,
//! `# exit N` gives its expected exit status (default 0) and `# prints: TEXT`
//! a text its output must contain.
//!
//! - `touchstone …` (or `cargo run --release -- …`) runs the binary from the
//!   repository root, `CI` removed from its environment, and must exit as
//!   stated. Files it writes (`--json` and the other report flags,
//!   `--save-captures`) must go under `target/`.
//! - A command that cannot run in a test (it needs the Python recorders, a GPU
//!   or NVRTC, Python with numpy, the real 0.5B model, takes minutes, or writes
//!   goldens) sits in a ```` ```console no-run ```` block: it is parsed with the
//!   binary's own argument parser instead, and every repository path in it must
//!   exist. `no_run_reason` says which commands those are; a command that could
//!   run in a `no-run` block, or one that cannot in a plain block, fails.
//! - Any other command must be on the `OTHERS` allowlist, with the reason it can
//!   be trusted, and passes the checks listed there (paths exist, flags exist).
//!
//! A `yaml` block with a top-level `model:` is a spec: it must parse and plan
//! as a file in `specs/` would (a trial named after the block's line).
//!
//! One more trial per file (`docs::<file>::links`) checks that every relative
//! link (and `#anchor`) and every repository path written in inline code
//! exists, and that every fence has a known info string. `docs::README.md::size` keeps the
//! README at most 12,000 bytes, saying `cargo test`, and linking every page of
//! `docs/`.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, Mutex};

use clap::Parser;
use libtest_mimic::{Arguments, Failed, Trial};

/// Fence info strings a doc may use.
const INFO_STRINGS: [&str; 7] = ["console", "console no-run", "yaml", "rust", "text", "toml", "json"];

/// Links that may point at a file not in the repository yet (none now).
const FORWARD: [&str; 0] = [];

/// The largest README accepted (bytes).
const README_MAX: usize = 12_000;

/// Report flags whose value is a file the command writes.
const OUTPUT_FLAGS: [&str; 5] = ["--json", "--junit", "--markdown", "--html", "--save-captures"];

/// Commands the docs show that are not touchstone: never run by this test.
/// Each is trusted for the reason given, and checked as far as a test can:
/// every repository path in it exists, every `--flag` of a script is in the
/// script's text, and the named checks (`check_other`) hold.
const OTHERS: [(&str, &str); 14] = [
    (
        "python3 ci/import_cycles.py",
        "the import-circle scan of src/; ci/test.sh runs it (checked)",
    ),
    (
        "python3 ci/house_rules.py",
        "the house rules (file sizes, headers, module style, paths); ci/test.sh runs it (checked)",
    ),
    (
        "bash ci/test.sh",
        "the project's test command, exactly what .ci/run runs (checked)",
    ),
    (
        "bash ci/nextest.sh",
        "the suite under cargo-nextest (pinned from PyPI), arguments passed to `cargo nextest run` (checked)",
    ),
    (
        "bash ci/kernels.sh",
        "the kernel check, which ci/test.sh runs (checked)",
    ),
    (
        "python3 ci/fetch_real_model.py",
        "fetches the real model; ci/test.sh runs it (checked)",
    ),
    (
        "cargo test",
        "cargo's own test runner on this workspace; --test, -p and --example names are checked",
    ),
    (
        "cargo run --release --example",
        "an example of this package, built by cargo (its file is checked)",
    ),
    (
        "cargo run --release -p",
        "a workspace member's binary (the member and its flags are checked)",
    ),
    (
        "cargo insta review",
        "insta's reviewer for the snapshots in tests/snapshots (checked to exist)",
    ),
    (
        "bash ci/bench.sh",
        "the benchmark script, not CI: its flags are checked against its usage text",
    ),
    (
        "bash goldens/recorders/regen.sh",
        "the recorders' one command (needs their Python environment)",
    ),
    (
        "python3 goldens/recorders/",
        "a recorder script (it exists, and so does every flag given)",
    ),
    (
        "~/.cache/touchstone/recorders-venv/bin/python goldens/recorders/",
        "a recorder script run with the recorders' venv",
    ),
];

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// README.md and docs/*.md (the files whose commands are checked), then the
/// other pages whose links are checked.
fn doc_files() -> (Vec<String>, Vec<String>) {
    let mut docs = vec!["README.md".to_string()];
    let mut pages: Vec<String> = std::fs::read_dir(root().join("docs"))
        .map(|rd| {
            rd.filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| n.ends_with(".md"))
                .map(|n| format!("docs/{n}"))
                .collect()
        })
        .unwrap_or_default();
    pages.sort();
    docs.extend(pages);
    let linked_only = vec!["goldens/recorders/README.md".to_string()];
    (docs, linked_only)
}

// ---- markdown -----------------------------------------------------------------

struct Fence {
    info: String,
    /// 1-based line of the opening fence.
    line: usize,
    body: Vec<(usize, String)>,
}

/// The fenced blocks of a document, and its lines outside fences.
fn split_fences(text: &str) -> (Vec<Fence>, Vec<(usize, String)>) {
    let mut fences = Vec::new();
    let mut prose = Vec::new();
    let mut open: Option<(String, Fence)> = None;
    for (i, line) in text.lines().enumerate() {
        let n = i + 1;
        let t = line.trim_start();
        let marker: String = t.chars().take_while(|&c| c == '`' || c == '~').collect();
        let is_fence = marker.len() >= 3 && marker.chars().all(|c| c == marker.chars().next().unwrap());
        match &mut open {
            Some((m, f)) => {
                if is_fence && marker.starts_with(m.as_str()) && t[marker.len()..].trim().is_empty() {
                    fences.push(open.take().unwrap().1);
                } else {
                    f.body.push((n, line.to_string()));
                }
            }
            None if is_fence => {
                open = Some((
                    marker.clone(),
                    Fence {
                        info: t[marker.len()..].trim().to_string(),
                        line: n,
                        body: Vec::new(),
                    },
                ))
            }
            None => prose.push((n, line.to_string())),
        }
    }
    if let Some((_, f)) = open {
        // An unclosed fence: reported by the links trial through its info string.
        fences.push(Fence {
            info: format!("(unclosed fence) {}", f.info),
            ..f
        });
    }
    (fences, prose)
}

/// GitHub's anchor for a heading: lower case, punctuation dropped, spaces to `-`.
fn slug(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter(|c| c.is_alphanumeric() || *c == ' ' || *c == '-' || *c == '_')
        .map(|c| if c == ' ' { '-' } else { c })
        .collect()
}

/// Every anchor of a document (duplicates get `-1`, `-2`, … as on GitHub).
fn anchors(text: &str) -> Vec<String> {
    let (_, prose) = split_fences(text);
    let mut seen: BTreeMap<String, usize> = BTreeMap::new();
    let mut out = Vec::new();
    for (_, line) in prose {
        let hashes = line.chars().take_while(|&c| c == '#').count();
        if hashes == 0 || hashes > 6 || !line[hashes..].starts_with(' ') {
            continue;
        }
        let s = slug(&line[hashes..].replace('`', ""));
        let k = seen.entry(s.clone()).or_insert(0);
        out.push(if *k == 0 { s.clone() } else { format!("{s}-{k}") });
        *k += 1;
    }
    out
}

/// Inline code spans of a prose line.
fn code_spans(line: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = line;
    while let Some(a) = rest.find('`') {
        let ticks = rest[a..].chars().take_while(|&c| c == '`').count();
        let after = &rest[a + ticks..];
        let close = "`".repeat(ticks);
        match after.find(&close) {
            Some(b) => {
                out.push(after[..b].trim().to_string());
                rest = &after[b + ticks..];
            }
            None => break,
        }
    }
    out
}

/// The line with its inline code spans removed (links are searched there).
fn without_code(line: &str) -> String {
    let mut out = String::new();
    let mut rest = line;
    while let Some(a) = rest.find('`') {
        out.push_str(&rest[..a]);
        let ticks = rest[a..].chars().take_while(|&c| c == '`').count();
        let after = &rest[a + ticks..];
        match after.find(&"`".repeat(ticks)) {
            Some(b) => rest = &after[b + ticks..],
            None => {
                rest = after;
                break;
            }
        }
    }
    out.push_str(rest);
    out
}

/// Link targets of a prose line: `[text](target)` and `[label]: target`.
fn link_targets(line: &str) -> Vec<String> {
    let line = without_code(line);
    let mut out = Vec::new();
    let t = line.trim_start();
    if t.starts_with('[') {
        if let Some(i) = t.find("]: ") {
            out.push(t[i + 3..].split_whitespace().next().unwrap_or("").to_string());
        }
    }
    let mut rest = line.as_str();
    while let Some(i) = rest.find("](") {
        let after = &rest[i + 2..];
        let end = after.find(')').unwrap_or(after.len());
        out.push(after[..end].split_whitespace().next().unwrap_or("").to_string());
        rest = &after[end..];
    }
    out
}

// ---- paths ----------------------------------------------------------------------

/// The repository's own top-level names: a token starting with one of these
/// (then `/`) is a repository path and must exist.
const TOP_DIRS: [&str; 9] = [
    "src", "specs", "goldens", "tests", "examples", "ci", "cuda", "docs", ".ci",
];
const TOP_FILES: [&str; 5] = ["Cargo.toml", "Cargo.lock", "build.rs", "README.md", "rustfmt.toml"];

/// A token as a repository path, if it is one: leading `./` and trailing
/// punctuation dropped, `exec:`/`dumps:` prefixes and `--flag=` removed.
fn as_repo_path(token: &str) -> Option<String> {
    let mut t = token
        .trim_start_matches(['\'', '"', '('])
        .trim_end_matches(['\'', '"', ')', ',', ';', '.', ':']);
    if let Some((flag, v)) = t.split_once('=') {
        if flag.starts_with("--") {
            t = v;
        }
    }
    for p in ["dumps:", "./"] {
        t = t.strip_prefix(p).unwrap_or(t);
    }
    if TOP_FILES.contains(&t) {
        return Some(t.to_string());
    }
    let first = t.split('/').next()?;
    (TOP_DIRS.contains(&first) && t.len() > first.len()).then(|| t.to_string())
}

/// Placeholders (`<step>`, `{i}`, `X.Y.Z`, `…`) make a path a pattern, not a file.
fn is_placeholder(p: &str) -> bool {
    p.contains(['<', '{', '…', '$', '[']) || p.contains("...") || p.contains("X.Y")
}

/// `*` and `?` in the last component match file names (one folder, as a shell does).
fn glob(pattern: &str) -> Vec<String> {
    let path = Path::new(pattern);
    if !pattern.contains(['*', '?']) {
        return if root().join(path).exists() {
            vec![pattern.to_string()]
        } else {
            vec![]
        };
    }
    let (dir, name) = match (path.parent(), path.file_name()) {
        (Some(d), Some(n)) => (d, n.to_string_lossy().into_owned()),
        _ => return vec![],
    };
    if dir.to_string_lossy().contains(['*', '?']) {
        return vec![];
    }
    let mut out: Vec<String> = std::fs::read_dir(root().join(dir))
        .map(|rd| {
            rd.filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| wildcard(name.as_bytes(), n.as_bytes()))
                .map(|n| dir.join(n).to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    out.sort();
    out
}

fn wildcard(p: &[u8], s: &[u8]) -> bool {
    match (p.first(), s.first()) {
        (None, None) => true,
        (Some(b'*'), _) => wildcard(&p[1..], s) || (!s.is_empty() && wildcard(p, &s[1..])),
        (Some(b'?'), Some(_)) => wildcard(&p[1..], &s[1..]),
        (Some(a), Some(b)) if a == b => wildcard(&p[1..], &s[1..]),
        _ => false,
    }
}

/// Every repository path among `tokens` (an `exec:` value is split as the
/// command line it is) that does not exist.
fn missing_paths(tokens: &[String]) -> Vec<String> {
    let mut missing = Vec::new();
    for tok in tokens {
        let parts = match tok.strip_prefix("exec:").or_else(|| tok.strip_prefix("--engine=exec:")) {
            Some(cmd) => shlex::split(cmd).unwrap_or_default(),
            None => vec![tok.clone()],
        };
        for p in parts {
            if let Some(path) = as_repo_path(&p) {
                if !is_placeholder(&path) && !FORWARD.contains(&path.as_str()) && glob(&path).is_empty() {
                    missing.push(path);
                }
            }
        }
    }
    missing
}

// ---- commands ---------------------------------------------------------------------

#[derive(Clone, Debug)]
struct Cmd {
    file: String,
    line: usize,
    text: String,
    expect_exit: i32,
    prints: Vec<String>,
    no_run_block: bool,
}

/// The commands of a document's console blocks, grouped by block (a block's
/// commands run in order: later ones may read what earlier ones wrote).
fn commands(file: &str, text: &str) -> Result<Vec<Vec<Cmd>>, String> {
    let (fences, _) = split_fences(text);
    let mut blocks = Vec::new();
    for f in fences
        .iter()
        .filter(|f| f.info == "console" || f.info == "console no-run")
    {
        let mut cmds: Vec<Cmd> = Vec::new();
        let mut directives_open = false;
        let mut lines = f.body.iter().peekable();
        while let Some((n, line)) = lines.next() {
            if let Some(c) = line.strip_prefix("$ ") {
                let mut text = c.trim_end().to_string();
                while text.ends_with('\\') {
                    text.pop();
                    match lines.next() {
                        Some((_, next)) => text.push_str(next.trim()),
                        None => return Err(format!("{file}:{n}: a continued command with no next line")),
                    }
                }
                cmds.push(Cmd {
                    file: file.to_string(),
                    line: *n,
                    text: text.trim().to_string(),
                    expect_exit: 0,
                    prints: vec![],
                    no_run_block: f.info == "console no-run",
                });
                directives_open = true;
            } else if let (true, Some(last)) = (directives_open, cmds.last_mut()) {
                if let Some(code) = line.strip_prefix("# exit ") {
                    last.expect_exit = code
                        .trim()
                        .parse()
                        .map_err(|_| format!("{file}:{n}: `# exit` needs a number, got `{code}`"))?;
                } else if let Some(t) = line.strip_prefix("# prints: ") {
                    last.prints.push(t.to_string());
                } else {
                    directives_open = false;
                }
            } else if line.starts_with("# exit ") || line.starts_with("# prints: ") {
                return Err(format!("{file}:{n}: `{line}` must come right after its command"));
            }
        }
        if cmds.is_empty() {
            return Err(format!("{file}:{}: a console block with no `$ ` command", f.line));
        }
        blocks.push(cmds);
    }
    Ok(blocks)
}

/// `KEY=VALUE` assignments before a command.
type Env = Vec<(String, String)>;

/// Each command's result in a block, once it has run (`None`: not yet).
type BlockResults = Arc<Mutex<Vec<Option<Result<(), String>>>>>;

/// A command split into its environment assignments and its words.
fn words(cmd: &Cmd) -> Result<(Env, Vec<String>), String> {
    let toks = shlex::split(&cmd.text).ok_or("unbalanced quotes")?;
    if let Some(op) = toks
        .iter()
        .find(|t| t.starts_with('#') || ["|", "||", "&&", ";", ">", ">>", "<", "2>&1", "&"].contains(&t.as_str()))
    {
        return Err(format!(
            "`{op}`: a doc command is one program and its arguments (no comments, pipes, redirections or lists)"
        ));
    }
    let mut env = Vec::new();
    let mut i = 0;
    while i < toks.len() {
        match toks[i].split_once('=') {
            Some((k, v))
                if !k.is_empty()
                    && k.chars()
                        .all(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_') =>
            {
                env.push((k.to_string(), v.to_string()));
                i += 1;
            }
            _ => break,
        }
    }
    Ok((env, toks[i..].to_vec()))
}

/// The touchstone arguments of a command, if it runs touchstone.
fn touchstone_args(w: &[String]) -> Option<Vec<String>> {
    if w.first().map(String::as_str) == Some("touchstone") {
        return Some(w[1..].to_vec());
    }
    let cargo_run = ["cargo", "run", "--release", "--"];
    (w.len() >= 4 && w[..4].iter().zip(cargo_run).all(|(a, b)| a == b)).then(|| w[4..].to_vec())
}

/// Why a touchstone command cannot run in this test, if it cannot.
fn no_run_reason(env: &[(String, String)], args: &[String]) -> Option<String> {
    let on_ci = env
        .iter()
        .any(|(k, v)| k == "CI" && !v.is_empty() && v != "false" && v != "0");
    let pos: Vec<&str> = args
        .iter()
        .map(String::as_str)
        .filter(|a| !a.starts_with('-'))
        .collect();
    match (pos.first().copied(), pos.get(1).copied()) {
        // With CI set, regen and accept refuse before reading anything (exit 2).
        (Some("goldens"), Some("regen")) if !on_ci => {
            return Some("runs the Python recorders and writes pending goldens".into())
        }
        (Some("goldens"), Some("accept")) if !on_ci => return Some("writes goldens".into()),
        (Some("goldens"), Some("reject")) => return Some("deletes pending goldens a reader may be reviewing".into()),
        (Some("bench"), _) => return Some("a benchmark: minutes on a quiet machine".into()),
        (Some("kernels"), _) => return Some("needs NVRTC (ci/kernels.sh fetches it)".into()),
        _ => {}
    }
    let engine = args
        .iter()
        .position(|a| a == "--engine")
        .and_then(|i| args.get(i + 1))
        .map(String::as_str)
        .or_else(|| args.iter().find_map(|a| a.strip_prefix("--engine=")));
    match engine {
        None | Some("cpu") | Some("cuda-emu") => {}
        Some(e) if e.starts_with("dumps:") => {}
        Some("cuda") | Some("all") => {
            return Some("runs the CUDA engine: its result depends on the machine's GPU".into())
        }
        Some(e)
            if ["hf", "llama.cpp"]
                .iter()
                .any(|n| e == *n || e.starts_with(&format!("{n}:"))) =>
        {
            return Some("HF transformers or llama.cpp under test: needs the recorders' venv (and libllama)".into())
        }
        Some(_) => return Some("a protocol engine: needs Python with numpy".into()),
    }
    if args.iter().any(|a| a == "--require-gpu") {
        return Some("needs a GPU".into());
    }
    // A folder of specs runs every spec in it: the real model's too, where it is there.
    let real_in_folder = |a: &String| {
        std::fs::read_dir(root().join(a)).is_ok_and(|rd| {
            rd.filter_map(|e| e.ok())
                .any(|e| std::fs::read_to_string(e.path()).is_ok_and(|t| t.contains("model: cache:")))
        })
    };
    if args
        .iter()
        .any(|a| a.contains("qwen2.5-0.5b") || a.contains("cache:") || (as_repo_path(a).is_some() && real_in_folder(a)))
    {
        return Some("the real 0.5B model: fetched by ci/fetch_real_model.py, about a minute a run".into());
    }
    None
}

/// Parses touchstone arguments with the binary's own parser.
fn parse(args: &[String]) -> Result<(), String> {
    match touchstone::cli::Cli::try_parse_from(std::iter::once("touchstone".to_string()).chain(args.iter().cloned())) {
        Ok(_) => Ok(()),
        Err(e)
            if matches!(
                e.kind(),
                clap::error::ErrorKind::DisplayHelp | clap::error::ErrorKind::DisplayVersion
            ) =>
        {
            Ok(())
        }
        Err(e) => Err(format!("the binary would refuse these arguments:\n{e}")),
    }
}

/// Runs touchstone as the docs show it; Ok when it exits as stated.
fn run_touchstone(cmd: &Cmd, env: &[(String, String)], args: &[String]) -> Result<(), String> {
    for (i, a) in args.iter().enumerate() {
        let value = OUTPUT_FLAGS
            .iter()
            .find_map(|f| a.strip_prefix(&format!("{f}=")))
            .or_else(|| {
                OUTPUT_FLAGS
                    .contains(&a.as_str())
                    .then(|| args.get(i + 1).map(String::as_str))
                    .flatten()
            });
        if let Some(v) = value {
            if !(v.starts_with("target/") || v == "-" || v == "/dev/null") {
                return Err(format!(
                    "`{a} {v}`: a doc command writes its files under target/ (or to - or /dev/null)"
                ));
            }
        }
    }
    // A shell expands globs; so does this test (within one folder).
    let mut expanded = Vec::new();
    for a in args {
        match as_repo_path(a).filter(|p| p.contains(['*', '?'])) {
            Some(p) => {
                let m = glob(&p);
                if m.is_empty() {
                    return Err(format!("`{a}` matches nothing"));
                }
                expanded.extend(m);
            }
            None => expanded.push(a.clone()),
        }
    }
    std::fs::create_dir_all(root().join("target")).map_err(|e| e.to_string())?;
    let out = Command::new(env!("CARGO_BIN_EXE_touchstone"))
        .args(&expanded)
        .env_remove("CI")
        .envs(env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
        .current_dir(root())
        .output()
        .map_err(|e| format!("cannot start touchstone: {e}"))?;
    let code = out.status.code().unwrap_or(-1);
    let all = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let tail = || {
        let lines: Vec<&str> = all.lines().collect();
        lines[lines.len().saturating_sub(40)..].join("\n")
    };
    if all.contains("panicked") {
        return Err(format!("touchstone panicked:\n{}", tail()));
    }
    if code != cmd.expect_exit {
        return Err(format!(
            "exit status {code}, the doc says {} (add `# exit {code}` after the command if that is right); output:\n{}",
            cmd.expect_exit,
            tail()
        ));
    }
    for p in &cmd.prints {
        if !all.contains(p.as_str()) {
            return Err(format!("the output lacks `{p}`; output:\n{}", tail()));
        }
    }
    Ok(())
}

/// The package names of the workspace, with their folders.
fn workspace_packages() -> Vec<(String, PathBuf)> {
    let manifest = std::fs::read_to_string(root().join("Cargo.toml")).unwrap_or_default();
    let members = manifest
        .lines()
        .find_map(|l| l.trim().strip_prefix("members = "))
        .unwrap_or("[]")
        .trim_matches(|c| c == '[' || c == ']')
        .split(',')
        .map(|m| m.trim().trim_matches('"').to_string())
        .filter(|m| !m.is_empty())
        .collect::<Vec<_>>();
    members
        .into_iter()
        .filter_map(|m| {
            let dir = root().join(&m);
            let text = std::fs::read_to_string(dir.join("Cargo.toml")).ok()?;
            let name = text
                .lines()
                .find_map(|l| l.trim().strip_prefix("name = "))?
                .trim_matches('"')
                .to_string();
            Some((name, dir))
        })
        .collect()
}

fn read(rel: &str) -> String {
    std::fs::read_to_string(root().join(rel)).unwrap_or_default()
}

/// The allowlist's checks for a command that is not touchstone.
fn check_other(w: &[String]) -> Result<&'static str, String> {
    let line = w.join(" ");
    let line = line.replace(&format!("{}/", std::env::var("HOME").unwrap_or_default()), "~/");
    let Some((prefix, reason)) = OTHERS
        .iter()
        .find(|(p, _)| line == *p || line.starts_with(&format!("{p} ")) || (p.ends_with('/') && line.starts_with(p)))
    else {
        return Err(format!(
            "`{line}` is neither touchstone nor on this test's allowlist (OTHERS in tests/docs.rs): \
             add it there with the reason it can be trusted, or show a touchstone command"
        ));
    };
    let missing = missing_paths(w);
    if !missing.is_empty() {
        return Err(format!(
            "no such file or folder in the repository: {}",
            missing.join(", ")
        ));
    }
    let contains = |file: &str, what: &str| {
        if read(file).contains(what) {
            Ok(())
        } else {
            Err(format!(
                "{file} does not contain `{what}`, which this allowlist entry relies on"
            ))
        }
    };
    // Flags of a script or program must be in its text.
    let flags_in = |file: &str, args: &[String]| -> Result<(), String> {
        let text = read(file);
        for a in args.iter().filter(|a| a.starts_with("--")) {
            let flag = a.split('=').next().unwrap();
            if !text.contains(flag) {
                return Err(format!("{file} knows no `{flag}`"));
            }
        }
        Ok(())
    };
    match *prefix {
        "bash ci/test.sh" => {
            contains(".ci/run", "exec bash ci/test.sh")?;
            if w.len() > 2 {
                return Err("`bash ci/test.sh` is shown with no arguments, as .ci/run runs it".into());
            }
        }
        "bash ci/kernels.sh" => contains("ci/test.sh", "bash ci/kernels.sh")?,
        "python3 ci/import_cycles.py" => contains("ci/test.sh", "python3 ci/import_cycles.py")?,
        "python3 ci/house_rules.py" => contains("ci/test.sh", "python3 ci/house_rules.py")?,
        "python3 ci/fetch_real_model.py" => {
            contains("ci/test.sh", "source ci/test-env.sh")?;
            contains("ci/test-env.sh", "python3 ci/fetch_real_model.py")?
        }
        "bash ci/nextest.sh" => {
            contains("ci/nextest.sh", "source ci/test-env.sh")?;
            contains(
                "ci/nextest.sh",
                "cargo nextest run --release --locked --no-fail-fast \"$@\"",
            )?
        }
        "cargo test" | "cargo run --release --example" | "cargo run --release -p" => {
            let packages = workspace_packages();
            let mut pkg_dir = root();
            for (i, a) in w.iter().enumerate() {
                let next = w.get(i + 1).map(String::as_str).unwrap_or("");
                match a.as_str() {
                    "--" => break,
                    "-p" | "--package" => match packages.iter().find(|(n, _)| n == next) {
                        Some((_, d)) => pkg_dir = d.clone(),
                        None => return Err(format!("no workspace package `{next}`")),
                    },
                    _ => {}
                }
            }
            for (i, a) in w.iter().enumerate() {
                let next = w.get(i + 1).map(String::as_str).unwrap_or("");
                match a.as_str() {
                    "--" => break,
                    "--test" if !pkg_dir.join(format!("tests/{next}.rs")).is_file() => {
                        return Err(format!(
                            "no test target `{next}` ({}/tests/{next}.rs)",
                            pkg_dir.display()
                        ))
                    }
                    "--example" if !pkg_dir.join(format!("examples/{next}.rs")).is_file() => {
                        return Err(format!("no example `{next}`"))
                    }
                    _ => {}
                }
            }
            if let Some(i) = w.iter().position(|a| a == "--") {
                if *prefix == "cargo run --release -p" {
                    flags_in(
                        &format!("{}/src/main.rs", pkg_dir.strip_prefix(root()).unwrap().display()),
                        &w[i + 1..],
                    )?;
                }
            }
        }
        "cargo insta review" => contains("tests/report_sinks.rs", "insta::")?,
        "bash ci/bench.sh" => flags_in("ci/bench.sh", &w[2..])?,
        "bash goldens/recorders/regen.sh" => {}
        _ => {
            // A recorder script: the first repository path is the script.
            let script = w.iter().find_map(|t| as_repo_path(t)).ok_or("no script named")?;
            let i = w
                .iter()
                .position(|t| as_repo_path(t).as_deref() == Some(script.as_str()))
                .unwrap();
            flags_in(&script, &w[i + 1..])?;
        }
    }
    Ok(reason)
}

/// One command's trial.
fn command_trial(cmd: Cmd, block: BlockResults, index: usize, cmds: Arc<Vec<Cmd>>) -> Trial {
    let name = format!("docs::{}:{}", cmd.file, cmd.line);
    let kind = match words(&cmd) {
        Ok((env, w)) => match touchstone_args(&w) {
            Some(args) if cmd.no_run_block || no_run_reason(&env, &args).is_some() => "parse",
            Some(_) => "run",
            None => "allowlisted",
        },
        Err(_) => "run",
    };
    Trial::test(name, move || {
        let (env, w) = words(&cmd)?;
        let Some(args) = touchstone_args(&w) else {
            check_other(&w)?;
            return Ok(());
        };
        let why = no_run_reason(&env, &args);
        match (cmd.no_run_block, &why) {
            (true, None) => {
                return Err(Failed::from(
                    "this command runs in a test: show it in a ```console block, not ```console no-run",
                ))
            }
            (false, Some(w)) => {
                return Err(Failed::from(format!(
                    "this command cannot run in a test ({w}): show it in a ```console no-run block"
                )))
            }
            _ => {}
        }
        if why.is_some() {
            parse(&args)?;
            let missing = missing_paths(&args);
            if !missing.is_empty() {
                return Err(format!("no such file or folder in the repository: {}", missing.join(", ")).into());
            }
            return Ok(());
        }
        // Runnable: this command and the runnable ones before it in its block,
        // in order, each once (a later command may read an earlier one's file).
        let mut results = block.lock().unwrap_or_else(|e| e.into_inner());
        for j in 0..=index {
            if results[j].is_none() {
                let c = &cmds[j];
                let r = match words(c) {
                    Ok((env, w)) => match touchstone_args(&w) {
                        Some(a) if !c.no_run_block && no_run_reason(&env, &a).is_none() => run_touchstone(c, &env, &a),
                        _ => Ok(()),
                    },
                    Err(e) => Err(e),
                };
                results[j] = Some(r);
            }
        }
        results[index].clone().unwrap().map_err(Failed::from)
    })
    .with_kind(kind)
}

// ---- per-file checks ------------------------------------------------------------------

/// Links, anchors, inline-code paths and fence info strings of one file.
fn check_file(file: &str) -> Result<(), String> {
    let text = std::fs::read_to_string(root().join(file)).map_err(|e| format!("{file}: {e}"))?;
    let dir = Path::new(file).parent().unwrap_or(Path::new(""));
    let (fences, prose) = split_fences(&text);
    let mut problems = Vec::new();
    for f in &fences {
        if !INFO_STRINGS.contains(&f.info.as_str()) {
            problems.push(format!(
                "{file}:{}: fence info string `{}` (use one of: {}; shell examples are `console`)",
                f.line,
                f.info,
                INFO_STRINGS.join(", ")
            ));
        }
    }
    let own_anchors = anchors(&text);
    for (n, line) in &paragraphs(&prose) {
        for target in link_targets(line) {
            if target.is_empty()
                || target.starts_with("http://")
                || target.starts_with("https://")
                || target.starts_with("mailto:")
            {
                continue;
            }
            let (path, frag) = match target.split_once('#') {
                Some((p, f)) => (p, Some(f)),
                None => (target.as_str(), None),
            };
            let resolved = if path.is_empty() {
                PathBuf::from(file)
            } else {
                normalize(&dir.join(path))
            };
            let rel = resolved.to_string_lossy().into_owned();
            if FORWARD.contains(&rel.as_str()) {
                continue;
            }
            if !root().join(&resolved).exists() {
                problems.push(format!("{file}:{n}: link `{target}`: no such file ({rel})"));
                continue;
            }
            if let Some(frag) = frag {
                let targets = if path.is_empty() {
                    own_anchors.clone()
                } else if rel.ends_with(".md") {
                    anchors(&std::fs::read_to_string(root().join(&resolved)).unwrap_or_default())
                } else {
                    continue;
                };
                if !targets.iter().any(|a| a == frag) {
                    problems.push(format!(
                        "{file}:{n}: link `{target}`: {rel} has no heading with anchor `#{frag}`"
                    ));
                }
            }
        }
        for span in code_spans(line) {
            let tokens: Vec<String> = span.split_whitespace().map(str::to_string).collect();
            for p in missing_paths(&tokens) {
                problems.push(format!(
                    "{file}:{n}: `{span}`: no such file or folder in the repository: {p}"
                ));
            }
        }
    }
    if problems.is_empty() {
        Ok(())
    } else {
        Err(problems.join("\n"))
    }
}

/// Prose lines joined into paragraphs (a code span or link may wrap), each
/// with its first line: a blank line, a heading, a table row or a fence ends one.
fn paragraphs(prose: &[(usize, String)]) -> Vec<(usize, String)> {
    let mut out: Vec<(usize, String)> = Vec::new();
    let mut last = 0;
    for (n, line) in prose {
        let t = line.trim();
        let breaks = t.is_empty() || t.starts_with('#') || t.starts_with('|') || *n != last + 1;
        match out.last_mut() {
            Some((_, p)) if !breaks && !p.is_empty() => {
                p.push(' ');
                p.push_str(t);
            }
            _ => out.push((*n, t.to_string())),
        }
        if t.is_empty() || t.starts_with('#') || t.starts_with('|') {
            // Nothing joins onto a heading or a table row.
            out.push((*n, String::new()));
        }
        last = *n;
    }
    out.retain(|(_, p)| !p.is_empty());
    out
}

/// `a/b/../c` → `a/c` (paths inside the repository, no symlinks involved).
fn normalize(p: &Path) -> PathBuf {
    let mut out = PathBuf::new();
    for c in p.components() {
        match c {
            std::path::Component::ParentDir => {
                out.pop();
            }
            std::path::Component::CurDir => {}
            other => out.push(other),
        }
    }
    out
}

/// A YAML block with a top-level `model:` is a spec: it must parse and plan
/// as if it were a file in specs/ (so its `../goldens/…` paths resolve), with
/// the real model's spec only parsed where that model is absent.
fn check_spec_block(file: &str, line: usize, body: &str) -> Result<(), String> {
    let path = root().join("specs/docs-example.yaml");
    let spec = touchstone::spec::Spec::parse(&path, body).map_err(|e| format!("{file}:{line}: {e}"))?;
    if spec.cached_model.is_some() && !spec.model.exists() {
        return Ok(());
    }
    touchstone::plan::Plan::build(spec, None)
        .map(|_| ())
        .map_err(|e| format!("{file}:{line}: the spec does not plan: {e}"))
}

/// README: small, says `cargo test`, and links every page of docs/.
fn check_readme(docs: &[String]) -> Result<(), String> {
    let text = read("README.md");
    let mut problems = Vec::new();
    if text.len() > README_MAX {
        problems.push(format!("README.md is {} bytes; at most {README_MAX}", text.len()));
    }
    if !text.contains("cargo test") {
        problems.push("README.md must say `cargo test`".into());
    }
    for d in docs.iter().filter(|d| d.starts_with("docs/")) {
        if !text.contains(&format!("]({d})")) {
            problems.push(format!("README.md does not link {d}"));
        }
    }
    if problems.is_empty() {
        Ok(())
    } else {
        Err(problems.join("\n"))
    }
}

fn main() {
    let args = Arguments::from_args();
    let (docs, linked_only) = doc_files();
    let mut trials = Vec::new();
    {
        let docs = docs.clone();
        trials.push(Trial::test("docs::README.md::size", move || {
            check_readme(&docs).map_err(Failed::from)
        }));
    }
    for file in docs.iter().chain(&linked_only) {
        let f = file.clone();
        trials.push(Trial::test(format!("docs::{file}::links"), move || {
            check_file(&f).map_err(Failed::from)
        }));
    }
    for file in &docs {
        let text = read(file);
        for f in split_fences(&text).0 {
            if f.info == "yaml" && f.body.iter().any(|(_, l)| l.starts_with("model:")) {
                let body: String = f.body.iter().map(|(_, l)| format!("{l}\n")).collect();
                let (file, line) = (file.clone(), f.line);
                trials.push(
                    Trial::test(format!("docs::{file}:{line}"), move || {
                        check_spec_block(&file, line, &body).map_err(Failed::from)
                    })
                    .with_kind("spec"),
                );
            }
        }
        match commands(file, &text) {
            Err(e) => trials.push(Trial::test(format!("docs::{file}::console"), move || {
                Err(Failed::from(e.clone()))
            })),
            Ok(blocks) => {
                for cmds in blocks {
                    let cmds = Arc::new(cmds);
                    let results = Arc::new(Mutex::new(vec![None; cmds.len()]));
                    for (i, c) in cmds.iter().enumerate() {
                        trials.push(command_trial(c.clone(), results.clone(), i, cmds.clone()));
                    }
                }
            }
        }
    }
    libtest_mimic::run(&args, trials).exit();
}
