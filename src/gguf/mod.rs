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
//! - [`GgufFile::open`] maps and validates a file of any ggml tensor types
//!   (their block sizes locate the data); [`GgufFile::read_tensor`] widens a
//!   tensor to f32, dequantising the quantised types [`quant`] reads.
//! - [`model`] turns a file into a [`ModelConfig`](crate::model::ModelConfig)
//!   and HF-named [`Weights`](crate::model::Weights), undoing llama.cpp's Q/K
//!   row permutation for Llama.
//! - [`writer`] writes small GGUF files (tests and fixtures).

pub mod quant;
mod reader;
pub mod summary;
#[cfg(test)]
mod tests;
pub mod writer;

use std::fmt;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

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

/// The `ggml_type`s, with their ids as discriminants. The reader accepts every
/// one of them (their block sizes locate the data); [`quant::READABLE`] says
/// which can be read as f32. Names are ggml's own (hence the allow).
#[allow(non_camel_case_types)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum GgmlType {
    F32 = 0,
    F16 = 1,
    Q4_0 = 2,
    Q4_1 = 3,
    Q5_0 = 6,
    Q5_1 = 7,
    Q8_0 = 8,
    Q8_1 = 9,
    Q2_K = 10,
    Q3_K = 11,
    Q4_K = 12,
    Q5_K = 13,
    Q6_K = 14,
    Q8_K = 15,
    IQ2_XXS = 16,
    IQ2_XS = 17,
    IQ3_XXS = 18,
    IQ1_S = 19,
    IQ4_NL = 20,
    IQ3_S = 21,
    IQ2_S = 22,
    IQ4_XS = 23,
    I8 = 24,
    I16 = 25,
    I32 = 26,
    I64 = 27,
    F64 = 28,
    IQ1_M = 29,
    BF16 = 30,
    Q4_0_4_4 = 31,
    Q4_0_4_8 = 32,
    Q4_0_8_8 = 33,
    TQ1_0 = 34,
    TQ2_0 = 35,
    MXFP4 = 39,
    NVFP4 = 40,
    Q1_0 = 41,
    Q2_0 = 42,
}

/// Every type: (type, name, elements per block, bytes per block), in id order.
/// The sizes are ggml's `type_traits` (`blck_size`, `type_size`), as gguf-py
/// 0.19.0 lists them in `GGML_QUANT_SIZES`. `QK_K` = 256.
///
/// Q4_0_4_4 / Q4_0_4_8 / Q4_0_8_8 (31..=33) were Q4_0 blocks interleaved for
/// ARM; ggml has since removed them (its table now has block size 0 for
/// them, and llama.cpp refuses such files). They keep the layout they had
/// (`blck_size = QK4_0`, `type_size = sizeof(block_q4_0)`), so files from that
/// time still open and inspect; their data cannot be read.
const TYPES: [(GgmlType, &str, u64, u64); 38] = {
    use GgmlType::*;
    const QK_K: u64 = 256;
    [
        (F32, "F32", 1, 4),
        (F16, "F16", 1, 2),
        (Q4_0, "Q4_0", 32, 2 + 16),
        (Q4_1, "Q4_1", 32, 2 + 2 + 16),
        (Q5_0, "Q5_0", 32, 2 + 4 + 16),
        (Q5_1, "Q5_1", 32, 2 + 2 + 4 + 16),
        (Q8_0, "Q8_0", 32, 2 + 32),
        (Q8_1, "Q8_1", 32, 2 + 2 + 32),
        (Q2_K, "Q2_K", 256, 2 + 2 + QK_K / 16 + QK_K / 4),
        (Q3_K, "Q3_K", 256, 2 + QK_K / 4 + QK_K / 8 + 12),
        (Q4_K, "Q4_K", 256, 2 + 2 + QK_K / 2 + 12),
        (Q5_K, "Q5_K", 256, 2 + 2 + QK_K / 2 + QK_K / 8 + 12),
        (Q6_K, "Q6_K", 256, 2 + QK_K / 2 + QK_K / 4 + QK_K / 16),
        (Q8_K, "Q8_K", 256, 4 + QK_K + QK_K / 8),
        (IQ2_XXS, "IQ2_XXS", 256, 2 + QK_K / 4),
        (IQ2_XS, "IQ2_XS", 256, 2 + QK_K / 4 + QK_K / 32),
        (IQ3_XXS, "IQ3_XXS", 256, 2 + QK_K / 4 + QK_K / 8),
        (IQ1_S, "IQ1_S", 256, 2 + QK_K / 8 + QK_K / 16),
        (IQ4_NL, "IQ4_NL", 32, 2 + 16),
        (IQ3_S, "IQ3_S", 256, 2 + QK_K / 4 + QK_K / 8 + QK_K / 32 + 4),
        (IQ2_S, "IQ2_S", 256, 2 + QK_K / 4 + QK_K / 16),
        (IQ4_XS, "IQ4_XS", 256, 2 + 2 + QK_K / 2 + QK_K / 64),
        (I8, "I8", 1, 1),
        (I16, "I16", 1, 2),
        (I32, "I32", 1, 4),
        (I64, "I64", 1, 8),
        (F64, "F64", 1, 8),
        (IQ1_M, "IQ1_M", 256, QK_K / 8 + QK_K / 16 + QK_K / 32),
        (BF16, "BF16", 1, 2),
        (Q4_0_4_4, "Q4_0_4_4", 32, 2 + 16),
        (Q4_0_4_8, "Q4_0_4_8", 32, 2 + 16),
        (Q4_0_8_8, "Q4_0_8_8", 32, 2 + 16),
        (TQ1_0, "TQ1_0", 256, 2 + 4 * 13),
        (TQ2_0, "TQ2_0", 256, 2 + 64),
        (MXFP4, "MXFP4", 32, 1 + 16),
        (NVFP4, "NVFP4", 64, 4 + 32),
        (Q1_0, "Q1_0", 128, 2 + 16),
        (Q2_0, "Q2_0", 64, 2 + 16),
    ]
};

