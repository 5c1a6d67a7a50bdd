//! Runs the CPU engine on a golden file's prompt (teacher-forced with the
//! golden's greedy ids, every stage tapped) and prints the max abs error of
//! every (step, stage) against the golden, worst first at the end. A manual
//! cross-check of the engine against HF, before the spec runner exists.
//!
//! cargo run --example cpu_vs_hf -- MODEL_DIR GOLDEN.safetensors

use std::path::PathBuf;

use touchstone::engine::cpu::CpuEngine;
use touchstone::engine::{Engine, RunRequest, TapSet};
use touchstone::sampling::Sampling;
use touchstone::stage::{key, Step};
use touchstone::tensor_io::read_safetensors;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [model, golden] = &args[..] else {
        return Err("usage: cpu_vs_hf MODEL_DIR GOLDEN.safetensors".into());
    };
    let eng = CpuEngine::load(&PathBuf::from(model))?;
    let gold = read_safetensors(&PathBuf::from(golden))?;
    let prov: serde_json::Value =
        serde_json::from_str(gold.metadata.get("provenance").ok_or("no provenance")?)?;
    let ids = |v: &serde_json::Value| -> Vec<u32> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap() as u32)
            .collect()
    };
    let prompt = ids(&prov["prompt"]["token_ids"]);
    let greedy = ids(&prov["greedy_ids"]);
    let steps = prov["decode_steps"].as_u64().unwrap_or(3) as usize;
    let req = RunRequest {
        prompt,
        decode_steps: steps,
        sampling: Sampling::Greedy,
        seed: 0,
        forced: Some(greedy[..steps].to_vec()),
    };
    let out = eng.run(&req, &TapSet::all(eng.config().layers))?;
    let mut worst = (0.0f32, String::new());
    let mut missing = 0;
    for ((step, stage), t) in out.captures.iter() {
        let k = key(*step, *stage);
        let Some(g) = gold.floats.get(&k) else {
            missing += 1;
            println!("{k:32} (no golden)");
            continue;
        };
        if g.shape() != t.shape() {
            println!("{k:32} SHAPE {:?} vs golden {:?}", t.shape(), g.shape());
            worst = (f32::INFINITY, k);
            continue;
        }
        let err = t
            .data()
            .iter()
            .zip(g.data())
            .map(|(a, b)| (a - b).abs())
            .fold(0.0, f32::max);
        let mag = g.data().iter().fold(0.0f32, |m, x| m.max(x.abs()));
        println!(
            "{k:32} max_abs {err:.3e}  (max |golden| {mag:.3e}, ratio {:.1e})",
            err / mag.max(f32::MIN_POSITIVE)
        );
        if err > worst.0 {
            worst = (err, k);
        }
    }
    for (n, step) in Step::sequence(steps).into_iter().enumerate() {
        let (_, pos) = gold
            .ints
            .get(&format!("{step}/positions"))
            .ok_or("no positions")?;
        let pos: Vec<usize> = pos.iter().map(|&p| p as usize).collect();
        assert_eq!(pos, out.positions[n], "{step} positions");
    }
    println!(
        "captures: {}, without golden: {missing}",
        out.captures.len()
    );
    println!("worst: {} max_abs {:.3e}", worst.1, worst.0);
    println!(
        "sampled {:?}\ngolden  {:?}\ngreedy match: {}",
        out.sampled,
        greedy,
        out.sampled == greedy
    );
    Ok(())
}
