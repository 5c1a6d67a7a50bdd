//! LLaVA's vision side on the CPU, in HF's order of f32 operations: the CLIP
//! tower (patch convolution as a matmul over each flattened (C, P, P) patch,
//! CLS prepended, learned position embeddings added, `pre_layrnorm`, pre-LN
//! blocks of LayerNorm → q/k/v with biases → bidirectional attention over
//! each image's N + 1 rows → out_proj → residual → LayerNorm → fc1 →
//! quick_gelu → fc2 → residual), the chosen hidden state with CLS dropped
//! (`vision_feature_layer`, the select strategy) and the two-layer projector
//! (linear_1 → erf GELU → linear_2). Images (LLaVA-NeXT's base image and
//! tiles) go through the tower one by one, their rows stacked.
//!
//! Each stage is returned under its canonical name (`vision.patch_embed`,
//! `vision.blk.{i}.q`, ...), stored in the engine's storage type; `pack`
//! then lays the projector's rows out as the image tokens (LLaVA-NeXT: the
//! base image, the unpadded tile grid with `image_newline` after each row).

use crate::error::Result;
use crate::model::llava::{packed_rows, LlavaConfig, Select};
use crate::model::Weights;
use crate::stage::{Stage, VBlock, VisionStage};
use crate::tensor::{DType, Tensor};

use super::attention::{attend, AttnShape};
use super::layers::Linear;
use super::mutants::{Mutant, Mutants};
use super::ops::add;
use super::vision::{gelu_erf, quick_gelu, LayerNorm};

/// One pre-LN CLIP encoder layer.
#[derive(Clone, Debug)]
pub struct ClipBlock {
    pub norm1: LayerNorm,
    pub q: Linear,
    pub k: Linear,
    pub v: Linear,
    pub o: Linear,
    pub norm2: LayerNorm,
    pub fc1: Linear,
    pub fc2: Linear,
}

/// The tower and the projector.
#[derive(Clone, Debug)]
pub struct ClipWeights {
    /// `[Ev, 3·P·P]`: the convolution's kernel, each output a row.
    pub patch: Linear,
    pub class: Vec<f32>,
    /// `[N + 1, Ev]`.
    pub pos: Vec<f32>,
    pub pre_norm: LayerNorm,
    pub blocks: Vec<ClipBlock>,
    /// Loaded so that every tensor of the file is accounted for; LLaVA's
    /// features never pass through it.
    pub post_norm: LayerNorm,
    pub proj1: Linear,
    pub proj2: Linear,
    /// LLaVA-NeXT's `image_newline` `[E]`.
    pub newline: Option<Vec<f32>>,
}

impl ClipWeights {
    /// Under the canonical names (`model::llava::canonical_name`:
    /// `vision_tower.*`, `multi_modal_projector.*`, `image_newline`); `e` is
    /// the language model's width.
    pub fn load(ws: &mut Weights, cfg: &LlavaConfig, e: usize) -> Result<ClipWeights> {
        let t = &cfg.tower;
        let (ev, fv, p) = (t.hidden, t.ffn, t.patch);
        let vm = "vision_tower";
        let ln = |ws: &mut Weights, name: &str| LayerNorm::load(ws, name, ev);
        let kernel = ws.take(&format!("{vm}.embeddings.patch_embedding.weight"), &[ev, t.channels, p, p])?;
        let patch = Linear::from_parts(kernel.reshaped(vec![ev, t.channels * p * p]), None, ev, t.channels * p * p);
        let class = ws.take(&format!("{vm}.embeddings.class_embedding"), &[ev])?.into_data();
        let pos = ws.take(&format!("{vm}.embeddings.position_embedding.weight"), &[t.patches() + 1, ev])?.into_data();
        let pre_norm = ln(ws, &format!("{vm}.pre_layrnorm"))?;
        let mut blocks = Vec::with_capacity(t.layers);
        for i in 0..t.layers {
            let b = format!("{vm}.encoder.layers.{i}");
            blocks.push(ClipBlock {
                norm1: ln(ws, &format!("{b}.layer_norm1"))?,
                q: Linear::load(ws, &format!("{b}.self_attn.q_proj"), ev, ev)?,
                k: Linear::load(ws, &format!("{b}.self_attn.k_proj"), ev, ev)?,
                v: Linear::load(ws, &format!("{b}.self_attn.v_proj"), ev, ev)?,
                o: Linear::load(ws, &format!("{b}.self_attn.out_proj"), ev, ev)?,
                norm2: ln(ws, &format!("{b}.layer_norm2"))?,
                fc1: Linear::load(ws, &format!("{b}.mlp.fc1"), fv, ev)?,
                fc2: Linear::load(ws, &format!("{b}.mlp.fc2"), ev, fv)?,
            });
        }
        let post_norm = ln(ws, &format!("{vm}.post_layernorm"))?;
        let mp = "multi_modal_projector";
        Ok(ClipWeights {
            patch,
            class,
            pos,
            pre_norm,
            blocks,
            post_norm,
            proj1: Linear::load(ws, &format!("{mp}.linear_1"), e, ev)?,
            proj2: Linear::load(ws, &format!("{mp}.linear_2"), e, e)?,
            newline: match cfg.pinpoints {
                Some(_) => Some(ws.take("image_newline", &[e])?.into_data()),
                None => None,
            },
        })
    }
}

