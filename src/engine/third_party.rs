//! Engines touchstone did not write, under test by name: `--engine hf` (HF
//! transformers) and `--engine llama.cpp` (libllama with its defaults: flash
//! attention auto, an f16 KV cache, its own quantised kernels). Each is a
//! protocol engine (`engine::exec`) built from the golden recorders —
//! `goldens/recorders/engine_hf.py` and `engine_llamacpp.py`, which tap
//! every stage with the recorders' own hooks and node map — run by the
//! recorders' Python, the venv `touchstone goldens regen` creates
//! (`$TOUCHSTONE_CACHE/recorders-venv`). They declare their capabilities and
//! arithmetic in their load answer.
//!
//! `hf:ARGS…` / `llama.cpp:ARGS…` pass arguments to the script: the planted
//! changes `--attn-scale X` (HF) and `--rope-freq-base X` (llama.cpp), or
//! llama.cpp's `--flash-attn`/`--kv-type`.
//!
//! The scripts are run from the source tree they belong to (the nearest
//! ancestor of the spec holding `goldens/recorders/requirements.txt`, else
//! the tree this binary was built from), not embedded: they import the
//! recorders (record_hf.py, record_llamacpp.py, golden_io.py,
//! build_llamacpp.py), and the venv itself is made from that tree's
//! requirements.txt by `goldens regen`, which needs the tree anyway.
//!
//! Neither is part of `--engine all` (which stays Rust-only: `cargo test`
//! needs no Python). Where the venv, the script or libllama is missing,
//! resolving the name fails with `Error::Environment`: what is missing and
//! the command that creates it.

use std::path::{Path, PathBuf};
use std::time::Duration;

use super::exec::ExecSpec;
use crate::error::{Error, Result};

/// Which third-party engine.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Hf,
    LlamaCpp,
}

/// Both, in the order help texts list them.
pub const KINDS: [Kind; 2] = [Kind::Hf, Kind::LlamaCpp];

/// Per-request deadline: loading the real model into HF (the GGUF
/// dequantised by gguf-py) takes tens of seconds on two cores.
const TIMEOUT: Duration = Duration::from_secs(600);

impl Kind {
    /// The name `--engine` takes, in trial ids and reports.
    pub fn name(self) -> &'static str {
        match self {
            Kind::Hf => "hf",
            Kind::LlamaCpp => "llama.cpp",
        }
    }

    fn script(self) -> &'static str {
        match self {
            Kind::Hf => "engine_hf.py",
            Kind::LlamaCpp => "engine_llamacpp.py",
        }
    }

    fn what(self) -> &'static str {
        match self {
            Kind::Hf => "HF transformers (hooks)",
            Kind::LlamaCpp => "llama.cpp (libllama, its defaults)",
        }
    }
}

/// A resolved `hf[:ARGS]` / `llama.cpp[:ARGS]`.
#[derive(Clone, Debug, PartialEq)]
pub struct ThirdParty {
    pub kind: Kind,
    /// Arguments for the script (the planted changes).
    pub args: Vec<String>,
    /// How it runs: the venv's python, the script, the arguments.
    pub exec: ExecSpec,
}

impl ThirdParty {
    /// `Some` when `arg` names a third-party engine (`hf`, `hf:ARGS`,
    /// `llama.cpp`, `llama.cpp:ARGS`); its environment is checked here.
    pub fn parse(arg: &str, spec_path: &Path) -> Option<Result<ThirdParty>> {
        let (kind, args) = KINDS.iter().find_map(|k| {
            if arg == k.name() {
                Some((*k, ""))
            } else {
                arg.strip_prefix(k.name())
                    .and_then(|rest| rest.strip_prefix(':'))
                    .map(|rest| (*k, rest))
            }
        })?;
        Some(ThirdParty::new(kind, args, spec_path))
    }

    fn new(kind: Kind, args: &str, spec_path: &Path) -> Result<ThirdParty> {
        let args =
            shlex::split(args).ok_or_else(|| Error::Usage(format!("{}:{args}: unbalanced quotes", kind.name())))?;
        let root = repo_root(spec_path);
        let script = root.join("goldens/recorders").join(kind.script());
        let python = venv_python();
        let missing = |missing: String, fix: String| Error::Environment {
            engine: kind.name().into(),
            missing,
            fix,
        };
        if !script.is_file() {
            return Err(missing(
                format!("its script {}", script.display()),
                format!(
                    "run touchstone from a checkout of its source tree (the spec {} is not in one, and this \
                     binary's tree {} has no such file)",
                    spec_path.display(),
                    env!("CARGO_MANIFEST_DIR")
                ),
            ));
        }
        if !python.is_file() {
            return Err(missing(
                format!("the recorders' Python environment {}", python.display()),
                create_venv(&root),
            ));
        }
        if kind == Kind::LlamaCpp {
            if let Some(lib) = libllama(&root).filter(|l| !l.is_file()) {
                return Err(missing(
                    format!(
                        "libllama built from the pinned llama-cpp-python sdist ({})",
                        lib.display()
                    ),
                    format!(
                        "build it with `{} {}` (about 20 minutes on 2 cores; `touchstone goldens regen` and \
                         goldens/recorders/regen.sh build it too)",
                        python.display(),
                        root.join("goldens/recorders/build_llamacpp.py").display()
                    ),
                ));
            }
        }
        let mut argv = vec![python.display().to_string(), script.display().to_string()];
        argv.extend(args.iter().cloned());
        Ok(ThirdParty {
            kind,
            args,
            exec: ExecSpec {
                name: kind.name().into(),
                argv,
                cwd: None,
                timeout: TIMEOUT,
                arithmetic: None,
                requires: None,
            },
        })
    }

