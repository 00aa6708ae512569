//! weight-checker's core: exact, parallel SHA-256 digests of model weights.
//!
//! Pure Rust; the PyO3 binding sits behind the `python` feature so that
//! `cargo test` and `cargo bench` need no interpreter.

pub mod background;
pub mod checkpoint;
pub mod error;
mod fault_guard;
pub mod fp8;
mod prefetch;
pub mod scheduler;
pub mod settings;
pub mod sha256;
pub mod strided;
mod transpose;

#[cfg(feature = "python")]
mod python;

/// The wide kernel's test policy, shared with the integration tests.
#[cfg(test)]
#[path = "tests/common/wide_check.rs"]
mod wide_check;

pub use error::Error;
pub use scheduler::{
    BatchQueue, BatchTally, Batches, ChunkSource, MultiHasher, RunShape, RunSummary, Scheduler, Slices,
};
pub use settings::SettingError;
pub use sha256::{Digest, Kernel, Sha256};
