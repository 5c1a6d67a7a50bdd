//! Mixture-of-experts feed-forward layers as features, read from an HF
//! config: how a token's router logits become the experts it visits and
//! their weights (`Routing`), and which layers route (`Moe::sparse`). The
//! families differ only in these fields:
//!
//! | family     | scores             | choice                     | weights                          | shared expert        |
//! |------------|--------------------|----------------------------|----------------------------------|----------------------|
//! | Mixtral    | softmax(all)       | top-k                      | renormalised                     | —                    |
//! | Qwen2-MoE  | softmax(all)       | top-k                      | `norm_topk_prob` (default false) | σ(gate(x))·MLP(x)    |
//! | Qwen3-MoE  | softmax(all)       | top-k                      | `norm_topk_prob`                 | —                    |
//! | DeepSeek-V3| sigmoid            | top-k of score + bias, in the `topk_group` best groups | unbiased, normalised, × `routed_scaling_factor` | MLP(x) |
//! | gpt-oss    | logits (+ bias)    | top-k                      | softmax over the k               | —                    |
//!
//! The arithmetic of a choice (`select`) lives here too, shared by the
//! engines and the checks that recompute it, so that "the top-k" means one
//! thing: descending score, a tie to the lower expert id (llama.cpp's
//! argsort and the common routing kernels keep index order; torch.topk on
//! CPU leaves equal scores in no set order, so touchstone pins the rule),
//! reported in ascending id order (the canonical layout of
//! `ffn_moe_topk`, which HF's unsorted top-k does not fix).

use serde_json::Value;

use super::features::Activation;

/// What the router's top-k is taken over, and how weights follow from it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Scores {
    /// softmax over every expert's logit (Mixtral, Qwen-MoE).
    Softmax,
    /// σ(logit) per expert (DeepSeek-V3).
    Sigmoid,
    /// The logits themselves; the weights are the softmax over the k chosen
    /// (gpt-oss).
    TopkSoftmax,
}

/// How a token's experts and weights follow from its router logits.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct Routing {
    pub experts: usize,
    pub top_k: usize,
    pub scores: Scores,
    /// Divide the chosen weights by their sum (HF `norm_topk_prob`;
    /// Mixtral always).
    pub norm_topk: bool,
    /// DeepSeek-V3's `e_score_correction_bias`: added to the scores to
    /// choose, never to the weights.
    pub correction_bias: bool,
    /// DeepSeek-V3's `(n_group, topk_group)`: only experts in the
    /// `topk_group` groups with the largest sum of their two best biased
    /// scores may be chosen (the others masked with −∞, as HF does).
    pub groups: Option<(usize, usize)>,
    /// Multiplies the weights (DeepSeek-V3's `routed_scaling_factor`).
    pub scaling: f64,
    /// The router has a bias (gpt-oss).
    pub router_bias: bool,
}

/// A model's MoE layers.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct Moe {
    pub routing: Routing,
    /// Each routed expert's intermediate size.
    pub expert_ffn: usize,
    /// The shared expert's intermediate size, if the model has one.
    pub shared_ffn: Option<usize>,
    /// The shared expert's output is scaled by σ(shared_expert_gate(x)) (Qwen2-MoE).
    pub shared_gate: bool,
    /// Per layer: true where the MLP is routed (the others are dense MLPs of
    /// the config's `intermediate_size`).
    pub sparse: Vec<bool>,
    /// The experts' gated activation (gpt-oss: the clamped SwiGLU; the
    /// others SiLU, as their `hidden_act`).
    pub expert_act: super::features::Activation,
    /// gpt-oss's checkpoint layout: each layer's experts fused and
    /// transposed (`x·W`), gate and up interleaved in columns, with biases
    /// (`model::moe_layout`).
    pub interleaved: bool,
}

fn usize_of(v: &Value, k: &str) -> Result<usize, String> {
    v.get(k)
        .and_then(Value::as_u64)
        .map(|n| n as usize)
        .ok_or_else(|| format!("missing or non-integer key `{k}`"))
}

fn bool_of(v: &Value, k: &str, default: bool) -> Result<bool, String> {
    match v.get(k) {
        None | Some(Value::Null) => Ok(default),
        Some(x) => x.as_bool().ok_or_else(|| format!("`{k}` is {x}, expected true or false")),
    }
}

/// The MoE families touchstone reads (`model_type`s).
pub const MOE_ARCHS: &[&str] = &["mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3", "gpt_oss"];