impl ClipWeights {
    /// Every linear (storage rounding).
    pub fn linears_mut(&mut self) -> Vec<&mut Linear> {
        let mut v: Vec<&mut Linear> = vec![&mut self.patch, &mut self.proj1, &mut self.proj2];
        for b in &mut self.blocks {
            v.extend([&mut b.q, &mut b.k, &mut b.v, &mut b.o, &mut b.fc1, &mut b.fc2]);
        }
        v
    }

    /// Every tensor held, by canonical name (`Engine::visit_weights`).
    pub fn visit(&self, cfg: &LlavaConfig, f: &mut crate::engine::WeightVisitor) {
        let lin = |f: &mut crate::engine::WeightVisitor, name: &str, l: &Linear| {
            f(&format!("{name}.weight"), &[l.out_f, l.in_f], l.w.data());
            if let Some(b) = &l.bias {
                f(&format!("{name}.bias"), &[l.out_f], b);
            }
        };
        let ln = |f: &mut crate::engine::WeightVisitor, name: &str, n: &LayerNorm| {
            f(&format!("{name}.weight"), &[n.w.len()], &n.w);
            f(&format!("{name}.bias"), &[n.b.len()], &n.b);
        };
        let t = &cfg.tower;
        let vm = "vision_tower";
        let kernel = [t.hidden, t.channels, t.patch, t.patch];
        f(&format!("{vm}.embeddings.patch_embedding.weight"), &kernel, self.patch.w.data());
        f(&format!("{vm}.embeddings.class_embedding"), &[t.hidden], &self.class);
        f(&format!("{vm}.embeddings.position_embedding.weight"), &[t.patches() + 1, t.hidden], &self.pos);
        ln(f, &format!("{vm}.pre_layrnorm"), &self.pre_norm);
        for (i, b) in self.blocks.iter().enumerate() {
            let p = format!("{vm}.encoder.layers.{i}");
            ln(f, &format!("{p}.layer_norm1"), &b.norm1);
            for (name, l) in [("q_proj", &b.q), ("k_proj", &b.k), ("v_proj", &b.v), ("out_proj", &b.o)] {
                lin(f, &format!("{p}.self_attn.{name}"), l);
            }
            ln(f, &format!("{p}.layer_norm2"), &b.norm2);
            lin(f, &format!("{p}.mlp.fc1"), &b.fc1);
            lin(f, &format!("{p}.mlp.fc2"), &b.fc2);
        }
        ln(f, &format!("{vm}.post_layernorm"), &self.post_norm);
        lin(f, "multi_modal_projector.linear_1", &self.proj1);
        lin(f, "multi_modal_projector.linear_2", &self.proj2);
        if let Some(nl) = &self.newline {
            f("image_newline", &[nl.len()], nl);
        }
    }
}

