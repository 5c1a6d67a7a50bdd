//! `touchstone diff` and `touchstone compare` as a user runs them: a baseline
//! run, a deliberate regression (a perturbed golden), the diff exits 1 naming
//! the regressed stage; the same diff unchanged exits 0; bad input exits 2
//! naming the file. `compare` matches tensors by name across safetensors,
//! .npy and .npz.

mod common;
use common::*;

use std::path::Path;

fn s(p: &Path) -> String {
    p.display().to_string()
}

/// The default spec without its oracle: per-element tolerances, so a moved
/// golden fails the golden check itself (under the scaled policy it is the
/// golden's `references_agree` that fails, which `--only golden` leaves out).
fn per_element_spec_text(golden: &Path) -> String {
    let t = spec_text(&model_dir(), golden);
    let out: String = t
        .lines()
        .filter(|l| !l.starts_with("oracle:"))
        .map(|l| format!("{l}\n"))
        .collect();
    assert!(out.len() < t.len(), "the default spec has an oracle line");
    out
}

/// Runs the default spec (per-element tolerances) against `golden` (only golden
/// checks, for speed) into `json`.
fn run_json(dir: &Path, golden: &Path, json: &Path) -> Output {
    let spec = write(dir, "s.yaml", &per_element_spec_text(golden));
    touchstone(&["run", &s(&spec), "--only", "golden", "--json", &s(json)])
}

#[test]
fn diff_names_the_first_regressed_stage_and_exits_1() {
    let d = tempfile::tempdir().unwrap();
    let base = d.path().join("base.json");
    assert_eq!(run_json(d.path(), &hf_golden(), &base).code, 0);
    // The regression: decode1/blk.0.ffn_out moved by 1e-2 (fails), and
    // decode2/blk.0.k by 8e-6 (still passes, but the error grows > 10x).
    let g = d.path().join("hf.safetensors");
    altered_golden(&g, |t| {
        t.get_mut("decode2/blk.0.k").unwrap().data_mut()[3] += 8e-6;
        t.get_mut("decode1/blk.0.ffn_out").unwrap().data_mut()[7] += 1e-2;
    });
    let new = d.path().join("new.json");
    assert_eq!(run_json(d.path(), &g, &new).code, 1);

    let (junit, md, html) = (d.path().join("d.xml"), d.path().join("d.md"), d.path().join("d.html"));
    let o = touchstone(&[
        "diff",
        &s(&base),
        &s(&new),
        "--junit",
        &s(&junit),
        "--markdown",
        &s(&md),
        "--html",
        &s(&html),
    ]);
    assert_eq!(o.code, 1, "{}", o.all());
    assert!(
        o.stdout
            .contains("first regressed stage in execution order: decode1/blk.0.ffn_out"),
        "{}",
        o.stdout
    );
    assert!(o.stdout.contains("newly failing (was pass)"), "{}", o.stdout);
    let grew = o
        .stdout
        .lines()
        .find(|l| l.starts_with("decode2/blk.0.k::golden:hf"))
        .unwrap();
    assert!(
        grew.contains("REGRESSION: error grew") && grew.contains("pass"),
        "{grew}"
    );
    assert!(o.stdout.contains("REGRESSED: 2 regression(s)"), "{}", o.stdout);

    // The sinks: JUnit parses, one testcase per check, two failures.
    let xml = std::fs::read_to_string(&junit).unwrap();
    let doc = roxmltree::Document::parse(&xml).unwrap();
    let checks = json(&base)["checks"].as_array().unwrap().len();
    assert_eq!(doc.descendants().filter(|n| n.has_tag_name("testcase")).count(), checks);
    assert_eq!(doc.descendants().filter(|n| n.has_tag_name("failure")).count(), 2);
    let md = std::fs::read_to_string(&md).unwrap();
    assert!(
        md.contains("❌ REGRESSED") && md.contains("decode1/blk.0.ffn_out"),
        "{md}"
    );
    let html = std::fs::read_to_string(&html).unwrap();
    assert!(html.contains("<svg") && html.contains("first regression"), "html plot");
    // Each golden source is its own line on each side (not one zigzag line).
    for legend in ["BASE hf", "NEW hf", "BASE llama.cpp", "NEW llama.cpp"] {
        assert!(html.contains(legend), "no {legend} line in the diff plot");
    }
    assert!(html.contains(".plot svg{width:100%"), "plots do not scale to the page");

    // Unchanged: exit 0; a larger factor forgives the growth but not the failure.
    let o = touchstone(&["diff", &s(&base), &s(&base)]);
    assert_eq!(o.code, 0, "{}", o.all());
    assert!(o.stdout.contains("no regression"), "{}", o.stdout);
    let o = touchstone(&["diff", &s(&base), &s(&new), "--factor", "1e9"]);
    assert_eq!(o.code, 1, "{}", o.all());
    assert!(o.stdout.contains("REGRESSED: 1 regression(s)"), "{}", o.stdout);
}

