//! The per-chunk fold of the comparator, written to run at memory speed.
//!
//! Pairs are taken a row of `W` at a time by a branch-free loop over `W`
//! independent lanes (fixed-size arrays the compiler keeps in SIMD registers):
//! each lane has its own sums, mismatch count and greatest ULP distance,
//! combined in lane order at the end of the chunk, so a chunk's result depends
//! only on its data, never on the thread that folded it.
//!
//! Why f64 lanes, not f32: the squares and products behind NMSE and cosine are
//! *exact* in f64 (24 + 24 significand bits fit in 53, and even the smallest
//! f32 denormal squared is a normal f64), whereas in f32 they overflow above
//! 1.8e19 and vanish below 1e-19, which would turn the NMSE of a denormal-scale
//! tensor into 0/0; f32 partials per block would also cost cosine its last
//! digits. The allclose test, |a-e| and |a-e|/|e| must be the very f64 values
//! of the definition (they are reported and compared against tolerances), so
//! they are computed as it says: widen, subtract, multiply-then-add, divide.
//! The sums use fused multiply-adds: one instruction instead of two, and for
//! a², e² and a·e the same result as separate ones (the products are exact).
//!
//! Why portable lanes plus multiversioning rather than `std::arch`
//! intrinsics: the loop is written once, in plain Rust, and compiled three
//! times, for AVX-512, for AVX2 + FMA and for the baseline ISA, picked at run
//! time (laptops have AVX2, the machines here AVX-512). All three perform
//! the same IEEE operations in the same order, so they give bit-identical
//! results; only the register width differs (`W` = 8 f64 fills one AVX-512
//! register, two AVX2 ones; 16 was no faster on AVX-512 and spills on AVX2).
//! The baseline build on an x86 CPU without FMA (none made since 2013)
//! computes the fused sums in software: the same result, several times slower.
//!
//! Two things are kept off the per-element path:
//! - The greatest |a-e| and |a-e|/|e|: each row is *screened* against the
//!   chunk's maxima with a compare and a multiply, and only a row that may
//!   hold a new maximum goes to `Maxima::record`, which divides (see `row`).
//! - NaN and ±Inf: a non-finite value poisons its lane's Σa² or Σe², which
//!   costs nothing to notice. Such a chunk is folded again with those pairs
//!   zeroed out of every metric, then `screen_non_finite` counts them.

use super::Tolerance;
use crate::isa::Isa;

/// f64 lanes per row (see the module comment for why 8).
const W: usize = 8;

/// What one chunk contributes; indices are flat offsets into the whole tensor.
#[derive(Clone, Debug, Default, PartialEq)]
pub(super) struct Partial {
    pub nan_a: usize,
    pub inf_a: usize,
    pub nan_e: usize,
    pub inf_e: usize,
    pub first_nf: Option<usize>,
    pub mismatched: usize,
    pub max_abs: Option<(f64, usize)>,
    pub max_rel: Option<(f64, usize)>,
    pub max_ulp: u64,
    pub sum_d2: f64,
    pub sum_e2: f64,
    pub sum_a2: f64,
    pub sum_ae: f64,
}

/// Keeps the earlier candidate on ties: `new` must be strictly greater.
pub(super) fn keep_max(cur: &mut Option<(f64, usize)>, new: Option<(f64, usize)>) {
    if let Some((v, i)) = new {
        if cur.is_none_or(|(m, _)| v > m) {
            *cur = Some((v, i));
        }
    }
}

impl Partial {
    /// Folds a *later* chunk into this one; the order of calls fixes the result.
    pub(super) fn merge(mut self, later: Partial) -> Partial {
        self.nan_a += later.nan_a;
        self.inf_a += later.inf_a;
        self.nan_e += later.nan_e;
        self.inf_e += later.inf_e;
        self.first_nf = self.first_nf.or(later.first_nf);
        self.mismatched += later.mismatched;
        keep_max(&mut self.max_abs, later.max_abs);
        keep_max(&mut self.max_rel, later.max_rel);
        self.max_ulp = self.max_ulp.max(later.max_ulp);
        self.sum_d2 += later.sum_d2;
        self.sum_e2 += later.sum_e2;
        self.sum_a2 += later.sum_a2;
        self.sum_ae += later.sum_ae;
        self
    }
}

