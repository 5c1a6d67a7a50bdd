//! The emulated attention kernels (prefill and decode) against the CPU
//! engine's `attend`, within bounds derived from the summation order.

use super::*;

pub(super) struct AttnCase {
    pub(super) t: usize,
    pub(super) pos0: usize,
    pub(super) heads: usize,
    pub(super) kv: usize,
    pub(super) d: usize,
    /// A local layer's sliding window (0: none).
    pub(super) window: usize,
    /// Attention sinks (gpt-oss), one logit per head (`sink_values`).
    pub(super) sinks: bool,
}

/// A case's sink logits, stored as S and widened, around the scores' size.
pub(super) fn sink_values<S: Storage>(c: &AttnCase) -> (Vec<S>, Vec<f32>) {
    stored::<S>(&data(c.heads, 77, 3.0))
}

pub(super) struct AttnOut<S> {
    pub(super) ctx: Vec<S>,
    pub(super) probs: Vec<f32>,
    pub(super) scores: Vec<f32>,
}

/// q [T,H,D], k/v caches [S,KV,D] (S = pos0 + T), stored as S.
pub(super) fn attn_inputs<S: Storage>(c: &AttnCase, seed: u64) -> [(Vec<S>, Vec<f32>); 3] {
    let s = c.pos0 + c.t;
    [
        stored::<S>(&data(c.t * c.heads * c.d, seed, 1.5)),
        stored::<S>(&data(s * c.kv * c.d, seed + 1, 1.5)),
        stored::<S>(&data(s * c.kv * c.d, seed + 2, 2.0)),
    ]
}

/// Runs `kernel` (prefill, or decode when T = 1 and the name says so).
pub(super) fn run_attention<S: Storage + EmuType>(kernel: &str, c: &AttnCase, q: &[S], k: &[S], v: &[S]) -> AttnOut<S> {
    run_attention_on(&Emu::new(), kernel, c, q, k, v)
}

/// `run_attention` on a given device (serial or parallel launches).
pub(super) fn run_attention_on<S: Storage + EmuType>(
    emu: &Emu,
    kernel: &str,
    c: &AttnCase,
    q: &[S],
    k: &[S],
    v: &[S],
) -> AttnOut<S> {
    run_attention_mask(emu, kernel, c, q, k, v, true)
}

/// `run_attention_on`, causal or bidirectional (the vision tower's).
pub(super) fn run_attention_mask<S: Storage + EmuType>(
    emu: &Emu,
    kernel: &str,
    c: &AttnCase,
    q: &[S],
    k: &[S],
    v: &[S],
    causal: bool,
) -> AttnOut<S> {
    let s = c.pos0 + c.t;
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
    args.push((c.window as i32).into());
    args.push((causal as i32).into());
    let sinks = c.sinks.then(|| emu.upload("sinks", &sink_values::<S>(c).0));
    args.push(sinks.as_ref().map_or(crate::engine::cuda::emu::Arg::Null, |b| b.arg()));
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
/// product 2u: |Δp_j| <= (2δ + (S + 3) u) p_j (a sink is one more term of
/// the sum: S + 4). ctx = Σ p_j v_j: the order adds
/// S u Σ p_j |v_j| and the probability errors Σ |Δp_j| |v_j|.
/// Returns the worst (|Δ|/bound) seen, asserting it is <= 1; at 16-bit storage
/// ctx is compared within 1 ulp of S instead (one rounding of each f32 result).
pub(super) fn compare_attention<S: Storage>(
    c: &AttnCase,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    got: &AttnOut<S>,
) -> Vec<(usize, usize)> {
    let s = c.pos0 + c.t;
    let sinks = sink_values::<S>(c).1;
    let shape = AttnShape {
        causal: true,
        heads: c.heads,
        kv_heads: c.kv,
        head_dim: c.d,
        scale: (c.d as f64).powf(-0.5),
        window: (c.window > 0).then_some(c.window),
        mutants: Mutants::default(),
        batch_pad: 0,
        sinks: c.sinks.then_some(&sinks[..]),
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
                *d = (2.0 * delta + (s as f64 + 3.0 + f64::from(u8::from(c.sinks))) * U) * p + 1e-30;
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

const ATTN_CASES: [AttnCase; 6] = [
    AttnCase {
        t: 5,
        pos0: 3,
        heads: 4,
        kv: 2,
        d: 16,
        window: 0,
        sinks: false,
    },
    AttnCase {
        t: 3,
        pos0: 150,
        heads: 6,
        kv: 2,
        d: 8,
        window: 0,
        sinks: false,
    }, // S > blockDim
    AttnCase {
        t: 2,
        pos0: 0,
        heads: 2,
        kv: 2,
        d: 136,
        window: 0,
        sinks: false,
    }, // D > blockDim
    AttnCase {
        t: 6,
        pos0: 4,
        heads: 4,
        kv: 2,
        d: 16,
        window: 3,
        sinks: false,
    }, // a local layer: keys older than the window are masked
    AttnCase {
        t: 3,
        pos0: 150,
        heads: 2,
        kv: 1,
        d: 8,
        window: 100,
        sinks: false,
    }, // a window wider than a warp, starting past 0
    AttnCase {
        t: 4,
        pos0: 40,
        heads: 4,
        kv: 2,
        d: 16,
        window: 8,
        sinks: true,
    }, // gpt-oss: sinks, on a local layer
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
                    causal: true,
                    heads: c.heads,
                    kv_heads: c.kv,
                    head_dim: c.d,
                    scale: (c.d as f64).powf(-0.5),
                    window: (c.window > 0).then_some(c.window),
                    mutants: Mutants::default(),
                    batch_pad: 0,
                    sinks: None,
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
