//! The CUDA engine as a serving engine (`batch::BatchForward`): a paged KV
//! cache on the device, kept across requests (per layer a pool of blocks of
//! `BLOCK` positions; the bookkeeping is `engine::blocks`), and one
//! `forward_segs` per engine step over every live sequence.
//!
//! Attention reads a sequence's keys through its block table: the kernel
//! takes contiguous keys, so the blocks are gathered into a scratch buffer
//! first (device-to-device copies, one per block); what the check sees —
//! blocks handed out stale or poisoned, prefix blocks shared, the partial
//! one copied — is the paging itself.

use std::sync::MutexGuard;

use cudarc::cublas::{CudaBlas, Gemm};

use super::device::{CudaEngine, RopeTables, TapCtx};
use super::forward::{DevKv, DevSeg, Tables};
use super::paged::{ServeState, BLOCK};
use super::seam::{DBuf, Dev, View};
use super::storage::Storage;
use crate::engine::batch::{BatchForward, BatchRequest, Item, Poison, PrefixHit, Serving};
use crate::engine::blocks::{prefix_split, Table};
use crate::engine::TapSet;
use crate::error::Result;
use crate::tensor::DType;

/// One request's hold on the engine.
pub struct Session<'a, T: Storage> {
    _run: MutexGuard<'a, ()>,
    state: MutexGuard<'a, ServeState<T>>,
    /// One block's worth of the poison (per layer, k or v), when poisoned.
    poison: Option<DBuf<T>>,
    tables: (RopeTables, Option<RopeTables>),
    seqs: usize,
}

/// A step's view of the state, as the forward pass reads and writes it.
struct Paged<'a, T: Storage> {
    state: &'a mut ServeState<T>,
    /// The slot of each sequence of the step.
    seqs: Vec<usize>,
    poison: Option<&'a DBuf<T>>,
    kvd: usize,
}

impl<T: Storage> Paged<'_, T> {
    /// A block for one holder, filled with the poison when there is one.
    fn alloc(&mut self, dev: &Dev) -> Result<usize> {
        let (id, _) = self.state.book.alloc();
        assert!(id < self.state.cap, "the pool was sized for the request at open");
        if let Some(p) = self.poison {
            let n = BLOCK * self.kvd;
            for pool in self.state.k_pool.iter_mut().chain(self.state.v_pool.iter_mut()) {
                dev.copy(p.view(..), &mut pool.view_mut(id * n..(id + 1) * n))?;
            }
        }
        Ok(id)
    }
}

impl<T: Storage> DevKv<T> for Paged<'_, T> {
    fn append(
        &mut self,
        dev: &Dev,
        seg: usize,
        layer: usize,
        pos0: usize,
        k: View<'_, T>,
        v: View<'_, T>,
    ) -> Result<()> {
        let (slot, kvd, layers) = (self.seqs[seg], self.kvd, self.state.k_pool.len());
        let n = k.len() / kvd;
        let mut j = 0;
        while j < n {
            let pos = pos0 + j;
            let (blk, off) = (pos / BLOCK, pos % BLOCK);
            let run = (BLOCK - off).min(n - j);
            while self.state.slots[slot].blocks.len() <= blk {
                let id = self.alloc(dev)?;
                self.state.slots[slot].blocks.push(id);
            }
            let at = (self.state.slots[slot].blocks[blk] * BLOCK + off) * kvd;
            let (src, dst) = (j * kvd..(j + run) * kvd, at..at + run * kvd);
            dev.copy(
                k.slice(src.clone()),
                &mut self.state.k_pool[layer].view_mut(dst.clone()),
            )?;
            dev.copy(v.slice(src), &mut self.state.v_pool[layer].view_mut(dst))?;
            j += run;
        }
        let t = &mut self.state.slots[slot];
        t.lens.resize(layers, 0);
        t.lens[layer] = pos0 + n;
        Ok(())
    }

    fn read(&mut self, dev: &Dev, seg: usize, layer: usize, s: usize) -> Result<(View<'_, T>, View<'_, T>)> {
        let kvd = self.kvd;
        let room = self.state.scratch.as_ref().map_or(0, |x| x.2);
        if room < s {
            let n = s.next_multiple_of(BLOCK);
            self.state.scratch = Some((
                dev.alloc_zeros::<T>("kv_gather_k", n * kvd)?,
                dev.alloc_zeros::<T>("kv_gather_v", n * kvd)?,
                n,
            ));
        }
        let ServeState {
            k_pool,
            v_pool,
            slots,
            scratch,
            ..
        } = &mut *self.state;
        let (sk, sv, _) = scratch.as_mut().expect("sized above");
        let table = &slots[self.seqs[seg]];
        for (b, &id) in table.blocks.iter().enumerate().take(s.div_ceil(BLOCK)) {
            let rows = BLOCK.min(s - b * BLOCK);
            let (src, dst) = (
                id * BLOCK * kvd..(id * BLOCK + rows) * kvd,
                b * BLOCK * kvd..(b * BLOCK + rows) * kvd,
            );
            dev.copy(k_pool[layer].view(src.clone()), &mut sk.view_mut(dst.clone()))?;
            dev.copy(v_pool[layer].view(src), &mut sv.view_mut(dst))?;
        }
        Ok((sk.view(..s * kvd), sv.view(..s * kvd)))
    }
}

