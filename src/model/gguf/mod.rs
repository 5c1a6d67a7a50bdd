//! A GGUF file as a model: the `ModelConfig` from its metadata and the weights
//! renamed to HF names, so the engines' loaders (which take HF names from
//! `Weights`) work unchanged.
//!
//! Llama: llama.cpp's converter (`LlamaModel.permute` in convert_hf_to_gguf.py)
//! reorders the rows of `attn_q` / `attn_k` within each head from HF's
//! rotate-half layout to interleaved pairs:
//! `w.reshape(n_head, 2, D/2, E).swapaxes(1, 2).reshape(w.shape)` (n_head_kv
//! heads for K). The loader undoes it, so the CPU engine (rotate-half RoPE)
//! computes exactly the HF model. Qwen2 GGUFs are not permuted.

use std::collections::BTreeMap;

use crate::error::{Error, Result};
use crate::model::config::Activation;
use crate::model::{LoadOptions, ModelConfig, Weights};
use crate::tensor::Tensor;

use crate::gguf::writer::GgufWriter;
use crate::gguf::{quant, GgmlType, GgufFile, Value, ValueType};

/// `general.architecture` values this loader accepts.
pub const SUPPORTED_ARCHS: &[&str] = &["qwen2", "qwen3", "llama", "phi3", "gemma3"];

