//! The emulated kernels against the CPU engine (bitwise where the CUDA code
//! claims bitwise parity, within a derived bound where only the summation
//! order differs), at f32, f16 and bf16 storage; and planted kernel bugs,
//! each caught.

use super::*;
use crate::engine::cpu::attention::{attend, AttnShape};
use crate::engine::cpu::mutants::Mutants;
use crate::engine::cpu::ops;
use crate::engine::cuda::storage::Storage;
use crate::engine::cuda::{compile, launch, reference};
use crate::sampling;
use half::{bf16, f16};

const U: f64 = f32::EPSILON as f64 / 2.0; // unit roundoff of f32

/// Deterministic values in [-scale, scale).
pub(crate) fn data(n: usize, seed: u64, scale: f32) -> Vec<f32> {
    let mut s = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
        })
        .collect()
}

/// Values representable in storage S (what the device holds), widened.
fn stored<S: Storage>(x: &[f32]) -> (Vec<S>, Vec<f32>) {
    let s: Vec<S> = x.iter().map(|&v| S::from_f32(v)).collect();
    let w = s.iter().map(|v| v.to_f32()).collect();
    (s, w)
}

fn bits_eq<S: Storage>(a: &[S], b: &[S]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.bits() == y.bits())
}

/// Distance in units in the last place of S between two values of S.
fn ulps<S: Storage>(a: S, b: S) -> u32 {
    let ord = |v: S| -> i64 {
        let (bits, sign) = match S::DTYPE {
            crate::tensor::DType::F32 => (v.bits() as i64, 1i64 << 31),
            _ => (v.bits() as i64, 1i64 << 15),
        };
        if bits & sign != 0 {
            -(bits & (sign - 1))
        } else {
            bits
        }
    };
    (ord(a) - ord(b)).unsigned_abs() as u32
}

fn emu_kernel<S: Storage>(family: &str) -> String {
    format!("{family}_{}", S::SUFFIX)
}

#[test]
fn every_kernel_of_compile_rs_is_emulated_with_a_signature() {
    let names: HashMap<String, String> = kernel_names().into_iter().collect();
    for f in compile::FILES {
        for k in f.kernels {
            let sig = names
                .get(*k)
                .unwrap_or_else(|| panic!("{k} ({}) is not emulated", f.name));
            assert!(!sig.is_empty(), "{k}");
        }
    }
    assert_eq!(names["rmsnorm_bf16"], "*const bf16, *const bf16, *mut bf16, i32, f32");
    assert_eq!(
        names["attention_decode_f16"],
        "*const f16, *const f16, *const f16, *mut f32, *mut f32, *mut f16, i32, i32, i32, i32, i32, f32"
    );
    for v in [
        "planted_softmax_max",
        "planted_gqa_modulo",
        "planted_rope_pair",
        "planted_oob_store",
    ] {
        assert!(names.keys().any(|k| k.starts_with(&format!("{v}/"))), "{v}");
    }
}

#[test]
fn conversions_round_as_the_device() {
    // f16 -> f32: every f16, exactly as `half` (NaN: quiet, payload kept).
    for h in 0..=u16::MAX {
        let (e, r) = (emu_f16_to_f32(h), f16::from_bits(h).to_f32());
        assert!(e.to_bits() == r.to_bits(), "{h:#06x}: {e:e} vs {r:e}");
    }
    // f32 -> f16: round to nearest even; every exponent and sign with the
    // mantissa patterns around each rounding boundary, plus a stride over all.
    let check = |u: u32| {
        let x = f32::from_bits(u);
        let (e, r) = (emu_f32_to_f16(x), f16::from_f32(x).to_bits());
        if x.is_nan() {
            assert_eq!(e, 0x7fff, "{u:#010x}: NaN is canonical on the device");
        } else {
            assert_eq!(e, r, "{u:#010x} ({x:e})");
        }
    };
    for hi in 0..(1u32 << 19) {
        for lo in [0u32, 1, 0xfff, 0x1000, 0x1001, 0x1fff] {
            check(hi << 13 | lo);
        }
    }
    for u in (0..=u32::MAX).step_by(997) {
        check(u);
    }
}