/// The prefill's image on the tower and projector, every stage tapped;
/// returns the image-token rows the forward pass fuses.
pub(super) fn encode_tapped(
    cfg: &LlavaConfig,
    w: &ClipWeights,
    img: &crate::engine::ImageInput,
    tap: &mut super::forward::Tap,
) -> std::result::Result<super::vision::ImageFeatures, String> {
    let mx = tap.mutants;
    let stages = encode(cfg, w, &img.pixels, tap.dtype, mx);
    let projector = stages.last().map(|(_, _, d)| d.clone()).unwrap_or_default();
    for (stage, shape, data) in stages {
        tap.keep(stage, &shape, data);
    }
    let (merger, rows) = pack(cfg, w, &projector, img.size, mx)?;
    tap.copy(Stage::Vision(VisionStage::Merger), &[rows, w.proj2.out_f], &merger);
    Ok(super::vision::ImageFeatures {
        merger,
        rows,
        deepstack: Vec::new(),
    })
}

/// A stage, its shape and values.
pub type Named = (Stage, Vec<usize>, Vec<f32>);

/// The convolution's input as rows: patch (py, px) of each `[3, S, S]`
/// image is its (C, P, P) block flattened, `[P·N, 3·P·P]` (a permutation of
/// the pixels: what the matmul over each patch reads).
pub(crate) fn patchify(cfg: &LlavaConfig, pixels: &[f32]) -> Vec<f32> {
    let t = &cfg.tower;
    let (s, pp) = (t.image_size, t.patch);
    let mut flat = Vec::with_capacity(pixels.len());
    for img in pixels.chunks_exact(3 * s * s) {
        for py in 0..t.side() {
            for px in 0..t.side() {
                for c in 0..3 {
                    for y in 0..pp {
                        let at = c * s * s + (py * pp + y) * s + px * pp;
                        flat.extend_from_slice(&img[at..at + pp]);
                    }
                }
            }
        }
    }
    flat
}

