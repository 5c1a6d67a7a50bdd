//! Host mirrors of decisions the kernels make, so their logic is tested here
//! without a GPU: the argmax preference order of `cuda/sampling.cu` and its
//! reduction shape (per-thread strided scan, then a warp butterfly, then the
//! warp partials), which must give exactly `sampling::argmax`'s answer; and the
//! seeded sampling kernel (ChaCha8 keystream, rank keys, bitwise threshold
//! searches, f64 sums in the kernel's reduction order), which must draw what
//! the host's `Sampler` draws.

/// `argmax_prefers` of `cuda/sampling.cu`, line for line.
pub fn argmax_prefers(va: f32, ia: i64, vb: f32, ib: i64) -> bool {
    let (na, nb) = (va.is_nan(), vb.is_nan());
    if na != nb {
        return nb;
    }
    if na {
        return ia > ib;
    }
    if va != vb {
        return va > vb;
    }
    ia < ib
}

/// The reduction of `argmax` in `cuda/sampling.cu` with `threads` threads.
pub fn argmax_reduction(x: &[f32], threads: usize) -> u32 {
    assert!(threads.is_multiple_of(32) && threads <= 1024);
    let take = |(bv, bi): (f32, i64), (ov, oi): (f32, i64)| {
        if oi >= 0 && (bi < 0 || argmax_prefers(ov, oi, bv, bi)) {
            (ov, oi)
        } else {
            (bv, bi)
        }
    };
    // Per-thread strided scan.
    let mut lanes: Vec<(f32, i64)> = (0..threads)
        .map(|tid| {
            let mut best = (f32::NAN, -1i64);
            for i in (tid..x.len()).step_by(threads) {
                best = take(best, (x[i], i as i64));
            }
            best
        })
        .collect();
    // xor butterfly within each warp: every lane ends with the warp's best.
    let butterfly = |v: &mut [(f32, i64)]| {
        for o in [16, 8, 4, 2, 1] {
            let old = v.to_vec();
            for (l, item) in v.iter_mut().enumerate() {
                *item = take(old[l], old[l ^ o]);
            }
        }
    };
    for warp in lanes.chunks_mut(32) {
        butterfly(warp);
    }
    let mut partials: Vec<(f32, i64)> = (0..32)
        .map(|l| {
            if l < threads / 32 {
                lanes[l * 32]
            } else {
                (f32::NAN, -1)
            }
        })
        .collect();
    butterfly(&mut partials);
    partials[0].1.max(0) as u32
}

/// `block_sum_t` / `block_max` / `block_min_u64` of the kernels with `threads`
/// threads over `n` elements: each thread folds its strided elements in index
/// order from `identity`, then an xor butterfly within each warp, then one over
/// the warp partials (padded with `identity`).
fn block_reduce<T: Copy>(threads: usize, n: usize, identity: T, f: impl Fn(usize) -> T, op: impl Fn(T, T) -> T) -> T {
    let mut lanes: Vec<T> = (0..threads)
        .map(|tid| (tid..n).step_by(threads).fold(identity, |acc, i| op(acc, f(i))))
        .collect();
    let butterfly = |v: &mut [T]| {
        for o in [16, 8, 4, 2, 1] {
            let old = v.to_vec();
            for (l, item) in v.iter_mut().enumerate() {
                *item = op(old[l], old[l ^ o]);
            }
        }
    };
    for warp in lanes.chunks_mut(32) {
        butterfly(warp);
    }
    let mut partials: Vec<T> = (0..32)
        .map(|l| if l < threads / 32 { lanes[l * 32] } else { identity })
        .collect();
    butterfly(&mut partials);
    partials[0]
}

/// `chacha8_u64` of `cuda/sampling.cu`: u64 number `draw` of ChaCha8 stream 0.
pub fn chacha8_u64(key: &[u32; 8], draw: u64) -> u64 {
    fn qr(x: &mut [u32; 16], a: usize, b: usize, c: usize, d: usize) {
        x[a] = x[a].wrapping_add(x[b]);
        x[d] = (x[d] ^ x[a]).rotate_left(16);
        x[c] = x[c].wrapping_add(x[d]);
        x[b] = (x[b] ^ x[c]).rotate_left(12);
        x[a] = x[a].wrapping_add(x[b]);
        x[d] = (x[d] ^ x[a]).rotate_left(8);
        x[c] = x[c].wrapping_add(x[d]);
        x[b] = (x[b] ^ x[c]).rotate_left(7);
    }
    let block = draw >> 3;
    let word = (draw & 7) as usize * 2;
    let mut s = [0u32; 16];
    s[..4].copy_from_slice(&[0x6170_7865, 0x3320_646e, 0x7962_2d32, 0x6b20_6574]);
    s[4..12].copy_from_slice(key);
    s[12] = block as u32;
    s[13] = (block >> 32) as u32;
    let mut x = s;
    for _ in 0..4 {
        qr(&mut x, 0, 4, 8, 12);
        qr(&mut x, 1, 5, 9, 13);
        qr(&mut x, 2, 6, 10, 14);
        qr(&mut x, 3, 7, 11, 15);
        qr(&mut x, 0, 5, 10, 15);
        qr(&mut x, 1, 6, 11, 12);
        qr(&mut x, 2, 7, 8, 13);
        qr(&mut x, 3, 4, 9, 14);
    }
    let lo = x[word].wrapping_add(s[word]);
    let hi = x[word + 1].wrapping_add(s[word + 1]);
    ((hi as u64) << 32) | lo as u64
}

