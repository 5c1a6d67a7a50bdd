//! The CPU engine's paged KV cache, kept across requests like a serving
//! engine's: a pool of fixed-size blocks (every layer's keys and values for
//! `BLOCK` positions), a block table per sequence slot, and reference counts
//! so that a prefix hit shares the full blocks of the sequence it came from
//! and copies only the partial one. Blocks go back to the pool when the
//! request ends and are handed out again without clearing (as a real engine
//! does), so stale data is there to be misread; a poisoned request fills
//! every block it is given first.

use std::borrow::Cow;

use super::forward::KvStore;
use super::mutants::{Mutant, Mutants};
use crate::engine::blocks::{prefix_split, Blocks, Table};

/// Positions per block.
pub const BLOCK: usize = 16;

/// The block pool.
#[derive(Debug, Default)]
pub struct Pool {
    layers: usize,
    /// Floats per position per layer (KV·D).
    row: usize,
    blocks: Vec<Vec<f32>>,
    book: Blocks,
}

impl Pool {
    pub fn new(layers: usize, row: usize) -> Pool {
        Pool {
            layers,
            row,
            ..Pool::default()
        }
    }

    /// Floats in one block: [layer][k|v][slot][row].
    pub fn block_len(&self) -> usize {
        self.layers * 2 * BLOCK * self.row
    }

    fn at(&self, layer: usize, value: bool, slot: usize) -> usize {
        ((layer * 2 + usize::from(value)) * BLOCK + slot) * self.row
    }

    /// A block for one holder: a free one (its stale contents kept, or
    /// overwritten with `poison`), or a new zeroed one.
    fn alloc(&mut self, poison: Option<f32>) -> usize {
        let (id, fresh) = self.book.alloc();
        if fresh {
            self.blocks.push(vec![0.0; self.block_len()]);
        }
        if let Some(p) = poison {
            self.blocks[id].fill(p);
        }
        id
    }

    /// Gives slot `t`'s blocks back and empties it.
    pub fn clear(&mut self, t: &mut Slot) {
        t.clear(&mut self.book);
    }
}

/// One sequence slot's block table.
pub type Slot = Table;

/// The serving state of a CPU engine: the pool and the slots of the
/// sequences of the request being run (slot i serves sequence i).
#[derive(Debug, Default)]
pub struct ServeState {
    pub pool: Pool,
    pub slots: Vec<Slot>,
}

/// A request's view of the serving state, as the forward pass reads and
/// writes it (`KvStore`): sequence i of the step is slot `seqs[i]`.
pub struct Paged<'a> {
    pub state: &'a mut ServeState,
    /// The slot of each sequence of the step.
    pub seqs: Vec<usize>,
    pub poison: Option<f32>,
}

impl Paged<'_> {
    fn slot(&self, seg: usize) -> &Slot {
        &self.state.slots[self.seqs[seg]]
    }
}

/// Makes slot `dst` start from the first `len` positions of slot `src`: full
/// blocks shared, the partial one copied into a block of its own (so
/// neither sequence ever writes into a block the other reads).
pub fn reuse_prefix(state: &mut ServeState, src: usize, dst: usize, len: usize, poison: Option<f32>, mx: Mutants) {
    // The planted bug: one position fewer reused than claimed.
    let covered = if mx.is(Mutant::PrefixHitOneShort) { len - 1 } else { len };
    let (full, rem) = prefix_split(covered, BLOCK);
    let layers = state.pool.layers;
    let mut table: Vec<usize> = state.slots[src].blocks[..full].to_vec();
    table.iter_mut().for_each(|id| *id = state.pool.book.share(*id));
    if rem > 0 {
        let from = state.slots[src].blocks[full];
        let id = state.pool.alloc(poison);
        let pool = &mut state.pool;
        for layer in 0..layers {
            for value in [false, true] {
                let (a, n) = (pool.at(layer, value, 0), rem * pool.row);
                let src_data = pool.blocks[from][a..a + n].to_vec();
                pool.blocks[id][a..a + n].copy_from_slice(&src_data);
            }
        }
        table.push(id);
    } else if covered < len {
        // The hit claims a position in a block it never took: take one.
        table.push(state.pool.alloc(poison));
    }
    let slot = &mut state.slots[dst];
    slot.blocks = table;
    slot.lens = vec![len; layers];
}