/// Runs the tower and the projector on `pixels` (`[P, 3, S, S]`), returning
/// every stage in order; the last is `vision.projector` (`[P·rows, E]`).
pub fn encode(cfg: &LlavaConfig, w: &ClipWeights, pixels: &Tensor, sd: DType, mx: Mutants) -> Vec<Named> {
    let t = &cfg.tower;
    let (ev, hv, fv) = (t.hidden, t.heads, t.ffn);
    let dv = ev / hv;
    let (n, p_n) = (t.patches(), pixels.shape()[0]);
    let rows = n + 1;
    let total = p_n * rows;
    let stored = |mut y: Vec<f32>| {
        sd.round_slice(&mut y);
        y
    };
    let mut out: Vec<Named> = Vec::new();
    let mut put = |stage: VisionStage, shape: Vec<usize>, v: &[f32]| out.push((Stage::Vision(stage), shape, v.to_vec()));
    put(VisionStage::Pixels, pixels.shape().to_vec(), pixels.data());

    let flat = patchify(cfg, pixels.data());
    let patches = w.patch.forward(&flat, p_n * n, sd);
    put(VisionStage::PatchEmbed, vec![p_n * n, ev], &patches);
    // cat(CLS, patches) + position embeddings, per image.
    let mut x = Vec::with_capacity(total * ev);
    for img in patches.chunks_exact(n * ev) {
        let with_cls: Vec<f32> = w.class.iter().chain(img).copied().collect();
        x.extend(stored(add(&with_cls, &w.pos)));
    }
    put(VisionStage::PosEmbed, vec![total, ev], &x);
    if !mx.is(Mutant::LlavaPreNormSkipped) {
        x = stored(w.pre_norm.forward(&x, ev, t.ln_eps));
    }
    put(VisionStage::PreNorm, vec![total, ev], &x);

    let shape = AttnShape {
        heads: hv,
        kv_heads: hv,
        head_dim: dv,
        scale: (dv as f64).powf(-0.5),
        window: None,
        causal: false,
        mutants: mx,
        batch_pad: 0,
        sinks: None,
    };
    let mut hidden = vec![x.clone()];
    for (i, b) in w.blocks.iter().enumerate() {
        let st = |b: VBlock| VisionStage::Block(i, b);
        let h1 = stored(b.norm1.forward(&x, ev, t.ln_eps));
        put(st(VBlock::Norm1), vec![total, ev], &h1);
        let [q, k, v] = Linear::forward_many([&b.q, &b.k, &b.v], &h1, total, sd, true);
        for (b, y) in [(VBlock::Q, &q), (VBlock::K, &k), (VBlock::V, &v)] {
            put(st(b), vec![total, hv, dv], y);
        }
        // Each image attends over its own rows.
        let (mut probs, mut ctx) = (Vec::with_capacity(p_n * hv * rows * rows), Vec::with_capacity(total * ev));
        for img in 0..p_n {
            let r = img * rows * ev..(img + 1) * rows * ev;
            let a = attend(&q[r.clone()], rows, 0, &k[r.clone()], &v[r], shape, false);
            probs.extend(a.probs);
            ctx.extend(a.ctx);
        }
        put(st(VBlock::AttnProbs), vec![p_n * hv, rows, rows], &probs);
        let ctx = stored(ctx);
        put(st(VBlock::AttnCtx), vec![total, ev], &ctx);
        let attn_out = b.o.forward(&ctx, total, sd);
        put(st(VBlock::AttnOut), vec![total, ev], &attn_out);
        let mid = stored(add(&x, &attn_out));
        put(st(VBlock::MlpInp), vec![total, ev], &mid);
        let h2 = stored(b.norm2.forward(&mid, ev, t.ln_eps));
        put(st(VBlock::Norm2), vec![total, ev], &h2);
        let f1 = b.fc1.forward(&h2, total, sd);
        put(st(VBlock::MlpFc1), vec![total, fv], &f1);
        let act = if mx.is(Mutant::LlavaTowerErfGelu) {
            stored(f1.iter().map(|&v| gelu_erf(v)).collect())
        } else {
            stored(f1.iter().map(|&v| quick_gelu(v)).collect())
        };
        put(st(VBlock::MlpAct), vec![total, fv], &act);
        let y = b.fc2.forward(&act, total, sd);
        put(st(VBlock::MlpOut), vec![total, ev], &y);
        x = stored(add(&mid, &y));
        put(st(VBlock::Out), vec![total, ev], &x);
        hidden.push(x.clone());
    }
    // The chosen hidden state, CLS dropped per image by the default strategy.
    let chosen = match mx.is(Mutant::LlavaFeatureLastLayer) {
        true => &hidden[hidden.len() - 1],
        false => &hidden[cfg.feature_layer],
    };
    let skip = usize::from(cfg.select == Select::Default && !mx.is(Mutant::LlavaClsKept));
    let feats: Vec<f32> = chosen
        .chunks_exact(rows * ev)
        .flat_map(|img| img[skip * ev..].iter().copied())
        .collect();
    let f_rows = p_n * (rows - skip);
    put(VisionStage::Features, vec![f_rows, ev], &feats);
    let e = w.proj1.out_f;
    let h = w.proj1.forward(&feats, f_rows, sd);
    put(VisionStage::ProjFc1, vec![f_rows, e], &h);
    let a = stored(h.iter().map(|&v| gelu_erf(v)).collect());
    put(VisionStage::ProjAct, vec![f_rows, e], &a);
    let y = w.proj2.forward(&a, f_rows, sd);
    put(VisionStage::Projector, vec![f_rows, e], &y);
    out
}

