//! The kernel sources (`cuda/*.cu`, embedded in the binary) and their run-time
//! compilation with NVRTC. Options are pinned so the PTX loads on driver 580
//! (CUDA 13.0): an explicit virtual architecture, C++17, and the numerics the
//! kernels promise (no fast math, no FMA contraction). PTX is compiled once per
//! (file, arch) per process and cached; a compile failure is a typed error that
//! carries NVRTC's log.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

/// One `.cu` file and the `extern "C"` kernels it defines.
#[derive(Debug)]
pub struct KernelFile {
    pub name: &'static str,
    pub source: &'static str,
    pub kernels: &'static [&'static str],
}

/// Prepended to every file (16-bit storage types, reductions, INFINITY).
pub const COMMON: &str = include_str!("../../../cuda/common.cuh");

macro_rules! kernel_file {
    ($name:literal, [$($k:literal),* $(,)?]) => {
        KernelFile {
            name: $name,
            source: include_str!(concat!("../../../cuda/", $name)),
            kernels: &[$($k),*],
        }
    };
}

/// Every kernel file, one per op family. Matrix products are not here: they go
/// through cuBLAS (see `device.rs`).
pub const FILES: &[KernelFile] = &[
    kernel_file!("embedding.cu", ["embedding_f32", "embedding_f16", "embedding_bf16"]),
    kernel_file!("rmsnorm.cu", ["rmsnorm_f32", "rmsnorm_f16", "rmsnorm_bf16"]),
    kernel_file!("layernorm.cu", ["layernorm_f32", "layernorm_f16", "layernorm_bf16"]),
    kernel_file!(
        "rope.cu",
        [
            "rope_neox_f32",
            "rope_neox_f16",
            "rope_neox_bf16",
            "rope_interleaved_f32",
            "rope_interleaved_f16",
            "rope_interleaved_bf16",
            "rope_axes_f32",
            "rope_axes_f16",
            "rope_axes_bf16",
        ]
    ),
    kernel_file!(
        "attention.cu",
        [
            "attention_prefill_f32",
            "attention_decode_f32",
            "attention_prefill_f16",
            "attention_decode_f16",
            "attention_prefill_bf16",
            "attention_decode_bf16",
        ]
    ),
    kernel_file!(
        "elementwise.cu",
        [
            "bias_add_f32",
            "silu_mul_f32",
            "gelu_mul_f32",
            "scale_f32",
            "add_f32",
            "act_f32",
            "copy_cols_f32",
            "scatter_rows_f32",
            "bias_add_f16",
            "silu_mul_f16",
            "gelu_mul_f16",
            "scale_f16",
            "add_f16",
            "act_f16",
            "copy_cols_f16",
            "scatter_rows_f16",
            "bias_add_bf16",
            "silu_mul_bf16",
            "gelu_mul_bf16",
            "scale_bf16",
            "add_bf16",
            "act_bf16",
            "copy_cols_bf16",
            "scatter_rows_bf16",
            "fill_u32",
            "fill_u16",
        ]
    ),
    kernel_file!(
        "moe.cu",
        [
            "moe_route_f32",
            "moe_gather_f32",
            "moe_accumulate_f32",
            "moe_store_f32",
            "sigmoid_scale_f32",
            "swiglu_clamped_f32",
            "moe_route_f16",
            "moe_gather_f16",
            "moe_accumulate_f16",
            "moe_store_f16",
            "sigmoid_scale_f16",
            "swiglu_clamped_f16",
            "moe_route_bf16",
            "moe_gather_bf16",
            "moe_accumulate_bf16",
            "moe_store_bf16",
            "sigmoid_scale_bf16",
            "swiglu_clamped_bf16"
        ]
    ),
    kernel_file!(
        "mla.cu",
        [
            "mla_split_kv_f32",
            "rope_mla_f32",
            "mla_split_kv_f16",
            "rope_mla_f16",
            "mla_split_kv_bf16",
            "rope_mla_bf16"
        ]
    ),
    kernel_file!(
        "sampling.cu",
        [
            "argmax_f32",
            "argmax_f16",
            "argmax_bf16",
            "sample_f32",
            "sample_f16",
            "sample_bf16"
        ]
    ),
];

/// The newest PTX ISA the R580 driver (CUDA 13.0) JIT-compiles.
pub const MAX_PTX_VERSION: (u32, u32) = (9, 0);

