//! The machine's memory read bandwidth: every thread sums its own contiguous
//! part of a buffer far larger than the last-level cache, so every byte comes
//! from DRAM once per repetition. It is the ceiling for decode (each token
//! reads every weight) and for the comparator (it reads both tensors once).
//!
//! The sum is over `u64` with wrapping adds: integer addition is associative,
//! so the compiler vectorises the loop with several accumulators (an f32 sum
//! must keep its order and would be bound by the add latency, measuring the
//! core instead of the memory). `kernel_gb_s` runs the same loop on a buffer
//! that fits in L2, to show the loop is far faster than the memory.

use std::hint::black_box;
use std::time::Instant;

use rayon::prelude::*;

use super::stats::{best, median};
use super::{emit, init_threads, GB, MIB};
use crate::cli::bench::BandwidthArgs;
use crate::error::{Error, Result};

/// One measurement of read bandwidth.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Bandwidth {
    pub threads: usize,
    pub bytes: usize,
    /// Seconds of each timed pass.
    pub seconds: Vec<f64>,
    pub best_gb_s: f64,
    pub median_gb_s: f64,
    /// The same loop over a buffer resident in L2: the loop's own speed.
    pub kernel_gb_s: f64,
}

/// Allocates `bytes` of u64 (refusing, not aborting, when the memory is not
/// there) and writes them in parallel, so the pages exist before timing and
/// each thread first touches the part it will read.
fn filled_buffer(bytes: usize, threads: usize) -> Result<Vec<u64>> {
    let n = bytes / 8;
    let mut buf: Vec<u64> = Vec::new();
    buf.try_reserve_exact(n).map_err(|e| {
        Error::Usage(format!(
            "cannot allocate {} MiB for the bandwidth buffer: {e}",
            bytes / MIB
        ))
    })?;
    buf.resize(n, 0);
    let part = n.div_ceil(threads).max(1);
    buf.par_chunks_mut(part).enumerate().for_each(|(c, ch)| {
        for (i, x) in ch.iter_mut().enumerate() {
            *x = (c * part + i) as u64;
        }
    });
    Ok(buf)
}

fn sum(xs: &[u64]) -> u64 {
    xs.iter().fold(0u64, |a, &x| a.wrapping_add(x))
}

/// One parallel pass: each thread sums one contiguous part.
fn parallel_sum(buf: &[u64], threads: usize) -> u64 {
    let part = buf.len().div_ceil(threads).max(1);
    buf.par_chunks(part).map(sum).reduce(|| 0, u64::wrapping_add)
}

/// Measures on rayon's current pool (`threads` wide: the caller set it up).
pub fn measure(mib: usize, reps: usize, threads: usize) -> Result<Bandwidth> {
    let bytes = mib * MIB;
    let buf = filled_buffer(bytes, threads)?;
    black_box(parallel_sum(&buf, threads)); // untimed: faults nothing in, but warms the threads
    let mut seconds = Vec::with_capacity(reps);
    for _ in 0..reps {
        let t0 = Instant::now();
        black_box(parallel_sum(black_box(&buf), threads));
        seconds.push(t0.elapsed().as_secs_f64());
    }
    drop(buf);
    let rates: Vec<f64> = seconds.iter().map(|s| bytes as f64 / s / GB).collect();
    Ok(Bandwidth {
        threads,
        bytes,
        best_gb_s: best(&rates).unwrap_or(0.0),
        median_gb_s: median(&rates).unwrap_or(0.0),
        kernel_gb_s: kernel_speed(threads)?,
        seconds,
    })
}

/// The loop's speed out of L2: 256 KiB per thread (L2 is 1 MiB per core on
/// the Zen 4 this was written on, 256 KiB or more on any recent x86), summed
/// enough times to last tens of milliseconds.
fn kernel_speed(threads: usize) -> Result<f64> {
    const PER_THREAD: usize = 256 << 10;
    const PASSES: usize = 400;
    let buf = filled_buffer(PER_THREAD * threads, threads)?;
    let part = buf.len().div_ceil(threads);
    black_box(parallel_sum(&buf, threads));
    let t0 = Instant::now();
    let s: u64 = buf
        .par_chunks(part)
        .map(|ch| (0..PASSES).fold(0u64, |a, _| a.wrapping_add(sum(black_box(ch)))))
        .reduce(|| 0, u64::wrapping_add);
    black_box(s);
    Ok((PER_THREAD * threads * PASSES) as f64 / t0.elapsed().as_secs_f64() / GB)
}

pub fn run(a: &BandwidthArgs) -> Result<()> {
    let threads = a.threads as usize;
    init_threads(threads)?;
    let bw = measure(a.mib as usize, a.reps as usize, threads)?;
    report(&bw, a.mib as usize);
    Ok(())
}

/// One JSON line per pass and a summary line.
pub fn report(bw: &Bandwidth, mib: usize) {
    for (i, s) in bw.seconds.iter().enumerate() {
        let gb_s = bw.bytes as f64 / s / GB;
        emit(
            &serde_json::json!({"bench": "bandwidth", "rep": i + 1, "threads": bw.threads,
                                "bytes": bw.bytes, "seconds": s, "gb_s": gb_s}),
            &format!(
                "bandwidth rep {}/{}: {mib} MiB in {:.4} s = {gb_s:.1} GB/s",
                i + 1,
                bw.seconds.len(),
                s
            ),
        );
    }
    emit(
        &serde_json::json!({"bench": "bandwidth", "summary": true, "threads": bw.threads, "bytes": bw.bytes,
                            "mib": mib, "reps": bw.seconds.len(), "best_gb_s": bw.best_gb_s,
                            "median_gb_s": bw.median_gb_s, "kernel_gb_s": bw.kernel_gb_s}),
        &format!(
            "bandwidth: best {:.1} GB/s, median {:.1} GB/s ({} threads, {mib} MiB); the summing loop alone runs at {:.0} GB/s in L2",
            bw.best_gb_s, bw.median_gb_s, bw.threads, bw.kernel_gb_s
        ),
    );
    if bw.best_gb_s > 0.7 * bw.kernel_gb_s {
        eprintln!(
            "bandwidth: warning: memory ran at over 70% of the loop's in-cache speed; the loop, not the memory, may be the limit"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parallel_sum_is_the_sum_whatever_the_split() {
        let buf: Vec<u64> = (0..10_001).collect();
        let want = 10_000 * 10_001 / 2;
        for threads in [1, 2, 3, 7] {
            assert_eq!(parallel_sum(&buf, threads), want);
        }
    }

    #[test]
    fn filled_buffer_counts_up_across_parts() {
        let b = filled_buffer(8 * 1000, 3).unwrap();
        assert!(b.iter().enumerate().all(|(i, &x)| x == i as u64));
    }
}