impl Moe {
    /// The MoE layers of an HF config of family `arch`, None for a dense
    /// family. A routing parameter with a value the engines do not compute
    /// is refused by name.
    pub fn from_config(v: &Value, arch: &str, layers: usize) -> Result<Option<Moe>, String> {
        let moe = match arch {
            "mixtral" => Moe {
                routing: Routing {
                    experts: usize_of(v, "num_local_experts")?,
                    top_k: usize_of(v, "num_experts_per_tok")?,
                    scores: Scores::Softmax,
                    norm_topk: true,
                    correction_bias: false,
                    groups: None,
                    scaling: 1.0,
                    router_bias: false,
                },
                expert_ffn: usize_of(v, "intermediate_size")?,
                shared_ffn: None,
                shared_gate: false,
                sparse: vec![true; layers],
                expert_act: Activation::Silu,
                interleaved: false,
            },
            "qwen2_moe" | "qwen3_moe" => {
                let shared = arch == "qwen2_moe";
                let shared_ffn = match shared {
                    true => Some(usize_of(v, "shared_expert_intermediate_size")?).filter(|&n| n > 0),
                    false => None,
                };
                Moe {
                    routing: Routing {
                        // transformers 5 saves Qwen3-MoE's as `num_local_experts`
                        // (its attribute_map), published configs `num_experts`.
                        experts: usize_of(v, "num_experts").or_else(|_| usize_of(v, "num_local_experts"))?,
                        top_k: usize_of(v, "num_experts_per_tok")?,
                        scores: Scores::Softmax,
                        norm_topk: bool_of(v, "norm_topk_prob", false)?,
                        correction_bias: false,
                        groups: None,
                        scaling: 1.0,
                        router_bias: false,
                    },
                    expert_ffn: usize_of(v, "moe_intermediate_size")?,
                    shared_gate: shared_ffn.is_some(),
                    shared_ffn,
                    sparse: qwen_sparse_layers(v, layers)?,
                    expert_act: Activation::Silu,
                    interleaved: false,
                }
            }
            "deepseek_v3" => {
                let n_shared = match v.get("n_shared_experts") {
                    None | Some(Value::Null) => 0,
                    Some(_) => usize_of(v, "n_shared_experts")?,
                };
                let expert_ffn = usize_of(v, "moe_intermediate_size")?;
                let first_dense = match v.get("first_k_dense_replace") {
                    None | Some(Value::Null) => 0,
                    Some(_) => usize_of(v, "first_k_dense_replace")?,
                };
                let groups = match (v.get("n_group"), v.get("topk_group")) {
                    (Some(g), Some(t)) if !g.is_null() && !t.is_null() => {
                        Some((usize_of(v, "n_group")?, usize_of(v, "topk_group")?))
                    }
                    _ => None,
                };
                let scaling = match v.get("routed_scaling_factor") {
                    None | Some(Value::Null) => 1.0,
                    Some(x) => x.as_f64().ok_or_else(|| format!("`routed_scaling_factor` is {x}, expected a number"))?,
                };
                if let Some(f) = v.get("scoring_func").and_then(Value::as_str).filter(|f| *f != "sigmoid") {
                    return Err(format!(
                        "`scoring_func` is \"{f}\": DeepSeek-V3's routing scores with sigmoid; another scoring is not \
                         implemented by touchstone's engines"
                    ));
                }
                Moe {
                    routing: Routing {
                        experts: usize_of(v, "n_routed_experts").or_else(|_| usize_of(v, "num_local_experts"))?,
                        top_k: usize_of(v, "num_experts_per_tok")?,
                        scores: Scores::Sigmoid,
                        norm_topk: bool_of(v, "norm_topk_prob", true)?,
                        correction_bias: true,
                        groups,
                        scaling,
                        router_bias: false,
                    },
                    expert_ffn,
                    shared_ffn: (n_shared > 0).then_some(expert_ffn * n_shared),
                    shared_gate: false,
                    // HF: layer i routes where i >= first_k_dense_replace.
                    sparse: (0..layers).map(|i| i >= first_dense).collect(),
                    expert_act: Activation::Silu,
                    interleaved: false,
                }
            }
            "gpt_oss" => {
                let num = |k: &str, default: f64| match v.get(k) {
                    None | Some(Value::Null) => Ok(default),
                    Some(x) => x.as_f64().ok_or_else(|| format!("`{k}` is {x}, expected a number")),
                };
                // HF's GptOssConfig defaults.
                let (alpha, limit) = (num("swiglu_alpha", 1.702)?, num("swiglu_limit", 7.0)?);
                if !(alpha.is_finite() && limit.is_finite() && limit > 0.0) {
                    return Err(format!("`swiglu_alpha` {alpha} / `swiglu_limit` {limit}: expected finite numbers, a positive limit"));
                }
                Moe {
                    routing: Routing {
                        experts: usize_of(v, "num_local_experts")?,
                        top_k: usize_of(v, "num_experts_per_tok")?,
                        scores: Scores::TopkSoftmax,
                        norm_topk: false,
                        correction_bias: false,
                        groups: None,
                        scaling: 1.0,
                        router_bias: true,
                    },
                    expert_ffn: usize_of(v, "intermediate_size")?,
                    shared_ffn: None,
                    shared_gate: false,
                    sparse: vec![true; layers],
                    expert_act: Activation::ClampedSwiglu {
                        alpha: alpha as f32,
                        limit: limit as f32,
                    },
                    interleaved: true,
                }
            }
            _ => return Ok(None),
        };
        moe.validate()?;
        Ok(Some(moe))
    }

