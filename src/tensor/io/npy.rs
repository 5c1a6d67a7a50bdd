//! `.npy` arrays and `.npz` archives (numpy's `save` and `savez`).
//!
//! A little-endian f32 C-order array, the common case and the large one, is
//! used in place: a `.npy` file is memory-mapped and the tensor views the map
//! (numpy pads its header so the data starts 64-byte aligned), as does a
//! `.npz` member stored uncompressed (`savez`) where its data happens to be
//! 4-byte aligned in the archive. Otherwise such an array is copied out in one
//! pass (compressed members, odd offsets). Every other dtype goes through
//! npyz, element by element. Either way the header is checked first
//! (`check_npy_header`), and every check and message is the same.

use std::path::Path;
use std::sync::Arc;

use half::f16;
use memmap2::Mmap;

use super::{le_f32, map_file, TensorFile};
use crate::error::{Error, Result};
use crate::tensor::{DType, Tensor};

/// The deepest bracket nesting accepted in a `.npy` header. A plain dtype's
/// header nests 2 deep (`{... 'shape': (2, 3), }`); npyz's header parser is
/// exponential in the nesting depth, so a 176-byte header nesting 24 brackets
/// took over a minute before this bound.
const NPY_MAX_HEADER_NESTING: usize = 8;
/// numpy writes headers of at most a few hundred bytes (64 KiB in format 1).
const NPY_MAX_HEADER_BYTES: usize = 1 << 16;

/// Checks a `.npy` header's framing before npyz parses it: magic, version,
/// declared length within the bytes and the limit, and nesting depth.
/// Returns where the data starts.
fn check_npy_header(bytes: &[u8]) -> std::result::Result<usize, String> {
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
            let d: u64 = d
                .parse()
                .map_err(|_| format!("the shape has a dimension `{d}` that is not a count"))?;
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
    Ok(start + len)
}

/// Where an array's data lies, for the f32 fast path: its bytes (from the
/// end of the header on) and, when they are in a file's memory map, the map
/// and their offset in it.
struct Data<'a> {
    bytes: &'a [u8],
    mapped: Option<(&'a Arc<Mmap>, usize)>,
}

/// Reads one `.npy` array through a memory map; the tensor is named after the
/// file stem.
pub fn read_npy(path: &Path) -> Result<TensorFile> {
    let map = Arc::new(map_file(path)?);
    parse_npy_in(&map[..], Some(&map), path)
}

/// A `.npy` file already in memory; `path` names it (and the tensor) in errors.
pub fn parse_npy(bytes: &[u8], path: &Path) -> Result<TensorFile> {
    parse_npy_in(bytes, None, path)
}

/// `parse_npy` of `bytes`, which are all of `map` when it is given.
fn parse_npy_in(bytes: &[u8], map: Option<&Arc<Mmap>>, path: &Path) -> Result<TensorFile> {
    let start = check_npy_header(bytes).map_err(|m| Error::tensor_file(path, format!("not a valid .npy file: {m}")))?;
    let npy = npyz::NpyFile::new(bytes).map_err(|e| Error::tensor_file(path, format!("not a valid .npy file: {e}")))?;
    let name = path.file_stem().and_then(|s| s.to_str()).unwrap_or("array").to_string();
    let mut out = TensorFile {
        path: path.to_path_buf(),
        ..Default::default()
    };
    let data = Data {
        bytes: &bytes[start..],
        mapped: map.map(|m| (m, start)),
    };
    read_npy_array(npy, data, name, path, &mut out)?;
    Ok(out)
}

