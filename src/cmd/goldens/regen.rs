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
use std::time::Instant;

use super::change;
use super::job::{Job, Recorder};
use super::next_token;
use super::pending::{check_next_token_file, write_atomic};
use super::progress::Progress;
use super::record::{record_job, Ctx};
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

/// The outcome of a regen: the review text, whether any pending golden
/// differs, and each golden that could not be recorded (its label and why).
pub struct RegenResult {
    pub text: String,
    pub changed: bool,
    pub failed: Vec<(String, String)>,
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
    let mut failed: Vec<(String, String)> = Vec::new();
    let mut pending = Vec::new();
    let mut ctx = Ctx {
        py: &py,
        recorders: &recorders,
        work,
        fresh_hf: Default::default(),
        fresh_oracle: Default::default(),
        fresh_nt: next_token::Fresh::new(),
        ggufs: Default::default(),
    };
    // HF first, then the oracle, so the 16-bit HF and llama.cpp jobs of the
    // same spec are fed the fresh HF golden's tokens and an overflowing one
    // is told the oracle's magnitude there (`Recorder::order`).
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
        // A recorder that fails is named with why, and the others carry on.
        let staged = record_job(&mut ctx, j, &out, &progress).and_then(|memory| stage(&mut ctx, j, &out, memory));
        let took = t.elapsed();
        record_times.push(format!("{} {:.1} s", g.label(), took.as_secs_f64()));
        match staged {
            Ok(st) => {
                changed |= st.differs;
                pending.push(g.label());
                text += &format!(
                    "{}: pending {} vs current {}\n{}\n",
                    g.label(),
                    g.pending().display(),
                    g.golden.display(),
                    st.review
                );
            }
            Err(e) => {
                progress.println(&format!("{}: NOT RECORDED: {e}", g.label()));
                text += &format!(
                    "{}: NOT RECORDED (nothing pending for it):\n{}\n\n",
                    g.label(),
                    indent(&e.to_string())
                );
                failed.push((g.label(), first_line(&e.to_string())));
            }
        }
    }
    progress.finish();
    text += &format!(
        "timing: environment {:.1} s; recording {}\n",
        setup.as_secs_f64(),
        record_times.join(", ")
    );
    if !failed.is_empty() {
        text += &format!(
            "NOT RECORDED: {} of {} golden(s): {}\npending (what `touchstone goldens accept` would take): {}\n",
            failed.len(),
            jobs.len(),
            failed
                .iter()
                .map(|(l, why)| format!("{l} ({why})"))
                .collect::<Vec<_>>()
                .join("; "),
            if pending.is_empty() {
                "none".to_string()
            } else {
                pending.join(", ")
            }
        );
    }
    text += if changed {
        "review the change above, then `touchstone goldens accept` (or `reject`)\n"
    } else if pending.is_empty() {
        "nothing was recorded\n"
    } else {
        "every pending golden is byte-identical to the current one; `touchstone goldens reject` discards them\n"
    };
    Ok(RegenResult { text, changed, failed })
}

/// Checks a recorder's output is a usable golden, writes it as the pending
/// file and says what changed (and what the recorder reported: an
/// overflow, a greedy disagreement, its memory).
fn stage(ctx: &mut Ctx, j: &Job, out: &Path, memory: Vec<String>) -> Result<Staged> {
    let g = &j.golden;
    let bytes = std::fs::read(out).map_err(|e| Error::io(out, e))?;
    let memory: String = memory.iter().map(|m| format!("  {m}\n")).collect();
    if matches!(j.recorder, Recorder::NextToken(_)) {
        let src = check_next_token_file(out, &g.source)?;
        let overflow = if src.overflowed.is_empty() {
            String::new()
        } else {
            format!(
                "  OVERFLOW: `{}`'s forward went non-finite on {} of its {} prompt(s), left out of the file ({}); the \
                 next_token check does not count it as a reference there\n",
                g.source,
                src.overflowed.len(),
                src.overflowed.len() + src.prompts.len(),
                src.overflowed
                    .iter()
                    .map(|o| format!("`{}`: {}", o.name, o.at))
                    .collect::<Vec<_>>()
                    .join(", ")
            )
        };
        write_atomic(&g.pending(), &bytes)?;
        ctx.fresh_nt.insert(g.golden.clone(), g.pending());
        let (desc, differs) = next_token::describe(&g.golden, &g.pending())?;
        return Ok(Staged {
            review: format!("{desc}{overflow}{memory}"),
            differs,
        });
    }
    let recorded = GoldenSet::load(&g.source, out)?;
    write_atomic(&g.pending(), &bytes)?;
    match j.recorder {
        Recorder::Hf => {
            ctx.fresh_hf.insert(g.spec.clone(), g.pending());
        }
        Recorder::Oracle => {
            ctx.fresh_oracle.insert(g.spec.clone(), g.pending());
        }
        _ => {}
    }
    let (desc, differs) = change::describe(&g.golden, &g.pending())?;
    let greedy = change::greedy_disagreement(&g.source, &recorded.provenance).unwrap_or_default();
    let overflow = change::overflow(&g.source, &recorded.provenance);
    Ok(Staged {
        review: format!("{desc}{overflow}{greedy}{memory}"),
        differs,
    })
}

/// A recorded golden's review.
struct Staged {
    review: String,
    differs: bool,
}

fn first_line(s: &str) -> String {
    s.lines().next().unwrap_or("").to_string()
}

fn indent(s: &str) -> String {
    s.lines().map(|l| format!("  {l}")).collect::<Vec<_>>().join("\n")
}
