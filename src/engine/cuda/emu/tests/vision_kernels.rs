//! The emulated kernels the vision-language models add (LayerNorm, the
//! tower's activations, the qkv split, the image-row scatter, RoPE from a
//! position table for M-RoPE and the 2-D vision rotary, bidirectional
//! attention) against the CPU engine's own code, and the planted bugs of
//! those kernels caught.

use super::attention::{attn_inputs, run_attention_mask, AttnCase};
use super::*;
use crate::engine::cpu::vision::{gelu_erf, quick_gelu, rotate, vision_inv_freq, vision_rotary, LayerNorm};
use crate::model::vision::MRope;

#[test]
fn layernorm_is_the_cpu_engines_within_an_ulp() {
    // Both accumulate the moments in f64 and round them once; only the f64
    // summation order differs, so the f32 moments (hence the outputs) agree
    // but for an f64 sum within 2^-29 of an f32 rounding boundary.
    fn run<S: Storage + EmuType>(width: usize, rows: usize) {
        let x: Vec<f32> = data(rows * width, 40, 3.0).iter().map(|v| v + 1.5).collect();
        let (x, xw) = stored::<S>(&x);
        let (w, ww) = stored::<S>(&data(width, 41, 1.5));
        let (b, bw) = stored::<S>(&data(width, 42, 0.5));
        let cpu = LayerNorm { w: ww, b: bw }.forward(&xw, width, 1e-6);
        let emu = Emu::new();
        let (xb, wb, bb, ob) = (
            emu.upload("x", &x),
            emu.upload("w", &w),
            emu.upload("b", &b),
            emu.alloc::<S>("out", rows * width),
        );
        let args = [
            xb.arg(),
            wb.arg(),
            bb.arg(),
            ob.arg(),
            (width as i32).into(),
            1e-6f64.into(),
        ];
        emu.launch(
            &emu_kernel::<S>("layernorm"),
            launch::per_row(rows, width).into(),
            &args,
        )
        .unwrap();
        for (i, (g, c)) in ob.to_vec().iter().zip(&cpu).enumerate() {
            let d = ulps(*g, S::from_f32(*c));
            assert!(d <= 1, "layernorm_{} w={width} [{i}]: {d} ulps", S::SUFFIX);
        }
    }
    for (w, r) in [(32, 7), (33, 5), (128, 3), (1000, 2)] {
        run::<f32>(w, r);
        run::<f16>(w, r);
        run::<bf16>(w, r);
    }
}

#[test]
fn vision_activations_are_the_cpu_engines() {
    // quick_gelu and gelu_tanh: bitwise (same f32 operations, the same libm
    // expf/tanhf). The erf GELU: the CPU engine calls the `libm` crate's
    // erff, the kernel the C library's (CUDA's on a device); each is within
    // an ulp or two of erf, and 1 + erf cancels for negative x, so the bound
    // is on the absolute error that carries: |x|/2 · 2 ulp(1) + 2 ulp(y).
    let x: Vec<f32> = data(4096, 43, 8.0);
    let emu = Emu::new();
    let xb = emu.upload("x", &x);
    type Act = fn(f32) -> f32;
    let cases: [(i32, Act); 3] = [(0, quick_gelu), (1, ops::gelu_tanh), (2, gelu_erf)];
    for (kind, f) in cases {
        let ob = emu.alloc::<f32>("out", x.len());
        let args = [xb.arg(), ob.arg(), (x.len() as i64).into(), kind.into()];
        emu.launch("act_f32", launch::elementwise(x.len()).into(), &args)
            .unwrap();
        for (i, (g, &v)) in ob.to_vec().iter().zip(&x).enumerate() {
            let c = f(v);
            if kind < 2 {
                assert_eq!(g.to_bits(), c.to_bits(), "act kind {kind} at x = {v} [{i}]");
            } else {
                let bound = v.abs() as f64 * 4.0 * U + 4.0 * U * c.abs() as f64;
                let d = (*g as f64 - c as f64).abs();
                assert!(d <= bound, "gelu_erf at x = {v} [{i}]: {g} vs {c} (bound {bound:e})");
            }
        }
    }
}

