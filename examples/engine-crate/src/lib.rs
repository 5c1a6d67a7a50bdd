//! A deliberately small inference engine (Qwen2 and Llama in f32, plain loops,
//! a KV cache) written to show how an engine crate plugs into touchstone: it
//! implements `touchstone::engine::Engine` and its `tests/touchstone.rs` hands
//! it to `touchstone::harness::Harness`. It is not touchstone's CPU engine.
//!
//! What `Engine::run` owes touchstone, per step (`prefill`, then `decode1`, …)
//! and tapped stage, in the canonical layout (row-major, no batch dimension;
//! T tokens this step, S positions in the cache after it):
//!
//! | stage | shape | content |
//! | --- | --- | --- |
//! | `embed` | [T,E] | embedding rows of the step's tokens |
//! | `blk.{i}.attn_norm` | [T,E] | RMSNorm(x)·w |
//! | `blk.{i}.q`, `.k`, `.v` | [T,H,D], [T,KV,D], [T,KV,D] | projections, bias added, before RoPE |
//! | `blk.{i}.q_rope`, `.k_rope` | as q, k | after RoPE at each row's absolute position |
//! | `blk.{i}.attn_scores` | [H,T,S] | q·kᵀ/√D; entries after the row's position exactly 0 |
//! | `blk.{i}.attn_probs` | [H,T,S] | softmax of the visible scores; masked entries exactly 0 |
//! | `blk.{i}.attn_ctx` | [T,H·D] | probs·V |
//! | `blk.{i}.attn_out` | [T,E] | o_proj(ctx) |
//! | `blk.{i}.ffn_inp` | [T,E] | x + attn_out |
//! | `blk.{i}.ffn_norm` | [T,E] | RMSNorm(ffn_inp)·w |
//! | `blk.{i}.ffn_gate`, `.ffn_up` | [T,F] | gate and up projections |
//! | `blk.{i}.ffn_act` | [T,F] | silu(gate)·up |
//! | `blk.{i}.ffn_out` | [T,E] | down projection |
//! | `blk.{i}.out` | [T,E] | ffn_inp + ffn_out |
//! | `output_norm` | [T,E] | final RMSNorm |
//! | `logits` | [T,V] | LM head |
//! | `sample_probs` | [1,V] | random sampling only: the distribution drawn from |

use std::collections::BTreeMap;
use std::path::Path;

use touchstone::engine::{Captures, Engine, RunOutput, RunRequest, TapSet};
use touchstone::error::{Error, Result};
use touchstone::model::{LoadOptions, ModelConfig};
use touchstone::sampling::{distribution, Sampler};
use touchstone::stage::{BlockStage as B, Stage, Step};
use touchstone::tensor::{DType, Tensor};

const NAME: &str = "tiny-rs";

/// A weight matrix [rows, cols] and an optional bias [rows].
struct Linear {
    w: Vec<f32>,
    b: Option<Vec<f32>>,
    rows: usize,
    cols: usize,
}

impl Linear {
    /// y[t, r] = Σ_c x[t, c]·w[r, c] + b[r].
    fn apply(&self, x: &[f32]) -> Vec<f32> {
        let t = x.len() / self.cols;
        let mut y = vec![0.0f32; t * self.rows];
        for i in 0..t {
            let xi = &x[i * self.cols..(i + 1) * self.cols];
            for r in 0..self.rows {
                let wr = &self.w[r * self.cols..(r + 1) * self.cols];
                let mut acc = 0.0f32;
                for c in 0..self.cols {
                    acc += xi[c] * wr[c];
                }
                y[i * self.rows + r] = acc + self.b.as_ref().map_or(0.0, |b| b[r]);
            }
        }
        y
    }
}

struct Layer {
    attn_norm: Vec<f32>,
    q: Linear,
    k: Linear,
    v: Linear,
    o: Linear,
    ffn_norm: Vec<f32>,
    gate: Linear,
    up: Linear,
    down: Linear,
}

