//! Reading tensor files (safetensors, .npy) into host tensors, with errors that
//! name the file and the tensor. Floating tensors become `Tensor` (values in f32,
//! storage dtype kept); integer tensors (token ids, positions) are kept as i64.

use std::collections::BTreeMap;
use std::fs::File;
use std::path::{Path, PathBuf};

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

pub fn read_safetensors(path: &Path) -> Result<TensorFile> {
    let map = map_file(path)?;
    let bad = |msg: String| Error::tensor_file(path, msg);
    let (_, meta) =
        SafeTensors::read_metadata(&map[..]).map_err(|e| bad(format!("not a valid safetensors file: {e}")))?;
    let st = SafeTensors::deserialize(&map[..]).map_err(|e| bad(format!("not a valid safetensors file: {e}")))?;
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
                out.floats
                    .insert(name, Tensor::new(shape, le_f32(bytes)).with_dtype(DType::F32));
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
                out.ints.insert(name, (shape, v));
            }
            StDtype::I32 => {
                let v = bytes
                    .chunks_exact(4)
                    .map(|c| i32::from_le_bytes(c.try_into().expect("4-byte chunk")) as i64)
                    .collect();
                out.ints.insert(name, (shape, v));
            }
            other => {
                return Err(bad(format!(
                    "tensor `{name}` has dtype {other:?}; supported: F32, F16, BF16, I64, I32"
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

/// Reads one `.npy` array; the tensor is named after the file stem.
pub fn read_npy(path: &Path) -> Result<TensorFile> {
    let bytes = std::fs::read(path).map_err(|e| Error::io(path, e))?;
    let npy =
        npyz::NpyFile::new(&bytes[..]).map_err(|e| Error::tensor_file(path, format!("not a valid .npy file: {e}")))?;
    let name = path.file_stem().and_then(|s| s.to_str()).unwrap_or("array").to_string();
    let mut out = TensorFile {
        path: path.to_path_buf(),
        ..Default::default()
    };
    read_npy_array(npy, name, path, &mut out)?;
    Ok(out)
}

/// Reads every array of a `.npz` archive (numpy's `savez`); tensors keep their array names.
pub fn read_npz(path: &Path) -> Result<TensorFile> {
    let bad = |msg: String| Error::tensor_file(path, msg);
    let mut npz = npyz::npz::NpzArchive::open(path).map_err(|e| bad(format!("not a valid .npz archive: {e}")))?;
    let names: Vec<String> = npz.array_names().map(str::to_string).collect();
    let mut out = TensorFile {
        path: path.to_path_buf(),
        ..Default::default()
    };
    for name in names {
        let npy = npz
            .by_name(&name)
            .map_err(|e| bad(format!("array `{name}`: {e}")))?
            .ok_or_else(|| bad(format!("array `{name}` is listed but cannot be read")))?;
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
