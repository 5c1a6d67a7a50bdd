//! `touchstone goldens regen`: set up the recorders' Python environment, run
//! the recorders for each golden a spec declares, and write the results as
//! pending files (`<golden>.new`) for review. Never writes a committed golden,
//! and refuses to run at all on CI (`CI=true`): CI checks goldens, it never
//! makes them.
//!
//! Environment: `--python` when given (its packages must match every pin of
//! `goldens/recorders/requirements.txt`, checked offline), else the venv
//! `$TOUCHSTONE_CACHE/recorders-venv` (default `~/.cache/touchstone`; the one
//! `regen.sh` uses too), created (`$PYTHON -m venv`, default `python3`) and
//! `pip install -r` run when it is missing or a pin is not met. Recorders run
//! as `regen.sh` runs them: CPU only, one thread, offline.
//!
//! What is recorded: the spec's prompt (`prompt.text`, `prompt.chat`,
//! `prompt.decode_steps`; without a text, the current golden's prompt) and its
//! `record:` subset (`--steps`, `--stages`, `--logits`). The model is the
//! spec's: an HF folder (llama.cpp gets a GGUF converted from it, once per
//! regen) or a GGUF, which both recorders read as it is. A spec's
//! `next_token` run check adds its folder's five next-token goldens
//! (`next_token`: record_next_token.py, in regen.sh's order and arguments).
//!
//! Nothing is written inside the touchstone checkout: the venv and libllama
//! live in `$TOUCHSTONE_CACHE`, intermediate files (a converted GGUF, the
//! recorders' outputs) in a fresh temporary folder that is removed when regen
//! ends, also on error; only the pending `<golden>.new` files are written,
//! beside the spec's goldens.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use super::change;
use super::job::{Job, NtSource, RecordArgs, Recorder};
use super::next_token;
use super::pending::{check_next_token_file, write_atomic};
use super::progress::{run_streaming, tail, Progress};
use super::venv::python_env;
use crate::error::{Error, Result};
use crate::golden::GoldenSet;

/// A fresh folder for one regen's intermediate files, removed on drop (so
/// also when regen fails and returns early). A SIGKILL leaves it in the
/// system's temporary folder, never in the checkout.
struct WorkDir(PathBuf);

impl WorkDir {
    fn new() -> Result<WorkDir> {
        let base = std::env::temp_dir();
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
        for i in 0..100u32 {
            let p = base.join(format!("touchstone-regen-{}-{nanos}-{i}", std::process::id()));
            match std::fs::create_dir(&p) {
                Ok(()) => return Ok(WorkDir(p)),
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
                Err(e) => return Err(Error::io(&p, e)),
            }
        }
        Err(Error::Usage(format!(
            "cannot create a temporary folder in {}",
            base.display()
        )))
    }
}

impl Drop for WorkDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The golden whose token ids a teacher-forced recording is fed: the HF
/// golden recorded in this run, else the spec's current `hf` golden, else an
/// `hf.safetensors` beside this golden.
fn hf_tokens(fresh_hf: &std::collections::BTreeMap<String, PathBuf>, j: &Job) -> Option<PathBuf> {
    fresh_hf.get(&j.golden.spec).cloned().or_else(|| {
        [
            j.args.hf_golden.clone(),
            Some(j.golden.golden.with_file_name("hf.safetensors")),
        ]
        .into_iter()
        .flatten()
        .find(|p| p.exists())
    })
}

/// True when the model is a single GGUF file (recorded as it is).
fn is_gguf(model: &Path) -> bool {
    model.is_file() && model.extension().is_some_and(|e| e.eq_ignore_ascii_case("gguf"))
}

/// The GGUF llama.cpp runs for a job: a GGUF model as it is (quantised or
/// not); an HF folder converted first into the work folder, once per regen
/// (`ggufs`), in a folder named after the first job that needs it and the
/// file named as regen.sh names it (`model.gguf`, which the provenance keeps).
fn gguf_of(
    j: &Job,
    work: &Path,
    ggufs: &mut std::collections::BTreeMap<PathBuf, PathBuf>,
    py: &Path,
    recorders: &Path,
    progress: &Progress,
) -> Result<PathBuf> {
    if is_gguf(&j.model) {
        return Ok(j.model.clone());
    }
    if let Some(g) = ggufs.get(&j.model) {
        return Ok(g.clone());
    }
    let dir = work.join(format!("{}-{}", j.golden.spec, j.golden.source));
    std::fs::create_dir_all(&dir).map_err(|e| Error::io(&dir, e))?;
    let gguf = dir.join("model.gguf");
    let mut c = recorder_cmd(py, &recorders.join("convert_gguf.py"));
    c.arg(&j.model).arg(&gguf);
    run_recorder(c, "convert_gguf.py", progress)?;
    ggufs.insert(j.model.clone(), gguf.clone());
    Ok(gguf)
}

