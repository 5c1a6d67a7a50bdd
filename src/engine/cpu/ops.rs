//! The elementwise and row-wise kernels of the CPU reference engine (RMSNorm,
//! RoPE, SiLU·up, residual add); projections go through `matmul`. Each kernel mirrors HF transformers' order of f32 operations,
//! so that the only remaining disagreement with HF goldens is GEMM summation
//! order (a few f32 ulps per stage): the CPU engine is the reference other
//! engines are judged against.

use crate::model::rope_scaling::RopeScaling;

/// RMSNorm of each `width`-wide row, as HF's `Qwen2RMSNorm`/`LlamaRMSNorm` in f32:
/// `variance = x.pow(2).mean(-1)`, `x = x * rsqrt(variance + eps)`, `w * x`.
/// Each square is rounded to f32 (as `x.pow(2)` materialises it), summed in
/// ATen's order (`torch_sum`), and divided by the width (torch's CPU `mean` is
/// `sum().div_(n)`); rsqrt is 1/sqrt, two roundings, as ATen computes it.
#[cfg(test)]
pub fn rmsnorm(x: &[f32], width: usize, w: &[f32], eps: f64) -> Vec<f32> {
    rmsnorm_over(x, width, w, eps, width)
}

/// `rmsnorm` with the sum of squares divided by `divisor` (the width, except
/// for a planted length bug in tests).
pub(crate) fn rmsnorm_over(x: &[f32], width: usize, w: &[f32], eps: f64, divisor: usize) -> Vec<f32> {
    assert_eq!(w.len(), width);
    let eps = eps as f32;
    let mut out = vec![0.0f32; x.len()];
    let mut sq = vec![0.0f32; width];
    for (row, o) in x.chunks_exact(width).zip(out.chunks_exact_mut(width)) {
        for (s, &v) in sq.iter_mut().zip(row) {
            *s = v * v;
        }
        let var = torch_sum(&sq) / divisor as f32;
        let r = 1.0f32 / (var + eps).sqrt();
        for ((o, &v), &g) in o.iter_mut().zip(row).zip(w) {
            *o = g * (v * r);
        }
    }
    out
}

/// Lanes of ATen's `Vectorized<float>` under AVX2, the capability HF goldens
/// are recorded with (checked: this order reproduces them bit for bit).
const LANES: usize = 8;
type Lanes = [f32; LANES];

/// The f32 sum of a contiguous row in the order of ATen's CPU `sum` kernel
/// (`vectorized_inner_sum` → `row_sum` → `multi_row_sum`): 8-lane vectors
/// summed as 4 interleaved accumulators with ATen's cascade levels, the
/// accumulators folded, the scalar tail summed, then the lanes added in
/// order. Any accurate sum would do for conformance; this one makes RMSNorm
/// agree with HF exactly instead of to the last bit or two.
pub fn torch_sum(x: &[f32]) -> f32 {
    const ILP: usize = 4;
    let nvec = x.len() / LANES;
    let vec_at = |v: usize| -> Lanes {
        let mut l = [0.0; LANES];
        l.copy_from_slice(&x[v * LANES..][..LANES]);
        l
    };
    let add = |a: &mut Lanes, b: &Lanes| a.iter_mut().zip(b).for_each(|(a, b)| *a += b);

    // multi_row_sum over `rows` rows of ILP vectors each.
    let rows = nvec / ILP;
    const LEVELS: usize = 4;
    let ceil_log2 = if rows > 1 {
        (usize::BITS - (rows - 1).leading_zeros()) as usize
    } else {
        0
    };
    let level_power = (ceil_log2 / LEVELS).max(4);
    let level_step = 1usize << level_power;
    let level_mask = level_step - 1;
    let mut acc = [[[0.0f32; LANES]; ILP]; LEVELS];
    let mut i = 0;
    while i + level_step <= rows {
        for _ in 0..level_step {
            for (k, a) in acc[0].iter_mut().enumerate() {
                add(a, &vec_at(i * ILP + k));
            }
            i += 1;
        }
        for j in 1..LEVELS {
            let (lo, hi) = acc.split_at_mut(j);
            for (upper, lower) in hi[0].iter_mut().zip(lo[j - 1].iter_mut()) {
                add(upper, lower);
                *lower = [0.0; LANES];
            }
            if i & (level_mask << (j * level_power)) != 0 {
                break;
            }
        }
    }
    for r in i..rows {
        for (k, a) in acc[0].iter_mut().enumerate() {
            add(a, &vec_at(r * ILP + k));
        }
    }
    for j in 1..LEVELS {
        let (lo, hi) = acc.split_at_mut(j);
        for (a0, upper) in lo[0].iter_mut().zip(hi[0].iter()) {
            add(a0, upper);
        }
    }
    // row_sum: leftover vectors into partial 0, then fold the partials.
    let mut partial = acc[0];
    for v in rows * ILP..nvec {
        add(&mut partial[0], &vec_at(v));
    }
    for k in 1..ILP {
        let p = partial[k];
        add(&mut partial[0], &p);
    }
    // vectorized_inner_sum: scalar tail first, then the lanes in order.
    let mut total = 0.0f32;
    for &v in &x[nvec * LANES..] {
        total += v;
    }
    for l in partial[0] {
        total += l;
    }
    total
}