#[test]
fn embedding_is_a_bitwise_gather() {
    fn run<S: Storage + EmuType>() {
        let (v, e) = (11, 37);
        let (table, _) = stored::<S>(&data(v * e, 1, 2.0));
        let tokens: Vec<u32> = vec![3, 0, 10, 3, 7];
        let emu = Emu::new();
        let (tb, tk, out) = (
            emu.upload("table", &table),
            emu.upload("tokens", &tokens),
            emu.alloc::<S>("out", 5 * e),
        );
        let args = [tb.arg(), tk.arg(), out.arg(), 5i32.into(), (e as i32).into()];
        emu.launch(&emu_kernel::<S>("embedding"), launch::elementwise(5 * e).into(), &args)
            .unwrap();
        let want: Vec<S> = tokens
            .iter()
            .flat_map(|&t| table[t as usize * e..][..e].to_vec())
            .collect();
        assert!(bits_eq(&out.to_vec(), &want), "embedding_{}", S::SUFFIX);
    }
    run::<f32>();
    run::<f16>();
    run::<bf16>();
}

#[test]
fn rmsnorm_matches_the_cpu_engine_within_the_summation_order() {
    // Only the order of the sum of squares differs. For n positive terms any
    // order is within (n-1)u relative of the exact sum; var, +eps, sqrt, 1/x
    // and the two products add at most 5u; 1/sqrt halves the sum's error.
    // So |kernel - cpu| <= ((n-1)u + 8u) |cpu| at f32, and at 16-bit storage
    // (one rounding of each f32 result) the two differ by at most 1 ulp.
    fn run<S: Storage + EmuType>(width: usize, rows: usize) -> f64 {
        let (x, xw) = stored::<S>(&data(rows * width, 2, 3.0));
        let (w, ww) = stored::<S>(&data(width, 3, 1.5));
        let cpu = ops::rmsnorm_over(&xw, width, &ww, 1e-6, width);
        let emu = Emu::new();
        let (xb, wb, ob) = (
            emu.upload("x", &x),
            emu.upload("w", &w),
            emu.alloc::<S>("out", rows * width),
        );
        let args = [xb.arg(), wb.arg(), ob.arg(), (width as i32).into(), 1e-6f32.into()];
        emu.launch(&emu_kernel::<S>("rmsnorm"), launch::per_row(rows, width).into(), &args)
            .unwrap();
        let got = ob.to_vec();
        let mut worst = 0.0f64;
        for (i, (&g, &c)) in got.iter().zip(&cpu).enumerate() {
            if S::DTYPE == crate::tensor::DType::F32 {
                let (g, c) = (g.to_f32() as f64, c as f64);
                let bound = ((width - 1) as f64 * U + 8.0 * U) * c.abs();
                assert!(
                    (g - c).abs() <= bound,
                    "rmsnorm_f32 w={width} [{i}]: {g:e} vs {c:e} (bound {bound:e})"
                );
                worst = worst.max((g - c).abs() / c.abs().max(1e-30));
            } else {
                let d = ulps(g, S::from_f32(c));
                assert!(d <= 1, "rmsnorm_{} w={width} [{i}]: {d} ulps", S::SUFFIX);
                worst = worst.max(d as f64);
            }
        }
        worst
    }
    for width in [1, 7, 64, 300, 1000] {
        eprintln!("rmsnorm f32 width {width}: max rel err {:e}", run::<f32>(width, 3));
        eprintln!("rmsnorm f16 width {width}: max ulps {}", run::<f16>(width, 3));
        eprintln!("rmsnorm bf16 width {width}: max ulps {}", run::<bf16>(width, 3));
    }
}

/// cos/sin tables [positions, D/2] from the CPU engine's own Rope.
fn rope_tables(rope: &ops::Rope, positions: usize) -> (Vec<f32>, Vec<f32>) {
    let (mut c, mut s) = (Vec::new(), Vec::new());
    for p in 0..positions {
        let (cp, sp) = rope.cos_sin(p);
        c.extend(cp);
        s.extend(sp);
    }
    (c, s)
}

/// Runs rope `kernel` over x [rows, heads, D] at positions pos0.. and returns out.
fn run_rope<S: Storage + EmuType>(kernel: &str, x: &[S], rows: usize, heads: usize, d: usize, pos0: usize) -> Vec<S> {
    let rope = ops::Rope::new(d, 10000.0);
    let (cos, sin) = rope_tables(&rope, pos0 + rows);
    let emu = Emu::new();
    let (xb, ob) = (emu.upload("x", x), emu.alloc::<S>("out", x.len()));
    let (cb, sb) = (emu.upload("cos", &cos), emu.upload("sin", &sin));
    let args = [
        xb.arg(),
        ob.arg(),
        cb.arg(),
        sb.arg(),
        (rows as i32).into(),
        (heads as i32).into(),
        (d as i32).into(),
        (pos0 as i32).into(),
    ];
    emu.launch(kernel, launch::elementwise(rows * heads * d / 2).into(), &args)
        .unwrap();
    ob.to_vec()
}

