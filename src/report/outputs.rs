//! Report files (`--json`, `--junit`, `--markdown`, `--html`): checked before
//! the run, written together after it, and never damaging what a path names.
//!
//! - `-` is standard output (at most one report may take it; the terminal
//!   report then goes to standard error so the two never interleave).
//! - A character device (`/dev/null`, a terminal) is written through, and
//!   `/dev/stdout` / `/dev/stderr` are the process's own streams.
//! - Any other existing path that is not a regular file — a directory, a
//!   FIFO, a socket, a block device, or a symlink — is refused, untouched,
//!   before anything runs (exit 2, naming the user's path).
//! - Regular files are written to a temp file beside the target and renamed
//!   over it; every report of a run is renamed in one commit at the end, with
//!   SIGINT held off until the commit is done, so an interrupted run leaves no
//!   temp file and never a mix of old and new reports. The temp file's folder
//!   is probed for writing before the run, so an unwritable path is found
//!   before minutes of work, not after.

use std::fs::{self, OpenOptions};
use std::io::Write;
use std::os::unix::fs::FileTypeExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};

use crate::error::{Error, Result};

/// Where one report goes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Target {
    /// A regular file (new or replaced), written by temp file + rename.
    File(PathBuf),
    Stdout,
    Stderr,
    /// A character device, opened and written through.
    Device(PathBuf),
}

/// One requested report: what it is (`--json`, ...) and where it goes.
#[derive(Clone, Debug)]
pub struct Output {
    pub flag: &'static str,
    pub target: Target,
    /// The path as the user wrote it, for messages.
    pub given: PathBuf,
}

impl Output {
    /// Checks `path` for `flag` without changing anything on disk (beyond a
    /// probe file created and removed in the target's folder).
    pub fn resolve(flag: &'static str, path: &Path) -> Result<Output> {
        let bad = |msg: String| Error::Usage(format!("{flag} {}: {msg}", path.display()));
        let target = match path.to_str() {
            Some("-") | Some("/dev/stdout") => Target::Stdout,
            Some("/dev/stderr") => Target::Stderr,
            _ => match fs::symlink_metadata(path) {
                Ok(m) if m.file_type().is_symlink() => {
                    return Err(bad(
                        "is a symbolic link; refusing to replace it (name its target, or remove the link)".into(),
                    ))
                }
                Ok(m) if m.file_type().is_char_device() => Target::Device(path.to_path_buf()),
                Ok(m) if m.is_file() => {
                    probe(path).map_err(&bad)?;
                    Target::File(path.to_path_buf())
                }
                Ok(m) => {
                    let ft = m.file_type();
                    let what = if ft.is_dir() {
                        "a directory"
                    } else if ft.is_fifo() {
                        "a FIFO"
                    } else if ft.is_socket() {
                        "a socket"
                    } else if ft.is_block_device() {
                        "a block device"
                    } else {
                        "not a regular file"
                    };
                    return Err(bad(format!(
                        "is {what}; a report is written only to a regular file, `-` (standard output) or a \
                         character device such as /dev/null (nothing was written)"
                    )));
                }
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                    probe(path).map_err(&bad)?;
                    Target::File(path.to_path_buf())
                }
                Err(e) => return Err(bad(format!("cannot be examined: {e}"))),
            },
        };
        Ok(Output {
            flag,
            target,
            given: path.to_path_buf(),
        })
    }
}

/// The temp file a report is written to before the rename.
fn temp_of(path: &Path) -> PathBuf {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    };
    dir.join(format!(".{name}.touchstone-tmp.{}", std::process::id()))
}

/// Creates and removes the temp file: the folder exists and is writable.
fn probe(path: &Path) -> std::result::Result<(), String> {
    let tmp = temp_of(path);
    match OpenOptions::new().write(true).create_new(true).open(&tmp) {
        Ok(_) => {
            let _ = fs::remove_file(&tmp);
            Ok(())
        }
        Err(e) => Err(format!("cannot be written ({e} creating a file in its folder)")),
    }
}

/// Every report of one command, checked together before the run.
#[derive(Debug, Default)]
pub struct Outputs {
    outputs: Vec<Output>,
}

/// Test hooks: milliseconds to pause just before the commit begins (a SIGINT
/// then ends the run with nothing written) and inside it, after every temp
/// file is written and before the renames (a SIGINT then waits for them).
const PAUSE_BEFORE_ENV: &str = "TOUCHSTONE_TEST_PAUSE_BEFORE_REPORTS_MS";
const PAUSE_INSIDE_ENV: &str = "TOUCHSTONE_TEST_PAUSE_INSIDE_REPORTS_MS";

