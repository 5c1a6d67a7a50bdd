//! RoPE scaling as HF transformers computes it (`modeling_rope_utils`):
//! linear, dynamic NTK, YaRN, LongRoPE and Llama 3's, read from a config's
//! `rope_scaling` (transformers 4) or `rope_parameters` (transformers 5).
//!
//! Two things are computed from it:
//! - the engines' frequency table, in HF's f32 order of operations
//!   (`inv_freq_f32`), so that a correct engine's `q_rope` agrees with HF's
//!   to the last bit or two;
//! - the check's exact frequencies, in f64 (`inv_freq_f64`), with a bound on
//!   how far HF's f32 formation can be from them (`f32_rel_error`): the
//!   `rope` check judges every pair's angle against the config's formula.
//!
//! Dynamic NTK and LongRoPE depend on the length of the sequence a forward
//! pass reaches (HF's `dynamic_rope_update`: `seq_len = max(position_ids)+1`
//! of that call), so a step's table is chosen by the step; keys already in
//! the cache keep the rotation they were given (HF never re-rotates them).

use serde_json::Value;

/// A config's RoPE scaling.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
#[serde(tag = "rope_type", rename_all = "snake_case")]
pub enum RopeScaling {
    /// Positions divided by `factor` (`inv_freq / factor`).
    Linear { factor: f64 },
    /// Dynamic NTK: once a pass reaches `seq_len > max_positions`, the base
    /// becomes `θ·(factor·seq_len/max − (factor − 1))^(D/(D−2))` for that pass.
    Dynamic { factor: f64, max_positions: usize },
    /// YaRN: frequencies between extrapolation (fast pairs) and
    /// interpolation by `factor` (slow pairs) over a ramp from the correction
    /// range of `beta_fast`/`beta_slow` rotations in `original` positions
    /// (floored/ceiled when `truncate`); cos and sin times `attention_factor`.
    Yarn {
        factor: f64,
        original: usize,
        attention_factor: f64,
        beta_fast: f64,
        beta_slow: f64,
        truncate: bool,
    },
    /// LongRoPE: per-pair divisors, `short` while a pass stays within
    /// `original` positions and `long` once it reaches beyond; cos and sin
    /// times `attention_factor`.
    Longrope {
        short: Vec<f64>,
        long: Vec<f64>,
        original: usize,
        attention_factor: f64,
    },
    /// Llama 3: wavelengths above `original/low_freq_factor` divided by
    /// `factor`, below `original/high_freq_factor` kept, a smooth blend between.
    Llama3 {
        factor: f64,
        low_freq_factor: f64,
        high_freq_factor: f64,
        original: usize,
    },
}

/// Where a config keeps its scaling, for messages.
const FIELDS: [&str; 2] = ["rope_parameters", "rope_scaling"];

