//! The golden review flow without Python: pending files are made by hand or by
//! a fake recorder interpreter (`--python`, a shell script that copies a
//! prepared golden), so `cargo test` never runs the real recorders.
//! Covers status/accept/reject, regen's change table, the CI refusal, stale
//! goldens, and kill-safety: a SIGKILL at any moment of a regen leaves the
//! committed golden byte-identical.

mod common;
use common::*;

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

/// A scratch folder with a copy of the HF golden and a spec (named `name`) using it.
struct Scratch {
    dir: tempfile::TempDir,
    golden: PathBuf,
    spec: PathBuf,
}

fn scratch(name: &str) -> Scratch {
    let dir = tempfile::tempdir().unwrap();
    let golden = dir.path().join("hf.safetensors");
    std::fs::copy(hf_golden(), &golden).unwrap();
    // HF only: regen writes pending files beside every golden the spec names.
    let spec = write(
        dir.path(),
        &format!("{name}.yaml"),
        &hf_only_spec_text(&model_dir(), &golden),
    );
    Scratch { dir, golden, spec }
}

fn s(p: &Path) -> String {
    p.display().to_string()
}

fn pending(g: &Path) -> PathBuf {
    PathBuf::from(format!("{}.new", g.display()))
}

fn leftovers(dir: &Path) -> Vec<String> {
    std::fs::read_dir(dir)
        .unwrap()
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.contains(".tmp."))
        .collect()
}

/// A golden like the committed one with decode2/blk.1.attn_out[5] moved by 1e-2.
fn perturbed(dst: &Path) {
    altered_golden(dst, |t| {
        t.get_mut("decode2/blk.1.attn_out").unwrap().data_mut()[5] += 1e-2
    });
}

/// A fake interpreter: passes the pin check, logs each recorder call, and
/// "records" by copying $FAKE_GOLDEN (after $FAKE_SLEEP seconds).
fn fake_python(dir: &Path) -> PathBuf {
    let p = dir.join("fake-python");
    std::fs::write(
        &p,
        "#!/bin/sh\n[ \"$1\" = -c ] && exit 0\nscript=\"$1\"; shift\necho \"$(basename \"$script\") $*\" >> \"$FAKE_LOG\"\n\
         sleep \"${FAKE_SLEEP:-0}\"\ncp \"$FAKE_GOLDEN\" \"$2\"\n",
    )
    .unwrap();
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
    p
}

#[test]
fn status_accept_reject_with_pending_files() {
    let sc = scratch("flow");
    let original = std::fs::read(&sc.golden).unwrap();
    let spec = s(&sc.spec);
    let o = touchstone_env(&["goldens", "status", &spec], &[]);
    assert_eq!(o.code, 0, "{}", o.all());
    assert!(o.stdout.contains("no pending goldens"), "{}", o.stdout);

    // reject: deletes the pending file and a leftover of an interrupted write.
    perturbed(&pending(&sc.golden));
    let leftover = sc.dir.path().join(".hf.safetensors.new.tmp.12345");
    std::fs::write(&leftover, b"half a file").unwrap();
    let o = touchstone_env(&["goldens", "status", &spec], &[]);
    assert!(o.stdout.contains("DIFFERS from the current golden"), "{}", o.stdout);
    assert!(o.stdout.contains("leftover"), "{}", o.stdout);
    // --check: pending and leftover goldens are not a clean state (exit 1).
    let o = touchstone_env(&["goldens", "status", "--check", &spec], &[]);
    assert_eq!(o.code, 1, "{}", o.all());
    assert!(o.stdout.contains("2 item(s) need attention"), "{}", o.stdout);
    let o = touchstone_env(&["goldens", "reject", &spec], &[]);
    assert_eq!(o.code, 0, "{}", o.all());
    assert!(!pending(&sc.golden).exists() && !leftover.exists());
    assert_eq!(std::fs::read(&sc.golden).unwrap(), original);

    // accept: the pending file replaces the golden, byte for byte.
    perturbed(&pending(&sc.golden));
    let new = std::fs::read(pending(&sc.golden)).unwrap();
    let o = touchstone_env(&["goldens", "accept", &spec], &[]);
    assert_eq!(o.code, 0, "{}", o.all());
    assert!(o.stdout.contains("accepted"), "{}", o.stdout);
    assert_eq!(std::fs::read(&sc.golden).unwrap(), new);
    assert!(!pending(&sc.golden).exists());
    let o = touchstone_env(&["goldens", "status", &spec], &[]);
    assert!(o.stdout.contains("no pending goldens"), "{}", o.stdout);
    let o = touchstone_env(&["goldens", "status", "--check", &spec], &[]);
    assert_eq!(o.code, 0, "{}", o.all());
    assert!(o.stdout.contains("nothing pending, nothing stale"), "{}", o.stdout);
}

