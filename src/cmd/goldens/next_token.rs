//! Next-token goldens in the review flow: the five files of a spec's
//! `next_token` run check (`oracle`, `hf`, `hf-bf16`, `hf-f16` and
//! `llamacpp.safetensors` in the check's `goldens:` folder, written by
//! `goldens/recorders/record_next_token.py`) planned as regen jobs, recorded
//! in the order and with the arguments `regen.sh`'s `record_next_token`
//! uses, and described for review per prompt (`pending` checks the files).

use std::collections::BTreeMap;
use std::ffi::OsString;
use std::fmt::Write;
use std::path::{Component, Path, PathBuf};

use serde_json::Value;

use super::job::{Job, NtSource, RecordArgs, Recorder};
use super::pending::{GoldenKind, GoldenRef};
use super::SourceFilter;
use crate::checks::run::next_token_set::{read_source, Source};
use crate::compare::sci;
use crate::error::{Error, Result};
use crate::spec::Spec;

/// This run's recorded next-token files: golden path -> its pending file.
pub type Fresh = BTreeMap<PathBuf, PathBuf>;

/// The jobs of a spec's `next_token` item: one per source `filter` accepts,
/// the files `<goldens>/{oracle,hf,hf-bf16,hf-f16,llamacpp}.safetensors`.
/// Items naming the same folder are recorded once (they must name the same
/// prompt set).
pub fn jobs(spec: &Spec, filter: SourceFilter, kv_f16: bool) -> Result<Vec<Job>> {
    let dir = spec.path.parent().unwrap_or(Path::new(""));
    let mut items: Vec<(PathBuf, PathBuf)> = Vec::new();
    for (set, folder) in spec.run_checks.iter().filter_map(|r| r.next_token_files(dir)) {
        match items.iter().find(|(_, f)| *f == folder) {
            Some((other, _)) if *other != set => {
                return Err(Error::Usage(format!(
                    "{}: two next_token items record into {} from different prompt sets ({} and {})",
                    spec.path.display(),
                    folder.display(),
                    other.display(),
                    set.display()
                )))
            }
            Some(_) => {}
            None => items.push((set, folder)),
        }
    }
    if items.is_empty() {
        return Ok(Vec::new());
    }
    if spec.config.is_some() {
        return Err(Error::Usage(format!(
            "spec `{}`: a `next_token` check with a `config:` override is not supported (record_next_token.py does \
             not apply overrides)",
            spec.name
        )));
    }
    let arithmetic = declared_arithmetic(spec)?;
    let mut jobs = Vec::new();
    for (set, folder) in items {
        for src in NtSource::ALL.into_iter().filter(|s| filter.accepts(s.name())) {
            jobs.push(Job {
                golden: GoldenRef {
                    spec: spec.name.clone(),
                    source: src.name().to_string(),
                    golden: folder.join(src.file()),
                    kind: GoldenKind::NextToken,
                },
                model: spec.model.clone(),
                recorder: Recorder::NextToken(src),
                args: RecordArgs {
                    prompt_set: Some(normalized(&set)),
                    kv_f16,
                    arithmetic: arithmetic.clone(),
                    ..RecordArgs::default()
                },
            });
        }
    }
    Ok(jobs)
}

/// llama.cpp's arithmetic as the spec declares it under `scaled.arithmetic`,
/// as compact JSON with sorted keys (regen.sh's `spec_args arithmetic`): a
/// map as written, a name expanded (`q8_0`/`q8_k` -> f32 storage with those
/// activations, a dtype -> that storage). None when undeclared.
fn declared_arithmetic(spec: &Spec) -> Result<Option<String>> {
    let Some(key) = spec
        .scaled
        .arithmetic
        .keys()
        .find(|k| Recorder::for_source(k) == Some(Recorder::LlamaCpp))
    else {
        return Ok(None);
    };
    let text = std::fs::read_to_string(&spec.path).map_err(|e| Error::io(&spec.path, e))?;
    let bad = |m: String| Error::Usage(format!("{}: scaled.arithmetic.{key}: {m}", spec.path.display()));
    let doc: serde_yaml::Value = serde_yaml::from_str(&text).map_err(|e| bad(e.to_string()))?;
    let declared = doc
        .get("scaled")
        .and_then(|s| s.get("arithmetic"))
        .and_then(|a| a.get(key.as_str()))
        .ok_or_else(|| bad("not found in the spec's text".into()))?;
    let map: BTreeMap<String, Value> = match declared {
        serde_yaml::Value::String(name) if name == "q8_0" || name == "q8_k" => {
            [("storage", "f32"), ("activations", name.as_str())]
                .into_iter()
                .map(|(k, v)| (k.to_string(), Value::from(v)))
                .collect()
        }
        serde_yaml::Value::String(name) => [("storage".to_string(), Value::from(name.as_str()))].into(),
        other => serde_json::from_value(serde_json::to_value(other).map_err(|e| bad(e.to_string()))?)
            .map_err(|e| bad(format!("not a map ({e})")))?,
    };
    serde_json::to_string(&map).map(Some).map_err(|e| bad(e.to_string()))
}