/// The CPU engine's RoPE of x (stored as S) at positions pos0.., rounded to S.
fn cpu_rope<S: Storage>(xw: &[f32], rows: usize, heads: usize, d: usize, pos0: usize) -> Vec<S> {
    let mut y = xw.to_vec();
    ops::Rope::new(d, 10000.0).apply(&mut y, heads, &(pos0..pos0 + rows).collect::<Vec<_>>());
    y.iter().map(|&v| S::from_f32(v)).collect()
}

#[test]
fn rope_is_bitwise_the_cpu_engines() {
    fn run<S: Storage + EmuType>() {
        let (rows, heads, d, pos0) = (5, 3, 16, 4);
        let (x, xw) = stored::<S>(&data(rows * heads * d, 4, 2.0));
        let got = run_rope::<S>(&emu_kernel::<S>("rope_neox"), &x, rows, heads, d, pos0);
        assert!(
            bits_eq(&got, &cpu_rope::<S>(&xw, rows, heads, d, pos0)),
            "rope_neox_{}",
            S::SUFFIX
        );
        // Interleaved pairs (2j, 2j+1) = NEOX pairs (j, j + D/2) of the
        // de-interleaved head: permute in, run, permute back.
        let half = d / 2;
        let perm = |v: &[S], inv: bool| -> Vec<S> {
            let mut o = v.to_vec();
            for (h, (src, dst)) in v.chunks(d).zip(o.chunks_mut(d)).enumerate() {
                let _ = h;
                for j in 0..half {
                    if inv {
                        dst[j] = src[2 * j];
                        dst[j + half] = src[2 * j + 1];
                    } else {
                        dst[2 * j] = src[j];
                        dst[2 * j + 1] = src[j + half];
                    }
                }
            }
            o
        };
        let got = run_rope::<S>(
            &emu_kernel::<S>("rope_interleaved"),
            &perm(&x, false),
            rows,
            heads,
            d,
            pos0,
        );
        assert!(
            bits_eq(&perm(&got, true), &cpu_rope::<S>(&xw, rows, heads, d, pos0)),
            "rope_interleaved_{}",
            S::SUFFIX
        );
    }
    run::<f32>();
    run::<f16>();
    run::<bf16>();
}

#[test]
fn elementwise_kernels_are_bitwise_the_cpu_engines() {
    fn run<S: Storage + EmuType>() {
        let (rows, cols) = (7, 45);
        let n = rows * cols;
        let (a, aw) = stored::<S>(&data(n, 5, 4.0));
        let (b, bw) = stored::<S>(&data(n, 6, 4.0));
        let (bias, biasw) = stored::<S>(&data(cols, 7, 1.0));
        let emu = Emu::new();
        let round = |v: Vec<f32>| -> Vec<S> { v.iter().map(|&x| S::from_f32(x)).collect() };
        let (ab, bb) = (emu.upload("a", &a), emu.upload("b", &b));
        let cfg: LaunchConfig = launch::elementwise(n).into();
        // add
        let out = emu.alloc::<S>("out", n);
        emu.launch(
            &emu_kernel::<S>("add"),
            cfg,
            &[ab.arg(), bb.arg(), out.arg(), (n as i64).into()],
        )
        .unwrap();
        assert!(bits_eq(&out.to_vec(), &round(ops::add(&aw, &bw))), "add_{}", S::SUFFIX);
        // silu_mul (the same libm expf on both sides)
        emu.launch(
            &emu_kernel::<S>("silu_mul"),
            cfg,
            &[ab.arg(), bb.arg(), out.arg(), (n as i64).into()],
        )
        .unwrap();
        assert!(
            bits_eq(&out.to_vec(), &round(ops::silu_mul(&aw, &bw))),
            "silu_mul_{}",
            S::SUFFIX
        );
        // bias_add, in place (CPU: Linear::forward's `*v += bb` per row)
        let y = emu.upload("y", &a);
        let bias_b = emu.upload("bias", &bias);
        emu.launch(
            &emu_kernel::<S>("bias_add"),
            cfg,
            &[y.arg(), bias_b.arg(), (rows as i32).into(), (cols as i32).into()],
        )
        .unwrap();
        let want: Vec<f32> = aw.iter().enumerate().map(|(i, &v)| v + biasw[i % cols]).collect();
        assert!(bits_eq(&y.to_vec(), &round(want)), "bias_add_{}", S::SUFFIX);
    }
    run::<f32>();
    run::<f16>();
    run::<bf16>();
    // The guard fills.
    let emu = Emu::new();
    let (w, h) = (emu.alloc::<u32>("w", 1000), emu.alloc::<u16>("h", 999));
    let cfg: LaunchConfig = launch::elementwise(1000).into();
    emu.launch("fill_u32", cfg, &[w.arg(), 0x7fba_d5edu32.into(), 1000i64.into()])
        .unwrap();
    emu.launch("fill_u16", cfg, &[h.arg(), 0x7d5eu16.into(), 999i64.into()])
        .unwrap();
    assert!(w.to_vec().iter().all(|&v| v == 0x7fba_d5ed) && h.to_vec().iter().all(|&v| v == 0x7d5e));
}

