//! GGUF (v2 and v3), the llama.cpp model format: a header, typed metadata, a
//! tensor table and aligned tensor data, all little-endian.
//!
//! Why our own reader and not a crate: of the crates on crates.io, `ggus` (0.5)
//! pre-allocates maps from the header's counts (`with_capacity(kv_count)`), so a
//! corrupt count is a huge allocation rather than an error, and `gguf` (0.1.2)
//! is a small, unmaintained nom utility; `gguf-rs-lib` (0.3) is large (async,
//! writer, serde) for a reader. None of them reports errors naming the file and
//! the tensor or key the way every other loader here does. The format is small:
//! this reader bounds every length by the bytes left in the file (a truncated or
//! corrupt file is an error, never a panic or a huge allocation) and checks
//! every tensor's data range, alignment and overlap before anything is read.
//!
//! - [`GgufFile::open`] maps and validates a file; [`GgufFile::read_tensor`]
//!   widens a tensor to f32 (F32, F16, BF16, Q8_0 dequantised).
//! - [`model`] turns a file into a [`ModelConfig`](crate::model::ModelConfig)
//!   and HF-named [`Weights`](crate::model::Weights), undoing llama.cpp's Q/K
//!   row permutation for Llama.
//! - [`writer`] writes small GGUF files (tests and fixtures).

pub mod inspect;
pub mod model;
mod reader;
#[cfg(test)]
mod tests;
pub mod writer;

use std::fmt;
use std::fs::File;
use std::path::{Path, PathBuf};

use half::{bf16, f16};

use crate::error::{Error, Result};
use crate::tensor::{DType, Tensor};

pub const MAGIC: &[u8; 4] = b"GGUF";
pub const SUPPORTED_VERSIONS: [u32; 2] = [2, 3];
pub const DEFAULT_ALIGNMENT: u64 = 32;

/// Metadata value types (the `gguf_type` enum).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ValueType {
    U8 = 0,
    I8 = 1,
    U16 = 2,
    I16 = 3,
    U32 = 4,
    I32 = 5,
    F32 = 6,
    Bool = 7,
    String = 8,
    Array = 9,
    U64 = 10,
    I64 = 11,
    F64 = 12,
}

impl ValueType {
    pub fn from_id(id: u32) -> Option<ValueType> {
        use ValueType::*;
        Some(match id {
            0 => U8,
            1 => I8,
            2 => U16,
            3 => I16,
            4 => U32,
            5 => I32,
            6 => F32,
            7 => Bool,
            8 => String,
            9 => Array,
            10 => U64,
            11 => I64,
            12 => F64,
            _ => return None,
        })
    }
    pub fn name(self) -> &'static str {
        use ValueType::*;
        match self {
            U8 => "u8",
            I8 => "i8",
            U16 => "u16",
            I16 => "i16",
            U32 => "u32",
            I32 => "i32",
            F32 => "f32",
            Bool => "bool",
            String => "string",
            Array => "array",
            U64 => "u64",
            I64 => "i64",
            F64 => "f64",
        }
    }
    /// The fewest bytes one value of this type occupies (fixed size, or a
    /// string's / array's length prefix): bounds element counts by the bytes left.
    pub(crate) fn min_size(self) -> u64 {
        use ValueType::*;
        match self {
            U8 | I8 | Bool => 1,
            U16 | I16 => 2,
            U32 | I32 | F32 => 4,
            U64 | I64 | F64 | String => 8,
            Array => 12,
        }
    }
}

/// One metadata value.
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    String(String),
    /// Element type and elements.
    Array(ValueType, Vec<Value>),
    U64(u64),
    I64(i64),
    F64(f64),
}

