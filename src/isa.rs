//! The x86 instruction sets touchstone's hot loops (the comparator's fold,
//! the `linear` check's f64 dot products) are compiled for, chosen once at
//! run time: the release build targets baseline x86-64, and the same source
//! compiled under `#[target_feature]` lets the compiler use 4- or 8-wide
//! vectors where the CPU has them. (The CPU engine's GEMM has its own
//! intrinsics kernels; see `engine::cpu::matmul`.)

/// The instruction sets the hot loops are compiled for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Isa {
    #[cfg(target_arch = "x86_64")]
    Avx512,
    #[cfg(target_arch = "x86_64")]
    Avx2,
    Baseline,
}

impl Isa {
    /// Every variant this CPU can run, widest first.
    pub fn available() -> Vec<Isa> {
        let mut v = Vec::new();
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::is_x86_feature_detected as has;
            if has!("avx512f") && has!("avx512dq") && has!("avx512vl") && has!("avx512bw") && has!("fma") {
                v.push(Isa::Avx512);
            }
            if has!("avx2") && has!("fma") {
                v.push(Isa::Avx2);
            }
        }
        v.push(Isa::Baseline);
        v
    }

    /// The widest variant this CPU runs, decided once.
    pub fn best() -> Isa {
        static BEST: std::sync::OnceLock<Isa> = std::sync::OnceLock::new();
        *BEST.get_or_init(|| Isa::available()[0])
    }
}