/// The image-token rows from the projector's (`[P·rows, E]`): LLaVA-1.5's
/// as they are; LLaVA-NeXT's packed for an image of `size` (H, W) —
/// the base image's rows, then each kept row of the tile grid followed by
/// `image_newline` (`model::llava::packed_rows`). Returns the rows and
/// their count.
pub fn pack(
    cfg: &LlavaConfig,
    w: &ClipWeights,
    projector: &[f32],
    size: Option<(usize, usize)>,
    mx: Mutants,
) -> std::result::Result<(Vec<f32>, usize), String> {
    let e = w.proj2.out_f;
    let mut rows: Vec<f32> = match (&w.newline, cfg.pinpoints.is_some()) {
        (Some(newline), true) => {
            let (h, w_) = size.ok_or("LLaVA-NeXT needs the image's size (H, W) to pack its rows")?;
            let order = match mx.is(Mutant::NextUnpadRoundedOther) {
                true => super::mutants::next_rows_padding_rounded_up(cfg, h, w_),
                false => packed_rows(cfg, h, w_)?,
            };
            let mut out = Vec::with_capacity(order.len() * e);
            for p in order {
                match p.projector_row() {
                    Some(row) => out.extend_from_slice(&projector[row * e..][..e]),
                    None if mx.is(Mutant::NextNewlineMissing) => {}
                    None => out.extend_from_slice(newline),
                }
            }
            out
        }
        _ => projector.to_vec(),
    };
    if mx.is(Mutant::LlavaImageTokenShort) {
        rows.truncate(rows.len().saturating_sub(e));
    }
    let count = rows.len() / e;
    Ok((rows, count))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::llava::canonical_name;

    fn fixture() -> std::path::PathBuf {
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("goldens/llava-fixture")
    }

    /// Every recorded stage of HF's tower and projector (vision_feature_layer
    /// −2, CLS dropped) on two images, within 1e-5 of its largest value: an
    /// f32 engine is at ~1e-6 here (a wrong feature layer, CLS kept or the
    /// tower's activation swapped is off by orders of magnitude).
    #[test]
    fn the_tower_and_projector_match_hf_on_the_fixture() {
        let dir = fixture();
        let text = std::fs::read_to_string(dir.join("model/config.json")).unwrap();
        let cfg = LlavaConfig::from_json(&serde_json::from_str(&text).unwrap()).unwrap();
        let mut ws = Weights::from_hf_dir(&dir.join("model")).unwrap();
        ws.rename(canonical_name);
        let w = ClipWeights::load(&mut ws, &cfg, 64).unwrap();
        let hf = crate::tensor::io::read_safetensors(&dir.join("stages.safetensors")).unwrap().floats;
        let px = hf["vision.pixels"].clone().reshaped(vec![2, 3, 56, 56]);
        let mut compared = 0;
        for (stage, shape, data) in encode(&cfg, &w, &px, DType::F32, Mutants::default()) {
            let name = stage.to_string();
            let Some(g) = hf.get(&name) else { continue };
            assert_eq!(g.numel(), data.len(), "{name} {shape:?}");
            let m = g.data().iter().fold(0f32, |a, b| a.max(b.abs()));
            let d = g.data().iter().zip(&data).fold(0f32, |a, (x, y)| a.max((x - y).abs()));
            assert!(d <= 1e-5 * m, "{name}: max|engine − HF| {d:e} of max {m:e}");
            compared += 1;
        }
        assert_eq!(compared, hf.len(), "every recorded stage is produced");
    }

    /// touchstone's LLaVA processors give HF's pixels bit for bit: CLIP's
    /// shortest edge and centre crop (56×70), NeXT's base image and zero-padded
    /// tiles (56×56 in a 56×112 pinpoint); an image whose base image NeXT
    /// would resample is refused.
    #[test]
    fn the_processors_give_hfs_pixels() {
        let dir = fixture();
        let hf = crate::tensor::io::read_safetensors(&dir.join("pixels.safetensors")).unwrap().floats;
        let v = serde_json::json!({"model_type": "llava", "vision_config": {"hidden_size": 32, "num_attention_heads": 2,
            "intermediate_size": 64, "num_hidden_layers": 3, "patch_size": 14, "image_size": 56}});
        let plain = LlavaConfig::from_json(&v).unwrap();
        let mut vn = v.clone();
        vn["model_type"] = "llava_next".into();
        vn["image_grid_pinpoints"] = serde_json::json!([[56, 112], [112, 56], [112, 112]]);
        let next = LlavaConfig::from_json(&vn).unwrap();
        let proc = dir.join("proc");
        let a = crate::processor::clip::process(&dir.join("img-56x70.png"), &proc, &plain).unwrap();
        assert_eq!(a.pixels.data(), hf["clip_56x70"].data());
        let b = crate::processor::clip::process(&dir.join("img-56x56.png"), &proc, &next).unwrap();
        assert_eq!(b.pixels.shape(), [3, 3, 56, 56]);
        assert_eq!(b.pixels.data(), hf["next_56x56"].data());
        let e = crate::processor::clip::process(&dir.join("img-56x70.png"), &proc, &next).unwrap_err().to_string();
        assert!(e.contains("base image") && e.contains("does not resample"), "{e}");
    }
}