#[test]
fn status_check_fails_on_a_stale_golden() {
    let sc = scratch("stale");
    // A golden recorded for another prompt: the spec's explicit tokens differ.
    let text = std::fs::read_to_string(&sc.spec).unwrap();
    let stale = text.replace("prompt: {golden: hf}", "prompt: {tokens: [1, 2, 3], decode_steps: 2}");
    assert_ne!(stale, text, "the scratch spec takes its prompt from the golden");
    std::fs::write(&sc.spec, stale).unwrap();
    let o = touchstone_env(&["goldens", "status", "--check", &s(&sc.spec)], &[]);
    assert_eq!(o.code, 1, "{}", o.all());
    assert!(
        o.stdout.contains("STALE or unusable") && o.stdout.contains("stale golden"),
        "{}",
        o.stdout
    );
}

#[test]
fn accept_refuses_a_broken_pending_file_and_ci() {
    let sc = scratch("broken");
    let original = std::fs::read(&sc.golden).unwrap();
    std::fs::write(pending(&sc.golden), b"not a safetensors file").unwrap();
    let o = touchstone_env(&["goldens", "accept", &s(&sc.spec)], &[]);
    assert_eq!(o.code, 2, "{}", o.all());
    assert!(o.stderr.contains("hf.safetensors.new"), "{}", o.stderr);
    assert_eq!(std::fs::read(&sc.golden).unwrap(), original);
    perturbed(&pending(&sc.golden));
    let o = touchstone_env(&["goldens", "accept", &s(&sc.spec)], &[("CI", "true")]);
    assert_eq!(o.code, 2, "{}", o.all());
    assert_eq!(std::fs::read(&sc.golden).unwrap(), original);
}

#[test]
fn regen_on_ci_refuses_and_writes_nothing() {
    let sc = scratch("ci");
    let before: Vec<_> = std::fs::read_dir(sc.dir.path())
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    let log = sc.dir.path().join("log");
    let fake = fake_python(sc.dir.path());
    let o = touchstone_env(
        &["goldens", "regen", &s(&sc.spec), "--python", &s(&fake)],
        &[
            ("CI", "true"),
            ("FAKE_LOG", &s(&log)),
            ("FAKE_GOLDEN", &s(&hf_golden())),
        ],
    );
    assert_eq!(o.code, 2, "{}", o.all());
    assert!(
        o.stderr.contains("refusing to regenerate goldens on CI"),
        "{}",
        o.stderr
    );
    let after: Vec<_> = std::fs::read_dir(sc.dir.path())
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    assert_eq!(
        before.len() + 1,
        after.len(),
        "only the fake interpreter was added: {after:?}"
    );
    assert!(!log.exists(), "no recorder ran");
    assert!(!pending(&sc.golden).exists());
}