    pub fn validate(&self) -> Result<(), String> {
        let r = &self.routing;
        if r.experts == 0 || r.experts > 1 << 16 {
            return Err(format!("the number of experts is {}; 1 ..= 65536 are accepted", r.experts));
        }
        if r.top_k == 0 || r.top_k > r.experts {
            return Err(format!(
                "`num_experts_per_tok` is {} but there are {} experts",
                r.top_k, r.experts
            ));
        }
        if self.expert_ffn == 0 || self.expert_ffn > 1 << 22 {
            return Err(format!("the expert intermediate size is {}", self.expert_ffn));
        }
        if let Some((g, tg)) = r.groups {
            // The CUDA kernel keeps a bit per group (`cuda/moe.cu`).
            if g > 64 {
                return Err(format!("`n_group` is {g}; at most 64 groups are implemented"));
            }
            if g == 0 || !r.experts.is_multiple_of(g) || r.experts / g < 2 || tg == 0 || tg > g {
                return Err(format!(
                    "`n_group` {g} / `topk_group` {tg} do not fit {} experts (groups of at least 2, topk_group ≤ n_group)",
                    r.experts
                ));
            }
            if tg * (r.experts / g) < r.top_k {
                return Err(format!(
                    "`topk_group` {tg} groups of {} experts cannot hold top-k {}",
                    r.experts / g,
                    r.top_k
                ));
            }
        }
        if !r.scaling.is_finite() || r.scaling <= 0.0 {
            return Err(format!("`routed_scaling_factor` is {}", r.scaling));
        }
        Ok(())
    }

    /// Whether layer `l` routes.
    pub fn is_sparse(&self, l: usize) -> bool {
        self.sparse.get(l) == Some(&true)
    }
}

/// Qwen2/3-MoE's routed layers, as HF builds them: layer i is sparse unless
/// listed in `mlp_only_layers`, and only where (i + 1) % decoder_sparse_step
/// is 0.
fn qwen_sparse_layers(v: &Value, layers: usize) -> Result<Vec<bool>, String> {
    let step = match v.get("decoder_sparse_step") {
        None | Some(Value::Null) => 1,
        Some(_) => usize_of(v, "decoder_sparse_step")?,
    };
    if step == 0 {
        return Err("`decoder_sparse_step` must be positive".into());
    }
    let dense: Vec<usize> = match v.get("mlp_only_layers") {
        None | Some(Value::Null) => Vec::new(),
        Some(x) => x
            .as_array()
            .and_then(|a| a.iter().map(|i| i.as_u64().map(|n| n as usize)).collect())
            .ok_or_else(|| format!("`mlp_only_layers` is {x}, expected a list of layer indices"))?,
    };
    Ok((0..layers).map(|i| !dense.contains(&i) && (i + 1) % step == 0).collect())
}

/// One token's routing: the chosen experts in ascending id order and their
/// weights, in f64 from the scores given (the engines pass their f32 values
/// widened; the checks the engine's own tapped scores).
#[derive(Clone, Debug, PartialEq)]
pub struct Route {
    pub ids: Vec<usize>,
    pub weights: Vec<f64>,
}

/// The selection scores of one token from its router logits: softmax or
/// sigmoid (+ correction bias), or the logits themselves.
pub fn selection_scores(r: &Routing, logits: &[f64], bias: Option<&[f64]>) -> Vec<f64> {
    let mut s = unbiased_scores(r.scores, logits);
    if let Some(b) = bias {
        s.iter_mut().zip(b).for_each(|(s, b)| *s += b);
    }
    s
}

/// softmax / sigmoid of the logits (the logits for top-k-then-softmax).
pub fn unbiased_scores(kind: Scores, logits: &[f64]) -> Vec<f64> {
    match kind {
        Scores::Softmax => {
            let m = logits.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let e: Vec<f64> = logits.iter().map(|x| (x - m).exp()).collect();
            let s: f64 = e.iter().sum();
            e.into_iter().map(|x| x / s).collect()
        }
        Scores::Sigmoid => logits.iter().map(|x| 1.0 / (1.0 + (-x).exp())).collect(),
        Scores::TopkSoftmax => logits.to_vec(),
    }
}

