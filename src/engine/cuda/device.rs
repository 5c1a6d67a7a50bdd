//! The CUDA engine proper: weights loaded on the host by the CPU engine's own
//! strict loader (same formats, same checks) and uploaded once in the storage
//! type `T` (f32, f16 or bf16; every kernel computes in f32 and rounds once on
//! store, cuBLAS accumulates in f32 whatever `T`); one
//! forward pass per step in the canonical stage order, every stage writing its
//! own guarded device buffer; taps copy a stage back only when it is requested
//! (and check its guards in the same copy). With nothing tapped, the only
//! device→host copy of a step is the sampled token, 4 bytes: greedy is argmax
//! on the device, and seeded random sampling runs the host `Sampler`'s
//! algorithm and ChaCha8 stream on the device (`cuda/sampling.cu`), so a seed
//! draws the same tokens as on the CPU engine.
//!
//! Matrix products go through cuBLAS (sgemm for f32, GemmEx with
//! CUBLAS_COMPUTE_32F for f16/bf16; default math mode, so no TF32 for f32):
//! it is the fastest correct GEMM on every
//! architecture, it is deterministic run to run on one device and stream, and
//! a hand-written GEMM would add the riskiest kernel to review without a GPU.

//!
//! The device is reached only through the seam (`seam::Dev`): the real one
//! (cudarc) or the host emulation (`emu`, engine `cuda-emu`), so everything in
//! this file — buffer sizes, launch configurations, argument lists, taps and
//! guards, sampling — runs the same on both.

use std::path::Path;
use std::sync::Mutex;

use cudarc::cublas::{CudaBlas, Gemm};

use crate::engine::cpu::layers::{Linear, ModelWeights};
use crate::engine::cpu::ops::Rope;
use crate::engine::{Captures, Engine, RunOutput, RunRequest, TapSet};
use crate::error::Result;
use crate::model::ModelConfig;
use crate::sampling::{chacha_key, Sampling};
use crate::stage::{BlockStage as B, Stage, Step};
use crate::tensor::{DType, Tensor};

use super::guard::Guarded;
use super::launch::{self, Launch};
use super::seam::{DBuf, Dev, KArg, Kernel, View, ViewMut};
use super::storage::Storage;

struct DevLinear<T: Storage> {
    w: DBuf<T>,
    bias: Option<DBuf<T>>,
    out_f: usize,
    in_f: usize,
}

struct DevBlock<T: Storage> {
    attn_norm: DBuf<T>,
    q: DevLinear<T>,
    k: DevLinear<T>,
    v: DevLinear<T>,
    /// Qwen3's per-head q/k RMSNorm weights (`[D]`).
    qk_norm: Option<(DBuf<T>, DBuf<T>)>,
    o: DevLinear<T>,
    ffn_norm: DBuf<T>,
    gate: DevLinear<T>,
    up: DevLinear<T>,
    down: DevLinear<T>,
}

struct DevWeights<T: Storage> {
    embed: DBuf<T>,
    blocks: Vec<DevBlock<T>>,
    norm: DBuf<T>,
    lm_head: Option<DevLinear<T>>,
}

/// The kernels the forward pass launches, for the storage type.
struct Funcs {
    embedding: Kernel,
    rmsnorm: Kernel,
    rope_neox: Kernel,
    attention_prefill: Kernel,
    attention_decode: Kernel,
    bias_add: Kernel,
    silu_mul: Kernel,
    add: Kernel,
    fill_u32: Kernel,
    fill_u16: Kernel,
    argmax: Kernel,
    sample: Kernel,
}

/// A device buffer with guard regions (see `guard`).
struct GBuf<S: Storage> {
    buf: DBuf<S>,
    g: Guarded,
}

