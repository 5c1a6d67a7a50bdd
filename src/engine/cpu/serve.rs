//! The CPU engine as a serving engine (`batch::BatchForward`): a batched
//! forward pass over the paged KV cache that lives across requests
//! (`paged`). Every sequence of a step goes through one `forward_batch`:
//! row-wise work once over all rows, attention per sequence over its own
//! blocks.

use std::sync::MutexGuard;

use super::forward::{forward_batch, Seg, Tap};
use super::mutants::Mutant;
use super::paged::{reuse_prefix, Paged, ServeState, BLOCK};
use super::CpuEngine;
use crate::engine::batch::{BatchForward, BatchRequest, Item, PrefixHit, Serving};
use crate::engine::TapSet;
use crate::error::Result;

/// One request's hold on the serving state (requests are served one at a
/// time, as by one engine process).
pub struct Session<'a> {
    state: MutexGuard<'a, ServeState>,
    poison: Option<f32>,
    seqs: usize,
}

impl CpuEngine {
    /// What it declares: paged, bitwise batch-invariant, a poison hook.
    pub(crate) fn serving_caps() -> Serving {
        Serving {
            block_size: Some(BLOCK),
            invariant: true,
            poison: true,
            max_batch: 64,
        }
    }
}

impl BatchForward for CpuEngine {
    type Session<'a> = Session<'a>;

    fn open(&self, req: &BatchRequest) -> Result<Session<'_>> {
        let mut state = self.serve.lock().unwrap_or_else(|p| p.into_inner());
        let n = req.seqs.len();
        if state.slots.len() < n {
            state.slots.resize(n, Default::default());
        }
        // Each request starts from empty slots (they were cleared when the
        // last one closed; the planted bug keeps slot 0's).
        Ok(Session {
            state,
            poison: req.poison.map(|p| p.value()),
            seqs: n,
        })
    }

    fn start(&self, s: &mut Session<'_>, seq: usize, prefix: Option<PrefixHit>) -> Result<()> {
        if let Some(p) = prefix {
            let ServeState { pool, slots } = &mut *s.state;
            pool.clear(&mut slots[seq]);
            reuse_prefix(&mut s.state, p.from, seq, p.len, s.poison, self.mutants);
        }
        Ok(())
    }

    fn batch_step(&self, s: &mut Session<'_>, items: &mut [Item], taps: &TapSet) -> Result<Vec<Vec<f32>>> {
        let slots: Vec<usize> = items.iter().map(|i| i.seq).collect();
        let mut segs: Vec<Seg> = items
            .iter_mut()
            .map(|it| Seg {
                tokens: &it.tokens,
                pos0: it.pos0,
                tap: Tap {
                    taps,
                    step: it.step,
                    caps: &mut it.caps,
                    dtype: self.storage,
                    mutants: self.mutants,
                },
            })
            .collect();
        let mut store = Paged {
            state: &mut s.state,
            seqs: slots,
            poison: s.poison,
        };
        Ok(forward_batch(
            &self.cfg,
            &self.weights,
            &self.ropes,
            &mut segs,
            &mut store,
            None,
        ))
    }

    fn close(&self, mut s: Session<'_>) -> Result<()> {
        let ServeState { pool, slots } = &mut *s.state;
        for (i, slot) in slots.iter_mut().enumerate().take(s.seqs) {
            if i == 0 && self.mutants.is(Mutant::CacheNotCleared) {
                continue;
            }
            pool.clear(slot);
        }
        if self.mutants.is(Mutant::BufferLeakedPerRequest) {
            std::mem::forget(vec![0.0f32; pool.block_len()]);
        }
        Ok(())
    }
}