pub struct TinyEngine {
    cfg: ModelConfig,
    embed: Vec<f32>,
    layers: Vec<Layer>,
    norm: Vec<f32>,
    head: Linear,
}

impl TinyEngine {
    /// Loads an HF folder (`config.json` + `model.safetensors`) of a Qwen2 or
    /// Llama model in f32. Anything else is refused with the reason.
    pub fn load(model: &Path, opts: &LoadOptions) -> Result<TinyEngine> {
        let bad = |m: String| Error::engine(NAME, m);
        if opts.storage != DType::F32 {
            return Err(bad(format!("runs in f32 only, not {}", opts.storage)));
        }
        let cfg = touchstone::model::read_config(model)?;
        if !matches!(cfg.arch.as_str(), "qwen2" | "llama") || cfg.qk_norm {
            return Err(bad(format!("supports qwen2 and llama, not {}", cfg.arch)));
        }
        let file = touchstone::tensor::io::read_safetensors(&model.join("model.safetensors"))?;
        let mut w: BTreeMap<String, Tensor> = file.floats;
        let mut take = |name: &str| -> Result<Vec<f32>> {
            w.remove(name)
                .map(|t| t.data().to_vec())
                .ok_or_else(|| bad(format!("model.safetensors has no `{name}`")))
        };
        let (e, d) = (cfg.hidden, cfg.head_dim);
        let mut lin = |name: &str, rows: usize, cols: usize, bias: bool| -> Result<Linear> {
            let w = take(&format!("{name}.weight"))?;
            let b = if bias {
                Some(take(&format!("{name}.bias"))?)
            } else {
                None
            };
            Ok(Linear { w, b, rows, cols })
        };
        let bias = cfg.arch == "qwen2";
        let mut layers = Vec::new();
        for l in 0..cfg.layers {
            let p = format!("model.layers.{l}");
            layers.push(Layer {
                attn_norm: Vec::new(),
                q: lin(&format!("{p}.self_attn.q_proj"), cfg.heads * d, e, bias)?,
                k: lin(&format!("{p}.self_attn.k_proj"), cfg.kv_heads * d, e, bias)?,
                v: lin(&format!("{p}.self_attn.v_proj"), cfg.kv_heads * d, e, bias)?,
                o: lin(&format!("{p}.self_attn.o_proj"), e, cfg.heads * d, false)?,
                ffn_norm: Vec::new(),
                gate: lin(&format!("{p}.mlp.gate_proj"), cfg.ffn, e, false)?,
                up: lin(&format!("{p}.mlp.up_proj"), cfg.ffn, e, false)?,
                down: lin(&format!("{p}.mlp.down_proj"), e, cfg.ffn, false)?,
            });
        }
        let head = if cfg.tie_embeddings {
            None
        } else {
            Some(lin("lm_head", cfg.vocab, e, false)?)
        };
        for (l, layer) in layers.iter_mut().enumerate() {
            layer.attn_norm = take(&format!("model.layers.{l}.input_layernorm.weight"))?;
            layer.ffn_norm = take(&format!("model.layers.{l}.post_attention_layernorm.weight"))?;
        }
        let embed = take("model.embed_tokens.weight")?;
        let norm = take("model.norm.weight")?;
        let head = head.unwrap_or_else(|| Linear {
            w: embed.clone(),
            b: None,
            rows: cfg.vocab,
            cols: e,
        });
        Ok(TinyEngine {
            cfg,
            embed,
            layers,
            norm,
            head,
        })
    }

    fn rmsnorm(&self, x: &[f32], w: &[f32]) -> Vec<f32> {
        let e = w.len();
        let mut y = vec![0.0f32; x.len()];
        for (xr, yr) in x.chunks_exact(e).zip(y.chunks_exact_mut(e)) {
            let ms = xr.iter().map(|v| v * v).sum::<f32>() / e as f32;
            let inv = 1.0 / (ms + self.cfg.rms_eps as f32).sqrt();
            for i in 0..e {
                yr[i] = w[i] * (xr[i] * inv);
            }
        }
        y
    }

