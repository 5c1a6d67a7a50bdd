//! `bidirectional`: a vision tower's attention sees the whole image — no
//! head puts exactly 0 on every key after the query (the signature of a
//! causal mask left on). A softmax gives exactly 0 only where exp
//! underflows, a score gap beyond ~104 for every later key of every row of
//! a head, so a correct tower never fails. Rows still summing to 1 is
//! `softmax_rows`' claim.

use std::sync::Arc;

use serde::de::{Deserialize, Deserializer};

use crate::checks::facts::Facts;
use crate::checks::family::{Family, Metric};
use crate::checks::kind::{At, Kind, RuleEnv, StageCheck, StageRule};
use crate::checks::params::Empty;
use crate::checks::verdict::Verdict;
use crate::stage::{Stage, Step, VBlock, VisionStage};

#[derive(Clone, Debug, PartialEq)]
pub struct Bidirectional;

impl Kind for Bidirectional {
    const NAME: &'static str = "bidirectional";
    const PARAMS: &'static str = "none";
    const ABOUT: &'static str = "vision.blk.*.attn_probs only: no head is causal (every head puts weight on some key \
                                 after its query)";
    fn bare() -> Self {
        Bidirectional
    }
    fn parse<'de, D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        Empty::deserialize(d).map(|_| Bidirectional)
    }
}

impl StageRule for Bidirectional {
    fn kind(&self) -> &'static str {
        Self::NAME
    }
    fn expand(&self, stage: Stage, _: &RuleEnv) -> Result<Vec<Arc<dyn StageCheck>>, String> {
        if !matches!(stage, Stage::Vision(VisionStage::Block(_, VBlock::AttnProbs))) {
            return Err(format!("`bidirectional` applies to vision.blk.*.attn_probs, not `{stage}`"));
        }
        Ok(vec![Arc::new(Bidirectional)])
    }
}

impl StageCheck for Bidirectional {
    fn id(&self) -> String {
        Self::NAME.into()
    }
    fn family(&self) -> Family {
        Family::Invariant
    }
    fn metric(&self) -> Option<Metric> {
        Some(Metric::FutureMaxAbs)
    }
    fn planned(&self, step: Step, _: Stage, _: &Facts) -> bool {
        step == Step::Prefill
    }
    fn judge(&self, _: &Facts, at: &At) -> Verdict {
        let t = match at.capture() {
            Ok(t) => t,
            Err(v) => return v,
        };
        let [h, n, s] = t.shape() else {
            return Verdict::fail(format!("attn_probs has shape {:?}, expected [H, N, N]", t.shape()));
        };
        let (h, n, s) = (*h, *n, *s);
        if n != s || n < 2 {
            return Verdict::fail(format!("attn_probs has shape {:?}, expected [H, N, N] with N ≥ 2", t.shape()));
        }
        // Per head: the largest weight on a later key.
        let mut least = f64::INFINITY;
        let mut causal_heads = Vec::new();
        for head in 0..h {
            let mut future = 0.0f64;
            for r in 0..n - 1 {
                let row = &t.data()[(head * n + r) * n..][..n];
                future = row[r + 1..].iter().fold(future, |m, &p| m.max(p as f64));
            }
            least = least.min(future);
            if future == 0.0 {
                causal_heads.push(head);
            }
        }
        if causal_heads.is_empty() {
            Verdict::pass(format!(
                "every one of {h} heads weighs keys after its queries (least head's largest such weight {least:.3e})"
            ))
            .metric("future_max_abs", least)
        } else {
            Verdict::fail(format!(
                "head(s) {causal_heads:?} of {h} put exactly 0 on every key after each query: the vision attention is \
                 masked causally (an image's patches attend to each other both ways)"
            ))
            .metric("future_max_abs", least)
        }
    }
}
