//! GGUF reader and model-mapping tests on files written by `writer` into a
//! temporary folder: round trips per dtype, every integrity check, truncation at
//! every byte, every quant type's row size and id. (The model mapping's tests
//! are `model::gguf`'s.)

use std::path::{Path, PathBuf};

use super::writer::GgufWriter;
use super::*;

fn small() -> GgufWriter {
    let mut w = GgufWriter::new();
    w.kv("general.architecture", Value::String("llama".into()))
        .kv("some.u8", Value::U8(7))
        .kv("some.i64", Value::I64(-3))
        .kv("some.bool", Value::Bool(true))
        .kv("some.f64", Value::F64(0.25))
        .kv(
            "some.array",
            Value::Array(ValueType::U32, (0..20).map(Value::U32).collect()),
        )
        .kv(
            "some.nested",
            Value::Array(
                ValueType::Array,
                vec![Value::Array(ValueType::String, vec![Value::String("x".into())])],
            ),
        );
    let vals: Vec<f32> = (0..64).map(|i| i as f32 * 0.125 - 3.0).collect();
    w.tensor("a", GgmlType::F32, &[4, 16], &vals)
        .tensor("b", GgmlType::F16, &[64], &vals)
        .tensor("c", GgmlType::BF16, &[2, 2, 16], &vals)
        .tensor("d", GgmlType::Q8_0, &[2, 32], &vals);
    w
}

fn write(dir: &Path, name: &str, bytes: &[u8]) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, bytes).unwrap();
    p
}

fn open_err(bytes: &[u8]) -> String {
    let d = tempfile::tempdir().unwrap();
    let p = write(d.path(), "m.gguf", bytes);
    let e = GgufFile::open(&p).expect_err("must be rejected");
    assert!(matches!(e, Error::TensorFile { .. }), "{e:?}");
    let msg = e.to_string();
    assert!(msg.contains(&p.display().to_string()), "{msg}");
    msg
}

#[test]
fn round_trip_of_every_dtype_and_value_type() {
    let d = tempfile::tempdir().unwrap();
    for version in [2, 3] {
        let mut w = small();
        w.version = version;
        let p = write(d.path(), "m.gguf", &w.to_bytes());
        let f = GgufFile::open(&p).unwrap();
        assert_eq!(f.version, version);
        assert_eq!(f.alignment, 32);
        assert_eq!(f.metadata, w.metadata);
        assert_eq!(f.get("some.i64").and_then(Value::as_f64), Some(-3.0));
        assert_eq!(f.get("some.array").unwrap().summary(3, 10), "[len 20] 0, 1, 2, ...");
        let vals: Vec<f32> = (0..64).map(|i| i as f32 * 0.125 - 3.0).collect();
        let a = f.read_tensor(f.tensor("a").unwrap()).unwrap();
        assert_eq!((a.shape(), a.dtype(), a.data()), (&[4, 16][..], DType::F32, &vals[..]));
        assert_eq!(f.tensor("a").unwrap().ne, vec![16, 4]);
        let b = f.read_tensor(f.tensor("b").unwrap()).unwrap();
        assert_eq!((b.dtype(), b.data()), (DType::F16, &vals[..])); // exact in f16
        let c = f.read_tensor(f.tensor("c").unwrap()).unwrap();
        assert_eq!(
            (c.shape(), c.dtype(), c.data()),
            (&[2, 2, 16][..], DType::BF16, &vals[..])
        );
        let q = f.read_tensor(f.tensor("d").unwrap()).unwrap();
        assert_eq!(q.shape(), &[2, 32]);
        for (x, y) in q.data().iter().zip(&vals) {
            assert!((x - y).abs() <= 3.0 / 127.0, "{x} vs {y}");
        }
        for t in &f.tensors {
            assert_eq!(t.offset % 32, 0);
        }
    }
}

#[test]
fn custom_alignment_is_honoured_and_must_be_a_power_of_two() {
    let d = tempfile::tempdir().unwrap();
    let mut w = small();
    w.kv("general.alignment", Value::U32(64));
    let p = write(d.path(), "m.gguf", &w.to_bytes());
    let f = GgufFile::open(&p).unwrap();
    assert_eq!((f.alignment, f.data_offset % 64), (64, 0));
    assert!(f.tensors.iter().all(|t| t.offset % 64 == 0));

    let mut w = small();
    w.kv("general.alignment", Value::U32(48));
    let msg = open_err(&w.to_bytes());
    assert!(
        msg.contains("general.alignment") && msg.contains("power of two"),
        "{msg}"
    );
    let mut w = small();
    w.kv("general.alignment", Value::String("32".into()));
    assert!(open_err(&w.to_bytes()).contains("general.alignment"));
}

#[test]
fn magic_and_version_are_checked() {
    let mut b = small().to_bytes();
    b[..4].copy_from_slice(b"GGML");
    assert!(open_err(&b).contains("not a GGUF file"));
    for v in [1u32, 4] {
        let mut b = small().to_bytes();
        b[4..8].copy_from_slice(&v.to_le_bytes());
        let msg = open_err(&b);
        assert!(msg.contains(&format!("GGUF version {v} is not supported")), "{msg}");
    }
    let d = tempfile::tempdir().unwrap();
    let p = write(d.path(), "empty.gguf", b"");
    assert!(GgufFile::open(&p).unwrap_err().to_string().contains("empty file"));
}