#[test]
fn regen_writes_a_pending_golden_and_shows_the_change() {
    let sc = scratch("regen-change");
    let original = std::fs::read(&sc.golden).unwrap();
    let recorded = sc.dir.path().join("recorded.safetensors");
    perturbed(&recorded);
    let log = sc.dir.path().join("log");
    let fake = fake_python(sc.dir.path());
    let o = touchstone_env(
        &[
            "goldens",
            "regen",
            &s(&sc.spec),
            "--python",
            &s(&fake),
            "--source",
            "hf",
        ],
        &[("FAKE_LOG", &s(&log)), ("FAKE_GOLDEN", &s(&recorded))],
    );
    assert_eq!(o.code, 1, "a changed golden exits 1:\n{}", o.all());
    // The recorder got the current golden's prompt and decode steps.
    let calls = std::fs::read_to_string(&log).unwrap();
    assert!(
        calls.contains("record_hf.py") && calls.contains("--prompt Golden tensors check every stage. --decode-steps 3"),
        "{calls}"
    );
    assert_eq!(
        std::fs::read(pending(&sc.golden)).unwrap(),
        std::fs::read(&recorded).unwrap()
    );
    assert_eq!(
        std::fs::read(&sc.golden).unwrap(),
        original,
        "regen never writes the golden"
    );
    for needle in [
        "decode2/blk.1.attn_out",
        "1.0e-2",
        "1/64",
        "provenance: unchanged",
        "DIFFERS from the current golden",
    ] {
        assert!(o.stdout.contains(needle), "no `{needle}` in:\n{}", o.stdout);
    }
    // Plain progress lines when stderr is not a terminal.
    assert!(o.stderr.contains("regen: [2/2] recording `hf`"), "{}", o.stderr);

    // Recording the same bytes again: zero change, exit 0.
    let o = touchstone_env(
        &["goldens", "regen", &s(&sc.spec), "--python", &s(&fake)],
        &[("FAKE_LOG", &s(&log)), ("FAKE_GOLDEN", &s(&sc.golden))],
    );
    assert_eq!(o.code, 0, "{}", o.all());
    assert!(
        o.stdout.contains("every stage unchanged: max abs change 0, NMSE 0"),
        "{}",
        o.stdout
    );
    assert!(
        o.stdout.contains("byte-identical to the current golden"),
        "{}",
        o.stdout
    );
}

#[test]
fn llama_cpp_source_converts_then_records_with_the_hf_tokens() {
    // The scratch spec's llama.cpp source is a copy of the HF golden: the fake
    // recorder "records" that same file, so the pending golden is unchanged.
    let sc = scratch("llama");
    let text = std::fs::read_to_string(&sc.spec)
        .unwrap()
        .replace("goldens:\n", &format!("goldens:\n  llama.cpp: {}\n", s(&sc.golden)));
    std::fs::write(&sc.spec, text).unwrap();
    let log = sc.dir.path().join("log");
    let fake = fake_python(sc.dir.path());
    let o = touchstone_env(
        &[
            "goldens",
            "regen",
            &s(&sc.spec),
            "--source",
            "llama.cpp",
            "--python",
            &s(&fake),
        ],
        &[("FAKE_LOG", &s(&log)), ("FAKE_GOLDEN", &s(&sc.golden))],
    );
    assert_eq!(o.code, 0, "{}", o.all());
    let calls: Vec<String> = std::fs::read_to_string(&log)
        .unwrap()
        .lines()
        .map(String::from)
        .collect();
    assert_eq!(calls.len(), 2, "{calls:?}");
    // First llama.cpp's converter on the spec's model, then the recorder on that
    // GGUF, fed the token ids of the HF golden.
    assert!(
        calls[0].starts_with("convert_gguf.py ") && calls[0].contains(&s(&model_dir())),
        "{calls:?}"
    );
    assert!(calls[0].ends_with(".gguf"), "{calls:?}");
    assert!(calls[1].starts_with("record_llamacpp.py "), "{calls:?}");
    assert!(
        calls[1].ends_with(&format!("--hf-golden {}", s(&sc.golden))),
        "{calls:?}"
    );
    assert!(
        o.stdout.contains("byte-identical to the current golden"),
        "{}",
        o.stdout
    );
    let _ = touchstone_env(&["goldens", "reject", &s(&sc.spec)], &[]);
}

