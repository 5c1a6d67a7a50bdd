//! The commands, above the library: each file implements one `touchstone`
//! subcommand on top of the library's plan, runner, report and golden modules.
//! `cli` holds only the argument types; `execute` dispatches to these.

pub mod bench;
pub mod compare;
pub mod goldens;
pub mod inspect;
pub mod kernels;
