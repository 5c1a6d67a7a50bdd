//! GGUF models through the command line: the tiny Qwen2 converted to GGUF (as
//! Qwen2, and as a Llama with llama.cpp's Q/K permutation) passes the default
//! spec against the HF goldens; keeping the permutation fails at blk.0.q; and
//! every kind of bad GGUF is exit 2 with an error naming the file, never a panic
//! (checked in `common::touchstone`).

mod common;
use common::*;

use std::path::{Path, PathBuf};

use touchstone::gguf::writer::GgufWriter;
use touchstone::gguf::GgmlType;
use touchstone::model::gguf::model_writer;
use touchstone::model::ModelConfig;
use touchstone::tensor::io::read_safetensors;

/// The tiny Qwen2 as a GGUF of `arch` (written the way llama.cpp converts it).
fn tiny_writer(arch: &str) -> GgufWriter {
    let mut cfg = ModelConfig::from_hf_dir(&model_dir()).unwrap();
    cfg.arch = arch.to_string();
    let ts = read_safetensors(&model_dir().join("model.safetensors")).unwrap().floats;
    model_writer(&cfg, &ts, GgmlType::F32)
}

fn write_gguf(dir: &Path, name: &str, bytes: &[u8]) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, bytes).unwrap();
    p
}

fn expect_exit2(args: &[&str], needles: &[&str]) {
    let o = touchstone(args);
    assert_eq!(o.code, 2, "expected exit 2 for {args:?}:\n{}", o.all());
    for n in needles {
        assert!(o.stderr.contains(n), "stderr lacks {n:?}:\n{}", o.stderr);
    }
}

/// `inspect FILE` and `run --model FILE` both exit 2 naming the file and `needle`.
fn rejected(p: &Path, needle: &str) {
    let s = p.display().to_string();
    expect_exit2(&["inspect", &s], &[&s, needle]);
    let spec = write(
        p.parent().unwrap(),
        "hf-only.yaml",
        &hf_only_spec_text(&model_dir(), &hf_golden()),
    );
    expect_exit2(&["run", &spec.display().to_string(), "--model", &s], &[&s, needle]);
}

#[test]
fn qwen2_gguf_passes_the_default_spec() {
    let d = tempfile::tempdir().unwrap();
    let p = d.path().join("qwen2.gguf");
    tiny_writer("qwen2").write(&p).unwrap();
    let spec = write(d.path(), "hf-only.yaml", &hf_only_spec_text(&model_dir(), &hf_golden()));
    let o = touchstone(&["run", &spec.display().to_string(), "--model", &p.display().to_string()]);
    assert_eq!(o.code, 0, "{}", o.all());
}

#[test]
fn llama_gguf_is_unpermuted_and_the_switch_shows_the_failure() {
    let d = tempfile::tempdir().unwrap();
    let p = d.path().join("llama.gguf");
    tiny_writer("llama").write(&p).unwrap();
    let s = p.display().to_string();
    let spec = write(d.path(), "hf-only.yaml", &hf_only_spec_text(&model_dir(), &hf_golden()));
    let spec = spec.display().to_string();
    let o = touchstone(&["run", &spec, "--model", &s]);
    assert_eq!(o.code, 0, "{}", o.all());

    let json = d.path().join("r.json");
    let o = touchstone(&[
        "run",
        &spec,
        "--model",
        &s,
        "--keep-gguf-qk-permutation",
        "--json",
        &json.display().to_string(),
    ]);
    assert_eq!(o.code, 1, "{}", o.all());
    let r = common::json(&json);
    let fd = &r["first_divergence"];
    assert_eq!(fd["step"], "prefill", "{fd}");
    assert_eq!(fd["stage"], "blk.0.q", "{fd}");
    // The rerun command reproduces the switch.
    assert!(o.stdout.contains("--keep-gguf-qk-permutation"), "{}", o.stdout);
    // The switch is a hidden test aid.
    let help = touchstone(&["run", "--help"]);
    assert!(!help.stdout.contains("keep-gguf"), "{}", help.stdout);
}

