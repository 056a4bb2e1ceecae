//! Error kinds and the process exit codes they map to.
//!
//! Exit codes: 0 pass, 1 divergence found, 2 usage / input / environment error.
//! Every failure the user can cause (a bad file, a missing GPU) is an `Error`, never a panic.

use std::fmt;

/// Exit code: every compared stage was within tolerance.
pub const EXIT_PASS: i32 = 0;
/// Exit code: a divergence (or a baseline regression) was found.
pub const EXIT_DIVERGENCE: i32 = 1;
/// Exit code: bad usage, unreadable/invalid input, or a missing environment (no GPU, NVRTC error).
pub const EXIT_ERROR: i32 = 2;

/// What went wrong, grouped by whose move it is to fix it.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The GGUF file is malformed, truncated or inconsistent.
    #[error("{path}: {msg}")]
    Format { path: String, msg: String },
    /// The file is well formed but not something we can run (non-MLA architecture, unsupported quant type...).
    #[error("{0}")]
    Unsupported(String),
    /// A tensor the run needs is missing or has the wrong shape.
    #[error("{0}")]
    Tensor(String),
    /// Bad command-line usage or a bad auxiliary input (npy, tolerance file, baseline).
    #[error("{0}")]
    Usage(String),
    /// The environment cannot do what was asked (no CUDA driver, no GPU, NVRTC compile error).
    #[error("{0}")]
    Environment(String),
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    pub fn format(path: impl fmt::Display, msg: impl Into<String>) -> Self {
        Error::Format {
            path: path.to_string(),
            msg: msg.into(),
        }
    }
    pub fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        Error::Io {
            context: context.into(),
            source,
        }
    }
}

impl From<candle_core::Error> for Error {
    fn from(e: candle_core::Error) -> Self {
        Error::Unsupported(format!("candle: {e}"))
    }
}