/// `unit_f64`: the top 53 bits times 2^-53.
pub fn unit_f64(r: u64) -> f64 {
    (r >> 11) as f64 * (1.0 / 9_007_199_254_740_992.0)
}

/// `rank_key`: larger is better ranked (value by total order, then lower index).
pub fn rank_key(v: f32, i: usize) -> u64 {
    let b = v.to_bits();
    let o = if b & 0x8000_0000 != 0 { !b } else { b | 0x8000_0000 };
    ((o as u64) << 32) | (0xffff_ffff - i as u32) as u64
}

/// The `sample` kernel of `cuda/sampling.cu`, step for step, with `threads`
/// threads. `top_k` is 0 for none (the engine passes `max(k, 1)` otherwise).
#[allow(clippy::too_many_arguments)]
pub fn sample(
    x: &[f32],
    temperature: f32,
    top_k: i64,
    top_p: f32,
    has_top_p: bool,
    key: &[u32; 8],
    draw: u64,
    threads: usize,
) -> u32 {
    assert!(threads.is_multiple_of(32) && threads <= 1024);
    let n = x.len();
    let sum_u = |f: &dyn Fn(usize) -> u64| block_reduce(threads, n, 0u64, f, |a, b| a + b);
    let sum_d = |f: &dyn Fn(usize) -> f64| block_reduce(threads, n, 0.0f64, f, |a, b| a + b);
    let fin = |i: usize| x[i].is_finite();

    let cnt = sum_u(&|i| fin(i) as u64);
    if cnt == 0 {
        return argmax_reduction(x, threads);
    }
    let k = if top_k > 0 && (top_k as u64) < cnt {
        top_k as u64
    } else {
        cnt
    };
    let mut tk = 0u64;
    if k < cnt {
        for b in (0..64).rev() {
            let t = tk | (1u64 << b);
            if sum_u(&|i| (fin(i) && rank_key(x[i], i) >= t) as u64) >= k {
                tk = t;
            }
        }
    }
    let m = block_reduce(
        threads,
        n,
        f32::NEG_INFINITY,
        |i| if fin(i) { x[i] } else { f32::NEG_INFINITY },
        f32::max,
    );
    let w: Vec<f64> = (0..n)
        .map(|i| {
            if fin(i) && rank_key(x[i], i) >= tk {
                ((x[i] as f64 - m as f64) / temperature as f64).exp()
            } else {
                0.0
            }
        })
        .collect();
    let total = sum_d(&|i| w[i]);
    let mut tp = 0u64;
    if has_top_p {
        for b in (0..64).rev() {
            let t = tp | (1u64 << b);
            let inside = |i: usize| fin(i) && rank_key(x[i], i) >= tk && rank_key(x[i], i) >= t;
            let c = sum_u(&|i| inside(i) as u64);
            let mass = sum_d(&|i| if inside(i) { w[i] / total } else { 0.0 });
            if c >= 1 && mass >= top_p as f64 {
                tp = t;
            }
        }
    }
    let keep = tk.max(tp);
    let kept_i = |i: usize| fin(i) && rank_key(x[i], i) >= keep;
    let kept = if has_top_p {
        sum_d(&|i| if kept_i(i) { w[i] / total } else { 0.0 })
    } else {
        1.0
    };
    let u = unit_f64(chacha8_u64(key, draw));
    let mut td = 0u64;
    for b in (0..64).rev() {
        let t = td | (1u64 << b);
        let mass = sum_d(&|i| {
            if kept_i(i) && rank_key(x[i], i) >= t {
                if has_top_p {
                    (w[i] / total) / kept
                } else {
                    w[i] / total
                }
            } else {
                0.0
            }
        });
        if mass > u {
            td = t;
        }
    }
    if td == 0 {
        td = block_reduce(
            threads,
            n,
            u64::MAX,
            |i| if kept_i(i) { rank_key(x[i], i) } else { u64::MAX },
            u64::min,
        );
    }
    0xffff_ffff - (td & 0xffff_ffff) as u32
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sampling::{argmax, chacha_key, Sampler, Sampling};
    use rand::{Rng, RngCore, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    #[test]
    fn device_chacha_stream_is_rand_chachas() {
        for seed in [0u64, 1, 1234, u64::MAX] {
            let key = chacha_key(seed);
            let mut words = ChaCha8Rng::seed_from_u64(seed);
            let mut floats = ChaCha8Rng::seed_from_u64(seed);
            // 40 draws span 5 ChaCha blocks (and rand_chacha's 4-block buffer).
            for draw in 0..40 {
                let r = chacha8_u64(&key, draw);
                assert_eq!(r, words.next_u64(), "seed {seed}, draw {draw}");
                assert_eq!(unit_f64(r), floats.random::<f64>(), "seed {seed}, draw {draw}");
            }
        }
    }

    #[test]
    fn device_sampling_draws_what_the_host_sampler_draws() {
        let mut s = 99u64;
        let mut next = || {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            s >> 33
        };
        let mut rows: Vec<Vec<f32>> = vec![
            vec![f32::NAN, f32::INFINITY, f32::NEG_INFINITY],
            vec![-0.0, 0.0, -0.0, 0.0],
            vec![3.0],
            vec![1.0, f32::NAN, 1.0, -300.0, 1.0],
        ];
        for len in [2usize, 31, 40, 300, 1100] {
            for _ in 0..6 {
                rows.push(
                    (0..len)
                        .map(|_| match next() % 64 {
                            0 => f32::NAN,
                            1 => f32::NEG_INFINITY,
                            2 => f32::INFINITY,
                            3..=12 => (next() % 4) as f32, // ties
                            _ => (next() % 20_000) as f32 / 1000.0 - 10.0,
                        })
                        .collect(),
                );
            }
        }
        let params = [
            (1.0, None, None),
            (0.7, Some(0), None),
            (1.0, Some(1), Some(0.9)),
            (1.3, Some(5), None),
            (1.0, Some(50), Some(0.95)),
            (2.0, None, Some(0.5)),
            (1.0, None, Some(0.0)),
            (1.0, None, Some(1.0)),
        ];
        let mut compared = 0;
        for (r, row) in rows.iter().enumerate() {
            for (p, &(temperature, top_k, top_p)) in params.iter().enumerate() {
                let sampling = Sampling::Random {
                    temperature,
                    top_k,
                    top_p,
                };
                let seed = (r * 31 + p) as u64;
                let mut host = Sampler::new(sampling, seed);
                let key = chacha_key(seed);
                let k = top_k.map(|k: usize| k.max(1) as i64).unwrap_or(0);
                for draw in 0..3u64 {
                    let want = host.sample(row);
                    let threads = [32, 256, 1024][(draw as usize + r) % 3];
                    let got = sample(
                        row,
                        temperature,
                        k,
                        top_p.unwrap_or(0.0),
                        top_p.is_some(),
                        &key,
                        draw,
                        threads,
                    );
                    assert_eq!(got, want, "row {r} (len {}), params {p}, draw {draw}", row.len());
                    compared += 1;
                }
            }
        }
        assert_eq!(compared, rows.len() * params.len() * 3);
    }

    #[test]
    fn device_argmax_order_equals_the_host_scan() {
        let mut cases: Vec<Vec<f32>> = vec![
            vec![0.0, 3.0, 3.0, 1.0],
            vec![f32::NAN, 1.0, 2.0],
            vec![1.0, f32::NAN, 2.0],
            vec![f32::NAN, f32::NAN, 1.0],
            vec![f32::NAN, f32::NAN],
            vec![f32::NAN],
            vec![-0.0, 0.0],
            vec![f32::NEG_INFINITY, f32::NEG_INFINITY],
            vec![5.0],
        ];
        // Pseudo-random rows with ties and NaNs, longer than one block.
        let mut s = 12345u64;
        for len in [2usize, 33, 1000, 1025, 5000] {
            for _ in 0..20 {
                let row = (0..len)
                    .map(|_| {
                        s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                        match (s >> 33) % 50 {
                            0 => f32::NAN,
                            1 => f32::INFINITY,
                            k => (k % 7) as f32,
                        }
                    })
                    .collect();
                cases.push(row);
            }
        }
        for x in &cases {
            for threads in [32, 256, 1024] {
                assert_eq!(argmax_reduction(x, threads), argmax(x), "{threads} threads, {x:?}");
            }
        }
    }
}