impl Value {
    pub fn value_type(&self) -> ValueType {
        match self {
            Value::U8(_) => ValueType::U8,
            Value::I8(_) => ValueType::I8,
            Value::U16(_) => ValueType::U16,
            Value::I16(_) => ValueType::I16,
            Value::U32(_) => ValueType::U32,
            Value::I32(_) => ValueType::I32,
            Value::F32(_) => ValueType::F32,
            Value::Bool(_) => ValueType::Bool,
            Value::String(_) => ValueType::String,
            Value::Array(..) => ValueType::Array,
            Value::U64(_) => ValueType::U64,
            Value::I64(_) => ValueType::I64,
            Value::F64(_) => ValueType::F64,
        }
    }
    /// A non-negative integer of any integer type.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Value::U8(v) => Some(v.into()),
            Value::U16(v) => Some(v.into()),
            Value::U32(v) => Some(v.into()),
            Value::U64(v) => Some(v),
            Value::I8(v) => u64::try_from(v).ok(),
            Value::I16(v) => u64::try_from(v).ok(),
            Value::I32(v) => u64::try_from(v).ok(),
            Value::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }
    /// A number of any numeric type.
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Value::F32(v) => Some(v.into()),
            Value::F64(v) => Some(v),
            Value::I8(v) => Some(v.into()),
            Value::I16(v) => Some(v.into()),
            Value::I32(v) => Some(v.into()),
            Value::I64(v) => Some(v as f64),
            _ => self.as_u64().map(|v| v as f64),
        }
    }
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::String(s) => Some(s),
            _ => None,
        }
    }
    pub fn as_array(&self) -> Option<(ValueType, &[Value])> {
        match self {
            Value::Array(t, v) => Some((*t, v)),
            _ => None,
        }
    }
    /// `u32`, `string`, `array<string>`, ...
    pub fn type_name(&self) -> String {
        match self {
            Value::Array(t, _) => format!("array<{}>", t.name()),
            other => other.value_type().name().to_string(),
        }
    }
    /// A one-line rendering: strings quoted and cut at `max_chars`, arrays as
    /// `[len N] first, items, ...`.
    pub fn summary(&self, max_items: usize, max_chars: usize) -> String {
        match self {
            Value::String(s) => {
                let cut: String = s.chars().take(max_chars).collect();
                let more = if cut.len() < s.len() { "..." } else { "" };
                format!("{cut:?}{more}")
            }
            Value::Array(_, items) => {
                let shown: Vec<String> = items
                    .iter()
                    .take(max_items)
                    .map(|v| v.summary(max_items, max_chars.min(24)))
                    .collect();
                let more = if items.len() > max_items { ", ..." } else { "" };
                format!("[len {}] {}{more}", items.len(), shown.join(", "))
            }
            other => other.to_string(),
        }
    }
}

impl fmt::Display for Value {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Value::U8(v) => write!(f, "{v}"),
            Value::I8(v) => write!(f, "{v}"),
            Value::U16(v) => write!(f, "{v}"),
            Value::I16(v) => write!(f, "{v}"),
            Value::U32(v) => write!(f, "{v}"),
            Value::I32(v) => write!(f, "{v}"),
            Value::F32(v) => write!(f, "{v:e}"),
            Value::Bool(v) => write!(f, "{v}"),
            Value::String(s) => write!(f, "{s:?}"),
            Value::Array(..) => f.write_str(&self.summary(8, 64)),
            Value::U64(v) => write!(f, "{v}"),
            Value::I64(v) => write!(f, "{v}"),
            Value::F64(v) => write!(f, "{v:e}"),
        }
    }
}

/// The tensor data types this reader accepts (`ggml_type` ids).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GgmlType {
    F32,
    F16,
    BF16,
    /// Blocks of 32: an f16 scale then 32 i8 quants (34 bytes); dequantised to f32.
    Q8_0,
}

impl GgmlType {
    pub const F32_ID: u32 = 0;
    pub const F16_ID: u32 = 1;
    pub const Q8_0_ID: u32 = 8;
    pub const BF16_ID: u32 = 30;

