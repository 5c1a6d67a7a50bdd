//! Reading tensor files (safetensors, .npy) into host tensors, with errors that
//! name the file and the tensor. Floating tensors become `Tensor` (values in f32,
//! storage dtype kept); integer tensors (token ids, positions) are kept as i64.

use std::collections::BTreeMap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use half::{bf16, f16};
use safetensors::{Dtype as StDtype, SafeTensors};

use crate::error::{Error, Result};
use crate::tensor::{DType, Tensor};

/// Everything in one tensor file.
#[derive(Debug, Default)]
pub struct TensorFile {
    pub path: PathBuf,
    pub floats: BTreeMap<String, Tensor>,
    pub ints: BTreeMap<String, (Vec<usize>, Vec<i64>)>,
    /// The stored width of each integer tensor (`i32` or `i64`): values are
    /// widened to i64 in `ints`, and `inspect` shows what the file holds.
    pub int_dtypes: BTreeMap<String, &'static str>,
    /// safetensors `__metadata__` (empty for .npy).
    pub metadata: BTreeMap<String, String>,
}

impl TensorFile {
    /// Reads a `.safetensors` or `.npy` file, chosen by extension.
    pub fn read(path: &Path) -> Result<TensorFile> {
        match path.extension().and_then(|e| e.to_str()) {
            Some("safetensors") => read_safetensors(path),
            Some("npy") => read_npy(path),
            Some("npz") => read_npz(path),
            _ => Err(Error::tensor_file(
                path,
                "unknown tensor file type (expected .safetensors, .npy or .npz)",
            )),
        }
    }
}

fn map_file(path: &Path) -> Result<memmap2::Mmap> {
    let file = File::open(path).map_err(|e| Error::io(path, e))?;
    // SAFETY: the map is read-only and dropped before this function's caller
    // returns; a concurrent writer truncating the file is outside our contract
    // (goldens are replaced by atomic rename, never rewritten in place).
    unsafe { memmap2::Mmap::map(&file) }.map_err(|e| Error::io(path, e))
}

/// Reads a safetensors file; its f32 tensors are used in place from the file's
/// memory map (no copy, no conversion) where aligned, everything else is
/// converted to owned f32.
pub fn read_safetensors(path: &Path) -> Result<TensorFile> {
    let map = Arc::new(map_file(path)?);
    parse_safetensors_in(&map[..], Some(&map), path)
}

/// A safetensors file already in memory; `path` names it in errors.
pub fn parse_safetensors(map: &[u8], path: &Path) -> Result<TensorFile> {
    parse_safetensors_in(map, None, path)
}

/// `parse_safetensors` of `bytes`, which are all of `shared` when it is given:
/// f32 tensors then view the map instead of being copied.
fn parse_safetensors_in(map: &[u8], shared: Option<&Arc<memmap2::Mmap>>, path: &Path) -> Result<TensorFile> {
    let bad = |msg: String| Error::tensor_file(path, msg);
    let (_, meta) = SafeTensors::read_metadata(map).map_err(|e| bad(format!("not a valid safetensors file: {e}")))?;
    let st = SafeTensors::deserialize(map).map_err(|e| bad(format!("not a valid safetensors file: {e}")))?;
    let mut out = TensorFile {
        path: path.to_path_buf(),
        metadata: meta
            .metadata()
            .clone()
            .map(|m| m.into_iter().collect())
            .unwrap_or_default(),
        ..Default::default()
    };
    for (name, view) in st.tensors() {
        let shape = view.shape().to_vec();
        let bytes = view.data();
        match view.dtype() {
            StDtype::F32 => {
                let in_place = shared.and_then(|m| {
                    let offset = bytes.as_ptr() as usize - m.as_ptr() as usize;
                    Tensor::mapped(shape.clone(), m.clone(), offset)
                });
                let t = in_place.unwrap_or_else(|| Tensor::new(shape, le_f32(bytes)));
                out.floats.insert(name, t.with_dtype(DType::F32));
            }
            StDtype::F16 => {
                let v = bytes
                    .chunks_exact(2)
                    .map(|c| f16::from_le_bytes([c[0], c[1]]).to_f32())
                    .collect();
                out.floats.insert(name, Tensor::new(shape, v).with_dtype(DType::F16));
            }
            StDtype::BF16 => {
                let v = bytes
                    .chunks_exact(2)
                    .map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32())
                    .collect();
                out.floats.insert(name, Tensor::new(shape, v).with_dtype(DType::BF16));
            }
            StDtype::I64 => {
                let v = bytes
                    .chunks_exact(8)
                    .map(|c| i64::from_le_bytes(c.try_into().expect("8-byte chunk")))
                    .collect();
                out.int_dtypes.insert(name.clone(), "i64");
                out.ints.insert(name, (shape, v));
            }
            StDtype::I32 => {
                let v = bytes
                    .chunks_exact(4)
                    .map(|c| i32::from_le_bytes(c.try_into().expect("4-byte chunk")) as i64)
                    .collect();
                out.int_dtypes.insert(name.clone(), "i32");
                out.ints.insert(name, (shape, v));
            }
            StDtype::U32 => {
                let v = bytes
                    .chunks_exact(4)
                    .map(|c| u32::from_le_bytes(c.try_into().expect("4-byte chunk")) as i64)
                    .collect();
                out.int_dtypes.insert(name.clone(), "u32");
                out.ints.insert(name, (shape, v));
            }
            other => {
                return Err(bad(format!(
                    "tensor `{name}` has dtype {other:?}; supported: F32, F16, BF16, I64, I32, U32"
                )))
            }
        }
    }
    Ok(out)
}

