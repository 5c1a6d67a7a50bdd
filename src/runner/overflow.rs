//! A storage the model's own values do not fit: where the float64 oracle's
//! values exceed the largest finite value of the run's storage dtype (Gemma
//! 3's residual stream passes f16's 65504), a correct engine at that storage
//! overflows there too, and every check from that (step, stage) on would
//! fail on infinities and NaNs that are the format's, not the engine's. The
//! run says so once, naming the first such stage and value, and skips those
//! checks, instead of failing check after check. A reference of that storage
//! whose recorder saw its own forward overflow earlier (provenance
//! `overflow`, `GoldenSet::overflow`) moves the point to where it did.

use crate::plan::Plan;
use crate::stage::{Stage, Step};
use crate::tensor::DType;

/// The first (step, stage) a run at `storage` cannot represent.
#[derive(Clone, Debug, PartialEq)]
pub struct Overflow {
    pub at: (Step, Stage),
    /// The oracle's largest |x| there, when it records the stage.
    pub value: Option<f64>,
    pub storage: DType,
    /// A 16-bit reference that overflowed there (the point is its).
    pub reference: Option<String>,
}

impl Overflow {
    /// Whether a check at `at` is past the point.
    pub fn covers(&self, at: (Step, Stage)) -> bool {
        at >= self.at
    }

    /// The run's note.
    pub fn sentence(&self, skipped: usize) -> String {
        let (step, stage) = self.at;
        let limit = self.storage.max_finite();
        let why = match (&self.reference, self.value) {
            (None, Some(v)) => format!(
                "the oracle's {step}/{stage} reaches {v:.4e}, beyond {}'s largest finite value {limit}",
                self.storage
            ),
            (Some(r), Some(v)) => format!(
                "reference `{r}` (the same storage) overflowed at {step}/{stage}, where the oracle reaches {v:.4e}"
            ),
            (Some(r), None) => format!("reference `{r}` (the same storage) overflowed at {step}/{stage}"),
            (None, None) => format!("{step}/{stage} is beyond {}'s range", self.storage),
        };
        format!(
            "storage {} cannot hold this model's values: {why}. A correct {} engine overflows there, so the {skipped} \
             check(s) from that stage on are skipped, not failed (run at bf16 or f32 to check them)",
            self.storage, self.storage
        )
    }
}

/// Where a run of `plan` at `storage` first overflows, if it does.
pub fn storage_overflow(plan: &Plan, storage: DType) -> Option<Overflow> {
    if storage == DType::F32 {
        return None;
    }
    let limit = storage.max_finite();
    let oracle = plan.oracle.as_deref();
    let max_at = |at: (Step, Stage)| {
        oracle
            .and_then(|o| o.get(at.0, at.1))
            .map(crate::checks::scaled::max_abs_value)
    };
    let from_oracle = oracle.and_then(|o| {
        o.keys()
            .copied()
            .find(|&(step, stage)| max_at((step, stage)).is_some_and(|m| m > limit))
            .map(|at| Overflow {
                at,
                value: max_at(at),
                storage,
                reference: None,
            })
    });
    let of_storage = |name: &str| {
        crate::arithmetic::Arithmetic::of_provenance(&plan.goldens[name].provenance)
            .ok()
            .flatten()
            .is_some_and(|a| a.storage == storage)
    };
    let from_refs = plan
        .goldens
        .iter()
        .filter(|(n, _)| of_storage(n))
        .filter_map(|(n, g)| g.overflow().map(|at| (at, n.clone())))
        .min()
        .map(|(at, name)| Overflow {
            at,
            value: max_at(at),
            storage,
            reference: Some(name),
        });
    match (from_oracle, from_refs) {
        (Some(a), Some(b)) => Some(if b.at < a.at { b } else { a }),
        (a, b) => a.or(b),
    }
}