/// NEOX (rotate-half) rotary embedding with HF's f32 arithmetic:
/// `inv_freq = 1 / base^(arange(0,D,2).float()/D)` in f32 (or a scaling's
/// frequencies, `RopeScaling::inv_freq_f32`), angle = inv_freq·pos in f32,
/// cos/sin of that f32 angle, each times the scaling's attention factor in
/// f32 (HF's `emb.cos() * attention_scaling`; 1 without scaling: exact).
#[derive(Clone, Debug)]
pub struct Rope {
    inv_freq: Vec<f32>,
    attn: f32,
}

impl Rope {
    pub fn new(head_dim: usize, theta: f64) -> Rope {
        let base = theta as f32;
        let inv_freq = (0..head_dim / 2)
            .map(|j| 1.0f32 / base.powf((2 * j) as f32 / head_dim as f32))
            .collect();
        Rope { inv_freq, attn: 1.0 }
    }

    /// The table of a pass reaching `seq_len` positions under `scaling`.
    pub fn scaled(head_dim: usize, theta: f64, scaling: Option<&RopeScaling>, seq_len: usize) -> Rope {
        match scaling {
            None => Rope::new(head_dim, theta),
            Some(s) => Rope {
                inv_freq: s.inv_freq_f32(head_dim, theta, seq_len),
                attn: s.attention_factor() as f32,
            },
        }
    }

    /// A table from its parts (the planted scaling bugs of tests).
    pub(crate) fn from_parts(inv_freq: Vec<f32>, attn: f32) -> Rope {
        Rope { inv_freq, attn }
    }

    pub fn head_dim(&self) -> usize {
        self.inv_freq.len() * 2
    }

    /// The D/2 f32 frequencies (the CUDA engine's M-RoPE kernel reads them).
    pub fn inv_freq(&self) -> &[f32] {
        &self.inv_freq
    }

    /// cos and sin (each D/2 wide; HF's second half repeats the first) at `pos`.
    pub(crate) fn cos_sin(&self, pos: usize) -> (Vec<f32>, Vec<f32>) {
        let p = pos as f32;
        self.inv_freq
            .iter()
            .map(|&f| {
                let a = f * p;
                // Evaluated in f64 and rounded: correctly rounded f32 cos/sin,
                // within torch's own 1-ulp vectorised results.
                ((a as f64).cos() as f32 * self.attn, (a as f64).sin() as f32 * self.attn)
            })
            .unzip()
    }

    /// Rotates `x` laid out `[T, heads, D]` in place; row t is at `positions[t]`.
    /// out[j] = x[j]·cos − x[j+D/2]·sin; out[j+D/2] = x[j+D/2]·cos + x[j]·sin,
    /// each product rounded separately as torch's `q*cos + rotate_half(q)*sin`.
    pub fn apply(&self, x: &mut [f32], heads: usize, positions: &[usize]) {
        let d = self.head_dim();
        let half = d / 2;
        assert_eq!(x.len(), positions.len() * heads * d);
        for (row, &pos) in x.chunks_exact_mut(heads * d).zip(positions) {
            let (cos, sin) = self.cos_sin(pos);
            for head in row.chunks_exact_mut(d) {
                for j in 0..half {
                    let (a, b) = (head[j], head[j + half]);
                    head[j] = a * cos[j] - b * sin[j];
                    head[j + half] = b * cos[j] + a * sin[j];
                }
            }
        }
    }
}

