//! How fast the comparator runs against how fast this machine reads memory.
//!
//! `cargo run --release --example compare_throughput [MIB]` builds two f32
//! tensors of MIB MiB each (default 256), then times
//! - `touchstone::compare::compare` on them, and
//! - a plain parallel sum over the same two buffers: the read bandwidth the
//!   comparator could reach at best (it reads each input once, as the sum does),
//!
//! each as the best of five runs, and prints both in GB/s (bytes of both inputs
//! per second, 10^9) and their ratio.

use std::time::Instant;

use rayon::prelude::*;
use touchstone::compare::{compare, Tolerance};
use touchstone::tensor::Tensor;

/// Best wall time of `runs` calls, in seconds.
fn best_of<T>(runs: usize, mut f: impl FnMut() -> T) -> (f64, T) {
    let mut best = f64::INFINITY;
    let mut out = None;
    for _ in 0..runs {
        let t = Instant::now();
        let r = std::hint::black_box(f());
        best = best.min(t.elapsed().as_secs_f64());
        out = Some(r);
    }
    (best, out.expect("at least one run"))
}

/// A sum the compiler vectorises (16 independent f32 lanes, no reassociation
/// needed), so it runs at the speed memory delivers the bytes.
fn lane_sum(xs: &[f32]) -> f32 {
    let mut acc = [0f32; 16];
    let mut it = xs.chunks_exact(16);
    for c in &mut it {
        for (a, x) in acc.iter_mut().zip(c) {
            *a += x;
        }
    }
    acc.iter().sum::<f32>() + it.remainder().iter().sum::<f32>()
}

fn main() {
    let mib: usize = std::env::args()
        .nth(1)
        .map(|s| s.parse().expect("MIB: a whole number of MiB"))
        .unwrap_or(256);
    let n = mib * (1 << 20) / 4;
    // An engine's output against its golden: values in [-1, 1], each off by
    // a pseudo-random relative error within ±5e-7 (a few f32 roundings).
    let e: Vec<f32> = (0..n)
        .into_par_iter()
        .map(|i| ((i % 4093) as f32 * 0.37).sin())
        .collect();
    let a: Vec<f32> = e
        .par_iter()
        .enumerate()
        .map(|(i, x)| {
            let u = ((i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 40) as f32 / (1u32 << 24) as f32;
            x * (1.0 + (u - 0.5) * 1e-6)
        })
        .collect();
    let bytes = 2.0 * (n * 4) as f64;

    let (t_sum, s) = best_of(5, || {
        a.par_chunks(1 << 16)
            .zip(e.par_chunks(1 << 16))
            .map(|(x, y)| lane_sum(x) + lane_sum(y))
            .sum::<f32>()
    });
    let (a, e) = (Tensor::new(vec![n], a), Tensor::new(vec![n], e));
    let tol = Tolerance::default_for(touchstone::tensor::DType::F32);
    let (t_cmp, c) = best_of(5, || compare(&a, &e, tol).expect("same shapes"));

    let (bw, cmp) = (bytes / t_sum / 1e9, bytes / t_cmp / 1e9);
    println!(
        "2 x {mib} MiB f32, {} threads (sum {s:.3e}; {} mismatched, nmse {:.3e})",
        rayon::current_num_threads(),
        c.mismatched,
        c.nmse
    );
    println!("read bandwidth (parallel sum): {bw:6.1} GB/s  ({:.1} ms)", t_sum * 1e3);
    println!("compare:                       {cmp:6.1} GB/s  ({:.1} ms)", t_cmp * 1e3);
    println!("compare / bandwidth:           {:6.1} %", 100.0 * cmp / bw);
}
