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

use std::path::Path;
use std::sync::{Arc, Mutex};

use cudarc::cublas::sys::cublasOperation_t;
use cudarc::cublas::{CudaBlas, Gemm, GemmConfig};
use cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, CudaStream, CudaView, CudaViewMut, LaunchConfig, PushKernelArg,
};
use cudarc::nvrtc::Ptx;

use crate::engine::cpu::layers::{Linear, ModelWeights};
use crate::engine::cpu::ops::Rope;
use crate::engine::{Captures, Engine, RunOutput, RunRequest, TapSet};
use crate::error::{Error, Result};
use crate::model::ModelConfig;
use crate::sampling::{chacha_key, Sampling};
use crate::stage::{BlockStage as B, Stage, Step};
use crate::tensor::{DType, Tensor};

use super::compile::{self, FILES};
use super::guard::Guarded;
use super::launch::{self, Launch};
use super::storage::Storage;

fn err(what: impl std::fmt::Display) -> Error {
    Error::engine("cuda", what.to_string())
}

fn lcfg(l: Launch) -> LaunchConfig {
    LaunchConfig {
        grid_dim: l.grid,
        block_dim: (l.block, 1, 1),
        shared_mem_bytes: l.smem,
    }
}

struct DevLinear<T> {
    w: CudaSlice<T>,
    bias: Option<CudaSlice<T>>,
    out_f: usize,
    in_f: usize,
}

struct DevBlock<T> {
    attn_norm: CudaSlice<T>,
    q: DevLinear<T>,
    k: DevLinear<T>,
    v: DevLinear<T>,
    /// Qwen3's per-head q/k RMSNorm weights (`[D]`).
    qk_norm: Option<(CudaSlice<T>, CudaSlice<T>)>,
    o: DevLinear<T>,
    ffn_norm: CudaSlice<T>,
    gate: DevLinear<T>,
    up: DevLinear<T>,
    down: DevLinear<T>,
}

struct DevWeights<T> {
    embed: CudaSlice<T>,
    blocks: Vec<DevBlock<T>>,
    norm: CudaSlice<T>,
    lm_head: Option<DevLinear<T>>,
}

/// The kernels the forward pass launches, for the storage type.
struct Funcs {
    embedding: CudaFunction,
    rmsnorm: CudaFunction,
    rope_neox: CudaFunction,
    attention_prefill: CudaFunction,
    attention_decode: CudaFunction,
    bias_add: CudaFunction,
    silu_mul: CudaFunction,
    add: CudaFunction,
    fill_u32: CudaFunction,
    fill_u16: CudaFunction,
    argmax: CudaFunction,
    sample: CudaFunction,
}

/// A device buffer with guard regions (see `guard`).
struct GBuf<S> {
    buf: CudaSlice<S>,
    g: Guarded,
}

impl<S: Storage> GBuf<S> {
    fn view(&self) -> CudaView<'_, S> {
        self.buf.slice(self.g.interior())
    }
    fn view_mut(&mut self) -> CudaViewMut<'_, S> {
        let r = self.g.interior();
        self.buf.slice_mut(r)
    }
}

/// Loads the model for the CUDA engine in the storage type `opts.storage`.
pub fn load(model: &Path, opts: &crate::model::LoadOptions) -> Result<Box<dyn Engine>> {
    Ok(match opts.storage {
        DType::F32 => Box::new(CudaEngine::<f32>::load(model, opts)?),
        DType::F16 => Box::new(CudaEngine::<half::f16>::load(model, opts)?),
        DType::BF16 => Box::new(CudaEngine::<half::bf16>::load(model, opts)?),
    })
}

