//! The CUDA engine's step (`driver::Forward`): the device state of a run
//! (the KV cache of every layer, RoPE tables, the seeded sampler's state) and
//! one forward pass in the canonical stage order, every stage writing its own
//! guarded device buffer, taps copying a stage back only when it is
//! requested. With nothing tapped, the only device→host copy of a step is the
//! sampled token: greedy is argmax on the device, and seeded random sampling
//! runs the host `Sampler`'s algorithm and ChaCha8 stream on the device
//! (`cuda/sampling.cu`), so a seed draws the same tokens as on the CPU engine.

use cudarc::cublas::{CudaBlas, Gemm};

use super::device::{CudaEngine, GBuf, RopeTables, TapCtx};
use super::launch::{self, Launch};
use super::multimodal::VlmRun;
use super::seam::{DBuf, KArg};
use super::storage::Storage;
use crate::engine::driver::{Forward, StepIn, StepOut};
use crate::engine::RunRequest;
use crate::error::Result;
use crate::model::config::Activation;
use crate::sampling::{chacha_key, Sampling};
use crate::stage::{BlockStage as B, Stage};
use crate::tensor::DType;

/// Per-run device state: the KV cache of every layer, `[capacity, KV, D]`.
pub struct RunState<T: Storage> {
    k_cache: Vec<DBuf<T>>,
    v_cache: Vec<DBuf<T>>,
    tabs: RopeTables,
    /// Local layers' tables (Gemma 3), when the model has its own base for them.
    local_tabs: Option<RopeTables>,
    /// Seeded random sampling (None: greedy).
    random: Option<DevSampler>,
    /// A vision-language model's image and M-RoPE state.
    vlm: Option<VlmRun>,
}

/// What the `sample` kernel needs across a run: the parameters, the ChaCha8
/// key of the run's seed, f64 scratch for the weights, and the index of the
/// next draw (the host `Sampler` draws one u64 per random sampling call).
pub(super) struct DevSampler {
    temperature: f32,
    /// 0: no top-k; else max(k, 1), as the host truncates.
    top_k: i64,
    top_p: f32,
    has_top_p: i32,
    key: DBuf<u32>,
    scratch: DBuf<f64>,
    draws: u64,
}

impl<T: Storage> Forward for CudaEngine<T>
where
    CudaBlas: Gemm<T>,
{
    type Run = RunState<T>;

    fn engine_name(&self) -> &str {
        self.dev.engine_name()
    }

    fn vocab(&self) -> usize {
        self.cfg.vocab
    }

    fn storage(&self) -> DType {
        T::DTYPE
    }

    fn begin(&self, req: &RunRequest) -> Result<(RunState<T>, Sampling)> {
        let cfg = &self.cfg;
        let total = req.prompt.len() + req.decode_steps;
        launch::attention(1, cfg.heads, cfg.head_dim, total).map_err(|m| self.dev.err(m))?;

        let half = cfg.head_dim / 2;
        let tables = |rope: &crate::engine::cpu::ops::Rope| -> Result<RopeTables> {
            let (mut cos, mut sin) = (Vec::with_capacity(total * half), Vec::with_capacity(total * half));
            for p in 0..total {
                let (c, s) = rope.cos_sin(p);
                cos.extend(c);
                sin.extend(s);
            }
            Ok(RopeTables {
                cos: self.dev.upload("rope_cos", &cos)?,
                sin: self.dev.upload("rope_sin", &sin)?,
            })
        };
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
            tabs: tables(&self.ropes.global)?,
            local_tabs: self.ropes.local.as_ref().map(|(r, _)| tables(r)).transpose()?,
            random,
            vlm: self.vlm_begin(req)?,
        };
        for _ in 0..cfg.layers {
            st.k_cache.push(self.dev.alloc_zeros::<T>("k_cache", total * kvd)?);
            st.v_cache.push(self.dev.alloc_zeros::<T>("v_cache", total * kvd)?);
        }

        Ok((st, req.sampling.clone()))
    }

    fn step(&self, st: &mut RunState<T>, s: StepIn) -> Result<StepOut> {
        let mut tc = TapCtx {
            taps: s.taps,
            step: s.step,
            caps: s.caps,
        };
        let (token, logits) = self.forward(st, s.tokens, s.pos0, &mut tc, s.want_logits)?;
        Ok(StepOut { token, logits })
    }

    fn end(&self, _: RunState<T>) -> Result<()> {
        self.dev.synchronize()
    }
}