/// Reads the model config from metadata (and the presence / shape of
/// `token_embd.weight` and `output.weight`).
pub fn config(f: &GgufFile) -> Result<ModelConfig> {
    let bad = |msg: String| Error::model(&f.path, msg);
    let arch = req(f, "general.architecture")?
        .as_str()
        .ok_or_else(|| bad(wrong_type(f, "general.architecture", "a string")))?
        .to_string();
    if !SUPPORTED_ARCHS.contains(&arch.as_str()) {
        return Err(bad(format!(
            "general.architecture is `{arch}`, which is not supported (supported: {})",
            SUPPORTED_ARCHS.join(", ")
        )));
    }
    let uint = |k: &str| -> Result<usize> {
        let key = format!("{arch}.{k}");
        req(f, &key)?
            .as_u64()
            .map(|n| n as usize)
            .ok_or_else(|| bad(wrong_type(f, &key, "a non-negative integer")))
    };
    let opt_uint = |k: &str| -> Result<Option<usize>> {
        let key = format!("{arch}.{k}");
        match f.get(&key) {
            None => Ok(None),
            Some(v) => v
                .as_u64()
                .map(|n| Some(n as usize))
                .ok_or_else(|| bad(wrong_type(f, &key, "a non-negative integer"))),
        }
    };
    let hidden = uint("embedding_length")?;
    let layers = uint("block_count")?;
    let heads = uint("attention.head_count")?;
    let kv_heads = opt_uint("attention.head_count_kv")?.unwrap_or(heads);
    let ffn = uint("feed_forward_length")?;
    let head_dim = opt_uint("attention.key_length")?.unwrap_or(hidden / heads.max(1));
    if let Some(vl) = opt_uint("attention.value_length")? {
        if vl != head_dim {
            return Err(bad(format!(
                "{arch}.attention.value_length ({vl}) differs from the key length ({head_dim}); not supported"
            )));
        }
    }
    if let Some(rd) = opt_uint("rope.dimension_count")? {
        if rd != head_dim {
            return Err(bad(format!(
                "{arch}.rope.dimension_count is {rd} but the head dim is {head_dim}: partial RoPE is not supported"
            )));
        }
    }
    let scaling_key = format!("{arch}.rope.scaling.type");
    if let Some(s) = f.get(&scaling_key).and_then(Value::as_str) {
        if s != "none" {
            return Err(bad(format!("{scaling_key} is `{s}`: RoPE scaling is not supported")));
        }
    }
    // Maths the engines do not implement: refused by key, never computed as
    // something else (the HF side does the same in `model::config`).
    for (k, what) in [
        ("attn_logit_softcapping", "attention logit soft-capping"),
        ("final_logit_softcapping", "final logit soft-capping"),
        ("rope.scaling.factor", "RoPE scaling"),
    ] {
        let key = format!("{arch}.{k}");
        if let Some(v) = f.get(&key) {
            let inert = k == "rope.scaling.factor" && v.as_f64() == Some(1.0);
            let zero = v.as_f64() == Some(0.0);
            if !inert && !zero {
                return Err(bad(format!(
                    "{key} is {v}: {what} is not implemented by touchstone's engines (refusing rather than \
                     computing a different model)"
                )));
            }
        }
    }
    let window = opt_uint("attention.sliding_window")?.filter(|&w| w > 0);
    let gemma = arch == "gemma3";
    // Gemma 3's window is per layer and implemented (`local`); any other
    // family's bounds the run (`ModelConfig::sliding_window`).
    let sliding_window = window.filter(|_| !gemma);
    let context_length = opt_uint("context_length")?;
    // llama.cpp's default when the key is absent.
    let rope_key = format!("{arch}.rope.freq_base");
    let rope_theta = match f.get(&rope_key) {
        None => 10000.0,
        Some(v) => v.as_f64().ok_or_else(|| bad(wrong_type(f, &rope_key, "a number")))?,
    };
    let eps_key = format!("{arch}.attention.layer_norm_rms_epsilon");
    let rms_eps = req(f, &eps_key)?
        .as_f64()
        .ok_or_else(|| bad(wrong_type(f, &eps_key, "a number")))?;

    req(f, "tokenizer.ggml.model")?
        .as_str()
        .ok_or_else(|| bad(wrong_type(f, "tokenizer.ggml.model", "a string")))?;
    let vocab = match req(f, "tokenizer.ggml.tokens")?.as_array() {
        Some((ValueType::String, items)) => items.len(),
        _ => return Err(bad(wrong_type(f, "tokenizer.ggml.tokens", "an array of strings"))),
    };
    let embd = f.tensor("token_embd.weight").ok_or_else(|| {
        bad(
            "missing tensor `token_embd.weight` (HF `model.embed_tokens.weight`), required by every architecture"
                .into(),
        )
    })?;
    let shape = embd.shape();
    if shape.len() != 2 || shape[0] != vocab {
        return Err(bad(format!(
            "tokenizer.ggml.tokens has {vocab} tokens but tensor `token_embd.weight` has shape {shape:?} \
             (expected [{vocab}, {hidden}])"
        )));
    }
    if let Some(v) = opt_uint("vocab_size")? {
        if v != vocab {
            return Err(bad(format!(
                "{arch}.vocab_size is {v} but tokenizer.ggml.tokens has {vocab} tokens"
            )));
        }
    }
    let local = match window.filter(|_| gemma) {
        None => None,
        Some(w) => Some(crate::model::config::LocalAttention {
            window: w,
            layers: swa_layers(f, &arch, layers)?,
            rope_theta: Some(match f.get(&format!("{arch}.rope.freq_base_swa")) {
                None => crate::model::gemma::DEFAULT_LOCAL_THETA,
                Some(v) => v
                    .as_f64()
                    .ok_or_else(|| bad(wrong_type(f, &format!("{arch}.rope.freq_base_swa"), "a number")))?,
            }),
        }),
    };
    // llama.cpp's Gemma 3 score scale: 1/√head_dim, except the 27B (62
    // layers), whose query_pre_attn_scalar is hidden/heads; a GGUF does not
    // carry the scalar, so this is what llama.cpp computes from it.
    let attn_scale = if gemma && layers == 62 {
        ((hidden / heads.max(1)) as f64).powf(-0.5)
    } else {
        (head_dim as f64).powf(-0.5)
    };
    let cfg = ModelConfig {
        rope_scaling: None,
        qk_norm: arch == "qwen3" || gemma,
        sliding_window,
        context_length,
        act: if gemma { Activation::GeluTanh } else { Activation::Silu },
        norm_plus_one: gemma,
        embed_scale: gemma.then(|| (hidden as f64).sqrt() as f32),
        post_norms: gemma,
        attn_scale,
        local,
        vision: None,
        mrope: None,
        moe: None,
        mla: None,
        attn_sinks: false,
        arch,
        vocab,
        hidden,
        ffn,
        layers,
        heads,
        kv_heads,
        head_dim,
        rope_theta,
        rms_eps,
        tie_embeddings: f.tensor("output.weight").is_none(),
    };
    cfg.validate()
        .map_err(|m| bad(format!("{m} (from the GGUF metadata)")))?;
    // Every block has several tensors: more blocks than tensors is corrupt.
    if cfg.layers > f.tensors.len() {
        return Err(bad(format!(
            "{}.block_count is {} but the file has only {} tensors",
            cfg.arch,
            cfg.layers,
            f.tensors.len()
        )));
    }
    Ok(cfg)
}