#[test]
fn run_writes_junit_markdown_and_html() {
    let d = tempfile::tempdir().unwrap();
    let (j, x, m, h) = (
        d.path().join("r.json"),
        d.path().join("r.xml"),
        d.path().join("r.md"),
        d.path().join("r.html"),
    );
    let o = touchstone(&[
        "run",
        "--only",
        "prefill/",
        "--json",
        &s(&j),
        "--junit",
        &s(&x),
        "--markdown",
        &s(&m),
        "--html",
        &s(&h),
    ]);
    assert_eq!(o.code, 0, "{}", o.all());
    let xml = std::fs::read_to_string(&x).unwrap();
    let doc = roxmltree::Document::parse(&xml).unwrap();
    let n = json(&j)["checks"].as_array().unwrap().len();
    assert_eq!(doc.descendants().filter(|n| n.has_tag_name("testcase")).count(), n);
    assert!(std::fs::read_to_string(&m).unwrap().contains("✅ PASSED"));
    let html = std::fs::read_to_string(&h).unwrap();
    assert_eq!(html.matches("<svg").count(), 1, "one plot: prefill only");
}

#[test]
fn diff_bad_input_exits_2_naming_the_file() {
    let d = tempfile::tempdir().unwrap();
    let missing = d.path().join("missing.json");
    let bad = write(d.path(), "bad.json", "{\"passed\": true}");
    let o = touchstone(&["diff", &s(&missing), &s(&bad)]);
    assert_eq!(o.code, 2, "{}", o.all());
    assert!(o.stderr.contains("missing.json"), "{}", o.stderr);
    let o = touchstone(&["diff", &s(&bad), &s(&bad)]);
    assert_eq!(o.code, 2, "{}", o.all());
    assert!(
        o.stderr.contains("bad.json") && o.stderr.contains("not a touchstone JSON report"),
        "{}",
        o.stderr
    );
}

#[test]
fn diff_growth_from_synthetic_reports() {
    let d = tempfile::tempdir().unwrap();
    let check = |id: &str, step: &str, stage: &str, status: &str, max_abs: f64| {
        serde_json::json!({"spec": "s", "engine": "cpu", "id": id, "step": step, "stage": stage,
            "check": "golden:hf", "status": status, "metrics": {"max_abs": max_abs}, "message": "m"})
    };
    let report = |checks: Vec<serde_json::Value>| serde_json::json!({ "checks": checks }).to_string();
    let base = write(
        d.path(),
        "b.json",
        &report(vec![
            check("decode1/logits::golden:hf", "decode1", "logits", "pass", 1e-7),
            check("prefill/embed::golden:hf", "prefill", "embed", "pass", 0.0),
            check("prefill/logits::golden:hf", "prefill", "logits", "pass", 1e-7),
        ]),
    );
    let new = write(
        d.path(),
        "n.json",
        &report(vec![
            check("decode1/logits::golden:hf", "decode1", "logits", "pass", 5e-6),
            check("prefill/embed::golden:hf", "prefill", "embed", "pass", 0.0),
            check("prefill/logits::golden:hf", "prefill", "logits", "pass", 9e-7),
        ]),
    );
    let o = touchstone(&["diff", &s(&base), &s(&new)]);
    assert_eq!(o.code, 1, "{}", o.all());
    // 50x at decode1 is a regression; 9x at prefill is not; execution order names decode1.
    assert!(
        o.stdout
            .contains("first regressed stage in execution order: decode1/logits"),
        "{}",
        o.stdout
    );
    assert!(o.stdout.contains("50.000x"), "{}", o.stdout);
    assert!(o.stdout.contains("REGRESSED: 1 regression(s)"), "{}", o.stdout);
}

#[test]
fn compare_safetensors_npy_and_npz() {
    use npyz::WriterBuilder;
    let d = tempfile::tempdir().unwrap();
    let a = hf_golden();
    let b = d.path().join("b.safetensors");
    altered_golden(&b, |t| {
        t.get_mut("prefill/logits").unwrap().data_mut()[0] += 1e-3;
        t.remove("decode3/logits");
    });
    let o = touchstone(&["compare", &s(&a), &s(&b)]);
    assert_eq!(o.code, 1, "{}", o.all());
    assert!(o.stdout.contains("--- FAIL prefill/logits"), "{}", o.stdout);
    assert!(o.stdout.contains("Greatest absolute difference"), "{}", o.stdout);
    assert!(o.stdout.contains("only in A (1): decode3/logits"), "{}", o.stdout);
    // A looser atol passes the same pair.
    let o = touchstone(&["compare", &s(&a), &s(&b), "--atol", "1e-2"]);
    assert_eq!(o.code, 0, "{}", o.all());

    // .npz (numpy savez layout) against .npy and itself.
    let npz = d.path().join("x.npz");
    {
        let mut w = npyz::npz::NpzWriter::create(&npz).unwrap();
        let mut arr = w
            .array::<f32>("x", Default::default())
            .unwrap()
            .default_dtype()
            .shape(&[2])
            .begin_nd()
            .unwrap();
        arr.extend([1.5f32, -2.0]).unwrap();
        arr.finish().unwrap();
        let mut arr = w
            .array::<f32>("y", Default::default())
            .unwrap()
            .default_dtype()
            .shape(&[1])
            .begin_nd()
            .unwrap();
        arr.extend([3.0f32]).unwrap();
        arr.finish().unwrap();
    }
    let npy = d.path().join("x.npy");
    {
        let mut w = npyz::WriteOptions::new()
            .default_dtype()
            .shape(&[2])
            .writer(std::fs::File::create(&npy).unwrap())
            .begin_nd()
            .unwrap();
        w.extend([1.5f32, -2.5]).unwrap();
        w.finish().unwrap();
    }
    let o = touchstone(&["compare", &s(&npz), &s(&npz)]);
    assert_eq!(o.code, 0, "{}", o.all());
    assert!(o.stdout.contains("PASSED: 2 tensors match"), "{}", o.stdout);
    let o = touchstone(&["compare", &s(&npz), &s(&npy)]);
    assert_eq!(o.code, 1, "{}", o.all());
    assert!(
        o.stdout.contains("--- FAIL x") && o.stdout.contains("only in A (1): y"),
        "{}",
        o.stdout
    );
    // Nothing in common is not a pass.
    let o = touchstone(&["compare", &s(&npy), &s(&a)]);
    assert_eq!(o.code, 1, "{}", o.all());
    assert!(o.stdout.contains("no tensor name in common"), "{}", o.stdout);
}

