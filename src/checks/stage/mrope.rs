//! `mrope`: a vision-language model's M-RoPE position ids (`positions`,
//! `[3, T]`) follow the prompt and the image grid: text tokens count up on
//! all three axes; image k's tokens take (st + t, st + h, st + w) over its
//! merged grid, st being the position after the text before it; text after
//! the image resumes at the image's largest position + 1; a decode step sits
//! at its cache position plus the prefill's delta (max + 1 − T) on every
//! axis. Computed from the tokens the engine was fed and the grid
//! (`model::vision::mrope_positions`), compared exactly, and a failure says
//! which of those properties broke first.

use std::sync::Arc;

use serde::de::{Deserialize, Deserializer};

use crate::checks::facts::Facts;
use crate::checks::family::Family;
use crate::checks::kind::{At, Kind, RuleEnv, StageCheck, StageRule};
use crate::checks::params::Empty;
use crate::checks::verdict::Verdict;
use crate::model::vision::mrope_positions;
use crate::stage::{Stage, Step};

#[derive(Clone, Debug, PartialEq)]
pub struct Mrope;

impl Kind for Mrope {
    const NAME: &'static str = "mrope";
    const PARAMS: &'static str = "none";
    const ABOUT: &'static str = "positions only: M-RoPE ids follow the image grid (t, h, w), text resumes after the \
                                 image's largest position, decode steps add the prefill's delta";
    fn bare() -> Self {
        Mrope
    }
    fn parse<'de, D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        Empty::deserialize(d).map(|_| Mrope)
    }
}

impl StageRule for Mrope {
    fn kind(&self) -> &'static str {
        Self::NAME
    }
    fn expand(&self, stage: Stage, _: &RuleEnv) -> Result<Vec<Arc<dyn StageCheck>>, String> {
        if stage != Stage::Positions {
            return Err(format!("`mrope` applies to positions, not `{stage}`"));
        }
        Ok(vec![Arc::new(Mrope)])
    }
}

impl StageCheck for Mrope {
    fn id(&self) -> String {
        Self::NAME.into()
    }
    fn family(&self) -> Family {
        Family::Invariant
    }
    fn judge(&self, facts: &Facts, at: &At) -> Verdict {
        let Some(vc) = &facts.config.vision else {
            return Verdict::not_applicable("the model has no M-RoPE");
        };
        let got = match at.capture() {
            Ok(t) => t,
            Err(v) => return v,
        };
        let grids: Vec<_> = facts.image.iter().map(|i| i.grid).collect();
        let (delta, want) = match (
            mrope_positions(facts.prompt, vc.image_token, &grids, vc.merge),
            facts.mrope_positions(at.step),
        ) {
            (Ok((_, delta)), Ok(want)) => (delta, want),
            (Err(m), _) | (_, Err(m)) => return Verdict::fail(format!("the prompt does not fit the image: {m}")),
        };
        let run_t = facts.step_dims(at.step).0;
        let first = match at.step {
            Step::Prefill => 0,
            Step::Decode(n) => facts.prompt.len() + n - 1,
        };
        if got.shape() != [3, run_t] {
            return Verdict::fail(format!("positions have shape {:?}, expected [3, {run_t}]", got.shape()));
        }
        let axis = ["t", "h", "w"];
        // `r` indexes three axes of both tensors and the prompt at once.
        #[allow(clippy::needless_range_loop)]
        for r in 0..run_t {
            let g: Vec<i64> = (0..3).map(|a| got.data()[a * run_t + r] as i64).collect();
            let w: Vec<i64> = (0..3).map(|a| want[a][r]).collect();
            if g != w {
                let token = first + r;
                let is_image = at.step == Step::Prefill && facts.prompt[r] == vc.image_token;
                let what = if is_image {
                    let all_equal = g[0] == g[1] && g[1] == g[2];
                    format!(
                        "image token {token} is at (t, h, w) = ({}, {}, {}), the grid puts it at ({}, {}, {}){}",
                        g[0],
                        g[1],
                        g[2],
                        w[0],
                        w[1],
                        w[2],
                        if all_equal {
                            ": equal on every axis, as 1-D positions are"
                        } else {
                            ""
                        }
                    )
                } else {
                    let after_image = facts.prompt[..token.min(facts.prompt.len())].contains(&vc.image_token);
                    let wrong_axes: Vec<&str> = (0..3).filter(|&a| g[a] != w[a]).map(|a| axis[a]).collect();
                    format!(
                        "text token {token} is at {:?}, expected {} on every axis{} (axes {} differ)",
                        g,
                        w[0],
                        if after_image {
                            format!(" (text resumes after the image's largest position; delta {delta})")
                        } else {
                            String::new()
                        },
                        wrong_axes.join(", ")
                    )
                };
                return Verdict::fail(what);
            }
        }
        Verdict::pass(format!(
            "{run_t} token(s) at the M-RoPE positions of the prompt and grid {} (delta {delta})",
            grids
                .iter()
                .map(|g| g.to_string())
                .collect::<Vec<_>>()
                .join(", ")
        ))
    }
}
