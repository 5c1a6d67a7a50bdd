//! Batched decode against the same sequences run one by one, on the CPU
//! engine, measured in the same run.
//!
//! `cargo run --release --example batch_decode [MODEL] [STEPS]` loads MODEL
//! (default: the real Qwen2.5-Coder-0.5B GGUF in touchstone's model cache,
//! `python3 ci/fetch_real_model.py` fetches it), builds 8 prompts of different
//! lengths (8..36 tokens), and times, each as the best of three:
//! - batched: one `run_batch` of the 8 sequences, STEPS (default 16) greedy
//!   decode steps each, every decode step one forward pass over 8 rows;
//! - one by one: the same 8 requests as 8 `run_batch`es of one sequence;
//!
//! and the same two with 0 decode steps (the prefills alone). Decode time is
//! the difference; it prints decode tokens per second of both and their
//! ratio, and checks that both ways sampled the same tokens (the CPU engine
//! is batch-invariant); a last JSON line carries both rates for
//! `ci/bench/batch_decode.py`, which runs llama.cpp's batched decode beside
//! it. Absolute times are noise on a shared machine; the ratio is the claim.

use std::time::Instant;

use touchstone::engine::batch::{BatchRequest, SeqRequest};
use touchstone::engine::cpu::CpuEngine;
use touchstone::engine::{Engine, RunRequest, TapSet};

const SEQS: usize = 8;

fn request(i: usize, steps: usize, vocab: usize) -> RunRequest {
    let len = 8 + 4 * i;
    // Ordinary token ids (well inside the vocabulary), a different stretch
    // per sequence.
    let prompt = (0..len).map(|j| ((1000 + 37 * i + 11 * j) % vocab) as u32).collect();
    RunRequest::greedy(prompt, steps, 0)
}

fn batch(reqs: Vec<RunRequest>) -> BatchRequest {
    BatchRequest {
        seqs: reqs.into_iter().map(SeqRequest::plain).collect(),
        poison: None,
    }
}

/// (seconds, sampled tokens of each sequence): best of three.
fn timed(engine: &CpuEngine, steps: usize, together: bool) -> (f64, Vec<Vec<u32>>) {
    let vocab = engine.config().vocab;
    let reqs: Vec<RunRequest> = (0..SEQS).map(|i| request(i, steps, vocab)).collect();
    let mut best = f64::INFINITY;
    let mut tokens = Vec::new();
    for _ in 0..3 {
        let t = Instant::now();
        let outs = if together {
            engine.run_batch(&batch(reqs.clone()), &TapSet::none()).expect("batch")
        } else {
            reqs.iter()
                .map(|r| {
                    engine
                        .run_batch(&batch(vec![r.clone()]), &TapSet::none())
                        .expect("one")
                        .remove(0)
                })
                .collect()
        };
        best = best.min(t.elapsed().as_secs_f64());
        tokens = outs.into_iter().map(|o| o.sampled).collect();
    }
    (best, tokens)
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let model = args
        .first()
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| touchstone::model::cache::model_path("qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"));
    let steps: usize = args.get(1).map_or(16, |s| s.parse().expect("STEPS is a number"));
    let engine = match CpuEngine::load(&model) {
        Ok(e) => e,
        Err(e) => {
            eprintln!("cannot load {}: {e}", model.display());
            std::process::exit(2);
        }
    };
    let (pre_b, _) = timed(&engine, 0, true);
    let (pre_1, _) = timed(&engine, 0, false);
    let (all_b, tok_b) = timed(&engine, steps, true);
    let (all_1, tok_1) = timed(&engine, steps, false);
    let (dec_b, dec_1) = ((all_b - pre_b).max(1e-9), (all_1 - pre_1).max(1e-9));
    let n = (SEQS * steps) as f64;
    println!("model {} ({} threads)", model.display(), rayon::current_num_threads());
    println!("{SEQS} sequences (prompts 8..36 tokens), {steps} greedy decode steps each, best of 3:");
    println!("  prefills   batched {:>8.3} s   one by one {:>8.3} s", pre_b, pre_1);
    println!(
        "  decode     batched {:>8.3} s ({:>7.1} tok/s)   one by one {:>8.3} s ({:>7.1} tok/s)",
        dec_b,
        n / dec_b,
        dec_1,
        n / dec_1
    );
    println!("  batched decode / one-by-one decode throughput: {:.2}x", dec_1 / dec_b);
    assert_eq!(tok_b, tok_1, "batched and one-by-one runs sampled the same tokens");
    println!("  same tokens both ways: yes");
    // For ci/bench/batch_decode.py, which sets these beside llama.cpp's.
    println!(
        "{{\"batched_decode_tok_s\": {}, \"one_by_one_decode_tok_s\": {}, \"steps\": {steps}, \"seqs\": {SEQS}}}",
        n / dec_b,
        n / dec_1
    );
}