    pub fn from_id(id: u32) -> Option<GgmlType> {
        match id {
            Self::F32_ID => Some(GgmlType::F32),
            Self::F16_ID => Some(GgmlType::F16),
            Self::Q8_0_ID => Some(GgmlType::Q8_0),
            Self::BF16_ID => Some(GgmlType::BF16),
            _ => None,
        }
    }
    pub fn id(self) -> u32 {
        match self {
            GgmlType::F32 => Self::F32_ID,
            GgmlType::F16 => Self::F16_ID,
            GgmlType::Q8_0 => Self::Q8_0_ID,
            GgmlType::BF16 => Self::BF16_ID,
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            GgmlType::F32 => "F32",
            GgmlType::F16 => "F16",
            GgmlType::BF16 => "BF16",
            GgmlType::Q8_0 => "Q8_0",
        }
    }
    /// (elements per block, bytes per block).
    pub fn block(self) -> (u64, u64) {
        match self {
            GgmlType::F32 => (1, 4),
            GgmlType::F16 | GgmlType::BF16 => (1, 2),
            GgmlType::Q8_0 => (32, 34),
        }
    }
    /// The storage precision a loaded tensor reports. Q8_0 values are exact in
    /// f32 once dequantised (an f16 scale times an i8), so they report f32.
    pub fn dtype(self) -> DType {
        match self {
            GgmlType::F32 | GgmlType::Q8_0 => DType::F32,
            GgmlType::F16 => DType::F16,
            GgmlType::BF16 => DType::BF16,
        }
    }
}

/// The names of `ggml_type` ids, for messages about unsupported types.
pub fn ggml_type_name(id: u32) -> Option<&'static str> {
    const NAMES: [(u32, &str); 37] = [
        (0, "F32"),
        (1, "F16"),
        (2, "Q4_0"),
        (3, "Q4_1"),
        (6, "Q5_0"),
        (7, "Q5_1"),
        (8, "Q8_0"),
        (9, "Q8_1"),
        (10, "Q2_K"),
        (11, "Q3_K"),
        (12, "Q4_K"),
        (13, "Q5_K"),
        (14, "Q6_K"),
        (15, "Q8_K"),
        (16, "IQ2_XXS"),
        (17, "IQ2_XS"),
        (18, "IQ3_XXS"),
        (19, "IQ1_S"),
        (20, "IQ4_NL"),
        (21, "IQ3_S"),
        (22, "IQ2_S"),
        (23, "IQ4_XS"),
        (24, "I8"),
        (25, "I16"),
        (26, "I32"),
        (27, "I64"),
        (28, "F64"),
        (29, "IQ1_M"),
        (30, "BF16"),
        (34, "TQ1_0"),
        (35, "TQ2_0"),
        (39, "MXFP4"),
        (40, "NVFP4"),
        (41, "Q1_0"),
        (42, "Q2_0"),
        (31, "Q4_0_4_4"),
        (32, "Q4_0_4_8"),
    ];
    NAMES.iter().find(|(i, _)| *i == id).map(|(_, n)| *n)
}

/// One entry of the tensor table.
#[derive(Clone, Debug, PartialEq)]
pub struct TensorInfo {
    pub name: String,
    /// GGUF dimensions, fastest-varying first (`ne[0]` is the row length).
    pub ne: Vec<u64>,
    pub ggml_type: GgmlType,
    /// Offset from the start of the data section (a multiple of the alignment).
    pub offset: u64,
    /// Bytes of data.
    pub size: u64,
}

impl TensorInfo {
    /// The row-major (numpy / HF) shape: `ne` reversed.
    pub fn shape(&self) -> Vec<usize> {
        self.ne.iter().rev().map(|&n| n as usize).collect()
    }
    pub fn numel(&self) -> u64 {
        self.ne.iter().product()
    }
}

/// A validated GGUF file, mapped.
pub struct GgufFile {
    pub path: PathBuf,
    pub version: u32,
    pub alignment: u64,
    /// Metadata in file order.
    pub metadata: Vec<(String, Value)>,
    /// The tensor table in file order.
    pub tensors: Vec<TensorInfo>,
    /// Absolute file offset of the data section.
    pub data_offset: u64,
    map: memmap2::Mmap,
}

