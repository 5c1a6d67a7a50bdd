//! `moe_route` on the emulated device against `model::moe::select`, for
//! every kind of routing (including DeepSeek-V3's groups, bias and scale
//! and gpt-oss's top-k-then-softmax) and rows with exactly tied scores.

use crate::engine::cuda::seam::Dev;
use crate::model::moe::{self, Routing, Scores};

/// Runs moe_route_f32 over `logits` (`[rows, n]`): (probs, ids, weights).
fn route_on_device(r: &Routing, logits: &[f32], bias: Option<&[f32]>) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let dev = Dev::emu();
    let (n, k) = (r.experts, r.top_k);
    let rows = logits.len() / n;
    let l = dev.upload("logits", logits).unwrap();
    let b = bias.map(|b| dev.upload("bias", b).unwrap());
    let mut p = dev.alloc::<f32>("probs", rows * n).unwrap();
    let mut i = dev.alloc::<f32>("ids", rows * k).unwrap();
    let mut w = dev.alloc::<f32>("weights", rows * k).unwrap();
    let f = dev.kernel("moe_route_f32").unwrap();
    {
        let (mut pv, mut iv, mut wv) = (p.view_mut(..), i.view_mut(..), w.view_mut(..));
        let bv = b.as_ref().map(|b| b.view(..));
        super::launch_route(&dev, &f, r, l.view(..), bv, &mut pv, &mut iv, &mut wv, rows).unwrap();
    }
    (
        dev.download(p.view(..)).unwrap(),
        dev.download(i.view(..)).unwrap(),
        dev.download(w.view(..)).unwrap(),
    )
}

fn routing(scores: Scores, norm: bool, groups: Option<(usize, usize)>, scaling: f64, top_k: usize) -> Routing {
    Routing {
        experts: 8,
        top_k,
        scores,
        norm_topk: norm,
        correction_bias: scores == Scores::Sigmoid,
        groups,
        scaling,
        router_bias: false,
    }
}

#[test]
fn the_kernel_routes_as_the_reference_rule_for_every_family() {
    // Pseudo-random logits, then a row whose 2nd and 3rd best (experts 3
    // and 5) tie exactly: the lower id is chosen.
    let mut logits: Vec<f32> = (0..8 * 9).map(|i| ((i * 37 % 23) as f32 - 11.0) * 0.31).collect();
    logits.extend([0.1, -0.2, 1.5, 0.3, -1.0, 0.3, 0.2, -0.4]);
    let bias: Vec<f32> = (0..8).map(|j| (j as f32 - 3.5) * 0.05).collect();
    let cases = [
        routing(Scores::Softmax, true, None, 1.0, 2),
        routing(Scores::Softmax, false, None, 1.0, 2),
        routing(Scores::Sigmoid, true, Some((4, 2)), 2.5, 3),
        routing(Scores::TopkSoftmax, false, None, 1.0, 2),
    ];
    for r in cases {
        let b = r.correction_bias.then_some(&bias[..]);
        let (probs, ids, weights) = route_on_device(&r, &logits, b);
        let (n, k) = (r.experts, r.top_k);
        for row in 0..logits.len() / n {
            let x: Vec<f64> = logits[row * n..][..n].iter().map(|&v| v as f64).collect();
            let bw: Option<Vec<f64>> = b.map(|b| b.iter().map(|&v| v as f64).collect());
            let sel = moe::selection_scores(&r, &x, bw.as_deref());
            let raw = moe::unbiased_scores(r.scores, &x);
            for j in 0..n {
                assert!((probs[row * n + j] as f64 - sel[j]).abs() <= 1e-6 * sel[j].abs().max(1.0), "{r:?} row {row}");
            }
            // The device's own scores choose: the reference rule on them.
            let dev_sel: Vec<f64> = probs[row * n..][..n].iter().map(|&v| v as f64).collect();
            let want = moe::select(&r, &dev_sel, &raw);
            let got: Vec<usize> = ids[row * k..][..k].iter().map(|&v| v as usize).collect();
            assert_eq!(got, want.ids, "{r:?} row {row}");
            for c in 0..k {
                let w = weights[row * k + c] as f64;
                assert!((w - want.weights[c]).abs() <= 1e-6 * want.weights[c].abs(), "{r:?} row {row}: {w} vs {}", want.weights[c]);
            }
        }
        if r.scores == Scores::Softmax {
            assert_eq!(&ids[9 * k..9 * k + 2], &[2.0, 3.0], "the tie goes to the lower id");
        }
    }
}