impl RopeScaling {
    /// The scaling of an HF config `v`, or None (no scaling, `default`).
    /// `arch` decides HF's class defaults (Phi-3's `original_max_position_embeddings`).
    pub fn from_config(v: &Value, arch: &str) -> Result<Option<RopeScaling>, String> {
        // transformers 5 writes `rope_parameters` (with `rope_theta` in it);
        // transformers 4 `rope_scaling`. Either may be absent or null.
        // The first that asks for scaling (a config may carry a `default`
        // rope_parameters beside a transformers-4 `rope_scaling`).
        let scaled = |p: &&Value| {
            let ty = p.get("rope_type").or_else(|| p.get("type"));
            ty.is_some_and(|t| t.as_str() != Some("default")) || p.get("factor").is_some_and(|f| !f.is_null())
        };
        let found = FIELDS
            .iter()
            .find_map(|&f| v.get(f).filter(|p| p.is_object()).filter(scaled).map(|p| (f, p)));
        let Some((field, p)) = found else {
            for f in FIELDS {
                if let Some(x) = v.get(f).filter(|x| !x.is_null() && !x.is_object()) {
                    return Err(format!("`{f}` is {x}, expected an object or null"));
                }
            }
            return Ok(None);
        };
        let ty = match p.get("rope_type").or_else(|| p.get("type")) {
            None => return Err(format!("`{field}` has a `factor` but no `rope_type`: which scaling is meant?")),
            Some(t) => t
                .as_str()
                .ok_or_else(|| format!("`{field}.rope_type` is {t}, expected a string"))?,
        };
        let num = |k: &str| -> Result<Option<f64>, String> {
            match p.get(k) {
                None | Some(Value::Null) => Ok(None),
                Some(x) => x
                    .as_f64()
                    .filter(|f| f.is_finite())
                    .map(Some)
                    .ok_or_else(|| format!("`{field}.{k}` is {x}, expected a finite number")),
            }
        };
        let need = |k: &str| num(k)?.ok_or_else(|| format!("`{field}` of rope_type `{ty}` needs `{k}`"));
        let max_pos = v.get("max_position_embeddings").and_then(Value::as_u64).map(|n| n as usize);
        // HF's `standardize_rope_params`: a top-level
        // `original_max_position_embeddings` wins (Phi-3 keeps it there, with
        // a class default of 4096), then the scaling's own, then the model's
        // max_position_embeddings.
        let original = || -> Result<usize, String> {
            let top = v.get("original_max_position_embeddings").filter(|x| !x.is_null());
            let own = p.get("original_max_position_embeddings").filter(|x| !x.is_null());
            let o = match (top, own) {
                (Some(x), _) => x.as_u64().ok_or_else(|| {
                    format!("`original_max_position_embeddings` is {x}, expected a positive integer")
                })? as usize,
                (None, _) if arch == "phi3" => 4096,
                (None, Some(x)) => x.as_u64().ok_or_else(|| {
                    format!("`{field}.original_max_position_embeddings` is {x}, expected a positive integer")
                })? as usize,
                (None, None) => max_pos.ok_or_else(|| {
                    format!(
                        "rope_type `{ty}` needs `original_max_position_embeddings` (or `max_position_embeddings`)"
                    )
                })?,
            };
            if o < 2 {
                return Err(format!("original_max_position_embeddings is {o}; at least 2 is needed"));
            }
            Ok(o)
        };
        // Like HF, a factor may be left out where the model's two lengths give it.
        let factor_or_ratio = |o: usize| -> Result<f64, String> {
            match num("factor")? {
                Some(f) => Ok(f),
                None => max_pos
                    .map(|m| m as f64 / o as f64)
                    .ok_or_else(|| format!("`{field}` of rope_type `{ty}` needs `factor` (or max_position_embeddings)")),
            }
        };
        if let Some(x) = num("partial_rotary_factor")?.filter(|&f| f != 1.0) {
            return Err(format!(
                "`{field}.partial_rotary_factor` is {x}: partial RoPE is not implemented by touchstone's engines"
            ));
        }
        let positive = |k: &str, f: f64| {
            if f > 0.0 {
                Ok(f)
            } else {
                Err(format!("`{field}.{k}` is {f}, expected a positive number"))
            }
        };
        let s = match ty {
            "default" => {
                if let Some(f) = num("factor")?.filter(|&f| f != 1.0) {
                    return Err(format!("`{field}.factor` is {f} with rope_type `default`: which scaling is meant?"));
                }
                return Ok(None);
            }
            "linear" => RopeScaling::Linear {
                factor: positive("factor", need("factor")?)?,
            },
            "dynamic" => RopeScaling::Dynamic {
                factor: positive("factor", need("factor")?)?,
                max_positions: max_pos.ok_or("rope_type `dynamic` needs `max_position_embeddings`")?,
            },
            "yarn" => {
                let o = original()?;
                let factor = positive("factor", factor_or_ratio(o)?)?;
                let mscale = |s: f64, m: f64| if s <= 1.0 { 1.0 } else { 0.1 * m * s.ln() + 1.0 };
                let attention_factor = match (num("attention_factor")?, num("mscale")?, num("mscale_all_dim")?) {
                    (Some(a), _, _) => a,
                    // HF: `if mscale and mscale_all_dim` (0 counts as absent).
                    (None, Some(m), Some(a)) if m != 0.0 && a != 0.0 => mscale(factor, m) / mscale(factor, a),
                    _ => mscale(factor, 1.0),
                };
                // HF: `get("beta_fast") or 32`: 0 or null take the default.
                let beta = |k: &str, d: f64| Ok::<f64, String>(num(k)?.filter(|&b| b != 0.0).unwrap_or(d));
                let truncate = match p.get("truncate") {
                    None | Some(Value::Null) => true,
                    Some(Value::Bool(b)) => *b,
                    Some(x) => return Err(format!("`{field}.truncate` is {x}, expected true or false")),
                };
                RopeScaling::Yarn {
                    factor,
                    original: o,
                    attention_factor,
                    beta_fast: beta("beta_fast", 32.0)?,
                    beta_slow: beta("beta_slow", 1.0)?,
                    truncate,
                }
            }
            "longrope" => {
                let o = original()?;
                let factor = factor_or_ratio(o)?;
                let attention_factor = match num("attention_factor")? {
                    Some(a) => a,
                    None if factor <= 1.0 => 1.0,
                    None => (1.0 + factor.ln() / (o as f64).ln()).sqrt(),
                };
                let list = |k: &str| -> Result<Vec<f64>, String> {
                    let a = p
                        .get(k)
                        .and_then(Value::as_array)
                        .ok_or_else(|| format!("rope_type `longrope` needs `{field}.{k}`, a list of numbers"))?;
                    a.iter()
                        .map(|x| {
                            x.as_f64()
                                .filter(|f| f.is_finite() && *f > 0.0)
                                .ok_or_else(|| format!("`{field}.{k}` holds {x}, expected positive numbers"))
                        })
                        .collect()
                };
                RopeScaling::Longrope {
                    short: list("short_factor")?,
                    long: list("long_factor")?,
                    original: o,
                    attention_factor,
                }
            }
            "llama3" => {
                let (lo, hi) = (need("low_freq_factor")?, need("high_freq_factor")?);
                if hi <= lo {
                    return Err(format!(
                        "`{field}.high_freq_factor` ({hi}) must exceed `low_freq_factor` ({lo})"
                    ));
                }
                RopeScaling::Llama3 {
                    factor: positive("factor", need("factor")?)?,
                    low_freq_factor: positive("low_freq_factor", lo)?,
                    high_freq_factor: hi,
                    original: original()?,
                }
            }
            other => {
                return Err(format!(
                    "`{field}.rope_type` is \"{other}\": this RoPE scaling is not implemented by touchstone's engines \
                     (implemented: linear, dynamic, yarn, longrope, llama3), so this model cannot be computed \
                     faithfully (refusing rather than checking a different model)"
                ))
            }
        };
        Ok(Some(s))
    }