impl fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GgufFile")
            .field("path", &self.path)
            .field("version", &self.version)
            .field("metadata", &self.metadata.len())
            .field("tensors", &self.tensors.len())
            .finish()
    }
}

impl GgufFile {
    /// Maps and validates `path`: header, metadata, tensor table, every tensor's
    /// data range. Errors name the file and the key or tensor at fault.
    pub fn open(path: &Path) -> Result<GgufFile> {
        let file = File::open(path).map_err(|e| Error::io(path, e))?;
        let len = file.metadata().map_err(|e| Error::io(path, e))?.len();
        if len == 0 {
            return Err(Error::tensor_file(path, "empty file (not a GGUF file)"));
        }
        // SAFETY: read-only map; a concurrent writer truncating the file is
        // outside our contract (as for safetensors in tensor_io).
        let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| Error::io(path, e))?;
        let parsed = reader::parse(&map).map_err(|msg| Error::tensor_file(path, msg))?;
        Ok(GgufFile {
            path: path.to_path_buf(),
            version: parsed.version,
            alignment: parsed.alignment,
            metadata: parsed.metadata,
            tensors: parsed.tensors,
            data_offset: parsed.data_offset,
            map,
        })
    }

    /// Only the metadata of `path` (header and key/values; the tensor table is
    /// not read, so any tensor type is fine): the tokenizer needs no more.
    pub fn read_metadata(path: &Path) -> Result<Vec<(String, Value)>> {
        let file = File::open(path).map_err(|e| Error::io(path, e))?;
        // SAFETY: read-only map, as in `open`.
        let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| Error::io(path, e))?;
        let (_, metadata) = reader::parse_metadata(&map).map_err(|msg| Error::tensor_file(path, msg))?;
        Ok(metadata)
    }

    pub fn get(&self, key: &str) -> Option<&Value> {
        self.metadata.iter().find(|(k, _)| k == key).map(|(_, v)| v)
    }

    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensors.iter().find(|t| t.name == name)
    }

    /// The raw bytes of a tensor (its range was checked by `open`).
    pub fn tensor_bytes(&self, info: &TensorInfo) -> &[u8] {
        let start = (self.data_offset + info.offset) as usize;
        &self.map[start..start + info.size as usize]
    }

    /// Reads a tensor widened to f32, shaped row-major (`ne` reversed).
    pub fn read_tensor(&self, info: &TensorInfo) -> Result<Tensor> {
        let b = self.tensor_bytes(info);
        let data: Vec<f32> = match info.ggml_type {
            GgmlType::F32 => b
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
            GgmlType::F16 => b
                .chunks_exact(2)
                .map(|c| f16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
            GgmlType::BF16 => b
                .chunks_exact(2)
                .map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
            GgmlType::Q8_0 => dequantize_q8_0(b),
        };
        let shape = info.shape();
        if data.len() != shape.iter().product::<usize>() {
            // `open` checked sizes; this guards the invariant without a panic.
            return Err(Error::tensor_file(
                &self.path,
                format!(
                    "tensor `{}`: {} bytes of {} hold {} values, its shape {shape:?} needs {}",
                    info.name,
                    b.len(),
                    info.ggml_type.name(),
                    data.len(),
                    shape.iter().product::<usize>()
                ),
            ));
        }
        Ok(Tensor::new(shape, data).with_dtype(info.ggml_type.dtype()))
    }
}

/// Q8_0: per block of 32 values, an f16 scale `d` then 32 i8 `q`; value = d·q.
pub fn dequantize_q8_0(bytes: &[u8]) -> Vec<f32> {
    let mut out = Vec::with_capacity(bytes.len() / 34 * 32);
    for block in bytes.chunks_exact(34) {
        let d = f16::from_le_bytes([block[0], block[1]]).to_f32();
        out.extend(block[2..].iter().map(|&q| d * (q as i8) as f32));
    }
    out
}

/// Whether `path` names a GGUF file (by extension).
pub fn is_gguf_path(path: &Path) -> bool {
    path.extension().is_some_and(|e| e.eq_ignore_ascii_case("gguf"))
}
