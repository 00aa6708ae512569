//! The one error type of the core. The Python binding maps each variant to
//! an exception once, in `python.rs`.

use std::fmt;
use std::path::PathBuf;

#[derive(Debug)]
pub enum Error {
    /// A multi-hasher update named a digest that does not exist.
    DigestIndex { index: usize, len: usize },
    /// A file could not be opened, read or mapped.
    Io { path: PathBuf, source: std::io::Error },
    /// A safetensors file or index is malformed. `tensor` names the entry at
    /// fault when there is one.
    Safetensors {
        path: PathBuf,
        tensor: Option<String>,
        reason: String,
    },
    /// A progress callback asked to stop.
    Cancelled,
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::DigestIndex { index, len } => write!(f, "digest index {index} out of range for {len} digests"),
            Error::Io { path, source } => write!(f, "{}: {source}", path.display()),
            Error::Safetensors {
                path,
                tensor: Some(t),
                reason,
            } => {
                write!(f, "{}: tensor '{t}': {reason}", path.display())
            }
            Error::Safetensors {
                path,
                tensor: None,
                reason,
            } => write!(f, "{}: {reason}", path.display()),
            Error::Cancelled => f.write_str("cancelled"),
        }
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Error::Io { source, .. } => Some(source),
            _ => None,
        }
    }
}