/// Why a kernel file could not be turned into loadable PTX.
#[derive(Clone, Debug, thiserror::Error)]
pub enum KernelError {
    #[error(
        "NVRTC (libnvrtc.so.13) is not loadable: put the CUDA 13.0 NVRTC library on LD_LIBRARY_PATH \
         (bash ci/kernels.sh installs the pinned nvidia-cuda-nvrtc==13.0.88 wheel into .cache/cuda-wheels)"
    )]
    NvrtcMissing,
    #[error("`{arch}` is not a GPU architecture NVRTC 13 compiles for (expected sm_75 or newer, e.g. sm_90)")]
    BadArch { arch: String },
    #[error("cuda/{file} does not compile for {arch} (NVRTC {status}); options {options:?}; log:\n{log}")]
    Compile {
        file: String,
        arch: String,
        status: String,
        options: Vec<String>,
        log: String,
    },
    #[error("cuda/{file} for {arch}: PTX ISA {found} is newer than {max} (the newest the R580 / CUDA 13.0 driver loads): pin NVRTC 13.0.x")]
    PtxTooNew {
        file: String,
        arch: String,
        found: String,
        max: String,
    },
    #[error("cuda/{file} for {arch}: NVRTC error: {msg}")]
    Other { file: String, arch: String, msg: String },
}

/// Whether libnvrtc can be loaded (checked before any NVRTC call, which would
/// panic otherwise).
pub fn nvrtc_present() -> bool {
    // SAFETY: only tries to dlopen the library by its candidate names.
    unsafe { cudarc::nvrtc::sys::is_culib_present() }
}

/// `sm_90` -> 90 (accepts `sm_XY`, `compute_XY`, or `XY`); NVRTC 13 needs >= 75.
pub fn arch_number(arch: &str) -> Result<u32, KernelError> {
    let digits = arch
        .strip_prefix("sm_")
        .or_else(|| arch.strip_prefix("compute_"))
        .unwrap_or(arch);
    match digits.parse::<u32>() {
        Ok(n) if (75..1000).contains(&n) => Ok(n),
        _ => Err(KernelError::BadArch { arch: arch.into() }),
    }
}

/// The pinned NVRTC options for one architecture.
///
/// - `--gpu-architecture=compute_XY`: PTX for the device's own virtual arch
///   (the driver JITs it; NVRTC 13.0 emits PTX ISA 9.0, which R580 accepts).
/// - `-std=c++17`.
/// - `--fmad=false`: no FMA contraction, so `a*b + c` rounds the product
///   first, as the CPU engine's Rust code does (RoPE, RMSNorm squares, SiLU).
/// - no `--use_fast_math`: keeps IEEE `sqrtf` and division and the accurate
///   `expf` (fast math would swap in `__expf`, flush denormals to zero and
///   approximate division, moving results away from the f32 reference).
pub fn options(arch_num: u32) -> Vec<String> {
    vec![
        format!("--gpu-architecture=compute_{arch_num}"),
        "-std=c++17".into(),
        "--fmad=false".into(),
    ]
}

/// The full program text NVRTC compiles for `file`.
pub fn program_source(file: &KernelFile) -> String {
    format!("{COMMON}\n// ---- cuda/{} ----\n{}", file.name, file.source)
}