/// `p` absolute, `.` and `..` folded away as written (regen.sh's
/// os.path.normpath): the prompt set's path the recorder is given.
fn normalized(p: &Path) -> PathBuf {
    let abs = std::path::absolute(p).unwrap_or_else(|_| p.to_path_buf());
    let mut out = PathBuf::new();
    for c in abs.components() {
        match c {
            Component::CurDir => {}
            Component::ParentDir => {
                out.pop();
            }
            other => out.push(other),
        }
    }
    out
}

/// A file another source's recording reads: this run's, else the folder's
/// current golden.
fn input(fresh: &Fresh, j: &Job, of: NtSource, flag: &str) -> Result<PathBuf> {
    let golden = j.golden.golden.with_file_name(of.file());
    if let Some(p) = fresh.get(&golden) {
        return Ok(p.clone());
    }
    if golden.is_file() {
        return Ok(golden);
    }
    Err(Error::Usage(format!(
        "spec `{}`: the next-token `{}` golden is recorded with {flag} the `{}` one, and {} does not exist: record \
         them in the same regen (leave out --source, or accept the `{}` one first)",
        j.golden.spec,
        j.golden.source,
        of.name(),
        golden.display(),
        of.name()
    )))
}

/// record_next_token.py's arguments for one job: `MODEL OUT --prompts SET
/// --source NAME`, then `--oracle` (every source but the oracle),
/// `--tokens-from` the `hf` file (the 16-bit sources and llama.cpp), and
/// llama.cpp's `--kv-type f16` and `--arithmetic`, as regen.sh passes them.
/// `model` is the spec's model, or for llama.cpp its GGUF.
pub fn args(j: &Job, src: NtSource, model: &Path, out: &Path, fresh: &Fresh) -> Result<Vec<OsString>> {
    let set = j.args.prompt_set.as_ref().ok_or_else(|| {
        Error::Usage(format!(
            "spec `{}`: a next-token job without a prompt set",
            j.golden.spec
        ))
    })?;
    let mut a: Vec<OsString> = vec![model.into(), out.into(), "--prompts".into(), set.into()];
    a.extend(["--source".into(), src.name().into()]);
    if src == NtSource::LlamaCpp {
        if j.args.kv_f16 {
            a.extend(["--kv-type".into(), "f16".into()]);
        }
        if let Some(json) = &j.args.arithmetic {
            a.extend(["--arithmetic".into(), json.into()]);
        }
    }
    if matches!(src, NtSource::HfHalf(_) | NtSource::LlamaCpp) {
        a.extend([
            "--tokens-from".into(),
            input(fresh, j, NtSource::Hf, "the tokens of")?.into(),
        ]);
    }
    if src != NtSource::Oracle {
        a.extend([
            "--oracle".into(),
            input(fresh, j, NtSource::Oracle, "the log-probabilities at the top ids of")?.into(),
        ]);
    }
    Ok(a)
}

