//! Parsing a GGUF byte buffer: header, metadata, tensor table, then the
//! integrity checks on the data section. Every read goes through `Cursor`,
//! which refuses to read past the end of the buffer, and every count or length
//! is bounded by the bytes left before anything is allocated for it. Errors are
//! plain messages; `GgufFile::open` adds the file's path.

use std::collections::HashSet;

use super::{GgmlType, TensorInfo, Value, ValueType, DEFAULT_ALIGNMENT, MAGIC, SUPPORTED_VERSIONS};

/// Most dimensions a ggml tensor has (`GGML_MAX_DIMS`).
const MAX_DIMS: u32 = 4;
/// Arrays of arrays are legal GGUF; nesting deeper than this is corruption.
const MAX_DEPTH: u32 = 4;

pub(crate) struct Parsed {
    pub version: u32,
    pub alignment: u64,
    pub metadata: Vec<(String, Value)>,
    pub tensors: Vec<TensorInfo>,
    pub data_offset: u64,
}

type R<T> = std::result::Result<T, String>;

struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn remaining(&self) -> u64 {
        (self.buf.len() - self.pos) as u64
    }

    /// `n` bytes, or a "truncated" error saying what was being read.
    fn bytes(&mut self, n: u64, what: &dyn Fn() -> String) -> R<&'a [u8]> {
        if n > self.remaining() {
            return Err(format!(
                "truncated: {} needs {n} byte(s) at offset {}, but the file ends at {}",
                what(),
                self.pos,
                self.buf.len()
            ));
        }
        let s = &self.buf[self.pos..self.pos + n as usize];
        self.pos += n as usize;
        Ok(s)
    }
    fn array<const N: usize>(&mut self, what: &dyn Fn() -> String) -> R<[u8; N]> {
        Ok(self.bytes(N as u64, what)?.try_into().expect("N bytes"))
    }
    fn u32(&mut self, what: &dyn Fn() -> String) -> R<u32> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }
    fn u64(&mut self, what: &dyn Fn() -> String) -> R<u64> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }
    /// A string: u64 length then UTF-8 bytes (the length is bounded by the file).
    fn string(&mut self, what: &dyn Fn() -> String) -> R<String> {
        let n = self.u64(&|| format!("the length of {}", what()))?;
        let b = self.bytes(n, what)?;
        String::from_utf8(b.to_vec()).map_err(|_| format!("{} is not valid UTF-8", what()))
    }

    fn value(&mut self, ty: ValueType, key: &str, depth: u32) -> R<Value> {
        let what = || format!("the value of metadata key `{key}`");
        Ok(match ty {
            ValueType::U8 => Value::U8(self.array::<1>(&what)?[0]),
            ValueType::I8 => Value::I8(self.array::<1>(&what)?[0] as i8),
            ValueType::U16 => Value::U16(u16::from_le_bytes(self.array(&what)?)),
            ValueType::I16 => Value::I16(i16::from_le_bytes(self.array(&what)?)),
            ValueType::U32 => Value::U32(u32::from_le_bytes(self.array(&what)?)),
            ValueType::I32 => Value::I32(i32::from_le_bytes(self.array(&what)?)),
            ValueType::F32 => Value::F32(f32::from_le_bytes(self.array(&what)?)),
            ValueType::U64 => Value::U64(u64::from_le_bytes(self.array(&what)?)),
            ValueType::I64 => Value::I64(i64::from_le_bytes(self.array(&what)?)),
            ValueType::F64 => Value::F64(f64::from_le_bytes(self.array(&what)?)),
            ValueType::Bool => match self.array::<1>(&what)?[0] {
                0 => Value::Bool(false),
                1 => Value::Bool(true),
                b => return Err(format!("metadata key `{key}`: bool value is {b}, expected 0 or 1")),
            },
            ValueType::String => Value::String(self.string(&what)?),
            ValueType::Array => {
                if depth >= MAX_DEPTH {
                    return Err(format!("metadata key `{key}`: arrays nested deeper than {MAX_DEPTH}"));
                }
                let id = self.u32(&|| format!("the element type of metadata key `{key}`"))?;
                let elem = ValueType::from_id(id).ok_or_else(|| {
                    format!("metadata key `{key}`: array element type id {id} is not a GGUF value type (0..=12)")
                })?;
                let n = self.u64(&|| format!("the length of metadata array `{key}`"))?;
                let need = n.saturating_mul(elem.min_size());
                if need > self.remaining() {
                    return Err(format!(
                        "truncated: metadata array `{key}` claims {n} {} element(s) (at least {need} bytes) \
                         at offset {}, but only {} byte(s) are left in the file",
                        elem.name(),
                        self.pos,
                        self.remaining()
                    ));
                }
                let mut items = Vec::with_capacity((n as usize).min(1 << 16));
                for _ in 0..n {
                    items.push(self.value(elem, key, depth + 1)?);
                }
                Value::Array(elem, items)
            }
        })
    }
}

