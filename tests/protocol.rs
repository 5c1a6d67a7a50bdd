//! External engines through the subprocess protocol (`exec:`, a spec's
//! `engines:`) and through dumps, as a user runs them: an engine that
//! misbehaves in any way gives a clear failure naming the engine and the
//! request, within the per-request timeout, never a hang or a panic; the
//! other engines' results are still reported. (The reference engines in
//! examples/protocol/ are tested in tests/protocol_reference.rs.)

mod common;
use common::*;

use std::path::Path;
use std::time::{Duration, Instant};

fn fixture() -> String {
    root()
        .join("tests/fixtures/protocol/misbehaving_engine.py")
        .display()
        .to_string()
}

/// The default spec with one declared engine `bad` running the misbehaving
/// engine in `mode`, with a 3 s request timeout.
fn spec_with(dir: &Path, mode: &str) -> String {
    // The default spec declares engines already (numpy): `bad` joins them.
    let text = spec_text(&model_dir(), &hf_golden());
    assert!(text.contains("\nengines:\n"), "the default spec has an engines: map");
    let text = text.replacen(
        "\nengines:\n",
        &format!(
            "\nengines:\n  bad: {{exec: [python3, \"{}\", {mode}], timeout_s: 3}}\n",
            fixture()
        ),
        1,
    );
    write(dir, "s.yaml", &text).display().to_string()
}

/// Runs `--engine ENGINE` and returns the output, the JSON report and the time taken.
fn run(mode: &str, engine: &str) -> (Output, serde_json::Value, Duration) {
    let d = tempfile::tempdir().unwrap();
    let s = spec_with(d.path(), mode);
    let j = d.path().join("r.json");
    let t = Instant::now();
    let o = touchstone(&["run", &s, "--engine", engine, "-q", "--json", &j.display().to_string()]);
    let took = t.elapsed();
    let report = json(&j);
    (o, report, took)
}

/// Every check of engine `bad` failed (but `weights`, not applicable: a
/// protocol engine does not show its weights; and the serving checks, not
/// applicable where it loaded: it declares no batches), each naming the
/// engine; returns one message.
fn all_failed(report: &serde_json::Value, engine: &str) -> String {
    let of_engine = || {
        report["checks"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|c| c["engine"] == engine)
    };
    let serving = |c: &serde_json::Value| {
        touchstone::checks::run::SERVING
            .iter()
            .any(|s| c["id"].as_str() == Some(&format!("run::{s}")))
    };
    for c in of_engine().filter(|c| serving(c)) {
        // Failed with the rest when the engine never loaded; else not applicable.
        let declined =
            c["status"] == "not_applicable" && c["message"].as_str().unwrap().contains("does not declare batches");
        assert!(
            c["status"] == "fail" || declined,
            "{}: {} {}",
            c["id"],
            c["status"],
            c["message"]
        );
    }
    let checks: Vec<&serde_json::Value> = of_engine()
        .filter(|c| c["id"] != "run::weights" && !serving(c))
        .collect();
    assert!(!checks.is_empty());
    for c in &checks {
        assert_eq!(c["status"], "fail", "{}: {}", c["id"], c["message"]);
    }
    checks[0]["message"].as_str().unwrap().to_string()
}

#[test]
fn an_engine_that_exits_mid_run_is_a_failure_with_its_log() {
    let (o, r, took) = run("crash", "bad");
    assert_eq!(o.code, 1, "{}", o.all());
    let m = all_failed(&r, "bad");
    assert!(m.contains("`bad`") && m.contains("request `run`"), "{m}");
    assert!(m.contains("exited") && m.contains("exit status: 3"), "{m}");
    assert!(m.contains("simulated segmentation fault"), "the engine's stderr: {m}");
    assert!(took < Duration::from_secs(30), "{took:?}");
}

#[test]
fn an_engine_that_never_answers_is_killed_at_the_timeout() {
    let (o, r, took) = run("hang", "bad");
    assert_eq!(o.code, 1, "{}", o.all());
    let m = all_failed(&r, "bad");
    assert!(m.contains("no answer within 3 s") && m.contains("killed"), "{m}");
    // The main run times out once; later runs fail at once (the engine is dead).
    assert!(took < Duration::from_secs(30), "{took:?}");
}

#[test]
fn a_truncated_output_file_is_a_clear_failure() {
    let (o, r, _) = run("truncated", "bad");
    assert_eq!(o.code, 1, "{}", o.all());
    let m = all_failed(&r, "bad");
    assert!(
        m.contains("answered `run` with ok, but its output is not usable"),
        "{m}"
    );
    assert!(m.contains("not a valid safetensors file"), "{m}");
}

#[test]
fn a_line_that_is_not_json_is_a_clear_failure() {
    let (o, r, _) = run("garbage", "bad");
    assert_eq!(o.code, 1, "{}", o.all());
    let m = all_failed(&r, "bad");
    assert!(m.contains("not JSON") && m.contains("Loading weights... done"), "{m}");
}