/// Which layers are local: `{arch}.attention.sliding_window_pattern` as a
/// per-layer bool array or a period, else llama.cpp's default period 6.
fn swa_layers(f: &GgufFile, arch: &str, layers: usize) -> Result<Vec<bool>> {
    let key = format!("{arch}.attention.sliding_window_pattern");
    let bad = |m: String| Error::model(&f.path, m);
    match f.get(&key) {
        None => Ok(crate::model::gemma::pattern_layers(
            layers,
            crate::model::gemma::DEFAULT_PATTERN,
        )),
        Some(v) => {
            if let Some(n) = v.as_u64() {
                return Ok(crate::model::gemma::pattern_layers(layers, n as usize));
            }
            match v.as_array() {
                Some((ValueType::Bool, items)) if items.len() == layers => {
                    Ok(items.iter().map(|b| matches!(b, Value::Bool(true))).collect())
                }
                Some((ValueType::Bool, items)) => Err(bad(format!(
                    "{key} has {} entries but the model has {layers} layers",
                    items.len()
                ))),
                _ => Err(bad(wrong_type(f, &key, "an integer or an array of bools"))),
            }
        }
    }
}

fn req<'a>(f: &'a GgufFile, key: &str) -> Result<&'a Value> {
    f.get(key)
        .ok_or_else(|| Error::model(&f.path, format!("missing metadata key `{key}`")))
}

fn wrong_type(f: &GgufFile, key: &str, expected: &str) -> String {
    let got = f.get(key).map(Value::type_name).unwrap_or_default();
    format!("metadata key `{key}` is a {got}, expected {expected}")
}

/// The HF name of a GGUF tensor name in architecture `arch`: Gemma 3's norms
/// are named apart (its `ffn_norm` is HF's `pre_feedforward_layernorm`, and
/// it has two post norms); every other family as [`hf_name`].
pub fn hf_name_in(arch: &str, gguf: &str) -> Option<String> {
    let block = gguf.strip_prefix("blk.").and_then(|r| r.split_once('.'));
    if let (true, Some((layer, rest))) = (arch == "gemma3", block) {
        let hf = match rest {
            "ffn_norm.weight" => Some("pre_feedforward_layernorm.weight"),
            "post_attention_norm.weight" => Some("post_attention_layernorm.weight"),
            "post_ffw_norm.weight" => Some("post_feedforward_layernorm.weight"),
            _ => None,
        };
        if let Some(hf) = hf {
            return Some(format!("model.layers.{}.{hf}", layer.parse::<usize>().ok()?));
        }
    }
    hf_name(gguf)
}

/// The GGUF name of an HF tensor name in architecture `arch` (the inverse
/// of [`hf_name_in`]).
pub fn gguf_name_in(arch: &str, hf: &str) -> Option<String> {
    let block = hf.strip_prefix("model.layers.").and_then(|r| r.split_once('.'));
    if let (true, Some((layer, rest))) = (arch == "gemma3", block) {
        let g = match rest {
            "pre_feedforward_layernorm.weight" => Some("ffn_norm.weight"),
            "post_attention_layernorm.weight" => Some("post_attention_norm.weight"),
            "post_feedforward_layernorm.weight" => Some("post_ffw_norm.weight"),
            _ => None,
        };
        if let Some(g) = g {
            return Some(format!("blk.{}.{g}", layer.parse::<usize>().ok()?));
        }
    }
    gguf_name(hf)
}

/// A GGUF tensor's values as HF holds them: Llama's Q/K rows un-permuted
/// (unless `keep_permutation`), and Gemma 3's norm weights less the 1 that
/// llama.cpp's converter added (`w + 1` stored; HF's `Gemma3RMSNorm` holds
/// `w` and multiplies by `1 + w`). The subtraction is exact for stored
/// values ≥ 0.5 (Sterbenz) and for every value whose exponent is at least
/// 1's, which covers norm weights w > −0.5; the engines add the 1 back
/// in f32, as HF does.
pub fn as_hf(cfg: &ModelConfig, gguf: &str, t: Tensor, keep_permutation: bool) -> Tensor {
    if cfg.arch == "llama" && !keep_permutation {
        if gguf.contains(".attn_q.") {
            return unpermute_rows(t, cfg.heads);
        }
        if gguf.contains(".attn_k.") {
            return unpermute_rows(t, cfg.kv_heads);
        }
    }
    if cfg.norm_plus_one && gguf.ends_with("norm.weight") && t.shape().len() == 1 {
        let dtype = t.dtype();
        let shape = t.shape().to_vec();
        let data = t.into_data().into_iter().map(|g| g - 1.0).collect();
        return Tensor::new(shape, data).with_dtype(dtype);
    }
    t
}

