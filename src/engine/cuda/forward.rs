//! The CUDA engine's forward pass over a batch of sequences, in the canonical
//! stage order, every stage writing its own guarded device buffer, taps
//! copying a stage back only when it is requested. A plain run (`step`) is a
//! batch of one; a serving request (`serve`) steps several sequences of
//! different lengths together: every row-wise kernel and projection runs once
//! over the rows of all of them, RoPE and attention per sequence over its own
//! positions and keys (`DevKv`: one run's contiguous cache, or the paged
//! pool). The emulated device's GEMM computes each row alone (`seam::gemm`),
//! so there a sequence gets the same bits in any batch; cuBLAS chooses its
//! algorithm by shape, so on a GPU it need not.

use cudarc::cublas::{CudaBlas, Gemm};

use super::device::{CudaEngine, GBuf, RopeTables, TapCtx};
use super::launch::{self, Launch};
use super::block_weights::DevQkv;
use super::block_weights::DevFfn;
use super::multimodal::VlmRun;
use super::seam::{Dev, KArg, View};
use super::storage::Storage;
use crate::error::Result;
use crate::stage::{BlockStage as B, Stage};
use crate::tensor::Tensor;

/// Where a device forward pass keeps keys (after RoPE) and values, per
/// (sequence of the batch, layer).
pub(super) trait DevKv<T: Storage> {
    /// Appends sequence `seg`'s step rows (`[T, KV, D]`) at positions `pos0..`.
    fn append(
        &mut self,
        dev: &Dev,
        seg: usize,
        layer: usize,
        pos0: usize,
        k: View<'_, T>,
        v: View<'_, T>,
    ) -> Result<()>;
    /// Keys and values holding `seg`'s first `s` positions contiguously
    /// (`[≥ s, KV, D]`), for the attention kernel.
    fn read(&mut self, dev: &Dev, seg: usize, layer: usize, s: usize) -> Result<(View<'_, T>, View<'_, T>)>;
}

/// One sequence's share of a forward pass.
pub(super) struct DevSeg<'a, 'c> {
    pub(super) tokens: &'a [u32],
    pub(super) pos0: usize,
    pub(super) tc: TapCtx<'c>,
}

/// The RoPE tables of a pass (a local layer's own, for Gemma 3).
pub(super) struct Tables<'a> {
    pub(super) global: &'a RopeTables,
    pub(super) local: Option<&'a RopeTables>,
}

/// The logits a pass leaves: `[rows, V]`, and each sequence's last row in it.
pub(super) struct Logits<T: Storage> {
    pub(super) buf: GBuf<T>,
    pub(super) last: Vec<usize>,
}

