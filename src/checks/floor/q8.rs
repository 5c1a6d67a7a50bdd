//! 8-bit block quantisation of a matmul's input, as llama.cpp's Q8_0 (blocks
//! of 32) and Q8_K (256) do before a quantised weight's dot products: one
//! scale d = amax/127 per block of the row, each value rounded to a multiple
//! of d. Each block's error is set by its own largest magnitude, so a row
//! with an outlier loses its small entries while a quiet row keeps them: the
//! floor takes the quantisation's effect element by element (`matmul`), or
//! this relative measure where no weight is at hand.

use crate::tensor::Tensor;

/// `x` quantised as Q8 blocks of `block` along each row of `n` values, minus
/// `x`: the error each input carries into the matmul (f64).
pub fn q8_error(x: &[f32], n: usize, block: usize) -> Vec<f64> {
    let mut out = Vec::with_capacity(x.len());
    for row in x.chunks(n.max(1)) {
        for b in row.chunks(block.max(1)) {
            let amax = b.iter().fold(0.0f64, |m, v| m.max((*v as f64).abs()));
            if amax == 0.0 {
                out.extend(std::iter::repeat_n(0.0, b.len()));
                continue;
            }
            let d = amax / 127.0;
            out.extend(b.iter().map(|v| {
                let v = *v as f64;
                (v / d).round() * d - v
            }));
        }
    }
    out
}

/// The relative RMS error of quantising `x` to 8 bits in blocks of `block`
/// along its rows: used where the matmul's weight is not at hand.
pub fn q8_rel_error(x: &Tensor, block: usize) -> f64 {
    let row = *x.shape().last().unwrap_or(&1);
    let e = q8_error(x.data(), row, block);
    let err: f64 = e.iter().map(|d| d * d).sum();
    let sig: f64 = x.data().iter().map(|v| (*v as f64).powi(2)).sum();
    if sig > 0.0 {
        (err / sig).sqrt()
    } else {
        0.0
    }
}

/// The worst case of `q8_rel_error` for one block: all its energy in one
/// value (used when the oracle did not record the matmul's input).
pub fn q8_rel_error_bound(block: usize) -> f64 {
    (block as f64).sqrt() / (127.0 * 12f64.sqrt())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn q8_error_is_half_a_step_of_each_blocks_own_maximum() {
        // One block of equal values quantises exactly.
        let x = Tensor::new(vec![1, 32], vec![0.5; 32]);
        assert_eq!(q8_rel_error(&x, 32), 0.0);
        // A ramp: errors up to amax/254, relative RMS well under the bound.
        let x = Tensor::new(vec![1, 32], (0..32).map(|i| i as f32 * 0.0137).collect());
        let r = q8_rel_error(&x, 32);
        assert!(r > 0.0 && r < q8_rel_error_bound(32), "{r}");
        assert!(q8_error(x.data(), 32, 32)
            .iter()
            .all(|e| e.abs() <= 31.0 * 0.0137 / 254.0 + 1e-12));
        // An outlier makes the rest of its block coarse, not the next block.
        let mut v = vec![0.01f32; 64];
        v[0] = 10.0;
        let e = q8_error(&v, 64, 32);
        assert!(e[1].abs() > 5e-3, "{}", e[1]);
        assert!(e[40].abs() < 1e-4, "{}", e[40]);
    }
}
