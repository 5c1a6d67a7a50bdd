//! The device seam: everything the CUDA engine's host code (`device.rs`) asks
//! of a device — buffers, uploads, kernel launches with a grid, a block and
//! dynamic shared memory, device-to-device copies, copies back, the GEMM —
//! goes through `Dev`, which has two implementations:
//!
//! - `Dev::Cuda`: the real device through cudarc (driver, NVRTC PTX, cuBLAS),
//!   issuing exactly the calls `device.rs` issued before the seam existed (the
//!   same `launch_builder` arguments, typed views included, so cudarc's stream
//!   synchronisation tracking sees the same reads and writes; the same
//!   `CudaBlas::gemm`).
//! - `Dev::Emu`: the host emulation (`emu.rs`): every kernel compiled for the
//!   CPU and launched by name with signature-checked arguments, guarded
//!   memory; cuBLAS is served by a host GEMM (`emu_gemm`) taking the very
//!   operand layouts, transposes and leading dimensions of the cuBLAS call,
//!   accumulating in f32 and rounding the output to the storage type.
//!
//! Why enums, not a `Device` trait with associated buffer types: a kernel's
//! argument list mixes buffers of several element types (`*const bf16`,
//! `*mut f32`, `*const u32`) with scalars, in one slice. With a trait, that
//! slice needs a type-erased argument per backend anyway, plus generic
//! associated types for `Buf<S>` threaded through every struct of the engine
//! (`DevWeights<D, T>`, `RunState<D, T>`, ...) and `where` clauses on each.
//! The enums keep the engine's types as they were (one type parameter, the
//! storage type), erase nothing but the backend, and make the one runtime
//! choice — which device — a `match` in this file only. A buffer of one
//! backend handed to the other is a bug of this file, reported as such.

use std::ops::{Bound, Range, RangeBounds};
use std::sync::Arc;

use cudarc::cublas::sys::cublasOperation_t;
use cudarc::cublas::{CudaBlas, Gemm, GemmConfig};
use cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, CudaStream, CudaView, CudaViewMut, DeviceRepr, LaunchArgs, LaunchConfig,
    PushKernelArg, ValidAsZeroBits,
};
use cudarc::nvrtc::Ptx;

use super::compile::{self, FILES};
use super::emu::{self, DevBuf, Emu, EmuType};
use super::launch::{GemmShape, Launch};
use super::storage::Storage;
use crate::error::{Error, Result};

/// An element type of device memory on both backends.
pub trait Elem: DeviceRepr + ValidAsZeroBits + EmuType + Copy + Default + Unpin + Send + Sync + 'static {}
impl<T: DeviceRepr + ValidAsZeroBits + EmuType + Copy + Default + Unpin + Send + Sync + 'static> Elem for T {}

/// The real device: cudarc's stream, cuBLAS handle and the kernels' modules.
pub struct CudaDev {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    blas: CudaBlas,
    modules: Vec<(&'static compile::KernelFile, Arc<cudarc::driver::CudaModule>)>,
}

/// The device the engine runs on.
pub enum Dev {
    Cuda(Box<CudaDev>),
    Emu(Emu),
}

/// A device buffer of `len` elements of `S`.
pub enum DBuf<S: Elem> {
    Cuda(CudaSlice<S>),
    Emu(DevBuf<S>),
}

/// A kernel, looked up once at load time: the cudarc function, or (emulated)
/// the name it is launched by.
pub struct Kernel {
    name: String,
    cuda: Option<CudaFunction>,
}

/// A read-only window `off..off+len` of a buffer (cudarc's `CudaView`).
pub struct View<'a, S: Elem> {
    buf: &'a DBuf<S>,
    off: usize,
    len: usize,
}

impl<S: Elem> Clone for View<'_, S> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<S: Elem> Copy for View<'_, S> {}

/// A writable window of a buffer (cudarc's `CudaViewMut`).
pub struct ViewMut<'a, S: Elem> {
    buf: &'a mut DBuf<S>,
    off: usize,
    len: usize,
}

/// `range` (any range syntax) inside `0..len`, as absolute bounds.
fn sub(len: usize, range: impl RangeBounds<usize>) -> Range<usize> {
    let start = match range.start_bound() {
        Bound::Included(&s) => s,
        Bound::Excluded(&s) => s + 1,
        Bound::Unbounded => 0,
    };
    let end = match range.end_bound() {
        Bound::Included(&e) => e + 1,
        Bound::Excluded(&e) => e,
        Bound::Unbounded => len,
    };
    assert!(
        start <= end && end <= len,
        "view {start}..{end} out of a window of {len}"
    );
    start..end
}

