//! Running the blocks of one launch: begun and ended once in `runtime.cpp`
//! (which checks the launch, and keeps the failure of the lowest block index),
//! the blocks in between run as ranges on rayon's pool, or all on the calling
//! thread.
//!
//! Why blocks may run anywhere in any order: CUDA gives the blocks of a grid
//! no order and no way to wait for one another, so a correct kernel's blocks
//! write what they write whatever the split; every block runs on one OS thread
//! with its own fibers and shared memory, under the same schedule as in the
//! serial order, so each block's arithmetic is the serial one bit for bit. A
//! kernel whose blocks race (two blocks writing one element) is a bug the
//! serial order hides and the parallel one may show as a changed value.

use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, Ordering};

use rayon::prelude::*;

use super::{ffi, LaunchConfig};

/// The work (in plain-call threads, about 5 ns each) below which a launch
/// runs on the calling thread: waking rayon's workers costs microseconds,
/// and on a loaded machine a wake-up can wait for a time slice, so a decode
/// step's many small launches (a few thousand elementwise threads) are
/// cheaper serial.
const MIN_PARALLEL_WORK: u64 = 1 << 16;
/// What a thread that waits (barriers, shuffles: a context switch at each,
/// a dozen in a block reduction) costs, in plain-call threads.
const WAITING_THREAD_WORK: u64 = 64;
/// Ranges per worker: blocks differ in cost (attention rows see more keys
/// further down) and a worker may lose its core for a while, so several
/// ranges each balance the load.
const RANGES_PER_THREAD: u64 = 8;

/// Whether a launch's blocks are split over rayon's workers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Split {
    /// When the estimated work is worth it (and the pool has 2+ workers).
    Auto,
    /// Never: every block on the calling thread, in order.
    Never,
    /// Whenever there are 2+ blocks (tests).
    #[cfg_attr(not(test), allow(dead_code))]
    Always,
}

/// The launch handle, shared by the workers: `runtime.cpp` synchronises what
/// they write to it (an atomic and a mutex), and it lives until `run` ends it.
#[derive(Clone, Copy)]
struct Handle(*mut c_void);
// SAFETY: see above; the handle outlives every range run on it (the parallel
// loop returns before `ts_emu_launch_end`).
unsafe impl Send for Handle {}
unsafe impl Sync for Handle {}

impl Handle {
    /// The pointer, through a method so that closures capture the whole
    /// (Send) handle rather than its raw-pointer field.
    fn ptr(self) -> *mut c_void {
        self.0
    }
}

/// Runs kernel `index` over the grid of `cfg` with `slots` (its parameters,
/// each in an 8-byte slot), split over rayon's pool or not by `split`, and
/// returns the result of the lowest failed block, or
/// success. `waits`: whether the kernel's threads waited at its last launch
/// (updated here), for the estimate of whether this one is worth splitting.
///
/// # Safety
/// `slots` hold the kernel's parameters by its signature, and every pointer
/// among them is null or into a live emulator buffer.
pub(super) unsafe fn run(
    index: i32,
    cfg: LaunchConfig,
    slots: &mut [[u8; 8]],
    split: Split,
    waits: &AtomicBool,
) -> ffi::LaunchResult {
    let mut ptrs: Vec<*mut c_void> = slots.iter_mut().map(|s| s.as_mut_ptr() as *mut c_void).collect();
    let grid = [cfg.grid.0, cfg.grid.1, cfg.grid.2];
    let block = [cfg.block.0, cfg.block.1, cfg.block.2];
    let mut res = ffi::LaunchResult {
        code: 0,
        fault_write: 0,
        fault_addr: 0,
        fault_block: [0; 3],
        fault_thread: [0; 3],
        msg: [0; 512],
    };
    // SAFETY: the pointers are valid for the call; `ptrs` and `slots` outlive
    // the launch (ended below, before they are dropped).
    let h = unsafe {
        ffi::ts_emu_launch_begin(
            index,
            grid.as_ptr(),
            block.as_ptr(),
            cfg.shared_bytes as usize,
            ptrs.as_mut_ptr(),
            &mut res,
        )
    };
    if h.is_null() {
        return res;
    }
    let h = Handle(h);
    let blocks = grid.iter().map(|&g| g as u64).product::<u64>();
    let per_block = block.iter().map(|&b| b as u64).product::<u64>();
    let workers = rayon::current_num_threads() as u64;
    let per_thread = if waits.load(Ordering::Relaxed) {
        WAITING_THREAD_WORK
    } else {
        1
    };
    let parallel = blocks >= 2
        && match split {
            Split::Never => false,
            Split::Always => true,
            Split::Auto => workers >= 2 && blocks * per_block * per_thread >= MIN_PARALLEL_WORK,
        };
    // SAFETY (both arms): h is a live launch; the ranges are disjoint and
    // inside the grid.
    if !parallel {
        unsafe { ffi::ts_emu_launch_run(h.ptr(), 0, blocks) };
    } else {
        let per = blocks.div_ceil(workers.max(1) * RANGES_PER_THREAD).max(1);
        (0..blocks.div_ceil(per))
            .into_par_iter()
            .for_each(|r| unsafe { ffi::ts_emu_launch_run(h.ptr(), r * per, ((r + 1) * per).min(blocks)) });
    }
    // SAFETY: every range has returned; h is ended once.
    unsafe {
        waits.store(ffi::ts_emu_launch_waited(h.ptr()) != 0, Ordering::Relaxed);
        ffi::ts_emu_launch_end(h.ptr(), &mut res)
    };
    res
}