struct AttnCase {
    t: usize,
    pos0: usize,
    heads: usize,
    kv: usize,
    d: usize,
}

struct AttnOut<S> {
    ctx: Vec<S>,
    probs: Vec<f32>,
    scores: Vec<f32>,
}

/// q [T,H,D], k/v caches [S,KV,D] (S = pos0 + T), stored as S.
fn attn_inputs<S: Storage>(c: &AttnCase, seed: u64) -> [(Vec<S>, Vec<f32>); 3] {
    let s = c.pos0 + c.t;
    [
        stored::<S>(&data(c.t * c.heads * c.d, seed, 1.5)),
        stored::<S>(&data(s * c.kv * c.d, seed + 1, 1.5)),
        stored::<S>(&data(s * c.kv * c.d, seed + 2, 2.0)),
    ]
}

/// Runs `kernel` (prefill, or decode when T = 1 and the name says so).
fn run_attention<S: Storage + EmuType>(kernel: &str, c: &AttnCase, q: &[S], k: &[S], v: &[S]) -> AttnOut<S> {
    let s = c.pos0 + c.t;
    let emu = Emu::new();
    let (qb, kb, vb) = (emu.upload("q", q), emu.upload("k_cache", k), emu.upload("v_cache", v));
    let sb = emu.alloc::<f32>("scores", c.heads * c.t * s);
    let pb = emu.alloc::<f32>("probs", c.heads * c.t * s);
    let cb = emu.alloc::<S>("ctx", c.t * c.heads * c.d);
    let scale = (c.d as f64).powf(-0.5) as f32;
    let decode = kernel.contains("decode");
    let mut args = vec![qb.arg(), kb.arg(), vb.arg(), sb.arg(), pb.arg(), cb.arg()];
    if !decode {
        args.push((c.t as i32).into());
    }
    for x in [c.heads, c.kv, c.d, c.pos0, s] {
        args.push((x as i32).into());
    }
    args.push(scale.into());
    let mut cfg: LaunchConfig = launch::attention(c.t, c.heads, c.d, s).unwrap().into();
    if decode {
        cfg.grid = (c.heads as u32, 1, 1);
    }
    emu.launch(kernel, cfg, &args).unwrap();
    AttnOut {
        ctx: cb.to_vec(),
        probs: pb.to_vec(),
        scores: sb.to_vec(),
    }
}

