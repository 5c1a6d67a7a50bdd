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

mod npy;
pub use npy::{parse_npy, read_npy, read_npz};

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
    // SAFETY: the map is read-only and lives as long as the tensors that view
    // it; a concurrent writer truncating or rewriting the file in place is
    // outside our contract (goldens are replaced by atomic rename, never
    // rewritten in place; `compare`'s inputs are the user's to keep still).
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

/// Little-endian f32 values, copied out of bytes of any alignment.
fn le_f32(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().expect("4-byte chunk")))
        .collect()
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