    /// NeoX RoPE in place on [T, heads, D] rows at positions pos0..pos0+T.
    fn rope(&self, x: &mut [f32], heads: usize, pos0: usize) {
        let d = self.cfg.head_dim;
        let half = d / 2;
        for (t, row) in x.chunks_exact_mut(heads * d).enumerate() {
            let pos = (pos0 + t) as f32;
            for h in row.chunks_exact_mut(d) {
                for j in 0..half {
                    let inv = 1.0 / (self.cfg.rope_theta as f32).powf(2.0 * j as f32 / d as f32);
                    let (s, c) = (pos * inv).sin_cos();
                    let (a, b) = (h[j], h[j + half]);
                    h[j] = a * c - b * s;
                    h[j + half] = b * c + a * s;
                }
            }
        }
    }

    /// One step over `tokens` at positions pos0.., appending to the caches;
    /// returns the logits of every row.
    fn step(&self, tokens: &[u32], pos0: usize, cache: &mut [(Vec<f32>, Vec<f32>)], tap: &mut Tap) -> Vec<f32> {
        let c = &self.cfg;
        let (e, d, h, kv) = (c.hidden, c.head_dim, c.heads, c.kv_heads);
        let t = tokens.len();
        let mut x: Vec<f32> = tokens
            .iter()
            .flat_map(|&id| self.embed[id as usize * e..(id as usize + 1) * e].iter().copied())
            .collect();
        tap.put(Stage::Embed, &[t, e], &x);
        for (l, ly) in self.layers.iter().enumerate() {
            let st = |b| Stage::Block(l, b);
            let xn = self.rmsnorm(&x, &ly.attn_norm);
            tap.put(st(B::AttnNorm), &[t, e], &xn);
            let (mut q, mut k, v) = (ly.q.apply(&xn), ly.k.apply(&xn), ly.v.apply(&xn));
            tap.put(st(B::Q), &[t, h, d], &q);
            tap.put(st(B::K), &[t, kv, d], &k);
            tap.put(st(B::V), &[t, kv, d], &v);
            self.rope(&mut q, h, pos0);
            self.rope(&mut k, kv, pos0);
            tap.put(st(B::QRope), &[t, h, d], &q);
            tap.put(st(B::KRope), &[t, kv, d], &k);
            cache[l].0.extend_from_slice(&k);
            cache[l].1.extend_from_slice(&v);
            let (keys, vals) = (&cache[l].0, &cache[l].1);
            let s = keys.len() / (kv * d);
            let scale = (d as f64).powf(-0.5) as f32;
            let mut scores = vec![0.0f32; h * t * s];
            let mut probs = vec![0.0f32; h * t * s];
            let mut ctx = vec![0.0f32; t * h * d];
            for hh in 0..h {
                let g = hh / (h / kv);
                for r in 0..t {
                    let visible = pos0 + r + 1;
                    let qv = &q[(r * h + hh) * d..][..d];
                    let row = &mut scores[(hh * t + r) * s..][..s];
                    for (j, sc) in row.iter_mut().enumerate().take(visible) {
                        let kj = &keys[(j * kv + g) * d..][..d];
                        *sc = qv.iter().zip(kj).map(|(a, b)| a * b).sum::<f32>() * scale;
                    }
                    let m = row[..visible].iter().cloned().fold(f32::NEG_INFINITY, f32::max);
                    let p = &mut probs[(hh * t + r) * s..][..s];
                    let mut z = 0.0f32;
                    for j in 0..visible {
                        p[j] = (row[j] - m).exp();
                        z += p[j];
                    }
                    for pj in p[..visible].iter_mut() {
                        *pj /= z;
                    }
                    let out = &mut ctx[(r * h + hh) * d..][..d];
                    for j in 0..visible {
                        let vj = &vals[(j * kv + g) * d..][..d];
                        for i in 0..d {
                            out[i] += p[j] * vj[i];
                        }
                    }
                }
            }
            tap.put(st(B::AttnScores), &[h, t, s], &scores);
            tap.put(st(B::AttnProbs), &[h, t, s], &probs);
            tap.put(st(B::AttnCtx), &[t, h * d], &ctx);
            let attn_out = ly.o.apply(&ctx);
            tap.put(st(B::AttnOut), &[t, e], &attn_out);
            let ffn_inp: Vec<f32> = x.iter().zip(&attn_out).map(|(a, b)| a + b).collect();
            tap.put(st(B::FfnInp), &[t, e], &ffn_inp);
            let hn = self.rmsnorm(&ffn_inp, &ly.ffn_norm);
            tap.put(st(B::FfnNorm), &[t, e], &hn);
            let (gate, up) = (ly.gate.apply(&hn), ly.up.apply(&hn));
            tap.put(st(B::FfnGate), &[t, c.ffn], &gate);
            tap.put(st(B::FfnUp), &[t, c.ffn], &up);
            let act: Vec<f32> = gate.iter().zip(&up).map(|(g, u)| g / (1.0 + (-g).exp()) * u).collect();
            tap.put(st(B::FfnAct), &[t, c.ffn], &act);
            let ffn_out = ly.down.apply(&act);
            tap.put(st(B::FfnOut), &[t, e], &ffn_out);
            x = ffn_inp.iter().zip(&ffn_out).map(|(a, b)| a + b).collect();
            tap.put(st(B::Out), &[t, e], &x);
        }
        let xn = self.rmsnorm(&x, &self.norm);
        tap.put(Stage::OutputNorm, &[t, e], &xn);
        let logits = self.head.apply(&xn);
        tap.put(Stage::Logits, &[t, c.vocab], &logits);
        logits
    }
}

