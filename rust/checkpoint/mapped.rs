//! The mapped path: a tensor of a file in the page cache hashed through the
//! file's mapping ([`MappedTensor`]), a window at a time with read-ahead in
//! front and page release behind, and each lane's share of the windows and
//! the read-ahead ([`Windows`], the chunk and read-ahead sizes).

use memmap2::{Advice, UncheckedAdvice};

use super::{page_size, CheckpointFile, TensorEntry};
use crate::error::Error;
use crate::scheduler::ChunkSource;

/// Bytes a lane hashes from one tensor before its pages are dropped, at
/// most: bounds what the mapping keeps resident at about `streams x
/// CHUNK_BYTES`.
pub const CHUNK_BYTES: usize = 4 << 20;

/// What the hashed windows of all lanes together may keep resident: 8
/// narrow lanes (2 threads x 4) at [`CHUNK_BYTES`]. With more messages in
/// flight (the wide kernel's 16 a thread, more threads) each lane's window
/// shrinks to fit, down to [`MIN_CHUNK_BYTES`]. Where the page cache holds
/// large folios (Linux 6.x), a fault maps the rest of the folio too, up to
/// 2 MiB a lane beyond its window until the window is released: measured
/// on a 2-vCPU AMD EPYC (Linux 6.18), 64 tensors of 16 MiB, peak RSS
/// growth 36 MiB at 8 lanes and 97 MiB at 32 (121 MiB with 4 MiB windows).
pub(super) const RESIDENT_BYTES: usize = 8 * CHUNK_BYTES;
pub(super) const MIN_CHUNK_BYTES: usize = 1 << 20;

/// Read-ahead requested for all lanes together; each lane's share is
/// [`READ_AHEAD_BYTES`] at 8 lanes, less with more (so the disk sees the
/// same depth of requests), never under a quarter of it.
pub(super) const READ_AHEAD_TOTAL_BYTES: usize = 8 * READ_AHEAD_BYTES;

/// How far ahead of each lane the kernel is asked to read the file
/// (`MADV_WILLNEED`), so that a cold checkpoint is read while it is hashed.
/// Measured cold on a 2-vCPU AMD EPYC VM's disk (2026-11): 32 MiB 1.4-1.6 GB/s, 64 MiB 1.9-2.1,
/// 128 MiB 2.1-2.2 (a plain sequential read: 1.7-2.1). Page cache only, not
/// resident memory.
pub const READ_AHEAD_BYTES: usize = 64 << 20;

/// Tensors smaller than this get no explicit read-ahead: the kernel's own
/// fault-around covers them, and a syscall each would cost more.
const READ_AHEAD_MIN_BYTES: usize = 1 << 20;

/// One tensor of a mapped file as a stream of [`CHUNK_BYTES`] windows, with
/// read-ahead in front and page release behind.
pub(super) struct MappedTensor<'a> {
    file: &'a CheckpointFile,
    /// Window and read-ahead of this lane (see [`Windows`]).
    windows: Windows,
    map: &'a [u8],
    /// Absolute byte range of the tensor in the file.
    end: usize,
    /// The current window is `map[pos..window_end]`.
    pos: usize,
    window_end: usize,
    /// Read-ahead has been requested up to here.
    prefetched: usize,
    total: u64,
}

impl<'a> MappedTensor<'a> {
    pub(super) fn new(file: &'a CheckpointFile, t: &TensorEntry, windows: Windows) -> MappedTensor<'a> {
        let (start, end) = (t.start as usize, t.end as usize);
        MappedTensor {
            file,
            windows,
            map: &file.map,
            end,
            pos: start,
            window_end: start,
            prefetched: start,
            total: t.nbytes(),
        }
    }
}

impl ChunkSource for MappedTensor<'_> {
    fn total_bytes(&self) -> u64 {
        self.total
    }

    fn chunk(&self) -> &[u8] {
        &self.map[self.pos..self.window_end]
    }

    fn next_chunk(&mut self) -> Result<bool, Error> {
        // A fault anywhere in the file (one atomic load a window): stop now,
        // nothing hashed of zeros is returned.
        if let Some(e) = self.file.fault_error() {
            return Err(e);
        }
        if self.window_end > self.pos {
            self.file.release(self.pos, self.window_end);
        }
        self.pos = self.window_end;
        if self.pos == self.end {
            return Ok(false);
        }
        let Windows { chunk, read_ahead } = self.windows;
        self.window_end = (self.pos + chunk).min(self.end);
        let want = (self.pos + read_ahead).min(self.end);
        let from = self.prefetched.max(self.pos);
        // Ask in large steps (half a window, or the rest of the tensor), not per chunk.
        let worth_it = self.total >= READ_AHEAD_MIN_BYTES as u64;
        if worth_it && want > from && (want - from >= read_ahead / 2 || want == self.end) {
            self.file.will_need(from, want);
            self.prefetched = want;
        }
        Ok(true)
    }
}

/// Each lane's window and read-ahead, for a run with `streams` messages in
/// flight: the totals ([`RESIDENT_BYTES`], [`READ_AHEAD_TOTAL_BYTES`])
/// shared out, within bounds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Windows {
    pub(super) chunk: usize,
    pub(super) read_ahead: usize,
}

impl Windows {
    pub(super) fn for_streams(streams: usize) -> Windows {
        let streams = streams.max(1);
        let page = page_size();
        let chunk = (RESIDENT_BYTES / streams).clamp(MIN_CHUNK_BYTES, CHUNK_BYTES) / page * page;
        let read_ahead = (READ_AHEAD_TOTAL_BYTES / streams).clamp(READ_AHEAD_BYTES / 4, READ_AHEAD_BYTES);
        Windows { chunk, read_ahead }
    }
}

impl CheckpointFile {
    /// Drops the whole pages inside bytes `[start, end)` of the mapping from
    /// our page tables; the page cache keeps them.
    fn release(&self, start: usize, end: usize) {
        let page = page_size();
        let (lo, hi) = (start.div_ceil(page) * page, end / page * page);
        if hi > lo {
            // SAFETY: MADV_DONTNEED on a read-only shared file mapping only
            // drops page-table entries: a later read of the same pages faults
            // them back in from the page cache with identical contents (the
            // file is not modified while it is read: `CheckpointFile::open`'s
            // precondition), so no reader (including other threads hashing
            // neighbouring tensors) can observe a change.
            let _ = unsafe { self.map.unchecked_advise_range(UncheckedAdvice::DontNeed, lo, hi - lo) };
        }
    }

    /// Starts reading bytes `[start, end)` into the page cache in the
    /// background (a hint: errors are ignored, reads then fault as usual).
    fn will_need(&self, start: usize, end: usize) {
        let lo = start / page_size() * page_size();
        let _ = self.map.advise_range(Advice::WillNeed, lo, end - lo);
    }
}
