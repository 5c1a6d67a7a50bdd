//! Report paths (`--json`, `--junit`, `--markdown`, `--html`) as a careful
//! user needs them: `-` and character devices written through; FIFOs,
//! symlinks and directories refused untouched before the run; an unwritable
//! path found before the run, named as given; every report written together
//! with no temp file left.

mod common;
use common::*;
use std::os::unix::fs::FileTypeExt;

fn run_to(flag: &str, path: &str) -> Output {
    touchstone(&["run", "--only", "prefill/embed::golden:hf", flag, path])
}

#[test]
fn dev_null_and_stdout_are_written_through() {
    let o = run_to("--json", "/dev/null");
    assert_eq!(o.code, 0, "{}", o.all());
    assert!(std::fs::metadata("/dev/null").unwrap().file_type().is_char_device());
    // `-`: the JSON is standard output, the terminal report moves to stderr.
    let o = run_to("--json", "-");
    assert_eq!(o.code, 0, "{}", o.all());
    let v: serde_json::Value = serde_json::from_str(&o.stdout).expect("stdout is the JSON report");
    assert_eq!(v["passed"], true);
    assert!(o.stderr.contains("PASSED"), "{}", o.stderr);
    assert!(
        !std::path::Path::new(&root().join("-")).exists(),
        "a file named - was written"
    );
    let o = touchstone(&["run", "--only", "prefill/embed", "--json", "-", "--markdown", "-"]);
    assert_eq!(o.code, 2, "{}", o.all());
    assert!(o.stderr.contains("at most one of them `-`"), "{}", o.stderr);
}

#[test]
fn fifos_symlinks_and_directories_are_refused_untouched_before_the_run() {
    let d = tempfile::tempdir().unwrap();
    let fifo = d.path().join("fifo");
    assert!(std::process::Command::new("mkfifo")
        .arg(&fifo)
        .status()
        .unwrap()
        .success());
    let target = d.path().join("target.json");
    std::fs::write(&target, "old").unwrap();
    let link = d.path().join("link.json");
    std::os::unix::fs::symlink(&target, &link).unwrap();
    for (flag, path, what) in [
        ("--json", &fifo, "is a FIFO"),
        ("--junit", &link, "is a symbolic link"),
        ("--html", &d.path().to_path_buf(), "is a directory"),
    ] {
        let p = path.display().to_string();
        let t = std::time::Instant::now();
        let o = run_to(flag, &p);
        assert_eq!(o.code, 2, "{}", o.all());
        assert!(o.stderr.contains(&format!("{flag} {p}: {what}")), "{}", o.stderr);
        assert!(o.stdout.is_empty(), "ran before refusing: {}", o.stdout);
        assert!(t.elapsed().as_secs() < 5);
    }
    assert!(std::fs::symlink_metadata(&fifo).unwrap().file_type().is_fifo());
    assert!(std::fs::symlink_metadata(&link).unwrap().file_type().is_symlink());
    assert_eq!(std::fs::read_to_string(&target).unwrap(), "old");
    let left: Vec<_> = std::fs::read_dir(d.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(left.len(), 3, "{left:?}");
}

#[test]
fn an_unwritable_path_is_found_before_the_run_and_named_as_given() {
    let o = run_to("--json", "/nonexistent-dir/r.json");
    assert_eq!(o.code, 2, "{}", o.all());
    assert!(
        o.stderr.contains("--json /nonexistent-dir/r.json: cannot be written"),
        "{}",
        o.stderr
    );
    assert!(o.stdout.is_empty(), "{}", o.stdout);
}

#[test]
fn all_reports_are_written_together_with_no_temp_file_left() {
    let d = tempfile::tempdir().unwrap();
    let (j, x) = (d.path().join("r.json"), d.path().join("r.xml"));
    std::fs::write(&j, "old json").unwrap();
    let o = touchstone(&[
        "run",
        "--only",
        "prefill/embed::golden:hf",
        "--json",
        &j.display().to_string(),
        "--junit",
        &x.display().to_string(),
    ]);
    assert_eq!(o.code, 0, "{}", o.all());
    assert!(std::fs::read_to_string(&j).unwrap().contains("\"passed\": true"));
    assert!(std::fs::read_to_string(&x).unwrap().contains("<testsuites"));
    let names: Vec<String> = std::fs::read_dir(d.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(names.len(), 2, "temp files left: {names:?}");
}

/// Runs with `--json` and `--html` over old files, waits for the test hook
/// `env` to pause, sends SIGINT, and returns the exit code and the folder.
fn interrupted(env: &str) -> (Option<i32>, tempfile::TempDir) {
    use std::io::Read;
    let d = tempfile::tempdir().unwrap();
    let (j, h) = (d.path().join("r.json"), d.path().join("r.html"));
    std::fs::write(&j, "old json").unwrap();
    std::fs::write(&h, "old html").unwrap();
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_touchstone"))
        .args(["run", "--only", "prefill/embed::golden:hf", "--json"])
        .arg(&j)
        .arg("--html")
        .arg(&h)
        .current_dir(root())
        .env_remove("CI")
        .env(env, "2000")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut err = child.stderr.take().unwrap();
    let (mut seen, mut buf) = (String::new(), [0u8; 512]);
    while !seen.contains("test hook") {
        let n = err.read(&mut buf).unwrap();
        assert!(n > 0, "exited before the hook: {seen}");
        seen.push_str(&String::from_utf8_lossy(&buf[..n]));
    }
    let kill = std::process::Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(kill.success());
    let status = child.wait().unwrap();
    (status.code(), d)
}

fn contents(d: &tempfile::TempDir) -> Vec<(String, String)> {
    let mut v: Vec<(String, String)> = std::fs::read_dir(d.path())
        .unwrap()
        .map(|e| {
            let p = e.unwrap().path();
            let text = std::fs::read_to_string(&p).unwrap_or_default();
            (p.file_name().unwrap().to_string_lossy().into_owned(), text)
        })
        .collect();
    v.sort();
    v
}

#[test]
fn sigint_before_the_reports_leaves_the_old_ones_and_no_temp_file() {
    let (code, d) = interrupted("TOUCHSTONE_TEST_PAUSE_BEFORE_REPORTS_MS");
    assert_eq!(code, Some(130));
    let c = contents(&d);
    assert_eq!(c.len(), 2, "{c:?}");
    assert_eq!((c[0].1.as_str(), c[1].1.as_str()), ("old html", "old json"));
}

#[test]
fn sigint_during_the_commit_waits_for_it_no_mix_no_temp_file() {
    let (code, d) = interrupted("TOUCHSTONE_TEST_PAUSE_INSIDE_REPORTS_MS");
    assert_eq!(code, Some(130));
    let c = contents(&d);
    assert_eq!(c.len(), 2, "temp files left: {c:?}");
    assert!(
        c[0].1.contains("<html") && c[1].1.contains("\"passed\""),
        "a mix of old and new: {c:?}"
    );
}

#[test]
fn a_character_device_that_fails_the_write_is_left_a_device() {
    // As root, `--json /dev/full` used to replace the device with a plain file.
    if !std::path::Path::new("/dev/full").exists() {
        return;
    }
    let o = run_to("--json", "/dev/full");
    assert_eq!(o.code, 2, "{}", o.all());
    assert!(o.stderr.contains("--json /dev/full"), "{}", o.stderr);
    assert!(std::fs::metadata("/dev/full").unwrap().file_type().is_char_device());
}
