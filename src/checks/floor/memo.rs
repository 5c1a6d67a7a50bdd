//! What one run's floors share, computed once: the oracle-only terms of a
//! matmul stage (each element's Σ|W·x| and 8-bit quantisation effect, read
//! off the model file's weight and the oracle's input; the LM head's alone is
//! a 136M-product pass on a 0.5B model) and each source's floor at a stage,
//! which the engine's golden checks against every reference, the
//! references' own checks and the row judge all ask for. Held by the runner
//! for one run (an engine's captures are that run's), lent through `Facts`.

use std::collections::HashMap;
use std::hash::Hash;
use std::sync::{Arc, Mutex, OnceLock};

use super::matmul::MatmulTerms;
use super::Floor;
use crate::stage::{Stage, Step};

type Cell<V> = Arc<OnceLock<V>>;

#[derive(Debug, Default)]
pub struct FloorMemo {
    /// (step, stage, q8 block or 0) → the oracle-only terms (None: no weight).
    matmul: Mutex<HashMap<(Step, Stage, usize), Cell<Option<Arc<MatmulTerms>>>>>,
    /// (source, step, stage, arithmetic) → its floor.
    floors: Mutex<HashMap<(String, Step, Stage, String), Cell<Floor>>>,
}

/// The value under `k`, computed by `f` by the first thread to ask (the
/// others wait for it rather than compute it again).
fn get_or<K: Eq + Hash, V: Clone>(map: &Mutex<HashMap<K, Cell<V>>>, k: K, f: impl FnOnce() -> V) -> V {
    // A panic while the lock is held leaves the map consistent (one insert).
    let cell = map
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .entry(k)
        .or_default()
        .clone();
    cell.get_or_init(f).clone()
}

impl FloorMemo {
    pub(super) fn matmul(
        &self,
        key: (Step, Stage, usize),
        f: impl FnOnce() -> Option<Arc<MatmulTerms>>,
    ) -> Option<Arc<MatmulTerms>> {
        get_or(&self.matmul, key, f)
    }

    pub(crate) fn floor(&self, key: (String, Step, Stage, String), f: impl FnOnce() -> Floor) -> Floor {
        get_or(&self.floors, key, f)
    }
}
