//! The vision tower of Qwen2-VL and Qwen3-VL on the CPU, in HF's order of f32
//! operations: the Conv3d patch embedding as a matmul over each flattened
//! patch, Qwen3-VL's learned position table resampled bilinearly to the grid,
//! blocks of LayerNorm → fused qkv → 2-D (h, w) rotary → bidirectional
//! attention → proj → residual → LayerNorm → MLP → residual, then the patch
//! merger (LayerNorm, each m×m window concatenated into one row, MLP with
//! exact GELU) and Qwen3-VL's deepstack mergers. Every stage is tapped at the
//! prefill in its canonical layout (docs/stages-and-checks.md).

use crate::engine::ImageInput;
use crate::error::{Error, Result};
use crate::model::vision::{VisionAct, VisionConfig, VisionFamily};
use crate::model::{ModelConfig, Weights};
use crate::stage::{Stage, VBlock, VisionStage as VS};
use crate::tensor::DType;

use super::attention::{attend, AttnShape};
use super::layers::Linear;
use super::mutants::Mutant;
use super::ops::{add, gelu_tanh};
use super::tap::Tap;

/// An `nn.LayerNorm`'s weight and bias.
#[derive(Clone, Debug)]
pub struct LayerNorm {
    pub w: Vec<f32>,
    pub b: Vec<f32>,
}

impl LayerNorm {
    pub(crate) fn load(ws: &mut Weights, prefix: &str, width: usize) -> Result<LayerNorm> {
        Ok(LayerNorm {
            w: ws.take(&format!("{prefix}.weight"), &[width])?.into_data(),
            b: ws.take(&format!("{prefix}.bias"), &[width])?.into_data(),
        })
    }

    /// `(x − mean)·rsqrt(var + eps)·w + b` over rows of `width` (biased
    /// variance, as torch). The moments are accumulated in f64 and rounded
    /// once: torch's CPU kernel (Welford in f32 with cascaded partials) is
    /// within an ulp of them, and the tolerance of the golden checks is
    /// derived from such roundings, not from one summation order.
    pub fn forward(&self, x: &[f32], width: usize, eps: f64) -> Vec<f32> {
        let mut out = vec![0.0f32; x.len()];
        for (row, o) in x.chunks_exact(width).zip(out.chunks_exact_mut(width)) {
            let mean = row.iter().map(|&v| v as f64).sum::<f64>() / width as f64;
            let var = row.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / width as f64;
            let (mean, rstd) = (mean as f32, (1.0 / (var + eps).sqrt()) as f32);
            for (((o, &v), &w), &b) in o.iter_mut().zip(row).zip(&self.w).zip(&self.b) {
                *o = (v - mean) * rstd * w + b;
            }
        }
        out
    }
}

/// A patch merger: LayerNorm, windows of m² rows concatenated, fc1, GELU, fc2.
#[derive(Clone, Debug)]
pub struct Merger {
    pub norm: LayerNorm,
    /// Qwen3-VL's deepstack mergers norm the concatenated rows (m²·Ev wide);
    /// the main merger norms each patch row (Ev wide) before concatenating.
    pub postshuffle: bool,
    pub fc1: Linear,
    pub fc2: Linear,
}

/// One vision block.
#[derive(Clone, Debug)]
pub struct VisionBlock {
    pub norm1: LayerNorm,
    pub qkv: Linear,
    pub proj: Linear,
    pub norm2: LayerNorm,
    pub fc1: Linear,
    pub fc2: Linear,
}

/// Every weight of the tower.
#[derive(Clone, Debug)]
pub struct VisionWeights {
    /// The Conv3d kernel as `[Ev, C·T·P·P]` (bias: Qwen3-VL only).
    pub patch: Linear,
    /// Qwen3-VL's learned position table `[n, Ev]`.
    pub pos_embed: Option<Vec<f32>>,
    pub blocks: Vec<VisionBlock>,
    pub merger: Merger,
    pub deepstack: Vec<Merger>,
}

