//! Host emulation of the CUDA device: every kernel in `cuda/` compiled for the
//! CPU at build time (`build.rs`, `cuda/emu/emu.hpp`, `cuda/emu/runtime.cpp`)
//! and launched by name with a grid, a block, dynamic shared memory and typed
//! arguments, so the kernels run in CI without a GPU.
//!
//! - Execution: the blocks of a grid run in parallel on rayon's pool
//!   (`grid.rs`; CUDA gives the blocks of a grid no order, so any split
//!   computes what the serial order does, bit for bit), or one after another
//!   on the calling thread with `TOUCHSTONE_EMU_THREADS=1` or `Emu::serial`;
//!   the threads of a block are fibers with true barrier semantics
//!   (`__syncthreads` opens when every live thread is at it) and warp
//!   shuffles that exchange only once all 32 lanes have arrived. A barrier or
//!   shuffle that not every thread reaches is reported as a deadlock. When
//!   several blocks fail, the lowest block index is reported, as the serial
//!   order would. A thread runs as a plain call until it first waits, so a
//!   kernel without barriers or shuffles costs no context switch.
//! - Memory: "device memory" is host memory with guard regions. Every
//!   allocation ends on an inaccessible page and starts after a canary (and a
//!   page before that): the first access past the end faults at once, and the
//!   fault is reported with the kernel, the block and thread that made it, and
//!   the buffer and byte offset; a write into the canary before the start is
//!   found by the check after every launch of the buffers it was handed
//!   (kernel, buffer, offset). Fresh allocations hold 0xff bytes (a NaN)
//!   until written; freed mappings are reused for allocations of their size.
//! - Arguments are checked against the kernel's C++ signature (count, pointer
//!   or scalar, element and scalar types) before the launch.
//!
//! The API is the shape of a device: `alloc`/`upload`/`download`/`launch`, so
//! a `Device` trait over cudarc and this emulator can drive the same engine.

use std::collections::{BTreeMap, HashMap};
use std::ffi::{c_char, CStr};
use std::marker::PhantomData;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock};

mod ffi {
    use std::ffi::{c_char, c_void};

    #[repr(C)]
    #[derive(Clone, Copy, Debug)]
    pub struct Alloc {
        pub map: *mut c_void,
        pub map_len: usize,
        pub ptr: *mut c_void,
        pub bytes: usize,
        pub front: usize,
    }

    #[repr(C)]
    pub struct LaunchResult {
        pub code: i32,
        pub fault_write: i32,
        pub fault_addr: u64,
        pub fault_block: [u32; 3],
        pub fault_thread: [u32; 3],
        pub msg: [c_char; 512],
    }

    extern "C" {
        pub fn ts_emu_kernel_count() -> i32;
        pub fn ts_emu_launch_begin(
            index: i32,
            grid: *const u32,
            block: *const u32,
            dyn_bytes: usize,
            args: *mut *mut c_void,
            res: *mut LaunchResult,
        ) -> *mut c_void;
        pub fn ts_emu_launch_run(h: *mut c_void, first: u64, end: u64);
        pub fn ts_emu_launch_end(h: *mut c_void, res: *mut LaunchResult) -> i32;
        pub fn ts_emu_launch_waited(h: *mut c_void) -> i32;
        pub fn ts_emu_kernel_name(i: i32) -> *const c_char;
        pub fn ts_emu_kernel_signature(i: i32) -> *const c_char;
        pub fn ts_emu_alloc_guarded(bytes: usize, out: *mut Alloc) -> i32;
        pub fn ts_emu_free_guarded(a: *const Alloc);
        pub fn ts_emu_guarded_len(bytes: usize) -> usize;
        pub fn ts_emu_reuse_guarded(bytes: usize, a: *mut Alloc);
        pub fn ts_emu_check_guarded(a: *const Alloc) -> i64;
        pub fn ts_emu_test_f32_to_f16(x: f32) -> u16;
        pub fn ts_emu_test_f16_to_f32(h: u16) -> f32;
    }
}

