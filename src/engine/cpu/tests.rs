//! End-to-end tests of the CPU engine on the synthetic model of `test_model`:
//! loading, the forward pass, the KV cache and the run loop exercised
//! together, including the error paths a user can hit.

use safetensors::Dtype;

use super::test_model::*;
use super::CpuEngine;
use crate::engine::{Engine, RunRequest, TapSet};
use crate::error::Error;
use crate::model::LoadOptions;
use crate::sampling::Sampling;
use crate::stage::{BlockStage, Stage, Step};
use crate::tensor::DType;

fn req(prompt: Vec<u32>, decode_steps: usize, forced: Option<Vec<u32>>) -> RunRequest {
    RunRequest {
        prompt,
        decode_steps,
        sampling: Sampling::Greedy,
        seed: 0,
        forced,
        image: None,
    }
}

fn max_abs(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

#[test]
fn runs_with_all_taps_in_canonical_shapes() {
    let (_d, eng) = model(Opts::default());
    let out = eng.run(&req(vec![3, 7, 1, 9], 2, None), &TapSet::all(L)).unwrap();
    assert_eq!(out.sampled.len(), 3);
    assert_eq!(out.positions, vec![vec![0, 1, 2, 3], vec![4], vec![5]]);
    assert_eq!(out.captures.len(), 3 * Stage::of_model(eng.config(), false).len());
    let shape = |step, st| out.captures.get(step, st).unwrap().shape().to_vec();
    assert_eq!(shape(Step::Prefill, Stage::Embed), [4, E]);
    assert_eq!(shape(Step::Prefill, Stage::Block(1, BlockStage::Q)), [4, H, D]);
    assert_eq!(shape(Step::Prefill, Stage::Block(1, BlockStage::KRope)), [4, KV, D]);
    assert_eq!(shape(Step::Prefill, Stage::Block(0, BlockStage::AttnProbs)), [H, 4, 4]);
    assert_eq!(
        shape(Step::Decode(2), Stage::Block(0, BlockStage::AttnProbs)),
        [H, 1, 6]
    );
    assert_eq!(shape(Step::Decode(1), Stage::Block(0, BlockStage::AttnCtx)), [1, H * D]);
    assert_eq!(shape(Step::Decode(1), Stage::Block(1, BlockStage::FfnAct)), [1, F]);
    assert_eq!(shape(Step::Prefill, Stage::Logits), [4, V]);
    // Greedy: sampled tokens are the argmax of each step's last logits row,
    // and with forcing off each decode step is fed the previous sample.
    for (i, step) in Step::sequence(2).into_iter().enumerate() {
        let lg = out.captures.get(step, Stage::Logits).unwrap();
        let last = &lg.data()[lg.numel() - V..];
        assert_eq!(out.sampled[i], crate::sampling::argmax(last));
    }
    let fed = out.captures.get(Step::Decode(1), Stage::Embed).unwrap();
    assert_eq!(
        fed.data(),
        &eng.weights.embed.data()[out.sampled[0] as usize * E..][..E]
    );
}

#[test]
fn untapped_run_captures_nothing_and_samples_the_same() {
    let (_d, eng) = model(Opts::default());
    let r = req(vec![5, 2, 8], 3, None);
    let bare = eng.run(&r, &TapSet::none()).unwrap();
    let full = eng.run(&r, &TapSet::all(L)).unwrap();
    assert!(bare.captures.is_empty());
    assert_eq!(bare.sampled, full.sampled);
    // Logits tapped alone still agree with the last-row-only path.
    let only: TapSet = [Stage::Logits].into_iter().collect();
    let lg = eng.run(&r, &only).unwrap();
    assert_eq!(lg.captures.len(), 4);
    assert_eq!(lg.sampled, bare.sampled);
}

#[test]
fn incremental_decode_matches_full_prefill() {
    let (_d, eng) = model(Opts::default());
    let prompt = vec![3, 7, 1, 9, 0];
    let forced = vec![12, 33, 4];
    let taps: TapSet = [Stage::Logits, Stage::Block(1, BlockStage::KRope)]
        .into_iter()
        .collect();
    let inc = eng.run(&req(prompt.clone(), 3, Some(forced.clone())), &taps).unwrap();
    let mut all = prompt.clone();
    all.extend(&forced);
    let full = eng.run(&req(all, 0, None), &taps).unwrap();
    let full_logits = full.captures.get(Step::Prefill, Stage::Logits).unwrap().data();
    let t0 = prompt.len();
    // Prefill rows, then each decode step against the matching full row.
    let pre = inc.captures.get(Step::Prefill, Stage::Logits).unwrap().data();
    assert!(max_abs(pre, &full_logits[..t0 * V]) < 1e-5);
    for n in 1..=3 {
        let dec = inc.captures.get(Step::Decode(n), Stage::Logits).unwrap().data();
        let row = &full_logits[(t0 + n - 1) * V..][..V];
        let err = max_abs(dec, row);
        assert!(err < 1e-5, "decode{n} logits differ from full prefill by {err}");
        let k = inc
            .captures
            .get(Step::Decode(n), Stage::Block(1, BlockStage::KRope))
            .unwrap()
            .data();
        let kf = full
            .captures
            .get(Step::Prefill, Stage::Block(1, BlockStage::KRope))
            .unwrap()
            .data();
        assert!(max_abs(k, &kf[(t0 + n - 1) * KV * D..][..KV * D]) < 1e-5);
    }
    // Forced tokens are what the decode steps were fed.
    assert_eq!(inc.positions[3], vec![t0 + 2]);
}

#[test]
fn two_runs_are_bitwise_identical() {
    let (_d, eng) = model(Opts::default());
    let r = RunRequest {
        prompt: vec![1, 2, 3, 4, 5, 6],
        decode_steps: 3,
        sampling: Sampling::Random {
            temperature: 0.8,
            top_k: Some(10),
            top_p: Some(0.9),
        },
        seed: 42,
        forced: None,
        image: None,
    };
    let a = eng.run(&r, &TapSet::all(L)).unwrap();
    let b = eng.run(&r, &TapSet::all(L)).unwrap();
    assert_eq!(a.sampled, b.sampled);
    for ((ka, ta), (kb, tb)) in a.captures.iter().zip(b.captures.iter()) {
        assert_eq!(ka, kb);
        let same = ta.data().iter().zip(tb.data()).all(|(x, y)| x.to_bits() == y.to_bits());
        assert!(same, "{ka:?} differs between runs");
    }
}

#[test]
fn missing_weight_is_an_error_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    write_model(dir.path(), Opts::default(), |ts| {
        ts.retain(|(n, _, _)| n != "model.layers.1.mlp.up_proj.weight")
    });
    let err = CpuEngine::load(dir.path()).err().expect("must fail");
    assert!(matches!(err, Error::Model { .. }));
    let msg = err.to_string();
    assert!(msg.contains("model.layers.1.mlp.up_proj.weight"), "{msg}");
    assert!(msg.contains(&dir.path().display().to_string()), "{msg}");
}