impl VisionWeights {
    /// Takes the tower's weights (canonical names, `model::vision::canonical_name`).
    pub fn load(cfg: &ModelConfig, vc: &VisionConfig, ws: &mut Weights) -> Result<VisionWeights> {
        // LLaVA's CLIP tower is `clip::ClipWeights`: the arms below that
        // name it with Qwen2-VL are never reached for it.
        if vc.llava.is_some() {
            return Err(Error::model(&ws.dir, "a LLaVA tower is loaded by engine::cpu::clip, not as Qwen-VL's"));
        }
        let (ev, fv, e, m2) = (vc.hidden, vc.ffn, cfg.hidden, vc.merge * vc.merge);
        let pw = vc.patch_width();
        let kernel = [ev, vc.in_channels, vc.temporal_patch, vc.patch, vc.patch];
        let w = ws
            .take("visual.patch_embed.proj.weight", &kernel)?
            .reshaped(vec![ev, pw]);
        let bias = ws
            .take_opt("visual.patch_embed.proj.bias", &[ev])?
            .map(|t| t.into_data());
        if bias.is_some() != (vc.family == VisionFamily::Qwen3Vl) {
            return Err(Error::model(
                &ws.dir,
                "the patch embedding's bias does not match the family (Qwen3-VL has one, Qwen2-VL none)",
            ));
        }
        let patch = Linear::from_parts(w, bias, ev, pw);
        let pos_embed = match vc.pos_embeds {
            Some(n) => Some(ws.take("visual.pos_embed.weight", &[n, ev])?.into_data()),
            None => None,
        };
        let (fc1, fc2) = match vc.family {
            VisionFamily::Qwen2Vl | VisionFamily::Llava | VisionFamily::LlavaNext => ("mlp.fc1", "mlp.fc2"),
            VisionFamily::Qwen3Vl => ("mlp.linear_fc1", "mlp.linear_fc2"),
        };
        let mut blocks = Vec::with_capacity(vc.depth);
        for i in 0..vc.depth {
            let p = format!("visual.blocks.{i}");
            blocks.push(VisionBlock {
                norm1: LayerNorm::load(ws, &format!("{p}.norm1"), ev)?,
                qkv: Linear::load(ws, &format!("{p}.attn.qkv"), 3 * ev, ev)?,
                proj: Linear::load(ws, &format!("{p}.attn.proj"), ev, ev)?,
                norm2: LayerNorm::load(ws, &format!("{p}.norm2"), ev)?,
                fc1: Linear::load(ws, &format!("{p}.{fc1}"), fv, ev)?,
                fc2: Linear::load(ws, &format!("{p}.{fc2}"), ev, fv)?,
            });
        }
        let merger = match vc.family {
            VisionFamily::Qwen2Vl | VisionFamily::Llava | VisionFamily::LlavaNext => Merger {
                norm: LayerNorm::load(ws, "visual.merger.ln_q", ev)?,
                postshuffle: false,
                fc1: Linear::load(ws, "visual.merger.mlp.0", m2 * ev, m2 * ev)?,
                fc2: Linear::load(ws, "visual.merger.mlp.2", e, m2 * ev)?,
            },
            VisionFamily::Qwen3Vl => qwen3_merger(ws, "visual.merger", ev, m2, e, false)?,
        };
        let deepstack = (0..vc.deepstack.len())
            .map(|j| qwen3_merger(ws, &format!("visual.deepstack_merger_list.{j}"), ev, m2, e, true))
            .collect::<Result<_>>()?;
        Ok(VisionWeights {
            patch,
            pos_embed,
            blocks,
            merger,
            deepstack,
        })
    }

    /// Every linear of the tower (storage rounding).
    pub fn linears_mut(&mut self) -> Vec<&mut Linear> {
        let mut v: Vec<&mut Linear> = vec![&mut self.patch];
        for b in &mut self.blocks {
            v.extend([&mut b.qkv, &mut b.proj, &mut b.fc1, &mut b.fc2]);
        }
        for m in std::iter::once(&mut self.merger).chain(self.deepstack.iter_mut()) {
            v.extend([&mut m.fc1, &mut m.fc2]);
        }
        v
    }

