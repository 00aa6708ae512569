//! weight-checker's core: exact, parallel SHA-256 digests of model weights.
//!
//! Pure Rust; the PyO3 binding sits behind the `python` feature so that
//! `cargo test` and `cargo bench` need no interpreter.

pub mod checkpoint;
pub mod engine;
pub mod error;
pub mod sha256;
pub mod strided;

#[cfg(feature = "python")]
mod python;

pub use engine::{hash_many, ChunkSource, Engine, MultiHasher, Slices};
pub use error::Error;
pub use sha256::{Backend, Digest, Sha256};