pub struct CudaEngine<T> {
    cfg: ModelConfig,
    stream: Arc<CudaStream>,
    blas: CudaBlas,
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
    /// engine) and uploads its weights rounded to `T`.
    pub fn load(model: &Path, opts: &crate::model::LoadOptions) -> Result<CudaEngine<T>> {
        let ctx = super::context().map_err(err)?;
        let (cfg, mut ws) = crate::model::load(model, opts)?;
        let host = ModelWeights::load(&cfg, &mut ws)?;
        let stream = ctx.default_stream();
        let f = load_funcs::<T>(&ctx)?;
        let blas = CudaBlas::new(stream.clone()).map_err(|e| err(format!("cuBLAS init: {e}")))?;
        let up = |v: &[f32]| {
            let h: Vec<T> = v.iter().map(|&x| T::from_f32(x)).collect();
            stream.clone_htod(&h).map_err(|e| err(format!("weight upload: {e}")))
        };
        let lin = |l: &Linear| -> Result<DevLinear<T>> {
            Ok(DevLinear {
                w: up(&l.w)?,
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
            embed: up(&host.embed)?,
            blocks,
            norm: up(&host.norm)?,
            lm_head: host.lm_head.as_ref().map(lin).transpose()?,
        };
        let rope = Rope::new(cfg.head_dim, cfg.rope_theta);
        Ok(CudaEngine {
            cfg,
            stream,
            blas,
            f,
            w,
            rope,
            run_lock: Mutex::new(()),
        })
    }

    /// A guarded buffer of `len` elements of `S`, filled with `S`'s sentinel
    /// (guards and interior).
    fn gbuf<S: Storage>(&self, len: usize) -> Result<GBuf<S>> {
        let g = Guarded { len };
        // SAFETY: every element is written by the fill below before any read.
        let mut buf = unsafe { self.stream.alloc::<S>(g.total()) }.map_err(err)?;
        let n = g.total() as i64;
        let (bits32, bits16) = (S::SENTINEL_BITS, S::SENTINEL_BITS as u16);
        let wide = std::mem::size_of::<S>() == 4;
        let mut b = self
            .stream
            .launch_builder(if wide { &self.f.fill_u32 } else { &self.f.fill_u16 });
        b.arg(&mut buf);
        if wide {
            b.arg(&bits32);
        } else {
            b.arg(&bits16);
        }
        b.arg(&n);
        // SAFETY: fill_u32(unsigned* x, unsigned bits, long long n) or fill_u16(unsigned
        // short* x, unsigned short bits, long long n) over the n elements of buf, by S's width.
        unsafe { b.launch(lcfg(launch::elementwise(g.total()))) }.map_err(err)?;
        Ok(GBuf { buf, g })
    }

    /// `y[rows, out] = x[rows, in] · wᵀ (+ bias)`, as the CPU's `Linear::forward`.
    fn linear(&self, x: &CudaView<T>, rows: usize, lin: &DevLinear<T>, y: &mut CudaViewMut<T>) -> Result<()> {
        self.gemm_bias(x, rows, &lin.w, lin.bias.as_ref(), lin.in_f, lin.out_f, y)
    }

    /// The GEMM (cuBLAS, f32 accumulation, output rounded to `T`), then the
    /// bias added in place (not fused, as torch's `bias + x·wᵀ` and the CPU
    /// engine; with 16-bit storage that rounds twice, as the CPU engine's
    /// storage emulation does).
    #[allow(clippy::too_many_arguments)]
    fn gemm_bias(
        &self,
        x: &CudaView<T>,
        rows: usize,
        w: &CudaSlice<T>,
        bias: Option<&CudaSlice<T>>,
        in_f: usize,
        out_f: usize,
        y: &mut CudaViewMut<T>,
    ) -> Result<()> {
        assert!(x.len() >= rows * in_f && w.len() == out_f * in_f && y.len() >= rows * out_f);
        let g = launch::linear_gemm(rows, in_f, out_f);
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
        // SAFETY: w is [out, in], x at least [rows, in], y at least [rows, out] (asserted).
        unsafe { self.blas.gemm(gc, w, x, y) }.map_err(|e| err(format!("cuBLAS gemm ({}): {e}", T::SUFFIX)))?;
        if let Some(bias) = bias {
            let (r, c) = (rows as i32, out_f as i32);
            let mut b = self.stream.launch_builder(&self.f.bias_add);
            b.arg(&mut *y).arg(bias).arg(&r).arg(&c);
            // SAFETY: bias_add_T(y [rows, cols], b [cols], rows, cols).
            unsafe { b.launch(lcfg(launch::elementwise(rows * out_f))) }.map_err(err)?;
        }
        Ok(())
    }

    /// RMSNorm of `rows` rows of the hidden width (the block and final norms).
    fn rmsnorm(&self, x: &CudaView<T>, w: &CudaSlice<T>, out: &mut CudaViewMut<T>, rows: usize) -> Result<()> {
        self.rmsnorm_rows(x, w, out, rows, self.cfg.hidden)
    }

    /// RMSNorm of `rows` rows of `width` values each: the hidden width, or a
    /// head (`[T·heads]` rows of D) for Qwen3's q/k norms.
    fn rmsnorm_rows(
        &self,
        x: &CudaView<T>,
        w: &CudaSlice<T>,
        out: &mut CudaViewMut<T>,
        rows: usize,
        width: usize,
    ) -> Result<()> {
        let (wi, eps) = (width as i32, self.cfg.rms_eps as f32);
        let mut b = self.stream.launch_builder(&self.f.rmsnorm);
        b.arg(x).arg(w).arg(out).arg(&wi).arg(&eps);
        // SAFETY: rmsnorm_T(x [rows, width], w [width], out [rows, width], width, eps).
        unsafe { b.launch(lcfg(launch::per_row(rows, width))) }.map_err(err)?;
        Ok(())
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
        let mut b = self.stream.launch_builder(&self.f.rope_neox);
        b.arg(&xv)
            .arg(&mut ov)
            .arg(&tabs.cos)
            .arg(&tabs.sin)
            .arg(&r)
            .arg(&h)
            .arg(&d)
            .arg(&p);
        // SAFETY: rope_neox_T over [rows, heads, D] (f32 tables); tables cover positions < pos0 + rows.
        unsafe { b.launch(lcfg(launch::elementwise(rows * heads * self.cfg.head_dim / 2))) }.map_err(err)?;
        Ok(())
    }

    fn add(&self, a: &CudaView<T>, bb: &CudaView<T>, out: &mut GBuf<T>) -> Result<()> {
        let n = out.g.len as i64;
        let mut ov = out.view_mut();
        let mut b = self.stream.launch_builder(&self.f.add);
        b.arg(a).arg(bb).arg(&mut ov).arg(&n);
        // SAFETY: add_T(a, b, out, n), all n long.
        unsafe { b.launch(lcfg(launch::elementwise(n as usize))) }.map_err(err)?;
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
        let full = self.stream.clone_dtoh(&buf.buf).map_err(err)?;
        self.stream.synchronize().map_err(err)?;
        buf.g
            .check(&full)
            .map_err(|v| err(format!("{}/{stage}: {v}", tc.step)))?;
        let values = full[buf.g.interior()].iter().map(|x| x.to_f32()).collect();
        tc.caps
            .insert(tc.step, stage, Tensor::new(shape.to_vec(), values).with_dtype(T::DTYPE));
        Ok(())
    }
}

fn load_funcs<T: Storage>(ctx: &Arc<CudaContext>) -> Result<Funcs> {
    let (major, minor) = ctx.compute_capability().map_err(err)?;
    let arch = format!("sm_{major}{minor}");
    let mut modules = Vec::new();
    for file in FILES {
        let ptx = compile::ptx(file, &arch).map_err(err)?;
        let m = ctx
            .load_module(Ptx::from_src(ptx.as_str()))
            .map_err(|e| err(format!("loading the PTX of cuda/{} for {arch}: {e}", file.name)))?;
        modules.push((file, m));
    }
    let get = |name: &str| -> Result<CudaFunction> {
        let (_, m) = modules
            .iter()
            .find(|(f, _)| f.kernels.contains(&name))
            .ok_or_else(|| err(format!("kernel {name} is in no kernel file")))?;
        m.load_function(name).map_err(|e| err(format!("kernel {name}: {e}")))
    };
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
    cos: CudaSlice<f32>,
    sin: CudaSlice<f32>,
}

struct TapCtx<'a> {
    taps: &'a TapSet,
    step: Step,
    caps: &'a mut Captures,
}

/// Per-run device state: the KV cache of every layer, `[capacity, KV, D]`.
struct RunState<T> {
    k_cache: Vec<CudaSlice<T>>,
    v_cache: Vec<CudaSlice<T>>,
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
    key: CudaSlice<u32>,
    scratch: CudaSlice<f64>,
    draws: u64,
}

impl<T: Storage> Engine for CudaEngine<T>
where
    CudaBlas: Gemm<T>,
{
    fn name(&self) -> &str {
        "cuda"
    }

    fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    /// The device copies, read back one tensor at a time: a bad upload or a
    /// wrong offset shows in the `weights` check named by tensor.
    fn visit_weights(&self, f: &mut crate::engine::WeightVisitor) -> Result<()> {
        let (e, v, d) = (self.cfg.hidden, self.cfg.vocab, self.cfg.head_dim);
        let back = |buf: &CudaSlice<T>| -> Result<Vec<f32>> {
            Ok(self
                .stream
                .clone_dtoh(buf)
                .map_err(err)?
                .into_iter()
                .map(T::to_f32)
                .collect())
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
        req.validate("cuda", self.cfg.vocab)?;
        let _one_run = self.run_lock.lock().unwrap_or_else(|p| p.into_inner());
        let cfg = &self.cfg;
        let total = req.prompt.len() + req.decode_steps;
        launch::attention(1, cfg.heads, cfg.head_dim, total).map_err(err)?;

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
                key: self.stream.clone_htod(&chacha_key(req.seed)).map_err(err)?,
                scratch: self.stream.alloc_zeros::<f64>(cfg.vocab).map_err(err)?,
                draws: 0,
            }),
            // Greedy, or a temperature <= 0, which the host Sampler also takes as greedy.
            _ => None,
        };
        let mut st = RunState {
            k_cache: Vec::with_capacity(cfg.layers),
            v_cache: Vec::with_capacity(cfg.layers),
            tabs: RopeTables {
                cos: self.stream.clone_htod(&cos).map_err(err)?,
                sin: self.stream.clone_htod(&sin).map_err(err)?,
            },
            random,
        };
        for _ in 0..cfg.layers {
            st.k_cache.push(self.stream.alloc_zeros::<T>(total * kvd).map_err(err)?);
            st.v_cache.push(self.stream.alloc_zeros::<T>(total * kvd).map_err(err)?);
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
        self.stream.synchronize().map_err(err)?;
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

        let tok_dev = self.stream.clone_htod(tokens).map_err(err)?;
        let mut embed = self.gbuf(t * e)?;
        {
            let (rows, width) = (t as i32, e as i32);
            let mut ev = embed.view_mut();
            let mut b = self.stream.launch_builder(&self.f.embedding);
            b.arg(&w.embed).arg(&tok_dev).arg(&mut ev).arg(&rows).arg(&width);
            // SAFETY: embedding_T(table [V, E], tokens [T] (< V, checked), out [T, E]).
            unsafe { b.launch(lcfg(launch::elementwise(t * e))) }.map_err(err)?;
        }
        self.tap(tc, Stage::Embed, &[t, e], &embed)?;

        let mut attn_norm = self.gbuf(t * e)?;
        let mut q = self.gbuf(t * qd)?;
        let mut k = self.gbuf(t * kvd)?;
        let mut vv = self.gbuf(t * kvd)?;
        let mut q_rope = self.gbuf(t * qd)?;
        let mut k_rope = self.gbuf(t * kvd)?;
        let any_tap = |x: B| (0..cfg.layers).any(|l| tc.taps.contains(Stage::Block(l, x)));
        // Scores and probabilities stay f32 whatever the storage (the kernel writes f32).
        let mut probs = if any_tap(B::AttnProbs) {
            Some(self.gbuf::<f32>(h * t * s)?)
        } else {
            None
        };
        let mut scores = if any_tap(B::AttnScores) {
            Some(self.gbuf::<f32>(h * t * s)?)
        } else {
            None
        };
        let mut ctx = self.gbuf(t * qd)?;
        let mut attn_out = self.gbuf(t * e)?;
        let mut ffn_inp = self.gbuf(t * e)?;
        let mut ffn_norm = self.gbuf(t * e)?;
        let mut gate = self.gbuf(t * f)?;
        let mut up = self.gbuf(t * f)?;
        let mut act = self.gbuf(t * f)?;
        let mut ffn_out = self.gbuf(t * e)?;
        let mut out = self.gbuf(t * e)?;
        let attn_launch = launch::attention(t, h, d, s).map_err(err)?;

        for (l, b) in w.blocks.iter().enumerate() {
            let stg = |x: B| Stage::Block(l, x);
            // The block input: the embeddings, then the previous block's output
            // (read here and by the residual add below, before `out` is rewritten).
            let x_in: &GBuf<T> = if l == 0 { &embed } else { &out };
            self.rmsnorm(&x_in.view(), &b.attn_norm, &mut attn_norm.view_mut(), t)?;
            self.tap(tc, stg(B::AttnNorm), &[t, e], &attn_norm)?;

            self.linear(&attn_norm.view(), t, &b.q, &mut q.view_mut())?;
            self.linear(&attn_norm.view(), t, &b.k, &mut k.view_mut())?;
            self.linear(&attn_norm.view(), t, &b.v, &mut vv.view_mut())?;
            self.tap(tc, stg(B::Q), &[t, h, d], &q)?;
            self.tap(tc, stg(B::K), &[t, kv, d], &k)?;
            self.tap(tc, stg(B::V), &[t, kv, d], &vv)?;
            // Qwen3: per-head RMSNorm before RoPE, into the RoPE output
            // buffers (free until RoPE), then RoPE from there back into q/k.
            let (q_in, k_in, q_out, k_out) = match &b.qk_norm {
                Some((qn, kn)) => {
                    self.rmsnorm_rows(&q.view(), qn, &mut q_rope.view_mut(), t * h, d)?;
                    self.rmsnorm_rows(&k.view(), kn, &mut k_rope.view_mut(), t * kv, d)?;
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
            self.stream
                .memcpy_dtod(&k_rope.view(), &mut st.k_cache[l].slice_mut(span.clone()))
                .map_err(err)?;
            self.stream
                .memcpy_dtod(&vv.view(), &mut st.v_cache[l].slice_mut(span))
                .map_err(err)?;

            let want_probs = tc.taps.contains(stg(B::AttnProbs));
            let want_scores = tc.taps.contains(stg(B::AttnScores));
            {
                let (rows, hh, kvh, dd, p0, ss) = (t as i32, h as i32, kv as i32, d as i32, pos0 as i32, s as i32);
                // HF's `head_dim ** -0.5` rounded to f32, as the CPU engine.
                let scale = (d as f64).powf(-0.5) as f32;
                let qv = q_rope.view();
                let mut cv = ctx.view_mut();
                let null: u64 = 0;
                let mut pv = probs.as_mut().filter(|_| want_probs).map(|p| p.view_mut());
                let mut sv = scores.as_mut().filter(|_| want_scores).map(|p| p.view_mut());
                let decode = t == 1;
                let func = if decode {
                    &self.f.attention_decode
                } else {
                    &self.f.attention_prefill
                };
                let mut bld = self.stream.launch_builder(func);
                bld.arg(&qv).arg(&st.k_cache[l]).arg(&st.v_cache[l]);
                match sv.as_mut() {
                    Some(p) => bld.arg(p),
                    None => bld.arg(&null),
                };
                match pv.as_mut() {
                    Some(p) => bld.arg(p),
                    None => bld.arg(&null),
                };
                bld.arg(&mut cv);
                if !decode {
                    bld.arg(&rows);
                }
                bld.arg(&hh).arg(&kvh).arg(&dd).arg(&p0).arg(&ss).arg(&scale);
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
                unsafe { bld.launch(lcfg(lc)) }.map_err(err)?;
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
            self.linear(&ctx.view(), t, &b.o, &mut attn_out.view_mut())?;
            self.tap(tc, stg(B::AttnOut), &[t, e], &attn_out)?;

            let x_in: &GBuf<T> = if l == 0 { &embed } else { &out };
            self.add(&x_in.view(), &attn_out.view(), &mut ffn_inp)?;
            self.tap(tc, stg(B::FfnInp), &[t, e], &ffn_inp)?;
            self.rmsnorm(&ffn_inp.view(), &b.ffn_norm, &mut ffn_norm.view_mut(), t)?;
            self.tap(tc, stg(B::FfnNorm), &[t, e], &ffn_norm)?;
            self.linear(&ffn_norm.view(), t, &b.gate, &mut gate.view_mut())?;
            self.tap(tc, stg(B::FfnGate), &[t, f], &gate)?;
            self.linear(&ffn_norm.view(), t, &b.up, &mut up.view_mut())?;
            self.tap(tc, stg(B::FfnUp), &[t, f], &up)?;
            {
                let n = (t * f) as i64;
                let (gv, uv, mut av) = (gate.view(), up.view(), act.view_mut());
                let mut bld = self.stream.launch_builder(&self.f.silu_mul);
                bld.arg(&gv).arg(&uv).arg(&mut av).arg(&n);
                // SAFETY: silu_mul_T(gate, up, out, n), all [T, F].
                unsafe { bld.launch(lcfg(launch::elementwise(t * f))) }.map_err(err)?;
            }
            self.tap(tc, stg(B::FfnAct), &[t, f], &act)?;
            self.linear(&act.view(), t, &b.down, &mut ffn_out.view_mut())?;
            self.tap(tc, stg(B::FfnOut), &[t, e], &ffn_out)?;
            self.add(&ffn_inp.view(), &ffn_out.view(), &mut out)?;
            self.tap(tc, stg(B::Out), &[t, e], &out)?;
        }

        // As the CPU engine: only the last row is normed and projected unless
        // output_norm or logits is tapped.
        let all_rows = tc.taps.contains(Stage::OutputNorm) || tc.taps.contains(Stage::Logits);
        let first = if all_rows { 0 } else { t - 1 };
        let nrows = t - first;
        let x_fin: &GBuf<T> = if w.blocks.is_empty() { &embed } else { &out };
        let mut onorm = self.gbuf(nrows * e)?;
        self.rmsnorm(&x_fin.view().slice(first * e..), &w.norm, &mut onorm.view_mut(), nrows)?;
        self.tap(tc, Stage::OutputNorm, &[t, e], &onorm)?;
        let head_rows = if tc.taps.contains(Stage::Logits) { t } else { 1 };
        let mut logits = self.gbuf(head_rows * v)?;
        {
            let ov = onorm.view();
            let head_in = ov.slice((nrows - head_rows) * e..);
            let mut lv = logits.view_mut();
            match &w.lm_head {
                Some(lin) => self.linear(&head_in, head_rows, lin, &mut lv)?,
                // Tied head: the embedding matrix [V, E] is the weight.
                None => self.gemm_bias(&head_in, head_rows, &w.embed, None, e, v, &mut lv)?,
            }
        }
        self.tap(tc, Stage::Logits, &[t, v], &logits)?;

        let lv = logits.view();
        let last = lv.slice((head_rows - 1) * v..head_rows * v);
        // The only device→host copy of an untapped step: the token, 4 bytes.
        let mut tok = self.stream.alloc_zeros::<u32>(1).map_err(err)?;
        let n = v as i32;
        match st.random.as_mut() {
            None => {
                let mut bld = self.stream.launch_builder(&self.f.argmax);
                bld.arg(&last).arg(&n).arg(&mut tok);
                // SAFETY: argmax_T(x [n], n, out [1]).
                unsafe { bld.launch(lcfg(launch::argmax())) }.map_err(err)?;
            }
            Some(r) => {
                if tc.taps.contains(Stage::SampleProbs) {
                    // The distribution the draw samples from, computed on the host
                    // from this step's device logits with the host sampler's rules
                    // (the `sample` kernel is proven to draw as the host sampler:
                    // `reference::sample`); read back only when tapped.
                    let row = self.stream.clone_dtoh(&last).map_err(err)?;
                    self.stream.synchronize().map_err(err)?;
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
                let mut bld = self.stream.launch_builder(&self.f.sample);
                bld.arg(&last)
                    .arg(&n)
                    .arg(&r.temperature)
                    .arg(&r.top_k)
                    .arg(&r.top_p)
                    .arg(&r.has_top_p)
                    .arg(&r.key)
                    .arg(&r.draws)
                    .arg(&mut r.scratch)
                    .arg(&mut tok);
                // SAFETY: sample_T(x [n], n, temperature, top_k, top_p, has_top_p, key [8],
                // draw, w [n] f64 scratch (vocab long), out [1]).
                unsafe { bld.launch(lcfg(launch::sample())) }.map_err(err)?;
                r.draws += 1;
            }
        }
        let host = self.stream.clone_dtoh(&tok).map_err(err)?;
        self.stream.synchronize().map_err(err)?;
        Ok(host[0])
    }
}