impl<T: Storage> CudaEngine<T>
where
    CudaBlas: Gemm<T>,
{
    /// Captures each sequence's rows of `buf` (`[rows, dims…]`) if `stage`
    /// is tapped: one copy back, the guards checked, split by sequence.
    pub(super) fn tap_rows<S: Storage>(&self, segs: &mut [DevSeg], stage: Stage, dims: &[usize], buf: &GBuf<S>) -> Result<()> {
        if segs.len() == 1 {
            let t = segs[0].tokens.len();
            let shape: Vec<usize> = std::iter::once(t).chain(dims.iter().copied()).collect();
            return self.tap(&mut segs[0].tc, stage, &shape, buf);
        }
        if !segs[0].tc.taps.contains(stage) {
            return Ok(());
        }
        let full = self.dev.download(buf.buf.view(..))?;
        buf.g
            .check(&full)
            .map_err(|v| self.dev.err(format!("{}/{stage}: {v}", segs[0].tc.step)))?;
        let values: Vec<f32> = full[buf.g.interior()].iter().map(|x| x.to_f32()).collect();
        let width: usize = dims.iter().product();
        let mut r0 = 0;
        for seg in segs.iter_mut() {
            let n = seg.tokens.len();
            let shape: Vec<usize> = std::iter::once(n).chain(dims.iter().copied()).collect();
            let data = values[r0 * width..(r0 + n) * width].to_vec();
            let tc = &mut seg.tc;
            tc.caps
                .insert(tc.step, stage, Tensor::new(shape, data).with_dtype(T::DTYPE));
            r0 += n;
        }
        Ok(())
    }

    /// Copies row `r` of each range end (`rows[i].end − 1`) of `x` (`[rows, E]`)
    /// into a new buffer, in order.
    fn last_rows(&self, x: &GBuf<T>, ends: &[usize]) -> Result<GBuf<T>> {
        let e = self.cfg.hidden;
        let mut out = self.gbuf("last_rows", ends.len() * e)?;
        for (i, &end) in ends.iter().enumerate() {
            let src = x.view().slice((end - 1) * e..end * e);
            self.dev.copy(
                src,
                &mut out
                    .buf
                    .view_mut(out.g.interior().start + i * e..out.g.interior().start + (i + 1) * e),
            )?;
        }
        Ok(out)
    }

    /// One forward pass over `segs` (each at positions `pos0..pos0+T`),
    /// appending their keys and values to `kv`. `vlm`: a VLM's step (a batch
    /// of one).
    pub(super) fn forward_segs(
        &self,
        segs: &mut [DevSeg],
        kv: &mut dyn DevKv<T>,
        tables: &Tables,
        mut vlm: Option<&mut VlmRun>,
    ) -> Result<Logits<T>> {
        let cfg = &self.cfg;
        let ends: Vec<usize> = segs
            .iter()
            .scan(0, |r, s| {
                *r += s.tokens.len();
                Some(*r)
            })
            .collect();
        let t = *ends.last().expect("at least one sequence");
        let (e, v) = (cfg.hidden, cfg.vocab);
        let (h, kvh, d, f) = (cfg.heads, cfg.kv_heads, cfg.head_dim, cfg.ffn);
        let (qd, kvd) = (h * d, kvh * d);
        let dv = cfg.v_head_dim();
        let w = &self.w;
        let taps = segs[0].tc.taps;

        let all_tokens: Vec<u32> = segs.iter().flat_map(|s| s.tokens.iter().copied()).collect();
        let tok_dev = self.dev.upload("tokens", &all_tokens)?;
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
        self.tap_rows(segs, Stage::Embed, &[e], &embed)?;
        // A VLM: the image fused into the embeddings, the M-RoPE positions.
        let vstep = match vlm.as_deref_mut() {
            Some(run) => {
                let (tokens, pos0) = (segs[0].tokens, segs[0].pos0);
                Some(self.vlm_prologue(run, tokens, pos0, &mut embed, &mut segs[0].tc)?)
            }
            None => None,
        };

        // A sequence whose pass reaches past a length-dependent scaling's
        // boundary (dynamic NTK, LongRoPE) rotates with its pass's own
        // tables, uploaded for its rows only (first row = its pos0).
        let own_tables: Vec<Option<(RopeTables, Option<RopeTables>)>> = segs
            .iter()
            .map(|s| {
                let n = s.tokens.len();
                self.ropes
                    .for_pass(s.pos0 + n)
                    .map(|r| self.rope_tables_of(&r, s.pos0, s.pos0 + n))
                    .transpose()
            })
            .collect::<Result<_>>()?;

        let mut attn_norm = self.gbuf("attn_norm", t * e)?;
        let mut q = self.gbuf("q", t * qd)?;
        let mut k = self.gbuf("k", t * kvd)?;
        let mut vv = self.gbuf("v", t * kvd)?;
        let mut q_rope = self.gbuf("q_rope", t * qd)?;
        let mut k_rope = self.gbuf("k_rope", t * kvd)?;
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

        for (l, b) in w.blocks.iter().enumerate() {
            let stg = |x: B| Stage::Block(l, x);
            // The block input: the embeddings, then the previous block's output
            // (read here and by the residual add below, before `out` is rewritten).
            let x_in: &GBuf<T> = if l == 0 { &embed } else { &out };
            self.rmsnorm(x_in.view(), &b.attn_norm, &mut attn_norm.view_mut(), t)?;
            self.tap_rows(segs, stg(B::AttnNorm), &[e], &attn_norm)?;

            // Latent attention taps its narrower values and caches them padded.
            let latent = match &b.qkv {
                DevQkv::Split { q: wq, k: wk, v: wv } => {
                    self.linear(attn_norm.view(), t, wq, &mut q.view_mut())?;
                    self.linear(attn_norm.view(), t, wk, &mut k.view_mut())?;
                    self.linear(attn_norm.view(), t, wv, &mut vv.view_mut())?;
                    None
                }
                DevQkv::Latent(m) => Some(self.latent_qkv(m, attn_norm.view(), t, &mut q, &mut k)?),
            };
            self.tap_rows(segs, stg(B::Q), &[h, d], &q)?;
            self.tap_rows(segs, stg(B::K), &[kvh, d], &k)?;
            match &latent {
                Some(lv) => self.tap_rows(segs, stg(B::V), &[kvh, dv], &lv.v)?,
                None => self.tap_rows(segs, stg(B::V), &[kvh, d], &vv)?,
            }
            let v_cache: &GBuf<T> = latent.as_ref().map_or(&vv, |lv| &lv.v_pad);
            // Qwen3: per-head RMSNorm before RoPE, into the RoPE output
            // buffers (free until RoPE), then RoPE from there back into q/k.
            let (q_in, k_in, q_out, k_out) = match &b.qk_norm {
                Some((qn, kn)) => {
                    self.rmsnorm_rows(q.view(), qn, &mut q_rope.view_mut(), t * h, d)?;
                    self.rmsnorm_rows(k.view(), kn, &mut k_rope.view_mut(), t * kvh, d)?;
                    self.tap_rows(segs, stg(B::QNorm), &[h, d], &q_rope)?;
                    self.tap_rows(segs, stg(B::KNorm), &[kvh, d], &k_rope)?;
                    (&q_rope, &k_rope, &mut q, &mut k)
                }
                None => (&q, &k, &mut q_rope, &mut k_rope),
            };
            let is_local = matches!(&self.ropes.local, Some((_, local)) if local.get(l) == Some(&true));
            let tabs = match tables.local {
                Some(lt) if is_local => lt,
                _ => tables.global,
            };
            match (vlm.as_deref(), vstep.as_ref()) {
                (Some(run), Some(vs)) if vs.pos.is_some() => {
                    self.mrope(run, vs, q_in, q_out, h)?;
                    self.mrope(run, vs, k_in, k_out, kvh)?;
                }
                _ => {
                    // Each sequence rotates at its own positions.
                    let mut r0 = 0;
                    for (seg, own) in segs.iter().zip(&own_tables) {
                        let n = seg.tokens.len();
                        let (tabs, p0) = match own {
                            Some((_, Some(lt))) if is_local => (lt, 0),
                            Some((g, _)) if !is_local || tables.local.is_none() => (g, 0),
                            _ => (tabs, seg.pos0),
                        };
                        self.rope_rows(q_in, q_out, tabs, r0, n, h, p0)?;
                        self.rope_rows(k_in, k_out, tabs, r0, n, kvh, p0)?;
                        r0 += n;
                    }
                }
            }
            let (q_rope, k_rope) = (&*q_out, &*k_out);
            self.tap_rows(segs, stg(B::QRope), &[h, d], q_rope)?;
            self.tap_rows(segs, stg(B::KRope), &[kvh, d], k_rope)?;

            let want_probs = taps.contains(stg(B::AttnProbs));
            let want_scores = taps.contains(stg(B::AttnScores));
            let mut r0 = 0;
            for (i, seg) in segs.iter_mut().enumerate() {
                let (n, pos0) = (seg.tokens.len(), seg.pos0);
                let s = pos0 + n;
                // Append this step's keys (after RoPE) and values to the cache.
                let (kr, vr) = (r0 * kvd..(r0 + n) * kvd, r0 * kvd..(r0 + n) * kvd);
                kv.append(&self.dev, i, l, pos0, k_rope.view().slice(kr), v_cache.view().slice(vr))?;
                // Scores and probabilities stay f32 whatever the storage (the kernel writes f32).
                let mut probs = want_probs
                    .then(|| self.gbuf::<f32>("attn_probs", h * n * s))
                    .transpose()?;
                let mut scores = want_scores
                    .then(|| self.gbuf::<f32>("attn_scores", h * n * s))
                    .transpose()?;
                {
                    let (rows, hh, kh, dd, p0, ss) = (n as i32, h as i32, kvh as i32, d as i32, pos0 as i32, s as i32);
                    // HF's `head_dim ** -0.5` (Gemma: query_pre_attn_scalar ** -0.5)
                    // rounded to f32, as the CPU engine; a local layer's window (0: none).
                    let scale = cfg.attn_scale as f32;
                    let window = cfg.window_of(l).map_or(0, |w| w.min(i32::MAX as usize) as i32);
                    let qv = q_rope.view().slice(r0 * qd..(r0 + n) * qd);
                    let (ci, cs) = (ctx.g.interior().start, r0 * qd);
                    let mut cv = ctx.buf.view_mut(ci + cs..ci + cs + n * qd);
                    let mut pv = probs.as_mut().map(|p| p.view_mut());
                    let mut sv = scores.as_mut().map(|p| p.view_mut());
                    let decode = n == 1;
                    let func = if decode {
                        &self.f.attention_decode
                    } else {
                        &self.f.attention_prefill
                    };
                    let (kc, vc) = kv.read(&self.dev, i, l, s)?;
                    let mut args = vec![qv.arg(), kc.arg(), vc.arg()];
                    args.push(sv.as_mut().map_or(KArg::Null, |p| p.arg()));
                    args.push(pv.as_mut().map_or(KArg::Null, |p| p.arg()));
                    args.push(cv.arg());
                    if !decode {
                        args.push(rows.into());
                    }
                    args.extend([
                        hh.into(),
                        kh.into(),
                        dd.into(),
                        p0.into(),
                        ss.into(),
                        scale.into(),
                        window.into(),
                        // Causal: the LM's attention (the vision tower's is not).
                        1i32.into(),
                    ]);
                    let sinks = b.sinks.as_ref().map(|s| s.view(..));
                    args.push(sinks.as_ref().map_or(KArg::Null, |s| s.arg()));
                    let attn_launch = launch::attention(n, h, d, s).map_err(|m| self.dev.err(m))?;
                    let lc = if decode {
                        Launch {
                            grid: (h as u32, 1, 1),
                            ..attn_launch
                        }
                    } else {
                        attn_launch
                    };
                    // SAFETY: q [T, H, D], caches [≥ S, KV, D], scores and probs [H, T, S] or NULL,
                    // ctx [T, H*D]; smem (D + S) floats as `launch::attention` computed.
                    unsafe { self.dev.launch(func, lc, &mut args) }?;
                }
                if let Some(p) = &scores {
                    self.tap(&mut seg.tc, stg(B::AttnScores), &[h, n, s], p)?;
                }
                if let Some(p) = &probs {
                    self.tap(&mut seg.tc, stg(B::AttnProbs), &[h, n, s], p)?;
                }
                r0 += n;
            }
            let ctx_v = match cfg.mla {
                Some(_) => {
                    let mut c = self.gbuf::<T>("ctx_v", t * h * dv)?;
                    self.copy_columns(ctx.view(), &mut c, t * h, d, 0, dv)?;
                    Some(c)
                }
                None => None,
            };
            let ctx_in = ctx_v.as_ref().unwrap_or(&ctx);
            self.tap_rows(segs, stg(B::AttnCtx), &[h * dv], ctx_in)?;
            self.linear(ctx_in.view(), t, &b.o, &mut attn_out.view_mut())?;
            self.tap_rows(segs, stg(B::AttnOut), &[e], &attn_out)?;
            // Gemma: each branch is normed before its residual add.
            let attn_branch = match &b.post_norms {
                Some((an, _)) => {
                    self.rmsnorm(attn_out.view(), an, &mut attn_post.view_mut(), t)?;
                    self.tap_rows(segs, stg(B::AttnPostNorm), &[e], &attn_post)?;
                    &attn_post
                }
                None => &attn_out,
            };

            let x_in: &GBuf<T> = if l == 0 { &embed } else { &out };
            self.add(x_in.view(), attn_branch.view(), &mut ffn_inp)?;
            self.tap_rows(segs, stg(B::FfnInp), &[e], &ffn_inp)?;
            self.rmsnorm(ffn_inp.view(), &b.ffn_norm, &mut ffn_norm.view_mut(), t)?;
            self.tap_rows(segs, stg(B::FfnNorm), &[e], &ffn_norm)?;
            match &b.ffn {
                DevFfn::Dense(m) => {
                    self.linear(ffn_norm.view(), t, &m.gate, &mut gate.view_mut())?;
                    self.tap_rows(segs, stg(B::FfnGate), &[f], &gate)?;
                    self.linear(ffn_norm.view(), t, &m.up, &mut up.view_mut())?;
                    self.tap_rows(segs, stg(B::FfnUp), &[f], &up)?;
                    self.act_mul(self.cfg.act, gate.view(), up.view(), &mut act)?;
                    self.tap_rows(segs, stg(B::FfnAct), &[f], &act)?;
                    self.linear(act.view(), t, &m.down, &mut ffn_out.view_mut())?;
                }
                DevFfn::Moe(m) => self.moe_ffn(segs, l, m, &ffn_norm, &mut ffn_out, t)?,
            }
            self.tap_rows(segs, stg(B::FfnOut), &[e], &ffn_out)?;
            let ffn_branch = match &b.post_norms {
                Some((_, fnn)) => {
                    self.rmsnorm(ffn_out.view(), fnn, &mut ffn_post.view_mut(), t)?;
                    self.tap_rows(segs, stg(B::FfnPostNorm), &[e], &ffn_post)?;
                    &ffn_post
                }
                None => &ffn_out,
            };
            self.add(ffn_inp.view(), ffn_branch.view(), &mut out)?;
            self.tap_rows(segs, stg(B::Out), &[e], &out)?;
            if let Some(vs) = &vstep {
                self.deepstack(vs, l, &mut out, &mut segs[0].tc)?;
            }
        }

        // As the CPU engine: only each sequence's last row is normed and
        // projected unless output_norm or logits is tapped.
        let x_fin: &GBuf<T> = if w.blocks.is_empty() { &embed } else { &out };
        let all_rows = taps.contains(Stage::OutputNorm) || taps.contains(Stage::Logits);
        let (onorm, nrows) = if all_rows {
            let mut onorm = self.gbuf("output_norm", t * e)?;
            self.rmsnorm(x_fin.view(), &w.norm, &mut onorm.view_mut(), t)?;
            self.tap_rows(segs, Stage::OutputNorm, &[e], &onorm)?;
            (onorm, t)
        } else {
            let last = self.last_rows(x_fin, &ends)?;
            let mut onorm = self.gbuf("output_norm", ends.len() * e)?;
            self.rmsnorm(last.view(), &w.norm, &mut onorm.view_mut(), ends.len())?;
            (onorm, ends.len())
        };
        let every_row = taps.contains(Stage::Logits);
        let head_in = if every_row || nrows == ends.len() {
            onorm
        } else {
            self.last_rows(&onorm, &ends)?
        };
        let head_rows = head_in.g.len / e;
        let mut logits = self.gbuf("logits", head_rows * v)?;
        {
            let mut lv = logits.view_mut();
            match &w.lm_head {
                Some(lin) => self.linear(head_in.view(), head_rows, lin, &mut lv)?,
                // Tied head: the embedding matrix [V, E] is the weight.
                None => self.gemm_bias(head_in.view(), head_rows, &w.embed, None, e, v, &mut lv)?,
            }
        }
        self.tap_rows(segs, Stage::Logits, &[v], &logits)?;
        let last = if head_rows == t {
            ends.iter().map(|&r| r - 1).collect()
        } else {
            (0..ends.len()).collect()
        };
        Ok(Logits { buf: logits, last })
    }
}