impl GgmlType {
    pub const F32_ID: u32 = 0;
    pub const F16_ID: u32 = 1;
    pub const Q8_0_ID: u32 = 8;
    pub const BF16_ID: u32 = 30;

    /// Every type, in id order.
    pub fn all() -> impl Iterator<Item = GgmlType> {
        TYPES.iter().map(|e| e.0)
    }
    pub fn from_id(id: u32) -> Option<GgmlType> {
        TYPES.iter().find(|e| e.0 as u32 == id).map(|e| e.0)
    }
    pub fn id(self) -> u32 {
        self as u32
    }
    fn entry(self) -> &'static (GgmlType, &'static str, u64, u64) {
        // Every variant has its row (the test `every_type_has_one_row` checks).
        TYPES.iter().find(|e| e.0 == self).unwrap_or(&TYPES[0])
    }
    pub fn name(self) -> &'static str {
        self.entry().1
    }
    /// (elements per block, bytes per block).
    pub fn block(self) -> (u64, u64) {
        (self.entry().2, self.entry().3)
    }
    /// Whether [`GgufFile::read_tensor`] can read this type (see [`quant`]).
    pub fn readable(self) -> bool {
        quant::READABLE.contains(&self)
    }
    /// The storage precision a loaded tensor reports. F16 and BF16 values stay
    /// exactly representable in their type. Dequantised values are f32: each is
    /// an f32 product (and difference) of f16 scales and small integers, which
    /// in general needs more mantissa than f16 or bf16 has (a Q4_K value
    /// `(d·sc)·q − dmin·m` is rounded to f32 twice), so tagging them f16 would
    /// claim a rounding the values never had. The quantisation error is a
    /// property of the weights, not a storage rounding the engine applies.
    pub fn dtype(self) -> DType {
        match self {
            GgmlType::F16 => DType::F16,
            GgmlType::BF16 => DType::BF16,
            _ => DType::F32,
        }
    }
}

/// The name of a `ggml_type` id, if ggml has (or had) that id.
pub fn ggml_type_name(id: u32) -> Option<&'static str> {
    GgmlType::from_id(id).map(GgmlType::name)
}

/// The known `ggml_type` ids as ranges, `0..=3, 6..=35, 39..=42`.
pub fn known_type_ids() -> String {
    let mut ranges: Vec<(u32, u32)> = Vec::new();
    for id in GgmlType::all().map(GgmlType::id) {
        match ranges.last_mut() {
            Some((_, hi)) if *hi + 1 == id => *hi = id,
            _ => ranges.push((id, id)),
        }
    }
    let r: Vec<String> = ranges.iter().map(|(lo, hi)| format!("{lo}..={hi}")).collect();
    r.join(", ")
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
    /// Shared with the f32 tensors read in place from it (`read_tensor`).
    map: Arc<memmap2::Mmap>,
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
        Self::from_map(path, map)
    }

    /// A GGUF file's bytes already in memory (fuzzing, tests); `path` names it
    /// in errors. The bytes are copied into an anonymous map.
    pub fn from_bytes(path: &Path, bytes: &[u8]) -> Result<GgufFile> {
        if bytes.is_empty() {
            return Err(Error::tensor_file(path, "empty file (not a GGUF file)"));
        }
        let mut m = memmap2::MmapMut::map_anon(bytes.len()).map_err(|e| Error::io(path, e))?;
        m.copy_from_slice(bytes);
        let map = m.make_read_only().map_err(|e| Error::io(path, e))?;
        Self::from_map(path, map)
    }

    fn from_map(path: &Path, map: memmap2::Mmap) -> Result<GgufFile> {
        let parsed = reader::parse(&map).map_err(|msg| Error::tensor_file(path, msg))?;
        Ok(GgufFile {
            path: path.to_path_buf(),
            version: parsed.version,
            alignment: parsed.alignment,
            metadata: parsed.metadata,
            tensors: parsed.tensors,
            data_offset: parsed.data_offset,
            map: Arc::new(map),
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

    /// Reads a tensor widened to f32 (dequantised for the quantised types),
    /// shaped row-major (`ne` reversed). A type outside [`quant::READABLE`]
    /// is an error naming the tensor and its type.
    pub fn read_tensor(&self, info: &TensorInfo) -> Result<Tensor> {
        // F32 needs no conversion: used in place from the map (a 2 GB f32 model
        // then costs no second 2 GB), when aligned (GGUF aligns tensor data to
        // `general.alignment`, 32 by default).
        if info.ggml_type == GgmlType::F32 {
            let start = (self.data_offset + info.offset) as usize;
            if let Some(t) = Tensor::mapped(info.shape(), self.map.clone(), start) {
                return Ok(t);
            }
        }
        let b = self.tensor_bytes(info);
        let data = quant::to_f32(info.ggml_type, b).ok_or_else(|| {
            Error::tensor_file(
                &self.path,
                format!(
                    "tensor `{}` is of type {}, which cannot be read (dequantisation exists for {})",
                    info.name,
                    info.ggml_type.name(),
                    quant::readable_names()
                ),
            )
        })?;
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

/// Whether `path` names a GGUF file (by extension).
pub fn is_gguf_path(path: &Path) -> bool {
    path.extension().is_some_and(|e| e.eq_ignore_ascii_case("gguf"))
}
