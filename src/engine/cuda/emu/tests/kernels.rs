//! The emulated element-wise and per-row kernels (embedding, RMSNorm, RoPE,
//! bias add, SiLU·up, residual add) against the CPU engine's own ops.

use super::*;

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
        let args = [
            xb.arg(),
            wb.arg(),
            ob.arg(),
            (width as i32).into(),
            1e-6f32.into(),
            0i32.into(),
        ];
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
    // Gemma's 1 + w: the kernel with plus_one set equals the kernel given
    // the weights 1 + w (formed in f32, as the CPU engine forms them).
    {
        let (rows, width) = (3, 64);
        let x = data(rows * width, 4, 3.0);
        let w = data(width, 5, 0.5);
        let w1: Vec<f32> = w.iter().map(|v| 1.0 + v).collect();
        let emu = Emu::new();
        let run = |wv: &[f32], plus_one: i32| {
            let (xb, wb, ob) = (
                emu.upload("x", &x),
                emu.upload("w", wv),
                emu.alloc::<f32>("out", rows * width),
            );
            let args = [
                xb.arg(),
                wb.arg(),
                ob.arg(),
                (width as i32).into(),
                1e-6f32.into(),
                plus_one.into(),
            ];
            emu.launch("rmsnorm_f32", launch::per_row(rows, width).into(), &args)
                .unwrap();
            ob.to_vec()
        };
        let (a, b, plain) = (run(&w, 1), run(&w1, 0), run(&w, 0));
        assert!(bits_eq(&a, &b), "rmsnorm plus_one is (1 + w)");
        assert!(!bits_eq(&a, &plain), "plus_one changes the result");
    }
    for width in [1, 7, 64, 300, 1000] {
        eprintln!("rmsnorm f32 width {width}: max rel err {:e}", run::<f32>(width, 3));
        eprintln!("rmsnorm f16 width {width}: max ulps {}", run::<f16>(width, 3));
        eprintln!("rmsnorm bf16 width {width}: max ulps {}", run::<bf16>(width, 3));
    }
}

/// cos/sin tables [positions, D/2] from the CPU engine's own Rope.
pub(super) fn rope_tables(rope: &ops::Rope, positions: usize) -> (Vec<f32>, Vec<f32>) {
    let (mut c, mut s) = (Vec::new(), Vec::new());
    for p in 0..positions {
        let (cp, sp) = rope.cos_sin(p);
        c.extend(cp);
        s.extend(sp);
    }
    (c, s)
}

/// Runs rope `kernel` over x [rows, heads, D] at positions pos0.. and returns out.
pub(super) fn run_rope<S: Storage + EmuType>(
    kernel: &str,
    x: &[S],
    rows: usize,
    heads: usize,
    d: usize,
    pos0: usize,
) -> Vec<S> {
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
pub(super) fn cpu_rope<S: Storage>(xw: &[f32], rows: usize, heads: usize, d: usize, pos0: usize) -> Vec<S> {
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
        // gelu_mul (Gemma's GeGLU; the same libm tanhf on both sides)
        emu.launch(
            &emu_kernel::<S>("gelu_mul"),
            cfg,
            &[ab.arg(), bb.arg(), out.arg(), (n as i64).into()],
        )
        .unwrap();
        assert!(
            bits_eq(
                &out.to_vec(),
                &round(ops::act_mul(crate::model::config::Activation::GeluTanh, &aw, &bw))
            ),
            "gelu_mul_{}",
            S::SUFFIX
        );
        // scale, in place (Gemma's embedding times sqrt(hidden), then stored)
        let xs = emu.upload("xs", &a);
        let sc = 25.298221f32;
        emu.launch(
            &emu_kernel::<S>("scale"),
            cfg,
            &[xs.arg(), sc.into(), (n as i64).into()],
        )
        .unwrap();
        let want: Vec<f32> = aw.iter().map(|v| v * sc).collect();
        assert!(bits_eq(&xs.to_vec(), &round(want)), "scale_{}", S::SUFFIX);
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