    /// Checks what depends on the head size (LongRoPE's lists: D/2 each).
    pub fn validate(&self, head_dim: usize) -> Result<(), String> {
        if let RopeScaling::Longrope { short, long, .. } = self {
            for (k, l) in [("short_factor", short), ("long_factor", long)] {
                if l.len() != head_dim / 2 {
                    return Err(format!(
                        "`{k}` has {} entries; rope_type `longrope` needs head_dim/2 = {}",
                        l.len(),
                        head_dim / 2
                    ));
                }
            }
        }
        Ok(())
    }

    pub fn name(&self) -> &'static str {
        match self {
            RopeScaling::Linear { .. } => "linear",
            RopeScaling::Dynamic { .. } => "dynamic",
            RopeScaling::Yarn { .. } => "yarn",
            RopeScaling::Longrope { .. } => "longrope",
            RopeScaling::Llama3 { .. } => "llama3",
        }
    }

    /// The factor cos and sin are multiplied by (HF's `attention_scaling`).
    pub fn attention_factor(&self) -> f64 {
        match self {
            RopeScaling::Yarn { attention_factor, .. } | RopeScaling::Longrope { attention_factor, .. } => {
                *attention_factor
            }
            _ => 1.0,
        }
    }

    /// The sequence length past which a pass's table changes (its `seq_len`
    /// = the pass's last position + 1), for the scalings that depend on it.
    pub fn switch_after(&self) -> Option<usize> {
        match self {
            RopeScaling::Dynamic { max_positions, .. } => Some(*max_positions),
            RopeScaling::Longrope { original, .. } => Some(*original),
            _ => None,
        }
    }

    /// Which table a pass reaching `seq_len` positions uses: equal keys, the
    /// same frequencies. 0 is the table of a short pass.
    pub fn table_key(&self, seq_len: usize) -> usize {
        match self {
            RopeScaling::Dynamic { max_positions, .. } if seq_len > *max_positions => seq_len,
            RopeScaling::Longrope { original, .. } if seq_len > *original => 1,
            _ => 0,
        }
    }

    /// The positions every boundary of this scaling sits at (for the
    /// boundary checks and messages): the original context, the switch.
    pub fn original_context(&self) -> Option<usize> {
        match self {
            RopeScaling::Yarn { original, .. }
            | RopeScaling::Longrope { original, .. }
            | RopeScaling::Llama3 { original, .. } => Some(*original),
            RopeScaling::Dynamic { max_positions, .. } => Some(*max_positions),
            RopeScaling::Linear { .. } => None,
        }
    }

    /// The context the scaled model is built for: the original times the
    /// factor (None where no bound follows: dynamic grows as far as asked).
    pub fn scaled_context(&self, max_positions: Option<usize>) -> Option<usize> {
        let grow = |o: usize, f: f64| ((o as f64 * f).floor() as usize).max(max_positions.unwrap_or(0));
        match self {
            RopeScaling::Dynamic { .. } => None,
            RopeScaling::Linear { factor } => max_positions.map(|m| grow(m, *factor)),
            RopeScaling::Yarn { factor, original, .. } | RopeScaling::Llama3 { factor, original, .. } => {
                Some(grow(*original, *factor))
            }
            RopeScaling::Longrope { .. } => max_positions,
        }
    }

    /// YaRN's ramp (low, high) in pair indices: HF's `find_correction_range`
    /// (f64, floored/ceiled when truncating), with `linear_ramp_factor`'s
    /// guard against a zero-width ramp.
    pub fn yarn_range(head_dim: usize, theta: f64, beta_fast: f64, beta_slow: f64, original: usize, truncate: bool) -> (f64, f64) {
        let dim = head_dim as f64;
        let corr = |rot: f64| (dim * (original as f64 / (rot * 2.0 * std::f64::consts::PI)).ln()) / (2.0 * theta.ln());
        let (mut low, mut high) = (corr(beta_fast), corr(beta_slow));
        if truncate {
            low = low.floor();
            high = high.ceil();
        }
        let (low, high) = (low.max(0.0), high.min(dim - 1.0));
        (low, if low == high { high + 0.001 } else { high })
    }

    /// The f32 frequencies HF computes for a pass reaching `seq_len`
    /// positions, in its order of operations (see each arm).
    pub fn inv_freq_f32(&self, head_dim: usize, theta: f64, seq_len: usize) -> Vec<f32> {
        let half = head_dim / 2;
        let d = head_dim as f32;
        // `base ** (arange(0, D, 2).float() / D)` in f32.
        let pow_of = |base: f32| -> Vec<f32> { (0..half).map(|j| base.powf((2 * j) as f32 / d)).collect() };
        let plain = || -> Vec<f32> { pow_of(theta as f32).iter().map(|&p| 1.0f32 / p).collect() };
        match self {
            RopeScaling::Linear { factor } => plain().iter().map(|&f| f / *factor as f32).collect(),
            RopeScaling::Dynamic { factor, max_positions } => {
                if seq_len <= *max_positions {
                    return plain();
                }
                // seq_len is an int64 tensor in HF, so the base is formed in f32.
                let (f, m) = (*factor as f32, *max_positions as f32);
                let grow = ((f * seq_len as f32) / m - (*factor - 1.0) as f32).powf((head_dim as f64 / (head_dim as f64 - 2.0)) as f32);
                let base = theta as f32 * grow;
                pow_of(base).iter().map(|&p| 1.0f32 / p).collect()
            }
            RopeScaling::Yarn {
                factor,
                original,
                beta_fast,
                beta_slow,
                truncate,
                ..
            } => {
                let pos = pow_of(theta as f32);
                let (low, high) = Self::yarn_range(head_dim, theta, *beta_fast, *beta_slow, *original, *truncate);
                let span = (high - low) as f32;
                let f = *factor as f32;
                (0..half)
                    .map(|j| {
                        let ramp = ((j as f32 - low as f32) / span).clamp(0.0, 1.0);
                        let extrap_w = 1.0f32 - ramp;
                        let extrap = 1.0f32 / pos[j];
                        let interp = 1.0f32 / (f * pos[j]);
                        interp * (1.0f32 - extrap_w) + extrap * extrap_w
                    })
                    .collect()
            }
            RopeScaling::Longrope {
                short, long, original, ..
            } => {
                let ext = if seq_len > *original { long } else { short };
                pow_of(theta as f32)
                    .iter()
                    .zip(ext)
                    .map(|(&p, &e)| 1.0f32 / (e as f32 * p))
                    .collect()
            }
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original,
            } => {
                let o = *original as f64;
                let (low_w, high_w) = ((o / low_freq_factor) as f32, (o / high_freq_factor) as f32);
                let f = *factor as f32;
                let two_pi = (2.0 * std::f64::consts::PI) as f32;
                // A Python number divided by a tensor is torch's
                // `reciprocal(t) * number`: two roundings, kept here.
                plain()
                    .iter()
                    .map(|&inv| {
                        let w = (1.0f32 / inv) * two_pi;
                        let scaled = if w > low_w { inv / f } else { inv };
                        if !(w < high_w) && !(w > low_w) {
                            let s = ((1.0f32 / w) * *original as f32 - *low_freq_factor as f32)
                                / (high_freq_factor - low_freq_factor) as f32;
                            (1.0f32 - s) * scaled / f + s * scaled
                        } else {
                            scaled
                        }
                    })
                    .collect()
            }
        }
    }

    /// The exact frequencies of the formula (f64), for the `rope` check.
    pub fn inv_freq_f64(&self, head_dim: usize, theta: f64, seq_len: usize) -> Vec<f64> {
        let half = head_dim / 2;
        let d = head_dim as f64;
        let plain_of = |base: f64| -> Vec<f64> { (0..half).map(|j| base.powf(-((2 * j) as f64) / d)).collect() };
        match self {
            RopeScaling::Linear { factor } => plain_of(theta).iter().map(|f| f / factor).collect(),
            RopeScaling::Dynamic { factor, max_positions } => {
                if seq_len <= *max_positions {
                    return plain_of(theta);
                }
                let grow = (factor * seq_len as f64 / *max_positions as f64 - (factor - 1.0)).powf(d / (d - 2.0));
                plain_of(theta * grow)
            }
            RopeScaling::Yarn {
                factor,
                original,
                beta_fast,
                beta_slow,
                truncate,
                ..
            } => {
                let (low, high) = Self::yarn_range(head_dim, theta, *beta_fast, *beta_slow, *original, *truncate);
                plain_of(theta)
                    .iter()
                    .enumerate()
                    .map(|(j, &x)| {
                        let ramp = ((j as f64 - low) / (high - low)).clamp(0.0, 1.0);
                        x / factor * ramp + x * (1.0 - ramp)
                    })
                    .collect()
            }
            RopeScaling::Longrope {
                short, long, original, ..
            } => {
                let ext = if seq_len > *original { long } else { short };
                plain_of(theta).iter().zip(ext).map(|(x, e)| x / e).collect()
            }
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original,
            } => {
                let o = *original as f64;
                let (low_w, high_w) = (o / low_freq_factor, o / high_freq_factor);
                plain_of(theta)
                    .iter()
                    .map(|&inv| {
                        let w = 2.0 * std::f64::consts::PI / inv;
                        if w > low_w {
                            inv / factor
                        } else if w < high_w {
                            inv
                        } else {
                            let s = (o / w - low_freq_factor) / (high_freq_factor - low_freq_factor);
                            (1.0 - s) * inv / factor + s * inv
                        }
                    })
                    .collect()
            }
        }
    }

    /// A bound on the relative distance of HF's f32 frequencies from the
    /// exact formula, counted from the f32 operations each forms them with
    /// (u = 2^-24 per correctly rounded op, 2u for `powf`):
    /// plain θ^(−2j/D): pow 2u + reciprocal u = 3u; linear adds a division (4u);
    /// dynamic forms its base in f32 (4 ops and a pow: 6u, at most that
    /// relative in θ^(2j/D) since the exponent is below 1) before the plain
    /// 3u (9u); LongRoPE rounds its factor and multiplies (5u); YaRN mixes
    /// interpolation (3u + u) and extrapolation (3u) with a ramp whose f32
    /// value is off by up to 3u absolute, each error relative to the mixture,
    /// which is at least 1/factor of the larger term, so
    /// (4u + 2u + 3u)·factor; Llama 3's blend weight s is off by up to 6u of
    /// its value ≤ 1 (wavelength 2 ops, ratio, difference, division), and
    /// the blend's own 4 ops, relative to a result ≥ inv/factor:
    /// (3u + 6u + 4u)·factor. The `rope` check grants this on top of the
    /// angle's own f32 product.
    pub fn f32_rel_error(&self) -> f64 {
        let u = 2f64.powi(-24);
        match self {
            RopeScaling::Linear { .. } => 4.0 * u,
            RopeScaling::Dynamic { .. } => 9.0 * u,
            RopeScaling::Longrope { .. } => 5.0 * u,
            RopeScaling::Yarn { factor, .. } => 9.0 * u * factor.max(1.0),
            RopeScaling::Llama3 { factor, .. } => 13.0 * u * factor.max(1.0),
        }
    }

    /// One line for messages: the type and its parameters.
    pub fn describe(&self) -> String {
        match self {
            RopeScaling::Linear { factor } => format!("linear, factor {factor}"),
            RopeScaling::Dynamic { factor, max_positions } => {
                format!("dynamic NTK, factor {factor}, from seq_len > {max_positions}")
            }
            RopeScaling::Yarn {
                factor,
                original,
                attention_factor,
                beta_fast,
                beta_slow,
                truncate,
            } => format!(
                "yarn, factor {factor}, original {original}, attention factor {attention_factor}, beta_fast {beta_fast}, \
                 beta_slow {beta_slow}, truncate {truncate}"
            ),
            RopeScaling::Longrope {
                original,
                attention_factor,
                ..
            } => format!(
                "longrope, short factors while seq_len <= {original}, long beyond, attention factor {attention_factor}"
            ),
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original,
            } => format!(
                "llama3, factor {factor}, low_freq_factor {low_freq_factor}, high_freq_factor {high_freq_factor}, \
                 original {original}"
            ),
        }
    }
}

#[cfg(test)]
#[path = "rope_scaling_tests.rs"]
mod tests;
