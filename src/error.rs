//! The one error type of the crate. Every variant names the file (and, for YAML,
//! line:col) so a user can fix the input without reading our code. All of them
//! map to exit code 2 ("bad input"); a failing *check* is not an error.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    /// A spec problem with a known position in the YAML file.
    #[error("{}:{line}:{col}: {msg}", path.display())]
    SpecSyntax {
        path: PathBuf,
        line: usize,
        col: usize,
        msg: String,
    },

    /// A spec problem found after parsing (e.g. a layer index past the model's layer count).
    #[error("{}: {msg}", path.display())]
    SpecInvalid { path: PathBuf, msg: String },

    /// A model folder or file that cannot be loaded (missing config key, missing tensor, bad shape).
    #[error("{}: {msg}", path.display())]
    Model { path: PathBuf, msg: String },

    /// A tensor file (safetensors / npy) that is malformed or truncated.
    #[error("{}: {msg}", path.display())]
    TensorFile { path: PathBuf, msg: String },

    /// A golden file that loads but cannot be used (missing tensor, NaN, bad provenance).
    #[error("{}: {msg}", path.display())]
    Golden { path: PathBuf, msg: String },

    /// An engine failed while running (not a check failure).
    #[error("engine {engine}: {msg}")]
    Engine { engine: String, msg: String },

    /// A prerequisite outside touchstone is not installed (the recorders'
    /// Python environment, libllama): what is missing and how to create it.
    #[error("engine {engine} needs {missing}, which is not there: {fix}")]
    Environment {
        engine: String,
        missing: String,
        fix: String,
    },

    #[error("{0}")]
    Usage(String),
}

impl Error {
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io {
            path: path.into(),
            source,
        }
    }
    pub fn model(path: impl Into<PathBuf>, msg: impl Into<String>) -> Self {
        Error::Model {
            path: path.into(),
            msg: msg.into(),
        }
    }
    pub fn tensor_file(path: impl Into<PathBuf>, msg: impl Into<String>) -> Self {
        Error::TensorFile {
            path: path.into(),
            msg: msg.into(),
        }
    }
    pub fn golden(path: impl Into<PathBuf>, msg: impl Into<String>) -> Self {
        Error::Golden {
            path: path.into(),
            msg: msg.into(),
        }
    }
    pub fn engine(engine: impl Into<String>, msg: impl Into<String>) -> Self {
        Error::Engine {
            engine: engine.into(),
            msg: msg.into(),
        }
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;
