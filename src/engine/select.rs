//! Which engine `--engine` (and a spec's `engines:`) names: a built-in one
//! (`cpu`, `cuda`, `cuda-emu`), any program speaking the subprocess protocol
//! (`exec:COMMAND ARGS…`, or a name the spec declares under `engines:`), or
//! tensors already written (`dumps:PATH`).

use std::path::{Path, PathBuf};
use std::time::Duration;

use super::exec::{ExecEngine, ExecSpec};
use super::{Availability, Engine, EngineKind};
use crate::error::{Error, Result};
use crate::model::LoadOptions;
use crate::spec::Spec;

#[derive(Clone, Debug, PartialEq)]
pub enum EngineSel {
    Builtin(EngineKind),
    Exec(ExecSpec),
    Dumps(PathBuf),
}

impl EngineSel {
    /// Resolves one `--engine` value against a spec: `cpu`, `cuda`,
    /// `cuda-emu`, `all` (every built-in — `cuda-emu` unless the spec says
    /// `emulate: false` — and every engine the spec declares),
    /// `exec:…`,
    /// `dumps:…`, or a name under the spec's `engines:`.
    pub fn resolve(arg: &str, spec: &Spec) -> Result<Vec<EngineSel>> {
        let usage = |m: String| Error::Usage(m);
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
        if let Some(k) = EngineKind::from_name(arg) {
            return Ok(vec![EngineSel::Builtin(k)]);
        }
        if arg == "all" {
            let mut v: Vec<EngineSel> = EngineKind::ALL
                .iter()
                .filter(|k| spec.emulate || **k != EngineKind::CudaEmu)
                .map(|k| EngineSel::Builtin(*k))
                .collect();
            v.extend(spec.engines.keys().map(|n| declared(spec, n)));
            return Ok(v);
        }
        if spec.engines.contains_key(arg) {
            return Ok(vec![declared(spec, arg)]);
        }
        let mut known: Vec<&str> = EngineKind::ALL.iter().map(|k| k.name()).collect();
        known.push("all");
        known.extend(spec.engines.keys().map(String::as_str));
        let hint = crate::suggest::hint(arg, known.iter().copied());
        Err(usage(format!(
            "unknown engine `{arg}`{hint} for spec {} (known: {}, exec:COMMAND, dumps:PATH)",
            spec.path.display(),
            known.join(", ")
        )))
    }

    /// The name in trial ids and reports.
    pub fn name(&self) -> String {
        match self {
            EngineSel::Builtin(k) => k.name().to_string(),
            EngineSel::Exec(e) => e.name.clone(),
            EngineSel::Dumps(_) => "dumps".into(),
        }
    }

    /// How to name it on a command line (for rerun commands).
    pub fn cli_arg(&self) -> String {
        match self {
            EngineSel::Builtin(k) => k.name().to_string(),
            EngineSel::Exec(e) if e.name != "exec" => e.name.clone(),
            EngineSel::Exec(e) => quote(&format!("exec:{}", e.command_line())),
            EngineSel::Dumps(p) => quote(&format!("dumps:{}", p.display())),
        }
    }

    pub fn is_builtin(&self) -> bool {
        matches!(self, EngineSel::Builtin(_))
    }

    pub fn availability(&self) -> Availability {
        match self {
            EngineSel::Builtin(k) => k.availability(),
            EngineSel::Exec(_) => Availability::Available,
            EngineSel::Dumps(p) if p.exists() => Availability::Available,
            EngineSel::Dumps(p) => Availability::Unavailable(format!("dumps: {} does not exist", p.display())),
        }
    }

    /// Loads `model` into the engine (starts a protocol engine, opens dumps).
    pub fn load(&self, model: &Path, opts: &LoadOptions, spec: &Spec) -> Result<Box<dyn Engine>> {
        match self {
            EngineSel::Builtin(k) => k.load(model, opts),
            EngineSel::Exec(e) => Ok(Box::new(ExecEngine::start(e, model, opts, &spec.names)?)),
            EngineSel::Dumps(p) => Ok(Box::new(super::dumps::DumpsEngine::open(
                p,
                model,
                opts.storage,
                &spec.names,
            )?)),
        }
    }
}

/// A spec's declared engine: its command runs in the spec's folder.
fn declared(spec: &Spec, name: &str) -> EngineSel {
    let d = &spec.engines[name];
    EngineSel::Exec(ExecSpec {
        name: name.to_string(),
        argv: d.exec.clone(),
        cwd: Some(
            spec.path
                .parent()
                .filter(|p| !p.as_os_str().is_empty())
                .map_or_else(|| PathBuf::from("."), Path::to_path_buf),
        ),
        timeout: d
            .timeout_s
            .map(Duration::from_secs_f64)
            .unwrap_or(super::exec::DEFAULT_TIMEOUT),
    })
}

fn quote(s: &str) -> String {
    shlex::try_quote(s)
        .map(|c| c.into_owned())
        .unwrap_or_else(|_| s.to_string())
}
