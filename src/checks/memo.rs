//! What the checks of one run share, computed once: the scaled policy's
//! oracle-only terms of a matmul stage (each element's Σ|W·x| and 8-bit
//! quantisation effect, read off the model file's weight and the oracle's
//! input; the LM head's alone is a 136M-product pass on a 0.5B model) and
//! each source's floor at a stage, which the engine's golden checks against
//! every reference, the references' own checks and the row judge all ask
//! for. Two are lent through `Facts`: the runner's for one run (the engine's
//! floors: its captures are that run's) and the plan's for every run of it
//! (what the goldens and the model file alone decide). Values of any type,
//! so it needs to know none.

use std::any::{Any, TypeId};
use std::collections::HashMap;
use std::hash::Hash;
use std::sync::{Arc, Mutex};

/// Values of any type, each under a key of its own (type, text).
#[derive(Debug, Default)]
pub struct Memo {
    values: Mutex<HashMap<(TypeId, String), Arc<dyn Any + Send + Sync>>>,
}

/// The value under `k`, or `f`'s, kept for the next asker. `f` runs with no
/// lock held and nobody waits for it: it uses rayon, and a rayon worker that
/// blocked on a value another frame of its own stack is computing (a job it
/// stole while that frame waited for its parallel loop) would never wake.
/// Two threads may both compute a value; the first kept is every later
/// asker's (both are the same numbers).
fn get_or<K: Eq + Hash, V: Clone>(map: &Mutex<HashMap<K, V>>, k: K, f: impl FnOnce() -> V) -> V {
    // A panic while the lock is held leaves the map consistent (one insert).
    let lock = || map.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(v) = lock().get(&k) {
        return v.clone();
    }
    let v = f();
    lock().entry(k).or_insert(v).clone()
}

impl Memo {
    /// The `V` under `key`, computed by `f` where there is none yet.
    pub fn get_or<V: Clone + Send + Sync + 'static>(&self, key: String, f: impl FnOnce() -> V) -> V {
        let any = get_or(&self.values, (TypeId::of::<V>(), key), || {
            Arc::new(f()) as Arc<dyn Any + Send + Sync>
        });
        any.downcast_ref::<V>().expect("keyed by its type").clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What hung `touchstone run --engine cuda` on a 16-core machine: a
    /// value is computed with rayon, and a worker waiting for that loop
    /// steals another check, which asks for the same value: the thread that
    /// computes a value asks for it again. That must compute it (or read it)
    /// rather than wait for itself.
    #[test]
    fn a_thread_computing_a_value_may_ask_for_it_again() {
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let memo: Mutex<HashMap<u32, u64>> = Default::default();
            let v = get_or(&memo, 7, || get_or(&memo, 7, || 1) + 1);
            tx.send((v, get_or(&memo, 7, || 3))).unwrap();
        });
        let got = rx
            .recv_timeout(std::time::Duration::from_secs(30))
            .expect("a thread waited for the value it was computing");
        // The first value kept is every later asker's.
        assert_eq!(got, (1, 1));
    }
}