/// Reads every array of a `.npz` archive (numpy's `savez`); tensors keep their
/// array names. The archive is memory-mapped: a stored (uncompressed) member
/// is parsed where it lies; a compressed one is inflated whole (at most its
/// declared size, so a forged size cannot make it read more). Each member's
/// header is checked before npyz parses it.
pub fn read_npz(path: &Path) -> Result<TensorFile> {
    use std::io::Read;
    let bad = |msg: String| Error::tensor_file(path, msg);
    let map = Arc::new(map_file(path)?);
    let file_len = map.len() as u64;
    let mut zip = zip::ZipArchive::new(std::io::Cursor::new(&map[..]))
        .map_err(|e| bad(format!("not a valid .npz archive: {e}")))?;
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
        let at = entry.data_start();
        let stored = entry.compression() == zip::CompressionMethod::Stored
            && entry.compressed_size() == declared
            && at.checked_add(declared).is_some_and(|end| end <= file_len);
        let inflated;
        let (bytes, offset) = if stored {
            (&map[at as usize..(at + declared) as usize], Some(at as usize))
        } else {
            let mut v = Vec::with_capacity(declared as usize);
            (&mut entry)
                .take(declared)
                .read_to_end(&mut v)
                .map_err(|e| bad(format!("array `{name}`: {e}")))?;
            inflated = v;
            (&inflated[..], None)
        };
        let start = check_npy_header(bytes).map_err(|m| bad(format!("array `{name}`: {m}")))?;
        let npy = npyz::NpyFile::new(bytes).map_err(|e| bad(format!("array `{name}`: {e}")))?;
        let data = Data {
            bytes: &bytes[start..],
            mapped: offset.map(|o| (&map, o + start)),
        };
        read_npy_array(npy, data, name, path, &mut out)?;
    }
    Ok(out)
}

