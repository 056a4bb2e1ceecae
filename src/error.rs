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

/// Longest file-derived name shown in a message, in characters after escaping.
const QUOTE_MAX: usize = 80;

/// A name, key or string read from a file, fit for a one-line message: quoted, control and other
/// non-printable characters escaped (a name may hold newlines or binary), cut at 80 characters.
pub fn quote(s: &str) -> String {
    let mut out = String::from("\"");
    let mut n = 0;
    for c in s.chars() {
        // escape_debug covers quotes, backslashes, control and non-printable characters; other line or
        // paragraph separators (U+2028 ...) must not break the line either.
        let esc: String = if c.is_whitespace() && !matches!(c, ' ' | '\n' | '\t' | '\r') {
            c.escape_unicode().collect()
        } else {
            c.escape_debug().collect()
        };
        n += esc.chars().count();
        if n > QUOTE_MAX {
            out.push_str("\"… (");
            out.push_str(&format!("{} bytes)", s.len()));
            return out;
        }
        out.push_str(&esc);
    }
    out.push('"');
    out
}

/// The last guard of the one-line rule: whatever an error says, print it as one bounded line.
pub fn one_line(msg: &str) -> String {
    const MAX: usize = 1000;
    let mut s: String = msg
        .chars()
        .flat_map(|c| match c {
            '\n' => "\\n".chars().collect::<Vec<_>>(),
            '\r' => "\\r".chars().collect(),
            c if c.is_control() || (c.is_whitespace() && c != ' ') => c.escape_unicode().collect(),
            c => vec![c],
        })
        .take(MAX + 1)
        .collect();
    if s.chars().count() > MAX {
        s = s.chars().take(MAX).collect();
        s.push('…');
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quote_escapes_and_truncates() {
        assert_eq!(quote("blk.0.x"), "\"blk.0.x\"");
        assert_eq!(quote("a\nb\"c\u{2028}\0"), "\"a\\nb\\\"c\\u{2028}\\0\"");
        let long = "x\n".repeat(1000);
        let q = quote(&long);
        assert!(!q.contains('\n') && q.chars().count() < 110, "{q}");
        assert!(q.ends_with("(2000 bytes)"), "{q}");
        assert_eq!(one_line("a\nb\u{85}c"), "a\\nb\\u{85}c");
        assert!(one_line(&"y".repeat(5000)).chars().count() == 1001);
    }
}
