//! Token selection from logits, shared by every engine so that "same seed, same
//! tokens" is a property of the engine's logits alone. Greedy is argmax (first
//! index on ties, as torch.argmax); random sampling applies temperature, then
//! top-k, then top-p (nucleus), then draws with a seeded ChaCha8 RNG.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub enum Sampling {
    Greedy,
    Random {
        temperature: f32,
        top_k: Option<usize>,
        top_p: Option<f32>,
    },
}

/// A spec writes sampling as `greedy` or `{temperature: 0.8, top_k: 40, top_p: 0.95}`.
impl<'de> serde::Deserialize<'de> for Sampling {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        use serde::de::{self, MapAccess, Visitor};
        use serde::Deserialize;
        #[derive(serde::Deserialize)]
        #[serde(deny_unknown_fields)]
        struct Random {
            temperature: f32,
            top_k: Option<usize>,
            top_p: Option<f32>,
        }
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Sampling;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("`greedy` or a map {temperature, top_k, top_p}")
            }
            fn visit_str<E: de::Error>(self, s: &str) -> Result<Sampling, E> {
                match s {
                    "greedy" => Ok(Sampling::Greedy),
                    other => Err(E::custom(format!(
                        "unknown sampling `{other}`: use `greedy` or {{temperature, top_k, top_p}}"
                    ))),
                }
            }
            fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Sampling, A::Error> {
                let r = Random::deserialize(de::value::MapAccessDeserializer::new(map))?;
                if !(r.temperature.is_finite() && r.temperature >= 0.0) {
                    return Err(de::Error::custom("temperature must be a finite number >= 0"));
                }
                if let Some(p) = r.top_p {
                    if !(p > 0.0 && p <= 1.0) {
                        return Err(de::Error::custom("top_p must be in (0, 1]"));
                    }
                }
                if r.top_k == Some(0) {
                    return Err(de::Error::custom("top_k must be at least 1"));
                }
                Ok(Sampling::Random {
                    temperature: r.temperature,
                    top_k: r.top_k,
                    top_p: r.top_p,
                })
            }
        }
        d.deserialize_any(V)
    }
}

pub struct Sampler {
    sampling: Sampling,
    rng: ChaCha8Rng,
}

impl Sampler {
    pub fn new(sampling: Sampling, seed: u64) -> Sampler {
        Sampler {
            sampling,
            rng: ChaCha8Rng::seed_from_u64(seed),
        }
    }

    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        match &self.sampling {
            Sampling::Greedy => argmax(logits),
            Sampling::Random {
                temperature,
                top_k,
                top_p,
            } => {
                if *temperature <= 0.0 {
                    return argmax(logits);
                }
                let (t, k, p) = (*temperature, *top_k, *top_p);
                sample_random(logits, t, k, p, &mut self.rng)
            }
        }
    }
}

/// The 256-bit ChaCha8 key `Sampler::new(_, seed)` draws with, as 8
/// little-endian words: what the CUDA engine's sampling kernel is given.
pub fn chacha_key(seed: u64) -> [u32; 8] {
    let bytes = ChaCha8Rng::seed_from_u64(seed).get_seed();
    std::array::from_fn(|i| u32::from_le_bytes([bytes[4 * i], bytes[4 * i + 1], bytes[4 * i + 2], bytes[4 * i + 3]]))
}

pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &x) in logits.iter().enumerate() {
        // `>` keeps the first maximum; NaN never wins.
        if x > logits[best] || logits[best].is_nan() {
            best = i;
        }
    }
    best as u32
}

/// The tokens a random draw chooses from, in draw order (logit descending,
/// ties by index), and their probabilities: temperature, then top-k, then
/// top-p (the smallest prefix whose mass reaches p, renormalised). `None` when
/// no logit is finite.
fn nucleus(
    logits: &[f32],
    temperature: f32,
    top_k: Option<usize>,
    top_p: Option<f32>,
) -> Option<(Vec<usize>, Vec<f64>)> {
    // Candidates sorted by logit, descending; ties broken by index so the order
    // (and hence the draw) is deterministic.
    let mut idx: Vec<usize> = (0..logits.len()).filter(|&i| logits[i].is_finite()).collect();
    if idx.is_empty() {
        return None;
    }
    idx.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
    if let Some(k) = top_k {
        idx.truncate(k.max(1));
    }
    let max = logits[idx[0]] as f64;
    let mut probs: Vec<f64> = idx
        .iter()
        .map(|&i| ((logits[i] as f64 - max) / temperature as f64).exp())
        .collect();
    let total: f64 = probs.iter().sum();
    probs.iter_mut().for_each(|p| *p /= total);
    if let Some(p) = top_p {
        // Keep the smallest prefix whose mass reaches p (at least one token).
        let mut acc = 0.0;
        let mut keep = probs.len();
        for (n, q) in probs.iter().enumerate() {
            acc += q;
            if acc >= p as f64 {
                keep = n + 1;
                break;
            }
        }
        idx.truncate(keep);
        probs.truncate(keep);
        let total: f64 = probs.iter().sum();
        probs.iter_mut().for_each(|q| *q /= total);
    }
    Some((idx, probs))
}