/// Converts one parsed array into `out`. A little-endian f32 array whose
/// data is all there is viewed in place (`data.mapped`) or copied in one pass;
/// anything else, a short one included, is read by npyz, whose errors say
/// what is wrong.
fn read_npy_array<R: std::io::Read>(
    npy: npyz::NpyFile<R>,
    data: Data,
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
    let f32_bytes = expected.checked_mul(4).filter(|&n| n <= data.bytes.len());
    if let (true, Some(n)) = (descr == "<f4", f32_bytes) {
        let in_place = data
            .mapped
            .and_then(|(map, at)| Tensor::mapped(shape.clone(), map.clone(), at));
        let t = in_place.unwrap_or_else(|| Tensor::new(shape, le_f32(&data.bytes[..n])));
        out.floats.insert(name, t);
        return Ok(());
    }
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

#[cfg(test)]
mod tests {
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

    /// A `.npy` file as numpy writes it: a v1 header padded with spaces and a
    /// newline to a multiple of `pad_to` bytes (numpy: 64), then `data`.
    fn npy_file(descr: &str, fortran: bool, shape: &str, data: &[u8], pad_to: usize) -> Vec<u8> {
        let fortran = if fortran { "True" } else { "False" };
        let mut h = format!("{{'descr': '{descr}', 'fortran_order': {fortran}, 'shape': {shape}, }}");
        h += &" ".repeat((pad_to - (10 + h.len() + 1) % pad_to) % pad_to);
        h.push('\n');
        let mut b = npy(&h);
        b.extend_from_slice(data);
        b
    }

    fn le(values: &[f32]) -> Vec<u8> {
        values.iter().flat_map(|v| v.to_le_bytes()).collect()
    }

    const VALUES: [f32; 6] = [1.5, -2.0, 0.0, -0.0, 1e-40, f32::MAX];

    #[test]
    fn an_f32_npy_is_read_in_place_and_an_unaligned_one_copied() {
        let d = tempfile::tempdir().unwrap();
        let cases = [
            ("aligned", 64, true),
            // A 2-byte-padded header leaves the data off a 4-byte boundary.
            ("unaligned", 2, false),
        ];
        for (name, pad_to, in_place) in cases {
            let bytes = npy_file("<f4", false, "(2, 3)", &le(&VALUES), pad_to);
            assert_eq!(check_npy_header(&bytes).unwrap().is_multiple_of(4), in_place, "{name}");
            let p = d.path().join(format!("{name}.npy"));
            std::fs::write(&p, &bytes).unwrap();
            let f = read_npy(&p).unwrap();
            let t = &f.floats[name];
            assert_eq!(t.is_mapped(), in_place, "{name}");
            assert_eq!((t.shape(), t.dtype()), (&[2, 3][..], DType::F32));
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(t.data()), bits(&VALUES), "{name}");
            // The same bytes from memory (no map) give the same tensor.
            let m = parse_npy(&bytes, &p).unwrap();
            assert!(!m.floats[name].is_mapped());
            assert_eq!(bits(m.floats[name].data()), bits(&VALUES));
        }
        // Bytes after the data are ignored, as npyz ignores them.
        let mut extra = le(&VALUES);
        extra.extend_from_slice(&[1, 2, 3]);
        let p = d.path().join("extra.npy");
        std::fs::write(&p, npy_file("<f4", false, "(6,)", &extra, 64)).unwrap();
        assert_eq!(read_npy(&p).unwrap().floats["extra"].data().len(), 6);
    }

    #[test]
    fn refused_f32_arrays_keep_their_messages() {
        let d = tempfile::tempdir().unwrap();
        let be: Vec<u8> = VALUES[..4].iter().flat_map(|v| v.to_be_bytes()).collect();
        let cases = [
            (
                "short",
                npy_file("<f4", false, "(2, 3)", &le(&VALUES)[..10], 64),
                "short.npy: `short`: truncated or corrupt data: failed to fill whole buffer",
            ),
            (
                "fortran",
                npy_file("<f4", true, "(2, 2)", &le(&VALUES[..4]), 64),
                "fortran.npy: `fortran`: Fortran-ordered arrays are not supported",
            ),
            (
                "big",
                npy_file(">f4", false, "(4,)", &be, 64),
                "big.npy: `big`: unsupported .npy dtype `>f4` (supported: f4, f2, f8, i4, i8)",
            ),
        ];
        for (name, bytes, want) in cases {
            let p = d.path().join(format!("{name}.npy"));
            std::fs::write(&p, &bytes).unwrap();
            let err = read_npy(&p).unwrap_err().to_string();
            assert!(err.ends_with(want), "{name}: {err}");
        }
    }

    #[test]
    fn npz_members_stored_aligned_are_mapped_others_copied_or_inflated() {
        use std::io::Write;
        use zip::write::FileOptions;
        use zip::CompressionMethod::{Deflated, Stored};
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("x.npz");
        let f32_member = npy_file("<f4", false, "(6,)", &le(&VALUES), 64);
        let f8: Vec<u8> = [0.25f64, -4.0].iter().flat_map(|v| v.to_le_bytes()).collect();
        {
            let mut w = zip::ZipWriter::new(std::fs::File::create(&p).unwrap());
            // A local header is 30 bytes plus the name: "ab.npy" puts the first
            // member's f32 data at 36 + 128 (4-aligned), "abc.npy" the
            // second's at 188 + 37 + 128 (not).
            for (name, method, bytes) in [
                ("ab.npy", Stored, &f32_member),
                ("abc.npy", Stored, &f32_member),
                ("c.npy", Deflated, &f32_member),
                ("f8.npy", Stored, &npy_file("<f8", false, "(2,)", &f8, 64)),
            ] {
                w.start_file(name, FileOptions::default().compression_method(method))
                    .unwrap();
                w.write_all(bytes).unwrap();
            }
            w.finish().unwrap();
        }
        let f = read_npz(&p).unwrap();
        let mapped: Vec<(&str, bool)> = f.floats.iter().map(|(n, t)| (n.as_str(), t.is_mapped())).collect();
        assert_eq!(mapped, [("ab", true), ("abc", false), ("c", false), ("f8", false)]);
        for n in ["ab", "abc", "c"] {
            assert_eq!(f.floats[n].data(), &VALUES[..], "{n}");
        }
        assert_eq!(f.floats["f8"].data(), [0.25, -4.0]);
    }
}