#[test]
fn wrong_shape_and_leftover_weights_are_errors() {
    let dir = tempfile::tempdir().unwrap();
    write_model(dir.path(), Opts::default(), |ts| {
        let t = ts.iter_mut().find(|(n, _, _)| n == "model.norm.weight").unwrap();
        t.1 = vec![E + 1];
        t.2 = vec![1.0; E + 1];
    });
    let msg = CpuEngine::load(dir.path()).err().unwrap().to_string();
    assert!(msg.contains("model.norm.weight") && msg.contains("shape"), "{msg}");

    let dir = tempfile::tempdir().unwrap();
    write_model(dir.path(), Opts::default(), |ts| {
        ts.push(("model.layers.0.self_attn.q_norm.weight".into(), vec![D], vec![1.0; D]));
        ts.push((
            "model.layers.0.self_attn.rotary_emb.inv_freq".into(),
            vec![D / 2],
            vec![1.0; D / 2],
        ));
    });
    let msg = CpuEngine::load(dir.path()).err().unwrap().to_string();
    assert!(msg.contains("q_norm"), "{msg}");
    assert!(!msg.contains("inv_freq"), "RoPE buffers are ignored: {msg}");
}

#[test]
fn tied_head_uses_embeddings_and_untied_head_differs() {
    let (_d1, tied) = model(Opts {
        tied: true,
        ..Opts::default()
    });
    let (_d2, untied) = model(Opts::default());
    assert!(tied.weights.lm_head.is_none());
    assert!(untied.weights.lm_head.is_some());
    let taps: TapSet = [Stage::OutputNorm, Stage::Logits].into_iter().collect();
    let r = req(vec![4, 4, 11], 0, None);
    let a = tied.run(&r, &taps).unwrap();
    let xn = a.captures.get(Step::Prefill, Stage::OutputNorm).unwrap().data();
    let lg = a.captures.get(Step::Prefill, Stage::Logits).unwrap().data();
    // logits[t, v] = output_norm[t] · embed[v]
    for (t, vv) in [(0, 0), (2, V - 1), (1, 17)] {
        let want: f32 = (0..E)
            .map(|i| xn[t * E + i] * tied.weights.embed.data()[vv * E + i])
            .sum();
        assert!((lg[t * V + vv] - want).abs() < 1e-5);
    }
    let b = untied.run(&r, &taps).unwrap();
    let lb = b.captures.get(Step::Prefill, Stage::Logits).unwrap().data();
    assert!(max_abs(lg, lb) > 1e-2, "an untied head must give other logits");
}