    /// Every tensor held, by canonical HF name (`Engine::visit_weights`).
    pub fn visit(&self, vc: &VisionConfig, f: &mut crate::engine::WeightVisitor) {
        let lin = |f: &mut crate::engine::WeightVisitor, name: &str, shape: &[usize], l: &Linear| {
            f(&format!("{name}.weight"), shape, l.w.data());
            if let Some(b) = &l.bias {
                f(&format!("{name}.bias"), &[l.out_f], b);
            }
        };
        let ln = |f: &mut crate::engine::WeightVisitor, name: &str, n: &LayerNorm| {
            f(&format!("{name}.weight"), &[n.w.len()], &n.w);
            f(&format!("{name}.bias"), &[n.b.len()], &n.b);
        };
        let kernel = [vc.hidden, vc.in_channels, vc.temporal_patch, vc.patch, vc.patch];
        lin(f, "visual.patch_embed.proj", &kernel, &self.patch);
        if let Some(p) = &self.pos_embed {
            f("visual.pos_embed.weight", &[p.len() / vc.hidden, vc.hidden], p);
        }
        let (fc1, fc2) = match vc.family {
            VisionFamily::Qwen2Vl | VisionFamily::Llava | VisionFamily::LlavaNext => ("mlp.fc1", "mlp.fc2"),
            VisionFamily::Qwen3Vl => ("mlp.linear_fc1", "mlp.linear_fc2"),
        };
        for (i, b) in self.blocks.iter().enumerate() {
            let p = format!("visual.blocks.{i}");
            ln(f, &format!("{p}.norm1"), &b.norm1);
            lin(f, &format!("{p}.attn.qkv"), &[b.qkv.out_f, b.qkv.in_f], &b.qkv);
            lin(f, &format!("{p}.attn.proj"), &[b.proj.out_f, b.proj.in_f], &b.proj);
            ln(f, &format!("{p}.norm2"), &b.norm2);
            lin(f, &format!("{p}.{fc1}"), &[b.fc1.out_f, b.fc1.in_f], &b.fc1);
            lin(f, &format!("{p}.{fc2}"), &[b.fc2.out_f, b.fc2.in_f], &b.fc2);
        }
        let m = &self.merger;
        let (mn, m1, m2) = match vc.family {
            VisionFamily::Qwen2Vl | VisionFamily::Llava | VisionFamily::LlavaNext => ("visual.merger.ln_q", "visual.merger.mlp.0", "visual.merger.mlp.2"),
            VisionFamily::Qwen3Vl => (
                "visual.merger.norm",
                "visual.merger.linear_fc1",
                "visual.merger.linear_fc2",
            ),
        };
        ln(f, mn, &m.norm);
        lin(f, m1, &[m.fc1.out_f, m.fc1.in_f], &m.fc1);
        lin(f, m2, &[m.fc2.out_f, m.fc2.in_f], &m.fc2);
        for (j, d) in self.deepstack.iter().enumerate() {
            let p = format!("visual.deepstack_merger_list.{j}");
            ln(f, &format!("{p}.norm"), &d.norm);
            lin(f, &format!("{p}.linear_fc1"), &[d.fc1.out_f, d.fc1.in_f], &d.fc1);
            lin(f, &format!("{p}.linear_fc2"), &[d.fc2.out_f, d.fc2.in_f], &d.fc2);
        }
    }
}

fn qwen3_merger(ws: &mut Weights, p: &str, ev: usize, m2: usize, e: usize, post: bool) -> Result<Merger> {
    Ok(Merger {
        norm: LayerNorm::load(ws, &format!("{p}.norm"), if post { m2 * ev } else { ev })?,
        postshuffle: post,
        fc1: Linear::load(ws, &format!("{p}.linear_fc1"), m2 * ev, m2 * ev)?,
        fc2: Linear::load(ws, &format!("{p}.linear_fc2"), e, m2 * ev)?,
    })
}

/// What the tower hands the language model: the image tokens' features
/// (`vision.merger`, `[M, E]`) and Qwen3-VL's deepstack features.
pub struct ImageFeatures {
    pub merger: Vec<f32>,
    /// Rows of `merger` (M, unless a planted bug miscounts them).
    pub rows: usize,
    pub deepstack: Vec<Vec<f32>>,
}

/// HF `quick_gelu`: `x·σ(1.702·x)`.
pub(crate) fn quick_gelu(x: f32) -> f32 {
    x * (1.0 / (1.0 + (-(1.702f32 * x)).exp()))
}

/// torch's exact `nn.GELU`: `x·½·(1 + erf(x/√2))`.
pub(crate) fn gelu_erf(x: f32) -> f32 {
    x * 0.5 * (1.0 + libm::erff(x * std::f32::consts::FRAC_1_SQRT_2))
}