/// An element type of emulated device memory, named as the kernel signatures
/// name it (`f32`, `f16`, `u32`, ...).
pub trait EmuType: Copy + Send + Sync + 'static {
    const NAME: &'static str;
}
macro_rules! emu_type {
    ($($t:ty => $n:literal),*) => { $(impl EmuType for $t { const NAME: &'static str = $n; })* };
}
emu_type!(f32 => "f32", f64 => "f64", i32 => "i32", u32 => "u32", i64 => "i64", u64 => "u64", u16 => "u16",
          half::f16 => "f16", half::bf16 => "bf16");

/// One live allocation, for naming the buffer an address falls in.
struct Record {
    emu: u64,
    label: String,
    raw: ffi::Alloc,
}
// SAFETY: the raw pointers are addresses of an mmap owned by the DevBuf; the
// registry only reads them (and the canary bytes, through the C check).
unsafe impl Send for Record {}

/// Every live allocation by the start of its mapping (ordered, so the one an
/// address falls in is found in O(log n)).
fn registry() -> &'static Mutex<BTreeMap<u64, Record>> {
    static R: OnceLock<Mutex<BTreeMap<u64, Record>>> = OnceLock::new();
    R.get_or_init(|| Mutex::new(BTreeMap::new()))
}
static NEXT_ID: AtomicU64 = AtomicU64::new(1);

/// A buffer of emulated device memory (`len` elements of `T`), between guard
/// regions. Freed on drop.
pub struct DevBuf<T: EmuType> {
    raw: ffi::Alloc,
    len: usize,
    _t: PhantomData<T>,
}
// SAFETY: the memory is a private mapping owned by this value; kernels write
// it only during a launch, which borrows the buffer through an `Arg`.
unsafe impl<T: EmuType> Send for DevBuf<T> {}
unsafe impl<T: EmuType> Sync for DevBuf<T> {}

impl<T: EmuType> DevBuf<T> {
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// The buffer as a kernel argument (a `T*` to its first element).
    pub fn arg(&self) -> Arg<'_> {
        self.arg_at(0)
    }
    /// A pointer to element `offset` (a view, as cudarc's `slice(offset..)`).
    pub fn arg_at(&self, offset: usize) -> Arg<'_> {
        assert!(
            offset <= self.len,
            "arg_at({offset}) past the end of a buffer of {} elements",
            self.len
        );
        Arg::Ptr {
            addr: self.raw.ptr as u64 + (offset * std::mem::size_of::<T>()) as u64,
            elem: T::NAME,
            _l: PhantomData,
        }
    }
    /// A copy of the contents.
    pub fn to_vec(&self) -> Vec<T> {
        let mut v = Vec::with_capacity(self.len);
        // SAFETY: ptr holds len initialised (bit-valid for every EmuType) elements.
        unsafe {
            std::ptr::copy_nonoverlapping(self.raw.ptr as *const T, v.as_mut_ptr(), self.len);
            v.set_len(self.len);
        }
        v
    }
    /// A copy of elements `range`.
    pub fn read_range(&self, range: std::ops::Range<usize>) -> Vec<T> {
        assert!(
            range.start <= range.end && range.end <= self.len,
            "read_range {range:?} of {} elements",
            self.len
        );
        let n = range.len();
        let mut v = Vec::with_capacity(n);
        // SAFETY: range is inside the len initialised elements (asserted).
        unsafe {
            std::ptr::copy_nonoverlapping((self.raw.ptr as *const T).add(range.start), v.as_mut_ptr(), n);
            v.set_len(n);
        }
        v
    }
    /// Elements `range`, read in place (the host GEMM's operands, which a
    /// copy made the emulated engine spend its time in page faults).
    ///
    /// # Safety
    /// Nothing writes the buffer (`write_at`, `copy_from`, a launch) while
    /// the slice lives.
    pub unsafe fn slice(&self, range: std::ops::Range<usize>) -> &[T] {
        assert!(
            range.start <= range.end && range.end <= self.len,
            "slice {range:?} of {} elements",
            self.len
        );
        // SAFETY: in bounds (asserted), initialised; no writer (the caller's contract).
        unsafe { std::slice::from_raw_parts((self.raw.ptr as *const T).add(range.start), range.len()) }
    }
    /// Overwrites elements `offset..offset + data.len()`.
    pub fn write_at(&self, offset: usize, data: &[T]) {
        assert!(
            offset + data.len() <= self.len,
            "write_at({offset}, {} elements) past the end of {}",
            data.len(),
            self.len
        );
        // SAFETY: in bounds (asserted); no launch runs on this thread now.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), (self.raw.ptr as *mut T).add(offset), data.len()) }
    }
    /// Overwrites the contents.
    pub fn copy_from(&self, data: &[T]) {
        assert_eq!(data.len(), self.len, "copy_from: length mismatch");
        // SAFETY: ptr has room for len elements; no launch runs on this thread now.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), self.raw.ptr as *mut T, self.len) }
    }
}

