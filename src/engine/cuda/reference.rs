//! Host mirrors of decisions the kernels make, so their logic is tested here
//! without a GPU: the argmax preference order of `cuda/sampling.cu` and its
//! reduction shape (per-thread strided scan, then a warp butterfly, then the
//! warp partials), which must give exactly `sampling::argmax`'s answer.

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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sampling::argmax;

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
