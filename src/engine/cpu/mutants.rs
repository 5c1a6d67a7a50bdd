//! Planted bugs in the CPU engine, for tests that prove the checks catch
//! them and localise them to the right stage. A mutant can only be switched on
//! in test builds (`cfg(test)`): in any other build `Mutants::is` is a
//! constant `false` and the planted branches compile away.

/// One planted bug.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mutant {
    /// Qwen3's per-head q/k RMSNorm is not applied (q_norm = q, k_norm = k),
    /// as an engine that treats Qwen3 as Qwen2 would.
    SkipQkNorm,
}

/// The mutants switched on for an engine (none outside tests).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Mutants {
    #[cfg(test)]
    on: Option<Mutant>,
}

impl Mutants {
    /// An engine with `m` planted (tests only).
    #[cfg(test)]
    pub fn with(m: Mutant) -> Mutants {
        Mutants { on: Some(m) }
    }

    /// Whether `m` is planted: always false outside test builds.
    #[inline(always)]
    pub fn is(self, m: Mutant) -> bool {
        #[cfg(test)]
        {
            self.on == Some(m)
        }
        #[cfg(not(test))]
        {
            let _ = m;
            false
        }
    }
}