// A metadata entry is at least 8 (key length) + 4 (type) + 1 bytes; a tensor
// entry at least 8 (name length) + 4 (n_dims) + 8 (ne[0]) + 4 (type) + 8 (offset).
fn bound(n: u64, min: u64, what: &str, c: &Cursor) -> R<()> {
    if n.checked_mul(min).is_none_or(|b| b > c.remaining()) {
        return Err(format!(
            "truncated or corrupt: the header claims {n} {what}, which cannot fit in the {} byte(s) left \
             after offset {}",
            c.remaining(),
            c.pos
        ));
    }
    Ok(())
}

/// Metadata entries in file order.
type Metadata = Vec<(String, Value)>;

/// Magic, version, counts and the metadata entries; returns (version, tensor count, metadata).
fn header_and_metadata(c: &mut Cursor) -> R<(u32, u64, Metadata)> {
    let magic = c.array::<4>(&|| "the magic number".into())?;
    if &magic != MAGIC {
        return Err(format!(
            "not a GGUF file: the magic number is {:?} ({}), expected \"GGUF\"",
            String::from_utf8_lossy(&magic),
            magic.iter().map(|b| format!("{b:02x}")).collect::<Vec<_>>().join(" ")
        ));
    }
    let version = c.u32(&|| "the GGUF version".into())?;
    if !SUPPORTED_VERSIONS.contains(&version) {
        return Err(format!(
            "GGUF version {version} is not supported (supported: 2, 3){}",
            if version == 1 {
                "; re-convert the model with a current llama.cpp"
            } else {
                ""
            }
        ));
    }
    let n_tensors = c.u64(&|| "the tensor count".into())?;
    let n_kv = c.u64(&|| "the metadata count".into())?;
    bound(n_kv, 13, "metadata entries", c)?;

    let mut metadata = Vec::with_capacity((n_kv as usize).min(1 << 12));
    let mut seen = HashSet::new();
    for i in 0..n_kv {
        let key = c.string(&|| format!("the key of metadata entry {i}"))?;
        let id = c.u32(&|| format!("the value type of metadata key `{key}`"))?;
        let ty = ValueType::from_id(id)
            .ok_or_else(|| format!("metadata key `{key}`: value type id {id} is not a GGUF value type (0..=12)"))?;
        let v = c.value(ty, &key, 0)?;
        if !seen.insert(key.clone()) {
            return Err(format!("metadata key `{key}` appears more than once"));
        }
        metadata.push((key, v));
    }
    Ok((version, n_tensors, metadata))
}

/// Only the header and the metadata: what a reader of the tokenizer needs,
/// whatever tensor types the file holds. Returns (version, metadata).
pub(crate) fn parse_metadata(buf: &[u8]) -> R<(u32, Metadata)> {
    let mut c = Cursor { buf, pos: 0 };
    let (version, _, metadata) = header_and_metadata(&mut c)?;
    Ok((version, metadata))
}

