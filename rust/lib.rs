//! weight-checker's core: exact, parallel SHA-256 digests of model weights.
//!
//! Pure Rust; the PyO3 binding sits behind the `python` feature so that
//! `cargo test` and `cargo bench` need no interpreter.

pub mod checkpoint;
pub mod error;
mod prefetch;
pub mod scheduler;
pub mod sha256;
pub mod strided;

#[cfg(feature = "python")]
mod python;

pub use error::Error;
pub use scheduler::{BatchQueue, Batches, ChunkSource, MultiHasher, Scheduler, Slices};
pub use sha256::{Digest, Kernel, Sha256};
