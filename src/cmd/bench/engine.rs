//! `touchstone bench engine`: the CPU engine called as a library, as
//! `EngineSel::load` gives it to the runner, on a fixed token list: prefill,
//! then greedy decode steps, with no taps (an untapped run copies nothing).
//!
//! The `Engine` trait runs a prefill and its decode steps in one call, and
//! this stays outside the trait rather than adding a timing hook to it: the
//! trait is what every engine implements, and a clock is not part of what an
//! engine owes the checks. So each repetition makes two runs, a prefill alone
//! (decode 0) and the prefill with N decode steps; the prefill time is the
//! first, the decode time the difference. Both runs include picking the
//! token after each step (argmax over the logits), as the peers' loops do.

use std::time::Instant;

use super::proc_stats::{model_file_bytes, peak_rss_bytes};
use super::stats::{median, rate};
use super::{emit, init_threads};
use crate::cli::bench::EngineArgs;
use crate::engine::names::NameMap;
use crate::engine::registry::EngineSel;
use crate::engine::{RunRequest, TapSet};
use crate::error::{Error, Result};
use crate::model::LoadOptions;
use crate::sampling::Sampling;

/// The prompt every engine of the bench is fed: deterministic, spread over
/// the vocabulary (7919 is prime, so consecutive ids differ), all < `vocab`.
pub fn prompt_tokens(n: usize, vocab: usize) -> Vec<u32> {
    (0..n).map(|i| ((17 + 7919 * i as u64) % vocab as u64) as u32).collect()
}

/// The request of one run: greedy, no teacher forcing.
fn request(prompt: &[u32], decode_steps: usize) -> RunRequest {
    RunRequest {
        prompt: prompt.to_vec(),
        decode_steps,
        sampling: Sampling::Greedy,
        seed: 0,
        forced: None,
        image: None,
    }
}

/// Refuses a run the model cannot hold, before the (slow) weight load.
fn check_fits(cfg: &crate::model::ModelConfig, total: usize) -> Result<()> {
    if let Some(ctx) = cfg.context_length.filter(|&c| total > c) {
        return Err(Error::Usage(format!(
            "--prompt-tokens + --decode = {total} positions, more than the model's context length {ctx}"
        )));
    }
    match cfg.unfaithful_beyond(total) {
        Some(reason) => Err(Error::Usage(reason)),
        None => Ok(()),
    }
}

