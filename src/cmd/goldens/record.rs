//! Running one recorder: its command line as `regen.sh` runs it (CPU only,
//! one thread, offline), its progress relayed, its failure kept with the
//! tail of what it printed, and the inputs a job reads from earlier ones (the
//! fresh HF golden's tokens, the GGUF converted from an HF folder).

use std::path::{Path, PathBuf};
use std::process::Command;

use std::collections::BTreeMap;

use super::args::{decode_steps, prompt_args, subset_args, vlm_args};
use super::aux::aux_args;
use super::job::{Job, NtSource, Recorder};
use super::next_token;
use super::progress::{run_streaming, tail, Progress};
use crate::error::{Error, Result};

/// What the jobs of one regen share: the interpreter and the recorders, the
/// work folder, and what earlier jobs made (keyed by spec name).
pub(super) struct Ctx<'a> {
    pub py: &'a Path,
    pub recorders: &'a Path,
    pub work: &'a Path,
    /// The HF golden recorded in this run: a teacher-forced job's tokens.
    pub fresh_hf: BTreeMap<String, PathBuf>,
    /// The oracle recorded in this run: an overflowing 16-bit HF recording
    /// reads its magnitude where it overflowed.
    pub fresh_oracle: BTreeMap<String, PathBuf>,
    /// Next-token files recorded in this run, which the later sources read.
    pub fresh_nt: next_token::Fresh,
    /// The GGUF converted from each HF-folder model, once per regen.
    pub ggufs: BTreeMap<PathBuf, PathBuf>,
}

