//! The CUDA engine's step (`driver::Forward`): the device state of a run
//! (the KV cache of every layer, RoPE tables, the seeded sampler's state),
//! one forward pass (`forward::forward_segs`, a batch of one) and the
//! step's sampling. With nothing tapped, the only device→host copy of a step is the
//! sampled token: greedy is argmax on the device, and seeded random sampling
//! runs the host `Sampler`'s algorithm and ChaCha8 stream on the device
//! (`cuda/sampling.cu`), so a seed draws the same tokens as on the CPU engine.

use cudarc::cublas::{CudaBlas, Gemm};

use super::device::{CudaEngine, RopeTables, TapCtx};
use super::forward::{DevKv, DevSeg, Tables};
use super::launch;
use super::multimodal::VlmRun;
use super::seam::{DBuf, Dev, View};
use super::storage::Storage;
use crate::engine::driver::{Forward, StepIn, StepOut};
use crate::engine::RunRequest;
use crate::error::Result;
use crate::sampling::{chacha_key, Sampling};
use crate::tensor::DType;

/// Per-run device state: the KV cache, the RoPE tables, the sampler.
pub struct RunState<T: Storage> {
    kv: RunKv<T>,
    tabs: RopeTables,
    /// Local layers' tables (Gemma 3), when the model has its own base for them.
    local_tabs: Option<RopeTables>,
    /// Seeded random sampling (None: greedy).
    random: Option<DevSampler>,
    /// A vision-language model's image and M-RoPE state.
    vlm: Option<VlmRun>,
}

/// One run's KV cache: every layer's keys (after RoPE) and values,
/// `[capacity, KV, D]`, contiguous.
struct RunKv<T: Storage> {
    k_cache: Vec<DBuf<T>>,
    v_cache: Vec<DBuf<T>>,
    /// Elements per position (KV·D).
    kvd: usize,
}

impl<T: Storage> DevKv<T> for RunKv<T> {
    fn append(&mut self, dev: &Dev, _: usize, layer: usize, pos0: usize, k: View<'_, T>, v: View<'_, T>) -> Result<()> {
        let span = pos0 * self.kvd..pos0 * self.kvd + k.len();
        dev.copy(k, &mut self.k_cache[layer].view_mut(span.clone()))?;
        dev.copy(v, &mut self.v_cache[layer].view_mut(span))
    }
    fn read(&mut self, _: &Dev, _: usize, layer: usize, _: usize) -> Result<(View<'_, T>, View<'_, T>)> {
        Ok((self.k_cache[layer].view(..), self.v_cache[layer].view(..)))
    }
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
        let (tabs, local_tabs) = self.rope_tables(total)?;
        let mut st = RunState {
            kv: RunKv {
                k_cache: Vec::with_capacity(cfg.layers),
                v_cache: Vec::with_capacity(cfg.layers),
                kvd,
            },
            tabs,
            local_tabs,
            random,
            vlm: self.vlm_begin(req)?,
        };
        for _ in 0..cfg.layers {
            st.kv.k_cache.push(self.dev.alloc_zeros::<T>("k_cache", total * kvd)?);
            st.kv.v_cache.push(self.dev.alloc_zeros::<T>("v_cache", total * kvd)?);
        }

        Ok((st, req.sampling.clone()))
    }

    fn step(&self, st: &mut RunState<T>, s: StepIn) -> Result<StepOut> {
        let tc = TapCtx {
            taps: s.taps,
            step: s.step,
            caps: s.caps,
        };
        let (token, logits) = self.forward(st, s.tokens, s.pos0, tc, s.want_logits)?;
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
    /// cos/sin tables for positions `0..total` (and a local layers' own, Gemma 3).
    pub(super) fn rope_tables(&self, total: usize) -> Result<(RopeTables, Option<RopeTables>)> {
        self.rope_tables_of(&self.ropes, 0, total)
    }

    /// cos/sin tables of `ropes` for positions `from..to`, row 0 at `from`.
    pub(super) fn rope_tables_of(
        &self,
        ropes: &crate::engine::cpu::ops::LayerRopes,
        from: usize,
        to: usize,
    ) -> Result<(RopeTables, Option<RopeTables>)> {
        let half = self.cfg.rope_dim() / 2;
        let n = to - from;
        let tables = |rope: &crate::engine::cpu::ops::Rope| -> Result<RopeTables> {
            let (mut cos, mut sin) = (Vec::with_capacity(n * half), Vec::with_capacity(n * half));
            for p in from..to {
                let (c, s) = rope.cos_sin(p);
                cos.extend(c);
                sin.extend(s);
            }
            Ok(RopeTables {
                cos: self.dev.upload("rope_cos", &cos)?,
                sin: self.dev.upload("rope_sin", &sin)?,
            })
        };
        let global = tables(&ropes.global)?;
        let local = ropes.local.as_ref().map(|(r, _)| tables(r)).transpose()?;
        Ok((global, local))
    }

    /// One step at positions `pos0..pos0+T`; returns the sampled token, and
    /// the last row of the logits when `want_logits`.
    fn forward(
        &self,
        st: &mut RunState<T>,
        tokens: &[u32],
        pos0: usize,
        tc: TapCtx,
        want_logits: bool,
    ) -> Result<(u32, Option<Vec<f32>>)> {
        let v = self.cfg.vocab;
        let mut segs = [DevSeg { tokens, pos0, tc }];
        let tables = Tables {
            global: &st.tabs,
            local: st.local_tabs.as_ref(),
        };
        let logits = self.forward_segs(&mut segs, &mut st.kv, &tables, st.vlm.as_mut())?;
        let head_rows = logits.last[0] + 1;
        let lv = logits.buf.view();
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