type Cache = Mutex<HashMap<(&'static str, u32), Result<Arc<String>, KernelError>>>;

/// PTX of `file` for `arch` (e.g. `sm_90`), compiled once per process.
pub fn ptx(file: &'static KernelFile, arch: &str) -> Result<Arc<String>, KernelError> {
    static CACHE: OnceLock<Cache> = OnceLock::new();
    let n = arch_number(arch)?;
    if !nvrtc_present() {
        return Err(KernelError::NvrtcMissing);
    }
    let cache = CACHE.get_or_init(Default::default);
    // Compiles under the lock: at most one NVRTC compile per (file, arch).
    let mut map = cache.lock().unwrap_or_else(|p| p.into_inner());
    map.entry((file.name, n))
        .or_insert_with(|| compile(file, n).map(Arc::new))
        .clone()
}

fn compile(file: &KernelFile, n: u32) -> Result<String, KernelError> {
    let arch = format!("sm_{n}");
    let opts = cudarc::nvrtc::CompileOptions {
        options: options(n),
        name: Some(file.name.to_string()),
        ..Default::default()
    };
    let ptx = cudarc::nvrtc::compile_ptx_with_opts(program_source(file), opts).map_err(|e| match e {
        cudarc::nvrtc::CompileError::CompileError { nvrtc, options, log } => KernelError::Compile {
            file: file.name.into(),
            arch: arch.clone(),
            status: format!("{nvrtc:?}"),
            options,
            log: log.to_string_lossy().into_owned(),
        },
        other => KernelError::Other {
            file: file.name.into(),
            arch: arch.clone(),
            msg: format!("{other:?}"),
        },
    })?;
    let text = ptx.to_src();
    if let Some(found) = ptx_version(&text) {
        if found > MAX_PTX_VERSION {
            return Err(KernelError::PtxTooNew {
                file: file.name.into(),
                arch,
                found: format!("{}.{}", found.0, found.1),
                max: format!("{}.{}", MAX_PTX_VERSION.0, MAX_PTX_VERSION.1),
            });
        }
    }
    Ok(text)
}

/// The `.version X.Y` line of a PTX text.
pub fn ptx_version(ptx: &str) -> Option<(u32, u32)> {
    let line = ptx.lines().find_map(|l| l.trim().strip_prefix(".version "))?;
    let (a, b) = line.trim().split_once('.')?;
    Some((a.parse().ok()?, b.parse().ok()?))
}

/// Whether `ptx` defines kernel entry `name`.
pub fn has_entry(ptx: &str, name: &str) -> bool {
    ptx.lines().any(|l| {
        let l = l.trim();
        l.starts_with(".visible .entry") && l.split([' ', '(']).any(|w| w == name)
    })
}

/// The `extern "C" __global__` names defined in a source text (to check `FILES`
/// against the sources without a compiler).
pub fn declared_kernels(source: &str) -> Vec<String> {
    let mut names = Vec::new();
    let mut prefixes: Vec<String> = Vec::new();
    for line in source.lines() {
        let Some(rest) = line.split("__global__ void ").nth(1) else {
            continue;
        };
        let name: String = rest
            .chars()
            .take_while(|c| c.is_alphanumeric() || *c == '_' || *c == '#')
            .collect();
        if let Some(stem) = name.strip_suffix("##SUFFIX") {
            prefixes.push(stem.to_string());
        } else if name != "NAME" {
            names.push(name);
        }
    }
    // Macro-generated families: `FOO_OPS(f32, float)` instantiates `<prefix>f32`.
    for line in source.lines() {
        let l = line.trim();
        if l.starts_with('#') || !l.contains("_OPS(") {
            continue;
        }
        if let Some(args) = l.split_once('(').map(|(_, a)| a) {
            let suffix: String = args.chars().take_while(|c| *c != ',').collect();
            for p in &prefixes {
                names.push(format!("{p}{}", suffix.trim()));
            }
        }
    }
    // `X_OP(name, ...)` instantiations.
    for line in source.lines() {
        let l = line.trim();
        if l.starts_with('#') {
            continue;
        }
        if let Some((mac, args)) = l.split_once('(') {
            if mac.ends_with("_OP") && !mac.contains(' ') {
                names.push(
                    args.chars()
                        .take_while(|c| *c != ',')
                        .collect::<String>()
                        .trim()
                        .to_string(),
                );
            }
        }
    }
    names.sort();
    names
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn registry_matches_the_sources() {
        for f in FILES {
            let mut listed: Vec<String> = f.kernels.iter().map(|s| s.to_string()).collect();
            listed.sort();
            assert_eq!(declared_kernels(f.source), listed, "cuda/{}", f.name);
            for k in f.kernels {
                let (op, dtype) = k.rsplit_once('_').unwrap();
                assert!(
                    !op.is_empty() && ["f32", "f16", "bf16", "u32", "u16"].contains(&dtype),
                    "{k}: not op_dtype"
                );
            }
        }
        let mut all: Vec<&str> = FILES.iter().flat_map(|f| f.kernels.iter().copied()).collect();
        let n = all.len();
        all.sort();
        all.dedup();
        assert_eq!(all.len(), n, "a kernel name is defined twice");
    }

    #[test]
    fn options_are_pinned() {
        assert_eq!(
            options(90),
            ["--gpu-architecture=compute_90", "-std=c++17", "--fmad=false"]
        );
        assert!(!options(80).iter().any(|o| o.contains("fast_math")));
        assert_eq!(arch_number("sm_90").unwrap(), 90);
        assert_eq!(arch_number("compute_80").unwrap(), 80);
        assert!(arch_number("sm_70").is_err(), "NVRTC 13 dropped sm_70");
        assert!(arch_number("hopper").is_err());
    }

    #[test]
    fn ptx_parsing() {
        let ptx = "//\n.version 9.0\n.target sm_90\n.visible .entry rmsnorm_f32(\n\t.param .u64 a\n)\n";
        assert_eq!(ptx_version(ptx), Some((9, 0)));
        assert!(has_entry(ptx, "rmsnorm_f32"));
        assert!(!has_entry(ptx, "rmsnorm_f16"));
        assert!((9, 5) > MAX_PTX_VERSION && (8, 8) <= MAX_PTX_VERSION);
    }
}
