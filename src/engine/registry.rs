//! The one registry of engines: every engine `--engine` (and a spec's
//! `engines:`) can name — the built-in ones (`cpu`, `cuda`, `cuda-emu`), the
//! third-party engines under test (`hf`, `llama.cpp`: `engine::third_party`),
//! any program speaking the subprocess protocol (`exec:COMMAND ARGS…`, or a
//! name declared under a spec's `engines:`), or tensors already written
//! (`dumps:PATH`) — with its name, availability and loader in one place.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::de::{self, Deserializer};
use serde::Deserialize;

use super::exec::{ExecEngine, ExecSpec};
use super::names::NameMap;
use super::third_party::ThirdParty;
use super::{cpu, cuda, dumps, Availability, Engine};
use crate::error::{Error, Result};
use crate::model::LoadOptions;

#[derive(Clone, Debug, PartialEq)]
pub enum EngineSel {
    /// The CPU reference engine.
    Cpu,
    /// The CUDA engine on a real device.
    Cuda,
    /// The CUDA engine's host code on the emulated device (`cuda::emu`):
    /// every kernel and launch of `cuda` run on the CPU, always available.
    CudaEmu,
    /// A program speaking the subprocess protocol.
    Exec(ExecSpec),
    /// HF transformers or llama.cpp under test (protocol engines run by the
    /// recorders' Python); not part of `all`.
    ThirdParty(ThirdParty),
    /// Tensors another program wrote (safetensors or `<step>/<name>.npy`).
    Dumps(PathBuf),
}

/// The built-in engines, in the order `all` runs them.
pub const BUILTINS: [EngineSel; 3] = [EngineSel::Cpu, EngineSel::Cuda, EngineSel::CudaEmu];

/// Names reserved for the built-ins, the third-party engines and the
/// `exec:`/`dumps:` forms (a spec's `engines:` may not shadow them).
pub const RESERVED: [&str; 8] = ["cpu", "cuda", "cuda-emu", "all", "exec", "dumps", "hf", "llama.cpp"];

/// A spec's `engines: {NAME: {exec: [COMMAND, ARGS…], timeout_s: 60}}` entry.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EngineDecl {
    /// The command and its arguments; it runs in the spec's folder.
    pub exec: Vec<String>,
    /// Per-request deadline in seconds (default 120).
    #[serde(default, deserialize_with = "seconds")]
    pub timeout_s: Option<f64>,
    /// How it computes, where its storage dtype does not say it all (e.g.
    /// `q8_k`: activations quantised to 8 bits before each matmul): the
    /// scaled policy judges it by that arithmetic's floors. Its load answer
    /// may say it instead.
    #[serde(default)]
    pub arithmetic: Option<crate::arithmetic::Arithmetic>,
    /// A command that must exit 0 for the engine to run here (e.g.
    /// `[python3, -c, "import numpy"]`); where it fails the engine's trials
    /// are ignored with its words as the reason, except under `CI=true`,
    /// where they fail (`engine::requires`).
    #[serde(default)]
    pub requires: Option<Vec<String>>,
}

/// A timeout: a finite number of seconds >= 0.
fn seconds<'de, D: Deserializer<'de>>(d: D) -> std::result::Result<Option<f64>, D::Error> {
    let v = f64::deserialize(d)?;
    if v.is_finite() && v >= 0.0 {
        Ok(Some(v))
    } else {
        Err(de::Error::custom(format!(
            "timeout_s must be a finite number >= 0 (seconds), got {v}"
        )))
    }
}

/// What a spec says about engines: those it declares, where they run, and
/// whether `all` includes the emulated device.
#[derive(Clone, Copy, Debug)]
pub struct Declared<'a> {
    pub engines: &'a BTreeMap<String, EngineDecl>,
    /// The spec's folder: declared engines run there.
    pub dir: &'a Path,
    /// `emulate:` — whether `all` includes `cuda-emu`.
    pub emulate: bool,
    /// The spec file, for messages.
    pub spec_path: &'a Path,
}

impl EngineSel {
    /// Resolves one `--engine` value: `cpu`, `cuda`, `cuda-emu`, `all` (every
    /// built-in — `cuda-emu` unless the spec says `emulate: false` — and every
    /// engine the spec declares; never `hf` or `llama.cpp`), `hf[:ARGS]`,
    /// `llama.cpp[:ARGS]` (an `Error::Environment` where their Python or
    /// libllama is missing), `exec:…`, `dumps:…`, or a declared name.
    pub fn resolve(arg: &str, declared: &Declared) -> Result<Vec<EngineSel>> {
        let usage = |m: String| Error::Usage(m);
        if let Some(t) = ThirdParty::parse(arg, declared.spec_path) {
            return Ok(vec![EngineSel::ThirdParty(t?)]);
        }
        if let Some(cmd) = arg.strip_prefix("exec:") {
            return Ok(vec![EngineSel::Exec(ExecSpec::parse_cli(cmd).map_err(usage)?)]);
        }
        if let Some(p) = arg.strip_prefix("dumps:") {
            if p.is_empty() {
                return Err(usage(
                    "dumps: needs a path, e.g. --engine dumps:out/run.safetensors".into(),
                ));
            }
            return Ok(vec![EngineSel::Dumps(PathBuf::from(p))]);
        }
        if let Some(b) = BUILTINS.iter().find(|b| b.name() == arg) {
            return Ok(vec![b.clone()]);
        }
        if arg == "all" {
            let mut v: Vec<EngineSel> = BUILTINS
                .iter()
                .filter(|b| declared.emulate || **b != EngineSel::CudaEmu)
                .cloned()
                .collect();
            v.extend(declared.engines.keys().map(|n| declared_engine(declared, n)));
            return Ok(v);
        }
        if declared.engines.contains_key(arg) {
            return Ok(vec![declared_engine(declared, arg)]);
        }
        let mut known: Vec<String> = BUILTINS.iter().map(EngineSel::name).collect();
        known.push("all".into());
        known.extend(super::third_party::KINDS.iter().map(|k| k.name().to_string()));
        known.extend(declared.engines.keys().cloned());
        let hint = crate::suggest::hint(arg, known.iter().map(String::as_str));
        Err(usage(format!(
            "unknown engine `{arg}`{hint} for spec {} (known: {}, exec:COMMAND, dumps:PATH)",
            declared.spec_path.display(),
            known.join(", ")
        )))
    }