#[test]
fn half_precision_weights_load_and_run() {
    let (_d, f32_eng) = model(Opts {
        bias: false,
        ..Opts::default()
    });
    let r = req(vec![9, 8, 7], 1, None);
    let taps: TapSet = [Stage::Logits].into_iter().collect();
    let want = f32_eng.run(&r, &taps).unwrap();
    let want = want.captures.get(Step::Prefill, Stage::Logits).unwrap().data().to_vec();
    for (dtype, tol) in [(Dtype::F16, 0.05), (Dtype::BF16, 0.3)] {
        let (_d, eng) = model(Opts {
            dtype,
            bias: false,
            ..Opts::default()
        });
        assert!(eng.weights.blocks[0].qkv.split().expect("plain attention").0.bias.is_none());
        let out = eng.run(&r, &taps).unwrap();
        let got = out.captures.get(Step::Prefill, Stage::Logits).unwrap().data();
        assert!(got.iter().all(|x| x.is_finite()));
        let err = max_abs(got, &want);
        assert!(err > 0.0 && err < tol, "{dtype:?} logits off by {err}");
    }
}

#[test]
fn bad_requests_are_typed_errors() {
    let (_d, eng) = model(Opts::default());
    let engine_err = |r: RunRequest| match eng.run(&r, &TapSet::none()) {
        Err(Error::Engine { engine, msg }) => {
            assert_eq!(engine, "cpu");
            msg
        }
        other => panic!("expected an engine error, got {other:?}"),
    };
    assert!(engine_err(req(vec![], 1, None)).contains("empty"));
    assert!(engine_err(req(vec![1, V as u32], 0, None)).contains(&V.to_string()));
    assert!(engine_err(req(vec![1], 3, Some(vec![2, 3]))).contains("2 token(s) for 3"));
    assert!(engine_err(req(vec![1], 2, Some(vec![2, 999]))).contains("999"));
}

/// The synthetic model loaded with `storage`.
fn stored_model(storage: DType) -> (tempfile::TempDir, CpuEngine) {
    let dir = tempfile::tempdir().unwrap();
    write_model(dir.path(), Opts::default(), |_| {});
    let opts = LoadOptions {
        storage,
        ..LoadOptions::default()
    };
    let eng = CpuEngine::load_with(dir.path(), &opts).unwrap();
    (dir, eng)
}

#[test]
fn f32_storage_is_the_default_engine_bit_for_bit() {
    let (_d, plain) = model(Opts::default());
    let (_e, stored) = stored_model(DType::F32);
    assert_eq!(stored.storage(), DType::F32);
    let r = req(vec![3, 7, 1, 9], 2, None);
    let (a, b) = (
        plain.run(&r, &TapSet::all(L)).unwrap(),
        stored.run(&r, &TapSet::all(L)).unwrap(),
    );
    assert_eq!(a.sampled, b.sampled);
    for ((key, ta), (_, tb)) in a.captures.iter().zip(b.captures.iter()) {
        assert_eq!(tb.dtype(), DType::F32, "{key:?}");
        let bits = |t: &crate::tensor::Tensor| t.data().iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(ta), bits(tb), "{key:?}");
    }
}