/// Derived bounds: the kernel and the CPU differ only in the order of the
/// D-term dot products (|Δscore| <= D u Σ|q_i k_i| scale, plus the scale's
/// rounding), the S-term softmax sum and the S-term ctx sum (expf is the same
/// libm function on both sides). A score error δ moves p_j by at most
/// 2 max δ relatively (x - max and the sum), the sum adds S u, the 1/sum and
/// product 2u: |Δp_j| <= (2δ + (S + 3) u) p_j. ctx = Σ p_j v_j: the order adds
/// S u Σ p_j |v_j| and the probability errors Σ |Δp_j| |v_j|.
/// Returns the worst (|Δ|/bound) seen, asserting it is <= 1; at 16-bit storage
/// ctx is compared within 1 ulp of S instead (one rounding of each f32 result).
fn compare_attention<S: Storage>(
    c: &AttnCase,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    got: &AttnOut<S>,
) -> Vec<(usize, usize)> {
    let s = c.pos0 + c.t;
    let shape = AttnShape {
        heads: c.heads,
        kv_heads: c.kv,
        head_dim: c.d,
        mutants: Mutants::default(),
    };
    let cpu = attend(q, c.t, c.pos0, k, v, shape, true);
    let cpu_scores = cpu.scores.unwrap();
    let scale = (c.d as f64).powf(-0.5);
    let kv_row = c.kv * c.d;
    let mut bad = Vec::new(); // (head, row) of mismatching outputs
    for h in 0..c.heads {
        let kvh = h / (c.heads / c.kv);
        for t in 0..c.t {
            let qrow = &q[(t * c.heads + h) * c.d..][..c.d];
            let visible = c.pos0 + t + 1;
            let at = (h * c.t + t) * s;
            let mut delta: f64 = 0.0;
            let mut ok = true;
            for j in 0..s {
                let mag: f64 = qrow
                    .iter()
                    .zip(&k[j * kv_row + kvh * c.d..][..c.d])
                    .map(|(a, b)| (a * b).abs() as f64)
                    .sum();
                let ds = (c.d as f64 * U * mag + 2.0 * U * mag) * scale;
                delta = delta.max(ds);
                if j < visible && (got.scores[at + j] as f64 - cpu_scores[at + j] as f64).abs() > ds + 1e-30 {
                    ok = false;
                }
                if j >= visible && (got.scores[at + j] != 0.0 || got.probs[at + j] != 0.0) {
                    ok = false;
                }
            }
            let mut dp = vec![0.0f64; s];
            for (j, d) in dp.iter_mut().enumerate().take(visible) {
                let p = cpu.probs[at + j] as f64;
                *d = (2.0 * delta + (s as f64 + 3.0) * U) * p + 1e-30;
                if (got.probs[at + j] as f64 - p).abs() > *d {
                    ok = false;
                }
            }
            let crow = (t * c.heads + h) * c.d;
            for i in 0..c.d {
                let (mut mass, mut perr) = (0.0f64, 0.0f64);
                for j in 0..visible {
                    let vj = (v[j * kv_row + kvh * c.d + i] as f64).abs();
                    mass += cpu.probs[at + j] as f64 * vj;
                    perr += dp[j] * vj;
                }
                let bound = s as f64 * U * mass + perr + 1e-30;
                let (g, r) = (got.ctx[crow + i], cpu.ctx[crow + i]);
                if S::DTYPE == crate::tensor::DType::F32 {
                    if (g.to_f32() as f64 - r as f64).abs() > bound {
                        ok = false;
                    }
                } else if ulps(g, S::from_f32(r)) > 1 {
                    ok = false;
                }
            }
            if !ok {
                bad.push((h, t));
            }
        }
    }
    bad
}

const ATTN_CASES: [AttnCase; 3] = [
    AttnCase {
        t: 5,
        pos0: 3,
        heads: 4,
        kv: 2,
        d: 16,
    },
    AttnCase {
        t: 3,
        pos0: 150,
        heads: 6,
        kv: 2,
        d: 8,
    }, // S > blockDim
    AttnCase {
        t: 2,
        pos0: 0,
        heads: 2,
        kv: 2,
        d: 136,
    }, // D > blockDim
];

#[test]
fn attention_prefill_and_decode_match_the_cpu_engine() {
    fn run<S: Storage + EmuType>() {
        for (ci, c) in ATTN_CASES.iter().enumerate() {
            let [(q, qw), (k, kw), (v, vw)] = attn_inputs::<S>(c, 10 + ci as u64);
            let got = run_attention::<S>(&emu_kernel::<S>("attention_prefill"), c, &q, &k, &v);
            let bad = compare_attention::<S>(c, &qw, &kw, &vw, &got);
            assert!(
                bad.is_empty(),
                "attention_prefill_{} case {ci}: (head, row) {bad:?} outside the bound",
                S::SUFFIX
            );
            {
                let shape = AttnShape {
                    heads: c.heads,
                    kv_heads: c.kv,
                    head_dim: c.d,
                    mutants: Mutants::default(),
                };
                let cpu = attend(&qw, c.t, c.pos0, &kw, &vw, shape, false);
                let rel = |g: &[f32], r: &[f32]| {
                    let m = r.iter().fold(0.0f32, |a, &b| a.max(b.abs()));
                    g.iter().zip(r).fold(0.0f32, |a, (x, y)| a.max((x - y).abs())) / m
                };
                let ctx: Vec<f32> = got.ctx.iter().map(|v| v.to_f32()).collect();
                eprintln!(
                    "attention_prefill_{} case {ci}: max|d|/max|ref| ctx {:e}, probs {:e}",
                    S::SUFFIX,
                    rel(&ctx, &cpu.ctx),
                    rel(&got.probs, &cpu.probs)
                );
            }
            // Decode of the last row: one query at position pos0 + T - 1, the
            // same bits as that prefill row.
            let last = AttnCase {
                t: 1,
                pos0: c.pos0 + c.t - 1,
                ..*c
            };
            let qd = &q[(c.t - 1) * c.heads * c.d..];
            let dec = run_attention::<S>(&emu_kernel::<S>("attention_decode"), &last, qd, &k, &v);
            let bad = compare_attention::<S>(&last, &qw[(c.t - 1) * c.heads * c.d..], &kw, &vw, &dec);
            assert!(
                bad.is_empty(),
                "attention_decode_{} case {ci}: heads {bad:?} outside the bound",
                S::SUFFIX
            );
            assert!(
                bits_eq(&dec.ctx, &got.ctx[(c.t - 1) * c.heads * c.d..]),
                "decode ctx = last prefill row"
            );
        }
    }
    run::<f32>();
    run::<f16>();
    run::<bf16>();
}