pub(crate) fn parse(buf: &[u8]) -> R<Parsed> {
    let mut c = Cursor { buf, pos: 0 };
    let (version, n_tensors, metadata) = header_and_metadata(&mut c)?;
    let alignment = match metadata.iter().find(|(k, _)| k == "general.alignment") {
        None => DEFAULT_ALIGNMENT,
        Some((_, v)) => {
            let a = v.as_u64().ok_or_else(|| {
                format!(
                    "metadata key `general.alignment` is a {}, expected an unsigned integer",
                    v.type_name()
                )
            })?;
            if a == 0 || !a.is_power_of_two() {
                return Err(format!(
                    "metadata key `general.alignment` is {a}, which is not a power of two"
                ));
            }
            a
        }
    };

    bound(n_tensors, 32, "tensors", &c)?;
    let mut tensors = Vec::with_capacity((n_tensors as usize).min(1 << 12));
    let mut names = HashSet::new();
    for i in 0..n_tensors {
        let name = c.string(&|| format!("the name of tensor {i}"))?;
        let t = || format!("tensor `{name}`");
        let n_dims = c.u32(&|| format!("the dimension count of {}", t()))?;
        if n_dims == 0 || n_dims > MAX_DIMS {
            return Err(format!("{}: {n_dims} dimensions (expected 1..={MAX_DIMS})", t()));
        }
        let mut ne = Vec::with_capacity(n_dims as usize);
        for d in 0..n_dims {
            let n = c.u64(&|| format!("dimension {d} of {}", t()))?;
            if n > i64::MAX as u64 {
                return Err(format!("{}: dimension {d} is {n}, which is negative as an int64", t()));
            }
            ne.push(n);
        }
        let type_id = c.u32(&|| format!("the type of {}", t()))?;
        let offset = c.u64(&|| format!("the data offset of {}", t()))?;
        // Any type ggml has (or had) is accepted here: its block size locates
        // the data, so the table can be shown and every range checked. Only
        // reading a tensor needs a dequantiser (`GgufFile::read_tensor`).
        let ggml_type = GgmlType::from_id(type_id).ok_or_else(|| {
            format!(
                "{}: ggml type id {type_id} is not supported: no ggml type has this id (known ids: {}), \
                 so the size of its data is unknown",
                t(),
                super::known_type_ids()
            )
        })?;
        let numel = ne
            .iter()
            .try_fold(1u64, |a, &n| a.checked_mul(n))
            .ok_or_else(|| format!("{}: dimensions {ne:?} overflow", t()))?;
        let (block_elems, block_bytes) = ggml_type.block();
        if ne[0] % block_elems != 0 {
            return Err(format!(
                "{}: row length ne[0] = {} is not a multiple of the {} block size {block_elems}",
                t(),
                ne[0],
                ggml_type.name()
            ));
        }
        let size = (numel / block_elems)
            .checked_mul(block_bytes)
            .ok_or_else(|| format!("{}: data size overflows", t()))?;
        if !names.insert(name.clone()) {
            return Err(format!("tensor `{name}` appears more than once in the tensor table"));
        }
        tensors.push(TensorInfo {
            name,
            ne,
            ggml_type,
            offset,
            size,
        });
    }

    let file_len = buf.len() as u64;
    let data_offset = (c.pos as u64).next_multiple_of(alignment);
    if !tensors.is_empty() && data_offset > file_len {
        return Err(format!(
            "truncated: the tensor data section starts at offset {data_offset}, past the end of the file ({file_len} bytes)"
        ));
    }
    for t in &tensors {
        if t.offset % alignment != 0 {
            return Err(format!(
                "tensor `{}`: data offset {} is not a multiple of the alignment {alignment}",
                t.name, t.offset
            ));
        }
        let end = data_offset.checked_add(t.offset).and_then(|s| s.checked_add(t.size));
        if end.is_none_or(|e| e > file_len) {
            return Err(format!(
                "tensor `{}`: data at offset {} + {} byte(s) in the data section (file offset {}) runs past the \
                 end of the file ({file_len} bytes); the file is truncated or the offset is corrupt",
                t.name,
                t.offset,
                t.size,
                data_offset.saturating_add(t.offset)
            ));
        }
    }
    // No two tensors may share bytes (sorted by start, neighbours suffice).
    let mut spans: Vec<(u64, u64, &str)> = tensors
        .iter()
        .filter(|t| t.size > 0)
        .map(|t| (t.offset, t.offset + t.size, t.name.as_str()))
        .collect();
    spans.sort();
    for w in spans.windows(2) {
        let ((_, end, a), (start, _, b)) = (w[0], w[1]);
        if start < end {
            return Err(format!(
                "tensors `{a}` and `{b}` overlap in the data section (`{b}` starts at {start}, `{a}` ends at {end})"
            ));
        }
    }
    Ok(Parsed {
        version,
        alignment,
        metadata,
        tensors,
        data_offset,
    })
}
