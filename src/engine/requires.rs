//! A declared engine's prerequisites (`engines: NAME: {requires: [COMMAND,
//! ARGS…]}`): a command that must exit 0 for the engine to run here, such as
//! `[python3, -c, "import numpy"]` for an engine written in numpy. Where it
//! fails the engine is unavailable and its trials are ignored with the
//! command's own words as the reason, so a machine with only the Rust
//! toolchain still runs `cargo test` green; under `CI=true` a missing
//! prerequisite fails instead (CI promised to have it).

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// How long a probe may take (starting an interpreter, importing a module).
const PROBE_TIMEOUT: Duration = Duration::from_secs(60);

/// Runs `argv` in `cwd`; Err(why) unless it exits 0 within the timeout.
pub fn probe(argv: &[String], cwd: Option<&Path>) -> Result<(), String> {
    let line = shlex::try_join(argv.iter().map(String::as_str)).unwrap_or_else(|_| argv.join(" "));
    let (cmd, args) = argv.split_first().ok_or("`requires:` is an empty command")?;
    let mut c = Command::new(cmd);
    c.args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    if let Some(d) = cwd {
        c.current_dir(d);
    }
    let mut child = c
        .spawn()
        .map_err(|e| format!("prerequisite `{line}` could not start: {e}"))?;
    let start = Instant::now();
    loop {
        match child.try_wait() {
            Ok(Some(_)) => break,
            Ok(None) if start.elapsed() > PROBE_TIMEOUT => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(format!(
                    "prerequisite `{line}` did not finish within {} s",
                    PROBE_TIMEOUT.as_secs()
                ));
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(20)),
            Err(e) => return Err(format!("prerequisite `{line}`: {e}")),
        }
    }
    let out = child
        .wait_with_output()
        .map_err(|e| format!("prerequisite `{line}`: {e}"))?;
    if out.status.success() {
        return Ok(());
    }
    // The last line of its error output says what is missing (a Python
    // traceback ends with `ModuleNotFoundError: No module named 'numpy'`).
    let err = String::from_utf8_lossy(&out.stderr);
    let last = err.lines().rev().find(|l| !l.trim().is_empty()).unwrap_or("").trim();
    let last: String = last.chars().take(300).collect();
    Err(format!(
        "prerequisite `{line}` failed ({}){}",
        out.status,
        if last.is_empty() {
            String::new()
        } else {
            format!(": {last}")
        }
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn argv(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn a_passing_probe_is_ok_and_a_failing_one_says_why() {
        assert!(probe(&argv(&["sh", "-c", "exit 0"]), None).is_ok());
        let e = probe(&argv(&["sh", "-c", "echo 'No module named numpy' >&2; exit 3"]), None).unwrap_err();
        assert!(
            e.contains("`sh -c") && e.contains("exit status: 3") && e.contains("No module named numpy"),
            "{e}"
        );
        let e = probe(&argv(&["/nonexistent/python3"]), None).unwrap_err();
        assert!(e.contains("could not start"), "{e}");
        assert!(probe(&[], None).unwrap_err().contains("empty"));
    }
}
