//! The CUDA engine: the same Llama/Qwen2 decoder as the CPU reference engine,
//! stage for stage, with its kernels in `cuda/*.cu` compiled at run time by
//! NVRTC and driven through cudarc. It is always compiled (cudarc loads
//! libcuda, libnvrtc and libcublas dynamically); without a driver or a device
//! it reports `Unavailable(reason)` and is never run.
//!
//! - `compile`: the embedded kernel sources, pinned NVRTC options, PTX cache.
//! - `device`: the engine (weights upload, forward pass, taps, sampling).
//! - `forward`: the forward pass over a batch of sequences (a run: one).
//! - `emu`: the kernels compiled for the host and run on an emulated device
//!   (fibers, guarded memory), so they execute in CI without a GPU.
//! - `guard`: guard regions around device outputs (host-side checking).
//! - `launch`: launch configurations and cuBLAS argument mapping.
//! - `multimodal`: a VLM's step: image fusion, M-RoPE positions, deepstack.
//! - `paged`: the device KV pool and its bookkeeping (kept across requests).
//! - `reference`: host mirrors of device-side decisions, for tests.
//! - `seam`: the device interface `device` drives: the real device (cudarc)
//!   or the emulated one (engine `cuda-emu`).
//! - `serve`: batches over a paged KV cache kept across requests.
//! - `storage`: the storage types (f32, f16, bf16) and their guard sentinels.
//! - `vision`: the VLM vision tower (Qwen2-VL, Qwen3-VL) on the device;
//!   `clip`: LLaVA's CLIP tower, projector and NeXT packing.
//! - `weights`: device copies of linear layers and of the vision tower.

pub mod compile;
mod block_weights;
mod device;
pub mod emu;
mod forward;
mod mla;
mod moe;
pub mod guard;
pub mod launch;
mod multimodal;
mod paged;
pub mod reference;
pub mod seam;
mod serve;
mod step;
pub mod storage;
mod clip;
mod clip_weights;
mod vision;
mod weights;

use std::sync::{Arc, OnceLock};

use cudarc::driver::CudaContext;

use super::Availability;

pub use device::{load, load_emu, CudaEngine};

/// The reason given when libcuda cannot be loaded.
pub const NO_DRIVER: &str = "libcuda.so.1 not found (no NVIDIA driver): the CUDA engine needs the NVIDIA \
                             driver library on the loader path; nothing was run on a GPU";

/// The process's CUDA context on device 0, created once. `Err` carries the
/// reason the engine is unavailable.
pub(crate) fn context() -> Result<Arc<CudaContext>, String> {
    static CTX: OnceLock<Result<Arc<CudaContext>, String>> = OnceLock::new();
    CTX.get_or_init(|| {
        // CudaContext::new panics (rather than returning Err) without libcuda.
        // SAFETY: only tries to dlopen the driver library.
        if !unsafe { cudarc::driver::sys::is_culib_present() } {
            return Err(NO_DRIVER.to_string());
        }
        let n = CudaContext::device_count()
            .map_err(|e| format!("the NVIDIA driver is loaded but reports no usable CUDA device ({e})"))?;
        if n < 1 {
            return Err("the NVIDIA driver is loaded but reports 0 CUDA devices".into());
        }
        CudaContext::new(0).map_err(|e| format!("cannot create a CUDA context on device 0: {e}"))
    })
    .clone()
}

/// Device memory in use on device 0 (total − free, all processes), for the
/// memory-growth check of `tests/cuda_device.rs`.
pub fn device_memory_used() -> Result<usize, String> {
    let ctx = context()?;
    ctx.bind_to_thread().map_err(|e| e.to_string())?;
    let (free, total) = ctx.mem_get_info().map_err(|e| e.to_string())?;
    Ok(total - free)
}

/// Whether the CUDA engine can run here: driver, device, NVRTC and cuBLAS.
pub fn availability() -> Availability {
    if let Err(reason) = context() {
        return Availability::Unavailable(reason);
    }
    if !compile::nvrtc_present() {
        return Availability::Unavailable(
            "libnvrtc.so.13 not found (CUDA 13 NVRTC): the CUDA engine compiles its kernels at run time; \
             put the toolkit's lib folder on LD_LIBRARY_PATH"
                .into(),
        );
    }
    // SAFETY: only tries to dlopen the library.
    if !unsafe { cudarc::cublas::sys::is_culib_present() } {
        return Availability::Unavailable(
            "libcublas.so.13 not found (CUDA 13 cuBLAS): the CUDA engine's matrix products use cuBLAS; \
             put the toolkit's lib folder on LD_LIBRARY_PATH"
                .into(),
        );
    }
    Availability::Available
}
