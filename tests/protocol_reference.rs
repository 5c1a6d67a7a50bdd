//! The reference protocol engines of examples/protocol/ (Python, numpy only),
//! run by touchstone through `exec:` as a user would: the correct one passes
//! every shipped tiny spec, the one whose RoPE is not applied in decode fails
//! with its first divergence at decode1/blk.0.q_rope, and the same engine's
//! captures, saved and checked again as dumps, get the same stage verdicts.
//! The test command (ci/test.sh) provides python3 with numpy; where python3
//! cannot import numpy every trial is ignored with that reason (touchstone
//! itself needs only Rust), except under `CI=true`, where they run and fail.

mod common;
use common::*;

use libtest_mimic::{Arguments, Completion, Trial};
use touchstone::checks::run::SERVING;

fn main() {
    let args = Arguments::from_args();
    let missing = if touchstone::ci_env::on_ci() {
        None
    } else {
        let probe = ["python3", "-c", "import numpy"].map(String::from);
        touchstone::engine::requires::probe(&probe, None).err()
    };
    let tests: [(&str, fn()); 8] = [
        (
            "a_version_1_engine_that_declares_no_batches_passes_with_the_serving_checks_not_applicable",
            a_version_1_engine_that_declares_no_batches_passes_with_the_serving_checks_not_applicable,
        ),
        (
            "the_engine_as_two_ranks_passes_with_its_shards_and_partial_sums_joined",
            the_engine_as_two_ranks_passes_with_its_shards_and_partial_sums_joined,
        ),
        (
            "a_rank_shard_at_the_wrong_offset_fails_naming_the_rank",
            a_rank_shard_at_the_wrong_offset_fails_naming_the_rank,
        ),
        (
            "the_numpy_engine_passes_every_shipped_tiny_spec",
            the_numpy_engine_passes_every_shipped_tiny_spec,
        ),
        (
            "the_engine_without_rope_in_decode_diverges_at_decode1_q_rope",
            the_engine_without_rope_in_decode_diverges_at_decode1_q_rope,
        ),
        (
            "its_captures_as_dumps_get_the_same_stage_verdicts",
            its_captures_as_dumps_get_the_same_stage_verdicts,
        ),
        (
            "the_spec_declared_engine_is_selected_by_name",
            the_spec_declared_engine_is_selected_by_name,
        ),
        (
            "a_flash_attention_engine_is_judged_on_what_it_can_tap",
            a_flash_attention_engine_is_judged_on_what_it_can_tap,
        ),
    ];
    let trials = tests
        .into_iter()
        .map(|(name, f)| match missing.clone() {
            Some(why) => Trial::ignorable_test(name, move || {
                Ok(Completion::ignored_with(format!(
                    "{why} (the reference engines are numpy programs; CI=true makes this fail)"
                )))
            }),
            None => Trial::test(name, move || {
                f();
                Ok(())
            }),
        })
        .collect();
    libtest_mimic::run(&args, trials).exit();
}

/// Each run check's (kind, status, message) in a JSON report.
fn run_checks(report: &serde_json::Value) -> Vec<(String, String, String)> {
    report["checks"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|o| {
            let s = |k: &str| o[k].as_str().unwrap_or_default().to_string();
            let kind = s("id").strip_prefix("run::")?.to_string();
            Some((kind, s("status"), s("message")))
        })
        .collect()
}

fn a_version_1_engine_that_declares_no_batches_passes_with_the_serving_checks_not_applicable() {
    let d = tempfile::tempdir().unwrap();
    let j = d.path().join("r.json");
    let engine = format!("{} --v1-only", exec("numpy_engine.py"));
    let o = touchstone(&[
        "run",
        &spec("qwen2-tiny.yaml"),
        "--engine",
        &engine,
        "-q",
        "--json",
        &j.display().to_string(),
    ]);
    assert_eq!(o.code, 0, "{}", o.all());
    let checks = run_checks(&json(&j));
    for mode in SERVING {
        let (_, status, msg) = checks
            .iter()
            .find(|c| c.0 == mode)
            .unwrap_or_else(|| panic!("{mode}: {checks:?}"));
        assert_eq!(status, "not_applicable", "{mode}: {msg}");
        assert!(msg.contains("does not declare batches"), "{mode}: {msg}");
    }
}

fn the_engine_as_two_ranks_passes_with_its_shards_and_partial_sums_joined() {
    for s in ["qwen2-tiny.yaml", "qwen3-tiny.yaml"] {
        let engine = format!("{} --ranks 2", exec("numpy_engine.py"));
        let o = touchstone(&["run", &spec(s), "--engine", &engine, "-q"]);
        assert_eq!(o.code, 0, "{s}:\n{}", o.all());
        assert!(o.stdout.contains("PASSED"), "{s}: {}", o.stdout);
    }
}

fn a_rank_shard_at_the_wrong_offset_fails_naming_the_rank() {
    let engine = format!("{} --ranks 2 --bug shard-offset", exec("numpy_engine.py"));
    let o = touchstone(&["run", &spec("qwen2-tiny.yaml"), "--engine", &engine, "-q"]);
    assert_eq!(o.code, 1, "{}", o.all());
    assert!(
        o.all().contains("rank 1's shard covers") && o.all().contains("overlaps"),
        "{}",
        o.all()
    );
}