fn le_f32(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().expect("4-byte chunk")))
        .collect()
}

/// The deepest bracket nesting accepted in a `.npy` header. A plain dtype's
/// header nests 2 deep (`{... 'shape': (2, 3), }`); npyz's header parser is
/// exponential in the nesting depth, so a 176-byte header nesting 24 brackets
/// took over a minute before this bound.
const NPY_MAX_HEADER_NESTING: usize = 8;
/// numpy writes headers of at most a few hundred bytes (64 KiB in format 1).
const NPY_MAX_HEADER_BYTES: usize = 1 << 16;

/// Checks a `.npy` header's framing before npyz parses it: magic, version,
/// declared length within the bytes and the limit, and nesting depth.
fn check_npy_header(bytes: &[u8]) -> std::result::Result<(), String> {
    if bytes.len() < 10 || &bytes[..6] != b"\x93NUMPY" {
        return Err("not a .npy file (no \\x93NUMPY magic)".into());
    }
    let (len, start) = match bytes[6] {
        1 => (u16::from_le_bytes([bytes[8], bytes[9]]) as usize, 10),
        2 | 3 if bytes.len() >= 12 => (
            u32::from_le_bytes([bytes[8], bytes[9], bytes[10], bytes[11]]) as usize,
            12,
        ),
        v => return Err(format!(".npy format version {v} is not supported (1, 2, 3)")),
    };
    if len > NPY_MAX_HEADER_BYTES {
        return Err(format!(
            "the header declares {len} bytes; at most {NPY_MAX_HEADER_BYTES} are accepted"
        ));
    }
    let header = bytes.get(start..start + len).ok_or_else(|| {
        format!(
            "the header declares {len} bytes but the file ends after {}",
            bytes.len() - start
        )
    })?;
    let mut depth = 0usize;
    for &b in header {
        match b {
            b'(' | b'[' | b'{' => {
                depth += 1;
                if depth > NPY_MAX_HEADER_NESTING {
                    return Err(format!(
                        "the header nests brackets deeper than {NPY_MAX_HEADER_NESTING} levels (a plain dtype needs 2)"
                    ));
                }
            }
            b')' | b']' | b'}' => depth = depth.saturating_sub(1),
            _ => {}
        }
    }
    // The shape's product must fit (npyz multiplies the dims unchecked: a
    // header declaring (2^40, 2^40) overflows inside it) and cannot exceed the
    // bytes that follow (every element takes at least one byte).
    let text = String::from_utf8_lossy(header);
    if let Some(rest) = text.split("'shape'").nth(1) {
        let dims = rest.split('(').nth(1).and_then(|r| r.split(')').next()).unwrap_or("");
        let mut n: u64 = 1;
        for d in dims.split(',').map(str::trim).filter(|d| !d.is_empty()) {
            let d: u64 = d.parse().map_err(|_| format!("the shape has a dimension `{d}` that is not a count"))?;
            n = n
                .checked_mul(d)
                .ok_or_else(|| format!("the shape ({dims}) has more elements than a 64-bit count holds"))?;
        }
        let data = (bytes.len() - start - len) as u64;
        if n > data {
            return Err(format!(
                "the shape ({dims}) declares {n} elements but only {data} bytes of data follow the header"
            ));
        }
    }
    Ok(())
}

/// Reads one `.npy` array; the tensor is named after the file stem.
pub fn read_npy(path: &Path) -> Result<TensorFile> {
    let bytes = std::fs::read(path).map_err(|e| Error::io(path, e))?;
    parse_npy(&bytes, path)
}

