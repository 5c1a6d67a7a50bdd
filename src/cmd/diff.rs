//! `touchstone diff BASE.json NEW.json`: the regression report between two
//! runs, to the terminal and the requested files (`crate::diff` decides).

use super::Outcome;
use crate::cli::DiffArgs;
use crate::error::Result;

pub fn run(args: DiffArgs) -> Result<Outcome> {
    let DiffArgs {
        base,
        new,
        factor,
        allow_vanished,
        changed,
        sinks,
    } = args;
    use crate::diff::render;
    let outputs = super::run::outputs(&sinks, None)?;
    let d = crate::diff::diff_files(&base, &new, factor, allow_vanished)?;
    let text = render::terminal_rows(&d, changed);
    if outputs.uses_stdout() {
        eprint!("{text}");
    } else {
        print!("{text}");
    }
    outputs.commit(&|flag| match flag {
        "--junit" => render::junit(&d),
        "--markdown" => render::markdown(&d),
        _ => render::html(&d),
    })?;
    Ok(if d.regressed() {
        Outcome::Failed
    } else {
        Outcome::Passed
    })
}