/// The HF name of a GGUF tensor name (Llama / Qwen2 layout), if it has one.
pub fn hf_name(gguf: &str) -> Option<String> {
    let fixed = match gguf {
        "token_embd.weight" => Some("model.embed_tokens.weight"),
        "output_norm.weight" => Some("model.norm.weight"),
        "output.weight" => Some("lm_head.weight"),
        _ => None,
    };
    if let Some(n) = fixed {
        return Some(n.to_string());
    }
    let rest = gguf.strip_prefix("blk.")?;
    let (layer, rest) = rest.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    let (part, suffix) = rest.rsplit_once('.')?;
    if suffix != "weight" && suffix != "bias" {
        return None;
    }
    let hf = match part {
        "attn_norm" => "input_layernorm",
        "attn_q" => "self_attn.q_proj",
        "attn_k" => "self_attn.k_proj",
        "attn_v" => "self_attn.v_proj",
        "attn_qkv" => "self_attn.qkv_proj",
        "attn_q_norm" => "self_attn.q_norm",
        "attn_k_norm" => "self_attn.k_norm",
        "attn_output" => "self_attn.o_proj",
        "ffn_norm" => "post_attention_layernorm",
        "ffn_gate" => "mlp.gate_proj",
        "ffn_up" => "mlp.up_proj",
        "ffn_down" => "mlp.down_proj",
        _ => return None,
    };
    Some(format!("model.layers.{layer}.{hf}.{suffix}"))
}

/// The GGUF name of an HF tensor name (the inverse of `hf_name`).
pub fn gguf_name(hf: &str) -> Option<String> {
    let fixed = match hf {
        "model.embed_tokens.weight" => Some("token_embd.weight"),
        "model.norm.weight" => Some("output_norm.weight"),
        "lm_head.weight" => Some("output.weight"),
        _ => None,
    };
    if let Some(n) = fixed {
        return Some(n.to_string());
    }
    let rest = hf.strip_prefix("model.layers.")?;
    let (layer, rest) = rest.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    let (part, suffix) = rest.rsplit_once('.')?;
    let g = match part {
        "input_layernorm" => "attn_norm",
        "self_attn.q_proj" => "attn_q",
        "self_attn.k_proj" => "attn_k",
        "self_attn.v_proj" => "attn_v",
        "self_attn.qkv_proj" => "attn_qkv",
        "self_attn.q_norm" => "attn_q_norm",
        "self_attn.k_norm" => "attn_k_norm",
        "self_attn.o_proj" => "attn_output",
        "post_attention_layernorm" => "ffn_norm",
        "mlp.gate_proj" => "ffn_gate",
        "mlp.up_proj" => "ffn_up",
        // Phi-3's fused gate·up is llama.cpp's (double-height) ffn_up.
        "mlp.gate_up_proj" => "ffn_up",
        "mlp.down_proj" => "ffn_down",
        _ => return None,
    };
    Some(format!("blk.{layer}.{g}.{suffix}"))
}

/// The tensors an architecture needs, with their row-major shapes: (name, shape, required).
pub fn expected_tensors(cfg: &ModelConfig) -> Vec<(String, Vec<usize>, bool)> {
    let (e, f, v) = (cfg.hidden, cfg.ffn, cfg.vocab);
    let (qd, kvd) = (cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim);
    let mut out = vec![
        ("token_embd.weight".to_string(), vec![v, e], true),
        ("output_norm.weight".to_string(), vec![e], true),
        ("output.weight".to_string(), vec![v, e], false),
    ];
    let (d, phi3) = (cfg.head_dim, cfg.arch == "phi3");
    for i in 0..cfg.layers {
        let b = |n: &str| format!("blk.{i}.{n}");
        out.push((b("attn_norm.weight"), vec![e], true));
        if phi3 {
            // Fused q·k·v rows, split on load (`model::fused`).
            out.push((b("attn_qkv.weight"), vec![qd + 2 * kvd, e], true));
        } else {
            out.extend([
                (b("attn_q.weight"), vec![qd, e], true),
                (b("attn_k.weight"), vec![kvd, e], true),
                (b("attn_v.weight"), vec![kvd, e], true),
                (b("attn_q.bias"), vec![qd], false),
                (b("attn_k.bias"), vec![kvd], false),
                (b("attn_v.bias"), vec![kvd], false),
            ]);
        }
        if cfg.qk_norm {
            out.push((b("attn_q_norm.weight"), vec![d], true));
            out.push((b("attn_k_norm.weight"), vec![d], true));
        }
        out.extend([
            (b("attn_output.weight"), vec![e, qd], true),
            (b("ffn_norm.weight"), vec![e], true),
            (b("ffn_down.weight"), vec![e, f], true),
        ]);
        if cfg.post_norms {
            out.push((b("post_attention_norm.weight"), vec![e], true));
            out.push((b("post_ffw_norm.weight"), vec![e], true));
        }
        if phi3 {
            // Fused gate·up (gate rows first), split on load.
            out.push((b("ffn_up.weight"), vec![2 * f, e], true));
        } else {
            out.push((b("ffn_gate.weight"), vec![f, e], true));
            out.push((b("ffn_up.weight"), vec![f, e], true));
        }
    }
    out
}