impl<T: EmuType> Drop for DevBuf<T> {
    fn drop(&mut self) {
        registry().lock().unwrap().remove(&(self.raw.map as u64));
        let mut pool = pool().lock().unwrap();
        if pool.bytes + self.raw.map_len <= POOL_BYTES {
            pool.bytes += self.raw.map_len;
            pool.free.entry(self.raw.map_len).or_default().push(Mapping(self.raw));
        } else {
            // SAFETY: raw came from ts_emu_alloc_guarded and is freed once.
            unsafe { ffi::ts_emu_free_guarded(&self.raw) }
        }
    }
}

/// Mappings of freed buffers, by length, for the next allocation of that
/// length: every step of the engine allocates its stage buffers afresh, and
/// a new mapping each time (mmap, two mprotects, a page fault per page,
/// munmap) doubled the emulated engine's system time.
struct Pool {
    free: HashMap<usize, Vec<Mapping>>,
    bytes: usize,
}
/// A freed mapping (owned by the pool; no buffer refers to it).
struct Mapping(ffi::Alloc);
// SAFETY: the pool owns the mapping; it is only handed to one new buffer.
unsafe impl Send for Mapping {}
/// The most bytes of mappings the pool keeps (the rest are unmapped).
const POOL_BYTES: usize = 256 << 20;

fn pool() -> &'static Mutex<Pool> {
    static P: OnceLock<Mutex<Pool>> = OnceLock::new();
    P.get_or_init(|| {
        Mutex::new(Pool {
            free: HashMap::new(),
            bytes: 0,
        })
    })
}

/// A kernel argument, in the order the kernel declares its parameters.
#[derive(Clone, Copy, Debug)]
pub enum Arg<'a> {
    /// A device pointer (from `DevBuf::arg`/`arg_at`).
    Ptr {
        addr: u64,
        elem: &'static str,
        _l: PhantomData<&'a ()>,
    },
    /// A null pointer, for any pointer parameter (e.g. attention's untapped probs).
    Null,
    I32(i32),
    U32(u32),
    I64(i64),
    U64(u64),
    U16(u16),
    F32(f32),
    F64(f64),
}

impl Arg<'_> {
    fn describe(&self) -> String {
        match self {
            Arg::Ptr { elem, .. } => format!("a {elem} buffer"),
            Arg::Null => "NULL".into(),
            Arg::I32(_) => "i32".into(),
            Arg::U32(_) => "u32".into(),
            Arg::I64(_) => "i64".into(),
            Arg::U64(_) => "u64".into(),
            Arg::U16(_) => "u16".into(),
            Arg::F32(_) => "f32".into(),
            Arg::F64(_) => "f64".into(),
        }
    }
    /// The value's bytes (little-endian, at the start of an 8-byte slot), if
    /// it fits parameter type `param` ("*const f32", "i32", ...).
    fn slot(&self, param: &str) -> Option<[u8; 8]> {
        let mut s = [0u8; 8];
        let pointee = param.strip_prefix("*const ").or_else(|| param.strip_prefix("*mut "));
        match (self, pointee) {
            (Arg::Ptr { addr, elem, .. }, Some(p)) if *elem == p => s.copy_from_slice(&addr.to_le_bytes()),
            (Arg::Null, Some(_)) => {}
            (Arg::I32(v), None) if param == "i32" => s[..4].copy_from_slice(&v.to_le_bytes()),
            (Arg::U32(v), None) if param == "u32" => s[..4].copy_from_slice(&v.to_le_bytes()),
            (Arg::I64(v), None) if param == "i64" => s.copy_from_slice(&v.to_le_bytes()),
            (Arg::U64(v), None) if param == "u64" => s.copy_from_slice(&v.to_le_bytes()),
            (Arg::U16(v), None) if param == "u16" => s[..2].copy_from_slice(&v.to_le_bytes()),
            (Arg::F32(v), None) if param == "f32" => s[..4].copy_from_slice(&v.to_le_bytes()),
            (Arg::F64(v), None) if param == "f64" => s.copy_from_slice(&v.to_le_bytes()),
            _ => return None,
        }
        Some(s)
    }
}