#[test]
fn inspect_shows_version_metadata_and_tensors() {
    let d = tempfile::tempdir().unwrap();
    let p = d.path().join("qwen2.gguf");
    tiny_writer("qwen2").write(&p).unwrap();
    let o = touchstone(&["inspect", &p.display().to_string()]);
    assert_eq!(o.code, 0, "{}", o.all());
    for needle in [
        "GGUF version 3",
        "metadata general.architecture (string): \"qwen2\"",
        "metadata tokenizer.ggml.tokens (array<string>): [len 512] \"<0>\"",
        "blk.0.attn_q.weight",
        "[64, 64]",
        "F32",
        "27 tensors by type: 27 F32 (",
    ] {
        assert!(o.stdout.contains(needle), "lacks {needle:?}:\n{}", o.stdout);
    }
    assert!(o.stdout.lines().count() < 80, "token lists must be cut:\n{}", o.stdout);
}

#[test]
fn truncated_gguf() {
    let d = tempfile::tempdir().unwrap();
    let b = tiny_writer("qwen2").to_bytes();
    let p = write_gguf(d.path(), "cut-header.gguf", &b[..1000]);
    rejected(&p, "truncated");
    let p = write_gguf(d.path(), "cut-data.gguf", &b[..b.len() - 100]);
    rejected(&p, "past the end of the file");
}

#[test]
fn wrong_magic() {
    let d = tempfile::tempdir().unwrap();
    let mut b = tiny_writer("qwen2").to_bytes();
    b[..4].copy_from_slice(b"GGJT");
    let p = write_gguf(d.path(), "m.gguf", &b);
    rejected(&p, "not a GGUF file");
}

#[test]
fn unsupported_version() {
    let d = tempfile::tempdir().unwrap();
    let mut b = tiny_writer("qwen2").to_bytes();
    b[4..8].copy_from_slice(&1u32.to_le_bytes());
    let p = write_gguf(d.path(), "m.gguf", &b);
    rejected(&p, "GGUF version 1 is not supported");
}

#[test]
fn tensor_offset_past_the_end() {
    let d = tempfile::tempdir().unwrap();
    let mut w = tiny_writer("qwen2");
    // A tensor whose data would start 1 MiB into a file far smaller: patch the
    // last tensor's offset field (the tensor table's last 8 bytes before padding).
    w.tensors.rotate_left(1);
    let mut b = w.to_bytes();
    let last = w.tensors.last().unwrap();
    let needle = [&(last.name.len() as u64).to_le_bytes()[..], last.name.as_bytes()].concat();
    let at = b.windows(needle.len()).position(|x| x == needle).unwrap() + needle.len();
    let at = at + 4 + 8 * last.ne.len() + 4;
    b[at..at + 8].copy_from_slice(&(1u64 << 20).to_le_bytes());
    let p = write_gguf(d.path(), "m.gguf", &b);
    rejected(&p, &format!("tensor `{}`", last.name));
    rejected(&p, "past the end of the file");
}

#[test]
fn missing_required_tensor() {
    let d = tempfile::tempdir().unwrap();
    let mut w = tiny_writer("qwen2");
    w.tensors.retain(|t| t.name != "blk.1.ffn_down.weight");
    let p = d.path().join("m.gguf");
    w.write(&p).unwrap();
    let s = p.display().to_string();
    let spec = write(d.path(), "hf-only.yaml", &hf_only_spec_text(&model_dir(), &hf_golden()));
    // Plan building reads the config only; the engine load names the tensor.
    expect_exit2(
        &["run", &spec.display().to_string(), "--model", &s],
        &[
            &s,
            "missing tensor `blk.1.ffn_down.weight`",
            "model.layers.1.mlp.down_proj.weight",
        ],
    );
}

