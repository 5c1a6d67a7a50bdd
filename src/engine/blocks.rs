//! The bookkeeping of a paged KV cache, shared by the CPU and CUDA engines'
//! serving state (each keeps its own storage): which blocks are free, how
//! many holders each has (a prefix hit shares the full blocks of the
//! sequence it came from), and each sequence slot's block table and
//! per-layer lengths. Blocks freed go back to the free list and are handed
//! out again without clearing, as a real engine does.

/// Holders of each block, and the free ones.
#[derive(Debug, Default)]
pub struct Blocks {
    refs: Vec<u32>,
    free: Vec<usize>,
}

impl Blocks {
    /// A block for one holder: a free one, or a new id (`(id, true)`; the
    /// caller makes its storage).
    pub fn alloc(&mut self) -> (usize, bool) {
        match self.free.pop() {
            Some(id) => {
                self.refs[id] = 1;
                (id, false)
            }
            None => {
                self.refs.push(1);
                (self.refs.len() - 1, true)
            }
        }
    }
    /// One more holder of `id`.
    pub fn share(&mut self, id: usize) -> usize {
        self.refs[id] += 1;
        id
    }
    pub fn release(&mut self, id: usize) {
        self.refs[id] -= 1;
        if self.refs[id] == 0 {
            self.free.push(id);
        }
    }
    /// Blocks ever made.
    pub fn count(&self) -> usize {
        self.refs.len()
    }
    /// Blocks free now.
    pub fn free(&self) -> usize {
        self.free.len()
    }
}

/// One sequence slot: its block table and how many positions each layer
/// holds (layers fill one after another within a step).
#[derive(Clone, Debug, Default)]
pub struct Table {
    pub blocks: Vec<usize>,
    pub lens: Vec<usize>,
}

impl Table {
    /// Gives its blocks back and empties it.
    pub fn clear(&mut self, b: &mut Blocks) {
        for id in self.blocks.drain(..) {
            b.release(id);
        }
        self.lens.clear();
    }
    pub fn len(&self, layer: usize) -> usize {
        self.lens.get(layer).copied().unwrap_or(0)
    }
    pub fn is_empty(&self) -> bool {
        self.lens.iter().all(|&n| n == 0)
    }
}

/// How a prefix hit of `covered` positions is served with blocks of
/// `block` positions: the full blocks shared, then the positions of the
/// partial one copied into a block of its own (so neither sequence ever
/// writes into a block the other reads).
pub fn prefix_split(covered: usize, block: usize) -> (usize, usize) {
    (covered / block, covered % block)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_come_back_when_their_last_holder_lets_go() {
        let mut b = Blocks::default();
        let (x, fresh) = b.alloc();
        assert!(fresh);
        b.share(x);
        let mut t = Table {
            blocks: vec![x],
            lens: vec![3],
        };
        t.clear(&mut b);
        assert_eq!(b.free(), 0, "still held by the sharer");
        b.release(x);
        assert_eq!((b.free(), b.alloc()), (1, (x, false)));
        assert_eq!(prefix_split(17, 16), (1, 1));
    }
}