/// Starts a regen that will pause as told, waits for `ready`, SIGKILLs it.
fn kill_regen_when(sc: &Scratch, envs: &[(&str, String)], ready: impl Fn() -> bool) {
    let fake = fake_python(sc.dir.path());
    // A SIGKILL leaves regen's work folder behind: keep it in the scratch folder.
    let tmp = sc.dir.path().join("tmp");
    std::fs::create_dir_all(&tmp).unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_touchstone"))
        .args(["goldens", "regen", &s(&sc.spec), "--python", &s(&fake)])
        .env_remove("CI")
        .env("TMPDIR", &tmp)
        .envs(envs.iter().map(|(k, v)| (*k, v.as_str())))
        .current_dir(root())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let t = Instant::now();
    while !ready() {
        assert!(
            t.elapsed() < Duration::from_secs(60),
            "regen never reached the kill point"
        );
        assert!(child.try_wait().unwrap().is_none(), "regen ended before the kill point");
        std::thread::sleep(Duration::from_millis(20));
    }
    child.kill().unwrap(); // SIGKILL on Unix
    child.wait().unwrap();
}

#[test]
fn sigkill_during_regen_leaves_the_golden_byte_identical() {
    // 1. Killed while the recorder runs.
    let sc = scratch("kill-record");
    let original = std::fs::read(&sc.golden).unwrap();
    let recorded = sc.dir.path().join("recorded.safetensors");
    perturbed(&recorded);
    let log = sc.dir.path().join("log");
    let envs = [
        ("FAKE_LOG", s(&log)),
        ("FAKE_GOLDEN", s(&recorded)),
        ("FAKE_SLEEP", "30".to_string()),
    ];
    kill_regen_when(&sc, &envs, || log.exists());
    assert_eq!(std::fs::read(&sc.golden).unwrap(), original);
    assert!(!pending(&sc.golden).exists());

    // 2. Killed between writing the pending file's temporary and renaming it.
    let sc = scratch("kill-write");
    let original = std::fs::read(&sc.golden).unwrap();
    let envs = [
        ("FAKE_LOG", s(&sc.dir.path().join("log"))),
        ("FAKE_GOLDEN", s(&recorded)),
        ("TOUCHSTONE_TEST_PAUSE_BEFORE_RENAME_MS", "30000".to_string()),
    ];
    let dir = sc.dir.path().to_path_buf();
    kill_regen_when(&sc, &envs, || !leftovers(&dir).is_empty());
    assert_eq!(
        std::fs::read(&sc.golden).unwrap(),
        original,
        "committed golden byte-identical"
    );
    assert!(!pending(&sc.golden).exists(), "no half-written pending file");
    // The interrupted temporary is reported and cleaned up by reject.
    let o = touchstone_env(&["goldens", "status", &s(&sc.spec)], &[]);
    assert!(o.stdout.contains("leftover"), "{}", o.stdout);
    let o = touchstone_env(&["goldens", "reject", &s(&sc.spec)], &[]);
    assert_eq!(o.code, 0, "{}", o.all());
    assert!(leftovers(&dir).is_empty());
    // A run still passes against the untouched golden.
    let o = touchstone(&["run", &s(&sc.spec), "--only", "logits::golden"]);
    assert_eq!(o.code, 0, "{}", o.all());
}

#[test]
fn a_golden_recorded_for_another_model_is_stale() {
    // Same architecture, one weight changed: the hash differs.
    let d = tempfile::tempdir().unwrap();
    let model = d.path().join("model");
    std::fs::create_dir(&model).unwrap();
    for f in std::fs::read_dir(model_dir()).unwrap() {
        let f = f.unwrap();
        std::fs::copy(f.path(), model.join(f.file_name())).unwrap();
    }
    let w = touchstone::tensor::io::read_safetensors(&model.join("model.safetensors")).unwrap();
    let mut floats = w.floats;
    let first = floats.keys().next().unwrap().clone();
    floats.get_mut(&first).unwrap().data_mut()[0] += 0.5;
    touchstone::tensor::io::write_safetensors(&model.join("model.safetensors"), &floats, &w.ints, &w.metadata).unwrap();
    let o = touchstone(&["run", "--model", &s(&model)]);
    assert_eq!(o.code, 2, "{}", o.all());
    for needle in [
        "stale golden",
        "was recorded for a model with model_sha256 48eb23797c121639417ce37f3f6cdf560c049d08480578daa6e068c351abec0e",
        &s(&model),
        "touchstone goldens regen",
    ] {
        assert!(o.stderr.contains(needle), "no `{needle}` in:\n{}", o.stderr);
    }
    assert!(
        o.stderr.lines().count() <= 2,
        "one message, not a wall of mismatches:\n{}",
        o.stderr
    );

    // Other dimensions (config.json), same weights file: the dims fallback names them.
    std::fs::copy(model_dir().join("model.safetensors"), model.join("model.safetensors")).unwrap();
    let cfg = std::fs::read_to_string(model.join("config.json")).unwrap();
    assert!(cfg.contains("\"vocab_size\": 512"), "{cfg}");
    std::fs::write(
        model.join("config.json"),
        cfg.replace("\"vocab_size\": 512", "\"vocab_size\": 600"),
    )
    .unwrap();
    let o = touchstone(&["run", "--model", &s(&model)]);
    assert_eq!(o.code, 2, "{}", o.all());
    assert!(
        o.stderr.contains("stale golden") && o.stderr.contains("vocab 512 vs 600"),
        "{}",
        o.stderr
    );
}

