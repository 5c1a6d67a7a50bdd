//! Model description and weights, independent of any engine.
pub mod config;
pub mod weights;

pub use config::ModelConfig;
pub use weights::Weights;