#[test]
fn every_truncation_is_an_error_not_a_panic() {
    let b = small().to_bytes();
    let d = tempfile::tempdir().unwrap();
    let p = d.path().join("t.gguf");
    for n in 1..b.len() {
        std::fs::write(&p, &b[..n]).unwrap();
        let e = GgufFile::open(&p).expect_err(&format!("a file cut at {n} of {} bytes must be rejected", b.len()));
        let msg = e.to_string();
        assert!(
            msg.contains("truncated") || msg.contains("past the end"),
            "cut at {n}: {msg}"
        );
    }
}

#[test]
fn huge_lengths_are_bounded_by_the_file() {
    // The first key's length claims far more bytes than the file has.
    let mut b = small().to_bytes();
    b[24..32].copy_from_slice(&u64::MAX.to_le_bytes());
    assert!(open_err(&b).contains("truncated"));
    // A metadata count no file could hold.
    let mut b = small().to_bytes();
    b[16..24].copy_from_slice(&(u64::MAX / 2).to_le_bytes());
    assert!(open_err(&b).contains("metadata entries"));
    // A tensor count no file could hold.
    let mut b = small().to_bytes();
    b[8..16].copy_from_slice(&(1u64 << 40).to_le_bytes());
    assert!(open_err(&b).contains("tensors"));
    // An array claiming 2^60 elements.
    let mut w = GgufWriter::new();
    w.kv("arr", Value::Array(ValueType::U64, vec![Value::U64(1)]));
    let mut b = w.to_bytes();
    let at = 24 + 8 + 3 + 4 + 4; // header, key, type, element type
    b[at..at + 8].copy_from_slice(&(1u64 << 60).to_le_bytes());
    let msg = open_err(&b);
    assert!(msg.contains("`arr`") && msg.contains("truncated"), "{msg}");
}

#[test]
fn bad_value_types_and_duplicates_are_named() {
    let mut w = GgufWriter::new();
    w.kv("k", Value::U8(1));
    let mut b = w.to_bytes();
    b[24 + 8 + 1..24 + 8 + 1 + 4].copy_from_slice(&13u32.to_le_bytes());
    let msg = open_err(&b);
    assert!(
        msg.contains("metadata key `k`") && msg.contains("value type id 13"),
        "{msg}"
    );

    let mut w = GgufWriter::new();
    w.kv("k", Value::Bool(true));
    let mut b = w.to_bytes();
    b[24 + 8 + 1 + 4] = 2; // header, key, type, then the bool
    let msg = open_err(&b);
    assert!(msg.contains("`k`") && msg.contains("bool value is 2"), "{msg}");

    let mut w = GgufWriter::new();
    w.metadata.push(("k".into(), Value::U8(1)));
    w.metadata.push(("k".into(), Value::U8(2)));
    assert!(open_err(&w.to_bytes()).contains("`k` appears more than once"));
}

#[test]
fn tensor_ranges_are_checked() {
    // Offset past the end.
    let mut w = small();
    w.tensors.pop();
    let mut b = w.to_bytes();
    let cut = b.len() - 10;
    b.truncate(cut);
    let msg = open_err(&b);
    assert!(msg.contains("tensor `c`") && msg.contains("past the end"), "{msg}");

    // Misaligned and overlapping offsets: patch the offset fields.
    let offset_field = |b: &[u8], name: &str| -> usize {
        let needle = [&(name.len() as u64).to_le_bytes()[..], name.as_bytes()].concat();
        let at = b.windows(needle.len()).position(|w| w == needle).unwrap() + needle.len();
        let n_dims = u32::from_le_bytes(b[at..at + 4].try_into().unwrap()) as usize;
        at + 4 + 8 * n_dims + 4
    };
    let b0 = small().to_bytes();
    let mut b = b0.clone();
    let at = offset_field(&b, "b");
    let off = u64::from_le_bytes(b[at..at + 8].try_into().unwrap());
    b[at..at + 8].copy_from_slice(&(off + 4).to_le_bytes());
    let msg = open_err(&b);
    assert!(msg.contains("tensor `b`") && msg.contains("alignment 32"), "{msg}");
    let mut b = b0.clone();
    b[at..at + 8].copy_from_slice(&0u64.to_le_bytes());
    let msg = open_err(&b);
    assert!(
        msg.contains("overlap") && msg.contains("`a`") && msg.contains("`b`"),
        "{msg}"
    );
    let mut b = b0;
    b[at..at + 8].copy_from_slice(&(u64::MAX - 31).to_le_bytes());
    assert!(open_err(&b).contains("past the end"));
}

