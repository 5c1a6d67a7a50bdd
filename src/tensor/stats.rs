//! Summary statistics of a tensor's values, as `inspect` shows them for
//! safetensors, .npy and GGUF files alike.

use super::Tensor;

/// Statistics over the finite values; `non_finite` counts the rest.
pub struct Stats {
    pub min: f64,
    pub max: f64,
    pub mean: f64,
    pub std: f64,
    pub non_finite: usize,
}

impl Stats {
    pub fn of(t: &Tensor) -> Stats {
        let (mut n, mut sum, mut sq) = (0usize, 0f64, 0f64);
        let (mut min, mut max) = (f64::INFINITY, f64::NEG_INFINITY);
        for &x in t.data() {
            if x.is_finite() {
                let x = x as f64;
                n += 1;
                sum += x;
                sq += x * x;
                min = min.min(x);
                max = max.max(x);
            }
        }
        let mean = if n > 0 { sum / n as f64 } else { f64::NAN };
        let var = if n > 0 {
            (sq / n as f64 - mean * mean).max(0.0)
        } else {
            f64::NAN
        };
        Stats {
            min,
            max,
            mean,
            std: var.sqrt(),
            non_finite: t.numel() - n,
        }
    }
}
