//! What only a GPU can show about the CUDA engine, as libtest trials named
//! `cuda::<property>::<case>` (all ignored, with the reason, where the engine
//! is unavailable — never passed):
//! - memory: 100 untapped generate calls grow device memory by at most 1 MiB;
//! - determinism: 10 runs with every stage tapped agree bitwise (captures and
//!   tokens), greedy and seeded random, at every storage dtype;
//! - sampling: seeded random sampling on the device draws the tokens the CPU
//!   engine's host `Sampler` draws for the same seed.
//!
//! Run them on a GPU machine with `cargo test --release --test cuda_device`.

use std::path::{Path, PathBuf};

use libtest_mimic::{Arguments, Completion, Failed, Trial};
use touchstone::engine::{cuda, Availability, Engine, EngineKind, RunOutput, RunRequest, TapSet};
use touchstone::model::LoadOptions;
use touchstone::sampling::Sampling;
use touchstone::tensor::DType;

fn model() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("goldens/qwen2-tiny/model")
}

fn load(kind: EngineKind, storage: DType) -> Result<Box<dyn Engine>, Failed> {
    let opts = LoadOptions {
        storage,
        ..LoadOptions::default()
    };
    kind.load(&model(), &opts).map_err(|e| Failed::from(e.to_string()))
}

fn random() -> Sampling {
    Sampling::Random {
        temperature: 1.0,
        top_k: Some(50),
        top_p: Some(0.95),
    }
}

fn request(sampling: Sampling, seed: u64, decode_steps: usize) -> RunRequest {
    RunRequest {
        prompt: vec![1, 17, 42, 99, 7, 250],
        decode_steps,
        sampling,
        seed,
        forced: None,
    }
}

fn run(e: &dyn Engine, req: &RunRequest, taps: &TapSet) -> Result<RunOutput, Failed> {
    e.run(req, taps).map_err(|x| Failed::from(x.to_string()))
}

/// 100 generate calls (16 decode steps, nothing tapped) after one warm-up:
/// device memory in use may grow by at most 1 MiB.
fn memory_growth() -> Result<(), Failed> {
    const MIB: i64 = 1 << 20;
    let e = load(EngineKind::Cuda, DType::F32)?;
    let req = request(Sampling::Greedy, 1, 16);
    run(&*e, &req, &TapSet::none())?;
    let before = cuda::device_memory_used()?;
    for seed in 0..100 {
        let mut r = req.clone();
        r.seed = seed;
        r.sampling = if seed % 2 == 0 { Sampling::Greedy } else { random() };
        run(&*e, &r, &TapSet::none())?;
    }
    let after = cuda::device_memory_used()?;
    let growth = after as i64 - before as i64;
    println!("device memory in use: {before} B before, {after} B after 100 generate calls ({growth:+} B)");
    if growth > MIB {
        return Err(format!("device memory grew by {growth} B over 100 generate calls (limit {MIB} B)").into());
    }
    Ok(())
}

/// 10 runs with every stage tapped must agree bitwise.
fn determinism(storage: DType, sampling: Sampling) -> Result<(), Failed> {
    let e = load(EngineKind::Cuda, storage)?;
    let taps = TapSet::all(e.config().layers);
    let req = request(sampling, 1234, 8);
    let first = run(&*e, &req, &taps)?;
    for n in 1..10 {
        let again = run(&*e, &req, &taps)?;
        if again.sampled != first.sampled {
            return Err(format!("run {n} sampled {:?}, run 0 {:?}", again.sampled, first.sampled).into());
        }
        for ((step, stage), t) in first.captures.iter() {
            let u = again
                .captures
                .get(*step, *stage)
                .ok_or_else(|| format!("run {n} has no capture {step}/{stage}"))?;
            let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
            if bits(t.data()) != bits(u.data()) {
                let i = t
                    .data()
                    .iter()
                    .zip(u.data())
                    .position(|(a, b)| a.to_bits() != b.to_bits())
                    .unwrap_or(0);
                return Err(format!(
                    "run {n} differs from run 0 at {step}/{stage}[{i}]: {:e} vs {:e}",
                    u.data()[i],
                    t.data()[i]
                )
                .into());
            }
        }
    }
    println!(
        "10 runs bitwise identical: {} captures, tokens {:?}",
        first.captures.len(),
        first.sampled
    );
    Ok(())
}

/// Seeded random sampling on the device draws the CPU engine's tokens.
fn sampling_matches_cpu(seed: u64) -> Result<(), Failed> {
    let gpu = load(EngineKind::Cuda, DType::F32)?;
    let cpu = load(EngineKind::Cpu, DType::F32)?;
    let req = request(random(), seed, 16);
    let (g, c) = (run(&*gpu, &req, &TapSet::none())?, run(&*cpu, &req, &TapSet::none())?);
    if g.sampled != c.sampled {
        return Err(format!("seed {seed}: cuda sampled {:?}, cpu {:?}", g.sampled, c.sampled).into());
    }
    Ok(())
}

type Body = Box<dyn FnOnce() -> Result<(), Failed> + Send>;

fn main() {
    let args = Arguments::from_args();
    let reason = match EngineKind::Cuda.availability() {
        Availability::Available => None,
        Availability::Unavailable(r) => Some(r),
    };
    let mut trials: Vec<(String, Body)> = Vec::new();
    trials.push(("cuda::memory::100_generate_calls".into(), Box::new(memory_growth)));
    for storage in [DType::F32, DType::F16, DType::BF16] {
        trials.push((
            format!("cuda::determinism::{storage}::greedy_10_runs"),
            Box::new(move || determinism(storage, Sampling::Greedy)),
        ));
        trials.push((
            format!("cuda::determinism::{storage}::random_10_runs"),
            Box::new(move || determinism(storage, random())),
        ));
    }
    for seed in 0..4u64 {
        trials.push((
            format!("cuda::sampling::same_tokens_as_cpu::seed_{seed}"),
            Box::new(move || sampling_matches_cpu(seed)),
        ));
    }
    let trials = trials
        .into_iter()
        .map(|(name, f)| match &reason {
            Some(r) => {
                let r = r.clone();
                Trial::ignorable_test(name, move || Ok(Completion::ignored_with(r)))
            }
            None => Trial::test(name, f),
        })
        .collect();
    libtest_mimic::run(&args, trials).exit();
}
