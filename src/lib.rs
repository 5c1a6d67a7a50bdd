//! touchstone: a golden-reference conformance harness for LLM inference engines.
//!
//! Data flows one way: a YAML spec is parsed into a plan of check instances; an
//! engine runs the spec's prompt with taps on the canonical stages; captures are
//! checked against invariants and golden tensors; outcomes go to a report.

pub mod bench;
pub mod cache;
pub mod checks;
pub mod cli;
pub mod compare;
pub mod compare_files;
pub mod diff;
pub mod engine;
pub mod error;
pub mod gguf;
pub mod golden;
pub mod goldens;
pub mod harness;
pub mod inspect;
pub mod kernels;
pub mod model;
pub mod plan;
pub mod provenance;
pub mod report;
pub mod runner;
pub mod sampling;
pub mod spec;
pub mod stage;
pub mod suggest;
pub mod tensor;
pub mod tensor_io;
pub mod tokenizer;

pub use error::{Error, Result};