#[test]
fn a_spec_prompt_other_than_the_goldens_is_stale() {
    let sc = scratch("prompt");
    let text = std::fs::read_to_string(&sc.spec)
        .unwrap()
        .replace("prompt: {golden: hf}", "prompt: {tokens: [1, 2, 3], decode_steps: 1}");
    std::fs::write(&sc.spec, text).unwrap();
    let o = touchstone(&["run", &s(&sc.spec)]);
    assert_eq!(o.code, 2, "{}", o.all());
    assert!(
        o.stderr.contains("stale golden") && o.stderr.contains("[1, 2, 3]"),
        "{}",
        o.stderr
    );
}

/// `git status --porcelain --ignored` of the checkout, less the build folder
/// (cargo writes there while tests run).
fn checkout_status() -> String {
    let out = Command::new("git")
        .args(["status", "--porcelain", "--ignored"])
        .current_dir(root())
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| !l.ends_with(" target/"))
        .collect::<Vec<_>>()
        .join("\n")
}

#[test]
fn regen_passes_the_spec_prompt_and_record_and_keeps_work_files_out_of_the_checkout() {
    let sc = scratch("subset");
    let text = std::fs::read_to_string(&sc.spec).unwrap().replace(
        "prompt: {golden: hf}",
        "prompt: {text: \"def f(x):\", chat: true, golden: hf, decode_steps: 2}\n\
         record: {steps: [prefill, decode2], stages: [embed, \"blk.0.*\", logits], logits: last}",
    );
    std::fs::write(&sc.spec, text).unwrap();
    // The work folder is made in TMPDIR: point it at a folder we can inspect.
    let tmp = sc.dir.path().join("tmp");
    std::fs::create_dir(&tmp).unwrap();
    let log = sc.dir.path().join("log");
    let fake = fake_python(sc.dir.path());
    let before = checkout_status();
    let o = touchstone_env(
        &["goldens", "regen", &s(&sc.spec), "--python", &s(&fake)],
        &[
            ("FAKE_LOG", &s(&log)),
            ("FAKE_GOLDEN", &s(&sc.golden)),
            ("TMPDIR", &s(&tmp)),
        ],
    );
    assert_eq!(o.code, 0, "{}", o.all());
    let calls = std::fs::read_to_string(&log).unwrap();
    let call = calls.lines().next().unwrap();
    let args: Vec<&str> = call.split(' ').collect();
    assert_eq!(args[0], "record_hf.py", "{call}");
    assert_eq!(args[1], s(&model_dir()), "{call}");
    // The recorder wrote into the temporary work folder ...
    assert!(args[2].starts_with(&s(&tmp)), "{call}");
    assert!(
        call.ends_with(
            " --prompt def f(x): --chat --decode-steps 2 --steps prefill,decode2 --stages embed,blk.0.*,logits \
             --logits last"
        ),
        "{call}"
    );
    // ... which is gone afterwards; the only new file beside the golden is the
    // pending one, and the checkout is untouched.
    assert_eq!(std::fs::read_dir(&tmp).unwrap().count(), 0, "work folder left behind");
    assert!(pending(&sc.golden).exists());
    assert_eq!(checkout_status(), before, "regen wrote into the checkout");
    let _ = touchstone_env(&["goldens", "reject", &s(&sc.spec)], &[]);
}

