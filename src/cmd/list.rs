//! `touchstone list`: the trial names of every check a run would make
//! (`<engine>::<spec>::<id>`), the ids `--only` and `cargo test` filter on.

use super::specs::specs_or_default;
use super::Outcome;
use crate::cli::ListArgs;
use crate::engine::registry::EngineSel;
use crate::error::Result;
use crate::plan::Plan;
use crate::spec::Spec;

pub fn run(args: ListArgs) -> Result<Outcome> {
    for p in specs_or_default(args.specs)? {
        let plan = Plan::build(Spec::load(&p)?, args.model.as_deref())?;
        for sel in EngineSel::resolve(&args.engine, &plan.spec.declared())? {
            for c in &plan.checks {
                println!("{}::{}::{}", sel.name(), plan.spec.name, c.id);
            }
        }
    }
    Ok(Outcome::Passed)
}