impl<S: Elem> DBuf<S> {
    pub fn len(&self) -> usize {
        match self {
            DBuf::Cuda(b) => b.len(),
            DBuf::Emu(b) => b.len(),
        }
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    pub fn view(&self, range: impl RangeBounds<usize>) -> View<'_, S> {
        let r = sub(self.len(), range);
        View {
            buf: self,
            off: r.start,
            len: r.len(),
        }
    }
    pub fn view_mut(&mut self, range: impl RangeBounds<usize>) -> ViewMut<'_, S> {
        let r = sub(self.len(), range);
        ViewMut {
            buf: self,
            off: r.start,
            len: r.len(),
        }
    }
    /// The whole buffer as a kernel argument (read).
    pub fn arg(&self) -> KArg<'_> {
        self.view(..).arg()
    }
    /// The whole buffer as a kernel argument (written).
    pub fn arg_mut(&mut self) -> KArg<'_> {
        match self {
            DBuf::Cuda(b) => KArg::Cuda(Box::new(PushMut(b))),
            DBuf::Emu(b) => KArg::Emu(b.arg()),
        }
    }
}

impl<'a, S: Elem> View<'a, S> {
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// A sub-window (`range` relative to this one).
    pub fn slice(&self, range: impl RangeBounds<usize>) -> View<'a, S> {
        let r = sub(self.len, range);
        View {
            buf: self.buf,
            off: self.off + r.start,
            len: r.len(),
        }
    }
    /// As a kernel argument: a pointer to its first element.
    pub fn arg(&self) -> KArg<'a> {
        match self.buf {
            DBuf::Cuda(b) => KArg::Cuda(Box::new(b.slice(self.off..self.off + self.len))),
            DBuf::Emu(b) => KArg::Emu(b.arg_at(self.off)),
        }
    }
    fn cuda(&self) -> CudaView<'a, S> {
        match self.buf {
            DBuf::Cuda(b) => b.slice(self.off..self.off + self.len),
            DBuf::Emu(_) => panic!("{MIXED}"),
        }
    }
}

impl<S: Elem> ViewMut<'_, S> {
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// As a kernel argument the kernel writes through.
    pub fn arg(&mut self) -> KArg<'_> {
        let r = self.off..self.off + self.len;
        match &mut *self.buf {
            DBuf::Cuda(b) => KArg::Cuda(Box::new(b.slice_mut(r))),
            DBuf::Emu(b) => KArg::Emu(b.arg_at(r.start)),
        }
    }
    /// Read-only, for the same window.
    pub fn as_view(&self) -> View<'_, S> {
        View {
            buf: self.buf,
            off: self.off,
            len: self.len,
        }
    }
    fn cuda(&mut self) -> CudaViewMut<'_, S> {
        let r = self.off..self.off + self.len;
        match &mut *self.buf {
            DBuf::Cuda(b) => b.slice_mut(r),
            DBuf::Emu(_) => panic!("{MIXED}"),
        }
    }
}

const MIXED: &str = "a buffer of the emulated device handed to the CUDA device, or the reverse (a bug of seam.rs)";

/// A cudarc kernel argument kept typed until the launch, so cudarc records
/// the read (`&CudaView`) or write (`&mut CudaViewMut`) as before the seam.
pub trait CudaPush {
    fn push<'b>(&'b mut self, b: &mut LaunchArgs<'b>);
}
impl<S> CudaPush for CudaView<'_, S> {
    fn push<'b>(&'b mut self, b: &mut LaunchArgs<'b>) {
        let me: &'b Self = self;
        b.arg(me);
    }
}
impl<S> CudaPush for CudaViewMut<'_, S> {
    fn push<'b>(&'b mut self, b: &mut LaunchArgs<'b>) {
        b.arg(self);
    }
}
/// A whole slice, written.
struct PushMut<'a, S>(&'a mut CudaSlice<S>);
impl<S> CudaPush for PushMut<'_, S> {
    fn push<'b>(&'b mut self, b: &mut LaunchArgs<'b>) {
        b.arg(&mut *self.0);
    }
}