#[test]
fn regen_records_a_token_prompt_as_given_and_refuses_to_invent_a_prompt() {
    let sc = scratch("tokens");
    let spec_text = std::fs::read_to_string(&sc.spec).unwrap();
    let text = spec_text.replace(
        "prompt: {golden: hf}",
        "prompt: {tokens: [7, 300, 2, 41], decode_steps: 2}",
    );
    std::fs::write(&sc.spec, text).unwrap();
    let log = sc.dir.path().join("log");
    let fake = fake_python(sc.dir.path());
    let env = [("FAKE_LOG", s(&log)), ("FAKE_GOLDEN", s(&sc.golden))];
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let o = touchstone_env(&["goldens", "regen", &s(&sc.spec), "--python", &s(&fake)], &env);
    assert!(o.code <= 1, "{}", o.all());
    let calls = std::fs::read_to_string(&log).unwrap();
    let call = calls.lines().next().unwrap();
    assert!(call.starts_with("record_hf.py "), "{call}");
    assert!(call.contains(" --prompt-tokens 7,300,2,41 --decode-steps 2"), "{call}");
    assert!(!call.contains("--prompt "), "a token prompt is not text: {call}");
    let _ = touchstone_env(&["goldens", "reject", &s(&sc.spec)], &[]);

    // No prompt in the spec and no golden to take one from: refused, never a
    // recorder's default prompt.
    std::fs::write(&sc.spec, &spec_text).unwrap();
    std::fs::remove_file(&sc.golden).unwrap();
    std::fs::remove_file(&log).unwrap();
    let o = touchstone_env(&["goldens", "regen", &s(&sc.spec), "--python", &s(&fake)], &env);
    assert_eq!(o.code, 2, "{}", o.all());
    assert!(o.stderr.contains("gives no prompt to record"), "{}", o.stderr);
    assert!(
        !log.exists(),
        "a recorder ran: {}",
        std::fs::read_to_string(&log).unwrap_or_default()
    );
    assert!(!pending(&sc.golden).exists());
}

#[test]
fn a_recording_whose_greedy_picks_left_hfs_is_written_and_reviewed_with_its_margins() {
    let sc = scratch("disagree");
    // What record_llamacpp.py writes when its arithmetic resolves a near-tie
    // otherwise: the golden, with the disagreement in its provenance.
    let recorded = sc.dir.path().join("recorded.safetensors");
    let f = touchstone::tensor::io::read_safetensors(&hf_golden()).unwrap();
    let mut meta = f.metadata.clone();
    let mut prov: serde_json::Value = serde_json::from_str(&meta["provenance"]).unwrap();
    prov["greedy_disagreement"] = serde_json::json!({
        "step": "decode2", "index": 2, "hf_id": 57, "llamacpp_id": 504,
        "llamacpp_margin": 0.0125, "hf_margin": 0.003
    });
    meta.insert("provenance".into(), prov.to_string());
    touchstone::tensor::io::write_safetensors(&recorded, &f.floats, &f.ints, &meta).unwrap();
    let fake = fake_python(sc.dir.path());
    let o = touchstone_env(
        &["goldens", "regen", &s(&sc.spec), "--python", &s(&fake)],
        &[
            ("FAKE_LOG", &s(&sc.dir.path().join("log"))),
            ("FAKE_GOLDEN", &s(&recorded)),
        ],
    );
    assert_eq!(o.code, 1, "a changed golden: {}", o.all());
    assert!(pending(&sc.golden).exists(), "the golden is written: {}", o.all());
    assert!(
        o.stdout.contains("greedy picks differ from HF's at decode2 (token 2): `hf` picks 504 by a margin of 0.0125 over HF's 57; HF's margin the other way 0.0030"),
        "{}",
        o.all()
    );
    let _ = touchstone_env(&["goldens", "reject", &s(&sc.spec)], &[]);
}