    /// How to name it on a command line (rerun commands).
    pub fn cli_arg(&self) -> String {
        if self.args.is_empty() {
            return self.kind.name().into();
        }
        let args = shlex::try_join(self.args.iter().map(String::as_str)).unwrap_or_else(|_| self.args.join(" "));
        let arg = format!("{}:{args}", self.kind.name());
        shlex::try_quote(&arg).map(|c| c.into_owned()).unwrap_or(arg)
    }
}

/// The names for help and error texts: `hf (HF transformers (hooks))`, ….
pub fn described() -> String {
    KINDS
        .iter()
        .map(|k| format!("{} ({})", k.name(), k.what()))
        .collect::<Vec<_>>()
        .join(", ")
}

/// The repository a spec belongs to: the nearest ancestor holding
/// `goldens/recorders/requirements.txt`, else the source tree of this binary.
pub fn repo_root(spec: &Path) -> PathBuf {
    let abs = std::fs::canonicalize(spec).unwrap_or_else(|_| spec.to_path_buf());
    abs.ancestors()
        .find(|d| d.join("goldens/recorders/requirements.txt").is_file())
        .map(Path::to_path_buf)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")))
}

/// The recorders' interpreter, where `goldens regen` and regen.sh create it.
pub fn venv_python() -> PathBuf {
    crate::model::cache::dir().join("recorders-venv/bin/python")
}

fn create_venv(root: &Path) -> String {
    let reqs = root.join("goldens/recorders/requirements.txt");
    format!(
        "create it with `touchstone goldens regen` (it creates {} from {} before recording; \
         `touchstone goldens reject` drops what it recorded) or `bash {}`, or by hand: \
         `python3.11 -m venv {} && {} -m pip install -r {}`",
        venv_python()
            .parent()
            .and_then(Path::parent)
            .unwrap_or(Path::new(""))
            .display(),
        reqs.display(),
        root.join("goldens/recorders/regen.sh").display(),
        venv_python()
            .parent()
            .and_then(Path::parent)
            .unwrap_or(Path::new(""))
            .display(),
        venv_python().display(),
        reqs.display()
    )
}

/// Where build_llamacpp.py puts libllama for the pinned version
/// (`$TOUCHSTONE_LLAMACPP_CACHE`, default `$TOUCHSTONE_CACHE/llamacpp`,
/// then `build-<version>/bin/libllama.so`); None when requirements.txt has
/// no pin to read (the engine then says what is missing when it loads).
pub fn libllama(root: &Path) -> Option<PathBuf> {
    let reqs = std::fs::read_to_string(root.join("goldens/recorders/requirements.txt")).ok()?;
    let version = reqs.lines().find_map(|l| {
        let rest = l.trim_start_matches('#').trim().strip_prefix("llama-cpp-python==")?;
        let v: String = rest
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '+' | '-'))
            .collect();
        (!v.is_empty()).then_some(v)
    })?;
    let cache = std::env::var_os("TOUCHSTONE_LLAMACPP_CACHE")
        .filter(|d| !d.is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(|| crate::model::cache::dir().join("llamacpp"));
    Some(cache.join(format!("build-{version}/bin/libllama.so")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_arguments_parse() {
        let spec = Path::new(env!("CARGO_MANIFEST_DIR")).join("specs/qwen2-tiny.yaml");
        assert!(ThirdParty::parse("cpu", &spec).is_none());
        assert!(ThirdParty::parse("hfx", &spec).is_none());
        assert!(ThirdParty::parse("llama.cppx", &spec).is_none());
        for (arg, kind, args) in [
            ("hf", Kind::Hf, vec![]),
            ("hf:--attn-scale 0.5", Kind::Hf, vec!["--attn-scale", "0.5"]),
            ("llama.cpp", Kind::LlamaCpp, vec![]),
            (
                "llama.cpp:--rope-freq-base 1e4",
                Kind::LlamaCpp,
                vec!["--rope-freq-base", "1e4"],
            ),
        ] {
            match ThirdParty::parse(arg, &spec).unwrap() {
                Ok(t) => {
                    assert_eq!(
                        (t.kind, t.args.clone()),
                        (kind, args.iter().map(|s| s.to_string()).collect())
                    );
                    assert_eq!(t.exec.name, kind.name());
                    assert!(t.exec.argv[1].ends_with(kind.script()), "{:?}", t.exec.argv);
                    let want = if t.args.is_empty() {
                        kind.name().to_string()
                    } else {
                        format!("'{arg}'")
                    };
                    assert_eq!(t.cli_arg(), want);
                }
                // No venv or libllama here: the error names what and how.
                Err(Error::Environment { engine, missing, fix }) => {
                    assert_eq!(engine, kind.name());
                    assert!(
                        missing.contains("recorders' Python") || missing.contains("libllama"),
                        "{missing}"
                    );
                    assert!(
                        fix.contains("goldens regen") || fix.contains("build_llamacpp.py"),
                        "{fix}"
                    );
                }
                Err(e) => panic!("{arg}: {e}"),
            }
        }
    }

    #[test]
    fn the_libllama_path_follows_the_pin() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR"));
        let lib = libllama(root).expect("requirements.txt pins llama-cpp-python");
        assert!(lib.ends_with("bin/libllama.so"), "{}", lib.display());
        assert!(lib.display().to_string().contains("/build-0."), "{}", lib.display());
    }
}