/// The review text of a pending next-token file against the current one:
/// per prompt whether its tokens changed, at how many positions the top-1
/// and the top-K ids changed, the largest change of a log-probability (at
/// the same id) and of `at_oracle`; the provenance key by key; whether the
/// bytes differ. Returns the text and whether they do.
pub fn describe(current: &Path, pending: &Path) -> Result<(String, bool)> {
    let mut out = String::new();
    let new_bytes = std::fs::read(pending).map_err(|e| Error::io(pending, e))?;
    let Ok(old_bytes) = std::fs::read(current) else {
        let _ = writeln!(
            out,
            "  no current golden at {}: the pending file is new",
            current.display()
        );
        return Ok((out, true));
    };
    let identical = old_bytes == new_bytes;
    let new = read_source(pending)?;
    match read_source(current) {
        Ok(old) => {
            prompt_table(&mut out, &old, &new);
            provenance(&mut out, &old.provenance, &new.provenance);
        }
        Err(e) => {
            let _ = writeln!(out, "  the current golden is not a readable next-token golden ({e})");
        }
    }
    let _ = writeln!(
        out,
        "  file: {}",
        if identical {
            "byte-identical to the current golden"
        } else {
            "DIFFERS from the current golden"
        }
    );
    Ok((out, !identical))
}

fn prompt_table(out: &mut String, old: &Source, new: &Source) {
    let _ = writeln!(
        out,
        "  {:<14} {:>16} {:>13} {:>13} {:>14} {:>16}",
        "prompt", "tokens", "top-1 moved", "top-K moved", "max|Δ logprob|", "max|Δ at_oracle|"
    );
    let f = |x: f64| if x.is_nan() { "-".to_string() } else { sci(x) };
    let mut unchanged = true;
    for p in &new.prompts {
        let Some(o) = old.prompts.iter().find(|o| o.name == p.name) else {
            unchanged = false;
            let _ = writeln!(out, "  {:<14} {:>16}  added", p.name, p.tokens.len());
            continue;
        };
        if o.tokens != p.tokens {
            unchanged = false;
            let at = o.tokens.iter().zip(&p.tokens).position(|(a, b)| a != b);
            let _ = writeln!(
                out,
                "  {:<14} {:>16}  first difference at position {}",
                p.name,
                format!("CHANGED {}->{}", o.tokens.len(), p.tokens.len()),
                at.unwrap_or(o.tokens.len().min(p.tokens.len()))
            );
            continue;
        }
        let t = p.tokens.len();
        let top1 = (0..t).filter(|&i| o.top_ids[i].first() != p.top_ids[i].first()).count();
        let topk = (0..t).filter(|&i| o.top_ids[i] != p.top_ids[i]).count();
        // Log-probabilities of the same id in both top lists.
        let mut dlp = 0.0f64;
        for i in 0..t {
            for (j, id) in p.top_ids[i].iter().enumerate() {
                if let Some(k) = o.top_ids[i].iter().position(|x| x == id) {
                    dlp = dlp.max((p.top_logprobs[i][j] - o.top_logprobs[i][k]).abs());
                }
            }
        }
        let dat = match (&o.at_oracle, &p.at_oracle) {
            (Some(a), Some(b)) => a
                .iter()
                .flatten()
                .zip(b.iter().flatten())
                .map(|(x, y)| (x - y).abs())
                .fold(0.0, f64::max),
            _ => f64::NAN,
        };
        unchanged &= top1 == 0 && topk == 0 && dlp == 0.0 && (dat == 0.0 || dat.is_nan());
        let _ = writeln!(
            out,
            "  {:<14} {:>16} {:>13} {:>13} {:>14} {:>16}",
            p.name,
            format!("{t} same"),
            format!("{top1}/{t}"),
            format!("{topk}/{t}"),
            f(dlp),
            f(dat)
        );
    }
    for o in old
        .prompts
        .iter()
        .filter(|o| !new.prompts.iter().any(|p| p.name == o.name))
    {
        unchanged = false;
        let _ = writeln!(out, "  {:<14} {:>16}  removed", o.name, o.tokens.len());
    }
    if unchanged {
        let _ = writeln!(
            out,
            "  every prompt unchanged: the same tokens and top ids, max |Δ logprob| 0"
        );
    }
}

fn provenance(out: &mut String, old: &Value, new: &Value) {
    let (mut po, mut pn) = (BTreeMap::new(), BTreeMap::new());
    super::change::flatten("", old, &mut po);
    super::change::flatten("", new, &mut pn);
    super::change::provenance_changes(out, &po, &pn);
}