pub fn run(a: &EngineArgs) -> Result<()> {
    let (n_prompt, n_decode) = (a.prompt_tokens as usize, a.decode as usize);
    let cfg = crate::model::read_config(&a.model)?;
    check_fits(&cfg, n_prompt + n_decode)?;
    let threads = a.threads as usize;
    init_threads(threads)?;
    let model_bytes = model_file_bytes(&a.model)?;

    let t0 = Instant::now();
    let engine = EngineSel::Cpu.load(&a.model, &LoadOptions::default(), &NameMap::default())?;
    let load_s = t0.elapsed().as_secs_f64();
    let mut weight_elems = 0usize;
    engine.visit_weights(&mut |_, _, w| weight_elems += w.len())?;
    // Read per decode token: every weight once, in f32 (the tied LM head is
    // the embedding matrix and is visited once).
    let weight_bytes = 4 * weight_elems;
    eprintln!(
        "touchstone: loaded {} in {} ({} layers, hidden {}, vocab {}; {:.1} MB of f32 weights), {threads} threads",
        a.model.display(),
        secs(load_s),
        cfg.layers,
        cfg.hidden,
        cfg.vocab,
        weight_bytes as f64 / 1e6
    );

    let prompt = prompt_tokens(n_prompt, cfg.vocab);
    let no_taps = TapSet::none();
    for _ in 0..a.warmup {
        engine.run(&request(&prompt, 1), &no_taps)?;
    }
    let (mut prefill_rates, mut decode_rates) = (Vec::new(), Vec::new());
    let mut generated = Vec::new();
    for rep in 1..=a.reps as usize {
        let t = Instant::now();
        engine.run(&request(&prompt, 0), &no_taps)?;
        let prefill_s = t.elapsed().as_secs_f64();
        let t = Instant::now();
        let out = engine.run(&request(&prompt, n_decode), &no_taps)?;
        let total_s = t.elapsed().as_secs_f64();
        // Never negative: a decode too fast to show beside prefill noise is
        // reported as unmeasured (null), not as an absurd rate.
        let decode_s = total_s - prefill_s;
        let prefill_tok_s = rate(n_prompt as f64, prefill_s);
        let decode_tok_s = rate(n_decode as f64, decode_s);
        prefill_rates.extend(prefill_tok_s);
        decode_rates.extend(decode_tok_s);
        generated = out.sampled;
        emit(
            &serde_json::json!({"bench": "engine", "engine": "touchstone", "rep": rep, "prefill_s": prefill_s,
                                "decode_s": decode_s, "prefill_tok_s": prefill_tok_s, "decode_tok_s": decode_tok_s}),
            &format!(
                "touchstone rep {rep}/{}: prefill {n_prompt} tokens in {} = {}; decode {n_decode} steps in {} = {}",
                a.reps,
                secs(prefill_s),
                tok_s(prefill_tok_s),
                secs(decode_s),
                tok_s(decode_tok_s)
            ),
        );
    }

    let peak = peak_rss_bytes();
    let rss_over_model = peak.filter(|_| model_bytes > 0).map(|p| p as f64 / model_bytes as f64);
    let (pm, dm) = (median(&prefill_rates), median(&decode_rates));
    emit(
        &serde_json::json!({
            "bench": "engine", "engine": "touchstone", "summary": true, "model": a.model,
            "threads": threads, "reps": a.reps, "warmup": a.warmup,
            "prompt_tokens": n_prompt, "decode_steps": n_decode, "prompt": prompt, "generated": generated,
            "load_s": load_s, "peak_rss_bytes": peak, "model_bytes": model_bytes, "rss_over_model": rss_over_model,
            "weight_bytes": weight_bytes, "prefill_tok_s_median": pm, "decode_tok_s_median": dm,
            "config": {"arch": cfg.arch, "layers": cfg.layers, "hidden": cfg.hidden, "ffn": cfg.ffn,
                       "heads": cfg.heads, "kv_heads": cfg.kv_heads, "vocab": cfg.vocab,
                       "tie_embeddings": cfg.tie_embeddings},
        }),
        &format!(
            "touchstone: median prefill {}, decode {}; load {}; peak RSS {} ({} the model's {:.2} GB on disk)",
            tok_s(pm),
            tok_s(dm),
            secs(load_s),
            peak.map_or("unknown".into(), |p| format!("{:.2} GB", p as f64 / 1e9)),
            rss_over_model.map_or("?".into(), |r| format!("{r:.2}x")),
            model_bytes as f64 / 1e9
        ),
    );
    Ok(())
}

/// A duration for a person: 512 µs, 41.3 ms, 2.41 s.
fn secs(s: f64) -> String {
    if s < 1e-3 {
        format!("{:.0} µs", s * 1e6)
    } else if s < 1.0 {
        format!("{:.1} ms", s * 1e3)
    } else {
        format!("{s:.2} s")
    }
}

fn tok_s(r: Option<f64>) -> String {
    r.map_or("unmeasured".into(), |r| format!("{r:.2} tok/s"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_read_in_their_unit() {
        assert_eq!(secs(0.000_512), "512 µs");
        assert_eq!(secs(0.041_27), "41.3 ms");
        assert_eq!(secs(2.414), "2.41 s");
    }

    #[test]
    fn prompt_is_deterministic_and_inside_the_vocabulary() {
        let p = prompt_tokens(32, 151_936);
        assert_eq!(p[..3], [17, 7936, 15855]);
        assert!(p.iter().all(|&t| (t as usize) < 151_936));
        let tiny = prompt_tokens(300, 512);
        assert!(tiny.iter().all(|&t| t < 512));
        assert_eq!(tiny, prompt_tokens(300, 512));
    }

    #[test]
    fn a_run_longer_than_the_context_is_refused_before_loading() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("goldens/qwen2-tiny/model");
        let cfg = crate::model::read_config(&dir).unwrap();
        let ctx = cfg.context_length.expect("the tiny model declares its context");
        assert!(check_fits(&cfg, ctx).is_ok());
        let err = check_fits(&cfg, ctx + 1).unwrap_err().to_string();
        assert!(err.contains("context length"), "{err}");
    }
}
