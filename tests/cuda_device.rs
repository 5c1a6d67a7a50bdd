//! The CUDA engine's device properties, as libtest trials named
//! `<engine>::<property>::<case>`, for `cuda` (the GPU; all ignored, with the
//! reason, where it is unavailable — never passed) and `cuda-emu` (the same
//! host code on the emulated device, always run):
//! - memory: untapped generate calls grow device memory by at most 1 MiB on
//!   the GPU (driver-wide total − free, 100 calls); on the emulated device the
//!   engine's live allocations after 20 calls are exactly those before (the
//!   buffer accounting: every per-run and per-step buffer freed);
//! - determinism: 10 runs with every stage tapped agree bitwise (captures and
//!   tokens), greedy and seeded random, at every storage dtype;
//! - sampling: seeded random sampling on the device draws the tokens the CPU
//!   engine's host `Sampler` draws for the same seed.
//!
//! What stays GPU-only: the driver's view of memory (the emulator has no
//! allocator of its own to leak from) and everything about real hardware
//! (warp scheduling, cuBLAS's kernels): the `cuda::` trials.
//!
//! Run them on a GPU machine with `cargo test --release --test cuda_device`.

use std::path::{Path, PathBuf};

use libtest_mimic::{Arguments, Completion, Failed, Trial};
use touchstone::engine::cuda::CudaEngine;
use touchstone::engine::names::NameMap;
use touchstone::engine::registry::EngineSel;
use touchstone::engine::{cuda, Availability, Engine, RunOutput, RunRequest, TapSet};
use touchstone::model::LoadOptions;
use touchstone::sampling::Sampling;
use touchstone::tensor::DType;

/// The built-in engines these trials run, as a `Copy` handle on the registry's.
#[derive(Clone, Copy, Debug, PartialEq)]
enum EngineKind {
    Cpu,
    Cuda,
    CudaEmu,
}

impl EngineKind {
    fn sel(self) -> EngineSel {
        match self {
            EngineKind::Cpu => EngineSel::Cpu,
            EngineKind::Cuda => EngineSel::Cuda,
            EngineKind::CudaEmu => EngineSel::CudaEmu,
        }
    }
    fn availability(self) -> Availability {
        self.sel().availability()
    }
    fn name(self) -> String {
        self.sel().name()
    }
}

fn model() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("goldens/qwen2-tiny/model")
}

fn load(kind: EngineKind, storage: DType) -> Result<Box<dyn Engine>, Failed> {
    let opts = LoadOptions {
        storage,
        ..LoadOptions::default()
    };
    kind.sel()
        .load(&model(), &opts, &NameMap::default())
        .map_err(|e| Failed::from(e.to_string()))
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
        image: None,
    }
}

fn run(e: &dyn Engine, req: &RunRequest, taps: &TapSet) -> Result<RunOutput, Failed> {
    e.run(req, taps).map_err(|x| Failed::from(x.to_string()))
}

/// 100 generate calls (16 decode steps, nothing tapped) after one warm-up:
/// device memory in use may grow by at most 1 MiB.
fn memory_growth(kind: EngineKind) -> Result<(), Failed> {
    if kind == EngineKind::CudaEmu {
        return emu_buffer_accounting();
    }
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

/// On the emulated device: 20 generate calls (16 decode steps, nothing
/// tapped, greedy and random alternating) after one warm-up leave exactly the
/// bytes allocated before (the weights): no buffer outlives its run.
fn emu_buffer_accounting() -> Result<(), Failed> {
    let opts = LoadOptions::default();
    let e = CudaEngine::<f32>::load_emu(&model(), &opts).map_err(|x| Failed::from(x.to_string()))?;
    let used = || e.device_memory_in_use().map_err(|x| Failed::from(x.to_string()));
    let req = request(Sampling::Greedy, 1, 16);
    let loaded = used()?;
    run(&e, &req, &TapSet::none())?;
    let before = used()?;
    if before != loaded {
        return Err(format!("a run left {} B allocated ({loaded} B after loading)", before - loaded).into());
    }
    for seed in 0..20 {
        let mut r = req.clone();
        r.seed = seed;
        r.sampling = if seed % 2 == 0 { Sampling::Greedy } else { random() };
        run(&e, &r, &TapSet::none())?;
    }
    let after = used()?;
    println!("emulated device: {before} B allocated before, {after} B after 20 generate calls");
    if after != before {
        return Err(format!("live allocations went from {before} B to {after} B over 20 generate calls").into());
    }
    Ok(())
}

/// 10 runs with every stage tapped must agree bitwise.
fn determinism(kind: EngineKind, storage: DType, sampling: Sampling) -> Result<(), Failed> {
    let e = load(kind, storage)?;
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
fn sampling_matches_cpu(kind: EngineKind, seed: u64) -> Result<(), Failed> {
    let gpu = load(kind, DType::F32)?;
    let cpu = load(EngineKind::Cpu, DType::F32)?;
    let req = request(random(), seed, 16);
    let (g, c) = (run(&*gpu, &req, &TapSet::none())?, run(&*cpu, &req, &TapSet::none())?);
    if g.sampled != c.sampled {
        return Err(format!(
            "seed {seed}: {} sampled {:?}, cpu {:?}",
            kind.name(),
            g.sampled,
            c.sampled
        )
        .into());
    }
    Ok(())
}

type Body = Box<dyn FnOnce() -> Result<(), Failed> + Send>;

fn main() {
    let args = Arguments::from_args();
    let mut all = Vec::new();
    for kind in [EngineKind::Cuda, EngineKind::CudaEmu] {
        let reason = match kind.availability() {
            Availability::Available => None,
            Availability::Unavailable(r) => Some(r),
        };
        let n = kind.name();
        let mut trials: Vec<(String, Body)> = Vec::new();
        let memory = if kind == EngineKind::Cuda {
            "100_generate_calls"
        } else {
            "20_generate_calls_free_every_buffer"
        };
        trials.push((format!("{n}::memory::{memory}"), Box::new(move || memory_growth(kind))));
        for storage in [DType::F32, DType::F16, DType::BF16] {
            trials.push((
                format!("{n}::determinism::{storage}::greedy_10_runs"),
                Box::new(move || determinism(kind, storage, Sampling::Greedy)),
            ));
            trials.push((
                format!("{n}::determinism::{storage}::random_10_runs"),
                Box::new(move || determinism(kind, storage, random())),
            ));
        }
        for seed in 0..4u64 {
            trials.push((
                format!("{n}::sampling::same_tokens_as_cpu::seed_{seed}"),
                Box::new(move || sampling_matches_cpu(kind, seed)),
            ));
        }
        all.extend(trials.into_iter().map(|(name, f)| match &reason {
            Some(r) => {
                let r = r.clone();
                Trial::ignorable_test(name, move || Ok(Completion::ignored_with(r)))
            }
            None => Trial::test(name, f),
        }));
    }
    libtest_mimic::run(&args, all).exit();
}
