//! The per-run key/value cache. Keys are stored after RoPE and values as
//! projected, `[S, KV, D]` per layer, appended one step at a time; this is what
//! makes a decode step see the prompt without recomputing it, and what the
//! kv_cache check (incremental decode == full prefill) exercises.

/// One layer's cache: `len` positions of `[KV, D]` keys and values.
#[derive(Clone, Debug, Default)]
pub struct LayerCache {
    k: Vec<f32>,
    v: Vec<f32>,
    /// Floats per position (KV·D).
    row: usize,
}

impl LayerCache {
    /// Appends `k` and `v` (each `[T, KV, D]`, the same T).
    pub fn append(&mut self, k: &[f32], v: &[f32]) {
        debug_assert_eq!(k.len(), v.len());
        debug_assert_eq!(k.len() % self.row, 0);
        self.k.extend_from_slice(k);
        self.v.extend_from_slice(v);
    }
    /// Swaps the last two positions' keys and values: the planted "written one
    /// slot off" bug of tests (the newest entry lands in the slot before).
    pub fn swap_last_two(&mut self) {
        let (n, r) = (self.len(), self.row);
        if n >= 2 {
            for buf in [&mut self.k, &mut self.v] {
                let (a, b) = buf[(n - 2) * r..].split_at_mut(r);
                a.swap_with_slice(b);
            }
        }
    }

    /// Keys `[S, KV, D]`.
    pub fn keys(&self) -> &[f32] {
        &self.k
    }
    /// Values `[S, KV, D]`.
    pub fn values(&self) -> &[f32] {
        &self.v
    }
    /// Positions held (S).
    pub fn len(&self) -> usize {
        self.k.len() / self.row
    }
}

/// The cache of every layer for one run.
#[derive(Clone, Debug)]
pub struct KvCache {
    pub layers: Vec<LayerCache>,
}

impl KvCache {
    /// An empty cache with room reserved for `capacity` positions, so decode
    /// steps never reallocate.
    pub fn new(n_layers: usize, kv_heads: usize, head_dim: usize, capacity: usize) -> KvCache {
        let row = kv_heads * head_dim;
        let layer = LayerCache {
            k: Vec::with_capacity(capacity * row),
            v: Vec::with_capacity(capacity * row),
            row,
        };
        KvCache {
            layers: vec![layer; n_layers],
        }
    }

    /// Positions held (the same in every layer between steps).
    pub fn len(&self) -> usize {
        self.layers.first().map_or(0, LayerCache::len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn appends_grow_every_layer_independently() {
        let mut c = KvCache::new(2, 2, 3, 4);
        assert_eq!(c.len(), 0);
        let k: Vec<f32> = (0..12).map(|i| i as f32).collect();
        c.layers[0].append(&k, &k);
        c.layers[1].append(&k, &k);
        c.layers[0].append(&k[..6], &k[6..]);
        assert_eq!(c.layers[0].len(), 3);
        assert_eq!(c.layers[1].len(), 2);
        assert_eq!(&c.layers[0].keys()[12..], &k[..6]);
        assert_eq!(&c.layers[0].values()[12..], &k[6..]);
    }
}
