//! touchstone: a golden-reference conformance harness for LLM inference engines.
//!
//! Data flows one way: a YAML spec is parsed into a plan of check instances; an
//! engine runs the spec's prompt with taps on the canonical stages; captures are
//! checked against invariants and golden tensors; outcomes go to a report.
//! docs/architecture.md draws the layers; a module only uses the ones below it
//! (`ci/import_cycles.py` checks there is no circle).

pub mod arithmetic;
pub mod checks;
pub mod ci_env;
pub mod cli;
pub mod cmd;
pub mod compare;
pub mod diff;
pub mod engine;
pub mod error;
pub mod gguf;
pub mod golden;
pub mod harness;
pub mod heap;
pub mod isa;
pub mod model;
pub mod plan;
pub mod processor;
pub mod report;
pub mod runner;
pub mod sampling;
pub mod spec;
pub mod stage;
pub mod suggest;
pub mod tensor;
pub mod tokenizer;

pub use error::{Error, Result};

/// The counting allocator (`heap`): how the `repeat` check reads an
/// in-process engine's memory.
#[cfg(feature = "heap-meter")]
#[global_allocator]
static GLOBAL: heap::Counting = heap::Counting;