#[test]
fn regen_removes_its_work_folder_when_a_recorder_fails() {
    let sc = scratch("fail");
    let tmp = sc.dir.path().join("tmp");
    std::fs::create_dir(&tmp).unwrap();
    let fake = fake_python(sc.dir.path());
    // FAKE_GOLDEN missing: the fake recorder's `cp` fails.
    let o = touchstone_env(
        &["goldens", "regen", &s(&sc.spec), "--python", &s(&fake)],
        &[
            ("FAKE_LOG", &s(&sc.dir.path().join("log"))),
            ("FAKE_GOLDEN", &s(&sc.dir.path().join("absent"))),
            ("TMPDIR", &s(&tmp)),
        ],
    );
    assert_eq!(o.code, 2, "{}", o.all());
    assert!(o.stderr.contains("record_hf.py failed"), "{}", o.stderr);
    assert_eq!(std::fs::read_dir(&tmp).unwrap().count(), 0, "work folder left behind");
    assert!(!pending(&sc.golden).exists());
}

#[test]
fn a_gguf_model_is_recorded_as_it_is_by_both_recorders() {
    let sc = scratch("gguf");
    let gguf = root().join("goldens/qwen2-tiny/model.gguf");
    let lc = sc.dir.path().join("llamacpp.safetensors");
    std::fs::copy(&sc.golden, &lc).unwrap();
    let text = std::fs::read_to_string(&sc.spec)
        .unwrap()
        .replace(&s(&model_dir()), &s(&gguf))
        .replace("goldens:\n", &format!("goldens:\n  llama.cpp: {}\n", s(&lc)));
    assert!(text.contains(&s(&gguf)), "{text}");
    std::fs::write(&sc.spec, text).unwrap();
    let log = sc.dir.path().join("log");
    let fake = fake_python(sc.dir.path());
    let o = touchstone_env(
        &["goldens", "regen", &s(&sc.spec), "--python", &s(&fake)],
        &[("FAKE_LOG", &s(&log)), ("FAKE_GOLDEN", &s(&sc.golden))],
    );
    assert_eq!(o.code, 0, "{}", o.all());
    let calls: Vec<String> = std::fs::read_to_string(&log)
        .unwrap()
        .lines()
        .map(String::from)
        .collect();
    // No conversion: HF reads the GGUF with its own loader, llama.cpp runs it.
    assert_eq!(calls.len(), 2, "{calls:?}");
    assert!(
        calls[0].starts_with(&format!("record_hf.py {} ", s(&gguf))),
        "{calls:?}"
    );
    assert!(
        calls[1].starts_with(&format!("record_llamacpp.py {} ", s(&gguf))),
        "{calls:?}"
    );
    let _ = touchstone_env(&["goldens", "reject", &s(&sc.spec)], &[]);
}

#[test]
fn a_llama_cpp_regen_is_fed_the_specs_own_hf_golden() {
    // The HF golden has a name of its own; no `hf.safetensors` lies beside the
    // llama.cpp golden, so only the spec can say which file to take the ids from.
    let sc = scratch("hf-name");
    let d = sc.dir.path().join("refs");
    std::fs::create_dir(&d).unwrap();
    let hf = d.join("reference-hf.safetensors");
    std::fs::copy(&sc.golden, &hf).unwrap();
    let lc = sc.dir.path().join("lc").join("llamacpp.safetensors");
    std::fs::create_dir(lc.parent().unwrap()).unwrap();
    std::fs::copy(&sc.golden, &lc).unwrap();
    let text = std::fs::read_to_string(&sc.spec)
        .unwrap()
        .replace(&s(&sc.golden), &s(&hf))
        .replace("goldens:\n", &format!("goldens:\n  llama.cpp: {}\n", s(&lc)));
    std::fs::write(&sc.spec, text).unwrap();
    let log = sc.dir.path().join("log");
    let fake = fake_python(sc.dir.path());
    let o = touchstone_env(
        &[
            "goldens",
            "regen",
            &s(&sc.spec),
            "--source",
            "llama.cpp",
            "--python",
            &s(&fake),
        ],
        &[("FAKE_LOG", &s(&log)), ("FAKE_GOLDEN", &s(&sc.golden))],
    );
    assert_eq!(o.code, 0, "{}", o.all());
    let calls = std::fs::read_to_string(&log).unwrap();
    let last = calls.lines().last().unwrap();
    assert!(
        last.starts_with("record_llamacpp.py ") && last.ends_with(&format!("--hf-golden {}", s(&hf))),
        "{calls}"
    );
    let _ = touchstone_env(&["goldens", "reject", &s(&sc.spec)], &[]);
}