#[test]
fn missing_tokenizer_metadata() {
    let d = tempfile::tempdir().unwrap();
    let mut w = tiny_writer("qwen2");
    w.metadata.retain(|(k, _)| k != "tokenizer.ggml.tokens");
    let p = d.path().join("m.gguf");
    w.write(&p).unwrap();
    let s = p.display().to_string();
    expect_exit2(
        &["run", "--model", &s],
        &[&s, "missing metadata key `tokenizer.ggml.tokens`"],
    );
}

#[test]
fn unsupported_dtype() {
    // IQ4_NL (blocks of 32 in 18 bytes) has a block size but no dequantiser:
    // the file opens and inspects; loading it names every such tensor.
    let d = tempfile::tempdir().unwrap();
    let mut w = tiny_writer("qwen2");
    for t in w.tensors.iter_mut() {
        if matches!(
            t.name.as_str(),
            "blk.0.ffn_up.weight" | "blk.1.ffn_up.weight" | "blk.0.ffn_down.weight"
        ) {
            let n = t.bytes.len() / 4;
            (t.type_id, t.bytes) = (GgmlType::IQ4_NL.id(), vec![0; n / 32 * 18]);
        }
    }
    let p = d.path().join("m.gguf");
    w.write(&p).unwrap();
    let s = p.display().to_string();
    let spec = write(d.path(), "hf-only.yaml", &hf_only_spec_text(&model_dir(), &hf_golden()));
    expect_exit2(
        &["run", &spec.display().to_string(), "--model", &s],
        &[
            &s,
            "3 tensors of type IQ4_NL are not supported: blk.0.ffn_down.weight, blk.0.ffn_up.weight, \
             blk.1.ffn_up.weight (dequantisation exists for F32, F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, \
             Q4_K, Q5_K, Q6_K, BF16)",
        ],
    );
    let o = touchstone(&["inspect", &s]);
    assert_eq!(o.code, 0, "{}", o.all());
    let row = o
        .stdout
        .lines()
        .find(|l| l.starts_with("blk.0.ffn_up.weight "))
        .unwrap_or_else(|| panic!("no row:\n{}", o.stdout));
    let cells: Vec<&str> = row.split_whitespace().collect();
    assert_eq!(cells[1], "IQ4_NL", "{row}");
    assert_eq!(&cells[cells.len() - 5..], ["-"; 5], "{row}");
    assert!(
        o.stdout
            .contains("; 3 cannot be read (no dequantisation for their type; stats shown as -)"),
        "{}",
        o.stdout
    );

    // A row length that is not a multiple of the block size is refused at open.
    let mut w = tiny_writer("qwen2");
    let t = w.tensors.iter_mut().find(|t| t.name == "blk.0.ffn_up.weight").unwrap();
    t.type_id = GgmlType::Q4_K.id();
    let p = d.path().join("q4k.gguf");
    w.write(&p).unwrap();
    rejected(
        &p,
        "tensor `blk.0.ffn_up.weight`: row length ne[0] = 64 is not a multiple of the Q4_K block size 256",
    );
}

#[test]
fn a_spec_may_name_a_gguf_model() {
    let d = tempfile::tempdir().unwrap();
    let p = d.path().join("qwen2.gguf");
    tiny_writer("qwen2").write(&p).unwrap();
    let s = write(d.path(), "s.yaml", &hf_only_spec_text(&p, &hf_golden()));
    let o = touchstone(&["run", &s.display().to_string(), "--only", "prefill/logits"]);
    assert_eq!(o.code, 0, "{}", o.all());
    // A model file that is neither a folder nor .gguf.
    let bin = write(d.path(), "model.bin", "x");
    let s = write(d.path(), "s2.yaml", &spec_text(&bin, &hf_golden()));
    expect_exit2(
        &["run", &s.display().to_string()],
        &[&bin.display().to_string(), ".gguf file"],
    );
}