impl<T: Storage> CudaEngine<T>
where
    CudaBlas: Gemm<T>,
{
    /// What it declares: paged, poisonable; bitwise batch-invariant on the
    /// emulated device (its GEMM computes each row alone), not on a GPU
    /// (cuBLAS picks its algorithm by shape).
    pub(super) fn serving_caps(&self) -> Option<Serving> {
        let serving = Serving {
            block_size: Some(BLOCK),
            invariant: matches!(self.dev, Dev::Emu(_)),
            poison: true,
            max_batch: 64,
        };
        self.cfg.vision.is_none().then_some(serving)
    }

    /// The poison as this storage holds it: "huge" is the largest finite
    /// value of the type (1e30 overflows f16).
    fn poison_value(p: Poison) -> T {
        match (p, T::DTYPE) {
            (Poison::Huge, DType::F16) => T::from_f32(65504.0),
            _ => T::from_f32(p.value()),
        }
    }
}

impl<T: Storage> BatchForward for CudaEngine<T>
where
    CudaBlas: Gemm<T>,
{
    type Session<'a> = Session<'a, T>;

    fn open(&self, req: &BatchRequest) -> Result<Session<'_, T>> {
        let run = self.run_lock.lock().unwrap_or_else(|p| p.into_inner());
        let mut state = self.serve.lock().unwrap_or_else(|p| p.into_inner());
        let cfg = &self.cfg;
        let kvd = cfg.kv_heads * cfg.head_dim;
        let total = |s: &crate::engine::batch::SeqRequest| s.run.prompt.len() + s.run.decode_steps;
        // Every block the request can hold at once (one more per sequence
        // for a prefix hit's partial copy), past every id already made.
        let needed: usize = req.seqs.iter().map(|s| total(s).div_ceil(BLOCK) + 1).sum();
        let want = state.book.count() + needed;
        if state.cap < want {
            let cap = want.next_power_of_two();
            for l in 0..cfg.layers {
                let (mut k, mut v) = (
                    self.dev.alloc_zeros::<T>("kv_pool_k", cap * BLOCK * kvd)?,
                    self.dev.alloc_zeros::<T>("kv_pool_v", cap * BLOCK * kvd)?,
                );
                if let (Some(ok), Some(ov)) = (state.k_pool.get(l), state.v_pool.get(l)) {
                    let old = state.cap * BLOCK * kvd;
                    self.dev.copy(ok.view(..), &mut k.view_mut(..old))?;
                    self.dev.copy(ov.view(..), &mut v.view_mut(..old))?;
                }
                if l < state.k_pool.len() {
                    (state.k_pool[l], state.v_pool[l]) = (k, v);
                } else {
                    state.k_pool.push(k);
                    state.v_pool.push(v);
                }
            }
            state.cap = cap;
        }
        let n = req.seqs.len();
        if state.slots.len() < n {
            state.slots.resize(n, Table::default());
        }
        let poison = match req.poison {
            Some(p) => Some(
                self.dev
                    .upload("kv_poison", &vec![Self::poison_value(p); BLOCK * kvd])?,
            ),
            None => None,
        };
        let longest = req.seqs.iter().map(total).max().unwrap_or(1);
        Ok(Session {
            _run: run,
            state,
            poison,
            tables: self.rope_tables(longest)?,
            seqs: n,
        })
    }

    fn start(&self, s: &mut Session<'_, T>, seq: usize, prefix: Option<PrefixHit>) -> Result<()> {
        let kvd = self.cfg.kv_heads * self.cfg.head_dim;
        let ServeState { book, slots, .. } = &mut *s.state;
        slots[seq].clear(book);
        let Some(p) = prefix else { return Ok(()) };
        let (full, rem) = prefix_split(p.len, BLOCK);
        let mut table: Vec<usize> = s.state.slots[p.from].blocks[..full].to_vec();
        table.iter_mut().for_each(|id| *id = s.state.book.share(*id));
        let mut paged = Paged {
            state: &mut s.state,
            seqs: vec![seq],
            poison: s.poison.as_ref(),
            kvd,
        };
        if rem > 0 {
            let from = paged.state.slots[p.from].blocks[full];
            let id = paged.alloc(&self.dev)?;
            let n = rem * kvd;
            for pool in paged.state.k_pool.iter_mut().chain(paged.state.v_pool.iter_mut()) {
                // Within one pool: through the host (a partial block, once per hit).
                let rows = self
                    .dev
                    .download(pool.view(from * BLOCK * kvd..from * BLOCK * kvd + n))?;
                let tmp = self.dev.upload("kv_prefix_copy", &rows)?;
                self.dev
                    .copy(tmp.view(..), &mut pool.view_mut(id * BLOCK * kvd..id * BLOCK * kvd + n))?;
            }
            table.push(id);
        }
        let layers = self.cfg.layers;
        let t = &mut s.state.slots[seq];
        t.blocks = table;
        t.lens = vec![p.len; layers];
        Ok(())
    }

    fn batch_step(&self, s: &mut Session<'_, T>, items: &mut [Item], taps: &TapSet) -> Result<Vec<Vec<f32>>> {
        let v = self.cfg.vocab;
        let slots: Vec<usize> = items.iter().map(|i| i.seq).collect();
        let mut segs: Vec<DevSeg> = items
            .iter_mut()
            .map(|it| DevSeg {
                tokens: &it.tokens,
                pos0: it.pos0,
                tc: TapCtx {
                    taps,
                    step: it.step,
                    caps: &mut it.caps,
                },
            })
            .collect();
        let tables = Tables {
            global: &s.tables.0,
            local: s.tables.1.as_ref(),
        };
        let mut kv = Paged {
            state: &mut s.state,
            seqs: slots,
            poison: s.poison.as_ref(),
            kvd: self.cfg.kv_heads * self.cfg.head_dim,
        };
        let logits = self.forward_segs(&mut segs, &mut kv, &tables, None)?;
        logits
            .last
            .iter()
            .map(|&r| {
                let row = self.dev.download(logits.buf.view().slice(r * v..(r + 1) * v))?;
                Ok(row.iter().map(|x| x.to_f32()).collect())
            })
            .collect()
    }

    fn close(&self, mut s: Session<'_, T>) -> Result<()> {
        let ServeState { book, slots, .. } = &mut *s.state;
        for t in slots.iter_mut().take(s.seqs) {
            t.clear(book);
        }
        self.dev.synchronize()
    }
}