/// Runs the tower on `img` (its grid already checked against the config),
/// tapping every vision stage.
pub fn encode(
    cfg: &ModelConfig,
    vc: &VisionConfig,
    w: &VisionWeights,
    img: &ImageInput,
    tap: &mut Tap,
) -> ImageFeatures {
    let mx = tap.mutants;
    let sd = tap.dtype;
    let stored = |mut y: Vec<f32>| {
        sd.round_slice(&mut y);
        y
    };
    let g = img.grid;
    let n = g.patches();
    let (ev, hv, dv, fv, m) = (vc.hidden, vc.heads, vc.head_dim(), vc.ffn, vc.merge);
    let vs = |s: VS| Stage::Vision(s);
    tap.copy(vs(VS::Pixels), &[n, vc.patch_width()], img.pixels.data());

    let mut x = w.patch.forward(img.pixels.data(), n, sd);
    tap.copy(vs(VS::PatchEmbed), &[n, ev], &x);
    if let Some(table) = &w.pos_embed {
        let pos = interpolate_pos(table, ev, g, m);
        x = stored(add(&x, &pos));
        tap.copy(vs(VS::PosEmbed), &[n, ev], &x);
    }

    // The 2-D rotary: each head's D/2 angles are h·f (D/4 of them), then w·f.
    let theta = if mx.is(Mutant::VisionRopeTextTheta) {
        cfg.rope_theta
    } else {
        vc.rope_theta
    };
    let (cos, sin) = vision_rotary(dv, theta as f32, &g.patch_hw(m));
    let shape = AttnShape {
        heads: hv,
        kv_heads: hv,
        head_dim: dv,
        scale: (dv as f64).powf(-0.5),
        window: None,
        causal: mx.is(Mutant::VisionAttnCausal),
        mutants: mx,
        batch_pad: 0,
        sinks: None,
    };
    let mut deepstack = Vec::new();
    for (i, b) in w.blocks.iter().enumerate() {
        let st = |s: VBlock| Stage::Vision(VS::Block(i, s));
        let h1 = stored(b.norm1.forward(&x, ev, vc.ln_eps));
        tap.copy(st(VBlock::Norm1), &[n, ev], &h1);
        let qkv = b.qkv.forward(&h1, n, sd);
        let split = |part: usize| -> Vec<f32> {
            qkv.chunks_exact(3 * ev)
                .flat_map(|row| row[part * ev..][..ev].iter().copied())
                .collect()
        };
        let (mut q, mut k, v) = (split(0), split(1), split(2));
        tap.copy(st(VBlock::Q), &[n, hv, dv], &q);
        tap.copy(st(VBlock::K), &[n, hv, dv], &k);
        tap.copy(st(VBlock::V), &[n, hv, dv], &v);
        rotate(&mut q, hv, dv, &cos, &sin);
        rotate(&mut k, hv, dv, &cos, &sin);
        sd.round_slice(&mut q);
        sd.round_slice(&mut k);
        tap.copy(st(VBlock::QRope), &[n, hv, dv], &q);
        tap.copy(st(VBlock::KRope), &[n, hv, dv], &k);
        let att = attend(&q, n, 0, &k, &v, shape, false);
        tap.keep(st(VBlock::AttnProbs), &[hv, n, n], att.probs);
        let ctx = stored(att.ctx);
        tap.copy(st(VBlock::AttnCtx), &[n, hv * dv], &ctx);
        let attn_out = b.proj.forward(&ctx, n, sd);
        tap.copy(st(VBlock::AttnOut), &[n, ev], &attn_out);
        let mid = stored(add(&x, &attn_out));
        tap.copy(st(VBlock::MlpInp), &[n, ev], &mid);
        let h2 = stored(b.norm2.forward(&mid, ev, vc.ln_eps));
        tap.copy(st(VBlock::Norm2), &[n, ev], &h2);
        let f1 = b.fc1.forward(&h2, n, sd);
        tap.copy(st(VBlock::MlpFc1), &[n, fv], &f1);
        let act: Vec<f32> = f1
            .iter()
            .map(|&v| match vc.act {
                VisionAct::QuickGelu => quick_gelu(v),
                VisionAct::GeluTanh => gelu_tanh(v),
            })
            .collect();
        let act = stored(act);
        tap.copy(st(VBlock::MlpAct), &[n, fv], &act);
        let out = b.fc2.forward(&act, n, sd);
        tap.copy(st(VBlock::MlpOut), &[n, ev], &out);
        x = stored(add(&mid, &out));
        tap.copy(st(VBlock::Out), &[n, ev], &x);
        if let Some(j) = vc.deepstack.iter().position(|&d| d == i) {
            let (_, y) = merge(&w.deepstack[j], &x, ev, m, vc.ln_eps, sd);
            tap.copy(vs(VS::Deepstack(j)), &[n / (m * m), cfg.hidden], &y);
            deepstack.push(y);
        }
    }
    let (normed, mut y) = merge(&w.merger, &x, ev, m, vc.ln_eps, sd);
    tap.copy(vs(VS::MergerNorm), &[n, ev], &normed);
    let mut rows = n / (m * m);
    if mx.is(Mutant::MergeSizeOff) {
        // Tokens counted with a merge size one too large: fewer rows.
        rows = n / ((m + 1) * (m + 1));
        y.truncate(rows * cfg.hidden);
    }
    tap.copy(vs(VS::Merger), &[rows, cfg.hidden], &y);
    ImageFeatures {
        merger: y,
        rows,
        deepstack,
    }
}