#[test]
fn half_storage_rounds_every_stage_but_the_probabilities() {
    let r = req(vec![3, 7, 1, 9, 22], 3, None);
    let (_d, f32_eng) = model(Opts::default());
    let want = f32_eng.run(&r, &TapSet::all(L)).unwrap();
    for storage in [DType::F16, DType::BF16] {
        let (_d, eng) = stored_model(storage);
        // Weights are held rounded.
        let w = &eng.weights;
        let held: [&[f32]; 7] = [
            w.embed.data(),
            &w.norm,
            &w.blocks[1].attn_norm,
            w.blocks[0].qkv.split().expect("plain attention").0.w.data(),
            w.blocks[0].qkv.split().expect("plain attention").0.bias.as_ref().unwrap(),
            w.blocks[1].ffn.dense().expect("a dense model").down.w.data(),
            w.lm_head.as_ref().unwrap().w.data(),
        ];
        for v in held {
            assert!(
                v.iter().all(|&x| storage.represents(x)),
                "{storage}: a weight is not rounded"
            );
        }
        let out = eng.run(&r, &TapSet::all(L)).unwrap();
        assert_eq!(out.captures.len(), 4 * Stage::of_model(eng.config(), false).len());
        let mut unrounded_probs = 0;
        for ((step, stage), t) in out.captures.iter() {
            // Every capture carries the run's storage dtype, attn_probs too.
            assert_eq!(t.dtype(), storage, "{step}/{stage}");
            let exact = t.data().iter().filter(|&&x| storage.represents(x)).count();
            // Scores and probabilities stay f32, as in HF's half-precision runs.
            if matches!(stage, Stage::Block(_, BlockStage::AttnProbs | BlockStage::AttnScores)) {
                unrounded_probs += t.numel() - exact;
            } else {
                assert_eq!(exact, t.numel(), "{storage}: {step}/{stage} holds unrounded values");
            }
            // Close to the f32 run, but not equal: the rounding happened.
            let f = want.captures.get(*step, *stage).unwrap();
            let err = max_abs(t.data(), f.data());
            assert!(err < 0.25, "{storage}: {step}/{stage} is {err} from f32");
        }
        // The probabilities are the attention kernel's f32 values: not rounded.
        assert!(unrounded_probs > 0, "{storage}: attn_probs look rounded to storage");
        let lg = |o: &crate::engine::RunOutput| o.captures.get(Step::Prefill, Stage::Logits).unwrap().data().to_vec();
        assert!(max_abs(&lg(&out), &lg(&want)) > 0.0, "{storage}: no rounding happened");
        // Sampling reads the stored logits.
        for (i, step) in Step::sequence(3).into_iter().enumerate() {
            let l = out.captures.get(step, Stage::Logits).unwrap();
            assert_eq!(out.sampled[i], crate::sampling::argmax(&l.data()[l.numel() - V..]));
        }
        // The KV cache holds the rounded keys: decode equals a full prefill bit for bit.
        let mut all = r.prompt.clone();
        all.extend(&out.sampled[..3]);
        let full = eng.run(&req(all, 0, None), &TapSet::all(L)).unwrap();
        let fl = full.captures.get(Step::Prefill, Stage::Logits).unwrap();
        let last = out.captures.get(Step::Decode(3), Stage::Logits).unwrap();
        assert_eq!(last.data(), &fl.data()[(r.prompt.len() + 2) * V..]);
    }
}

#[test]
fn a_biased_projection_rounds_after_the_gemm_and_after_the_bias() {
    use super::layers::Linear;
    // x·w = 1 + 2^-9 rounds to 1 in bf16; 1 + 2^-8 is then a tie, to even: 1.
    // Rounding once, after the bias, would give round(1 + 3·2^-9) = 1 + 2^-7.
    let lin = Linear {
        w: crate::tensor::Tensor::new(vec![1, 1], vec![1.0]),
        bias: Some(vec![2f32.powi(-8)]),
        out_f: 1,
        in_f: 1,
        q8_block: None,
    };
    let x = [1.0 + 2f32.powi(-9)];
    assert_eq!(lin.forward(&x, 1, DType::BF16), [1.0]);
    assert_eq!(DType::BF16.round(x[0] + 2f32.powi(-8)), 1.0 + 2f32.powi(-7));
    assert_eq!(lin.forward(&x, 1, DType::F32), [1.0 + 3.0 * 2f32.powi(-9)]);
}