/// The distribution a random draw samples from, over the whole vocabulary
/// (0 for tokens temperature/top-k/top-p removed): the `sample_probs` stage.
/// `None` for greedy sampling, which draws nothing.
pub fn distribution(sampling: &Sampling, logits: &[f32]) -> Option<Vec<f32>> {
    let Sampling::Random {
        temperature,
        top_k,
        top_p,
    } = *sampling
    else {
        return None;
    };
    let mut out = vec![0.0f32; logits.len()];
    if temperature <= 0.0 {
        out[argmax(logits) as usize] = 1.0;
        return Some(out);
    }
    match nucleus(logits, temperature, top_k, top_p) {
        Some((idx, probs)) => {
            for (i, p) in idx.into_iter().zip(probs) {
                out[i] = p as f32;
            }
        }
        None => out[argmax(logits) as usize] = 1.0,
    }
    Some(out)
}

fn sample_random(
    logits: &[f32],
    temperature: f32,
    top_k: Option<usize>,
    top_p: Option<f32>,
    rng: &mut ChaCha8Rng,
) -> u32 {
    // One draw per call, taken first, so the n-th call always uses the n-th
    // u64 of the stream whatever the logits (the CUDA engine's sampling kernel
    // is handed that index instead of carrying the generator's state).
    let mut u: f64 = rng.random();
    let Some((idx, probs)) = nucleus(logits, temperature, top_k, top_p) else {
        return argmax(logits);
    };
    for (n, q) in probs.iter().enumerate() {
        if u < *q {
            return idx[n] as u32;
        }
        u -= q;
    }
    idx[probs.len() - 1] as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_takes_first_maximum() {
        assert_eq!(argmax(&[0.0, 3.0, 3.0, 1.0]), 1);
    }

    #[test]
    fn same_seed_same_tokens_and_top_k_one_is_greedy() {
        let logits: Vec<f32> = (0..50).map(|i| ((i * 37) % 11) as f32 * 0.3).collect();
        let s = Sampling::Random {
            temperature: 1.0,
            top_k: Some(20),
            top_p: Some(0.9),
        };
        let draw = |seed| {
            let mut sm = Sampler::new(s.clone(), seed);
            (0..32).map(|_| sm.sample(&logits)).collect::<Vec<_>>()
        };
        assert_eq!(draw(7), draw(7));
        assert_ne!(draw(7), draw(8));
        let mut k1 = Sampler::new(
            Sampling::Random {
                temperature: 1.0,
                top_k: Some(1),
                top_p: None,
            },
            3,
        );
        assert_eq!(k1.sample(&logits), argmax(&logits));
    }

    #[test]
    fn distribution_is_what_the_draw_uses() {
        let logits: Vec<f32> = vec![1.0, 3.0, 2.0, f32::NEG_INFINITY, 3.0, 0.5];
        let s = Sampling::Random {
            temperature: 0.7,
            top_k: Some(4),
            top_p: Some(0.9),
        };
        let d = distribution(&s, &logits).unwrap();
        assert!((d.iter().map(|&p| p as f64).sum::<f64>() - 1.0).abs() < 1e-6);
        assert_eq!(d[3], 0.0, "-inf is never drawn");
        assert_eq!(d[5], 0.0, "outside the top 4");
        assert_eq!(d[1], d[4], "tied logits, tied probabilities");
        // Every token drawn has a positive probability.
        let mut sm = Sampler::new(s.clone(), 11);
        assert!((0..200).all(|_| d[sm.sample(&logits) as usize] > 0.0));
        assert_eq!(distribution(&Sampling::Greedy, &logits), None);
    }

    #[test]
    fn top_p_keeps_only_the_nucleus() {
        // One token holds almost all the mass: top_p 0.5 must always pick it.
        let mut logits = vec![0.0f32; 10];
        logits[4] = 20.0;
        let mut sm = Sampler::new(
            Sampling::Random {
                temperature: 1.0,
                top_k: None,
                top_p: Some(0.5),
            },
            1,
        );
        assert!((0..100).all(|_| sm.sample(&logits) == 4));
    }
}