/// Rows with NaN, ±inf, ties and ±0, at lengths around the block size.
fn logit_rows() -> Vec<Vec<f32>> {
    let mut rows = vec![
        vec![1.0, 3.0, 3.0, -2.0],
        vec![f32::NAN, f32::NAN, 0.5, f32::NAN],
        vec![f32::NAN; 5],
        vec![-0.0, 0.0, -0.0],
        vec![f32::NEG_INFINITY, -1e30, f32::INFINITY, f32::INFINITY],
        vec![f32::NEG_INFINITY; 3],
    ];
    for (i, n) in [1usize, 31, 33, 1024, 1025, 3000].into_iter().enumerate() {
        let mut r = data(n, 40 + i as u64, 8.0);
        if n > 40 {
            r[n / 3] = 9.0;
            r[n - 1] = 9.0; // a tie with a later index
            r[7] = f32::NAN;
        }
        rows.push(r);
    }
    rows
}

#[test]
fn argmax_draws_the_host_samplers_token() {
    fn run<S: Storage + EmuType>() {
        let emu = Emu::new();
        for (ri, row) in logit_rows().into_iter().enumerate() {
            let (x, xw) = stored::<S>(&row);
            let (xb, tok) = (emu.upload("logits", &x), emu.alloc::<u32>("token", 1));
            emu.launch(
                &emu_kernel::<S>("argmax"),
                launch::argmax().into(),
                &[xb.arg(), (x.len() as i32).into(), tok.arg()],
            )
            .unwrap();
            assert_eq!(tok.to_vec()[0], sampling::argmax(&xw), "argmax_{} row {ri}", S::SUFFIX);
        }
    }
    run::<f32>();
    run::<f16>();
    run::<bf16>();
}

#[test]
fn sampling_draws_the_host_samplers_tokens() {
    // The engine's block of 1024 threads at f32 with two parameter sets and
    // two draws; every set and three draws with 64 threads (two warps: the
    // same code, 16x fewer fiber switches) at every storage type.
    fn run<S: Storage + EmuType>(threads: u32, nparams: usize, draws: u64) {
        let emu = Emu::new();
        let params: [(f32, Option<usize>, Option<f32>); 5] = [
            (1.0, None, None),
            (0.7, Some(5), None),
            (1.3, None, Some(0.8)),
            (0.9, Some(40), Some(0.95)),
            (2.0, Some(1), None),
        ];
        for (ri, row) in logit_rows().into_iter().enumerate() {
            let (x, xw) = stored::<S>(&row);
            let n = x.len();
            let params = &params[..nparams];
            let xb = emu.upload("logits", &x);
            let scratch = emu.alloc::<f64>("scratch", n);
            let tok = emu.alloc::<u32>("token", 1);
            for (pi, &(temp, top_k, top_p)) in params.iter().enumerate() {
                let seed = 1000 + pi as u64;
                let key = sampling::chacha_key(seed);
                let kb = emu.upload("key", &key);
                let mut host = sampling::Sampler::new(
                    sampling::Sampling::Random {
                        temperature: temp,
                        top_k,
                        top_p,
                    },
                    seed,
                );
                let top_k_arg = top_k.map_or(0, |k| k.max(1) as i64);
                for draw in 0..draws {
                    let args = [
                        xb.arg(),
                        (n as i32).into(),
                        temp.into(),
                        top_k_arg.into(),
                        top_p.unwrap_or(1.0).into(),
                        (top_p.is_some() as i32).into(),
                        kb.arg(),
                        draw.into(),
                        scratch.arg(),
                        tok.arg(),
                    ];
                    let cfg = LaunchConfig {
                        block: (threads, 1, 1),
                        ..launch::sample().into()
                    };
                    emu.launch(&emu_kernel::<S>("sample"), cfg, &args).unwrap();
                    let got = tok.to_vec()[0];
                    let mirror = reference::sample(
                        &xw,
                        temp,
                        top_k_arg,
                        top_p.unwrap_or(1.0),
                        top_p.is_some(),
                        &key,
                        draw,
                        threads as usize,
                    );
                    assert_eq!(
                        got,
                        mirror,
                        "sample_{} row {ri} params {pi} draw {draw}: kernel vs its host mirror",
                        S::SUFFIX
                    );
                    assert_eq!(
                        got,
                        host.sample(&xw),
                        "sample_{} row {ri} params {pi} draw {draw}: vs Sampler",
                        S::SUFFIX
                    );
                }
            }
        }
    }
    run::<f32>(launch::ARGMAX_THREADS, 2, 2);
    run::<f32>(64, 5, 3);
    run::<f16>(64, 5, 3);
    run::<bf16>(64, 5, 3);
}

