//! `touchstone bench compare`: the comparator of every golden check
//! (`crate::compare::compare`) on two large f32 tensors, in GB/s of input
//! read (both tensors count), and as a fraction of the read bandwidth measured
//! in the same process with the same threads: the comparator reads each input
//! once, so that bandwidth is its limit.
//!
//! The tensors come from files (`--a`, `--b`: what `ci/bench.sh` gives every
//! peer, so numpy and torch see the same bytes) or are generated here.

use std::path::Path;
use std::time::Instant;

use rand::{Rng, SeedableRng};

use super::stats::{best, median};
use super::{bandwidth, emit, init_threads, GB, MIB};
use crate::cli::bench::CompareArgs;
use crate::compare::{compare, Comparison, Tolerance};
use crate::error::{Error, Result};
use crate::tensor::{DType, Tensor};

/// Golden-check-like data, seeded: `a` uniform in [-4, 4), `b` = `a` plus
/// noise up to ±1e-5, the scale of the default f32 tolerance (atol 1e-5), so
/// the allclose test sits near its boundary as in a real near-miss.
fn generated(mib: usize) -> Result<(Tensor, Tensor)> {
    let n = mib * MIB / 4;
    let alloc = |what: &str| -> Result<Vec<f32>> {
        let mut v = Vec::new();
        v.try_reserve_exact(n)
            .map_err(|e| Error::Usage(format!("cannot allocate {mib} MiB for tensor {what}: {e}")))?;
        Ok(v)
    };
    let (mut a, mut b) = (alloc("a")?, alloc("b")?);
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(0x7c0_4a2e);
    for _ in 0..n {
        let x: f32 = rng.random_range(-4.0..4.0);
        let noise: f32 = rng.random_range(-1e-5..1e-5);
        a.push(x);
        b.push(x + noise);
    }
    Ok((Tensor::new(vec![n], a), Tensor::new(vec![n], b)))
}

/// The one float tensor of a file.
fn single_tensor(path: &Path) -> Result<Tensor> {
    let mut f = crate::tensor::io::TensorFile::read(path)?;
    if f.floats.len() != 1 {
        return Err(Error::tensor_file(
            path,
            format!(
                "holds {} float tensors; the bench compares files of exactly one",
                f.floats.len()
            ),
        ));
    }
    f.floats
        .pop_first()
        .map(|(_, t)| t)
        .ok_or_else(|| Error::tensor_file(path, "holds no float tensor"))
}

/// Row-major flat offset of a multi-index.
fn flat(index: &[usize], shape: &[usize]) -> usize {
    index.iter().zip(shape).fold(0, |acc, (&i, &n)| acc * n + i)
}

/// The metrics every comparator peer computes, for the driver to check that
/// they all computed the same thing.
fn metrics_json(c: &Comparison) -> serde_json::Value {
    let worst = |m: &Option<(f64, crate::compare::At)>| {
        m.as_ref()
            .map(|(v, at)| serde_json::json!({"value": v, "index": flat(&at.index, &c.shape)}))
    };
    serde_json::json!({
        "numel": c.numel, "atol": c.tol.atol, "rtol": c.tol.rtol, "mismatched": c.mismatched,
        "non_finite": c.non_finite(), "max_abs": worst(&c.max_abs), "max_rel": worst(&c.max_rel),
        "max_ulp": c.max_ulp, "nmse": c.nmse, "cosine": c.cosine,
    })
}

pub fn run(a: &CompareArgs) -> Result<()> {
    let threads = a.threads as usize;
    init_threads(threads)?;
    let (ta, tb, source) = match (&a.a, &a.b) {
        (Some(pa), Some(pb)) => (single_tensor(pa)?, single_tensor(pb)?, "files"),
        _ => {
            let (x, y) = generated(a.mib as usize)?;
            (x, y, "generated")
        }
    };
    if ta.shape() != tb.shape() {
        return Err(Error::Usage(format!(
            "the tensors differ in shape ({:?} vs {:?}); the bench compares equal shapes",
            ta.shape(),
            tb.shape()
        )));
    }
    let bytes = 4 * (ta.numel() + tb.numel());
    let tol = Tolerance::default_for(DType::F32);
    let mut rates = Vec::new();
    let mut last = None;
    for rep in 1..=a.reps as usize {
        let t = Instant::now();
        let c = compare(&ta, &tb, tol).map_err(|e| Error::Usage(e.to_string()))?;
        let s = t.elapsed().as_secs_f64();
        let gb_s = bytes as f64 / s / GB;
        rates.push(gb_s);
        emit(
            &serde_json::json!({"bench": "compare", "impl": "touchstone", "rep": rep, "seconds": s, "gb_s": gb_s}),
            &format!(
                "touchstone compare rep {rep}/{}: {:.0} MB in {s:.3} s = {gb_s:.2} GB/s",
                a.reps,
                bytes as f64 / 1e6
            ),
        );
        last = Some(c);
    }
    drop((ta, tb));
    let bw = bandwidth::measure(a.bandwidth_mib as usize, 5, threads)?;
    let (med, top) = (median(&rates).unwrap_or(0.0), best(&rates).unwrap_or(0.0));
    let metrics = last.as_ref().map(metrics_json);
    emit(
        &serde_json::json!({"bench": "compare", "impl": "touchstone", "summary": true, "threads": threads,
                            "source": source, "bytes": bytes, "reps": a.reps, "median_gb_s": med, "best_gb_s": top,
                            "bandwidth_gb_s": bw.best_gb_s, "fraction_of_bandwidth": med / bw.best_gb_s,
                            "metrics": metrics}),
        &format!(
            "touchstone compare: median {med:.2} GB/s of input, {:.1}% of the {:.1} GB/s read bandwidth measured beside it",
            100.0 * med / bw.best_gb_s,
            bw.best_gb_s
        ),
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flat_offsets_are_row_major() {
        assert_eq!(flat(&[5], &[10]), 5);
        assert_eq!(flat(&[1, 2, 3], &[4, 5, 6]), 30 + 12 + 3);
    }

    #[test]
    fn generated_data_is_close_but_not_equal() {
        let (a, b) = generated(1).unwrap();
        assert_eq!(a.numel(), MIB / 4);
        let c = compare(&a, &b, Tolerance::default_for(DType::F32)).unwrap();
        let max_abs = c.max_abs.as_ref().unwrap().0;
        assert!(max_abs > 0.0 && max_abs <= 1.1e-5, "{max_abs}");
        assert_eq!(c.non_finite(), 0);
    }
}