/// Copies tapped stages into the captures of the current step.
struct Tap<'a> {
    taps: &'a TapSet,
    step: Step,
    caps: &'a mut Captures,
}

impl Tap<'_> {
    fn put(&mut self, stage: Stage, shape: &[usize], data: &[f32]) {
        if self.taps.contains(stage) {
            self.caps
                .insert(self.step, stage, Tensor::new(shape.to_vec(), data.to_vec()));
        }
    }
}

impl Engine for TinyEngine {
    fn name(&self) -> &str {
        NAME
    }

    fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    fn run(&self, req: &RunRequest, taps: &TapSet) -> Result<RunOutput> {
        req.validate(NAME, self.cfg.vocab)?;
        let mut cache = vec![(Vec::new(), Vec::new()); self.cfg.layers];
        let mut sampler = Sampler::new(req.sampling.clone(), req.seed);
        let mut captures = Captures::default();
        let (mut sampled, mut positions) = (Vec::new(), Vec::new());
        let mut tokens = req.prompt.clone();
        let mut pos0 = 0;
        for step in Step::sequence(req.decode_steps) {
            if let Step::Decode(n) = step {
                tokens = vec![req.decode_input(n, &sampled)];
            }
            let mut tap = Tap {
                taps,
                step,
                caps: &mut captures,
            };
            let logits = self.step(&tokens, pos0, &mut cache, &mut tap);
            let last = &logits[logits.len() - self.cfg.vocab..];
            if taps.contains(Stage::SampleProbs) {
                if let Some(p) = distribution(&req.sampling, last) {
                    captures.insert(step, Stage::SampleProbs, Tensor::new(vec![1, p.len()], p));
                }
            }
            sampled.push(sampler.sample(last));
            positions.push((pos0..pos0 + tokens.len()).collect());
            pos0 += tokens.len();
        }
        Ok(RunOutput {
            captures,
            sampled,
            positions,
            unmapped: Vec::new(),
        })
    }
}
