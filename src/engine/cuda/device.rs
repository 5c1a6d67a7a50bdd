//! The CUDA engine proper: weights loaded on the host by the CPU engine's own
//! strict loader (same formats, same checks) and uploaded once in the storage
//! type `T` (f32, f16 or bf16; every kernel computes in f32 and rounds once on
//! store, cuBLAS accumulates in f32 whatever `T`); the kernels it launches and
//! the device operations its forward pass (`step.rs`) is written in: guarded
//! buffers, projections, norms, RoPE, residual adds, taps.
//!
//! Matrix products go through cuBLAS (sgemm for f32, GemmEx with
//! CUBLAS_COMPUTE_32F for f16/bf16; default math mode, so no TF32 for f32):
//! it is the fastest correct GEMM on every architecture, it is deterministic
//! run to run on one device and stream, and a hand-written GEMM would add the
//! riskiest kernel to review without a GPU.
//!
//! The device is reached only through the seam (`seam::Dev`): the real one
//! (cudarc) or the host emulation (`emu`, engine `cuda-emu`), so everything
//! here — buffer sizes, launch configurations, argument lists, taps and
//! guards, sampling — runs the same on both.

use std::path::Path;
use std::sync::Mutex;

use cudarc::cublas::{CudaBlas, Gemm};

use crate::engine::cpu::layers::{Linear, ModelWeights};
use crate::engine::cpu::ops::LayerRopes;
use crate::engine::driver;
use crate::engine::{Captures, Engine, RunOutput, RunRequest, TapSet};
use crate::error::Result;
use crate::model::ModelConfig;
use crate::stage::{Stage, Step};
use crate::tensor::{DType, Tensor};

use super::guard::Guarded;
use super::launch;
use super::seam::{as_f32, DBuf, Dev, KArg, Kernel, View, ViewMut};
use super::storage::Storage;
use super::weights::{upload, upload_linear, DevLinear, DevVision};
use crate::engine::cpu::clip::ClipWeights;
use crate::engine::cpu::vision::VisionWeights;

pub(super) struct DevBlock<T: Storage> {
    pub(super) attn_norm: DBuf<T>,
    pub(super) qkv: super::block_weights::DevQkv<T>,
    /// Qwen3's per-head q/k RMSNorm weights (`[D]`).
    pub(super) qk_norm: Option<(DBuf<T>, DBuf<T>)>,
    pub(super) o: DevLinear<T>,
    /// gpt-oss's per-head attention sink logits (`[H]`).
    pub(super) sinks: Option<DBuf<T>>,
    /// Gemma's norms of the attention and MLP outputs (`[E]`).
    pub(super) post_norms: Option<(DBuf<T>, DBuf<T>)>,
    pub(super) ffn_norm: DBuf<T>,
    pub(super) ffn: super::block_weights::DevFfn<T>,
}

pub(super) struct DevWeights<T: Storage> {
    pub(super) embed: DBuf<T>,
    pub(super) blocks: Vec<DevBlock<T>>,
    pub(super) norm: DBuf<T>,
    pub(super) lm_head: Option<DevLinear<T>>,
}

/// The kernels the forward pass launches, for the storage type.
pub(super) struct Funcs {
    pub(super) embedding: Kernel,
    pub(super) rmsnorm: Kernel,
    pub(super) rope_neox: Kernel,
    pub(super) attention_prefill: Kernel,
    pub(super) attention_decode: Kernel,
    pub(super) bias_add: Kernel,
    pub(super) silu_mul: Kernel,
    pub(super) gelu_mul: Kernel,
    pub(super) scale: Kernel,
    pub(super) add: Kernel,
    pub(super) fill_u32: Kernel,
    /// Vision-language models: the tower's LayerNorm and activations, the
    /// qkv split, the M-RoPE / 2-D rotary, the image-row fusion.
    pub(super) layernorm: Kernel,
    pub(super) act: Kernel,
    pub(super) copy_cols: Kernel,
    pub(super) rope_axes: Kernel,
    pub(super) scatter_rows: Kernel,
    pub(super) fill_u16: Kernel,
    pub(super) argmax: Kernel,
    pub(super) sample: Kernel,
    /// Routed layers (`cuda/moe.cu`).
    pub(super) moe_route: Kernel,
    pub(super) moe_gather: Kernel,
    pub(super) moe_accumulate: Kernel,
    pub(super) moe_store: Kernel,
    pub(super) sigmoid_scale: Kernel,
    pub(super) swiglu_clamped: Kernel,
    /// DeepSeek's latent attention (`cuda/mla.cu`).
    pub(super) mla_split_kv: Kernel,
    pub(super) rope_mla: Kernel,
}