    /// The name in trial ids and reports.
    pub fn name(&self) -> String {
        match self {
            EngineSel::Cpu => "cpu".into(),
            EngineSel::Cuda => "cuda".into(),
            EngineSel::CudaEmu => "cuda-emu".into(),
            EngineSel::Exec(e) => e.name.clone(),
            EngineSel::ThirdParty(t) => t.kind.name().into(),
            EngineSel::Dumps(_) => "dumps".into(),
        }
    }

    /// How to name it on a command line (for rerun commands).
    pub fn cli_arg(&self) -> String {
        match self {
            EngineSel::Exec(e) if e.name != "exec" => e.name.clone(),
            EngineSel::Exec(e) => quote(&format!("exec:{}", e.command_line())),
            EngineSel::ThirdParty(t) => t.cli_arg(),
            EngineSel::Dumps(p) => quote(&format!("dumps:{}", p.display())),
            builtin => builtin.name(),
        }
    }

    pub fn is_builtin(&self) -> bool {
        matches!(self, EngineSel::Cpu | EngineSel::Cuda | EngineSel::CudaEmu)
    }

    /// Checked before loading anything, so an unavailable engine costs nothing.
    /// A declared engine whose `requires:` fails is unavailable, except on CI
    /// (`CI=true`), where `load` then fails with the same reason.
    pub fn availability(&self) -> Availability {
        match self {
            EngineSel::Cuda => cuda::availability(),
            EngineSel::Dumps(p) if !p.exists() => {
                Availability::Unavailable(format!("dumps: {} does not exist", p.display()))
            }
            EngineSel::Exec(e) if !crate::ci_env::on_ci() => match e.prerequisites() {
                Ok(()) => Availability::Available,
                Err(why) => Availability::Unavailable(format!(
                    "{why} (the engine `{}` needs it; trials are ignored here, and fail under CI=true)",
                    e.name
                )),
            },
            _ => Availability::Available,
        }
    }

    /// Loads `model` (an HF folder or a `.gguf` file) into the engine: starts
    /// a protocol engine, opens dumps (`names` maps their tensor names).
    pub fn load(&self, model: &Path, opts: &LoadOptions, names: &NameMap) -> Result<Box<dyn Engine>> {
        match self {
            EngineSel::Cpu => Ok(Box::new(cpu::CpuEngine::load_with(model, opts)?)),
            EngineSel::Cuda => match self.availability() {
                Availability::Unavailable(r) => Err(Error::engine("cuda", r)),
                Availability::Available => cuda::load(model, opts),
            },
            EngineSel::CudaEmu => cuda::load_emu(model, opts),
            EngineSel::Exec(e) => {
                e.prerequisites().map_err(|why| {
                    Error::engine(
                        &e.name,
                        format!("{why}; CI is set, so a missing prerequisite fails instead of being skipped"),
                    )
                })?;
                Ok(Box::new(ExecEngine::start(e, model, opts, names)?))
            }
            // Its environment was checked when the name was resolved.
            EngineSel::ThirdParty(t) => Ok(Box::new(ExecEngine::start(&t.exec, model, opts, names)?)),
            EngineSel::Dumps(p) => Ok(Box::new(dumps::DumpsEngine::open(p, model, opts.storage, names)?)),
        }
    }
}

/// A spec's declared engine: its command runs in the spec's folder.
fn declared_engine(declared: &Declared, name: &str) -> EngineSel {
    let d = &declared.engines[name];
    EngineSel::Exec(ExecSpec {
        name: name.to_string(),
        argv: d.exec.clone(),
        cwd: Some(if declared.dir.as_os_str().is_empty() {
            PathBuf::from(".")
        } else {
            declared.dir.to_path_buf()
        }),
        timeout: d
            .timeout_s
            .map(Duration::from_secs_f64)
            .unwrap_or(super::exec::DEFAULT_TIMEOUT),
        arithmetic: d.arithmetic,
        requires: d.requires.clone(),
    })
}

fn quote(s: &str) -> String {
    shlex::try_quote(s)
        .map(|c| c.into_owned())
        .unwrap_or_else(|_| s.to_string())
}