/// The experts eligible under group-limited routing (all, without groups):
/// per group the sum of its two largest scores, the `topk_group` best
/// groups kept (a tie to the lower group).
pub fn eligible(r: &Routing, scores: &[f64]) -> Vec<bool> {
    let Some((g, tg)) = r.groups else {
        return vec![true; scores.len()];
    };
    let per = scores.len() / g;
    let group_score: Vec<f64> = scores
        .chunks(per)
        .map(|c| {
            let mut v = c.to_vec();
            v.sort_by(|a, b| b.total_cmp(a));
            v[0] + v[1]
        })
        .collect();
    let kept = top_indices(&group_score, tg);
    (0..scores.len()).map(|e| kept.contains(&(e / per))).collect()
}

/// The indices of the `k` largest values, descending, a tie to the lower
/// index (a stable sort).
pub fn top_indices(v: &[f64], k: usize) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..v.len()).collect();
    idx.sort_by(|&a, &b| v[b].total_cmp(&v[a]));
    idx.truncate(k);
    idx
}

/// A token's route from its selection scores `sel` (biased where the model
/// has a bias) and unbiased scores `raw`: the top-k of the eligible experts,
/// weights the unbiased scores there, normalised (over the k: softmax for
/// top-k-then-softmax) and scaled as configured.
pub fn select(r: &Routing, sel: &[f64], raw: &[f64]) -> Route {
    let ok = eligible(r, sel);
    let masked: Vec<f64> = sel
        .iter()
        .zip(&ok)
        .map(|(s, ok)| if *ok { *s } else { f64::NEG_INFINITY })
        .collect();
    let mut ids = top_indices(&masked, r.top_k);
    ids.sort_unstable();
    Route {
        weights: weights_at(r, raw, &ids),
        ids,
    }
}

/// The weights of experts `ids` from the unbiased scores.
pub fn weights_at(r: &Routing, raw: &[f64], ids: &[usize]) -> Vec<f64> {
    let mut w: Vec<f64> = ids.iter().map(|&i| raw[i]).collect();
    if r.scores == Scores::TopkSoftmax {
        w = unbiased_scores(Scores::Softmax, &w);
    } else if r.norm_topk {
        let s: f64 = w.iter().sum();
        w.iter_mut().for_each(|x| *x /= s);
    }
    w.iter_mut().for_each(|x| *x *= r.scaling);
    w
}

#[cfg(test)]
mod tests {
    use super::*;

    fn routing(scores: Scores) -> Routing {
        Routing {
            experts: 8,
            top_k: 2,
            scores,
            norm_topk: true,
            correction_bias: false,
            groups: None,
            scaling: 1.0,
            router_bias: false,
        }
    }

    #[test]
    fn ties_go_to_the_lower_id_and_ids_come_ascending() {
        let r = routing(Scores::Softmax);
        let s = [0.1, 0.3, 0.05, 0.3, 0.05, 0.1, 0.05, 0.05];
        let route = select(&r, &s, &s);
        assert_eq!(route.ids, vec![1, 3]);
        assert!((route.weights[0] - 0.5).abs() < 1e-15);
        let s = [0.1, 0.2, 0.05, 0.3, 0.05, 0.2, 0.05, 0.05];
        assert_eq!(select(&r, &s, &s).ids, vec![1, 3], "tie between 1 and 5 to 1");
    }

    #[test]
    fn groups_mask_and_bias_chooses_but_does_not_weigh() {
        let mut r = routing(Scores::Sigmoid);
        r.groups = Some((4, 2));
        r.scaling = 2.5;
        // Group scores (top-2 sums): g0 0.9+0.8, g1 0.95+0.1, g2 0.5+0.5, g3 0.2+0.1.
        let raw = [0.9, 0.8, 0.95, 0.1, 0.5, 0.5, 0.2, 0.1];
        let route = select(&r, &raw, &raw);
        // g0 (1.7) and g1 (1.05) kept over g2 (1.0): 0.95 at 2 and 0.9 at 0.
        assert_eq!(route.ids, vec![0, 2]);
        let s = 0.9 + 0.95;
        assert!((route.weights[0] - 0.9 / s * 2.5).abs() < 1e-12);
        // A bias that lifts expert 6 (and its group) into the choice leaves
        // its weight unbiased.
        let mut sel = raw;
        sel[6] += 1.0;
        let route = select(&r, &sel, &raw);
        assert_eq!(route.ids, vec![0, 6]);
        assert!((route.weights[1] - 0.2 / (0.9 + 0.2) * 2.5).abs() < 1e-12);
    }

    #[test]
    fn topk_then_softmax_weighs_over_the_k() {
        let r = routing(Scores::TopkSoftmax);
        let l = [1.0, 3.0, 0.0, 2.0, -1.0, 0.5, 0.0, 0.0];
        let route = select(&r, &l, &l);
        assert_eq!(route.ids, vec![1, 3]);
        let e = (1.0f64).exp();
        assert!((route.weights[0] - e / (e + 1.0)).abs() < 1e-12);
    }
}