/// cos/sin tables `[positions, D/2]` from the CPU engine's own `Rope`.
pub(super) struct RopeTables {
    pub(super) cos: DBuf<f32>,
    pub(super) sin: DBuf<f32>,
}

/// Where a step's taps go.
pub(super) struct TapCtx<'a> {
    pub(super) taps: &'a TapSet,
    pub(super) step: Step,
    pub(super) caps: &'a mut Captures,
}

/// A device buffer with guard regions (see `guard`).
pub(super) struct GBuf<S: Storage> {
    pub(super) buf: DBuf<S>,
    pub(super) g: Guarded,
}

impl<S: Storage> GBuf<S> {
    pub(super) fn view(&self) -> View<'_, S> {
        self.buf.view(self.g.interior())
    }
    pub(super) fn view_mut(&mut self) -> ViewMut<'_, S> {
        let r = self.g.interior();
        self.buf.view_mut(r)
    }
}

/// Loads the model for the CUDA engine in the storage type `opts.storage`, on
/// the real device.
pub fn load(model: &Path, opts: &crate::model::LoadOptions) -> Result<Box<dyn Engine>> {
    load_on(Dev::cuda, model, opts)
}

/// Loads the model for the `cuda-emu` engine: the CUDA engine on a fresh
/// emulated device.
pub fn load_emu(model: &Path, opts: &crate::model::LoadOptions) -> Result<Box<dyn Engine>> {
    load_on(|| Ok(Dev::emu()), model, opts)
}

fn load_on(dev: impl Fn() -> Result<Dev>, model: &Path, opts: &crate::model::LoadOptions) -> Result<Box<dyn Engine>> {
    Ok(match opts.storage {
        DType::F32 => Box::new(CudaEngine::<f32>::load_on(dev()?, model, opts)?),
        DType::F16 => Box::new(CudaEngine::<half::f16>::load_on(dev()?, model, opts)?),
        DType::BF16 => Box::new(CudaEngine::<half::bf16>::load_on(dev()?, model, opts)?),
    })
}

pub struct CudaEngine<T: Storage> {
    pub(super) cfg: ModelConfig,
    pub(super) dev: Dev,
    pub(super) f: Funcs,
    pub(super) w: DevWeights<T>,
    /// The CPU engine's RoPE tables (per layer: Gemma 3's local layers have their own base).
    pub(super) ropes: LayerRopes,
    /// A VLM's vision tower: Qwen-VL's, or LLaVA's CLIP tower and projector.
    pub(super) vision: Option<DevVision<T>>,
    pub(super) clip: Option<super::clip_weights::DevClip<T>>,
    /// One run at a time: the engine's stream and cuBLAS handle are shared.
    pub(super) run_lock: Mutex<()>,
    /// The paged KV cache batches run on, kept across requests.
    pub(super) serve: Mutex<super::paged::ServeState<T>>,
}