#[test]
fn checks_that_vanish_fail_the_diff_and_are_counted() {
    let d = tempfile::tempdir().unwrap();
    let full = d.path().join("full.json");
    assert_eq!(run_json(d.path(), &hf_golden(), &full).code, 0);
    // A later run that checked only a handful of the same checks.
    let spec = write(d.path(), "s.yaml", &per_element_spec_text(&hf_golden()));
    let small = d.path().join("small.json");
    let o = touchstone(&[
        "run",
        &s(&spec),
        "--only",
        "prefill/embed::golden",
        "--json",
        &s(&small),
    ]);
    assert_eq!(o.code, 0, "{}", o.all());
    let o = touchstone(&["diff", &s(&full), &s(&small)]);
    assert_eq!(o.code, 1, "{}", o.all());
    assert!(o.stdout.contains("VANISHED from NEW"), "{}", o.stdout);
    assert!(o.stdout.contains("2 checks compared"), "{}", o.stdout);
    assert!(
        o.stdout.contains("vanished (in BASE, not in NEW), 0 new"),
        "{}",
        o.stdout
    );
    // Allowed explicitly: no regression, still counted.
    let o = touchstone(&["diff", &s(&full), &s(&small), "--allow-vanished", "--changed"]);
    assert_eq!(o.code, 0, "{}", o.all());
    assert!(o.stdout.contains("no regression (2 checks compared"), "{}", o.stdout);
    // --changed: the unchanged rows are not listed, the vanished ones are.
    assert!(
        !o.stdout.lines().any(|l| l.starts_with("prefill/embed::golden:hf ")),
        "{}",
        o.stdout
    );
    // The reverse: new checks are counted and do not fail.
    let o = touchstone(&["diff", &s(&small), &s(&full)]);
    assert_eq!(o.code, 0, "{}", o.all());
    assert!(o.stdout.contains("0 vanished"), "{}", o.stdout);
}

#[test]
fn inspect_shows_int32_and_compare_pairs_two_single_tensor_files() {
    let d = tempfile::tempdir().unwrap();
    let npy = |name: &str, descr: &str, payload: &[u8]| {
        let header = format!("{{'descr': '{descr}', 'fortran_order': False, 'shape': (3,), }}");
        let mut b = b"\x93NUMPY\x01\x00".to_vec();
        let pad = 64 - (10 + header.len() + 1) % 64;
        let h = format!("{header}{}\n", " ".repeat(pad % 64));
        b.extend_from_slice(&(h.len() as u16).to_le_bytes());
        b.extend_from_slice(h.as_bytes());
        b.extend_from_slice(payload);
        let p = d.path().join(name);
        std::fs::write(&p, b).unwrap();
        p
    };
    let ints: Vec<u8> = [1i32, 2, 3].iter().flat_map(|v| v.to_le_bytes()).collect();
    let o = touchstone(&["inspect", &s(&npy("ids.npy", "<i4", &ints))]);
    assert_eq!(o.code, 0, "{}", o.all());
    assert!(
        o.stdout.lines().any(|l| l.starts_with("ids") && l.contains(" i32 ")),
        "{}",
        o.stdout
    );
    let f = |v: [f32; 3]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
    let a = npy("engine_q.npy", "<f4", &f([1.0, 2.0, 3.0]));
    let b = npy("golden_q.npy", "<f4", &f([1.0, 2.0, 3.5]));
    let o = touchstone(&["compare", &s(&a), &s(&b)]);
    assert_eq!(o.code, 1, "{}", o.all());
    assert!(o.stdout.contains("engine_q ~ golden_q"), "{}", o.stdout);
}