#[test]
fn an_answer_out_of_protocol_is_a_clear_failure() {
    let (o, r, _) = run("off", "bad");
    assert_eq!(o.code, 1, "{}", o.all());
    let m = all_failed(&r, "bad");
    assert!(m.contains("out of protocol") && m.contains("\"status\""), "{m}");
}

#[test]
fn an_engine_that_refuses_the_model_or_dies_at_once_fails_its_checks() {
    let (o, r, _) = run("refuse", "bad");
    assert_eq!(o.code, 1, "{}", o.all());
    let m = all_failed(&r, "bad");
    assert!(
        m.contains("could not be loaded") && m.contains("does not support the model's architecture"),
        "{m}"
    );
    let (o, r, _) = run("silent", "bad");
    assert_eq!(o.code, 1, "{}", o.all());
    let m = all_failed(&r, "bad");
    assert!(m.contains("request `load`"), "{m}");
}

#[test]
fn the_other_engines_results_are_still_reported() {
    // `all`: cpu, cuda (skipped without a GPU) and the spec's `bad`.
    let (o, r, _) = run("crash", "all");
    assert_eq!(o.code, 1, "{}", o.all());
    let runs = r["runs"].as_array().unwrap();
    let by = |e: &str| {
        runs.iter()
            .find(|x| x["engine"] == e)
            .unwrap_or_else(|| panic!("no {e} run"))
    };
    assert_eq!(by("cpu")["passed"], true);
    assert_eq!(by("bad")["passed"], false);
}

#[test]
fn a_command_that_does_not_exist_is_a_clear_failure() {
    let d = tempfile::tempdir().unwrap();
    let s = write(d.path(), "s.yaml", &spec_text(&model_dir(), &hf_golden()));
    let o = touchstone(&[
        "run",
        &s.display().to_string(),
        "--engine",
        "exec:/no/such/engine --flag",
        "-q",
    ]);
    assert_eq!(o.code, 1, "{}", o.all());
    assert!(
        o.stdout.contains("cannot start `/no/such/engine --flag`"),
        "{}",
        o.stdout
    );
}

#[test]
fn an_unknown_engine_name_is_a_usage_error_with_a_suggestion() {
    let d = tempfile::tempdir().unwrap();
    let s = spec_with(d.path(), "crash");
    let o = touchstone(&["run", &s, "--engine", "bda"]);
    assert_eq!(o.code, 2, "{}", o.all());
    assert!(
        o.stderr.contains("unknown engine `bda`") && o.stderr.contains("bad"),
        "{}",
        o.stderr
    );
}

#[test]
fn saved_captures_checked_as_dumps_give_the_same_stage_verdicts() {
    let d = tempfile::tempdir().unwrap();
    let s = write(d.path(), "s.yaml", &spec_text(&model_dir(), &hf_golden()));
    let (cap, j1, j2) = (
        d.path().join("cap.safetensors"),
        d.path().join("1.json"),
        d.path().join("2.json"),
    );
    let p = |x: &Path| x.display().to_string();
    let o = touchstone(&["run", &p(&s), "-q", "--save-captures", &p(&cap), "--json", &p(&j1)]);
    assert_eq!(o.code, 0, "{}", o.all());
    let dumps = format!("dumps:{}", p(&cap));
    let o = touchstone(&["run", &p(&s), "-q", "--engine", &dumps, "--json", &p(&j2)]);
    assert_eq!(o.code, 0, "{}", o.all());
    let (a, b) = (json(&j1), json(&j2));
    assert_eq!(stage_verdicts(&a), stage_verdicts(&b));
    // Checks that need a second run are skipped, with the reason.
    let det = b["checks"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["id"] == "run::determinism")
        .unwrap();
    assert_eq!(det["status"], "skip");
    assert!(det["message"].as_str().unwrap().contains("dumps are one recorded run"));
}