impl<T: Storage> CudaEngine<T>
where
    CudaBlas: Gemm<T>,
{
    /// Loads a model (HF folder or GGUF, through the same loader as the CPU
    /// engine) and uploads its weights rounded to `T`, on the real device.
    pub fn load(model: &Path, opts: &crate::model::LoadOptions) -> Result<CudaEngine<T>> {
        Self::load_on(Dev::cuda()?, model, opts)
    }

    /// `load`, on the emulated device (`cuda-emu`).
    pub fn load_emu(model: &Path, opts: &crate::model::LoadOptions) -> Result<CudaEngine<T>> {
        Self::load_on(Dev::emu(), model, opts)
    }

    /// `load` on `dev`.
    pub fn load_on(dev: Dev, model: &Path, opts: &crate::model::LoadOptions) -> Result<CudaEngine<T>> {
        let (cfg, mut ws) = crate::model::load(model, opts)?;
        // The tower's weights first (as the CPU engine): the LM's loader
        // refuses any weight left unused.
        let (mut host_vision, mut host_clip) = (None, None);
        match cfg.vision.as_ref().map(|vc| (vc, &vc.llava)) {
            Some((_, Some(lc))) => host_clip = Some(ClipWeights::load(&mut ws, lc, cfg.hidden)?),
            Some((vc, None)) => host_vision = Some(VisionWeights::load(&cfg, vc, &mut ws)?),
            None => {}
        }
        let host = ModelWeights::load(&cfg, &mut ws)?;
        let f = load_funcs::<T>(&dev)?;
        let up = |v: &[f32]| upload::<T>(&dev, v);
        let lin = |l: &Linear| upload_linear::<T>(&dev, l);
        let vision = host_vision.as_ref().map(|v| DevVision::upload(&dev, v)).transpose()?;
        let clip = host_clip.as_ref().map(|c| super::clip_weights::DevClip::upload(&dev, c)).transpose()?;
        let mut blocks = Vec::with_capacity(host.blocks.len());
        for b in &host.blocks {
            blocks.push(DevBlock {
                attn_norm: up(&b.attn_norm)?,
                qkv: super::block_weights::DevQkv::upload(&dev, &b.qkv)?,
                qk_norm: match (&b.q_norm, &b.k_norm) {
                    (Some(qn), Some(kn)) => Some((up(qn)?, up(kn)?)),
                    _ => None,
                },
                o: lin(&b.o)?,
                sinks: b.sinks.as_deref().map(up).transpose()?,
                post_norms: match (&b.attn_post_norm, &b.ffn_post_norm) {
                    (Some(a), Some(m)) => Some((up(a)?, up(m)?)),
                    _ => None,
                },
                ffn_norm: up(&b.ffn_norm)?,
                ffn: super::block_weights::DevFfn::upload(&dev, &b.ffn)?,
            });
        }
        let w = DevWeights {
            embed: up(host.embed.data())?,
            blocks,
            norm: up(&host.norm)?,
            lm_head: host.lm_head.as_ref().map(lin).transpose()?,
        };
        let ropes = LayerRopes::new(&cfg);
        Ok(CudaEngine {
            cfg,
            dev,
            f,
            w,
            ropes,
            vision,
            clip,
            run_lock: Mutex::new(()),
            serve: Mutex::new(Default::default()),
        })
    }

    /// A guarded buffer of `len` elements of `S`, filled with `S`'s sentinel
    /// (guards and interior).
    pub(super) fn gbuf<S: Storage>(&self, label: &str, len: usize) -> Result<GBuf<S>> {
        let g = Guarded { len };
        // Every element is written by the fill below before any read.
        let mut buf = self.dev.alloc::<S>(label, g.total())?;
        let n = g.total() as i64;
        let (bits32, bits16) = (S::SENTINEL_BITS, S::SENTINEL_BITS as u16);
        let wide = std::mem::size_of::<S>() == 4;
        // The fill kernels take `unsigned*` / `unsigned short*`: the buffer's
        // bits, reinterpreted (the emulator checks the element width by name).
        let (k, bits) = if wide {
            (&self.f.fill_u32, KArg::U32(bits32))
        } else {
            (&self.f.fill_u16, KArg::U16(bits16))
        };
        let dst = buf.arg_mut().as_bits(wide);
        // SAFETY: fill_u32(unsigned* x, unsigned bits, long long n) or fill_u16(unsigned
        // short* x, unsigned short bits, long long n) over the n elements of buf, by S's width.
        unsafe {
            self.dev
                .launch(k, launch::elementwise(g.total()), &mut [dst, bits, n.into()])
        }?;
        Ok(GBuf { buf, g })
    }

    /// `y[rows, out] = x[rows, in] · wᵀ (+ bias)`, as the CPU's `Linear::forward`.
    pub(super) fn linear(&self, x: View<'_, T>, rows: usize, lin: &DevLinear<T>, y: &mut ViewMut<'_, T>) -> Result<()> {
        self.gemm_bias(x, rows, &lin.w, lin.bias.as_ref(), lin.in_f, lin.out_f, y)
    }

    /// The GEMM (cuBLAS, f32 accumulation, output rounded to `T`), then the
    /// bias added in place (not fused, as torch's `bias + x·wᵀ` and the CPU
    /// engine; with 16-bit storage that rounds twice, as the CPU engine's
    /// storage emulation does).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn gemm_bias(
        &self,
        x: View<'_, T>,
        rows: usize,
        w: &DBuf<T>,
        bias: Option<&DBuf<T>>,
        in_f: usize,
        out_f: usize,
        y: &mut ViewMut<'_, T>,
    ) -> Result<()> {
        assert!(x.len() >= rows * in_f && w.len() == out_f * in_f && y.len() >= rows * out_f);
        let g = launch::linear_gemm(rows, in_f, out_f);
        // w is [out, in], x at least [rows, in], y at least [rows, out] (asserted).
        self.dev.gemm(g, w.view(..), x, y)?;
        if let Some(bias) = bias {
            let (r, c) = (rows as i32, out_f as i32);
            // SAFETY: bias_add_T(y [rows, cols], b [cols], rows, cols).
            unsafe {
                self.dev.launch(
                    &self.f.bias_add,
                    launch::elementwise(rows * out_f),
                    &mut [y.arg(), bias.arg(), r.into(), c.into()],
                )
            }?;
        }
        Ok(())
    }

    /// RMSNorm of `rows` rows of the hidden width (the block and final norms).
    pub(super) fn rmsnorm(&self, x: View<'_, T>, w: &DBuf<T>, out: &mut ViewMut<'_, T>, rows: usize) -> Result<()> {
        self.rmsnorm_rows(x, w, out, rows, self.cfg.hidden)
    }

    /// RMSNorm of `rows` rows of `width` values each: the hidden width, or a
    /// head (`[T·heads]` rows of D) for Qwen3's q/k norms.
    pub(super) fn rmsnorm_rows(
        &self,
        x: View<'_, T>,
        w: &DBuf<T>,
        out: &mut ViewMut<'_, T>,
        rows: usize,
        width: usize,
    ) -> Result<()> {
        let (wi, eps) = (width as i32, self.cfg.rms_eps as f32);
        let plus_one = self.cfg.norm_plus_one as i32;
        // SAFETY: rmsnorm_T(x [rows, width], w [width], out [rows, width], width, eps, plus_one).
        unsafe {
            self.dev.launch(
                &self.f.rmsnorm,
                launch::per_row(rows, width),
                &mut [x.arg(), w.arg(), out.arg(), wi.into(), eps.into(), plus_one.into()],
            )
        }
    }

    /// `cols` columns from `col0` of `x` (`[rows, src_cols]`) into `out`.
    pub(super) fn copy_columns(&self, x: View<'_, T>, out: &mut GBuf<T>, rows: usize, src_cols: usize, col0: usize, cols: usize) -> Result<()> {
        let mut ov = out.view_mut();
        // SAFETY: copy_cols_T(src [rows, src_cols], dst [rows, cols], rows, src_cols, col0, cols).
        let r = unsafe {
            self.dev.launch(
                &self.f.copy_cols,
                launch::elementwise(rows * cols),
                &mut [
                    x.arg(),
                    ov.arg(),
                    (rows as i32).into(),
                    (src_cols as i32).into(),
                    (col0 as i32).into(),
                    (cols as i32).into(),
                ],
            )
        };
        r
    }

    /// RoPE of rows `r0..r0+rows` of `x` (`[·, heads, D]`) into the same rows
    /// of `out`, those rows at positions `pos0..pos0+rows` (one sequence of
    /// a batch).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn rope_rows(
        &self,
        x: &GBuf<T>,
        out: &mut GBuf<T>,
        tabs: &RopeTables,
        r0: usize,
        rows: usize,
        heads: usize,
        pos0: usize,
    ) -> Result<()> {
        // Latent attention rotates only each head's RoPE part.
        if self.cfg.mla.is_some() {
            return self.rope_mla_rows(x, out, tabs, r0, rows, heads, pos0);
        }
        let width = heads * self.cfg.head_dim;
        let (r, h, d, p) = (rows as i32, heads as i32, self.cfg.head_dim as i32, pos0 as i32);
        let span = r0 * width..(r0 + rows) * width;
        let xv = x.view().slice(span.clone());
        let o0 = out.g.interior().start;
        let mut ov = out.buf.view_mut(o0 + span.start..o0 + span.end);
        // SAFETY: rope_neox_T over [rows, heads, D] (f32 tables); tables cover positions < pos0 + rows.
        unsafe {
            self.dev.launch(
                &self.f.rope_neox,
                launch::elementwise(rows * heads * self.cfg.head_dim / 2),
                &mut [
                    xv.arg(),
                    ov.arg(),
                    tabs.cos.arg(),
                    tabs.sin.arg(),
                    r.into(),
                    h.into(),
                    d.into(),
                    p.into(),
                ],
            )
        }?;
        Ok(())
    }

    pub(super) fn add(&self, a: View<'_, T>, bb: View<'_, T>, out: &mut GBuf<T>) -> Result<()> {
        let n = out.g.len as i64;
        let mut ov = out.view_mut();
        // SAFETY: add_T(a, b, out, n), all n long.
        unsafe {
            self.dev.launch(
                &self.f.add,
                launch::elementwise(n as usize),
                &mut [a.arg(), bb.arg(), ov.arg(), n.into()],
            )
        }?;
        Ok(())
    }

    /// Copies `buf` back if `stage` is tapped, checks its guards, captures it.
    /// Every capture carries the run's storage dtype, attn_probs (kept in f32
    /// by the kernel) included: a capture's dtype is the precision of the run
    /// that produced it, which is what its golden tolerance must allow for.
    pub(super) fn tap<S: Storage>(&self, tc: &mut TapCtx, stage: Stage, shape: &[usize], buf: &GBuf<S>) -> Result<()> {
        if !tc.taps.contains(stage) {
            return Ok(());
        }
        debug_assert_eq!(shape.iter().product::<usize>(), buf.g.len);
        let full = self.dev.download(buf.buf.view(..))?;
        buf.g
            .check(&full)
            .map_err(|v| self.dev.err(format!("{}/{stage}: {v}", tc.step)))?;
        let values = full[buf.g.interior()].iter().map(|x| x.to_f32()).collect();
        tc.caps
            .insert(tc.step, stage, Tensor::new(shape.to_vec(), values).with_dtype(T::DTYPE));
        Ok(())
    }

    /// Bytes of device memory in use: device 0's total − free on the real
    /// device (all processes), this engine's live allocations on the emulated
    /// one. For the memory-growth check of `tests/cuda_device.rs`.
    pub fn device_memory_in_use(&self) -> Result<usize> {
        self.dev.memory_in_use()
    }
}