impl Rope {
    /// M-RoPE: rotates `x` `[T, heads, D]` in place where row t's frequency j
    /// turns by `pos[axes[j]][t]` (HF's `recomposition_frequencies`: the t, h
    /// and w position ids share the D/2 frequencies by `MRope::axis_of`).
    pub fn apply_axes(&self, x: &mut [f32], heads: usize, pos: &[Vec<i64>; 3], axes: &[usize]) {
        let d = self.head_dim();
        let half = d / 2;
        assert_eq!(axes.len(), half);
        assert_eq!(x.len(), pos[0].len() * heads * d);
        for (t, row) in x.chunks_exact_mut(heads * d).enumerate() {
            let (cos, sin): (Vec<f32>, Vec<f32>) = (0..half)
                .map(|j| {
                    let a = self.inv_freq[j] * pos[axes[j]][t] as f32;
                    ((a as f64).cos() as f32 * self.attn, (a as f64).sin() as f32 * self.attn)
                })
                .unzip();
            for head in row.chunks_exact_mut(d) {
                for j in 0..half {
                    let (a, b) = (head[j], head[j + half]);
                    head[j] = a * cos[j] - b * sin[j];
                    head[j + half] = b * cos[j] + a * sin[j];
                }
            }
        }
    }
}

/// torch's f32 SiLU: `x / (1 + exp(-x))`.
pub fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// SwiGLU activation `silu(gate) * up`, elementwise.
pub fn silu_mul(gate: &[f32], up: &[f32]) -> Vec<f32> {
    gate.iter().zip(up).map(|(&g, &u)| silu(g) * u).collect()
}

/// torch's f32 GELU-tanh (`gelu_pytorch_tanh`), in its order of operations:
/// x³ = x·x·x, inner = β·(x + κ·x³) with β = √(2/π), then ½·x·(1 + tanh(inner)).
pub fn gelu_tanh(x: f32) -> f32 {
    const BETA: f32 = (std::f64::consts::SQRT_2 * std::f64::consts::FRAC_2_SQRT_PI * 0.5) as f32;
    const KAPPA: f32 = 0.044715;
    let inner = BETA * (x + KAPPA * (x * x * x));
    0.5 * x * (1.0 + inner.tanh())
}

/// gpt-oss's clamped SwiGLU in HF's f32 order: g = min(gate, limit),
/// u = clamp(up, −limit, limit), glu = g·σ(g·α), then (u + 1)·glu.
pub fn clamped_swiglu(g: f32, u: f32, alpha: f32, limit: f32) -> f32 {
    let g = g.min(limit);
    let u = u.clamp(-limit, limit);
    let glu = g * (1.0 / (1.0 + (-(g * alpha)).exp()));
    (u + 1.0) * glu
}

/// The MLP's gated activation `act(gate) * up`, elementwise.
pub fn act_mul(act: crate::model::config::Activation, gate: &[f32], up: &[f32]) -> Vec<f32> {
    use crate::model::config::Activation;
    match act {
        Activation::Silu => silu_mul(gate, up),
        Activation::GeluTanh => gate.iter().zip(up).map(|(&g, &u)| gelu_tanh(g) * u).collect(),
        Activation::ClampedSwiglu { alpha, limit } => {
            gate.iter().zip(up).map(|(&g, &u)| clamped_swiglu(g, u, alpha, limit)).collect()
        }
    }
}

/// The RoPE table of each layer: the model's, and the local layers' own
/// when the model has them (Gemma 3).
#[derive(Clone, Debug)]
pub struct LayerRopes {
    pub global: Rope,
    /// Local layers' table, and which layers are local.
    pub local: Option<(Rope, Vec<bool>)>,
    /// The model's scaling when its table depends on the pass's length
    /// (dynamic NTK, LongRoPE), with what building another table needs.
    varies: Option<(RopeScaling, usize, f64)>,
}

impl LayerRopes {
    /// The tables of a pass that stays within the model's original context.
    pub fn new(cfg: &crate::model::ModelConfig) -> LayerRopes {
        let scaling = cfg.rope_scaling.as_ref();
        LayerRopes {
            global: Rope::scaled(cfg.rope_dim(), cfg.rope_theta, scaling, 0),
            local: cfg.local.as_ref().and_then(|l| {
                l.rope_theta
                    .map(|t| (Rope::new(cfg.rope_dim(), t), l.layers.clone()))
            }),
            varies: scaling
                .filter(|s| s.switch_after().is_some())
                .map(|s| (s.clone(), cfg.rope_dim(), cfg.rope_theta)),
        }
    }
    /// Layer `l`'s table.
    pub fn of(&self, l: usize) -> &Rope {
        match &self.local {
            Some((r, layers)) if layers.get(l) == Some(&true) => r,
            _ => &self.global,
        }
    }
    /// The tables of a pass reaching `seq_len` positions (its last
    /// position + 1), when they differ from `self`'s (HF's
    /// `dynamic_rope_update`); None: `self`'s apply.
    pub fn for_pass(&self, seq_len: usize) -> Option<LayerRopes> {
        let (s, d, theta) = self.varies.as_ref()?;
        (s.table_key(seq_len) != 0).then(|| LayerRopes {
            global: Rope::scaled(*d, *theta, Some(s), seq_len),
            local: self.local.clone(),
            varies: None,
        })
    }
    /// A copy with every table replaced (the planted RoPE bugs of tests).
    pub(crate) fn replaced(&self, global: Rope) -> LayerRopes {
        LayerRopes {
            local: self.local.as_ref().map(|(_, layers)| (global.clone(), layers.clone())),
            global,
            varies: None,
        }
    }
}