/// A `.npy` file already in memory; `path` names it (and the tensor) in errors.
pub fn parse_npy(bytes: &[u8], path: &Path) -> Result<TensorFile> {
    check_npy_header(bytes).map_err(|m| Error::tensor_file(path, format!("not a valid .npy file: {m}")))?;
    let npy = npyz::NpyFile::new(bytes).map_err(|e| Error::tensor_file(path, format!("not a valid .npy file: {e}")))?;
    let name = path.file_stem().and_then(|s| s.to_str()).unwrap_or("array").to_string();
    let mut out = TensorFile {
        path: path.to_path_buf(),
        ..Default::default()
    };
    read_npy_array(npy, name, path, &mut out)?;
    Ok(out)
}

/// Reads every array of a `.npz` archive (numpy's `savez`); tensors keep their array names.
/// Each member is read whole (at most its declared size, so a forged size
/// cannot make it read more) and its header checked before npyz parses it.
pub fn read_npz(path: &Path) -> Result<TensorFile> {
    use std::io::Read;
    let bad = |msg: String| Error::tensor_file(path, msg);
    let file = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
    let file_len = file.metadata().map_err(|e| Error::io(path, e))?.len();
    let mut zip = zip::ZipArchive::new(file).map_err(|e| bad(format!("not a valid .npz archive: {e}")))?;
    let mut out = TensorFile {
        path: path.to_path_buf(),
        ..Default::default()
    };
    for i in 0..zip.len() {
        let mut entry = zip.by_index(i).map_err(|e| bad(format!("member {i}: {e}")))?;
        let member = entry.name().to_string();
        let Some(name) = member.strip_suffix(".npy").map(str::to_string) else {
            continue;
        };
        // Deflate expands at most ~1032x: a declared size beyond that of the
        // whole archive is a forgery, refused before any allocation.
        let declared = entry.size();
        if declared > file_len.saturating_mul(1032) + (1 << 20) {
            return Err(bad(format!(
                "array `{name}` declares {declared} bytes, impossible for a {file_len}-byte archive"
            )));
        }
        let mut bytes = Vec::with_capacity(declared as usize);
        (&mut entry)
            .take(declared)
            .read_to_end(&mut bytes)
            .map_err(|e| bad(format!("array `{name}`: {e}")))?;
        check_npy_header(&bytes).map_err(|m| bad(format!("array `{name}`: {m}")))?;
        let npy = npyz::NpyFile::new(&bytes[..]).map_err(|e| bad(format!("array `{name}`: {e}")))?;
        read_npy_array(npy, name, path, &mut out)?;
    }
    Ok(out)
}

fn read_npy_array<R: std::io::Read>(
    npy: npyz::NpyFile<R>,
    name: String,
    path: &Path,
    out: &mut TensorFile,
) -> Result<()> {
    let label = name.clone();
    let bad = |msg: String| Error::tensor_file(path, format!("`{label}`: {msg}"));
    if npy.order() != npyz::Order::C {
        return Err(bad("Fortran-ordered arrays are not supported".into()));
    }
    let shape: Vec<usize> = npy.shape().iter().map(|&d| d as usize).collect();
    let expected: usize = shape.iter().product();
    let dtype = npy.dtype();
    let descr = match &dtype {
        npyz::DType::Plain(ts) => ts.to_string(),
        other => return Err(bad(format!("unsupported structured dtype {other:?}"))),
    };
    let short = |got: usize| bad(format!("truncated: header says {expected} values, file has {got}"));
    match descr.trim_start_matches(['<', '|', '=']) {
        "f4" => {
            let v: Vec<f32> = npy
                .into_vec()
                .map_err(|e| bad(format!("truncated or corrupt data: {e}")))?;
            if v.len() != expected {
                return Err(short(v.len()));
            }
            out.floats.insert(name, Tensor::new(shape, v));
        }
        "f2" => {
            let v: Vec<f16> = npy
                .into_vec()
                .map_err(|e| bad(format!("truncated or corrupt data: {e}")))?;
            if v.len() != expected {
                return Err(short(v.len()));
            }
            let v = v.into_iter().map(f16::to_f32).collect();
            out.floats.insert(name, Tensor::new(shape, v).with_dtype(DType::F16));
        }
        "f8" => {
            let v: Vec<f64> = npy
                .into_vec()
                .map_err(|e| bad(format!("truncated or corrupt data: {e}")))?;
            if v.len() != expected {
                return Err(short(v.len()));
            }
            out.floats
                .insert(name, Tensor::new(shape, v.into_iter().map(|x| x as f32).collect()));
        }
        "i8" | "i4" => {
            let v: Vec<i64> = if descr.ends_with("i8") {
                npy.into_vec()
                    .map_err(|e| bad(format!("truncated or corrupt data: {e}")))?
            } else {
                let v: Vec<i32> = npy
                    .into_vec()
                    .map_err(|e| bad(format!("truncated or corrupt data: {e}")))?;
                v.into_iter().map(i64::from).collect()
            };
            if v.len() != expected {
                return Err(short(v.len()));
            }
            out.int_dtypes
                .insert(name.clone(), if descr.ends_with("i8") { "i64" } else { "i32" });
            out.ints.insert(name, (shape, v));
        }
        _ => {
            return Err(bad(format!(
                "unsupported .npy dtype `{descr}` (supported: f4, f2, f8, i4, i8)"
            )))
        }
    }
    Ok(())
}

