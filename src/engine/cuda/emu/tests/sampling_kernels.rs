//! The emulated argmax and `sample` kernels draw the host sampler's tokens,
//! on rows with NaN, ±inf, ties and ±0.

use super::*;

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