fn load_funcs<T: Storage>(dev: &Dev) -> Result<Funcs> {
    let get = |name: &str| dev.kernel(name);
    let typed = |op: &str| get(&format!("{op}_{}", T::SUFFIX));
    Ok(Funcs {
        embedding: typed("embedding")?,
        rmsnorm: typed("rmsnorm")?,
        rope_neox: typed("rope_neox")?,
        attention_prefill: typed("attention_prefill")?,
        attention_decode: typed("attention_decode")?,
        bias_add: typed("bias_add")?,
        silu_mul: typed("silu_mul")?,
        gelu_mul: typed("gelu_mul")?,
        scale: typed("scale")?,
        add: typed("add")?,
        fill_u32: get("fill_u32")?,
        layernorm: typed("layernorm")?,
        act: typed("act")?,
        copy_cols: typed("copy_cols")?,
        rope_axes: typed("rope_axes")?,
        scatter_rows: typed("scatter_rows")?,
        fill_u16: get("fill_u16")?,
        argmax: typed("argmax")?,
        sample: typed("sample")?,
        moe_route: typed("moe_route")?,
        moe_gather: typed("moe_gather")?,
        moe_accumulate: typed("moe_accumulate")?,
        moe_store: typed("moe_store")?,
        sigmoid_scale: typed("sigmoid_scale")?,
        swiglu_clamped: typed("swiglu_clamped")?,
        mla_split_kv: typed("mla_split_kv")?,
        rope_mla: typed("rope_mla")?,
    })
}