/// Writes float tensors (as F32), integer tensors (as I64) and metadata to a
/// safetensors file, atomically: a temp file beside it, then a rename.
pub fn write_safetensors(
    path: &Path,
    floats: &BTreeMap<String, Tensor>,
    ints: &BTreeMap<String, (Vec<usize>, Vec<i64>)>,
    metadata: &BTreeMap<String, String>,
) -> Result<()> {
    use safetensors::tensor::TensorView;
    let mut buffers: Vec<(String, StDtype, Vec<usize>, Vec<u8>)> = Vec::new();
    for (name, t) in floats {
        let bytes = t.data().iter().flat_map(|x| x.to_le_bytes()).collect();
        buffers.push((name.clone(), StDtype::F32, t.shape().to_vec(), bytes));
    }
    for (name, (shape, v)) in ints {
        let bytes = v.iter().flat_map(|x| x.to_le_bytes()).collect();
        buffers.push((name.clone(), StDtype::I64, shape.clone(), bytes));
    }
    let views = buffers
        .iter()
        .map(|(n, d, s, b)| {
            TensorView::new(*d, s.clone(), b)
                .map(|v| (n.clone(), v))
                .map_err(|e| Error::tensor_file(path, format!("tensor `{n}`: {e}")))
        })
        .collect::<Result<Vec<_>>>()?;
    let meta: std::collections::HashMap<String, String> = metadata.clone().into_iter().collect();
    let tmp = path.with_extension("safetensors.tmp");
    safetensors::serialize_to_file(views, Some(meta), &tmp)
        .map_err(|e| Error::tensor_file(&tmp, format!("cannot write: {e}")))?;
    std::fs::rename(&tmp, path).map_err(|e| Error::io(path, e))
}

#[cfg(test)]
mod npy_header_tests {
    use super::*;

    fn npy(header: &str) -> Vec<u8> {
        let mut b = b"\x93NUMPY\x01\x00".to_vec();
        b.extend_from_slice(&(header.len() as u16).to_le_bytes());
        b.extend_from_slice(header.as_bytes());
        b
    }

    #[test]
    fn a_deeply_nested_header_is_refused_at_once() {
        let h = format!(
            "{{'descr': {}'<f4'{}, 'fortran_order': False, 'shape': (1,), }}",
            "[".repeat(24),
            "]".repeat(24)
        );
        let t = std::time::Instant::now();
        let e = check_npy_header(&npy(&h)).unwrap_err();
        assert!(e.contains("deeper than 8"), "{e}");
        assert!(t.elapsed().as_millis() < 100);
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("deep.npy");
        std::fs::write(&p, npy(&h)).unwrap();
        let err = read_npy(&p).unwrap_err().to_string();
        assert!(err.contains("deep.npy") && err.contains("deeper than 8"), "{err}");
    }

    #[test]
    fn a_shape_whose_product_overflows_or_outgrows_the_file_is_refused() {
        // Found by fuzzing: npyz multiplied these dims unchecked (a panic).
        let big = npy("{'descr': '<f4', 'fortran_order': False, 'shape': (4294967296, 4294967296, 16), }");
        assert!(check_npy_header(&big).unwrap_err().contains("64-bit"));
        let short = npy("{'descr': '<f4', 'fortran_order': False, 'shape': (1000, 1000), }");
        assert!(check_npy_header(&short).unwrap_err().contains("only 0 bytes of data"));
    }

    #[test]
    fn header_framing_is_checked() {
        assert!(check_npy_header(b"nope").unwrap_err().contains("magic"));
        let mut b = npy("{'descr': '<f4', 'fortran_order': False, 'shape': (1,), }");
        b.truncate(20);
        assert!(check_npy_header(&b).unwrap_err().contains("file ends"));
        let mut ok = npy("{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }");
        ok.extend_from_slice(&[0u8; 24]);
        assert!(check_npy_header(&ok).is_ok());
    }
}
