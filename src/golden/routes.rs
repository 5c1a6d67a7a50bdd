//! A golden's routing stages in the canonical layout: `ffn_moe_topk` rows
//! ascending by expert id, `ffn_moe_weights` permuted with them. HF records
//! torch.topk's order (descending score, or unsorted where DeepSeek-V3 asks
//! `sorted=False`), llama.cpp its argsort's: the route is the same set of
//! (expert, weight) pairs in any order, and comparing it needs one.

use std::collections::BTreeMap;

use crate::stage::{BlockStage, Stage, Step};
use crate::tensor::Tensor;

/// Sorts each row of every `ffn_moe_topk` by id, and the row of the same
/// step and layer's `ffn_moe_weights` with it. Rows whose ids are not
/// integers are left as recorded (the checks name them).
pub fn canonicalise(tensors: &mut BTreeMap<(Step, Stage), Tensor>) {
    let keys: Vec<(Step, usize)> = tensors
        .keys()
        .filter_map(|(st, s)| match s {
            Stage::Block(l, BlockStage::FfnMoeTopk) => Some((*st, *l)),
            _ => None,
        })
        .collect();
    for (step, l) in keys {
        let ids = &tensors[&(step, Stage::Block(l, BlockStage::FfnMoeTopk))];
        let Some(&k) = ids.shape().get(1).filter(|_| ids.shape().len() == 2) else {
            continue;
        };
        let orders: Vec<Vec<usize>> = ids
            .data()
            .chunks(k.max(1))
            .map(|row| {
                let mut o: Vec<usize> = (0..row.len()).collect();
                if row.iter().all(|v| v.fract() == 0.0) {
                    o.sort_by(|&a, &b| row[a].total_cmp(&row[b]));
                }
                o
            })
            .collect();
        for b in [BlockStage::FfnMoeTopk, BlockStage::FfnMoeWeights] {
            if let Some(t) = tensors.get_mut(&(step, Stage::Block(l, b))) {
                if t.shape() != [orders.len(), k] {
                    continue;
                }
                let data = t.data_mut();
                for (row, o) in data.chunks_mut(k).zip(&orders) {
                    let old = row.to_vec();
                    for (dst, &src) in row.iter_mut().zip(o) {
                        *dst = old[src];
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_ascend_and_weights_follow() {
        let mut m = BTreeMap::new();
        let s = |b| (Step::Prefill, Stage::Block(1, b));
        m.insert(s(BlockStage::FfnMoeTopk), Tensor::new(vec![2, 2], vec![5.0, 2.0, 1.0, 3.0]));
        m.insert(s(BlockStage::FfnMoeWeights), Tensor::new(vec![2, 2], vec![0.7, 0.3, 0.6, 0.4]));
        canonicalise(&mut m);
        assert_eq!(m[&s(BlockStage::FfnMoeTopk)].data(), &[2.0, 5.0, 1.0, 3.0]);
        assert_eq!(m[&s(BlockStage::FfnMoeWeights)].data(), &[0.3, 0.7, 0.6, 0.4]);
    }
}