#[test]
fn dumps_with_engine_names_are_mapped_by_the_spec() {
    // Write the CPU engine's captures under other names, as .npy files in
    // step folders, and map them back with `names:` (q as [T, H·D], reshaped).
    let d = tempfile::tempdir().unwrap();
    let s = write(d.path(), "s.yaml", &spec_text(&model_dir(), &hf_golden()));
    let cap = d.path().join("cap.safetensors");
    let p = |x: &Path| x.display().to_string();
    let o = touchstone(&[
        "run",
        &p(&s),
        "-q",
        "--only",
        "prefill/blk.*.q::*",
        "--save-captures",
        &p(&cap),
    ]);
    assert_eq!(o.code, 0, "{}", o.all());
    let f = touchstone::tensor::io::read_safetensors(&cap).unwrap();
    let dump = d.path().join("dump");
    for (k, t) in &f.floats {
        let (step, stage) = k.split_once('/').unwrap();
        std::fs::create_dir_all(dump.join(step)).unwrap();
        // q, under the engine's own name, and attn_norm, q's input (the
        // `linear` check recomputes q from it), under its canonical one;
        // the run also tapped the other stages q's floor reads, left out.
        if let Some(layer) = stage.strip_prefix("blk.").and_then(|r| r.strip_suffix(".q")) {
            let sh = t.shape();
            let flat = touchstone::tensor::Tensor::new(vec![sh[0], sh[1] * sh[2]], t.data().to_vec());
            write_npy(
                &dump.join(step).join(format!("layers.{layer}.attn.q_proj.out.npy")),
                &flat,
            );
        } else if let Some(layer) = stage.strip_prefix("blk.").and_then(|r| r.strip_suffix(".attn_norm")) {
            write_npy(&dump.join(step).join(format!("blk.{layer}.attn_norm.npy")), t);
        }
    }
    let (shape, ids) = &f.ints["tokens"];
    write_npy_i64(&dump.join("tokens.npy"), shape, ids);
    let mut text = spec_text(&model_dir(), &hf_golden());
    text.push_str("\nnames:\n  \"layers.{i}.attn.q_proj.out\": {stage: \"blk.{i}.q\", reshape: true}\n");
    let s2 = write(d.path(), "s2.yaml", &text);
    let o = touchstone(&[
        "run",
        &p(&s2),
        "-q",
        "--engine",
        &format!("dumps:{}", p(&dump)),
        "--only",
        "prefill/blk.*.q::*",
    ]);
    assert_eq!(o.code, 0, "{}", o.all());
    assert!(o.stdout.contains("PASSED"), "{}", o.stdout);
    // What the dumps hold is what they can tap: checks on stages they do not
    // hold (blk.0.k, ...) are not applicable, counted, never failed.
    let o = touchstone(&[
        "run",
        &p(&s2),
        "-q",
        "--engine",
        &format!("dumps:{}", p(&dump)),
        "--only",
        "prefill/blk.0.*::golden:hf",
    ]);
    assert_eq!(o.code, 0, "{}", o.all());
    let summary = o.stdout.lines().last().unwrap_or("").to_string();
    assert!(
        summary.contains("0 failed") && summary.contains("not applicable"),
        "{summary}"
    );
    // Without the map the names are unknown, and the message says so.
    let s3 = write(d.path(), "s3.yaml", &spec_text(&model_dir(), &hf_golden()));
    let o = touchstone(&[
        "run",
        &p(&s3),
        "-q",
        "--engine",
        &format!("dumps:{}", p(&dump)),
        "--only",
        "prefill/blk.0.q::shape",
    ]);
    assert_eq!(o.code, 1, "{}", o.all());
    assert!(o.stdout.contains("did not capture prefill/blk.0.q"), "{}", o.stdout);
    assert!(
        o.stdout.contains("prefill/layers.0.attn.q_proj.out") && o.stdout.contains("`names:`"),
        "{}",
        o.stdout
    );
}

/// A little-endian f4 `.npy` file.
fn write_npy(path: &Path, t: &touchstone::tensor::Tensor) {
    let data: Vec<u8> = t.data().iter().flat_map(|x| x.to_le_bytes()).collect();
    npy(path, "<f4", t.shape(), &data);
}

fn write_npy_i64(path: &Path, shape: &[usize], v: &[i64]) {
    let data: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
    npy(path, "<i8", shape, &data);
}

fn npy(path: &Path, descr: &str, shape: &[usize], data: &[u8]) {
    let dims: Vec<String> = shape.iter().map(|d| d.to_string()).collect();
    let shape = if dims.len() == 1 {
        format!("({},)", dims[0])
    } else {
        format!("({})", dims.join(", "))
    };
    let mut header = format!("{{'descr': '{descr}', 'fortran_order': False, 'shape': {shape}, }}");
    while (10 + header.len() + 1) % 64 != 0 {
        header.push(' ');
    }
    header.push('\n');
    let mut b = b"\x93NUMPY\x01\x00".to_vec();
    b.extend_from_slice(&(header.len() as u16).to_le_bytes());
    b.extend_from_slice(header.as_bytes());
    b.extend_from_slice(data);
    std::fs::write(path, b).unwrap();
}

#[test]
fn an_engine_tokenizer_is_judged_by_the_tokenize_op() {
    // The misbehaving engine's `tokenize` answers [1, 2, 3] for every text.
    let d = tempfile::tempdir().unwrap();
    let s = spec_with(d.path(), "tokenizer");
    let mut text = std::fs::read_to_string(&s).unwrap();
    text = text.replacen("\nrun_checks:\n", "\nrun_checks:\n  - tokenizer\n", 1);
    std::fs::write(&s, text).unwrap();
    let o = touchstone(&["run", &s, "--engine", "bad", "-q", "--only", "tokenizer"]);
    assert_eq!(o.code, 1, "{}", o.all());
    assert!(
        o.stdout.contains("the engine's ids for") && o.stdout.contains("engine [1, 2, 3]"),
        "{}",
        o.stdout
    );
    // The CPU engine has no tokenizer of its own: not applicable.
    let o = touchstone(&[
        "run",
        &s,
        "--engine",
        "cpu",
        "-q",
        "--only",
        "tokenizer",
        "--allow-skip",
    ]);
    assert_eq!(o.code, 0, "{}", o.all());
    assert!(o.stdout.contains("1 not applicable"), "{}", o.stdout);
}
