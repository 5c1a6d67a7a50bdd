//! The recorders' Python interpreter: `--python` when given (its packages
//! must match every pin of `goldens/recorders/requirements.txt`, checked
//! offline), else the venv `$TOUCHSTONE_CACHE/recorders-venv`, created and
//! `pip install -r`'d when missing or when a pin is not met.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use super::progress::{run_streaming, tail, Progress};
use crate::error::{Error, Result};

const PINS_OK: &str = r##"
import sys
from importlib.metadata import PackageNotFoundError, version
bad = []
for line in open(sys.argv[1]):
    line = line.split("#", 1)[0].strip()
    if not line:
        continue
    name, _, want = line.partition("==")
    try:
        have = version(name.strip())
    except PackageNotFoundError:
        have = None
    if have != want.strip():
        bad.append(f"{name.strip()} (want {want.strip()}, have {have})")
if bad:
    print("pins not satisfied: " + ", ".join(bad))
    sys.exit(1)
"##;

/// `Ok(())` when `python` has every pin of `reqs` installed at exactly that version.
fn pins_ok(python: &Path, reqs: &Path) -> std::result::Result<(), String> {
    let out = Command::new(python)
        .arg("-c")
        .arg(PINS_OK)
        .arg(reqs)
        .output()
        .map_err(|e| format!("cannot run {}: {e}", python.display()))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout).trim(),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

/// Finds or builds the recorders' interpreter (see the module comment).
pub fn python_env(root: &Path, explicit: Option<&Path>, progress: &mut Progress) -> Result<PathBuf> {
    let reqs = root.join("goldens/recorders/requirements.txt");
    let cache_venv = crate::model::cache::dir().join("recorders-venv");
    progress.start("checking the recorders' Python environment");
    if let Some(p) = explicit {
        return match pins_ok(p, &reqs) {
            Ok(()) => Ok(p.to_path_buf()),
            Err(why) => Err(Error::Usage(format!(
                "--python {}: {why}; install {} into it or leave out --python",
                p.display(),
                reqs.display()
            ))),
        };
    }
    let py = cache_venv.join("bin/python");
    if py.exists() {
        match pins_ok(&py, &reqs) {
            Ok(()) => {
                progress.println(&format!(
                    "reusing {} (every pin of requirements.txt installed)",
                    cache_venv.display()
                ));
                return Ok(py);
            }
            Err(why) => progress.println(&format!("updating {}: {why}", cache_venv.display())),
        }
    }
    if !py.exists() {
        if let Some(parent) = cache_venv.parent() {
            std::fs::create_dir_all(parent).map_err(|e| Error::io(parent, e))?;
        }
        let base = std::env::var("PYTHON").unwrap_or_else(|_| "python3".into());
        progress.detail(&format!("creating {} with {base}", cache_venv.display()));
        let out = Command::new(&base)
            .args(["-m", "venv"])
            .arg(&cache_venv)
            .output()
            .map_err(|e| Error::Usage(format!("cannot run `{base}` (set PYTHON=/path/to/python3.11): {e}")))?;
        if !out.status.success() {
            return Err(Error::Usage(format!(
                "`{base} -m venv {}` failed: {}",
                cache_venv.display(),
                String::from_utf8_lossy(&out.stderr).trim()
            )));
        }
    }
    progress.detail(&format!(
        "pip install -r {} (torch is a large download)",
        reqs.display()
    ));
    let t = Instant::now();
    let mut cmd = Command::new(&py);
    cmd.args([
        "-m",
        "pip",
        "install",
        "--disable-pip-version-check",
        "--progress-bar",
        "off",
        "-r",
    ])
    .arg(&reqs);
    let (ok, out) = run_streaming(cmd, |l| {
        if l.starts_with("Collecting") || l.starts_with("Downloading") || l.starts_with("Installing") {
            progress.detail(l.trim());
        }
    })?;
    if !ok {
        return Err(Error::Usage(format!(
            "pip install -r {} failed:\n{}",
            reqs.display(),
            tail(&out, 20)
        )));
    }
    pins_ok(&py, &reqs).map_err(|why| Error::Usage(format!("after pip install: {why}")))?;
    progress.println(&format!(
        "installed requirements.txt into {} in {:.0} s",
        cache_venv.display(),
        t.elapsed().as_secs_f64()
    ));
    Ok(py)
}
