//! A golden moved at one stage must be reported at exactly that stage, and
//! the report must say whose fault it can be:
//! - with two sources that can vote (two references, or a reference and the
//!   float64 oracle) the references leave their own allowance there, so the
//!   golden is *suspect* at that stage and the engine is not blamed: no first
//!   divergence, and the only failures are at that stage;
//! - with a single reference a moved golden cannot be told from a moved
//!   engine: the stage is the first divergence, later failures downstream.
//!
//! The perturbation is the one a subtle bug makes: 1e-3 relative over one
//! block (one head, one row), not one element out by 1e-2.

mod common;
use common::*;

/// Runs `spec_text` with the HF golden replaced by a copy whose `key` block is
/// perturbed; returns the exit status and the JSON report.
fn run_tampered(
    key: &str,
    in_block: &dyn Fn(&[usize]) -> bool,
    spec: fn(&std::path::Path, &std::path::Path) -> String,
) -> (Output, serde_json::Value) {
    let d = tempfile::tempdir().unwrap();
    let g = d.path().join("hf.safetensors");
    altered_golden(&g, |t| {
        let x = t.get_mut(key).unwrap_or_else(|| panic!("golden has {key}"));
        assert!(perturb(x, 1e-3, in_block) > 0, "the block of {key} is empty");
    });
    let s = write(d.path(), "s.yaml", &spec(&model_dir(), &g));
    let report = d.path().join("report.json");
    let o = touchstone(&["run", &s.display().to_string(), "--json", &report.display().to_string()]);
    let j = json(&report);
    (o, j)
}

fn failing(j: &serde_json::Value) -> Vec<String> {
    let mut ids: Vec<String> = j["checks"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|c| c["status"] == "fail")
        .map(|c| c["id"].as_str().unwrap().to_string())
        .collect();
    ids.sort();
    ids
}

fn at(v: &serde_json::Value) -> (Option<&str>, Option<&str>) {
    (v["step"].as_str(), v["stage"].as_str())
}

/// The default spec (HF, llama.cpp and the oracle): the tampered stage is a
/// suspect golden, and nothing else fails.
fn assert_suspect(key: &str, in_block: &dyn Fn(&[usize]) -> bool) {
    let (step, stage) = key.split_once('/').unwrap();
    let (o, j) = run_tampered(key, in_block, spec_text);
    assert_eq!(o.code, 1, "{}", o.all());
    let run = &j["runs"][0];
    assert_eq!(at(&run["suspect_golden"]), (Some(step), Some(stage)), "{}", o.stdout);
    assert!(
        run["first_divergence"].is_null(),
        "the engine is blamed: {}",
        run["first_divergence"]
    );
    let ids = failing(&j);
    assert!(!ids.is_empty());
    for id in &ids {
        assert!(id.starts_with(&format!("{key}::")), "{id} fails besides {key}: {ids:?}");
    }
    assert!(ids.contains(&format!("{key}::references_agree:oracle~hf")), "{ids:?}");
    assert!(o.stdout.contains("GOLDEN SUSPECT"), "{}", o.stdout);
}

#[test]
fn one_head_of_q_rope_moved_is_a_suspect_golden_at_that_stage() {
    // prefill q_rope [T, H, D]: head 1, every position.
    assert_suspect("prefill/blk.0.q_rope", &|i| i[1] == 1);
}

#[test]
fn one_row_of_attn_out_moved_is_a_suspect_golden_at_that_stage() {
    assert_suspect("decode2/blk.1.attn_out", &|_| true);
}

#[test]
fn one_row_of_ffn_act_moved_is_a_suspect_golden_at_that_stage() {
    // prefill ffn_act [T, F]: the last row.
    assert_suspect("prefill/blk.1.ffn_act", &|i| i[0] == 3);
}

