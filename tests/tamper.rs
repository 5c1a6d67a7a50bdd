//! Tampering with one element of one golden stage must fail the run (exit 1)
//! with the first divergence at exactly that step and stage, and everything
//! after it labelled downstream — the localisation the report promises.

mod common;
use common::*;

fn tamper(step_stage: &str, index: usize, delta: f32) -> (Output, serde_json::Value) {
    let d = tempfile::tempdir().unwrap();
    let g = d.path().join("hf.safetensors");
    altered_golden(&g, |t| {
        let x = t
            .get_mut(step_stage)
            .unwrap_or_else(|| panic!("golden has {step_stage}"));
        x.data_mut()[index] += delta;
    });
    let s = write(d.path(), "s.yaml", &spec_text(&model_dir(), &g));
    let report = d.path().join("report.json");
    let o = touchstone(&["run", &s.display().to_string(), "--json", &report.display().to_string()]);
    let j = json(&report);
    (o, j)
}

#[test]
fn tampered_decode_stage_is_the_first_divergence() {
    let (o, j) = tamper("decode2/blk.1.attn_out", 5, 1e-2);
    assert_eq!(o.code, 1, "{}", o.all());
    assert_eq!(j["passed"], false);
    let fd = &j["first_divergence"];
    assert_eq!(
        (fd["step"].as_str(), fd["stage"].as_str()),
        (Some("decode2"), Some("blk.1.attn_out")),
        "{fd}"
    );
    assert_eq!(fd["check"], "golden:hf");
    // Only the tampered stage fails: the engine against the tampered HF golden,
    // and the two references against each other (the golden itself is suspect).
    let mut failed: Vec<&serde_json::Value> = j["checks"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|c| c["status"] == "fail")
        .collect();
    failed.sort_by_key(|c| c["id"].as_str().unwrap().to_string());
    let ids: Vec<&str> = failed.iter().map(|c| c["id"].as_str().unwrap()).collect();
    assert_eq!(
        ids,
        [
            "decode2/blk.1.attn_out::golden:hf",
            "decode2/blk.1.attn_out::references_agree:hf~llama.cpp"
        ]
    );
    assert!(failed[0]["first_divergence"].as_bool().unwrap());
    assert!(failed[0]["rerun"]
        .as_str()
        .unwrap()
        .contains("--only 'decode2/blk.1.attn_out::golden:hf'"));
    // The terminal report marks it and shows both values.
    assert!(o.stdout.contains("FIRST DIVERGENCE"), "{}", o.stdout);
    assert!(o.stdout.contains("Greatest absolute difference"), "{}", o.stdout);
}

#[test]
fn tampered_prefill_stage_is_localised_too() {
    let (o, j) = tamper("prefill/blk.0.k_rope", 17, -1e-2);
    assert_eq!(o.code, 1, "{}", o.all());
    let fd = &j["first_divergence"];
    assert_eq!(
        (fd["step"].as_str(), fd["stage"].as_str()),
        (Some("prefill"), Some("blk.0.k_rope")),
        "{fd}"
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
