//! One error type for the data pipeline. Every message names the file (and line) at fault.

use std::path::{Path, PathBuf};

#[derive(Debug, thiserror::Error)]
pub enum DataError {
    /// The I/O error is part of the message, not a source: an error chain would print it twice.
    #[error("{}: {error}", path.display())]
    Io {
        path: PathBuf,
        error: std::io::Error,
    },
    #[error("{}: {reason}", path.display())]
    Input { path: PathBuf, reason: String },
    #[error("{}: not a usable tokenizer: {reason}", path.display())]
    Tokenizer { path: PathBuf, reason: String },
    #[error("{}: {reason}", path.display())]
    Shards { path: PathBuf, reason: String },
    #[error("{0}")]
    Invalid(String),
}

impl DataError {
    pub(crate) fn io(path: &Path) -> impl FnOnce(std::io::Error) -> Self + '_ {
        move |error| Self::Io {
            path: path.to_path_buf(),
            error,
        }
    }

    pub(crate) fn shards(path: &Path, reason: impl Into<String>) -> Self {
        Self::Shards {
            path: path.to_path_buf(),
            reason: reason.into(),
        }
    }
}

pub type Result<T> = std::result::Result<T, DataError>;