macro_rules! arg_from {
    ($($t:ty => $v:ident),*) => { $(impl From<$t> for Arg<'_> { fn from(x: $t) -> Self { Arg::$v(x) } })* };
}
arg_from!(i32 => I32, u32 => U32, i64 => I64, u64 => U64, u16 => U16, f32 => F32, f64 => F64);

/// Grid, block and dynamic shared memory of a launch (cudarc's `LaunchConfig`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LaunchConfig {
    pub grid: (u32, u32, u32),
    pub block: (u32, u32, u32),
    pub shared_bytes: u32,
}

impl From<super::launch::Launch> for LaunchConfig {
    fn from(l: super::launch::Launch) -> Self {
        LaunchConfig {
            grid: l.grid,
            block: (l.block, 1, 1),
            shared_bytes: l.smem,
        }
    }
}

struct KernelInfo {
    index: i32,
    params: Vec<String>,
    signature: String,
    /// Whether its threads waited (barriers, shuffles) at its last launch:
    /// such threads cost far more than plain calls (`grid::run`'s estimate).
    waits: AtomicBool,
}

fn kernels() -> &'static HashMap<String, KernelInfo> {
    static K: OnceLock<HashMap<String, KernelInfo>> = OnceLock::new();
    K.get_or_init(|| {
        let cstr = |p: *const c_char| unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned();
        // SAFETY: the table is static; indices are in range.
        let n = unsafe { ffi::ts_emu_kernel_count() };
        (0..n)
            .map(|i| {
                let name = cstr(unsafe { ffi::ts_emu_kernel_name(i) });
                let signature = cstr(unsafe { ffi::ts_emu_kernel_signature(i) });
                let params = signature
                    .split(", ")
                    .filter(|s| !s.is_empty())
                    .map(str::to_string)
                    .collect();
                (
                    name,
                    KernelInfo {
                        index: i,
                        params,
                        signature,
                        waits: AtomicBool::new(true),
                    },
                )
            })
            .collect()
    })
}

/// Every emulated kernel's name (production kernels as in compile.rs, planted
/// variants as `planted_<bug>/<kernel>`) and C++ signature.
pub fn kernel_names() -> Vec<(String, String)> {
    let mut v: Vec<_> = kernels()
        .iter()
        .map(|(k, i)| (k.clone(), i.signature.clone()))
        .collect();
    v.sort();
    v
}

/// The emulated device: its allocations, and how many OS threads run the
/// blocks of its launches.
pub struct Emu {
    id: u64,
    split: grid::Split,
}

impl Default for Emu {
    fn default() -> Self {
        Self::new()
    }
}

impl Emu {
    /// A device whose launches run their blocks on rayon's pool, or on the
    /// calling thread only when `TOUCHSTONE_EMU_THREADS=1`.
    pub fn new() -> Emu {
        let serial = std::env::var("TOUCHSTONE_EMU_THREADS").is_ok_and(|v| v.trim() == "1");
        Emu {
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
            split: if serial { grid::Split::Never } else { grid::Split::Auto },
        }
    }

    /// A device whose launches run their blocks one after another on the
    /// calling thread (the reference the parallel launches are tested against).
    pub fn serial() -> Emu {
        Emu {
            split: grid::Split::Never,
            ..Emu::new()
        }
    }

    /// A device that splits every launch of two blocks or more over rayon's
    /// pool, however small (for tests: a small faulting grid runs in parallel).
    #[cfg(test)]
    pub(crate) fn split_always() -> Emu {
        Emu {
            split: grid::Split::Always,
            ..Emu::new()
        }
    }

    /// `len` elements, uninitialised (0xff bytes), between guards; `label`
    /// names the buffer in reports.
    pub fn alloc<T: EmuType>(&self, label: &str, len: usize) -> DevBuf<T> {
        let bytes = len * std::mem::size_of::<T>();
        let mut raw = ffi::Alloc {
            map: std::ptr::null_mut(),
            map_len: 0,
            ptr: std::ptr::null_mut(),
            bytes: 0,
            front: 0,
        };
        // SAFETY: pure function.
        let map_len = unsafe { ffi::ts_emu_guarded_len(bytes) };
        let reused = {
            let mut pool = pool().lock().unwrap();
            let m = pool.free.get_mut(&map_len).and_then(Vec::pop);
            if m.is_some() {
                pool.bytes -= map_len;
            }
            m
        };
        if let Some(Mapping(m)) = reused {
            raw = m;
            // SAFETY: m is a pooled mapping of this length, owned by no buffer.
            unsafe { ffi::ts_emu_reuse_guarded(bytes, &mut raw) };
        } else {
            // SAFETY: writes `raw`.
            let rc = unsafe { ffi::ts_emu_alloc_guarded(bytes, &mut raw) };
            assert_eq!(rc, 0, "emulator: cannot map {bytes} bytes for `{label}`");
        }
        registry().lock().unwrap().insert(
            raw.map as u64,
            Record {
                emu: self.id,
                label: label.to_string(),
                raw,
            },
        );
        DevBuf {
            raw,
            len,
            _t: PhantomData,
        }
    }