/// One kernel argument, in the kernel's parameter order.
pub enum KArg<'a> {
    /// A buffer of the real device.
    Cuda(Box<dyn CudaPush + 'a>),
    /// A buffer of the emulated device (its element type is checked against
    /// the kernel's signature at the launch).
    Emu(emu::Arg<'a>),
    /// A null pointer (attention's untapped scores and probabilities).
    Null,
    I32(i32),
    I64(i64),
    U16(u16),
    U32(u32),
    U64(u64),
    F32(f32),
    F64(f64),
}

impl<'a> KArg<'a> {
    /// The same buffer as its raw bits, for the fill kernels (`unsigned*` when
    /// `wide`, else `unsigned short*`): the emulator checks element types by
    /// name, and a sentinel fill writes an f32/f16/bf16 buffer as integers.
    pub fn as_bits(self, wide: bool) -> KArg<'a> {
        match self {
            KArg::Emu(emu::Arg::Ptr { addr, elem, _l }) => {
                let (bits, width) = if wide {
                    ("u32", ["f32", "u32"])
                } else {
                    ("u16", ["f16", "bf16"])
                };
                assert!(
                    width.contains(&elem) || elem == bits,
                    "as_bits: a {elem} buffer is not {bits} wide"
                );
                KArg::Emu(emu::Arg::Ptr { addr, elem: bits, _l })
            }
            other => other,
        }
    }
}

