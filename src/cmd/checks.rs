//! `touchstone checks`: every check kind the binary knows, read from the
//! check tables themselves (`checks::stage`, `checks::run`), so the list is
//! never behind the code: a kind added to a table is listed here with its
//! own words.

use std::fmt::Write;

use crate::checks::{run, stage};

pub fn render() -> String {
    let mut out = String::new();
    for (title, where_, kinds) in [
        ("stage checks", "under `stages:`, per (step, stage)", stage::KINDS),
        ("run checks", "under `run_checks:`, on whole runs", run::KINDS),
    ] {
        let _ = writeln!(out, "{title} ({where_}):");
        for (name, params, about) in kinds {
            let _ = writeln!(out, "  {name}\n    parameters: {params}\n    holds when: {about}");
        }
    }
    out
}