/// A merger over `x` (`[N, Ev]`, windows of m² consecutive rows): the normed
/// rows as `[N, Ev]` (the main merger's `merger_norm` stage) and the output.
fn merge(mg: &Merger, x: &[f32], ev: usize, m: usize, eps: f64, sd: DType) -> (Vec<f32>, Vec<f32>) {
    let wide = ev * m * m;
    let normed = if mg.postshuffle {
        mg.norm.forward(x, wide, eps)
    } else {
        mg.norm.forward(x, ev, eps)
    };
    let mut normed = normed;
    sd.round_slice(&mut normed);
    let rows = x.len() / wide;
    let h = mg.fc1.forward(&normed, rows, sd);
    let mut a: Vec<f32> = h.iter().map(|&v| gelu_erf(v)).collect();
    sd.round_slice(&mut a);
    let y = mg.fc2.forward(&a, rows, sd);
    (normed, y)
}

/// cos and sin `[N, D/2]` of the 2-D rotary for patches at `hw`: angles
/// h·f_i then w·f_i with f_i = 1/θ^(2i/(D/2)), i < D/4 (HF's axial rope, in f32).
pub(crate) fn vision_rotary(d: usize, theta: f32, hw: &[(usize, usize)]) -> (Vec<f32>, Vec<f32>) {
    let spatial = d / 2;
    let inv = vision_inv_freq(d, theta);
    let mut cos = Vec::with_capacity(hw.len() * spatial);
    let mut sin = Vec::with_capacity(hw.len() * spatial);
    for &(h, w) in hw {
        for p in [h, w] {
            for &f in &inv {
                let a = p as f32 * f;
                cos.push((a as f64).cos() as f32);
                sin.push((a as f64).sin() as f32);
            }
        }
    }
    (cos, sin)
}

/// The 2-D rotary's D/4 frequencies f_i = 1/θ^(2i/(D/2)) in f32 (shared
/// with the CUDA engine, which computes the angles on the device).
pub(crate) fn vision_inv_freq(d: usize, theta: f32) -> Vec<f32> {
    let spatial = d / 2;
    (0..spatial / 2)
        .map(|i| 1.0f32 / theta.powf((2 * i) as f32 / spatial as f32))
        .collect()
}

/// Rotate-half rotary of `x` `[N, H, D]` with per-row cos/sin `[N, D/2]`.
pub(crate) fn rotate(x: &mut [f32], heads: usize, d: usize, cos: &[f32], sin: &[f32]) {
    let half = d / 2;
    for ((row, c), s) in x
        .chunks_exact_mut(heads * d)
        .zip(cos.chunks_exact(half))
        .zip(sin.chunks_exact(half))
    {
        for head in row.chunks_exact_mut(d) {
            for j in 0..half {
                let (a, b) = (head[j], head[j + half]);
                head[j] = a * c[j] - b * s[j];
                head[j + half] = b * c[j] + a * s[j];
            }
        }
    }
}

/// Qwen3-VL's learned `side × side` position table resampled to the grid's
/// h × w (bilinear, align_corners, in f32 as HF's
/// `get_vision_interpolation_indices_and_weights`), rows in patch order.
pub(crate) fn interpolate_pos(table: &[f32], ev: usize, g: crate::model::ImageGrid, m: usize) -> Vec<f32> {
    let side = ((table.len() / ev) as f64).sqrt() as usize;
    let taps = |idx: usize, size: usize| -> [(usize, f32); 2] {
        let src = idx as f32 * (side - 1) as f32 / (size.max(2) - 1) as f32;
        let fl = src.floor();
        let mut out = [(0, 0.0); 2];
        for (o, off) in out.iter_mut().zip([0.0f32, 1.0]) {
            let t = ((fl + off) as usize).min(side - 1);
            let wgt = (1.0 - (src - fl - off).abs()).max(0.0);
            *o = (t, wgt);
        }
        out
    };
    let mut out = Vec::with_capacity(g.patches() * ev);
    for (h, w) in g.patch_hw(m) {
        let (th, tw) = (taps(h, g.h), taps(w, g.w));
        let mut row = vec![0.0f32; ev];
        for &(hi, hw_) in &th {
            for &(wi, ww) in &tw {
                let wgt = hw_ * ww;
                let src = &table[(hi * side + wi) * ev..][..ev];
                for (r, &s) in row.iter_mut().zip(src) {
                    *r += s * wgt;
                }
            }
        }
        out.extend(row);
    }
    out
}