fn pause(env: &str) {
    if let Some(ms) = std::env::var(env).ok().and_then(|v| v.parse::<u64>().ok()) {
        eprintln!("touchstone: test hook: pausing {ms} ms ({env})");
        std::thread::sleep(std::time::Duration::from_millis(ms));
    }
}

/// Set while reports are being committed: SIGINT waits until it is done.
static COMMITTING: AtomicBool = AtomicBool::new(false);
static INTERRUPTED: AtomicBool = AtomicBool::new(false);

impl Outputs {
    /// Resolves each `(flag, path)`; at most one may be standard output.
    pub fn resolve(requests: &[(&'static str, Option<&Path>)]) -> Result<Outputs> {
        let mut outputs = Vec::new();
        for (flag, path) in requests {
            if let Some(p) = path {
                outputs.push(Output::resolve(flag, p)?);
            }
        }
        let to_stdout: Vec<&str> = outputs
            .iter()
            .filter(|o| o.target == Target::Stdout)
            .map(|o| o.flag)
            .collect();
        if to_stdout.len() > 1 {
            return Err(Error::Usage(format!(
                "{} all write to standard output; give at most one of them `-`",
                to_stdout.join(" and ")
            )));
        }
        for (i, a) in outputs.iter().enumerate() {
            if let Target::File(pa) = &a.target {
                if let Some(b) = outputs[..i].iter().find(|b| b.target == Target::File(pa.clone())) {
                    return Err(Error::Usage(format!(
                        "{} and {} both name {}: each report needs its own file",
                        b.flag,
                        a.flag,
                        pa.display()
                    )));
                }
            }
        }
        if outputs.iter().any(|o| matches!(o.target, Target::File(_))) {
            // Ctrl-C outside a commit ends the run at once (no temp file exists
            // then); during one it waits for the last rename.
            let _ = ctrlc::set_handler(|| {
                if COMMITTING.load(Ordering::SeqCst) {
                    INTERRUPTED.store(true, Ordering::SeqCst);
                } else {
                    std::process::exit(130);
                }
            });
        }
        Ok(Outputs { outputs })
    }

    /// Whether a report takes standard output (the terminal report then goes
    /// to standard error).
    pub fn uses_stdout(&self) -> bool {
        self.outputs.iter().any(|o| o.target == Target::Stdout)
    }

    /// Renders and writes every report: streams and devices directly, files
    /// into temp files first and then all renamed in one commit. A failure
    /// while writing leaves no temp file and no old report replaced; only a
    /// rename failing mid-commit (the folder changed during the run) can leave
    /// the earlier renames in place, and the error says which report failed.
    pub fn commit(&self, render: &dyn Fn(&'static str) -> String) -> Result<()> {
        let mut staged: Vec<(PathBuf, &Output)> = Vec::new();
        let cleanup = |staged: &[(PathBuf, &Output)]| {
            for (tmp, _) in staged {
                let _ = fs::remove_file(tmp);
            }
        };
        pause(PAUSE_BEFORE_ENV);
        COMMITTING.store(true, Ordering::SeqCst);
        let result = (|| -> Result<()> {
            for o in &self.outputs {
                let text = render(o.flag);
                let io_err = |e: std::io::Error| Error::Usage(format!("{} {}: {e}", o.flag, o.given.display()));
                match &o.target {
                    Target::Stdout => std::io::stdout().write_all(text.as_bytes()).map_err(io_err)?,
                    Target::Stderr => std::io::stderr().write_all(text.as_bytes()).map_err(io_err)?,
                    Target::Device(p) => OpenOptions::new()
                        .write(true)
                        .open(p)
                        .and_then(|mut f| f.write_all(text.as_bytes()))
                        .map_err(io_err)?,
                    Target::File(p) => {
                        let tmp = temp_of(p);
                        staged.push((tmp.clone(), o));
                        let mut f = OpenOptions::new()
                            .write(true)
                            .create_new(true)
                            .open(&tmp)
                            .map_err(io_err)?;
                        f.write_all(text.as_bytes())
                            .and_then(|_| f.sync_all())
                            .map_err(io_err)?;
                    }
                }
            }
            Ok(())
        })();
        let result = result.and_then(|()| {
            pause(PAUSE_INSIDE_ENV);
            for (tmp, o) in &staged {
                let Target::File(p) = &o.target else {
                    unreachable!("only files are staged")
                };
                fs::rename(tmp, p).map_err(|e| Error::Usage(format!("{} {}: {e}", o.flag, o.given.display())))?;
            }
            Ok(())
        });
        if result.is_err() {
            cleanup(&staged);
        }
        COMMITTING.store(false, Ordering::SeqCst);
        if INTERRUPTED.load(Ordering::SeqCst) {
            std::process::exit(130);
        }
        result
    }
}
