//! Safetensors checkpoints: header validation and per-tensor digests,
//! without torch: files in the page cache are hashed through their mapping,
//! the others read with large sequential reads ([`cold`]).
//!
//! Format: an 8-byte little-endian header length N, N bytes of JSON
//! (`{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}`),
//! then the data; offsets are relative to the data. Every malformed file is
//! reported with the file and, where one is at fault, the tensor.
//!
//! By concern: `header.rs` (the header, its validation and diagnosis),
//! `file.rs` (an opened, mapped file and whether it changed),
//! `residency.rs` (how much of it the page cache holds), `mapped.rs` (the
//! mapped path), `cold.rs` (the read path); here, the choice between the
//! two paths and the digests of a whole checkpoint.

use std::collections::HashMap;
use std::path::Path;

use crate::error::Error;
use crate::scheduler::{RunShape, Scheduler};
use crate::sha256::Digest;

mod cold;
mod file;
mod header;
mod mapped;
mod residency;

pub use cold::{cursors_for, BUFFER_BYTES, MAX_BUFFER_BYTES};
pub use file::CheckpointFile;
pub use header::{parse_header, TensorEntry};
pub use mapped::{CHUNK_BYTES, READ_AHEAD_BYTES};
pub use residency::CACHED_FRACTION;

use header::bad;
use mapped::{MappedTensor, Windows};

/// The system's page size, for the page-aligned ranges of the mapped path
/// and of the residency queries.
fn page_size() -> usize {
    static PAGE: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    // SAFETY: sysconf has no preconditions; a failure (-1) falls back to 4 KiB.
    *PAGE.get_or_init(|| usize::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) }).unwrap_or(4096))
}

/// How [`checksum_files_with`] reads each file.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ReadMode {
    /// Per file: through the mapping where at least [`CACHED_FRACTION`] of
    /// its data is in the page cache, else with large sequential reads.
    #[default]
    Auto,
    /// Every file through its mapping.
    Mapped,
    /// Every file with large sequential reads ([`cold`]).
    Read,
}

/// How [`checksum_files_with`] reads: the mode, and for the read path the
/// buffer size and the spans read side by side (0: the defaults,
/// [`BUFFER_BYTES`] and [`cursors_for`] the scheduler's threads).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ReadOptions {
    pub mode: ReadMode,
    pub buffer_bytes: usize,
    pub cursors: usize,
}

/// What [`checksum_files_with`] returns: every tensor's digest, keyed by
/// name in file order; the files it read (not mapped); and the shape of its
/// widest hashing run, counting every tensor.
pub struct Checksums {
    pub digests: Vec<(String, Digest)>,
    pub read_files: usize,
    pub shape: Option<RunShape>,
}

/// The digest of every tensor of `files`, keyed by tensor name, in file
/// order ([`checksum_files_with`], [`ReadMode::Auto`]).
pub fn checksum_files(
    files: &[CheckpointFile],
    scheduler: &Scheduler,
    progress: Option<&mut dyn FnMut(u64, u64) -> bool>,
) -> Result<Vec<(String, Digest)>, Error> {
    checksum_files_with(files, scheduler, ReadOptions::default(), progress).map(|c| c.digests)
}

/// The digest of every tensor of `files`, keyed by tensor name, in file
/// order. A tensor name found in two files is an error naming both.
///
/// Files in the page cache (see [`ReadMode`]) are hashed through their
/// mapping: every tensor is one message of the scheduler's streaming
/// feeder, so `threads x lanes` tensors are hashed at once whatever their
/// sizes, each read in windows of at most [`CHUNK_BYTES`] with read-ahead,
/// its pages dropped once hashed. The others first, with large sequential
/// reads hashed as they arrive ([`cold`]). `progress(done, total)` is
/// called on this thread about every 100 ms and once at the end; it returns
/// false to cancel (e.g. on Ctrl-C).
pub fn checksum_files_with(
    files: &[CheckpointFile],
    scheduler: &Scheduler,
    options: ReadOptions,
    mut progress: Option<&mut dyn FnMut(u64, u64) -> bool>,
) -> Result<Checksums, Error> {
    let mut owner: HashMap<&str, &Path> = HashMap::new();
    for f in files {
        for t in &f.tensors {
            if let Some(first) = owner.insert(&t.name, &f.path) {
                return Err(bad(&f.path, Some(&t.name), format!("also in {}", first.display())));
            }
        }
    }
    let read: Vec<bool> = files
        .iter()
        .map(|f| match options.mode {
            ReadMode::Mapped => false,
            ReadMode::Read => true,
            ReadMode::Auto => f.resident_fraction() < CACHED_FRACTION,
        })
        .collect();
    let total: u64 = files.iter().map(CheckpointFile::data_bytes).sum();
    let (cold, warm): (Vec<_>, Vec<_>) = files.iter().zip(&read).partition(|(_, &r)| r);
    let cold: Vec<&CheckpointFile> = cold.into_iter().map(|(f, _)| f).collect();
    let warm: Vec<&CheckpointFile> = warm.into_iter().map(|(f, _)| f).collect();

    let mut cold_digests = Vec::new().into_iter();
    let mut shapes = Vec::new();
    let mut cold_bytes = 0;
    if !cold.is_empty() {
        cold_bytes = cold.iter().map(|f| f.data_bytes()).sum();
        let shape = cold::Shape {
            buffer_bytes: if options.buffer_bytes == 0 {
                BUFFER_BYTES
            } else {
                options.buffer_bytes
            },
            cursors: if options.cursors == 0 {
                cursors_for(scheduler.effective_threads())
            } else {
                options.cursors
            },
            span_bytes: cold::SPAN_BYTES,
        };
        let mut report = |done: u64| progress.as_deref_mut().is_none_or(|p| p(done, total));
        let (digests, shape) = cold::checksum_read(&cold, scheduler, shape, &mut report)?;
        cold_digests = digests.into_iter();
        shapes.extend(shape);
    }
    let mut warm_digests = Vec::new().into_iter();
    if !warm.is_empty() || cold.is_empty() {
        let windows = Windows::for_streams(scheduler.streams());
        let sources: Vec<MappedTensor<'_>> = warm
            .iter()
            .flat_map(|f| f.tensors.iter().map(move |t| MappedTensor::new(f, t, windows)))
            .collect();
        let digests = match progress.as_deref_mut() {
            Some(p) => {
                let mut offset = |done: u64, _: u64| p(cold_bytes + done, total);
                scheduler.hash_sources(sources, Some(&mut offset))
            }
            None => scheduler.hash_sources(sources, None),
        };
        warm_digests = digests?.into_iter();
        shapes.extend(crate::scheduler::last_run());
    } else if let Some(p) = progress {
        if !p(total, total) {
            return Err(Error::Cancelled);
        }
    }
    // Every file as it was opened, else no digest of it is returned: a
    // truncation, a rewrite or a replacement during the run is an error.
    for f in files {
        f.unchanged()?;
    }
    let mut digests = Vec::with_capacity(owner.len());
    for (f, &r) in files.iter().zip(&read) {
        let from = if r { &mut cold_digests } else { &mut warm_digests };
        digests.extend(f.tensors.iter().map(|t| t.name.clone()).zip(from.by_ref()));
    }
    let messages = digests.len();
    let shape = shapes
        .into_iter()
        .max_by_key(|s| s.messages)
        .map(|s| RunShape { messages, ..s });
    Ok(Checksums {
        digests,
        read_files: cold.len(),
        shape,
    })
}

#[cfg(test)]
mod tests;