/// Copies of the default spec's three goldens (HF, llama.cpp, the oracle)
/// without any `blk.*.attn_scores` tensor — as goldens recorded before that
/// stage existed — and the default spec pointing at them, `extra` appended
/// to its `stages:` rules.
fn goldens_without_attn_scores(dir: &Path, extra: &str) -> PathBuf {
    let root = common::root();
    let mut text = spec_text(&model_dir(), &dir.join("hf.safetensors"));
    for (src, name) in [
        (hf_golden(), "hf.safetensors"),
        (
            root.join("goldens/qwen2-tiny/llamacpp.safetensors"),
            "llamacpp.safetensors",
        ),
        (root.join("goldens/qwen2-tiny/oracle.safetensors"), "oracle.safetensors"),
    ] {
        let f = touchstone::tensor::io::read_safetensors(&src).unwrap();
        let floats = f
            .floats
            .into_iter()
            .filter(|(k, _)| !k.ends_with(".attn_scores"))
            .collect();
        let dst = dir.join(name);
        touchstone::tensor::io::write_safetensors(&dst, &floats, &f.ints, &f.metadata).unwrap();
        text = text.replace(&src.display().to_string(), &dst.display().to_string());
    }
    assert_eq!(text.matches(&dir.display().to_string()).count(), 3, "{text}");
    let text = text.replacen("  \"blk.*.attn_probs\":", &format!("{extra}  \"blk.*.attn_probs\":"), 1);
    write(dir, "s.yaml", &text)
}

#[test]
fn goldens_lacking_a_stage_give_one_message_per_golden_not_a_suspect_per_check() {
    let d = tempfile::tempdir().unwrap();
    let spec = goldens_without_attn_scores(d.path(), "");
    let o = touchstone(&["run", &s(&spec), "-q"]);
    assert_eq!(o.code, 2, "{}", o.all());
    let err = o.all();
    assert!(!err.contains("SUSPECT"), "{err}");
    for g in ["golden `hf`", "golden `llama.cpp`", "golden `oracle`"] {
        assert_eq!(err.matches(g).count(), 1, "{g} once:\n{err}");
    }
    assert_eq!(err.matches("`blk.*.attn_scores`").count(), 3, "{err}");
    assert!(err.contains("{exclude: [golden, references_agree]}"), "{err}");
    assert!(err.contains("touchstone goldens regen"), "{err}");
}

#[test]
fn an_exclusion_takes_the_missing_stage_out_of_the_rule_and_the_spec_passes() {
    let d = tempfile::tempdir().unwrap();
    let spec = goldens_without_attn_scores(
        d.path(),
        "  \"blk.*.attn_scores\": [{exclude: [golden, references_agree]}]\n",
    );
    let o = touchstone(&["list", &s(&spec)]);
    assert_eq!(o.code, 0, "{}", o.all());
    assert!(
        o.stdout.contains("prefill/blk.0.attn_scores::finite"),
        "the exclusion keeps the invariants"
    );
    assert!(!o.stdout.contains("attn_scores::golden"), "{}", o.stdout);
    assert!(!o.stdout.contains("attn_scores::references_agree"), "{}", o.stdout);
    assert!(
        o.stdout.contains("prefill/blk.0.attn_probs::golden:hf"),
        "other stages keep theirs"
    );
    let o = touchstone(&["run", &s(&spec), "-q"]);
    assert_eq!(o.code, 0, "{}", o.all());
    assert!(o.all().contains("PASSED"), "{}", o.all());
}
