//! `rope`: the stage is its input rotated by RoPE — a norm-preserving
//! rotation by the right angle at every position, the identity at position 0.
//! The input is the pre-RoPE stage of the same layer (`blk.{i}.q` for
//! `q_rope`, `blk.{i}.k` for `k_rope`, or `input:`), tapped beside it.

use std::sync::Arc;

use serde::de::{self, Deserialize, Deserializer};

use crate::checks::facts::Facts;
use crate::checks::family::{Family, Metric};
use crate::checks::invariants;
use crate::checks::kind::{At, Kind, RuleEnv, StageCheck, StageRule};
use crate::checks::params::tol_value;
use crate::checks::verdict::Verdict;
use crate::stage::pattern::StageTemplate;
use crate::stage::{BlockStage, RopeStyle, Stage, VBlock, VisionStage};

/// The rule as written: `rope` or `{rope: {input: "blk.{i}.q", style: neox, tol: 1e-5}}`.
#[derive(Clone, Debug, PartialEq)]
pub struct Rope {
    pub input: Option<StageTemplate>,
    pub style: RopeStyle,
    pub tol: f64,
}

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct Params {
    input: Option<TemplateText>,
    #[serde(default = "default_style")]
    style: StyleName,
    #[serde(default = "default_tol", deserialize_with = "tol_value")]
    tol: f64,
}

#[derive(serde::Deserialize)]
#[serde(rename_all = "lowercase")]
enum StyleName {
    Neox,
    Interleaved,
}

fn default_style() -> StyleName {
    StyleName::Neox
}

fn default_tol() -> f64 {
    1e-5
}

struct TemplateText(StageTemplate);

impl<'de> Deserialize<'de> for TemplateText {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        StageTemplate::parse(&s).map(TemplateText).map_err(de::Error::custom)
    }
}

impl Kind for Rope {
    const NAME: &'static str = "rope";
    const PARAMS: &'static str = "input (blk.{i}.q for q_rope, blk.{i}.k for k_rope; vision.blk.{i}.q / .k in a vision tower), style (neox | interleaved), tol (1e-5)";
    const ABOUT: &'static str = "the stage is its input rotated by RoPE: the identity at position 0, norm-preserving, by position·θ^(−2j/D) at every pair";
    fn bare() -> Self {
        Rope {
            input: None,
            style: RopeStyle::Neox,
            tol: default_tol(),
        }
    }
    fn parse<'de, D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        Ok(match Option::<Params>::deserialize(d)? {
            None => Self::bare(),
            Some(p) => Rope {
                input: p.input.map(|t| t.0),
                style: match p.style {
                    StyleName::Neox => RopeStyle::Neox,
                    StyleName::Interleaved => RopeStyle::Interleaved,
                },
                tol: p.tol,
            },
        })
    }
}

impl StageRule for Rope {
    fn kind(&self) -> &'static str {
        Self::NAME
    }
    /// Without `input:`, q_rope reads q and k_rope reads k.
    fn expand(&self, stage: Stage, _: &RuleEnv) -> Result<Vec<Arc<dyn StageCheck>>, String> {
        let input = match (&self.input, stage) {
            (Some(t), Stage::Block(l, _) | Stage::Vision(VisionStage::Block(l, _))) => t
                .resolve(l)
                .ok_or_else(|| format!("rope input `{}` does not resolve for layer {l}", t.as_str()))?,
            (None, Stage::Vision(VisionStage::Block(i, VBlock::QRope))) => Stage::Vision(VisionStage::Block(i, VBlock::Q)),
            (None, Stage::Vision(VisionStage::Block(i, VBlock::KRope))) => Stage::Vision(VisionStage::Block(i, VBlock::K)),
            (None, Stage::Block(l, BlockStage::QRope)) => Stage::Block(l, BlockStage::Q),
            (None, Stage::Block(l, BlockStage::KRope)) => Stage::Block(l, BlockStage::K),
            _ => {
                return Err(format!(
                    "`rope` on `{stage}` needs `input:` (the pre-RoPE stage, e.g. `blk.{{i}}.q`)"
                ))
            }
        };
        Ok(vec![Arc::new(RopeCheck {
            input,
            style: self.style,
            tol: self.tol,
        })])
    }
}

/// The check at one stage, its input resolved.
#[derive(Clone, Debug, PartialEq)]
pub struct RopeCheck {
    pub input: Stage,
    pub style: RopeStyle,
    pub tol: f64,
}