#[test]
fn launches_on_parallel_threads_have_their_own_shared_memory() {
    // rmsnorm's __shared__ scratch is per block: 4 threads launching at once
    // must each get the single-threaded result.
    let (rows, width) = (16, 256);
    let x = data(rows * width, 20, 1.0);
    let w = data(width, 21, 1.0);
    let one = || {
        let emu = Emu::new();
        let (xb, wb, ob) = (
            emu.upload("x", &x),
            emu.upload("w", &w),
            emu.alloc::<f32>("out", rows * width),
        );
        for _ in 0..10 {
            emu.launch(
                "rmsnorm_f32",
                launch::per_row(rows, width).into(),
                &[xb.arg(), wb.arg(), ob.arg(), (width as i32).into(), 1e-5f32.into()],
            )
            .unwrap();
        }
        ob.to_vec()
    };
    let want = one();
    let got: Vec<Vec<f32>> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..4).map(|_| s.spawn(one)).collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for g in got {
        assert!(g.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()));
    }
}

#[test]
fn arguments_are_checked_against_the_signature() {
    let emu = Emu::new();
    let (x, o) = (emu.alloc::<f32>("x", 4), emu.alloc::<f16>("o", 4));
    let e = emu
        .launch(
            "add_f32",
            launch::elementwise(4).into(),
            &[x.arg(), x.arg(), o.arg(), 4i64.into()],
        )
        .unwrap_err();
    assert!(
        e.to_string()
            .contains("argument 2 is a f16 buffer, declared `*mut f32`"),
        "{e}"
    );
    let e = emu
        .launch(
            "add_f32",
            launch::elementwise(4).into(),
            &[x.arg(), x.arg(), x.arg(), 4i32.into()],
        )
        .unwrap_err();
    assert!(e.to_string().contains("argument 3 is i32, declared `i64`"), "{e}");
    assert!(matches!(
        emu.launch("nope", launch::argmax().into(), &[]),
        Err(EmuError::UnknownKernel(_))
    ));
}

// ---- planted kernel bugs ----

#[test]
fn planted_softmax_max_is_caught_at_the_rows_it_affects() {
    // The warp-only max differs from the block's only when a row's visible
    // keys span more than one warp (> 32 keys): exactly those rows mismatch.
    let c = AttnCase {
        t: 40,
        pos0: 0,
        heads: 2,
        kv: 1,
        d: 8,
    };
    let [(q, qw), (k, kw), (v, vw)] = attn_inputs::<f32>(&c, 30);
    let good = run_attention::<f32>("attention_prefill_f32", &c, &q, &k, &v);
    assert!(compare_attention(&c, &qw, &kw, &vw, &good).is_empty());
    let bug = run_attention::<f32>("planted_softmax_max/attention_prefill_f32", &c, &q, &k, &v);
    let bad = compare_attention(&c, &qw, &kw, &vw, &bug);
    let want: Vec<(usize, usize)> = (0..c.heads).flat_map(|h| (32..c.t).map(move |t| (h, t))).collect();
    assert_eq!(
        bad, want,
        "mismatching (head, row): those with more than 32 visible keys"
    );
}

