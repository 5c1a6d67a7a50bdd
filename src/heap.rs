//! Counting the heap an in-process engine holds, so that the `repeat` check
//! can read the memory of the CPU engine (or any Rust engine) itself, as it
//! reads a protocol engine's resident set from /proc.
//!
//! Why not this process's resident set: checks run in parallel in one
//! process (libtest), so its RSS moves with every other trial; and an
//! allocator keeps freed pages, so RSS hides small leaks. Instead the
//! global allocator counts the bytes allocated and not yet freed by threads
//! that carry a meter's tag: a `Meter` runs the engine on a thread pool of
//! its own whose threads carry its tag (the engine's rayon work included,
//! since rayon runs nested work on the pool it was called from), so its
//! count is exactly the engine's live heap, whatever else the process does.
//! Untagged threads pay one thread-local read per allocation.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};

/// Meters that can count at once (a meter waits for a free one).
const METERS: usize = 32;

static LIVE: [AtomicI64; METERS] = [const { AtomicI64::new(0) }; METERS];
static IN_USE: [AtomicBool; METERS] = [const { AtomicBool::new(false) }; METERS];

thread_local! {
    /// This thread's meter + 1 (0: not counted). Const-initialised without a
    /// destructor, so reading it never allocates.
    static TAG: Cell<usize> = const { Cell::new(0) };
}

/// The system allocator, counting tagged threads' bytes.
pub struct Counting;

fn tagged() -> Option<usize> {
    TAG.try_with(|t| t.get()).ok().filter(|&t| t > 0).map(|t| t - 1)
}

// SAFETY: every call forwards to `System` with the same arguments; the
// counters are plain atomics and never allocate.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let p = System.alloc(layout);
        if let (false, Some(m)) = (p.is_null(), tagged()) {
            LIVE[m].fetch_add(layout.size() as i64, Ordering::Relaxed);
        }
        p
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        let p = System.alloc_zeroed(layout);
        if let (false, Some(m)) = (p.is_null(), tagged()) {
            LIVE[m].fetch_add(layout.size() as i64, Ordering::Relaxed);
        }
        p
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        System.dealloc(ptr, layout);
        if let Some(m) = tagged() {
            LIVE[m].fetch_sub(layout.size() as i64, Ordering::Relaxed);
        }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let p = System.realloc(ptr, layout, new_size);
        if let (false, Some(m)) = (p.is_null(), tagged()) {
            LIVE[m].fetch_add(new_size as i64 - layout.size() as i64, Ordering::Relaxed);
        }
        p
    }
}

/// A counter of the heap that work run through it holds.
pub struct Meter {
    id: usize,
    pool: rayon::ThreadPool,
}

impl Meter {
    /// A meter with a pool of `threads` threads (the engine's parallelism).
    pub fn new(threads: usize) -> Result<Meter, String> {
        let id = loop {
            if let Some(i) = (0..METERS).find(|&i| {
                IN_USE[i]
                    .compare_exchange(false, true, Ordering::AcqRel, Ordering::Relaxed)
                    .is_ok()
            }) {
                break i;
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        };
        LIVE[id].store(0, Ordering::Relaxed);
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads.max(1))
            .thread_name(move |i| format!("touchstone-meter-{id}-{i}"))
            .start_handler(move |_| TAG.with(|t| t.set(id + 1)))
            .exit_handler(|_| TAG.with(|t| t.set(0)))
            .build()
            .map_err(|e| {
                IN_USE[id].store(false, Ordering::Release);
                format!("cannot start the memory meter's threads: {e}")
            })?;
        // Every thread runs once before counting starts: a pool thread sets
        // up its own state (deques, thread-locals) the first time the OS runs
        // it, and that would otherwise be counted at whichever request it
        // happened in (2 KB that moved readings from run to run).
        pool.broadcast(|_| ());
        LIVE[id].store(0, Ordering::Relaxed);
        Ok(Meter { id, pool })
    }

    /// Runs `f` on the meter's threads (everything it allocates is counted).
    pub fn run<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        self.pool.install(f)
    }

    /// Whether the counting allocator is this program's global allocator
    /// (the default feature `heap-meter`); without it nothing is counted.
    pub fn installed() -> bool {
        cfg!(feature = "heap-meter")
    }

    /// Bytes allocated by the meter's threads and not yet freed.
    pub fn live(&self) -> i64 {
        LIVE[self.id].load(Ordering::Relaxed)
    }
}

impl Drop for Meter {
    fn drop(&mut self) {
        IN_USE[self.id].store(false, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_meter_counts_what_its_work_keeps_and_nothing_else() {
        use rayon::prelude::*;
        // One thread: a pool's idle threads start (and set up their deques)
        // whenever the OS runs them, which would move the count between two
        // readings; the repeat check needs no such exactness (a leak must
        // grow at every request), this test does.
        let m = Meter::new(1).unwrap();
        let work = || (0..1000u64).into_par_iter().map(|x| x * 2).collect::<Vec<u64>>().len();
        // The pool's own thread keeps some memory (its deque): warm up.
        m.run(work);
        m.run(work);
        let base = m.live();
        // Temporaries freed inside, on the meter's threads: nothing stays.
        m.run(work);
        assert_eq!(m.live(), base, "temporaries are freed");
        let kept: Vec<Vec<u8>> = m.run(|| vec![vec![1u8; 4096]]);
        assert!(
            m.live() - base >= 4096,
            "the kept buffer is counted: {}",
            m.live() - base
        );
        // Work outside the meter is not counted.
        let before = m.live();
        let other = vec![0u8; 1 << 20];
        assert_eq!(m.live(), before);
        drop(other);
        m.run(move || drop(kept));
        assert_eq!(m.live(), base, "freed on the meter's threads");
        // A leak shows as growth.
        m.run(|| std::mem::forget(vec![0u8; 10_000]));
        assert_eq!(m.live() - base, 10_000);
    }
}