impl StageCheck for RopeCheck {
    fn id(&self) -> String {
        Rope::NAME.into()
    }
    fn family(&self) -> Family {
        Family::Invariant
    }
    fn metric(&self) -> Option<Metric> {
        Some(Metric::Pos0MaxAbs)
    }
    fn reads(&self, stage: Stage) -> Vec<Stage> {
        vec![stage, self.input]
    }
    fn judge(&self, facts: &Facts, at: &At) -> Verdict {
        let t = match at.capture() {
            Ok(t) => t,
            Err(v) => return v,
        };
        let Ok(input) = at.capture_of(self.input) else {
            return Verdict::fail(format!(
                "the engine returned no capture for the rope input {}/{}",
                at.step, self.input
            ));
        };
        // Each layer rotates by its own base (Gemma 3's local layers have theirs).
        let theta = at.stage.layer().map_or(facts.config.rope_theta, |l| facts.config.rope_theta_of(l));
        // A vision tower's 2-D rotary: the first D/4 pairs turn by the
        // patch's row h, the next D/4 by its column w, each with
        // θ_v^(−2i/(D/2)), i < D/4, θ_v the tower's base.
        if let (Stage::Vision(_), Some(vc)) = (at.stage, &facts.config.vision) {
            let Some(img) = facts.image else {
                return Verdict::not_applicable("the run has no image");
            };
            let dv = vc.head_dim();
            let (q, half) = (dv / 4, dv / 2);
            let rows: Vec<[usize; 3]> = img.grid.patch_hw(vc.merge).into_iter().map(|(h, w)| [h, w, 0]).collect();
            let axes: Vec<usize> = (0..half).map(|j| usize::from(j >= q)).collect();
            let f = invariants::RopeFormula {
                inv_freq: (0..half)
                    .map(|j| vc.rope_theta.powf(-((2 * (j % q)) as f64) / half as f64))
                    .collect(),
                ..invariants::RopeFormula::plain(vc.rope_theta, dv)
            };
            return invariants::rope_axes(input, t, &rows, ["h", "w", "-"], &axes, self.style, self.tol, &f);
        }
        // A VLM's M-RoPE: each frequency turns by its section's axis position.
        if let Some(mr) = &facts.config.mrope {
            let rows = match mrope_rows(facts, at.step) {
                Ok(r) => r,
                Err(m) => return Verdict::fail(format!("rope: the prompt does not fit the image: {m}")),
            };
            let d = facts.config.head_dim;
            let axes: Vec<usize> = (0..d / 2).map(|j| mr.axis_of(j)).collect();
            let f = invariants::RopeFormula::plain(theta, d);
            return invariants::rope_axes(input, t, &rows, ["t", "h", "w"], &axes, self.style, self.tol, &f);
        }
        let positions = at.positions();
        let f = formula(facts, at.stage.layer(), theta, positions);
        invariants::rope_with(input, t, positions, self.style, self.tol, &f)
    }
}

/// The rotation a text layer's `q_rope`/`k_rope` must be: plain RoPE, or the
/// config's scaling at the step's pass length (its last position + 1, HF's
/// `seq_len`: dynamic NTK and LongRoPE choose their table by it).
fn formula(facts: &Facts, layer: Option<usize>, theta: f64, positions: &[usize]) -> invariants::RopeFormula {
    let d = facts.config.head_dim;
    let scaling = match layer {
        Some(l) => facts.config.rope_scaling_of(l),
        None => facts.config.rope_scaling.as_ref(),
    };
    let Some(s) = scaling else {
        return invariants::RopeFormula::plain(theta, d);
    };
    let seq_len = positions.iter().max().map_or(0, |p| p + 1);
    let table = match s.switch_after() {
        Some(b) if seq_len > b => format!(" at seq_len {seq_len} (> {b}: the long table)"),
        Some(b) => format!(" at seq_len {seq_len} (<= {b}: the original table)"),
        None => String::new(),
    };
    invariants::RopeFormula {
        inv_freq: s.inv_freq_f64(d, theta, seq_len),
        scale: s.attention_factor(),
        freq_rel: s.f32_rel_error(),
        what: format!("position·inv_freq[j] of theta {theta} with {}{table}", s.describe()),
    }
}

/// The (t, h, w) positions of a VLM step's rows (`Facts::mrope_positions`).
fn mrope_rows(facts: &Facts, step: crate::stage::Step) -> Result<Vec<[usize; 3]>, String> {
    let p = facts.mrope_positions(step)?;
    let at = |v: i64| usize::try_from(v).map_err(|_| format!("negative position {v}"));
    (0..p[0].len()).map(|r| Ok([at(p[0][r])?, at(p[1][r])?, at(p[2][r])?])).collect()
}