#[test]
fn every_type_has_one_row_and_its_id() {
    let all: Vec<GgmlType> = GgmlType::all().collect();
    assert_eq!(all.len(), 38);
    for (i, t) in all.iter().enumerate() {
        assert_eq!(GgmlType::from_id(t.id()), Some(*t));
        assert_eq!(ggml_type_name(t.id()), Some(t.name()));
        // The name is the variant's own (no fallback row was used).
        assert_eq!(t.name(), format!("{t:?}"));
        assert!(all[..i].iter().all(|u| u.id() < t.id()), "id order");
        let (qk, bytes) = t.block();
        assert!(qk > 0 && bytes > 0, "{t:?}");
    }
    let ids: Vec<u32> = (0..=64).filter(|&i| GgmlType::from_id(i).is_some()).collect();
    assert_eq!(ids.len(), 38);
    assert_eq!(known_type_ids(), "0..=3, 6..=35, 39..=42");
    assert_eq!(
        quant::readable_names(),
        "F32, F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, BF16"
    );
    // ggml's sizes for the types the real models use (ggml-common.h).
    assert_eq!(GgmlType::Q4_K.block(), (256, 144));
    assert_eq!(GgmlType::Q5_0.block(), (32, 22));
    assert_eq!(GgmlType::Q6_K.block(), (256, 210));
    assert_eq!(GgmlType::IQ2_XS.block(), (256, 74));
}

#[test]
fn every_known_type_opens_and_only_reading_needs_a_dequantiser() {
    let mut w = small();
    for ty in GgmlType::all() {
        let (qk, bytes) = ty.block();
        w.raw_tensor(
            &format!("t.{}", ty.name()),
            ty.id(),
            vec![2 * qk, 3],
            vec![0; 6 * bytes as usize],
        );
    }
    let d = tempfile::tempdir().unwrap();
    let p = write(d.path(), "all.gguf", &w.to_bytes());
    let f = GgufFile::open(&p).unwrap();
    for ty in GgmlType::all() {
        let info = f.tensor(&format!("t.{}", ty.name())).unwrap();
        assert_eq!((info.ggml_type, info.size), (ty, 6 * ty.block().1));
        match f.read_tensor(info) {
            Ok(t) => {
                assert!(ty.readable(), "{ty:?}");
                assert_eq!(t.shape(), &[3, 2 * ty.block().0 as usize]);
                assert!(t.data().iter().all(|&x| x == 0.0), "{ty:?}: zero blocks are zeros");
            }
            Err(e) => {
                assert!(!ty.readable(), "{ty:?}: {e}");
                let msg = e.to_string();
                assert!(
                    msg.contains(&p.display().to_string())
                        && msg.contains(&format!("tensor `t.{}` is of type {}", ty.name(), ty.name()))
                        && msg.contains("dequantisation exists for F32, F16, Q4_0"),
                    "{msg}"
                );
            }
        }
    }
}

#[test]
fn truncated_quantised_data_names_the_tensor() {
    // Two Q6_K blocks (420 bytes) as the last tensor: any cut into them is an
    // error naming it, never a short read.
    let mut w = small();
    w.raw_tensor("blk.0.ffn_down.weight", GgmlType::Q6_K.id(), vec![256, 2], vec![7; 420]);
    let b = w.to_bytes();
    let d = tempfile::tempdir().unwrap();
    let p = d.path().join("q.gguf");
    std::fs::write(&p, &b).unwrap();
    let f = GgufFile::open(&p).unwrap();
    let t = f.read_tensor(f.tensor("blk.0.ffn_down.weight").unwrap()).unwrap();
    assert_eq!(t.shape(), &[2, 256]);
    for cut in [1, 209, 210, 211, 419] {
        let msg = open_err(&b[..b.len() - cut]);
        assert!(
            msg.contains("tensor `blk.0.ffn_down.weight`") && msg.contains("past the end of the file"),
            "cut {cut}: {msg}"
        );
    }
}

#[test]
fn unknown_type_ids_and_bad_sizes_name_the_tensor() {
    for id in [4u32, 5, 36, 37, 38, 43, 999] {
        let mut w = small();
        w.raw_tensor("x", id, vec![4], vec![0; 16]);
        let msg = open_err(&w.to_bytes());
        assert!(
            msg.contains(&format!("tensor `x`: ggml type id {id} is not supported"))
                && msg.contains("known ids: 0..=3, 6..=35, 39..=42"),
            "{msg}"
        );
    }
    let mut w = small();
    w.raw_tensor("q", GgmlType::Q8_0_ID, vec![16], vec![0; 17]);
    assert!(open_err(&w.to_bytes()).contains("block size 32"));
    let mut w = small();
    w.raw_tensor("blk.0.ffn_up.weight", GgmlType::Q4_K.id(), vec![64, 2], vec![0; 144]);
    let msg = open_err(&w.to_bytes());
    assert!(
        msg.contains("tensor `blk.0.ffn_up.weight`") && msg.contains("not a multiple of the Q4_K block size 256"),
        "{msg}"
    );
    let mut w = small();
    w.raw_tensor("five", 0, vec![1, 1, 1, 1, 1], vec![0; 4]);
    assert!(open_err(&w.to_bytes()).contains("5 dimensions"));
}
