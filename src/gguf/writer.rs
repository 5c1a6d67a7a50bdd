//! A small GGUF writer, for tests and fixtures: metadata and tensors (F32,
//! F16, BF16, Q8_0, or raw bytes of any type id), laid out with the alignment
//! `general.alignment` asks for (default 32). `crate::model::gguf::model_writer`
//! turns an HF-named model into a GGUF with it.

use std::path::Path;

use half::{bf16, f16};

use super::{GgmlType, Value, DEFAULT_ALIGNMENT, MAGIC};

#[derive(Clone, Debug)]
pub struct RawTensor {
    pub name: String,
    pub type_id: u32,
    /// GGUF order (fastest-varying first).
    pub ne: Vec<u64>,
    pub bytes: Vec<u8>,
}

#[derive(Clone, Debug)]
pub struct GgufWriter {
    pub version: u32,
    pub metadata: Vec<(String, Value)>,
    pub tensors: Vec<RawTensor>,
}

impl Default for GgufWriter {
    fn default() -> Self {
        GgufWriter {
            version: 3,
            metadata: Vec::new(),
            tensors: Vec::new(),
        }
    }
}

impl GgufWriter {
    pub fn new() -> GgufWriter {
        GgufWriter::default()
    }

    pub fn kv(&mut self, key: &str, v: Value) -> &mut Self {
        self.metadata.retain(|(k, _)| k != key);
        self.metadata.push((key.to_string(), v));
        self
    }

    pub fn raw_tensor(&mut self, name: &str, type_id: u32, ne: Vec<u64>, bytes: Vec<u8>) -> &mut Self {
        self.tensors.push(RawTensor {
            name: name.to_string(),
            type_id,
            ne,
            bytes,
        });
        self
    }

    /// A tensor of row-major `shape`, encoded as `ty` (F32, F16, BF16 or Q8_0;
    /// Q8_0 rounds to 8 bits). Panics on other types: this is a test aid.
    pub fn tensor(&mut self, name: &str, ty: GgmlType, shape: &[usize], data: &[f32]) -> &mut Self {
        assert_eq!(shape.iter().product::<usize>(), data.len(), "tensor `{name}`");
        let bytes: Vec<u8> = match ty {
            GgmlType::F32 => data.iter().flat_map(|x| x.to_le_bytes()).collect(),
            GgmlType::F16 => data.iter().flat_map(|x| f16::from_f32(*x).to_le_bytes()).collect(),
            GgmlType::BF16 => data.iter().flat_map(|x| bf16::from_f32(*x).to_le_bytes()).collect(),
            GgmlType::Q8_0 => quantize_q8_0(data),
            // A test aid: other types are written from their bytes.
            other => panic!(
                "the writer encodes F32, F16, BF16 and Q8_0, not {}: use raw_tensor",
                other.name()
            ),
        };
        let ne = shape.iter().rev().map(|&n| n as u64).collect();
        self.raw_tensor(name, ty.id(), ne, bytes)
    }

    fn alignment(&self) -> u64 {
        self.metadata
            .iter()
            .find(|(k, _)| k == "general.alignment")
            .and_then(|(_, v)| v.as_u64())
            .filter(|a| a.is_power_of_two())
            .unwrap_or(DEFAULT_ALIGNMENT)
    }

    pub fn to_bytes(&self) -> Vec<u8> {
        let align = self.alignment() as usize;
        let mut out = Vec::new();
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&self.version.to_le_bytes());
        out.extend_from_slice(&(self.tensors.len() as u64).to_le_bytes());
        out.extend_from_slice(&(self.metadata.len() as u64).to_le_bytes());
        for (k, v) in &self.metadata {
            put_str(&mut out, k);
            out.extend_from_slice(&(v.value_type() as u32).to_le_bytes());
            put_value(&mut out, v);
        }
        let mut offset = 0usize;
        let mut offsets = Vec::new();
        for t in &self.tensors {
            put_str(&mut out, &t.name);
            out.extend_from_slice(&(t.ne.len() as u32).to_le_bytes());
            for n in &t.ne {
                out.extend_from_slice(&n.to_le_bytes());
            }
            out.extend_from_slice(&t.type_id.to_le_bytes());
            out.extend_from_slice(&(offset as u64).to_le_bytes());
            offsets.push(offset);
            offset = (offset + t.bytes.len()).next_multiple_of(align);
        }
        let data_start = out.len().next_multiple_of(align);
        out.resize(data_start, 0);
        for (t, off) in self.tensors.iter().zip(offsets) {
            out.resize(data_start + off, 0);
            out.extend_from_slice(&t.bytes);
        }
        out
    }

    pub fn write(&self, path: &Path) -> std::io::Result<()> {
        std::fs::write(path, self.to_bytes())
    }
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u64).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

fn put_value(out: &mut Vec<u8>, v: &Value) {
    match v {
        Value::U8(x) => out.push(*x),
        Value::I8(x) => out.push(*x as u8),
        Value::U16(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::I16(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::U32(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::I32(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::F32(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::Bool(x) => out.push(*x as u8),
        Value::String(s) => put_str(out, s),
        Value::Array(t, items) => {
            out.extend_from_slice(&(*t as u32).to_le_bytes());
            out.extend_from_slice(&(items.len() as u64).to_le_bytes());
            for i in items {
                put_value(out, i);
            }
        }
        Value::U64(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::I64(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::F64(x) => out.extend_from_slice(&x.to_le_bytes()),
    }
}

/// Q8_0 as ggml quantises it: d = max|x| / 127 per block of 32, q = round(x / d).
pub fn quantize_q8_0(data: &[f32]) -> Vec<u8> {
    assert!(data.len().is_multiple_of(32), "Q8_0 needs a multiple of 32 values");
    let mut out = Vec::with_capacity(data.len() / 32 * 34);
    for block in data.chunks_exact(32) {
        let amax = block.iter().fold(0f32, |m, x| m.max(x.abs()));
        let d = amax / 127.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        out.extend_from_slice(&f16::from_f32(d).to_le_bytes());
        out.extend(block.iter().map(|x| (x * id).round() as i8 as u8));
    }
    out
}