impl<T: Storage> CudaEngine<T>
where
    CudaBlas: Gemm<T>,
{
    /// One step at positions `pos0..pos0+T`; returns the sampled token, and
    /// the last row of the logits when `want_logits`.
    fn forward(
        &self,
        st: &mut RunState<T>,
        tokens: &[u32],
        pos0: usize,
        tc: &mut TapCtx,
        want_logits: bool,
    ) -> Result<(u32, Option<Vec<f32>>)> {
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
        if let Some(sc) = cfg.embed_scale {
            let n = (t * e) as i64;
            let mut ev = embed.view_mut();
            // SAFETY: scale_T(x [n], s, n) in place over the embeddings.
            unsafe {
                self.dev.launch(
                    &self.f.scale,
                    launch::elementwise(t * e),
                    &mut [ev.arg(), sc.into(), n.into()],
                )
            }?;
        }
        self.tap(tc, Stage::Embed, &[t, e], &embed)?;
        // A VLM: the image fused into the embeddings, the M-RoPE positions.
        let vstep = match st.vlm.as_mut() {
            Some(run) => Some(self.vlm_prologue(run, tokens, pos0, &mut embed, tc)?),
            None => None,
        };

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
        let mut attn_post = self.gbuf("attn_post_norm", t * e)?;
        let mut ffn_post = self.gbuf("ffn_post_norm", t * e)?;
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
            let tabs = match (&st.local_tabs, &self.ropes.local) {
                (Some(lt), Some((_, local))) if local.get(l) == Some(&true) => lt,
                _ => &st.tabs,
            };
            match (st.vlm.as_ref(), vstep.as_ref()) {
                (Some(run), Some(vs)) => {
                    self.mrope(run, vs, q_in, q_out, h)?;
                    self.mrope(run, vs, k_in, k_out, kv)?;
                }
                _ => {
                    self.rope(q_in, q_out, tabs, t, h, pos0)?;
                    self.rope(k_in, k_out, tabs, t, kv, pos0)?;
                }
            }
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
                // HF's `head_dim ** -0.5` (Gemma: query_pre_attn_scalar ** -0.5)
                // rounded to f32, as the CPU engine; a local layer's window (0: none).
                let scale = cfg.attn_scale as f32;
                let window = cfg.window_of(l).map_or(0, |w| w.min(i32::MAX as usize) as i32);
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
                args.extend([
                    hh.into(),
                    kvh.into(),
                    dd.into(),
                    p0.into(),
                    ss.into(),
                    scale.into(),
                    window.into(),
                    // Causal: the LM's attention (the vision tower's is not).
                    1i32.into(),
                ]);
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
            // Gemma: each branch is normed before its residual add.
            let attn_branch = match &b.post_norms {
                Some((an, _)) => {
                    self.rmsnorm(attn_out.view(), an, &mut attn_post.view_mut(), t)?;
                    self.tap(tc, stg(B::AttnPostNorm), &[t, e], &attn_post)?;
                    &attn_post
                }
                None => &attn_out,
            };

            let x_in: &GBuf<T> = if l == 0 { &embed } else { &out };
            self.add(x_in.view(), attn_branch.view(), &mut ffn_inp)?;
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
                let kernel = match cfg.act {
                    Activation::Silu => &self.f.silu_mul,
                    Activation::GeluTanh => &self.f.gelu_mul,
                };
                // SAFETY: silu_mul_T / gelu_mul_T(gate, up, out, n), all [T, F].
                unsafe {
                    self.dev.launch(
                        kernel,
                        launch::elementwise(t * f),
                        &mut [gv.arg(), uv.arg(), av.arg(), n.into()],
                    )
                }?;
            }
            self.tap(tc, stg(B::FfnAct), &[t, f], &act)?;
            self.linear(act.view(), t, &b.down, &mut ffn_out.view_mut())?;
            self.tap(tc, stg(B::FfnOut), &[t, e], &ffn_out)?;
            let ffn_branch = match &b.post_norms {
                Some((_, fnn)) => {
                    self.rmsnorm(ffn_out.view(), fnn, &mut ffn_post.view_mut(), t)?;
                    self.tap(tc, stg(B::FfnPostNorm), &[t, e], &ffn_post)?;
                    &ffn_post
                }
                None => &ffn_out,
            };
            self.add(ffn_inp.view(), ffn_branch.view(), &mut out)?;
            self.tap(tc, stg(B::Out), &[t, e], &out)?;
            if let Some(vs) = &vstep {
                self.deepstack(vs, l, &mut out, tc)?;
            }
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
        // Read back only when asked (`sample_probs` is tapped): the driver
        // turns it into the distribution the draw below samples from.
        let row = if want_logits {
            Some(self.dev.download(last)?.iter().map(|x| x.to_f32()).collect())
        } else {
            None
        };
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
        Ok((host[0], row))
    }
}