#[test]
fn planted_gqa_modulo_is_caught_at_the_heads_it_remaps() {
    // H = 4, KV = 2: h / 2 = (0, 0, 1, 1), h % 2 = (0, 1, 0, 1): heads 1 and 2.
    let c = AttnCase {
        t: 3,
        pos0: 2,
        heads: 4,
        kv: 2,
        d: 8,
    };
    let [(q, qw), (k, kw), (v, vw)] = attn_inputs::<f32>(&c, 31);
    let bug = run_attention::<f32>("planted_gqa_modulo/attention_prefill_f32", &c, &q, &k, &v);
    let bad = compare_attention(&c, &qw, &kw, &vw, &bug);
    assert_eq!(bad, vec![(1, 0), (1, 1), (1, 2), (2, 0), (2, 1), (2, 2)]);
}

#[test]
fn planted_rope_pair_is_caught() {
    let (rows, heads, d, pos0) = (3, 2, 8, 0);
    let (x, xw) = stored::<f32>(&data(rows * heads * d, 32, 2.0));
    let want = cpu_rope::<f32>(&xw, rows, heads, d, pos0);
    let got = run_rope::<f32>("planted_rope_pair/rope_neox_f32", &x, rows, heads, d, pos0);
    let bad: Vec<usize> = (0..x.len())
        .filter(|&i| got[i].to_bits() != want[i].to_bits())
        .collect();
    // Position 0 rotates by angle 0 (the identity whatever the pairing), so
    // row 0 matches; every later row mismatches.
    assert!(!bad.is_empty());
    assert!(
        bad.iter().all(|&i| i >= heads * d),
        "row 0 (position 0) is the identity: {bad:?}"
    );
    for r in 1..rows {
        assert!(bad.iter().any(|&i| i / (heads * d) == r), "row {r} mismatches");
    }
}

#[test]
fn planted_oob_store_is_reported_with_kernel_thread_and_offset() {
    let (v, e, t) = (5, 24, 19); // 456 elements: the last thread is block 1, thread 199
    let emu = Emu::new();
    let table = emu.upload("table", &data(v * e, 33, 1.0));
    let tokens = emu.upload("tokens", &(0..t as u32).map(|i| i % v as u32).collect::<Vec<_>>());
    let out = emu.alloc::<f32>("embed_out", t * e);
    let args = [
        table.arg(),
        tokens.arg(),
        out.arg(),
        (t as i32).into(),
        (e as i32).into(),
    ];
    // The production kernel is clean.
    emu.launch("embedding_f32", launch::elementwise(t * e).into(), &args)
        .unwrap();
    let err = emu
        .launch(
            "planted_oob_store/embedding_f32",
            launch::elementwise(t * e).into(),
            &args,
        )
        .unwrap_err();
    eprintln!("{err}");
    let n = t * e;
    assert_eq!(
        err,
        EmuError::Fault {
            kernel: "planted_oob_store/embedding_f32".into(),
            block: ((n - 1) as u32 / 256, 0, 0),
            thread: ((n - 1) as u32 % 256, 0, 0),
            access: Access::Write,
            location: Location::Buffer {
                buffer: "embed_out".into(),
                bytes: n * 4,
                offset: (n * 4) as i64
            },
        }
    );
    assert_eq!(
        err.to_string(),
        "kernel `planted_oob_store/embedding_f32`: block (1,0,0) thread (199,0,0) wrote out of bounds at byte offset \
         1824 of buffer `embed_out` (1824 bytes; the first byte past its end)"
    );
}

#[test]
fn planted_underflow_store_is_found_in_the_canary() {
    // out[i - 1]: thread 0 writes 4 bytes before the buffer, into the canary
    // (no fault there, so the check after the launch names kernel, buffer, offset).
    let (v, e, t) = (5, 8, 4);
    let emu = Emu::new();
    let table = emu.upload("table", &data(v * e, 34, 1.0));
    let tokens = emu.upload("tokens", &[1u32, 2, 3, 4]);
    let out = emu.alloc::<f32>("embed_out", t * e);
    let args = [
        table.arg(),
        tokens.arg(),
        out.arg(),
        (t as i32).into(),
        (e as i32).into(),
    ];
    let err = emu
        .launch(
            "planted_oob_underflow/embedding_f32",
            launch::elementwise(t * e).into(),
            &args,
        )
        .unwrap_err();
    eprintln!("{err}");
    assert_eq!(
        err,
        EmuError::Guard {
            kernel: "planted_oob_underflow/embedding_f32".into(),
            location: Location::Buffer {
                buffer: "embed_out".into(),
                bytes: t * e * 4,
                offset: -4
            },
        }
    );
}