fn exec(script: &str) -> String {
    format!(
        "exec:python3 {}",
        root().join("examples/protocol").join(script).display()
    )
}

fn spec(name: &str) -> String {
    root().join("specs").join(name).display().to_string()
}

fn the_numpy_engine_passes_every_shipped_tiny_spec() {
    for s in [
        "qwen2-tiny.yaml",
        "llama-tiny.yaml",
        "qwen3-tiny.yaml",
        "phi3-tiny.yaml",
        "qwen2-tiny-long.yaml",
        "qwen2-tiny-sampling.yaml",
        "qwen2-tiny-f16.yaml",
        "qwen2-tiny-bf16.yaml",
    ] {
        let o = touchstone(&["run", &spec(s), "--engine", &exec("numpy_engine.py"), "-q"]);
        assert_eq!(o.code, 0, "{s}:\n{}", o.all());
        assert!(o.stdout.contains("PASSED"), "{s}: {}", o.stdout);
    }
}

fn the_engine_without_rope_in_decode_diverges_at_decode1_q_rope() {
    let d = tempfile::tempdir().unwrap();
    let j = d.path().join("r.json");
    let o = touchstone(&[
        "run",
        &spec("qwen2-tiny.yaml"),
        "--engine",
        &exec("numpy_engine_rope_bug.py"),
        "-q",
        "--json",
        &j.display().to_string(),
    ]);
    assert_eq!(o.code, 1, "{}", o.all());
    let r = json(&j);
    let fd = &r["runs"][0]["first_divergence"];
    assert_eq!(
        (fd["step"].as_str(), fd["stage"].as_str()),
        (Some("decode1"), Some("blk.0.q_rope")),
        "{fd}"
    );
    assert!(r["runs"][0]["suspect_golden"].is_null());
    assert!(o.stdout.contains("FIRST DIVERGENCE"), "{}", o.stdout);
}

fn its_captures_as_dumps_get_the_same_stage_verdicts() {
    let d = tempfile::tempdir().unwrap();
    let p = |x: &std::path::Path| x.display().to_string();
    let (cap, j1, j2) = (
        d.path().join("cap.safetensors"),
        d.path().join("1.json"),
        d.path().join("2.json"),
    );
    for (script, code) in [("numpy_engine.py", 0), ("numpy_engine_rope_bug.py", 1)] {
        let o = touchstone(&[
            "run",
            &spec("qwen2-tiny.yaml"),
            "--engine",
            &exec(script),
            "-q",
            "--save-captures",
            &p(&cap),
            "--json",
            &p(&j1),
        ]);
        assert_eq!(o.code, code, "{script}: {}", o.all());
        let o = touchstone(&[
            "run",
            &spec("qwen2-tiny.yaml"),
            "--engine",
            &format!("dumps:{}", p(&cap)),
            "-q",
            "--json",
            &p(&j2),
        ]);
        assert_eq!(o.code, code, "{script} as dumps: {}", o.all());
        let (a, b) = (json(&j1), json(&j2));
        assert_eq!(stage_verdicts(&a), stage_verdicts(&b), "{script}");
        assert_eq!(
            a["runs"][0]["first_divergence"], b["runs"][0]["first_divergence"],
            "{script}"
        );
    }
}

fn the_spec_declared_engine_is_selected_by_name() {
    let o = touchstone(&["run", &spec("qwen2-tiny.yaml"), "--engine", "numpy", "-q"]);
    assert_eq!(o.code, 0, "{}", o.all());
    assert!(o.stdout.contains("== qwen2-tiny on engine numpy"), "{}", o.stdout);
    let l = touchstone(&["list", &spec("qwen2-tiny.yaml"), "--engine", "numpy"]);
    assert!(
        l.stdout.lines().all(|x| x.starts_with("numpy::qwen2-tiny::")),
        "{}",
        l.stdout
    );
}

/// An engine that cannot tap attn_scores/attn_probs (flash attention) and
/// says so passes, those checks counted not applicable; the same engine
/// claiming every stage and writing none of them fails them as missing
/// captures, and none of them is the first divergence.
fn a_flash_attention_engine_is_judged_on_what_it_can_tap() {
    let o = touchstone(&[
        "run",
        &spec("qwen2-tiny.yaml"),
        "--engine",
        &exec("numpy_engine_flash.py"),
        "-q",
    ]);
    assert_eq!(o.code, 0, "{}", o.all());
    let summary = o.stdout.lines().last().unwrap_or("").to_string();
    // 2 layers x (scores + probs) x 4 steps, each with its checks.
    assert!(
        summary.contains("0 failed") && summary.contains("not applicable"),
        "{summary}"
    );
    let d = tempfile::tempdir().unwrap();
    let j = d.path().join("r.json");
    let o = touchstone(&[
        "run",
        &spec("qwen2-tiny.yaml"),
        "--engine",
        &format!("{} --claim-all", exec("numpy_engine_flash.py")),
        "-q",
        "--json",
        &j.display().to_string(),
    ]);
    assert_eq!(o.code, 1, "{}", o.all());
    assert!(o.stdout.contains("did not capture"), "{}", o.stdout);
    let r = json(&j);
    let fd = &r["runs"][0]["first_divergence"];
    assert!(
        fd.is_null() || !fd["stage"].as_str().unwrap_or("").contains("attn_"),
        "a missing capture is no first divergence: {fd}"
    );
}
