//! Checks: what must hold at a stage (`stage/`) or over whole runs (`run/`),
//! each kind one file registered by one line in its table; the pure maths
//! they share (`invariants`, `scaled`, `measure`, `exact_dot`, `projection`); what a verdict may depend
//! on (`facts`); and how a run's outcomes are triaged into a first
//! divergence, suspect goldens and budgets (`divergence`).

pub mod divergence;
pub(crate) mod exact_dot;
pub mod facts;
pub mod family;
pub mod floor;
pub mod invariants;
pub mod kind;
pub mod measure;
pub mod memo;
pub mod params;
pub mod projection;
mod registry;
pub mod row_judge;
pub mod run;
pub mod scaled;
pub mod stage;
mod verdict;

pub use facts::Facts;
pub use family::{Family, Metric};
pub use verdict::{Status, Verdict};