#[test]
fn with_one_reference_the_moved_stage_is_the_first_divergence() {
    let (o, j) = run_tampered("prefill/blk.0.q_rope", &|i| i[1] == 1, hf_only_spec_text);
    assert_eq!(o.code, 1, "{}", o.all());
    let fd = &j["first_divergence"];
    assert_eq!(at(fd), (Some("prefill"), Some("blk.0.q_rope")), "{fd}");
    assert_eq!(fd["check"], "golden:hf");
    // Everything that fails is that stage, or labelled downstream of it.
    for c in j["checks"].as_array().unwrap().iter().filter(|c| c["status"] == "fail") {
        let id = c["id"].as_str().unwrap();
        assert!(
            id.starts_with("prefill/blk.0.q_rope::") || c["downstream_of"] == "prefill/blk.0.q_rope",
            "{id}"
        );
    }
    assert!(o.stdout.contains("FIRST DIVERGENCE"), "{}", o.stdout);
    assert!(o.stdout.contains("Greatest absolute difference"), "{}", o.stdout);
    assert!(
        o.stdout.contains("--only 'prefill/blk.0.q_rope::golden:hf'"),
        "{}",
        o.stdout
    );
}

#[test]
fn untampered_copy_passes() {
    let d = tempfile::tempdir().unwrap();
    let g = d.path().join("hf.safetensors");
    altered_golden(&g, |_| {});
    let s = write(d.path(), "s.yaml", &spec_text(&model_dir(), &g));
    let o = touchstone(&["run", &s.display().to_string(), "--only", "golden"]);
    assert_eq!(o.code, 0, "{}", o.all());
}

/// A storage the oracle's values do not fit is said once, not failed check
/// by check: an oracle whose `prefill/blk.1.out` passes f16's 65504 (a copy,
/// scaled there) makes a run at f16 name that stage and value in one note
/// and skip every check from it on; every check before it still runs.
#[test]
fn an_oracle_beyond_the_storage_range_is_said_once_and_its_checks_skipped() {
    use touchstone::tensor::io::{read_safetensors, write_safetensors};
    let d = tempfile::tempdir().unwrap();
    let oracle = d.path().join("oracle.safetensors");
    let mut f = read_safetensors(&root().join("goldens/qwen2-tiny/oracle.safetensors")).unwrap();
    for x in f.floats.get_mut("prefill/blk.1.out").unwrap().data_mut() {
        *x *= 1e5;
    }
    write_safetensors(&oracle, &f.floats, &f.ints, &f.metadata).unwrap();
    let text = std::fs::read_to_string(root().join("specs/qwen2-tiny.yaml"))
        .unwrap()
        .replace(
            "../goldens/qwen2-tiny/oracle.safetensors",
            &oracle.display().to_string(),
        )
        .replace("../goldens/", &format!("{}/goldens/", root().display()));
    let s = write(d.path(), "s.yaml", &text);
    let report = d.path().join("r.json");
    let o = touchstone(&[
        "run",
        &s.display().to_string(),
        "--storage",
        "f16",
        "-q",
        "--json",
        &report.display().to_string(),
    ]);
    assert_eq!(o.code, 0, "{}", o.all());
    let note = "note: storage f16 cannot hold this model's values: the oracle's prefill/blk.1.out reaches";
    assert_eq!(o.stdout.matches(note).count(), 1, "{}", o.stdout);
    let j = json(&report);
    let checks = j["checks"].as_array().unwrap();
    let (mut before, mut after) = (0, 0);
    for c in checks {
        let at = (c["step"].as_str(), c["stage"].as_str());
        let past = match at {
            (Some("prefill"), Some(st)) => {
                !(st == "embed" || st.starts_with("blk.0.") || (st.starts_with("blk.1.") && st != "blk.1.out"))
            }
            (Some(_), Some(_)) => true,
            _ => !matches!(c["check"].as_str(), Some("weights")),
        };
        if past {
            assert_eq!(c["status"], "skip", "{}", c["id"]);
            after += 1;
        } else {
            assert_eq!(c["status"], "pass", "{}: {}", c["id"], c["message"]);
            before += 1;
        }
    }
    assert!(before > 100 && after > 100, "{before} judged before, {after} skipped");
}