impl KvStore for Paged<'_> {
    fn append(&mut self, seg: usize, layer: usize, k: &[f32], v: &[f32]) {
        let (row, slot_id, poison) = (self.state.pool.row, self.seqs[seg], self.poison);
        let ServeState { pool, slots } = &mut *self.state;
        let slot = &mut slots[slot_id];
        if slot.lens.len() < pool.layers {
            slot.lens.resize(pool.layers, 0);
        }
        for (j, (kr, vr)) in k.chunks_exact(row).zip(v.chunks_exact(row)).enumerate() {
            let pos = slot.lens[layer] + j;
            while slot.blocks.len() <= pos / BLOCK {
                slot.blocks.push(pool.alloc(poison));
            }
            let id = slot.blocks[pos / BLOCK];
            let (ka, va) = (pool.at(layer, false, pos % BLOCK), pool.at(layer, true, pos % BLOCK));
            pool.blocks[id][ka..ka + row].copy_from_slice(kr);
            pool.blocks[id][va..va + row].copy_from_slice(vr);
        }
        slot.lens[layer] += k.len() / row;
    }

    fn read(&self, seg: usize, layer: usize, neighbour: Option<usize>) -> (Cow<'_, [f32]>, Cow<'_, [f32]>) {
        let pool = &self.state.pool;
        let slot = self.slot(seg);
        let n = slot.len(layer);
        let mut keys = Vec::with_capacity(n * pool.row);
        let mut values = Vec::with_capacity(n * pool.row);
        for pos in 0..n {
            let mut id = slot.blocks[pos / BLOCK];
            // The planted bug: the first block from the next sequence's table.
            if let Some(nb) = neighbour.filter(|_| pos < BLOCK) {
                if let Some(&other) = self.slot(nb).blocks.first() {
                    id = other;
                }
            }
            let (ka, va) = (pool.at(layer, false, pos % BLOCK), pool.at(layer, true, pos % BLOCK));
            keys.extend_from_slice(&pool.blocks[id][ka..ka + pool.row]);
            values.extend_from_slice(&pool.blocks[id][va..va + pool.row]);
        }
        (Cow::Owned(keys), Cow::Owned(values))
    }

    fn slot_past(&self, seg: usize, layer: usize) -> Option<Vec<f32>> {
        let pool = &self.state.pool;
        let slot = self.slot(seg);
        let pos = slot.len(layer);
        // The slot after the last position is in memory the sequence holds
        // only when its last block has room left.
        let id = *slot.blocks.get(pos / BLOCK)?;
        let a = pool.at(layer, true, pos % BLOCK);
        Some(pool.blocks[id][a..a + pool.row].to_vec())
    }

    fn swap_last_two(&mut self, seg: usize, layer: usize) {
        let n = self.slot(seg).len(layer);
        if n < 2 {
            return;
        }
        let row = self.state.pool.row;
        let blocks = self.slot(seg).blocks.clone();
        let pool = &mut self.state.pool;
        for value in [false, true] {
            let (p, q) = (n - 2, n - 1);
            let (a, b) = (pool.at(layer, value, p % BLOCK), pool.at(layer, value, q % BLOCK));
            let x = pool.blocks[blocks[p / BLOCK]][a..a + row].to_vec();
            let y = pool.blocks[blocks[q / BLOCK]][b..b + row].to_vec();
            pool.blocks[blocks[p / BLOCK]][a..a + row].copy_from_slice(&y);
            pool.blocks[blocks[q / BLOCK]][b..b + row].copy_from_slice(&x);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rows(n: usize, base: f32, row: usize) -> Vec<f32> {
        (0..n * row).map(|i| base + i as f32).collect()
    }

    #[test]
    fn appends_read_back_across_blocks_and_prefix_hits_share_full_blocks_only() {
        let row = 2;
        let mut state = ServeState {
            pool: Pool::new(1, row),
            slots: vec![Slot::default(); 2],
        };
        let k = rows(BLOCK + 3, 0.0, row);
        let v = rows(BLOCK + 3, 1000.0, row);
        {
            let mut p = Paged {
                state: &mut state,
                seqs: vec![0],
                poison: None,
            };
            p.append(0, 0, &k[..5 * row], &v[..5 * row]);
            p.append(0, 0, &k[5 * row..], &v[5 * row..]);
            let (rk, rv) = p.read(0, 0, None);
            assert_eq!((&rk[..], &rv[..]), (&k[..], &v[..]));
            assert!(
                p.slot_past(0, 0).is_some(),
                "the second block has room after position {}",
                BLOCK + 2
            );
        }
        assert_eq!(state.pool.blocks.len(), 2);
        for len in [BLOCK - 1, BLOCK, BLOCK + 1] {
            state.pool.clear(&mut state.slots[1]);
            reuse_prefix(&mut state, 0, 1, len, Some(f32::NAN), Mutants::default());
            let p = Paged {
                state: &mut state,
                seqs: vec![1],
                poison: None,
            };
            let (rk, rv) = p.read(0, 0, None);
            assert_eq!((&rk[..], &rv[..]), (&k[..len * row], &v[..len * row]), "prefix {len}");
            let shared = state.slots[1]
                .blocks
                .iter()
                .filter(|b| state.slots[0].blocks.contains(b))
                .count();
            assert_eq!(shared, len / BLOCK, "prefix {len}: only full blocks are shared");
        }
        state.pool.clear(&mut state.slots[1]);
        state.pool.clear(&mut state.slots[0]);
        assert_eq!(state.pool.book.free(), state.pool.blocks.len(), "every block is back");
    }
}