/// Folds one chunk (`a` and `e` of equal length; `base` is the flat index of
/// its first element) with the widest instruction set this CPU has.
pub(super) fn scan(a: &[f32], e: &[f32], base: usize, tol: Tolerance) -> Partial {
    // SAFETY: `best` is one of `available`.
    unsafe { scan_on(Isa::best(), a, e, base, tol) }
}

/// `scan` with a given variant.
///
/// # Safety
/// `isa` must be one of `Isa::available()`: the CPU must have its features.
unsafe fn scan_on(isa: Isa, a: &[f32], e: &[f32], base: usize, tol: Tolerance) -> Partial {
    debug_assert_eq!(a.len(), e.len());
    match isa {
        // SAFETY: the caller vouches for the features.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => unsafe { scan_avx512(a, e, base, tol) },
        // SAFETY: as above.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { scan_avx2(a, e, base, tol) },
        Isa::Baseline => scan_lanes(a, e, base, tol),
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512dq,avx512vl,avx512bw,avx2,fma")]
fn scan_avx512(a: &[f32], e: &[f32], base: usize, tol: Tolerance) -> Partial {
    scan_lanes(a, e, base, tol)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn scan_avx2(a: &[f32], e: &[f32], base: usize, tol: Tolerance) -> Partial {
    scan_lanes(a, e, base, tol)
}

/// Per-lane accumulators touched by every pair. Kept apart from `Maxima` so
/// that they never leave registers: only `Maxima` is handed to the
/// out-of-line `Maxima::record`.
struct Sums {
    mismatched: [u64; W],
    max_ulp: [u32; W],
    d2: [f64; W],
    e2: [f64; W],
    a2: [f64; W],
    ae: [f64; W],
}

/// The chunk's greatest |a-e| and |a-e|/|e| so far, with the flat index of
/// their first occurrence. They start at -1, below any real value (both are
/// ≥ 0): still -1 means no qualifying pair.
///
/// One maximum for the chunk, not one per lane: a pair that beats its own
/// lane but not the chunk cannot be the chunk's answer, and screening against
/// the larger value sends about ln(len) rows to `record`, not W·ln(len/W).
/// Pairs are visited in index order (rows in order, lanes in order within
/// `record`), so strictly-greater updates keep the first index of a tie.
struct Maxima {
    abs: f64,
    abs_at: u64,
    rel: f64,
    rel_at: u64,
    /// `rel · SCREEN`: the screen for a possible new relative maximum.
    rel_screen: f64,
}

/// Where an f32's bit pattern falls on a line that is monotone in its value
/// (sign-magnitude to two's complement), as `ulp_distance` defines it.
#[inline(always)]
fn ulp_key(bits: u32) -> i32 {
    let mag = (bits & 0x7fff_ffff) as i32;
    let neg = (bits as i32) >> 31; // 0 or -1
    (mag ^ neg) - neg
}

/// Whether pair `l` of a row whose first `n` pairs are real counts: padding
/// never does, nor, with `SANITIZE`, a pair with a NaN or ±Inf (exponent bits
/// all ones). For a full row `l < W` folds away.
#[inline(always)]
fn counts<const SANITIZE: bool>(l: usize, n: usize, x: f32, y: f32) -> bool {
    let finite = (x.to_bits() & 0x7f80_0000) != 0x7f80_0000 && (y.to_bits() & 0x7f80_0000) != 0x7f80_0000;
    l < n && (!SANITIZE || finite)
}

/// Just below 1, so that `max · SCREEN · |e|` stays below `max · |e|` despite
/// the two roundings of computing it (see `row`).
const SCREEN: f64 = 1.0 - 1.0 / (1u64 << 50) as f64;

impl Sums {
    fn new() -> Sums {
        Sums {
            mismatched: [0; W],
            max_ulp: [0; W],
            d2: [0.0; W],
            e2: [0.0; W],
            a2: [0.0; W],
            ae: [0.0; W],
        }
    }

    /// Whether a lane met NaN or ±Inf (without `SANITIZE`): an f32 squared is
    /// at most 1.2e77 in f64, so Σa² + Σe² of finite data never overflows.
    fn poisoned(&self) -> bool {
        (0..W).any(|l| !(self.a2[l] + self.e2[l]).is_finite())
    }
}

impl Maxima {
    fn new() -> Maxima {
        Maxima {
            abs: -1.0,
            abs_at: 0,
            rel: -1.0,
            rel_at: 0,
            rel_screen: -1.0,
        }
    }

    /// The exact maxima after a row that passed a screen in `row`, recomputed
    /// from the row's values. The quotients are formed for the whole row at
    /// once (vector divides), and lanes are visited one by one only when one
    /// of them truly beats a maximum: a screen passed on a tie (every pair at
    /// the same |a-e|/|e|, as when one side is all zeros) costs a row of
    /// divides, not a scalar walk.
    #[inline(never)]
    fn record<const SANITIZE: bool>(&mut self, xs: &[f32; W], ys: &[f32; W], n: usize, idx: u64) {
        let mut d = [-1f64; W];
        let mut q = [-1f64; W];
        let mut beats = false;
        for l in 0..W {
            let (x, y) = (xs[l], ys[l]);
            let real = counts::<SANITIZE>(l, n, x, y);
            let (xd, yd) = (x as f64, y as f64);
            let diff = (xd - yd).abs();
            d[l] = if real { diff } else { -1.0 };
            q[l] = if real & (y != 0.0) { diff / yd.abs() } else { -1.0 };
            beats |= (d[l] > self.abs) | (q[l] > self.rel);
        }
        if !beats {
            return;
        }
        for l in 0..W {
            if d[l] > self.abs {
                (self.abs, self.abs_at) = (d[l], idx + l as u64);
            }
            if q[l] > self.rel {
                (self.rel, self.rel_at) = (q[l], idx + l as u64);
            }
        }
        self.rel_screen = self.rel * SCREEN;
    }
}

/// Lane `l` takes pair `l` of a row of `W` (`n` ≤ `W` of them are real: the
/// last row of a chunk may be short), the first at flat index `idx`. Every
/// condition in the loop is a select, not a branch, so the loop is one SIMD
/// instruction sequence.
///
/// `SANITIZE` is for chunks known to hold NaN or ±Inf: such a pair is zeroed
/// and kept out of every metric (`screen_non_finite` accounts for it).
/// Without it a non-finite value poisons its lane's Σa² or Σe², which is how
/// `scan_lanes` notices one. Padding (zeros) adds nothing to the sums and is
/// kept out of the counts and maxima.
///
/// The greatest |a-e|/|e| would need a divide per element, the slowest
/// instruction here; instead each lane screens with a multiply,
/// `|a-e| > (max · SCREEN) · |e|`, which every quotient that beats `max`
/// passes: it means |a-e| > max·|e| exactly, the computed product is below
/// max·|e| even after rounding twice, and |a-e|, a difference of f32s, is 0
/// or at least 2^-149, so an underflowing product cannot hide it. A new greatest
/// |a-e| is screened by plain comparison. Only a row where some lane passes a
/// screen goes to `Maxima::record`, which divides.
#[inline(always)]
fn row<const SANITIZE: bool>(
    sums: &mut Sums,
    max: &mut Maxima,
    xs: &[f32; W],
    ys: &[f32; W],
    n: usize,
    idx: u64,
    tol: Tolerance,
) {
    let mut screen = false;
    for l in 0..W {
        let (x, y) = (xs[l], ys[l]);
        let real = counts::<SANITIZE>(l, n, x, y);
        let (x, y) = if real { (x, y) } else { (0.0, 0.0) };
        let (xd, yd) = (x as f64, y as f64);
        let d = (xd - yd).abs();
        let ey = yd.abs();
        sums.mismatched[l] += (real & (d > tol.atol + tol.rtol * ey)) as u64;
        screen |= real & (d > max.abs);
        screen |= real & (y != 0.0) & (d > max.rel_screen * ey);

        // Both keys lie within ±(2^31 - 2^23), so their distance fits a u32.
        let (kx, ky) = (ulp_key(x.to_bits()), ulp_key(y.to_bits()));
        let ulp = kx.max(ky).wrapping_sub(kx.min(ky)) as u32;
        sums.max_ulp[l] = sums.max_ulp[l].max(ulp);

        sums.d2[l] = d.mul_add(d, sums.d2[l]);
        sums.e2[l] = yd.mul_add(yd, sums.e2[l]);
        sums.a2[l] = xd.mul_add(xd, sums.a2[l]);
        sums.ae[l] = xd.mul_add(yd, sums.ae[l]);
    }
    if screen {
        max.record::<SANITIZE>(xs, ys, n, idx);
    }
}

/// Combines the lanes in lane order into a chunk's partial.
fn finish(sums: &Sums, max: &Maxima) -> Partial {
    let mut p = Partial::default();
    for l in 0..W {
        p.mismatched += sums.mismatched[l] as usize;
        p.max_ulp = p.max_ulp.max(sums.max_ulp[l] as u64);
        p.sum_d2 += sums.d2[l];
        p.sum_e2 += sums.e2[l];
        p.sum_a2 += sums.a2[l];
        p.sum_ae += sums.ae[l];
    }
    p.max_abs = (max.abs >= 0.0).then_some((max.abs, max.abs_at as usize));
    p.max_rel = (max.rel >= 0.0).then_some((max.rel, max.rel_at as usize));
    p
}

/// The fold itself. `#[inline(always)]` (as is everything it calls on the
/// per-row path) so each multiversioned caller gets its own copy compiled
/// with its target features.
#[inline(always)]
fn scan_lanes(a: &[f32], e: &[f32], base: usize, tol: Tolerance) -> Partial {
    let (sums, max) = fold_rows::<false>(a, e, base, tol);
    if !sums.poisoned() {
        return finish(&sums, &max);
    }
    let (sums, max) = fold_rows::<true>(a, e, base, tol);
    let mut p = finish(&sums, &max);
    screen_non_finite(a, e, base, &mut p);
    p
}

#[inline(always)]
fn fold_rows<const SANITIZE: bool>(a: &[f32], e: &[f32], base: usize, tol: Tolerance) -> (Sums, Maxima) {
    let (mut sums, mut max) = (Sums::new(), Maxima::new());
    let (ra, re) = (a.chunks_exact(W), e.chunks_exact(W));
    let (ta, te) = (ra.remainder(), re.remainder());
    let mut idx = base as u64;
    for (xa, ya) in ra.zip(re) {
        let (xa, ya) = (xa.try_into().expect("W values"), ya.try_into().expect("W values"));
        row::<SANITIZE>(&mut sums, &mut max, xa, ya, W, idx, tol);
        idx += W as u64;
    }
    if !ta.is_empty() {
        // The short last row goes to the first lanes, padded with zeros.
        let (mut xa, mut ya) = ([0f32; W], [0f32; W]);
        xa[..ta.len()].copy_from_slice(ta);
        ya[..te.len()].copy_from_slice(te);
        row::<SANITIZE>(&mut sums, &mut max, &xa, &ya, ta.len(), idx, tol);
    }
    (sums, max)
}

/// The slow path for a chunk holding NaN or ±Inf: counts them per side,
/// records the first, and counts a non-finite pair as a mismatch unless both
/// sides are the same infinity (`==` on floats: NaN equals nothing).
#[cold]
fn screen_non_finite(a: &[f32], e: &[f32], base: usize, p: &mut Partial) {
    for (i, (&x, &y)) in a.iter().zip(e).enumerate() {
        if x.is_finite() && y.is_finite() {
            continue;
        }
        p.nan_a += x.is_nan() as usize;
        p.inf_a += x.is_infinite() as usize;
        p.nan_e += y.is_nan() as usize;
        p.inf_e += y.is_infinite() as usize;
        p.first_nf.get_or_insert(base + i);
        p.mismatched += (x != y) as usize;
    }
}

#[cfg(test)]
mod tests;