pub use crate::ci_env::on_ci;

/// Exit-2 error when on CI: goldens are never written there.
pub fn refuse_on_ci(what: &str) -> Result<()> {
    if on_ci() {
        return Err(Error::Usage(format!(
            "refusing to {what} goldens on CI (CI is set in the environment): CI checks goldens, it never writes \
             them; run `touchstone goldens regen` locally, review, accept and commit"
        )));
    }
    Ok(())
}

/// The prompt arguments of the HF recorder (llama.cpp's is fed the HF
/// golden's tokens): the spec's prompt (token ids as given, or text), else
/// the one the current golden was recorded with, so a regen records the same
/// prompt and number of decode steps. With neither, regen refuses: a
/// recorder's default prompt is never substituted for the spec's.
fn prompt_args(spec: &str, golden: &Path, args: &RecordArgs) -> Result<Vec<String>> {
    let current = GoldenSet::load("current", golden).ok();
    let recorded = |ptr: &str| current.as_ref().and_then(|g| g.provenance.pointer(ptr).cloned());
    let mut out = Vec::new();
    let given_ids = |ids: &[u32]| ids.iter().map(u32::to_string).collect::<Vec<_>>().join(",");
    if let Some(ids) = &args.tokens {
        out.extend(["--prompt-tokens".to_string(), given_ids(ids)]);
    } else if let Some(t) = &args.prompt {
        out.extend(["--prompt".to_string(), t.clone()]);
        if args.chat {
            out.push("--chat".to_string());
        }
    } else if recorded("/prompt/given")
        .and_then(|v| v.as_str().map(String::from))
        .as_deref()
        == Some("tokens")
    {
        let ids: Vec<u32> = recorded("/prompt/token_ids")
            .and_then(|v| serde_json::from_value(v).ok())
            .unwrap_or_default();
        out.extend(["--prompt-tokens".to_string(), given_ids(&ids)]);
    } else if let Some(t) = recorded("/prompt/text").and_then(|v| v.as_str().map(String::from)) {
        out.extend(["--prompt".to_string(), t]);
        if recorded("/prompt/chat").and_then(|v| v.as_bool()).unwrap_or(false) {
            out.push("--chat".to_string());
        }
    } else {
        return Err(Error::Usage(format!(
            "spec `{spec}` gives no prompt to record (`prompt: {{text: ...}}` or `prompt: {{tokens: [...]}}`) and \
             {} records none to record again: give the spec a prompt",
            if current.is_some() {
                format!("its golden {}", golden.display())
            } else {
                format!("its golden {} does not exist yet, so it", golden.display())
            }
        )));
    }
    let steps = args
        .decode_steps
        .map(|n| n as u64)
        .or_else(|| recorded("/decode_steps").and_then(|v| v.as_u64()));
    if let Some(n) = steps {
        out.extend(["--decode-steps".to_string(), n.to_string()]);
    }
    Ok(out)
}

/// record_vlm.py's arguments: the spec's text (with its one
/// `<|image_pad|>`), image, chat flag and decode steps. A VLM spec records
/// every stage of every step; a `record:` subset is refused, not ignored.
fn vlm_args(spec: &str, golden: &Path, args: &RecordArgs) -> Result<Vec<String>> {
    let (Some(text), Some(image)) = (&args.prompt, &args.image) else {
        return Err(Error::Usage(format!(
            "spec `{spec}` has `prompt.image` but no `prompt.text`: a vision-language golden is recorded from the text \
             (with `<|vision_start|><|image_pad|><|vision_end|>` where the image goes) and the image"
        )));
    };
    if args.steps.is_some() || args.stages.is_some() || args.rows.is_some() || args.logits_last {
        return Err(Error::Usage(format!(
            "spec `{spec}`: `record:` subsets are not supported for vision-language goldens (record_vlm.py records \
             every stage)"
        )));
    }
    let mut out = vec![
        "--prompt".to_string(),
        text.clone(),
        "--image".to_string(),
        image.display().to_string(),
    ];
    if args.chat {
        out.push("--chat".into());
    }
    // Without `prompt.decode_steps`, the current golden's count (as text specs).
    let current = GoldenSet::load("current", golden).ok();
    let steps = args.decode_steps.map(|n| n as u64).or_else(|| {
        current
            .as_ref()
            .and_then(|g| g.provenance.get("decode_steps").and_then(|v| v.as_u64()))
    });
    if let Some(n) = steps {
        out.extend(["--decode-steps".to_string(), n.to_string()]);
    }
    Ok(out)
}