impl<S: Storage> GBuf<S> {
    fn view(&self) -> View<'_, S> {
        self.buf.view(self.g.interior())
    }
    fn view_mut(&mut self) -> ViewMut<'_, S> {
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
    cfg: ModelConfig,
    dev: Dev,
    f: Funcs,
    w: DevWeights<T>,
    rope: Rope,
    /// One run at a time: the engine's stream and cuBLAS handle are shared.
    run_lock: Mutex<()>,
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
        let host = ModelWeights::load(&cfg, &mut ws)?;
        let f = load_funcs::<T>(&dev)?;
        let up = |v: &[f32]| {
            let h: Vec<T> = v.iter().map(|&x| T::from_f32(x)).collect();
            dev.upload("weight", &h)
                .map_err(|e| dev.err(format!("weight upload: {e}")))
        };
        let lin = |l: &Linear| -> Result<DevLinear<T>> {
            Ok(DevLinear {
                w: up(l.w.data())?,
                bias: l.bias.as_deref().map(up).transpose()?,
                out_f: l.out_f,
                in_f: l.in_f,
            })
        };
        let mut blocks = Vec::with_capacity(host.blocks.len());
        for b in &host.blocks {
            blocks.push(DevBlock {
                attn_norm: up(&b.attn_norm)?,
                q: lin(&b.q)?,
                k: lin(&b.k)?,
                v: lin(&b.v)?,
                qk_norm: match (&b.q_norm, &b.k_norm) {
                    (Some(qn), Some(kn)) => Some((up(qn)?, up(kn)?)),
                    _ => None,
                },
                o: lin(&b.o)?,
                ffn_norm: up(&b.ffn_norm)?,
                gate: lin(&b.gate)?,
                up: lin(&b.up)?,
                down: lin(&b.down)?,
            });
        }
        let w = DevWeights {
            embed: up(host.embed.data())?,
            blocks,
            norm: up(&host.norm)?,
            lm_head: host.lm_head.as_ref().map(lin).transpose()?,
        };
        let rope = Rope::new(cfg.head_dim, cfg.rope_theta);
        Ok(CudaEngine {
            cfg,
            dev,
            f,
            w,
            rope,
            run_lock: Mutex::new(()),
        })
    }

    /// A guarded buffer of `len` elements of `S`, filled with `S`'s sentinel
    /// (guards and interior).
    fn gbuf<S: Storage>(&self, label: &str, len: usize) -> Result<GBuf<S>> {
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
    fn linear(&self, x: View<'_, T>, rows: usize, lin: &DevLinear<T>, y: &mut ViewMut<'_, T>) -> Result<()> {
        self.gemm_bias(x, rows, &lin.w, lin.bias.as_ref(), lin.in_f, lin.out_f, y)
    }

    /// The GEMM (cuBLAS, f32 accumulation, output rounded to `T`), then the
    /// bias added in place (not fused, as torch's `bias + x·wᵀ` and the CPU
    /// engine; with 16-bit storage that rounds twice, as the CPU engine's
    /// storage emulation does).
    #[allow(clippy::too_many_arguments)]
    fn gemm_bias(
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
    fn rmsnorm(&self, x: View<'_, T>, w: &DBuf<T>, out: &mut ViewMut<'_, T>, rows: usize) -> Result<()> {
        self.rmsnorm_rows(x, w, out, rows, self.cfg.hidden)
    }

    /// RMSNorm of `rows` rows of `width` values each: the hidden width, or a
    /// head (`[T·heads]` rows of D) for Qwen3's q/k norms.
    fn rmsnorm_rows(
        &self,
        x: View<'_, T>,
        w: &DBuf<T>,
        out: &mut ViewMut<'_, T>,
        rows: usize,
        width: usize,
    ) -> Result<()> {
        let (wi, eps) = (width as i32, self.cfg.rms_eps as f32);
        // SAFETY: rmsnorm_T(x [rows, width], w [width], out [rows, width], width, eps).
        unsafe {
            self.dev.launch(
                &self.f.rmsnorm,
                launch::per_row(rows, width),
                &mut [x.arg(), w.arg(), out.arg(), wi.into(), eps.into()],
            )
        }
    }

    fn rope(
        &self,
        x: &GBuf<T>,
        out: &mut GBuf<T>,
        tabs: &RopeTables,
        rows: usize,
        heads: usize,
        pos0: usize,
    ) -> Result<()> {
        let (r, h, d, p) = (rows as i32, heads as i32, self.cfg.head_dim as i32, pos0 as i32);
        let (xv, mut ov) = (x.view(), out.view_mut());
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

    fn add(&self, a: View<'_, T>, bb: View<'_, T>, out: &mut GBuf<T>) -> Result<()> {
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
    fn tap<S: Storage>(&self, tc: &mut TapCtx, stage: Stage, shape: &[usize], buf: &GBuf<S>) -> Result<()> {
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
        add: typed("add")?,
        fill_u32: get("fill_u32")?,
        fill_u16: get("fill_u16")?,
        argmax: typed("argmax")?,
        sample: typed("sample")?,
    })
}

/// cos/sin tables `[positions, D/2]` from the CPU engine's own `Rope`.
struct RopeTables {
    cos: DBuf<f32>,
    sin: DBuf<f32>,
}

struct TapCtx<'a> {
    taps: &'a TapSet,
    step: Step,
    caps: &'a mut Captures,
}

/// Per-run device state: the KV cache of every layer, `[capacity, KV, D]`.
struct RunState<T: Storage> {
    k_cache: Vec<DBuf<T>>,
    v_cache: Vec<DBuf<T>>,
    tabs: RopeTables,
    /// Seeded random sampling (None: greedy).
    random: Option<DevSampler>,
}

/// What the `sample` kernel needs across a run: the parameters, the ChaCha8
/// key of the run's seed, f64 scratch for the weights, and the index of the
/// next draw (the host `Sampler` draws one u64 per random sampling call).
struct DevSampler {
    temperature: f32,
    /// 0: no top-k; else max(k, 1), as the host truncates.
    top_k: i64,
    top_p: f32,
    has_top_p: i32,
    key: DBuf<u32>,
    scratch: DBuf<f64>,
    draws: u64,
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

    /// The device copies, read back one tensor at a time: a bad upload or a
    /// wrong offset shows in the `weights` check named by tensor.
    fn visit_weights(&self, f: &mut crate::engine::WeightVisitor) -> Result<()> {
        let (e, v, d) = (self.cfg.hidden, self.cfg.vocab, self.cfg.head_dim);
        let back = |buf: &DBuf<T>| -> Result<Vec<f32>> {
            Ok(self.dev.download(buf.view(..))?.into_iter().map(T::to_f32).collect())
        };
        let lin = |f: &mut crate::engine::WeightVisitor, name: &str, l: &DevLinear<T>| -> Result<()> {
            f(&format!("{name}.weight"), &[l.out_f, l.in_f], &back(&l.w)?);
            if let Some(b) = &l.bias {
                f(&format!("{name}.bias"), &[l.out_f], &back(b)?);
            }
            Ok(())
        };
        let w = &self.w;
        f("model.embed_tokens.weight", &[v, e], &back(&w.embed)?);
        for (i, b) in w.blocks.iter().enumerate() {
            let p = format!("model.layers.{i}");
            f(&format!("{p}.input_layernorm.weight"), &[e], &back(&b.attn_norm)?);
            lin(f, &format!("{p}.self_attn.q_proj"), &b.q)?;
            lin(f, &format!("{p}.self_attn.k_proj"), &b.k)?;
            lin(f, &format!("{p}.self_attn.v_proj"), &b.v)?;
            if let Some((qn, kn)) = &b.qk_norm {
                f(&format!("{p}.self_attn.q_norm.weight"), &[d], &back(qn)?);
                f(&format!("{p}.self_attn.k_norm.weight"), &[d], &back(kn)?);
            }
            lin(f, &format!("{p}.self_attn.o_proj"), &b.o)?;
            f(
                &format!("{p}.post_attention_layernorm.weight"),
                &[e],
                &back(&b.ffn_norm)?,
            );
            lin(f, &format!("{p}.mlp.gate_proj"), &b.gate)?;
            lin(f, &format!("{p}.mlp.up_proj"), &b.up)?;
            lin(f, &format!("{p}.mlp.down_proj"), &b.down)?;
        }
        f("model.norm.weight", &[e], &back(&w.norm)?);
        if let Some(h) = &w.lm_head {
            lin(f, "lm_head", h)?;
        }
        Ok(())
    }

    fn run(&self, req: &RunRequest, taps: &TapSet) -> Result<RunOutput> {
        req.validate(self.dev.engine_name(), self.cfg.vocab)?;
        let _one_run = self.run_lock.lock().unwrap_or_else(|p| p.into_inner());
        let cfg = &self.cfg;
        let total = req.prompt.len() + req.decode_steps;
        launch::attention(1, cfg.heads, cfg.head_dim, total).map_err(|m| self.dev.err(m))?;

        let half = cfg.head_dim / 2;
        let (mut cos, mut sin) = (Vec::with_capacity(total * half), Vec::with_capacity(total * half));
        for p in 0..total {
            let (c, s) = self.rope.cos_sin(p);
            cos.extend(c);
            sin.extend(s);
        }
        let kvd = cfg.kv_heads * cfg.head_dim;
        let random = match &req.sampling {
            Sampling::Random {
                temperature,
                top_k,
                top_p,
            } if *temperature > 0.0 => Some(DevSampler {
                temperature: *temperature,
                top_k: top_k.map(|k| i64::try_from(k.max(1)).unwrap_or(i64::MAX)).unwrap_or(0),
                top_p: top_p.unwrap_or(0.0),
                has_top_p: top_p.is_some() as i32,
                key: self.dev.upload("chacha_key", &chacha_key(req.seed))?,
                scratch: self.dev.alloc_zeros::<f64>("sample_scratch", cfg.vocab)?,
                draws: 0,
            }),
            // Greedy, or a temperature <= 0, which the host Sampler also takes as greedy.
            _ => None,
        };
        let mut st = RunState {
            k_cache: Vec::with_capacity(cfg.layers),
            v_cache: Vec::with_capacity(cfg.layers),
            tabs: RopeTables {
                cos: self.dev.upload("rope_cos", &cos)?,
                sin: self.dev.upload("rope_sin", &sin)?,
            },
            random,
        };
        for _ in 0..cfg.layers {
            st.k_cache.push(self.dev.alloc_zeros::<T>("k_cache", total * kvd)?);
            st.v_cache.push(self.dev.alloc_zeros::<T>("v_cache", total * kvd)?);
        }

        let mut captures = Captures::default();
        let mut sampled = Vec::with_capacity(req.decode_steps + 1);
        let mut positions = Vec::with_capacity(req.decode_steps + 1);
        let mut tokens = req.prompt.clone();
        let mut pos0 = 0;
        for step in Step::sequence(req.decode_steps) {
            if let Step::Decode(n) = step {
                tokens = vec![req.decode_input(n, &sampled)];
            }
            let mut tc = TapCtx {
                taps,
                step,
                caps: &mut captures,
            };
            let tok = self.forward(&mut st, &tokens, pos0, &mut tc)?;
            sampled.push(tok);
            positions.push((pos0..pos0 + tokens.len()).collect());
            pos0 += tokens.len();
        }
        self.dev.synchronize()?;
        Ok(RunOutput {
            captures,
            sampled,
            positions,
            unmapped: Vec::new(),
        })
    }
}

impl<T: Storage> CudaEngine<T>
where
    CudaBlas: Gemm<T>,
{
    /// One step at positions `pos0..pos0+T`; returns the sampled token.
    fn forward(&self, st: &mut RunState<T>, tokens: &[u32], pos0: usize, tc: &mut TapCtx) -> Result<u32> {
        let cfg = &self.cfg;
        let (t, e, v) = (tokens.len(), cfg.hidden, cfg.vocab);
        let (h, kv, d, f) = (cfg.heads, cfg.kv_heads, cfg.head_dim, cfg.ffn);
        let (qd, kvd) = (h * d, kv * d);
        let s = pos0 + t;
        let w = &self.w;

        let tok_dev = self.dev.upload("tokens", tokens)?;
        let mut embed = self.gbuf("embed", t * e)?;
        {
            let (rows, width) = (t as i32, e as i32);
            let mut ev = embed.view_mut();
            // SAFETY: embedding_T(table [V, E], tokens [T] (< V, checked), out [T, E]).
            unsafe {
                self.dev.launch(
                    &self.f.embedding,
                    launch::elementwise(t * e),
                    &mut [w.embed.arg(), tok_dev.arg(), ev.arg(), rows.into(), width.into()],
                )
            }?;
        }
        self.tap(tc, Stage::Embed, &[t, e], &embed)?;

        let mut attn_norm = self.gbuf("attn_norm", t * e)?;
        let mut q = self.gbuf("q", t * qd)?;
        let mut k = self.gbuf("k", t * kvd)?;
        let mut vv = self.gbuf("v", t * kvd)?;
        let mut q_rope = self.gbuf("q_rope", t * qd)?;
        let mut k_rope = self.gbuf("k_rope", t * kvd)?;
        let any_tap = |x: B| (0..cfg.layers).any(|l| tc.taps.contains(Stage::Block(l, x)));
        // Scores and probabilities stay f32 whatever the storage (the kernel writes f32).
        let mut probs = if any_tap(B::AttnProbs) {
            Some(self.gbuf::<f32>("attn_probs", h * t * s)?)
        } else {
            None
        };
        let mut scores = if any_tap(B::AttnScores) {
            Some(self.gbuf::<f32>("attn_scores", h * t * s)?)
        } else {
            None
        };
        let mut ctx = self.gbuf("ctx", t * qd)?;
        let mut attn_out = self.gbuf("attn_out", t * e)?;
        let mut ffn_inp = self.gbuf("ffn_inp", t * e)?;
        let mut ffn_norm = self.gbuf("ffn_norm", t * e)?;
        let mut gate = self.gbuf("gate", t * f)?;
        let mut up = self.gbuf("up", t * f)?;
        let mut act = self.gbuf("act", t * f)?;
        let mut ffn_out = self.gbuf("ffn_out", t * e)?;
        let mut out = self.gbuf("out", t * e)?;
        let attn_launch = launch::attention(t, h, d, s).map_err(|m| self.dev.err(m))?;

        for (l, b) in w.blocks.iter().enumerate() {
            let stg = |x: B| Stage::Block(l, x);
            // The block input: the embeddings, then the previous block's output
            // (read here and by the residual add below, before `out` is rewritten).
            let x_in: &GBuf<T> = if l == 0 { &embed } else { &out };
            self.rmsnorm(x_in.view(), &b.attn_norm, &mut attn_norm.view_mut(), t)?;
            self.tap(tc, stg(B::AttnNorm), &[t, e], &attn_norm)?;

            self.linear(attn_norm.view(), t, &b.q, &mut q.view_mut())?;
            self.linear(attn_norm.view(), t, &b.k, &mut k.view_mut())?;
            self.linear(attn_norm.view(), t, &b.v, &mut vv.view_mut())?;
            self.tap(tc, stg(B::Q), &[t, h, d], &q)?;
            self.tap(tc, stg(B::K), &[t, kv, d], &k)?;
            self.tap(tc, stg(B::V), &[t, kv, d], &vv)?;
            // Qwen3: per-head RMSNorm before RoPE, into the RoPE output
            // buffers (free until RoPE), then RoPE from there back into q/k.
            let (q_in, k_in, q_out, k_out) = match &b.qk_norm {
                Some((qn, kn)) => {
                    self.rmsnorm_rows(q.view(), qn, &mut q_rope.view_mut(), t * h, d)?;
                    self.rmsnorm_rows(k.view(), kn, &mut k_rope.view_mut(), t * kv, d)?;
                    self.tap(tc, stg(B::QNorm), &[t, h, d], &q_rope)?;
                    self.tap(tc, stg(B::KNorm), &[t, kv, d], &k_rope)?;
                    (&q_rope, &k_rope, &mut q, &mut k)
                }
                None => (&q, &k, &mut q_rope, &mut k_rope),
            };
            self.rope(q_in, q_out, &st.tabs, t, h, pos0)?;
            self.rope(k_in, k_out, &st.tabs, t, kv, pos0)?;
            let (q_rope, k_rope) = (&*q_out, &*k_out);
            self.tap(tc, stg(B::QRope), &[t, h, d], q_rope)?;
            self.tap(tc, stg(B::KRope), &[t, kv, d], k_rope)?;

            // Append this step's keys (after RoPE) and values to the cache.
            let span = pos0 * kvd..s * kvd;
            self.dev
                .copy(k_rope.view(), &mut st.k_cache[l].view_mut(span.clone()))?;
            self.dev.copy(vv.view(), &mut st.v_cache[l].view_mut(span))?;

            let want_probs = tc.taps.contains(stg(B::AttnProbs));
            let want_scores = tc.taps.contains(stg(B::AttnScores));
            {
                let (rows, hh, kvh, dd, p0, ss) = (t as i32, h as i32, kv as i32, d as i32, pos0 as i32, s as i32);
                // HF's `head_dim ** -0.5` rounded to f32, as the CPU engine.
                let scale = (d as f64).powf(-0.5) as f32;
                let qv = q_rope.view();
                let mut cv = ctx.view_mut();
                let mut pv = probs.as_mut().filter(|_| want_probs).map(|p| p.view_mut());
                let mut sv = scores.as_mut().filter(|_| want_scores).map(|p| p.view_mut());
                let decode = t == 1;
                let func = if decode {
                    &self.f.attention_decode
                } else {
                    &self.f.attention_prefill
                };
                let mut args = vec![qv.arg(), st.k_cache[l].arg(), st.v_cache[l].arg()];
                args.push(sv.as_mut().map_or(KArg::Null, |p| p.arg()));
                args.push(pv.as_mut().map_or(KArg::Null, |p| p.arg()));
                args.push(cv.arg());
                if !decode {
                    args.push(rows.into());
                }
                args.extend([hh.into(), kvh.into(), dd.into(), p0.into(), ss.into(), scale.into()]);
                let lc = if decode {
                    Launch {
                        grid: (h as u32, 1, 1),
                        ..attn_launch
                    }
                } else {
                    attn_launch
                };
                // SAFETY: q [T, H, D], caches [capacity >= S, KV, D], scores and probs [H, T, S] or NULL,
                // ctx [T, H*D]; smem (D + S) floats as `launch::attention` computed.
                unsafe { self.dev.launch(func, lc, &mut args) }?;
            }
            if want_scores {
                let p = scores.as_ref().expect("allocated when any layer taps attn_scores");
                self.tap(tc, stg(B::AttnScores), &[h, t, s], p)?;
            }
            if want_probs {
                let p = probs.as_ref().expect("allocated when any layer taps attn_probs");
                self.tap(tc, stg(B::AttnProbs), &[h, t, s], p)?;
            }
            self.tap(tc, stg(B::AttnCtx), &[t, qd], &ctx)?;
            self.linear(ctx.view(), t, &b.o, &mut attn_out.view_mut())?;
            self.tap(tc, stg(B::AttnOut), &[t, e], &attn_out)?;

            let x_in: &GBuf<T> = if l == 0 { &embed } else { &out };
            self.add(x_in.view(), attn_out.view(), &mut ffn_inp)?;
            self.tap(tc, stg(B::FfnInp), &[t, e], &ffn_inp)?;
            self.rmsnorm(ffn_inp.view(), &b.ffn_norm, &mut ffn_norm.view_mut(), t)?;
            self.tap(tc, stg(B::FfnNorm), &[t, e], &ffn_norm)?;
            self.linear(ffn_norm.view(), t, &b.gate, &mut gate.view_mut())?;
            self.tap(tc, stg(B::FfnGate), &[t, f], &gate)?;
            self.linear(ffn_norm.view(), t, &b.up, &mut up.view_mut())?;
            self.tap(tc, stg(B::FfnUp), &[t, f], &up)?;
            {
                let n = (t * f) as i64;
                let (gv, uv, mut av) = (gate.view(), up.view(), act.view_mut());
                // SAFETY: silu_mul_T(gate, up, out, n), all [T, F].
                unsafe {
                    self.dev.launch(
                        &self.f.silu_mul,
                        launch::elementwise(t * f),
                        &mut [gv.arg(), uv.arg(), av.arg(), n.into()],
                    )
                }?;
            }
            self.tap(tc, stg(B::FfnAct), &[t, f], &act)?;
            self.linear(act.view(), t, &b.down, &mut ffn_out.view_mut())?;
            self.tap(tc, stg(B::FfnOut), &[t, e], &ffn_out)?;
            self.add(ffn_inp.view(), ffn_out.view(), &mut out)?;
            self.tap(tc, stg(B::Out), &[t, e], &out)?;
        }

        // As the CPU engine: only the last row is normed and projected unless
        // output_norm or logits is tapped.
        let all_rows = tc.taps.contains(Stage::OutputNorm) || tc.taps.contains(Stage::Logits);
        let first = if all_rows { 0 } else { t - 1 };
        let nrows = t - first;
        let x_fin: &GBuf<T> = if w.blocks.is_empty() { &embed } else { &out };
        let mut onorm = self.gbuf("output_norm", nrows * e)?;
        self.rmsnorm(x_fin.view().slice(first * e..), &w.norm, &mut onorm.view_mut(), nrows)?;
        self.tap(tc, Stage::OutputNorm, &[t, e], &onorm)?;
        let head_rows = if tc.taps.contains(Stage::Logits) { t } else { 1 };
        let mut logits = self.gbuf("logits", head_rows * v)?;
        {
            let ov = onorm.view();
            let head_in = ov.slice((nrows - head_rows) * e..);
            let mut lv = logits.view_mut();
            match &w.lm_head {
                Some(lin) => self.linear(head_in, head_rows, lin, &mut lv)?,
                // Tied head: the embedding matrix [V, E] is the weight.
                None => self.gemm_bias(head_in, head_rows, &w.embed, None, e, v, &mut lv)?,
            }
        }
        self.tap(tc, Stage::Logits, &[t, v], &logits)?;

        let lv = logits.view();
        let last = lv.slice((head_rows - 1) * v..head_rows * v);
        // The only device→host copy of an untapped step: the token, 4 bytes.
        let mut tok = self.dev.alloc_zeros::<u32>("token", 1)?;
        let n = v as i32;
        match st.random.as_mut() {
            None => {
                // SAFETY: argmax_T(x [n], n, out [1]).
                unsafe {
                    self.dev.launch(
                        &self.f.argmax,
                        launch::argmax(),
                        &mut [last.arg(), n.into(), tok.arg_mut()],
                    )
                }?;
            }
            Some(r) => {
                if tc.taps.contains(Stage::SampleProbs) {
                    // The distribution the draw samples from, computed on the host
                    // from this step's device logits with the host sampler's rules
                    // (the `sample` kernel is proven to draw as the host sampler:
                    // `reference::sample`); read back only when tapped.
                    let row = self.dev.download(last)?;
                    let row: Vec<f32> = row.iter().map(|x| x.to_f32()).collect();
                    let sampling = crate::sampling::Sampling::Random {
                        temperature: r.temperature,
                        top_k: (r.top_k > 0).then_some(r.top_k as usize),
                        top_p: (r.has_top_p != 0).then_some(r.top_p),
                    };
                    if let Some(p) = crate::sampling::distribution(&sampling, &row) {
                        tc.caps.insert(
                            tc.step,
                            Stage::SampleProbs,
                            Tensor::new(vec![1, v], p).with_dtype(T::DTYPE),
                        );
                    }
                }
                // SAFETY: sample_T(x [n], n, temperature, top_k, top_p, has_top_p, key [8],
                // draw, w [n] f64 scratch (vocab long), out [1]).
                unsafe {
                    self.dev.launch(
                        &self.f.sample,
                        launch::sample(),
                        &mut [
                            last.arg(),
                            n.into(),
                            r.temperature.into(),
                            r.top_k.into(),
                            r.top_p.into(),
                            r.has_top_p.into(),
                            r.key.arg(),
                            r.draws.into(),
                            r.scratch.arg_mut(),
                            tok.arg_mut(),
                        ],
                    )
                }?;
                r.draws += 1;
            }
        }
        let host = self.dev.download(tok.view(..))?;
        Ok(host[0])
    }
}