    /// Bytes requested by this device's live allocations (guards not counted).
    pub fn live_bytes(&self) -> usize {
        registry()
            .lock()
            .unwrap()
            .values()
            .filter(|r| r.emu == self.id)
            .map(|r| r.raw.bytes)
            .sum()
    }

    /// A buffer holding a copy of `data`.
    pub fn upload<T: EmuType>(&self, label: &str, data: &[T]) -> DevBuf<T> {
        let b = self.alloc(label, data.len());
        b.copy_from(data);
        b
    }

    /// Runs `kernel` over the grid, synchronously, then checks the canaries of
    /// the buffers it was handed.
    pub fn launch(&self, kernel: &str, cfg: LaunchConfig, args: &[Arg<'_>]) -> Result<(), EmuError> {
        let info = kernels()
            .get(kernel)
            .ok_or_else(|| EmuError::UnknownKernel(kernel.into()))?;
        let bad = |msg: String| EmuError::Arguments {
            kernel: kernel.into(),
            signature: info.signature.clone(),
            msg,
        };
        if args.len() != info.params.len() {
            return Err(bad(format!(
                "{} arguments given, {} declared",
                args.len(),
                info.params.len()
            )));
        }
        let mut slots: Vec<[u8; 8]> = Vec::with_capacity(args.len());
        for (i, (a, p)) in args.iter().zip(&info.params).enumerate() {
            slots.push(
                a.slot(p)
                    .ok_or_else(|| bad(format!("argument {i} is {}, declared `{p}`", a.describe())))?,
            );
        }
        // SAFETY: the arguments match the kernel's parameter types (checked
        // above) and every pointer is a live DevBuf (borrowed by `args`) or null;
        // out-of-bounds accesses land in guards and are reported, not UB for us.
        let res = unsafe { grid::run(info.index, cfg, &mut slots, self.split, &info.waits) };
        match res.code {
            0 => {}
            1 => {
                return Err(EmuError::Fault {
                    kernel: kernel.into(),
                    block: (res.fault_block[0], res.fault_block[1], res.fault_block[2]),
                    thread: (res.fault_thread[0], res.fault_thread[1], res.fault_thread[2]),
                    access: match res.fault_write {
                        1 => Access::Write,
                        0 => Access::Read,
                        _ => Access::Unknown,
                    },
                    location: locate(res.fault_addr),
                })
            }
            _ => {
                let msg = unsafe { CStr::from_ptr(res.msg.as_ptr()) }
                    .to_string_lossy()
                    .into_owned();
                return Err(EmuError::Kernel {
                    kernel: kernel.into(),
                    msg,
                });
            }
        }
        // Only the buffers the kernel was handed: a pointer below a buffer
        // lands in its own canary, then its leading guard page (a fault), so
        // no other buffer's canary is reachable. Checking every live buffer
        // (the weights included) after every launch was a tenth of the
        // emulated engine's time.
        let reg = registry().lock().unwrap();
        for a in args {
            let Arg::Ptr { addr, .. } = a else { continue };
            let Some((_, r)) = reg.range(..=addr).next_back() else {
                continue;
            };
            // SAFETY: r.raw is live (records are removed before their buffer is freed).
            let off = unsafe { ffi::ts_emu_check_guarded(&r.raw) };
            if off != 0 {
                return Err(EmuError::Guard {
                    kernel: kernel.into(),
                    location: Location::Buffer {
                        buffer: r.label.clone(),
                        bytes: r.raw.bytes,
                        offset: off,
                    },
                });
            }
        }
        Ok(())
    }
}

/// The buffer (of any emulated device) whose mapping holds `addr`.
fn locate(addr: u64) -> Location {
    if let Some((&map, r)) = registry().lock().unwrap().range(..=addr).next_back() {
        if addr < map + r.raw.map_len as u64 {
            return Location::Buffer {
                buffer: r.label.clone(),
                bytes: r.raw.bytes,
                offset: addr as i64 - r.raw.ptr as i64,
            };
        }
    }
    Location::Wild { addr }
}

/// The emulation's f32 -> f16 conversion (the device's `cvt.rn.f16.f32`), for tests.
pub fn emu_f32_to_f16(x: f32) -> u16 {
    // SAFETY: pure function.
    unsafe { ffi::ts_emu_test_f32_to_f16(x) }
}
/// The emulation's f16 -> f32 conversion (`cvt.f32.f16`), for tests.
pub fn emu_f16_to_f32(h: u16) -> f32 {
    // SAFETY: pure function.
    unsafe { ffi::ts_emu_test_f16_to_f32(h) }
}

mod grid;
mod report;
pub use report::{Access, EmuError, Location};

#[cfg(test)]
pub(crate) mod tests;
