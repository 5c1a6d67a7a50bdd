//! The evidence behind the CPU engine's hand-written matmul
//! (`touchstone::engine::cpu::matmul`): the same products at the Qwen2.5-0.5B
//! shapes through it and through the GEMM crates it could have used, in the
//! same process, interleaved, on the same thread count. For each shape it
//! prints the median GFLOP/s and weight GB/s of every candidate, the ratio of
//! ours to each, and whether a candidate gives a row computed alone the same
//! bits as that row inside the batch (the engine needs that: a decode step
//! must equal the same row of a full recompute bit for bit).
//!
//! `cargo run --release -p gemm-candidates -- [--threads N] [--reps N]`
//! (ci/bench.sh runs it). Not part of CI.

use std::time::Instant;

use touchstone::engine::cpu::matmul::matmul_wt;

/// Qwen2.5-0.5B's projections: (name, k = in features, n = out features).
const SHAPES: [(&str, usize, usize); 5] = [
    ("q/o 896x896", 896, 896),
    ("k/v 896->128", 896, 128),
    ("gate/up 896->4864", 896, 4864),
    ("down 4864->896", 4864, 896),
    ("lm_head 896->151936", 896, 151_936),
];

type Candidate = (&'static str, fn(&[f32], usize, usize, &[f32], usize, usize) -> Vec<f32>);

const CANDIDATES: [Candidate; 3] = [
    ("touchstone", |x, m, k, w, n, _| matmul_wt(x, m, k, w, n)),
    ("gemm 0.18", gemm_crate),
    ("matrixmultiply 0.3", matrixmultiply_cols),
];

/// `gemm`'s own parallelism (rayon, `threads` tasks). Its packing and kernel
/// choice depend on m, n, k.
fn gemm_crate(x: &[f32], m: usize, k: usize, w: &[f32], n: usize, threads: usize) -> Vec<f32> {
    let mut y = vec![0.0f32; m * n];
    let par = if threads > 1 {
        gemm::Parallelism::Rayon(threads)
    } else {
        gemm::Parallelism::None
    };
    // SAFETY: y is [m,n] row-major (cs 1, rs n); x [m,k] (cs 1, rs k); wᵀ is
    // [k,n] read from w [n,k] (cs k, rs 1); all in bounds.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            y.as_mut_ptr(),
            1,
            n as isize,
            false,
            x.as_ptr(),
            1,
            k as isize,
            w.as_ptr(),
            k as isize,
            1,
            0.0,
            1.0,
            false,
            false,
            false,
            par,
        );
    }
    y
}

/// `matrixmultiply::sgemm` over blocks of 256 output columns on rayon: how the
/// engine used it before (the crate's own threading is off by default).
fn matrixmultiply_cols(x: &[f32], m: usize, k: usize, w: &[f32], n: usize, _threads: usize) -> Vec<f32> {
    use rayon::prelude::*;
    const COLS: usize = 256;
    let mut y = vec![0.0f32; m * n];
    let out = y.as_mut_ptr() as usize;
    (0..n.div_ceil(COLS)).into_par_iter().for_each(|b| {
        let c0 = b * COLS;
        let nc = COLS.min(n - c0);
        // SAFETY: each task writes columns c0..c0+nc of y only.
        unsafe {
            matrixmultiply::sgemm(
                m,
                k,
                nc,
                1.0,
                x.as_ptr(),
                k as isize,
                1,
                w.as_ptr().add(c0 * k),
                1,
                k as isize,
                0.0,
                (out as *mut f32).add(c0),
                n as isize,
                1,
            );
        }
    });
    y
}

fn data(len: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.1
        })
        .collect()
}