/// The subset arguments (`record:`), the same for both recorders.
fn subset_args(args: &RecordArgs) -> Vec<String> {
    let mut out = Vec::new();
    if let Some(s) = &args.steps {
        out.extend(["--steps".to_string(), s.join(",")]);
    }
    if let Some(s) = &args.stages {
        out.extend(["--stages".to_string(), s.join(",")]);
    }
    if args.logits_last {
        out.extend(["--logits".to_string(), "last".to_string()]);
    }
    if let Some(rows) = &args.rows {
        let rows: Vec<String> = rows.iter().map(i64::to_string).collect();
        out.extend(["--rows".to_string(), rows.join(",")]);
    }
    out
}

/// Recorder progress (`record_hf.py: prefill: layer 3/24`, ...) goes to the
/// bar; anything else a recorder prints is kept for the error message.
fn relay(progress: &Progress) -> impl FnMut(&str) + '_ {
    |line: &str| {
        let l = line.trim();
        if [
            "record_hf.py:",
            "record_vlm.py:",
            "record_llamacpp_vlm.py:",
            "record_llamacpp.py:",
            "record_next_token.py:",
            "build_llamacpp.py:",
            "convert_gguf.py:",
            "INFO:hf-to-gguf:",
        ]
        .iter()
        .any(|p| l.starts_with(p))
        {
            progress.detail(l);
        }
    }
}

pub(super) fn recorder_cmd(python: &Path, script: &Path) -> Command {
    let mut c = Command::new(python);
    c.arg(script);
    // As regen.sh: CPU only, one thread, deterministic hashing, no Hub access.
    for (k, v) in [
        ("CUDA_VISIBLE_DEVICES", ""),
        ("OMP_NUM_THREADS", "1"),
        ("MKL_NUM_THREADS", "1"),
        ("PYTHONHASHSEED", "0"),
        ("PYTHONDONTWRITEBYTECODE", "1"),
        ("HF_HUB_OFFLINE", "1"),
        ("TRANSFORMERS_OFFLINE", "1"),
        ("TOKENIZERS_PARALLELISM", "false"),
    ] {
        c.env(k, v);
    }
    c
}

/// Runs a recorder; returns its `memory:` lines (the HF recorders' peak RSS
/// against the model's float32 size), which the review keeps.
fn run_recorder(cmd: Command, what: &str, progress: &Progress) -> Result<Vec<String>> {
    let (ok, out) = run_streaming(cmd, relay(progress))?;
    if !ok {
        progress.finish();
        return Err(Error::Usage(format!("{what} failed:\n{}", tail(&out, 25))));
    }
    Ok(memory_lines(&out))
}

/// `record_hf.py: memory: peak RSS …` → `memory: peak RSS …`.
fn memory_lines(out: &str) -> Vec<String> {
    out.lines()
        .filter_map(|l| l.trim().split_once(": memory: "))
        .filter(|(tool, _)| tool.ends_with(".py") && !tool.contains(' '))
        .map(|(_, m)| format!("memory: {m}"))
        .collect()
}

/// The outcome of a regen: the review text and whether any pending golden differs.
pub struct RegenResult {
    pub text: String,
    pub changed: bool,
}