#[test]
fn qkv_split_and_row_scatter_are_exact() {
    let (rows, ev) = (5, 6);
    let src = data(rows * 3 * ev, 44, 2.0);
    let emu = Emu::new();
    let sb = emu.upload("qkv", &src);
    for part in 0..3 {
        let ob = emu.alloc::<f32>("part", rows * ev);
        let args = [
            sb.arg(),
            ob.arg(),
            (rows as i32).into(),
            (3 * ev as i32).into(),
            ((part * ev) as i32).into(),
            (ev as i32).into(),
        ];
        emu.launch("copy_cols_f32", launch::elementwise(rows * ev).into(), &args)
            .unwrap();
        let want: Vec<f32> = src
            .chunks_exact(3 * ev)
            .flat_map(|r| r[part * ev..][..ev].to_vec())
            .collect();
        assert!(bits_eq(&ob.to_vec(), &want), "part {part}");
    }
    // Three feature rows into rows 1, 4, 7 of a [9, 4] buffer.
    let (width, idx) = (4, [1i32, 4, 7]);
    let dst = data(9 * width, 45, 1.0);
    let feat = data(3 * width, 46, 1.0);
    for accumulate in [0i32, 1] {
        let db = emu.upload("dst", &dst);
        let (fb, ib) = (emu.upload("feat", &feat), emu.upload("idx", &idx));
        let args = [
            fb.arg(),
            db.arg(),
            ib.arg(),
            3i32.into(),
            (width as i32).into(),
            accumulate.into(),
        ];
        emu.launch("scatter_rows_f32", launch::elementwise(3 * width).into(), &args)
            .unwrap();
        let mut want = dst.clone();
        for (r, &row) in idx.iter().enumerate() {
            for c in 0..width {
                let (d, s) = (&mut want[row as usize * width + c], feat[r * width + c]);
                *d = if accumulate == 1 { *d + s } else { s };
            }
        }
        assert!(bits_eq(&db.to_vec(), &want), "accumulate {accumulate}");
    }
}

/// Runs `kernel` (a rope_axes variant) over x [rows, heads, d].
fn run_rope_axes(
    kernel: &str,
    x: &[f32],
    inv: &[f32],
    pos: &[i32],
    axes: &[i32],
    rows: usize,
    heads: usize,
) -> Vec<f32> {
    let d = inv.len() * 2;
    let emu = Emu::new();
    let (xb, ob) = (emu.upload("x", x), emu.alloc::<f32>("out", x.len()));
    let (fb, pb, ab) = (emu.upload("inv", inv), emu.upload("pos", pos), emu.upload("axes", axes));
    let args = [
        xb.arg(),
        ob.arg(),
        fb.arg(),
        pb.arg(),
        ab.arg(),
        (rows as i32).into(),
        (heads as i32).into(),
        (d as i32).into(),
    ];
    emu.launch(kernel, launch::elementwise(rows * heads * d / 2).into(), &args)
        .unwrap();
    ob.to_vec()
}

/// M-RoPE positions of 6 rows: rows 0, 1, 2 and 5 have t = h = w, rows 3 and 4 not.
const MPOS: [[i64; 6]; 3] = [[0, 1, 2, 2, 2, 5], [0, 1, 2, 3, 3, 5], [0, 1, 2, 2, 3, 5]];

/// The rows (of [rows, heads, d]) where `got` and the CPU engine's M-RoPE differ.
fn mrope_bad_rows(kernel: &str, mr: &MRope) -> Vec<usize> {
    let (rows, heads, d) = (6, 2, 16);
    let x = data(rows * heads * d, 47, 2.0);
    let rope = ops::Rope::new(d, 10000.0);
    let axes: Vec<usize> = (0..d / 2).map(|j| mr.axis_of(j)).collect();
    let pos = MPOS.map(|a| a.to_vec());
    let mut want = x.clone();
    rope.apply_axes(&mut want, heads, &pos, &axes);
    let flat: Vec<i32> = MPOS.iter().flatten().map(|&p| p as i32).collect();
    let ax: Vec<i32> = axes.iter().map(|&a| a as i32).collect();
    let got = run_rope_axes(kernel, &x, rope.inv_freq(), &flat, &ax, rows, heads);
    let mut bad: Vec<usize> = (0..x.len())
        .filter(|&i| got[i].to_bits() != want[i].to_bits())
        .map(|i| i / (heads * d))
        .collect();
    bad.dedup();
    bad
}