/// Reads every tensor as f32 (quantised types dequantised), renamed to HF
/// names, checked against the architecture's expected tensors and shapes, and
/// refused with every tensor named if any type cannot be read; Llama Q/K rows un-permuted
/// unless `opts.keep_gguf_qk_permutation`. Tensors with no HF name keep their
/// GGUF name (the engine then reports them as unused).
pub fn weights(f: &GgufFile, cfg: &ModelConfig, opts: &LoadOptions) -> Result<Weights> {
    let bad = |msg: String| Error::model(&f.path, msg);
    for (name, shape, required) in expected_tensors(cfg) {
        match f.tensor(&name) {
            None if required => {
                return Err(bad(format!(
                    "missing tensor `{name}` (HF `{}`), required by the {} architecture",
                    hf_name(&name).unwrap_or_default(),
                    cfg.arch
                )))
            }
            None => {}
            Some(t) if t.shape() != shape => {
                return Err(bad(format!(
                    "tensor `{name}` has shape {:?} (GGUF ne {:?}), expected {shape:?}",
                    t.shape(),
                    t.ne
                )))
            }
            Some(_) => {}
        }
    }
    unreadable(f)?;
    let mut out = BTreeMap::new();
    for info in &f.tensors {
        let t = as_hf(cfg, &info.name, f.read_tensor(info)?, opts.keep_gguf_qk_permutation);
        let mut name = hf_name_in(&cfg.arch, &info.name).unwrap_or_else(|| info.name.clone());
        if cfg.arch == "phi3" && name.ends_with(".mlp.up_proj.weight") {
            name = name.replace(".mlp.up_proj.", ".mlp.gate_up_proj.");
        }
        out.insert(name, t);
    }
    Ok(Weights::from_map(f.path.clone(), out))
}

/// Every tensor of a type that cannot be read, named and counted per type in
/// one error: a model in an unsupported quantisation is then refused with the
/// whole list, not one tensor at a time.
fn unreadable(f: &GgufFile) -> Result<()> {
    let mut by_type: BTreeMap<GgmlType, Vec<&str>> = BTreeMap::new();
    for t in f.tensors.iter().filter(|t| !t.ggml_type.readable()) {
        by_type.entry(t.ggml_type).or_default().push(&t.name);
    }
    if by_type.is_empty() {
        return Ok(());
    }
    let clauses: Vec<String> = by_type
        .iter()
        .map(|(ty, names)| {
            let (n, verb) = match names.len() {
                1 => ("1 tensor".to_string(), "is"),
                n => (format!("{n} tensors"), "are"),
            };
            format!("{n} of type {} {verb} not supported: {}", ty.name(), names.join(", "))
        })
        .collect();
    Err(Error::model(
        &f.path,
        format!(
            "{} (dequantisation exists for {})",
            clauses.join("; "),
            quant::readable_names()
        ),
    ))
}

/// llama.cpp's `permute(w, n_head)`: within each head of D rows, HF row
/// `t·D/2 + j` (t ∈ {0,1}) is stored at row `2j + t`. Rows are the first axis;
/// a bias is a tensor of one-element rows.
pub fn permute_rows(t: Tensor, n_head: usize) -> Tensor {
    reorder_rows(t, n_head, false)
}

