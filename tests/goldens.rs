//! The golden review flow without Python: pending files are made by hand or by
//! a fake recorder interpreter (`--python`, a shell script that copies a
//! prepared golden), so `cargo test` never runs the real recorders.
//! Covers status/accept/reject, regen's change table, the CI refusal, stale
//! goldens, kill-safety (a SIGKILL at any moment of a regen leaves the
//! committed golden byte-identical), and a `next_token` check's folder of
//! next-token goldens: its five recordings in regen.sh's order and
//! arguments, their validation and review, and `accept` keeping the folder
//! one consistent set.

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
    // HF only: regen writes pending files beside every golden the spec names,
    // so the `next_token` item (the repository's next-token goldens) goes too.
    let text: String = hf_only_spec_text(&model_dir(), &golden)
        .lines()
        .filter(|l| !l.contains("- {next_token:"))
        .map(|l| format!("{l}\n"))
        .collect();
    let spec = write(dir.path(), &format!("{name}.yaml"), &text);
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
    // The recorder wrote into the temporary work folder, and was given what
    // the floors of the subset read (`record.aux`): layer 0's KV cache at the
    // step the subset skips, the logits' input where it judges them ...
    assert!(args[2].starts_with(&s(&tmp)), "{call}");
    assert!(
        call.ends_with(
            " --prompt def f(x): --chat --decode-steps 2 --steps prefill,decode2 --stages embed,blk.0.*,logits \
             --logits last --aux decode1=blk.0.v,blk.0.k_rope --aux-rows prefill=output_norm \
             --aux-rows decode2=output_norm"
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

// ---- next-token goldens -------------------------------------------------------

/// The committed next-token goldens of qwen2-tiny.
fn nt_goldens() -> PathBuf {
    root().join("goldens/qwen2-tiny/next-token")
}

fn prompt_set() -> PathBuf {
    root().join("goldens/prompt-sets/tiny-code-and-prose.yaml")
}

/// A scratch spec (HF golden only) with a `next_token` item whose folder,
/// `<scratch>/nt`, holds copies of the committed next-token goldens.
fn nt_scratch(name: &str) -> (Scratch, PathBuf) {
    let sc = scratch(name);
    let nt = sc.dir.path().join("nt");
    std::fs::create_dir(&nt).unwrap();
    for f in std::fs::read_dir(nt_goldens()).unwrap() {
        let f = f.unwrap();
        std::fs::copy(f.path(), nt.join(f.file_name())).unwrap();
    }
    let mut text = std::fs::read_to_string(&sc.spec).unwrap();
    let last = text.lines().rfind(|l| !l.trim_start().starts_with('#')).unwrap();
    assert!(last.starts_with("  - "), "run_checks: is the spec's last key: {last}");
    text += &format!(
        "  - {{next_token: {{prompts: {}, goldens: {}}}}}\n",
        s(&prompt_set()),
        s(&nt)
    );
    std::fs::write(&sc.spec, text).unwrap();
    (sc, nt)
}

/// A fake interpreter as `fake_python`, but record_next_token.py "records"
/// the file of its `--source` from the folder $FAKE_NT.
fn fake_python_nt(dir: &Path) -> PathBuf {
    let p = dir.join("fake-python-nt");
    std::fs::write(
        &p,
        "#!/bin/sh\n[ \"$1\" = -c ] && exit 0\nscript=\"$(basename \"$1\")\"; shift\necho \"$script $*\" >> \"$FAKE_LOG\"\n\
         from=\"$FAKE_GOLDEN\"; prev=\"\"\n\
         for a in \"$@\"; do\n  if [ \"$script\" = record_next_token.py ] && [ \"$prev\" = --source ]; then\n    \
         case \"$a\" in llama.cpp) from=\"$FAKE_NT/llamacpp.safetensors\";; *) from=\"$FAKE_NT/$a.safetensors\";; esac\n  \
         fi\n  prev=\"$a\"\ndone\ncp \"$from\" \"$2\"\n",
    )
    .unwrap();
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
    p
}

/// The log's calls of one script, each as its arguments.
fn calls_of(log: &Path, script: &str) -> Vec<Vec<String>> {
    std::fs::read_to_string(log)
        .unwrap()
        .lines()
        .filter_map(|l| l.strip_prefix(&format!("{script} ")))
        .map(|l| l.split(' ').map(String::from).collect())
        .collect()
}

const NT_FILES: [&str; 5] = [
    "oracle.safetensors",
    "hf.safetensors",
    "hf-bf16.safetensors",
    "hf-f16.safetensors",
    "llamacpp.safetensors",
];

#[test]
fn regen_records_a_next_token_folder_in_regen_sh_order_and_accept_takes_it() {
    let (sc, nt) = nt_scratch("nt-plan");
    let log = sc.dir.path().join("log");
    let fake = fake_python_nt(sc.dir.path());
    let envs = [
        ("FAKE_LOG", s(&log)),
        ("FAKE_GOLDEN", s(&sc.golden)),
        ("FAKE_NT", s(&nt_goldens())),
    ];
    let envs: Vec<(&str, &str)> = envs.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let o = touchstone_env(&["goldens", "regen", &s(&sc.spec), "--python", &s(&fake)], &envs);
    assert_eq!(o.code, 0, "{}", o.all());

    // The stage golden first, then the five next-token sources in regen.sh's
    // order: the oracle, `hf` against it, the others fed `hf`'s tokens, each
    // given this run's files (the pending ones).
    let lines: Vec<String> = std::fs::read_to_string(&log)
        .unwrap()
        .lines()
        .map(String::from)
        .collect();
    let scripts: Vec<&str> = lines.iter().map(|l| l.split(' ').next().unwrap()).collect();
    assert_eq!(
        scripts,
        [
            "record_hf.py",
            "record_next_token.py",
            "record_next_token.py",
            "record_next_token.py",
            "record_next_token.py",
            "convert_gguf.py",
            "record_next_token.py"
        ],
        "{lines:#?}"
    );
    let calls = calls_of(&log, "record_next_token.py");
    let p = |f: &str| s(&pending(&nt.join(f)));
    let gguf = &calls_of(&log, "convert_gguf.py")[0];
    assert_eq!(gguf[0], s(&model_dir()));
    let tail = |c: &Vec<String>| c[2..].join(" ");
    let set = s(&prompt_set());
    for (c, source, model) in [
        (&calls[0], "oracle", s(&model_dir())),
        (&calls[1], "hf", s(&model_dir())),
        (&calls[2], "hf-bf16", s(&model_dir())),
        (&calls[3], "hf-f16", s(&model_dir())),
        (&calls[4], "llama.cpp", gguf[1].clone()),
    ] {
        assert_eq!(c[0], model, "{c:?}");
        assert!(
            c[1].ends_with(".safetensors"),
            "the recorder writes into the work folder: {c:?}"
        );
        let mut want = format!("--prompts {set} --source {source}");
        if matches!(source, "hf-bf16" | "hf-f16" | "llama.cpp") {
            want += &format!(" --tokens-from {}", p("hf.safetensors"));
        }
        if source != "oracle" {
            want += &format!(" --oracle {}", p("oracle.safetensors"));
        }
        assert_eq!(tail(c), want, "{source}");
    }

    // Reviewed per file as unchanged; the pending files are the recordings.
    for src in ["oracle", "hf", "hf-bf16", "hf-f16", "llama.cpp"] {
        assert!(
            o.stdout.contains(&format!("nt-plan next-token `{src}`: pending")),
            "{src}:\n{}",
            o.stdout
        );
    }
    assert_eq!(
        o.stdout
            .matches("every prompt unchanged: the same tokens and top ids")
            .count(),
        5,
        "{}",
        o.stdout
    );
    assert!(
        o.stdout.contains("  add-py                  39 same          0/39"),
        "{}",
        o.stdout
    );
    assert!(
        o.stderr.contains("regen: [7/7] recording next-token `llama.cpp`"),
        "{}",
        o.stderr
    );
    for f in NT_FILES {
        assert_eq!(
            std::fs::read(pending(&nt.join(f))).unwrap(),
            std::fs::read(nt_goldens().join(f)).unwrap()
        );
    }

    let o = touchstone_env(&["goldens", "status", &s(&sc.spec)], &[]);
    assert!(
        o.stdout.contains("(nt-plan next-token `hf-bf16`): byte-identical"),
        "{}",
        o.stdout
    );
    assert!(o.stdout.contains("6 pending golden(s)"), "{}", o.stdout);
    let o = touchstone_env(&["goldens", "accept", &s(&sc.spec)], &[]);
    assert_eq!(o.code, 0, "{}", o.all());
    assert_eq!(o.stdout.matches("accepted").count(), 6, "{}", o.stdout);
    for f in NT_FILES {
        assert!(!pending(&nt.join(f)).exists());
        assert_eq!(
            std::fs::read(nt.join(f)).unwrap(),
            std::fs::read(nt_goldens().join(f)).unwrap()
        );
    }
}

#[test]
fn a_next_token_llama_cpp_regen_gets_the_declared_arithmetic_and_the_current_files() {
    // llama.cpp alone: its stage golden and its next-token file, the latter
    // fed the folder's current `hf` and oracle files, with the KV type and
    // the arithmetic the spec declares, on the spec's GGUF as it is.
    let (sc, nt) = nt_scratch("nt-arith");
    let gguf = root().join("goldens/qwen2-tiny/model.gguf");
    let lc = sc.dir.path().join("llamacpp.safetensors");
    std::fs::copy(&sc.golden, &lc).unwrap();
    let oracle = sc.dir.path().join("oracle.safetensors");
    std::fs::copy(root().join("goldens/qwen2-tiny/oracle.safetensors"), &oracle).unwrap();
    let text = std::fs::read_to_string(&sc.spec)
        .unwrap()
        .replace(&s(&model_dir()), &s(&gguf))
        .replace(
            "goldens:\n",
            &format!(
                "oracle: {}\nscaled:\n  arithmetic: {{llama.cpp: {{storage: f32, kv: f16, activations: q8_k}}}}\n\
             goldens:\n  llama.cpp: {}\n",
                s(&oracle),
                s(&lc)
            ),
        );
    std::fs::write(&sc.spec, &text).unwrap();
    let log = sc.dir.path().join("log");
    let fake = fake_python_nt(sc.dir.path());
    let envs = [
        ("FAKE_LOG", s(&log)),
        ("FAKE_GOLDEN", s(&sc.golden)),
        ("FAKE_NT", s(&nt_goldens())),
    ];
    let envs: Vec<(&str, &str)> = envs.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let args = [
        "goldens",
        "regen",
        &s(&sc.spec),
        "--source",
        "llama.cpp",
        "--python",
        &s(&fake),
    ];
    let o = touchstone_env(&args, &envs);
    assert_eq!(o.code, 0, "{}", o.all());
    let calls = calls_of(&log, "record_next_token.py");
    assert_eq!(calls.len(), 1, "{calls:?}");
    assert_eq!(calls[0][0], s(&gguf), "no conversion of a GGUF");
    assert_eq!(
        calls[0][2..].join(" "),
        format!(
            "--prompts {} --source llama.cpp --kv-type f16 --arithmetic {{\"activations\":\"q8_k\",\"kv\":\"f16\",\
             \"storage\":\"f32\"}} --tokens-from {} --oracle {}",
            s(&prompt_set()),
            s(&nt.join("hf.safetensors")),
            s(&nt.join("oracle.safetensors"))
        )
    );
    assert!(calls_of(&log, "convert_gguf.py").is_empty());

    // A name is expanded as regen.sh expands it; its KV cache is its storage's.
    std::fs::write(
        &sc.spec,
        text.replace(
            "{llama.cpp: {storage: f32, kv: f16, activations: q8_k}}",
            "{llama.cpp: q8_0}",
        ),
    )
    .unwrap();
    std::fs::remove_file(&log).unwrap();
    let o = touchstone_env(&args, &envs);
    assert_eq!(o.code, 0, "{}", o.all());
    let calls = calls_of(&log, "record_next_token.py");
    assert!(
        calls[0][2..]
            .join(" ")
            .contains("--source llama.cpp --arithmetic {\"activations\":\"q8_0\",\"storage\":\"f32\"} --tokens-from"),
        "{calls:?}"
    );

    // Without the folder's `hf` file (and not recording it) there are no tokens to feed.
    std::fs::remove_file(nt.join("hf.safetensors")).unwrap();
    let o = touchstone_env(&args, &envs);
    assert_eq!(o.code, 2, "{}", o.all());
    assert!(
        o.stderr
            .contains("the next-token `llama.cpp` golden is recorded with the tokens of the `hf` one"),
        "{}",
        o.stderr
    );
    let _ = touchstone_env(&["goldens", "reject", &s(&sc.spec)], &[]);
}

/// A copy of a next-token golden with `key`'s element `i` moved by `delta`.
fn moved(src: &Path, dst: &Path, key: &str, i: usize, delta: f64) {
    let bytes = std::fs::read(src).unwrap();
    let (_, meta) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut data: Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)> = st
        .tensors()
        .into_iter()
        .map(|(k, v)| (k, v.dtype(), v.shape().to_vec(), v.data().to_vec()))
        .collect();
    let t = data.iter_mut().find(|t| t.0 == key).unwrap();
    let x = f64::from_le_bytes(t.3[8 * i..8 * i + 8].try_into().unwrap()) + delta;
    t.3[8 * i..8 * i + 8].copy_from_slice(&x.to_le_bytes());
    let views: Vec<(String, safetensors::tensor::TensorView)> = data
        .iter()
        .map(|(k, d, s, b)| {
            (
                k.clone(),
                safetensors::tensor::TensorView::new(*d, s.clone(), b).unwrap(),
            )
        })
        .collect();
    let out = safetensors::serialize(views, meta.metadata().clone()).unwrap();
    std::fs::write(dst, out).unwrap();
}

#[test]
fn next_token_recordings_are_checked_reviewed_and_accepted_only_as_a_consistent_set() {
    let (sc, nt) = nt_scratch("nt-review");
    let log = sc.dir.path().join("log");
    let fake = fake_python_nt(sc.dir.path());
    // What the fake recorder "records": the committed files, the `hf` one's
    // first log-probability of `cat-en` lowered by 1e-3.
    let rec = sc.dir.path().join("recorded");
    std::fs::create_dir(&rec).unwrap();
    for f in NT_FILES {
        std::fs::copy(nt_goldens().join(f), rec.join(f)).unwrap();
    }
    moved(
        &nt_goldens().join("hf.safetensors"),
        &rec.join("hf.safetensors"),
        "cat-en/top_logprobs",
        0,
        -1e-3,
    );
    let envs = [
        ("FAKE_LOG", s(&log)),
        ("FAKE_GOLDEN", s(&sc.golden)),
        ("FAKE_NT", s(&rec)),
    ];
    let envs: Vec<(&str, &str)> = envs.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let args = ["goldens", "regen", &s(&sc.spec), "--python", &s(&fake)];
    let o = touchstone_env(&args, &envs);
    assert_eq!(o.code, 1, "a changed golden exits 1:\n{}", o.all());
    let hf = o
        .stdout
        .split("next-token `hf`:")
        .nth(1)
        .unwrap()
        .split("\n\n")
        .next()
        .unwrap();
    for needle in [
        "  cat-en                  37 same          0/37          0/37         1.0e-3                0",
        "  add-py                  39 same          0/39          0/39              0                0",
        "DIFFERS from the current golden",
    ] {
        assert!(hf.contains(needle), "no `{needle}` in:\n{hf}");
    }
    assert!(!hf.contains("every prompt unchanged"), "{hf}");
    assert_eq!(o.stdout.matches("every prompt unchanged").count(), 4, "{}", o.stdout);

    // A recording of another source is refused, and not staged.
    let _ = touchstone_env(&["goldens", "reject", &s(&sc.spec)], &[]);
    std::fs::copy(nt_goldens().join("hf-f16.safetensors"), rec.join("hf-bf16.safetensors")).unwrap();
    let o = touchstone_env(&args, &envs);
    assert_eq!(o.code, 2, "{}", o.all());
    assert!(
        o.stderr
            .contains("records source `hf-f16`, but it is the `hf-bf16` next-token golden"),
        "{}",
        o.stderr
    );
    assert!(!pending(&nt.join("hf-bf16.safetensors")).exists());
    let _ = touchstone_env(&["goldens", "reject", &s(&sc.spec)], &[]);

    // accept: a stage golden is no next-token golden; a file of another
    // prompt set would leave the folder inconsistent. Nothing is accepted.
    let before: Vec<Vec<u8>> = NT_FILES.iter().map(|f| std::fs::read(nt.join(f)).unwrap()).collect();
    std::fs::copy(&sc.golden, pending(&nt.join("hf-f16.safetensors"))).unwrap();
    let o = touchstone_env(&["goldens", "accept", &s(&sc.spec)], &[]);
    assert_eq!(o.code, 2, "{}", o.all());
    assert!(
        o.stderr.contains("hf-f16.safetensors.new") && o.stderr.contains("touchstone-next-token/1"),
        "{}",
        o.stderr
    );
    std::fs::remove_file(pending(&nt.join("hf-f16.safetensors"))).unwrap();
    let other = root().join("goldens/qwen2.5-0.5b/next-token/hf.safetensors");
    std::fs::copy(&other, pending(&nt.join("hf.safetensors"))).unwrap();
    let o = touchstone_env(&["goldens", "accept", &s(&sc.spec)], &[]);
    assert_eq!(o.code, 2, "{}", o.all());
    assert!(o.stderr.contains("would leave the folder inconsistent"), "{}", o.stderr);
    assert!(o.stderr.contains("are not the oracle's"), "{}", o.stderr);
    let after: Vec<Vec<u8>> = NT_FILES.iter().map(|f| std::fs::read(nt.join(f)).unwrap()).collect();
    assert!(before == after, "accept changed a next-token golden");
    assert!(pending(&nt.join("hf.safetensors")).exists());
    let _ = touchstone_env(&["goldens", "reject", &s(&sc.spec)], &[]);
}

/// A recorder that fails leaves the others recording: its golden is named
/// NOT RECORDED with why, the others are pending and said to be, and regen
/// exits 2 naming it (a llama.cpp recorder failing, the HF golden recorded).
#[test]
fn a_failing_recorder_is_named_and_the_others_carry_on() {
    let sc = scratch("failing");
    // A second source, llama.cpp, whose recorder fails.
    let llama = sc.dir.path().join("llamacpp.safetensors");
    std::fs::copy(&sc.golden, &llama).unwrap();
    let text = std::fs::read_to_string(&sc.spec).unwrap().replace(
        &format!("  hf: {}\n", s(&sc.golden)),
        &format!("  hf: {}\n  llama.cpp: {}\n", s(&sc.golden), s(&llama)),
    );
    assert!(text.contains("llama.cpp:"), "{text}");
    std::fs::write(&sc.spec, text).unwrap();
    let p = sc.dir.path().join("fake-python-fails");
    std::fs::write(
        &p,
        "#!/bin/sh\n[ \"$1\" = -c ] && exit 0\nscript=\"$(basename \"$1\")\"; shift\n\
         case \"$script\" in record_llamacpp.py|convert_gguf.py) echo 'AssertionError: the graph has no node kq-0' >&2; exit 1;; esac\n\
         cp \"$FAKE_GOLDEN\" \"$2\"\n",
    )
    .unwrap();
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
    let o = touchstone_env(
        &["goldens", "regen", &s(&sc.spec), "--python", &s(&p)],
        &[("FAKE_GOLDEN", &s(&sc.golden))],
    );
    assert_eq!(o.code, 2, "{}", o.all());
    assert!(o.stdout.contains("`llama.cpp`: NOT RECORDED"), "{}", o.stdout);
    assert!(o.stdout.contains("the graph has no node kq-0"), "{}", o.stdout);
    assert!(
        o.stdout
            .contains("pending (what `touchstone goldens accept` would take):")
            && o.stdout.contains("`hf`"),
        "{}",
        o.stdout
    );
    assert!(
        o.stderr.contains("1 golden(s) not recorded") && o.stderr.contains("llama.cpp"),
        "{}",
        o.stderr
    );
    assert!(pending(&sc.golden).exists() && !pending(&llama).exists());
    let _ = touchstone_env(&["goldens", "reject", &s(&sc.spec)], &[]);
}