/// `a + b`, elementwise (residual adds).
pub fn add(a: &[f32], b: &[f32]) -> Vec<f32> {
    a.iter().zip(b).map(|(&x, &y)| x + y).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rmsnorm_matches_hand_computation() {
        // x = [1, 2, 3, 4]: mean(x²) = 7.5; eps = 0.5 → r = 1/sqrt(8) .
        let x = [1.0f32, 2.0, 3.0, 4.0];
        let w = [1.0f32, 0.5, 2.0, -1.0];
        let y = rmsnorm(&x, 4, &w, 0.5);
        let r = 1.0 / 8.0f64.sqrt();
        let want = [1.0 * r, 0.5 * 2.0 * r, 2.0 * 3.0 * r, -4.0 * r];
        for (a, b) in y.iter().zip(want) {
            assert!((*a as f64 - b).abs() < 1e-7, "{a} vs {b}");
        }
        // Two rows are normalised independently.
        let y2 = rmsnorm(&[1.0, 2.0, 3.0, 4.0, 10.0, 0.0, 0.0, 0.0], 4, &[1.0; 4], 0.0);
        assert!((y2[4] - 2.0).abs() < 1e-6, "10/sqrt(25) = 2, got {}", y2[4]);
    }

    #[test]
    fn rope_at_position_zero_is_identity_and_preserves_pair_norms() {
        let rope = Rope::new(8, 10000.0);
        let x: Vec<f32> = (0..2 * 3 * 8).map(|i| (i as f32 * 0.37).sin()).collect();
        let mut y = x.clone();
        rope.apply(&mut y, 3, &[0, 5]);
        assert_eq!(&y[..24], &x[..24], "position 0 must not rotate");
        assert_ne!(&y[24..], &x[24..], "position 5 must rotate");
        for h in 0..3 {
            let (xh, yh) = (&x[24 + h * 8..32 + h * 8], &y[24 + h * 8..32 + h * 8]);
            for j in 0..4 {
                let n0 = xh[j].hypot(xh[j + 4]);
                let n1 = yh[j].hypot(yh[j + 4]);
                assert!((n0 - n1).abs() < 1e-6, "pair ({j},{}) norm {n0} -> {n1}", j + 4);
            }
        }
        // j = 0 has inv_freq 1: the first pair turns by exactly `pos` radians.
        let (c, s) = (5.0f64.cos() as f32, 5.0f64.sin() as f32);
        assert!((y[24] - (x[24] * c - x[28] * s)).abs() < 1e-7);
    }

    #[test]
    fn torch_sum_is_an_accurate_sum_at_every_length() {
        for n in [0, 1, 7, 8, 31, 64, 100, 513, 896, 4096, 20_000] {
            let x: Vec<f32> = (0..n).map(|i| ((i * 7919 % 1000) as f32) * 1e-3 + 0.5).collect();
            let exact: f64 = x.iter().map(|&v| v as f64).sum();
            let got = torch_sum(&x) as f64;
            assert!(
                (got - exact).abs() <= 1e-6 * exact.abs().max(1.0),
                "n={n}: {got} vs {exact}"
            );
        }
        // 64 values: 4 accumulators × 8 lanes, folded, then lanes in order.
        let x: Vec<f32> = (0..64).map(|i| 1.0 + i as f32 * 1e-7).collect();
        let mut acc = [0.0f32; 32];
        for (i, v) in x.iter().enumerate() {
            acc[i % 32] += v;
        }
        let mut lanes = [0.0f32; 8];
        for j in 0..4 {
            for l in 0..8 {
                lanes[l] += acc[j * 8 + l];
            }
        }
        assert_eq!(torch_sum(&x), lanes.iter().fold(0.0, |a, b| a + b));
    }

    #[test]
    fn silu_values() {
        assert_eq!(silu(0.0), 0.0);
        assert!((silu(1.0) - 0.731_058_6).abs() < 1e-6);
        assert_eq!(silu_mul(&[0.0, 1.0], &[5.0, 2.0])[0], 0.0);
    }
}