/// The inverse of [`permute_rows`]: back to HF's layout.
pub fn unpermute_rows(t: Tensor, n_head: usize) -> Tensor {
    reorder_rows(t, n_head, true)
}

fn reorder_rows(t: Tensor, n_head: usize, inverse: bool) -> Tensor {
    let shape = t.shape().to_vec();
    let dtype = t.dtype();
    let rows = shape[0];
    let row_len: usize = shape[1..].iter().product();
    let d = rows / n_head;
    let half = d / 2;
    let src = t.into_data();
    let mut dst = vec![0f32; src.len()];
    for h in 0..n_head {
        for tt in 0..2 {
            for j in 0..half {
                let hf = h * d + tt * half + j;
                let gg = h * d + 2 * j + tt;
                let (from, to) = if inverse { (gg, hf) } else { (hf, gg) };
                dst[to * row_len..(to + 1) * row_len].copy_from_slice(&src[from * row_len..(from + 1) * row_len]);
            }
        }
    }
    Tensor::new(shape, dst).with_dtype(dtype)
}

/// A GGUF of an HF-named model, as llama.cpp's converter writes it: GGUF names,
/// `{arch}.*` metadata, placeholder tokens (`<0>`, `<1>`, ...), and for
/// `cfg.arch == "llama"` the Q/K rows permuted. Tensors with no GGUF name are
/// skipped; the head is omitted when `cfg.tie_embeddings`.
pub fn model_writer(cfg: &ModelConfig, tensors: &BTreeMap<String, Tensor>, ty: GgmlType) -> GgufWriter {
    let mut w = GgufWriter::new();
    let a = cfg.arch.as_str();
    w.kv("general.architecture", Value::String(a.into()))
        .kv("general.name", Value::String(format!("touchstone test {a}")))
        .kv(&format!("{a}.block_count"), Value::U32(cfg.layers as u32))
        .kv(&format!("{a}.context_length"), Value::U32(256))
        .kv(&format!("{a}.embedding_length"), Value::U32(cfg.hidden as u32))
        .kv(&format!("{a}.feed_forward_length"), Value::U32(cfg.ffn as u32))
        .kv(&format!("{a}.attention.head_count"), Value::U32(cfg.heads as u32))
        .kv(&format!("{a}.attention.head_count_kv"), Value::U32(cfg.kv_heads as u32))
        .kv(&format!("{a}.attention.key_length"), Value::U32(cfg.head_dim as u32))
        .kv(&format!("{a}.attention.value_length"), Value::U32(cfg.head_dim as u32))
        .kv(&format!("{a}.rope.freq_base"), Value::F32(cfg.rope_theta as f32))
        .kv(
            &format!("{a}.attention.layer_norm_rms_epsilon"),
            Value::F32(cfg.rms_eps as f32),
        )
        .kv("tokenizer.ggml.model", Value::String("gpt2".into()))
        .kv(
            "tokenizer.ggml.tokens",
            Value::Array(
                ValueType::String,
                (0..cfg.vocab).map(|i| Value::String(format!("<{i}>"))).collect(),
            ),
        );
    if let Some(l) = &cfg.local {
        w.kv(&format!("{a}.attention.sliding_window"), Value::U32(l.window as u32));
        w.kv(
            &format!("{a}.attention.sliding_window_pattern"),
            Value::Array(ValueType::Bool, l.layers.iter().map(|b| Value::Bool(*b)).collect()),
        );
        if let Some(t) = l.rope_theta {
            w.kv(&format!("{a}.rope.freq_base_swa"), Value::F32(t as f32));
        }
    }
    for (hf, t) in tensors {
        if hf == "lm_head.weight" && cfg.tie_embeddings {
            continue;
        }
        let Some(name) = gguf_name_in(a, hf) else { continue };
        let mut t = t.clone();
        if cfg.norm_plus_one && name.ends_with("norm.weight") {
            t = Tensor::new(t.shape().to_vec(), t.data().iter().map(|w| w + 1.0).collect());
        }
        if a == "llama" {
            if name.contains(".attn_q.") {
                t = permute_rows(t, cfg.heads);
            } else if name.contains(".attn_k.") {
                t = permute_rows(t, cfg.kv_heads);
            }
        }
        // Norms and biases stay F32, as llama.cpp keeps 1-D tensors.
        let ty = if t.shape().len() == 1 { GgmlType::F32 } else { ty };
        w.tensor(&name, ty, t.shape(), t.data());
    }
    w
}

#[cfg(test)]
mod tests;