impl<T: Storage> Engine for CudaEngine<T>
where
    CudaBlas: Gemm<T>,
{
    fn name(&self) -> &str {
        self.dev.engine_name()
    }

    fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    /// Every stage, images (its vision tower runs on the device), and
    /// batches of text over its paged KV cache (`serve`).
    fn capabilities(&self) -> crate::engine::capabilities::Capabilities {
        crate::engine::capabilities::Capabilities {
            serving: self.serving_caps(),
            ..crate::engine::capabilities::Capabilities::all()
        }
    }

    fn run_batch(&self, req: &crate::engine::batch::BatchRequest, taps: &TapSet) -> Result<Vec<RunOutput>> {
        crate::engine::batch::run(self, req, taps)
    }

    /// Its device bytes: this engine's live allocations on the emulated
    /// device (exact); device 0's total − free on a GPU (every process's).
    fn memory(&self) -> Result<Vec<crate::engine::MemoryReading>> {
        let emu = matches!(self.dev, Dev::Emu(_));
        Ok(vec![crate::engine::MemoryReading {
            bytes: self.dev.memory_in_use()? as u64,
            what: if emu {
                "the engine's emulated device memory (live allocations)".into()
            } else {
                "device 0's memory in use (total − free, every process)".into()
            },
            exact: emu,
        }])
    }

    /// The device copies, read back one tensor at a time: a bad upload or a
    /// wrong offset shows in the `weights` check named by tensor.
    fn visit_weights(&self, f: &mut crate::engine::WeightVisitor) -> Result<()> {
        let (e, v, d) = (self.cfg.hidden, self.cfg.vocab, self.cfg.head_dim);
        // Each tensor as f32, read where it lies on the emulated device.
        let back = |f: &mut crate::engine::WeightVisitor, name: &str, shape: &[usize], buf: &DBuf<T>| -> Result<()> {
            self.dev.with_host(buf.view(..), |h| f(name, shape, &as_f32(h)))
        };
        let lin = |f: &mut crate::engine::WeightVisitor, name: &str, l: &DevLinear<T>| -> Result<()> {
            back(f, &format!("{name}.weight"), &[l.out_f, l.in_f], &l.w)?;
            if let Some(b) = &l.bias {
                back(f, &format!("{name}.bias"), &[l.out_f], b)?;
            }
            Ok(())
        };
        let w = &self.w;
        back(f, "model.embed_tokens.weight", &[v, e], &w.embed)?;
        for (i, b) in w.blocks.iter().enumerate() {
            let p = format!("model.layers.{i}");
            back(f, &format!("{p}.input_layernorm.weight"), &[e], &b.attn_norm)?;
            b.qkv.visit(&format!("{p}.self_attn"), f, &lin, &|f, name, len, b| back(f, name, &[len], b))?;
            if let Some((qn, kn)) = &b.qk_norm {
                back(f, &format!("{p}.self_attn.q_norm.weight"), &[d], qn)?;
                back(f, &format!("{p}.self_attn.k_norm.weight"), &[d], kn)?;
            }
            lin(f, &format!("{p}.self_attn.o_proj"), &b.o)?;
            if let Some(s) = &b.sinks {
                back(f, &format!("{p}.self_attn.sinks"), &[self.cfg.heads], s)?;
            }
            if let Some((an, fnn)) = &b.post_norms {
                back(f, &format!("{p}.post_attention_layernorm.weight"), &[e], an)?;
                back(f, &format!("{p}.post_feedforward_layernorm.weight"), &[e], fnn)?;
            }
            back(
                f,
                &format!("{p}.{}.weight", crate::engine::cpu::layers::ffn_norm_name(&self.cfg)),
                &[e],
                &b.ffn_norm,
            )?;
            b.ffn.visit(&format!("{p}.mlp"), f, &lin, &|f, name, len, b| back(f, name, &[len], b))?;
        }
        back(f, "model.norm.weight", &[e], &w.norm)?;
        if let Some(h) = &w.lm_head {
            lin(f, "lm_head", h)?;
        }
        if let (Some(v), Some(vc)) = (&self.vision, &self.cfg.vision) {
            v.visit(&self.dev, vc, f)?;
        }
        if let (Some(c), Some(lc)) = (&self.clip, self.cfg.llava()) {
            c.visit(&self.dev, lc, f)?;
        }
        Ok(())
    }

    /// One run at a time on the engine's stream; the step loop is the
    /// driver's (`step.rs` is this engine's forward pass).
    fn run(&self, req: &RunRequest, taps: &TapSet) -> Result<RunOutput> {
        let _one_run = self.run_lock.lock().unwrap_or_else(|p| p.into_inner());
        driver::run(self, req, taps)
    }
}