/// Best-of-`reps` GB/s of a parallel f32 sum over a buffer 32× the L3 here.
fn read_bandwidth(reps: usize) -> f64 {
    use rayon::prelude::*;
    let buf = data(1 << 28, 7);
    (0..reps)
        .map(|_| {
            let t = Instant::now();
            // 16 lane sums, so the loop vectorises (an f32 `sum()` is a
            // serial chain and would measure the adder, not the memory).
            let s: f32 = buf
                .par_chunks(1 << 16)
                .map(|c| {
                    let mut acc = [0.0f32; 16];
                    for v in c.chunks_exact(16) {
                        for (a, x) in acc.iter_mut().zip(v) {
                            *a += x;
                        }
                    }
                    acc.iter().sum::<f32>()
                })
                .sum();
            std::hint::black_box(s);
            (buf.len() * 4) as f64 / t.elapsed().as_secs_f64() / 1e9
        })
        .fold(0.0, f64::max)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn arg(args: &[String], name: &str, default: usize) -> Result<usize, String> {
    match args.iter().position(|a| a == name) {
        None => Ok(default),
        Some(i) => args
            .get(i + 1)
            .and_then(|v| v.parse().ok())
            .filter(|&v: &usize| v > 0)
            .ok_or_else(|| format!("{name} needs a positive integer")),
    }
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.iter().any(|a| a == "-h" || a == "--help") {
        println!("gemm-candidates [--threads N (2)] [--reps N (7)] [--best] [--m 1|32]: see the file's doc comment");
        return;
    }
    // The fastest rep rather than the median: on a shared machine the
    // interference is one-sided (it only ever slows a rep down).
    let best = args.iter().any(|a| a == "--best");
    let stat = if best { "best" } else { "median" };
    let (threads, reps) = match (arg(&args, "--threads", 2), arg(&args, "--reps", 7)) {
        (Ok(t), Ok(r)) => (t, r),
        (Err(e), _) | (_, Err(e)) => {
            eprintln!("gemm-candidates: {e}");
            std::process::exit(2);
        }
    };
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .expect("a rayon pool");
    println!("# GEMM candidates, {threads} threads, {stat} of {reps} interleaved reps; ratio = touchstone GFLOP/s / candidate's");
    println!(
        "{:<22} {:>3} {:<20} {:>9} {:>9} {:>7} {:>15}",
        "shape", "m", "candidate", "GFLOP/s", "w GB/s", "ratio", "row alone = batch"
    );
    pool.install(|| {
        let bw = read_bandwidth(reps);
        println!("# memory read bandwidth (parallel sum over 1 GiB, best of {reps}): {bw:.1} GB/s: the limit of w GB/s at m = 1 once w is out of cache (gate/up, down, lm_head)");
        for m in [1usize, 32] {
            for &(name, k, n) in &SHAPES {
                let x = data(m * k, 1 + k as u64);
                let w = data(n * k, 2 + n as u64);
                let mut times = vec![Vec::new(); CANDIDATES.len()];
                for _ in 0..reps {
                    for (c, (_, f)) in CANDIDATES.iter().enumerate() {
                        let t = Instant::now();
                        std::hint::black_box(f(&x, m, k, &w, n, threads));
                        times[c].push(t.elapsed().as_secs_f64());
                    }
                }
                let flops = 2.0 * (m * k * n) as f64;
                let wbytes = 4.0 * (k * n) as f64;
                let summary = |v: &Vec<f64>| if best { v.iter().copied().fold(f64::INFINITY, f64::min) } else { median(v.clone()) };
                let ours = summary(&times[0]);
                for (c, (cname, f)) in CANDIDATES.iter().enumerate() {
                    let t = summary(&times[c]);
                    // The last row alone against the same row of the batch.
                    let invariant = if m > 1 {
                        let batch = f(&x, m, k, &w, n, threads);
                        let alone = f(&x[(m - 1) * k..], 1, k, &w, n, threads);
                        let same = batch[(m - 1) * n..]
                            .iter()
                            .zip(&alone)
                            .all(|(a, b)| a.to_bits() == b.to_bits());
                        if same { "yes" } else { "NO" }
                    } else {
                        "-"
                    };
                    println!(
                        "{:<22} {:>3} {:<20} {:>9.1} {:>9.1} {:>7.2} {:>15}",
                        name,
                        m,
                        cname,
                        flops / t / 1e9,
                        wbytes / t / 1e9,
                        t / ours,
                        invariant
                    );
                }
            }
        }
    });
}