/// Records every job into its pending file and describes each change.
pub fn regen(root: &Path, jobs: &[Job], python: Option<&Path>) -> Result<RegenResult> {
    refuse_on_ci("regenerate")?;
    let recorders = root.join("goldens/recorders");
    for j in jobs {
        for s in j.recorder.scripts() {
            if !recorders.join(s).exists() {
                return Err(Error::Usage(format!(
                    "no recorder for golden `{}` of spec `{}`: {} is missing (the {} recorder has not landed in this \
                     checkout)",
                    j.golden.source,
                    j.golden.spec,
                    recorders.join(s).display(),
                    match j.recorder {
                        Recorder::Hf | Recorder::HfHalf(_) | Recorder::Oracle => "HF",
                        Recorder::LlamaCpp => "llama.cpp",
                        Recorder::NextToken(_) => "next-token",
                    }
                )));
            }
        }
    }
    for j in jobs {
        if !j.model.exists() {
            return Err(Error::Usage(format!(
                "spec `{}`: model {} does not exist",
                j.golden.spec,
                j.model.display()
            )));
        }
    }
    // A next-token file whose inputs (the oracle's, `hf`'s) neither this run
    // records nor the folder holds is refused before anything is recorded.
    let planned: next_token::Fresh = jobs
        .iter()
        .filter(|j| matches!(j.recorder, Recorder::NextToken(_)))
        .map(|j| (j.golden.golden.clone(), j.golden.pending()))
        .collect();
    for j in jobs {
        if let Recorder::NextToken(src) = j.recorder {
            next_token::args(j, src, &j.model, Path::new(""), &planned)?;
        }
    }
    // Removed when this function returns, whichever way.
    let work_dir = WorkDir::new()?;
    let work = work_dir.0.as_path();
    let mut progress = Progress::new(1 + jobs.len() as u64);
    let t0 = Instant::now();
    let py = python_env(root, python, &mut progress)?;
    let setup = t0.elapsed();
    let mut text = String::new();
    let mut changed = false;
    let mut record_times = Vec::new();
    // An HF golden regenerated in this run is what a llama.cpp recorder compares against.
    let mut fresh_hf: std::collections::BTreeMap<String, PathBuf> = Default::default();
    // Next-token files recorded in this run, which the later sources read.
    let mut fresh_nt = next_token::Fresh::new();
    // The GGUF converted from each HF-folder model, once per regen.
    let mut ggufs: std::collections::BTreeMap<PathBuf, PathBuf> = Default::default();
    // HF first, so the 16-bit HF and llama.cpp jobs of the same spec are fed
    // the fresh HF golden's tokens (`Recorder::order`).
    let mut ordered: Vec<&Job> = jobs.iter().collect();
    ordered.sort_by_key(|j| j.recorder.order());
    for j in ordered {
        let g = &j.golden;
        let nt = matches!(j.recorder, Recorder::NextToken(_));
        progress.start(&format!(
            "recording{} `{}` golden of {} from {}",
            if nt { " next-token" } else { "" },
            g.source,
            g.spec,
            j.model.display()
        ));
        let t = Instant::now();
        let out = work.join(format!(
            "{}{}-{}.safetensors",
            g.spec,
            if nt { "-next-token" } else { "" },
            g.source
        ));
        let _ = std::fs::remove_file(&out);
        let memory = match j.recorder {
            Recorder::HfHalf(half) => {
                let hf = hf_tokens(&fresh_hf, j).ok_or_else(|| {
                    Error::Usage(format!(
                        "spec `{}`: golden `{}` is fed the `hf` golden's tokens, and the spec has no `hf` golden \
                         (add one, or record it in the same regen)",
                        g.spec, g.source
                    ))
                })?;
                let mut c = recorder_cmd(&py, &recorders.join("record_hf.py"));
                c.arg(&j.model)
                    .arg(&out)
                    .arg("--dtype")
                    .arg(half.torch_name())
                    .arg("--tokens-from")
                    .arg(hf)
                    .args(subset_args(&j.args));
                run_recorder(c, "record_hf.py", &progress)?
            }
            // A vision-language spec: HF's processor and model from the
            // spec's text and image (record_vlm.py records every stage).
            Recorder::Hf | Recorder::Oracle if j.args.image.is_some() => {
                let mut c = recorder_cmd(&py, &recorders.join("record_vlm.py"));
                c.arg(&j.model).arg(&out).args(vlm_args(&g.spec, &g.golden, &j.args)?);
                if j.recorder == Recorder::Oracle {
                    c.arg("--dtype").arg("float64");
                }
                let memory = run_recorder(c, "record_vlm.py", &progress)?;
                if j.recorder == Recorder::Hf {
                    fresh_hf.insert(g.spec.clone(), g.pending());
                }
                memory
            }
            Recorder::Hf | Recorder::Oracle => {
                let mut c = recorder_cmd(&py, &recorders.join("record_hf.py"));
                c.arg(&j.model)
                    .arg(&out)
                    .args(prompt_args(&g.spec, &g.golden, &j.args)?)
                    .args(subset_args(&j.args));
                if let Some(sp) = &j.args.sample_probs {
                    c.arg("--sample-probs").arg(sp);
                }
                if j.recorder == Recorder::Oracle {
                    c.arg("--dtype").arg("float64");
                }
                let memory = run_recorder(c, "record_hf.py", &progress)?;
                if j.recorder == Recorder::Hf {
                    fresh_hf.insert(g.spec.clone(), g.pending());
                }
                memory
            }
            Recorder::NextToken(src) => {
                let model = if src == NtSource::LlamaCpp {
                    gguf_of(j, work, &mut ggufs, &py, &recorders, &progress)?
                } else {
                    j.model.clone()
                };
                let mut c = recorder_cmd(&py, &recorders.join("record_next_token.py"));
                c.args(next_token::args(j, src, &model, &out, &fresh_nt)?);
                run_recorder(c, "record_next_token.py", &progress)?
            }
            // A vision-language spec: the text GGUF and the vision tower's
            // mmproj GGUF converted from the HF folder, then mtmd fed the
            // image and the HF golden's tokens (record_llamacpp_vlm.py).
            Recorder::LlamaCpp if j.args.image.is_some() => {
                let gguf = gguf_of(j, work, &mut ggufs, &py, &recorders, &progress)?;
                let mmproj = gguf.with_file_name("mmproj.gguf");
                if !mmproj.exists() {
                    let mut c = recorder_cmd(&py, &recorders.join("convert_gguf.py"));
                    c.arg(&j.model).arg(&mmproj).arg("--mmproj");
                    run_recorder(c, "convert_gguf.py", &progress)?;
                }
                let hf = hf_tokens(&fresh_hf, j).ok_or_else(|| {
                    Error::Usage(format!(
                        "spec `{}`: llama.cpp's vision-language golden is fed the `hf` golden's tokens, and the spec \
                         has no `hf` golden",
                        g.spec
                    ))
                })?;
                let image = j.args.image.as_ref().expect("matched on an image");
                let mut c = recorder_cmd(&py, &recorders.join("record_llamacpp_vlm.py"));
                c.arg(&gguf)
                    .arg(&mmproj)
                    .arg(&out)
                    .arg("--hf-golden")
                    .arg(hf)
                    .arg("--image")
                    .arg(image);
                run_recorder(c, "record_llamacpp_vlm.py", &progress)?
            }
            Recorder::LlamaCpp => {
                let gguf = gguf_of(j, work, &mut ggufs, &py, &recorders, &progress)?;
                let hf = hf_tokens(&fresh_hf, j);
                let mut c = recorder_cmd(&py, &recorders.join("record_llamacpp.py"));
                c.arg(&gguf).arg(&out);
                c.args(subset_args(&j.args));
                c.arg("--kv-type").arg(if j.args.kv_f16 { "f16" } else { "f32" });
                if let Some(hf) = hf {
                    c.arg("--hf-golden").arg(hf);
                }
                run_recorder(c, "record_llamacpp.py", &progress)?
            }
        };
        let bytes = std::fs::read(&out).map_err(|e| Error::io(&out, e))?;
        // Refuse to stage something that is not a usable golden.
        let (desc, differs, greedy) = if nt {
            check_next_token_file(&out, &g.source)?;
            write_atomic(&g.pending(), &bytes)?;
            fresh_nt.insert(g.golden.clone(), g.pending());
            let (desc, differs) = next_token::describe(&g.golden, &g.pending())?;
            (desc, differs, String::new())
        } else {
            let recorded = GoldenSet::load(&g.source, &out)?;
            write_atomic(&g.pending(), &bytes)?;
            let (desc, differs) = change::describe(&g.golden, &g.pending())?;
            let greedy = change::greedy_disagreement(&g.source, &recorded.provenance).unwrap_or_default();
            (desc, differs, greedy)
        };
        let took = t.elapsed();
        record_times.push(format!("{} {:.1} s", g.label(), took.as_secs_f64()));
        changed |= differs;
        let memory: String = memory.iter().map(|m| format!("  {m}\n")).collect();
        text += &format!(
            "{}: pending {} vs current {}\n{desc}{greedy}{memory}\n",
            g.label(),
            g.pending().display(),
            g.golden.display(),
        );
    }
    progress.finish();
    text += &format!(
        "timing: environment {:.1} s; recording {}\n",
        setup.as_secs_f64(),
        record_times.join(", ")
    );
    text += if changed {
        "review the change above, then `touchstone goldens accept` (or `reject`)\n"
    } else {
        "every pending golden is byte-identical to the current one; `touchstone goldens reject` discards them\n"
    };
    Ok(RegenResult { text, changed })
}

#[cfg(test)]
mod tests {
    use super::memory_lines;

    #[test]
    fn memory_lines_keep_the_recorders_memory_report_only() {
        let out = "record_hf.py: prefill: layer 3/24\n\
                   regen noise: memory: no\n  record_hf.py: memory: peak RSS 4.28 GiB, the model in float32 2.35 GiB: 1.82x\n\
                   {\"out\": \"memory: not a progress line\"}\n\
                   record_next_token.py: memory: peak RSS 4.37 GiB\n";
        assert_eq!(
            memory_lines(out),
            [
                "memory: peak RSS 4.28 GiB, the model in float32 2.35 GiB: 1.82x",
                "memory: peak RSS 4.37 GiB"
            ]
        );
    }
}