#[test]
fn rope_axes_is_bitwise_the_cpu_engines_mrope_and_vision_rotary() {
    for mr in [
        MRope {
            section: [2, 3, 3],
            interleaved: false,
        },
        MRope {
            section: [4, 2, 2],
            interleaved: true,
        },
    ] {
        assert!(mrope_bad_rows("rope_axes_f32", &mr).is_empty(), "{mr:?}");
    }
    // The vision tower's 2-D rotary: frequency j < D/4 by h, D/4 + j by w.
    let (heads, d, theta) = (2, 16, 10000.0f32);
    let hw: Vec<(usize, usize)> = vec![(0, 0), (0, 1), (1, 0), (1, 1), (3, 7), (5, 2)];
    let rows = hw.len();
    let x = data(rows * heads * d, 48, 2.0);
    let (cos, sin) = vision_rotary(d, theta, &hw);
    let mut want = x.clone();
    rotate(&mut want, heads, d, &cos, &sin);
    let inv = vision_inv_freq(d, theta);
    let inv2: Vec<f32> = (0..d / 2).map(|j| inv[j % (d / 4)]).collect();
    let axes: Vec<i32> = (0..d / 2).map(|j| (j / (d / 4)) as i32).collect();
    let pos: Vec<i32> = hw
        .iter()
        .map(|p| p.0 as i32)
        .chain(hw.iter().map(|p| p.1 as i32))
        .collect();
    let got = run_rope_axes("rope_axes_f32", &x, &inv2, &pos, &axes, rows, heads);
    assert!(bits_eq(&got, &want), "the vision rotary");
}

#[test]
fn planted_mrope_one_axis_is_caught_at_the_rows_whose_axes_differ() {
    let mr = MRope {
        section: [2, 3, 3],
        interleaved: false,
    };
    assert_eq!(mrope_bad_rows("planted_mrope_one_axis/rope_axes_f32", &mr), vec![3, 4]);
}

/// The (head, row)s where a bidirectional attention run differs from the
/// CPU engine's (`causal: false`) by more than 1e-5 of the largest value, or
/// leaves a probability at 0.
pub(super) fn bidirectional_bad_rows(
    c: &AttnCase,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    ctx: &[f32],
    probs: &[f32],
) -> Vec<(usize, usize)> {
    let shape = AttnShape {
        causal: false,
        heads: c.heads,
        kv_heads: c.kv,
        head_dim: c.d,
        scale: (c.d as f64).powf(-0.5),
        window: None,
        mutants: Mutants::default(),
        batch_pad: 0,
        sinks: None,
    };
    let cpu = attend(q, c.t, 0, k, v, shape, false);
    let big = |x: &[f32]| x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let (cmax, pmax) = (big(&cpu.ctx), big(&cpu.probs));
    let mut bad = Vec::new();
    for h in 0..c.heads {
        for t in 0..c.t {
            let p = &probs[(h * c.t + t) * c.t..][..c.t];
            let pc = &cpu.probs[(h * c.t + t) * c.t..][..c.t];
            let cx = &ctx[(t * c.heads + h) * c.d..][..c.d];
            let cc = &cpu.ctx[(t * c.heads + h) * c.d..][..c.d];
            let p_bad = p.iter().zip(pc).any(|(a, b)| *a <= 0.0 || (a - b).abs() > 1e-5 * pmax);
            let c_bad = cx.iter().zip(cc).any(|(a, b)| (a - b).abs() > 1e-5 * cmax);
            if p_bad || c_bad {
                bad.push((h, t));
            }
        }
    }
    bad
}

#[test]
fn bidirectional_attention_is_the_cpu_engines_and_planted_causal_is_caught() {
    let c = AttnCase {
        t: 40,
        pos0: 0,
        heads: 2,
        kv: 2,
        d: 8,
        window: 0,
        sinks: false,
    };
    let [(q, qw), (k, kw), (v, vw)] = attn_inputs::<f32>(&c, 49);
    let emu = Emu::new();
    let good = run_attention_mask(&emu, "attention_prefill_f32", &c, &q, &k, &v, false);
    assert!(bidirectional_bad_rows(&c, &qw, &kw, &vw, &good.ctx, &good.probs).is_empty());
    // The flag ignored: every row but the last (which sees every key either
    // way) is masked as if causal.
    let kernel = "planted_attention_causal_ignored/attention_prefill_f32";
    let bug = run_attention_mask(&emu, kernel, &c, &q, &k, &v, false);
    let want: Vec<(usize, usize)> = (0..c.heads).flat_map(|h| (0..c.t - 1).map(move |t| (h, t))).collect();
    assert_eq!(bidirectional_bad_rows(&c, &qw, &kw, &vw, &bug.ctx, &bug.probs), want);
    // Causal, the planted kernel is the correct one: bitwise the good kernel's.
    let good_c = run_attention_mask(&emu, "attention_prefill_f32", &c, &q, &k, &v, true);
    let bug_c = run_attention_mask(&emu, kernel, &c, &q, &k, &v, true);
    assert!(bits_eq(&good_c.ctx, &bug_c.ctx) && bits_eq(&good_c.probs, &bug_c.probs));
}