/// Runs the recorder of `j` into `out`; returns its `memory:` lines.
pub(super) fn record_job(ctx: &mut Ctx, j: &Job, out: &Path, progress: &Progress) -> Result<Vec<String>> {
    let g = &j.golden;
    let (py, recorders, work) = (ctx.py, ctx.recorders, ctx.work);
    let no_hf = |what: &str| {
        Error::Usage(format!(
            "spec `{}`: {what} is fed the `hf` golden's tokens, and the spec has no `hf` golden (add one, or record \
             it in the same regen)",
            g.spec
        ))
    };
    match j.recorder {
        Recorder::HfHalf(half) => {
            let hf = hf_tokens(&ctx.fresh_hf, j).ok_or_else(|| no_hf(&format!("golden `{}`", g.source)))?;
            let mut c = recorder_cmd(py, &recorders.join("record_hf.py"));
            c.arg(&j.model)
                .arg(out)
                .arg("--dtype")
                .arg(half.torch_name())
                .arg("--tokens-from")
                .arg(hf)
                .args(subset_args(&j.args))
                .args(aux_args(&j.model, &j.args, decode_steps(&g.golden, &j.args))?);
            if let Some(o) = oracle_of(ctx, j) {
                c.arg("--oracle").arg(o);
            }
            run_recorder(c, "record_hf.py", progress)
        }
        // A vision-language spec: HF's processor and model from the spec's
        // text and image (record_vlm.py records every stage).
        Recorder::Hf | Recorder::Oracle if j.args.image.is_some() => {
            let mut c = recorder_cmd(py, &recorders.join("record_vlm.py"));
            c.arg(&j.model).arg(out).args(vlm_args(&g.spec, &g.golden, &j.args)?);
            if j.recorder == Recorder::Oracle {
                c.arg("--dtype").arg("float64");
            }
            run_recorder(c, "record_vlm.py", progress)
        }
        Recorder::Hf | Recorder::Oracle => {
            let mut c = recorder_cmd(py, &recorders.join("record_hf.py"));
            c.arg(&j.model)
                .arg(out)
                .args(prompt_args(&g.spec, &g.golden, &j.args)?)
                .args(subset_args(&j.args))
                .args(aux_args(&j.model, &j.args, decode_steps(&g.golden, &j.args))?);
            if let Some(sp) = &j.args.sample_probs {
                c.arg("--sample-probs").arg(sp);
            }
            if j.recorder == Recorder::Oracle {
                c.arg("--dtype").arg("float64");
            }
            run_recorder(c, "record_hf.py", progress)
        }
        Recorder::NextToken(src) => {
            let model = if src == NtSource::LlamaCpp {
                gguf_of(j, work, &mut ctx.ggufs, py, recorders, progress)?
            } else {
                j.model.clone()
            };
            let mut c = recorder_cmd(py, &recorders.join("record_next_token.py"));
            c.args(next_token::args(j, src, &model, out, &ctx.fresh_nt)?);
            run_recorder(c, "record_next_token.py", progress)
        }
        // LLaVA-1.5: the pinned converter has no route for its CLIP tower, so
        // record_llamacpp_llava.py writes both GGUFs (its docstring says how)
        // and records through mtmd, fed the image and the HF golden's tokens.
        Recorder::LlamaCpp if j.args.image.is_some() && is_llava(&j.model) => {
            let dir = work.join(format!("{}-{}", j.golden.spec, j.golden.source));
            let (gguf, mmproj) = (dir.join("model.gguf"), dir.join("mmproj.gguf"));
            if !(gguf.exists() && mmproj.exists()) {
                std::fs::create_dir_all(&dir).map_err(|e| Error::io(&dir, e))?;
                let mut c = recorder_cmd(py, &recorders.join("record_llamacpp_llava.py"));
                c.arg("convert").arg(&j.model).arg(&dir);
                run_recorder(c, "record_llamacpp_llava.py convert", progress)?;
            }
            let hf = hf_tokens(&ctx.fresh_hf, j).ok_or_else(|| no_hf("llama.cpp's LLaVA golden"))?;
            let image = j.args.image.as_ref().expect("matched on an image");
            let mut c = recorder_cmd(py, &recorders.join("record_llamacpp_llava.py"));
            c.arg("record").arg(&gguf).arg(&mmproj).arg(out).arg("--hf-golden").arg(hf).arg("--image").arg(image);
            if let Some(o) = oracle_of(ctx, j) {
                c.arg("--oracle").arg(o);
            }
            run_recorder(c, "record_llamacpp_llava.py", progress)
        }
        // A vision-language spec: the text GGUF and the vision tower's mmproj
        // GGUF converted from the HF folder, then mtmd fed the image and the
        // HF golden's tokens (record_llamacpp_vlm.py).
        Recorder::LlamaCpp if j.args.image.is_some() => {
            let gguf = gguf_of(j, work, &mut ctx.ggufs, py, recorders, progress)?;
            let mmproj = gguf.with_file_name("mmproj.gguf");
            if !mmproj.exists() {
                let mut c = recorder_cmd(py, &recorders.join("convert_gguf.py"));
                c.arg(&j.model).arg(&mmproj).arg("--mmproj");
                run_recorder(c, "convert_gguf.py", progress)?;
            }
            let hf = hf_tokens(&ctx.fresh_hf, j).ok_or_else(|| no_hf("llama.cpp's vision-language golden"))?;
            let image = j.args.image.as_ref().expect("matched on an image");
            let mut c = recorder_cmd(py, &recorders.join("record_llamacpp_vlm.py"));
            c.arg(&gguf)
                .arg(&mmproj)
                .arg(out)
                .arg("--hf-golden")
                .arg(hf)
                .arg("--image")
                .arg(image);
            run_recorder(c, "record_llamacpp_vlm.py", progress)
        }
        Recorder::LlamaCpp => {
            let gguf = gguf_of(j, work, &mut ctx.ggufs, py, recorders, progress)?;
            let hf = hf_tokens(&ctx.fresh_hf, j);
            let mut c = recorder_cmd(py, &recorders.join("record_llamacpp.py"));
            c.arg(&gguf).arg(out);
            c.args(subset_args(&j.args))
                .args(aux_args(&j.model, &j.args, decode_steps(&g.golden, &j.args))?);
            c.arg("--kv-type").arg(if j.args.kv_f16 { "f16" } else { "f32" });
            if let Some(hf) = hf {
                c.arg("--hf-golden").arg(hf);
            }
            run_recorder(c, "record_llamacpp.py", progress)
        }
    }
}

/// The oracle a spec's 16-bit HF recording is told about: this run's, else
/// the spec's current one.
fn oracle_of(ctx: &Ctx, j: &Job) -> Option<PathBuf> {
    ctx.fresh_oracle
        .get(&j.golden.spec)
        .cloned()
        .or_else(|| j.args.oracle.clone().filter(|p| p.exists()))
}

/// The golden whose token ids a teacher-forced recording is fed: the HF
/// golden recorded in this run, else the spec's current `hf` golden, else an
/// `hf.safetensors` beside this golden.
pub(super) fn hf_tokens(fresh_hf: &std::collections::BTreeMap<String, PathBuf>, j: &Job) -> Option<PathBuf> {
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
/// Whether the HF folder `model` holds a LLaVA model (`model_type` llava
/// or llava_next in its config.json).
fn is_llava(model: &Path) -> bool {
    std::fs::read_to_string(model.join("config.json"))
        .ok()
        .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
        .and_then(|v| v.get("model_type").and_then(|m| m.as_str()).map(|m| m.starts_with("llava")))
        .unwrap_or(false)
}

pub(super) fn gguf_of(
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
pub(super) fn run_recorder(cmd: Command, what: &str, progress: &Progress) -> Result<Vec<String>> {
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