macro_rules! karg_from {
    ($($t:ty => $v:ident),*) => { $(impl From<$t> for KArg<'_> { fn from(x: $t) -> Self { KArg::$v(x) } })* };
}
karg_from!(i32 => I32, i64 => I64, u16 => U16, u32 => U32, u64 => U64, f32 => F32, f64 => F64);

fn cfg(l: Launch) -> LaunchConfig {
    LaunchConfig {
        grid_dim: l.grid,
        block_dim: (l.block, 1, 1),
        shared_mem_bytes: l.smem,
    }
}

impl Dev {
    /// The real device 0: its context, default stream, cuBLAS handle, and
    /// every kernel file compiled by NVRTC for its architecture.
    pub fn cuda() -> Result<Dev> {
        let e = |m: String| Error::engine("cuda", m);
        let ctx = super::context().map_err(e)?;
        let stream = ctx.default_stream();
        let blas = CudaBlas::new(stream.clone()).map_err(|x| e(format!("cuBLAS init: {x}")))?;
        let (major, minor) = ctx.compute_capability().map_err(|x| e(x.to_string()))?;
        let arch = format!("sm_{major}{minor}");
        let mut modules = Vec::new();
        for file in FILES {
            let ptx = compile::ptx(file, &arch).map_err(|x| e(x.to_string()))?;
            let m = ctx
                .load_module(Ptx::from_src(ptx.as_str()))
                .map_err(|x| e(format!("loading the PTX of cuda/{} for {arch}: {x}", file.name)))?;
            modules.push((file, m));
        }
        Ok(Dev::Cuda(Box::new(CudaDev {
            ctx,
            stream,
            blas,
            modules,
        })))
    }

    /// A fresh emulated device.
    pub fn emu() -> Dev {
        Dev::Emu(Emu::new())
    }

    /// The engine's name on this device (trial ids, reports, errors).
    pub fn engine_name(&self) -> &'static str {
        match self {
            Dev::Cuda(_) => "cuda",
            Dev::Emu(_) => "cuda-emu",
        }
    }

    /// An engine error naming this device's engine.
    pub fn err(&self, what: impl std::fmt::Display) -> Error {
        Error::engine(self.engine_name(), what.to_string())
    }

    /// Kernel `name` (as compile.rs lists it), checked to exist now.
    pub fn kernel(&self, name: &str) -> Result<Kernel> {
        match self {
            Dev::Cuda(c) => {
                let (_, m) = c
                    .modules
                    .iter()
                    .find(|(f, _)| f.kernels.contains(&name))
                    .ok_or_else(|| self.err(format!("kernel {name} is in no kernel file")))?;
                let f = m
                    .load_function(name)
                    .map_err(|e| self.err(format!("kernel {name}: {e}")))?;
                Ok(Kernel {
                    name: name.into(),
                    cuda: Some(f),
                })
            }
            Dev::Emu(_) => {
                if !emu::kernel_names().iter().any(|(k, _)| k == name) {
                    return Err(self.err(format!("kernel {name} is not emulated")));
                }
                Ok(Kernel {
                    name: name.into(),
                    cuda: None,
                })
            }
        }
    }

    /// `len` elements, uninitialised (the engine fills every buffer it reads
    /// before reading it); `label` names it in the emulator's reports.
    pub fn alloc<S: Elem>(&self, label: &str, len: usize) -> Result<DBuf<S>> {
        match self {
            // SAFETY: callers write every element before reading it (the guarded
            // buffers are filled with their sentinel by a kernel at once).
            Dev::Cuda(c) => Ok(DBuf::Cuda(
                unsafe { c.stream.alloc::<S>(len) }.map_err(|e| self.err(e))?,
            )),
            Dev::Emu(m) => Ok(DBuf::Emu(m.alloc(label, len))),
        }
    }

    /// `len` zeros.
    pub fn alloc_zeros<S: Elem>(&self, label: &str, len: usize) -> Result<DBuf<S>> {
        match self {
            Dev::Cuda(c) => Ok(DBuf::Cuda(c.stream.alloc_zeros::<S>(len).map_err(|e| self.err(e))?)),
            Dev::Emu(m) => Ok(DBuf::Emu(m.upload(label, &vec![S::default(); len]))),
        }
    }

    /// A buffer holding a copy of `data`.
    pub fn upload<S: Elem>(&self, label: &str, data: &[S]) -> Result<DBuf<S>> {
        match self {
            Dev::Cuda(c) => Ok(DBuf::Cuda(c.stream.clone_htod(data).map_err(|e| self.err(e))?)),
            Dev::Emu(m) => Ok(DBuf::Emu(m.upload(label, data))),
        }
    }

    /// A copy of a window, on the host, once the device is done with it
    /// (synchronises the stream).
    pub fn download<S: Elem>(&self, v: View<'_, S>) -> Result<Vec<S>> {
        match self {
            Dev::Cuda(c) => {
                let h = c.stream.clone_dtoh(&v.cuda()).map_err(|e| self.err(e))?;
                c.stream.synchronize().map_err(|e| self.err(e))?;
                Ok(h)
            }
            Dev::Emu(_) => match v.buf {
                DBuf::Emu(b) => Ok(b.read_range(v.off..v.off + v.len)),
                DBuf::Cuda(_) => panic!("{MIXED}"),
            },
        }
    }

    /// `f` of a window's contents on the host: a copy back (as `download`) from
    /// the real device, the buffer itself on the emulated one, whose memory is
    /// host memory (the `weights` check reads every weight: a copy of 2 GB of
    /// f32 weights was a second of page faults).
    pub fn with_host<S: Elem, R>(&self, v: View<'_, S>, f: impl FnOnce(&[S]) -> R) -> Result<R> {
        match (self, v.buf) {
            (Dev::Emu(_), DBuf::Emu(b)) => {
                // SAFETY: nothing writes the buffer while `f` reads it (`v`
                // borrows it shared; the emulator runs nothing in between).
                Ok(f(unsafe { b.slice(v.off..v.off + v.len) }))
            }
            _ => Ok(f(&self.download(v)?)),
        }
    }

    /// Device-to-device copy of `src` into `dst` (same length).
    pub fn copy<S: Elem>(&self, src: View<'_, S>, dst: &mut ViewMut<'_, S>) -> Result<()> {
        assert_eq!(src.len, dst.len, "device copy: length mismatch");
        match self {
            Dev::Cuda(c) => c
                .stream
                .memcpy_dtod(&src.cuda(), &mut dst.cuda())
                .map_err(|e| self.err(e)),
            Dev::Emu(_) => match (src.buf, &*dst.buf) {
                (DBuf::Emu(s), DBuf::Emu(d)) => {
                    d.write_at(dst.off, &s.read_range(src.off..src.off + src.len));
                    Ok(())
                }
                _ => panic!("{MIXED}"),
            },
        }
    }

    /// Waits for the device (a no-op on the synchronous emulator).
    pub fn synchronize(&self) -> Result<()> {
        match self {
            Dev::Cuda(c) => c.stream.synchronize().map_err(|e| self.err(e)),
            Dev::Emu(_) => Ok(()),
        }
    }

    /// Launches `k` over the grid of `l` with `args` (the kernel's parameters
    /// in order). The emulator checks the arguments against the kernel's C++
    /// signature; on the real device they are trusted, hence `unsafe`.
    ///
    /// # Safety
    /// `args` match the kernel's parameters in number and type, and every
    /// buffer covers what the kernel reads and writes for this launch.
    pub unsafe fn launch(&self, k: &Kernel, l: Launch, args: &mut [KArg<'_>]) -> Result<()> {
        match self {
            Dev::Cuda(c) => {
                static NULL: u64 = 0;
                let f = k.cuda.as_ref().expect("a kernel of the CUDA device");
                let mut b = c.stream.launch_builder(f);
                for a in args.iter_mut() {
                    match a {
                        KArg::Cuda(p) => p.push(&mut b),
                        KArg::Emu(_) => panic!("{MIXED}"),
                        KArg::Null => {
                            b.arg(&NULL);
                        }
                        KArg::I32(v) => {
                            b.arg(&*v);
                        }
                        KArg::I64(v) => {
                            b.arg(&*v);
                        }
                        KArg::U16(v) => {
                            b.arg(&*v);
                        }
                        KArg::U32(v) => {
                            b.arg(&*v);
                        }
                        KArg::U64(v) => {
                            b.arg(&*v);
                        }
                        KArg::F32(v) => {
                            b.arg(&*v);
                        }
                        KArg::F64(v) => {
                            b.arg(&*v);
                        }
                    }
                }
                // SAFETY: the caller's contract.
                unsafe { b.launch(cfg(l)) }
                    .map(|_| ())
                    .map_err(|e| self.err(format!("launching {}: {e}", k.name)))
            }
            Dev::Emu(m) => {
                let a: Vec<emu::Arg<'_>> = args
                    .iter()
                    .map(|a| match a {
                        KArg::Cuda(_) => panic!("{MIXED}"),
                        KArg::Emu(a) => *a,
                        KArg::Null => emu::Arg::Null,
                        KArg::I32(v) => emu::Arg::I32(*v),
                        KArg::I64(v) => emu::Arg::I64(*v),
                        KArg::U16(v) => emu::Arg::U16(*v),
                        KArg::U32(v) => emu::Arg::U32(*v),
                        KArg::U64(v) => emu::Arg::U64(*v),
                        KArg::F32(v) => emu::Arg::F32(*v),
                        KArg::F64(v) => emu::Arg::F64(*v),
                    })
                    .collect();
                m.launch(&k.name, l.into(), &a).map_err(|e| self.err(e))
            }
        }
    }

    /// `C = op(A)·op(B)` in cuBLAS's column-major terms (`g` from
    /// `launch::linear_gemm`), alpha 1, beta 0, f32 accumulation, C rounded to
    /// `T`: cuBLAS (sgemm / GemmEx with CUBLAS_COMPUTE_32F) on the real
    /// device, `emu_gemm` on the emulated one.
    pub fn gemm<T: Storage + Elem>(
        &self,
        g: GemmShape,
        a: View<'_, T>,
        b: View<'_, T>,
        c: &mut ViewMut<'_, T>,
    ) -> Result<()>
    where
        CudaBlas: Gemm<T>,
    {
        match self {
            Dev::Cuda(d) => {
                let op = |t: bool| {
                    if t {
                        cublasOperation_t::CUBLAS_OP_T
                    } else {
                        cublasOperation_t::CUBLAS_OP_N
                    }
                };
                let gc = GemmConfig {
                    transa: op(g.transa),
                    transb: op(g.transb),
                    m: g.m as i32,
                    n: g.n as i32,
                    k: g.k as i32,
                    alpha: T::from_f32(1.0),
                    lda: g.lda as i32,
                    ldb: g.ldb as i32,
                    beta: T::from_f32(0.0),
                    ldc: g.ldc as i32,
                };
                // SAFETY: the caller sized A, B and C for g (device.rs asserts it).
                unsafe { d.blas.gemm(gc, &a.cuda(), &b.cuda(), &mut c.cuda()) }
                    .map_err(|e| self.err(format!("cuBLAS gemm ({}): {e}", T::SUFFIX)))
            }
            Dev::Emu(_) => {
                let (DBuf::Emu(ab), DBuf::Emu(bb)) = (a.buf, b.buf) else {
                    panic!("{MIXED}")
                };
                // SAFETY: A and B are only read here; the one buffer written,
                // C, is another buffer (`c` borrows its buffer mutably).
                let out = unsafe { emu_gemm(g, ab.slice(a.off..a.off + a.len), bb.slice(b.off..b.off + b.len)) };
                match &*c.buf {
                    DBuf::Emu(buf) => buf.write_at(c.off, &out),
                    DBuf::Cuda(_) => panic!("{MIXED}"),
                }
                Ok(())
            }
        }
    }

    /// Bytes of device memory in use: on the real device, total − free of
    /// device 0 (all processes); emulated, the bytes of this device's live
    /// allocations.
    pub fn memory_in_use(&self) -> Result<usize> {
        match self {
            Dev::Cuda(c) => {
                c.ctx.bind_to_thread().map_err(|e| self.err(e))?;
                let (free, total) = c.ctx.mem_get_info().map_err(|e| self.err(e))?;
                Ok(total - free)
            }
            Dev::Emu(m) => Ok(m.live_bytes()),
        }
    }
}

mod gemm;
#[cfg(test)]
mod tests;

pub use gemm::{as_f32, emu_gemm};
