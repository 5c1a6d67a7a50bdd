//! touchstone's dequantisation is bit-exact with llama.cpp's reference: for
//! every block-quantised type it reads, every value of the blocks in
//! `tests/fixtures/quant/` equals, `to_bits()` for `to_bits()` (NaN payloads
//! included), what gguf-py's `quants.dequantize` (gguf 0.19.0 from the pinned
//! llama-cpp-python sdist) gave for them. The blocks are random plus edge
//! cases (zero, extreme, subnormal, negative, infinite and NaN f16 scales;
//! every quant value; every sub-block scale code): see
//! `goldens/recorders/make_quant_fixtures.py` and the fixtures' README. A
//! failure names the type, the block (with its edge-case label) and the index.

use std::path::{Path, PathBuf};

use serde_json::Value;
use sha2::{Digest, Sha256};
use touchstone::gguf::writer::GgufWriter;
use touchstone::gguf::{quant, GgmlType, GgufFile};

fn dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/quant")
}

struct Fixture {
    ty: GgmlType,
    labels: Vec<String>,
    blocks: Vec<u8>,
    /// The expected values' bits.
    values: Vec<u32>,
}

fn read(name: &str, ext: &str, sha256: &str) -> Vec<u8> {
    let p = dir().join(format!("{name}.{ext}"));
    let b = std::fs::read(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
    let got = format!("{:x}", Sha256::digest(&b));
    assert_eq!(got, sha256, "{}: sha256 differs from manifest.json", p.display());
    b
}

fn fixtures() -> Vec<Fixture> {
    let p = dir().join("manifest.json");
    let m: Value = serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
    let mut out = Vec::new();
    for (name, t) in m["types"].as_object().expect("manifest.json: types") {
        let ty = GgmlType::all()
            .find(|t| t.name() == name)
            .unwrap_or_else(|| panic!("manifest.json: unknown type {name}"));
        let n = t["blocks"].as_u64().unwrap();
        let (qk, bytes) = (t["block_size"].as_u64().unwrap(), t["type_size"].as_u64().unwrap());
        assert_eq!(ty.block(), (qk, bytes), "{name}: block size and bytes per block");
        let blocks = read(name, "blocks", t["blocks_sha256"].as_str().unwrap());
        let values = read(name, "f32", t["values_sha256"].as_str().unwrap());
        assert_eq!(blocks.len() as u64, n * bytes, "{name}.blocks");
        assert_eq!(values.len() as u64, n * qk * 4, "{name}.f32");
        let labels: Vec<String> = t["labels"]
            .as_array()
            .unwrap()
            .iter()
            .map(|l| l.as_str().unwrap().to_string())
            .collect();
        assert_eq!(labels.len() as u64, n, "{name}: one label per block");
        let values = values
            .chunks_exact(4)
            .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        out.push(Fixture {
            ty,
            labels,
            blocks,
            values,
        });
    }
    out
}

/// Every value that differs, described (type, block and its label, index in
/// the block, both values and their bits), at most `max` of them, and the count.
fn mismatches(f: &Fixture, got: &[f32], max: usize) -> (usize, Vec<String>) {
    let qk = f.ty.block().0 as usize;
    let mut shown = Vec::new();
    let mut count = got.len().abs_diff(f.values.len());
    for (i, (g, &e)) in got.iter().zip(&f.values).enumerate() {
        if g.to_bits() != e {
            count += 1;
            if shown.len() < max {
                let b = (i / qk) % f.labels.len();
                shown.push(format!(
                    "{} block {b} ({}) index {}: got {g:e} ({:#010x}), gguf-py {:e} ({e:#010x})",
                    f.ty.name(),
                    f.labels[b],
                    i % qk,
                    g.to_bits(),
                    f32::from_bits(e)
                ));
            }
        }
    }
    (count, shown)
}

#[test]
fn every_quantised_type_is_bit_exact_with_gguf_py() {
    let fx = fixtures();
    // Exactly the block-quantised types touchstone reads have fixtures.
    let mut have: Vec<&str> = fx.iter().map(|f| f.ty.name()).collect();
    let mut want: Vec<&str> = quant::READABLE
        .iter()
        .filter(|t| t.block().0 > 1)
        .map(|t| t.name())
        .collect();
    have.sort();
    want.sort();
    assert_eq!(have, want, "fixture types vs quant::READABLE");

    let mut failures = Vec::new();
    for f in &fx {
        let got = quant::to_f32(f.ty, &f.blocks).expect("a readable type");
        let (count, shown) = mismatches(f, &got, 10);
        let nan = f.values.iter().filter(|&&b| f32::from_bits(b).is_nan()).count();
        eprintln!(
            "{}: {} blocks, {} of {} values bit-identical to gguf-py ({nan} NaN)",
            f.ty.name(),
            f.labels.len(),
            f.values.len() - count.min(f.values.len()),
            f.values.len()
        );
        if count > 0 {
            failures.push(format!(
                "{}: {count} value(s) differ:\n  {}",
                f.ty.name(),
                shown.join("\n  ")
            ));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// The parallel split (rayon tasks of many blocks) changes nothing: the
/// fixture blocks repeated into a tensor of thousands of blocks give the
/// expected values repeated.
#[test]
fn many_blocks_in_parallel_are_the_same_values() {
    for f in fixtures() {
        let reps = 20_000 / f.labels.len() + 1;
        let blocks = f.blocks.repeat(reps);
        let got = quant::to_f32(f.ty, &blocks).unwrap();
        let expect = Fixture {
            values: f.values.repeat(reps),
            ..f
        };
        let (count, shown) = mismatches(&expect, &got, 5);
        assert_eq!(count, 0, "{}", shown.join("\n"));
    }
}

/// Through a GGUF file: a tensor of each type reads back (`read_tensor`) as
/// the same values, row-major, reported as f32.
#[test]
fn quantised_tensors_in_a_gguf_read_back_exactly() {
    let d = tempfile::tempdir().unwrap();
    let p = d.path().join("q.gguf");
    let fx = fixtures();
    let mut w = GgufWriter::new();
    for f in &fx {
        let (qk, _) = f.ty.block();
        // Two blocks per row: ne = [2·qk, blocks / 2].
        let n = f.labels.len() as u64 / 2 * 2;
        let bytes = f.blocks[..(n * f.ty.block().1) as usize].to_vec();
        w.raw_tensor(f.ty.name(), f.ty.id(), vec![2 * qk, n / 2], bytes);
    }
    w.write(&p).unwrap();
    let g = GgufFile::open(&p).unwrap();
    for f in &fx {
        let info = g.tensor(f.ty.name()).unwrap();
        assert_eq!(info.ggml_type, f.ty);
        let t = g.read_tensor(info).unwrap();
        let qk = f.ty.block().0 as usize;
        assert_eq!(t.shape(), &[f.labels.len() / 2, 2 * qk]);
        assert_eq!(t.dtype(), touchstone::tensor::DType::F32);
        let (count, shown) = mismatches(
            &Fixture {
                values: f.values[..t.numel()].to_vec(),
                labels: f.labels.clone(),
                blocks: Vec::new(),
                ty: f.ty,
            },
            t.data(),
            5,
        );
        assert_eq!(count, 0, "{}", shown.join("\n"));
    }
}
