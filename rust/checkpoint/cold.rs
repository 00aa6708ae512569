//! The read path for checkpoint files that are not in the page cache.
//!
//! Cold pages of a mapping fault in small folios, and read-ahead on a
//! mapping is not a large sequential read: a cold checkpoint hashed through
//! its mapping ran at 0.4-0.75 of a plain `read()` of the same files. Here a
//! reader thread reads each file with large `pread`s into a fixed set of
//! reusable, page-aligned buffers, and the calling thread hashes each
//! buffer (through the scheduler's lanes, [`MultiHasher`]) while the next
//! ones are read.
//!
//! One message of SHA-256 is one sequential chain (about 1.5 GB/s a core
//! with SHA-NI), so a checkpoint of a few large tensors read front to back
//! would hash one tensor at a time, slower than the disk. The files are
//! therefore cut into *spans* at tensor boundaries (a large tensor alone,
//! runs of small ones together), and several *cursors* each read one span
//! front to back, taking turns a buffer at a time, largest spans first: a
//! few large tensors are hashed side by side. A buffer holding the ends of
//! many small tensors feeds them all; a tensor that spans buffers streams
//! through the same state, its buffers hashed in the order read.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::time::{Duration, Instant};

use super::{bad, CheckpointFile, TensorEntry};
use crate::error::Error;
use crate::scheduler::{MultiHasher, RunShape, Scheduler};
use crate::sha256::Digest;

/// Bytes one `pread` reads into one buffer, by default. Measured cold on a
/// 2-vCPU Intel Xeon VM's virtio disk (Linux 6.18): buffered reads of 1-16
/// MiB all ran at the disk's 2.0-2.1 GB/s (`cat`: 2.1), `O_DIRECT` reads
/// of 4-32 MiB at 1.3-1.6.
pub const BUFFER_BYTES: usize = 8 << 20;

/// The largest buffer a caller may ask for.
pub const MAX_BUFFER_BYTES: usize = 1 << 30;

/// Spans (what one cursor reads front to back) pack consecutive tensors up
/// to this many bytes; a larger tensor is a span alone.
pub(super) const SPAN_BYTES: u64 = 64 << 20;

/// How often the progress callback is called, at most (as the scheduler).
const PROGRESS_EVERY: Duration = Duration::from_millis(100);

/// Buffers are aligned to this (a page; enough for `O_DIRECT` too).
const ALIGN: usize = 4096;

/// Cursors (spans read side by side) for a run on `threads` hashing
/// threads: two a thread (a core hashes two SHA-NI streams at about 1.5x
/// one), at least 2, at most 8.
pub fn cursors_for(threads: usize) -> usize {
    (2 * threads).clamp(2, 8)
}

/// One page-aligned, reusable buffer: `len` bytes from `off` in `bytes`.
struct Buffer {
    bytes: Vec<u8>,
    off: usize,
    len: usize,
}

impl Buffer {
    fn new(len: usize) -> Buffer {
        // `vec![0; n]` of this size is a fresh zeroed mapping (calloc): its
        // pages are touched by the first read into them, then reused.
        let bytes = vec![0u8; len + ALIGN];
        let off = bytes.as_ptr().align_offset(ALIGN).min(ALIGN);
        Buffer { bytes, off, len }
    }

    fn slice(&self, len: usize) -> &[u8] {
        &self.bytes[self.off..self.off + len]
    }

    fn slice_mut(&mut self, len: usize) -> &mut [u8] {
        debug_assert!(len <= self.len);
        &mut self.bytes[self.off..self.off + len]
    }
}

/// Consecutive tensors of one file that one cursor reads front to back:
/// `tensors[first..first + count]` of the flat list, bytes `[start, end)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Span {
    pub(super) file: usize,
    pub(super) start: u64,
    pub(super) end: u64,
    pub(super) first: usize,
    pub(super) count: usize,
}

/// The spans of `files` (tensors in file order, as `parse_header` returns
/// them: back to back), largest first (stable: equal sizes in file order).
pub(super) fn spans(files: &[&CheckpointFile], span_bytes: u64) -> Vec<Span> {
    let mut out = Vec::new();
    let mut first = 0;
    for (file, f) in files.iter().enumerate() {
        let mut open: Option<Span> = None;
        for (i, t) in f.tensors.iter().enumerate() {
            let index = first + i;
            match &mut open {
                Some(s) if s.end - s.start + t.nbytes() <= span_bytes => {
                    debug_assert_eq!(s.end, t.start);
                    s.end = t.end;
                    s.count += 1;
                }
                _ => {
                    out.extend(open.take());
                    open = Some(Span {
                        file,
                        start: t.start,
                        end: t.end,
                        first: index,
                        count: 1,
                    });
                }
            }
        }
        out.extend(open);
        first += f.tensors.len();
    }
    out.sort_by_key(|s| std::cmp::Reverse(s.end - s.start));
    out
}

/// Bytes `[start, start + len)` of span `span`, read into `buffer`.
struct Chunk {
    buffer: Buffer,
    span: usize,
    start: u64,
    len: usize,
}

/// How a cold run goes: buffer size, cursors.
#[derive(Clone, Copy, Debug)]
pub(super) struct Shape {
    pub(super) buffer_bytes: usize,
    pub(super) cursors: usize,
    pub(super) span_bytes: u64,
}

/// A file opened again for one cursor: its own open file description, so
/// that the kernel's read-ahead follows each cursor's sequential stream (a
/// `dup` shares one read-ahead state between all cursors); an error if the
/// path now names another file.
fn reopen(f: &CheckpointFile) -> Result<File, Error> {
    let file = f.reopen()?;
    advise_sequential(&file);
    Ok(file)
}

/// Asks for the larger read-ahead window of a sequential reader (a hint).
#[cfg(target_os = "linux")]
fn advise_sequential(file: &File) {
    use std::os::fd::AsRawFd;
    // SAFETY: posix_fadvise only reads its integer arguments; the
    // descriptor is open (borrowed from `file`) for the whole call.
    let _ = unsafe { libc::posix_fadvise(file.as_raw_fd(), 0, 0, libc::POSIX_FADV_SEQUENTIAL) };
}

#[cfg(not(target_os = "linux"))]
fn advise_sequential(_file: &File) {}

/// Fills `buf` from `file` at `offset`. A file that ends first (truncated
/// since it was opened) is an error naming the tensor whose bytes are
/// missing.
fn read_full(
    f: &CheckpointFile,
    file: &File,
    span: &Span,
    tensors: &[TensorEntry],
    buf: &mut [u8],
    offset: u64,
) -> Result<(), Error> {
    let mut done = 0;
    while done < buf.len() {
        let at = offset + done as u64;
        match file.read_at(&mut buf[done..], at) {
            Ok(0) => {
                let local = &tensors[span.first..span.first + span.count];
                let t = local.iter().find(|t| t.start <= at && at < t.end);
                return Err(bad(
                    &f.path,
                    t.map(|t| t.name.as_str()),
                    format!("the file ends at byte {at}, before the end of the data its header describes: truncated while it was read?"),
                ));
            }
            Ok(n) => done += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(source) => {
                return Err(Error::Io {
                    path: f.path.clone(),
                    source,
                })
            }
        }
    }
    Ok(())
}

/// The reader thread: `cursors` spans read side by side, a buffer at a time
/// in turn, each chunk sent in the order read. Returns when every span is
/// read, after sending an error, or once the hashing side has hung up.
fn read_spans(
    files: &[&CheckpointFile],
    tensors: &[TensorEntry],
    spans: &[Span],
    shape: Shape,
    free: Receiver<Buffer>,
    filled: Sender<Result<Chunk, Error>>,
) {
    struct Cursor {
        span: usize,
        at: u64,
        file: File,
    }
    let open = |span: usize| -> Result<Cursor, Error> {
        let f = files[spans[span].file];
        let file = reopen(f)?;
        Ok(Cursor {
            span,
            at: spans[span].start,
            file,
        })
    };
    let mut next_span = 0;
    let mut active: Vec<Cursor> = Vec::with_capacity(shape.cursors);
    let mut turn = 0;
    loop {
        while active.len() < shape.cursors && next_span < spans.len() {
            let span = next_span;
            next_span += 1;
            if spans[span].start == spans[span].end {
                continue; // only empty tensors: nothing to read
            }
            match open(span) {
                Ok(c) => active.push(c),
                Err(e) => {
                    let _ = filled.send(Err(e));
                    return;
                }
            }
        }
        if active.is_empty() {
            return;
        }
        turn %= active.len();
        let Ok(mut buffer) = free.recv() else { return };
        let c = &mut active[turn];
        let span = &spans[c.span];
        let len = (span.end - c.at).min(shape.buffer_bytes as u64) as usize;
        let f = files[span.file];
        if let Err(e) = read_full(f, &c.file, span, tensors, buffer.slice_mut(len), c.at) {
            let _ = filled.send(Err(e));
            return;
        }
        let chunk = Chunk {
            buffer,
            span: c.span,
            start: c.at,
            len,
        };
        if filled.send(Ok(chunk)).is_err() {
            return;
        }
        c.at += len as u64;
        if c.at == span.end {
            active.swap_remove(turn);
        } else {
            turn += 1;
        }
    }
}

/// The `(tensor index, bytes)` pieces of one chunk: every tensor of its
/// span that overlaps it, clipped to it.
fn pieces<'a>(chunk: &'a Chunk, span: &Span, tensors: &[TensorEntry], out: &mut Vec<(usize, &'a [u8])>) {
    let local = &tensors[span.first..span.first + span.count];
    let (lo, hi) = (chunk.start, chunk.start + chunk.len as u64);
    let bytes = chunk.buffer.slice(chunk.len);
    let from = local.partition_point(|t| t.end <= lo);
    for (i, t) in local.iter().enumerate().skip(from) {
        if t.start >= hi {
            break;
        }
        let (a, b) = (t.start.max(lo), t.end.min(hi));
        if b > a {
            out.push((span.first + i, &bytes[(a - lo) as usize..(b - lo) as usize]));
        }
    }
}

/// The digests of every tensor of `files` (all read with `pread`, none
/// through the mapping), in file order, and the shape of the largest
/// hashing round. `progress(bytes hashed)` is called on this thread about
/// every 100 ms; it returns false to cancel.
pub(super) fn checksum_read(
    files: &[&CheckpointFile],
    scheduler: &Scheduler,
    shape: Shape,
    progress: &mut dyn FnMut(u64) -> bool,
) -> Result<(Vec<Digest>, Option<RunShape>), Error> {
    let tensors: Vec<TensorEntry> = files.iter().flat_map(|f| f.tensors.iter().cloned()).collect();
    let spans = spans(files, shape.span_bytes);
    let largest = spans.first().map_or(0, |s| s.end - s.start);
    // Never larger than the largest span needs (nor than MAX_BUFFER_BYTES):
    // each buffer is allocated whole.
    let buffer_bytes = shape.buffer_bytes.clamp(1, MAX_BUFFER_BYTES).min(
        (largest.min(MAX_BUFFER_BYTES as u64) as usize)
            .next_multiple_of(ALIGN)
            .max(ALIGN),
    );
    let shape = Shape {
        buffer_bytes,
        cursors: shape.cursors.max(1),
        ..shape
    };
    // Two buffers a cursor (one hashed while the next is read), never more
    // than the data needs.
    let per_cursor = (largest.div_ceil(buffer_bytes as u64) as usize).clamp(1, 2);
    let buffers = per_cursor * shape.cursors;
    let mut multi = scheduler.multi(tensors.len());
    let mut widest: Option<RunShape> = None;
    std::thread::scope(|scope| {
        let (free_tx, free_rx) = mpsc::channel();
        let (filled_tx, filled_rx) = mpsc::channel();
        for _ in 0..buffers {
            free_tx.send(Buffer::new(buffer_bytes)).expect("the receiver is alive");
        }
        let (tensors, spans) = (&tensors, &spans);
        scope.spawn(move || read_spans(files, tensors, spans, shape, free_rx, filled_tx));
        // At most this many chunks a round, so that the reader always has
        // a cursor's worth of buffers to read into while a round is hashed.
        let round_max = (buffers - buffers / 2).max(1);
        hash_chunks(
            &mut multi,
            tensors,
            spans,
            round_max,
            filled_rx,
            free_tx,
            progress,
            &mut widest,
        )
    })?;
    // Every byte of every tensor fed, or an error (never a digest of part
    // of a tensor): the reader stops early only after sending an error, so
    // this holds unless a change here breaks that.
    let mut index = 0;
    for f in files {
        for t in &f.tensors {
            if multi.bytes_fed(index) != Some(t.nbytes()) {
                return Err(bad(
                    &f.path,
                    Some(t.name.as_str()),
                    format!(
                        "{} of its {} bytes were read",
                        multi.bytes_fed(index).unwrap_or(0),
                        t.nbytes()
                    ),
                ));
            }
            index += 1;
        }
    }
    Ok((multi.finish(), widest))
}

/// The hashing side: takes the chunks as they are read (at least one,
/// at most `round_max` a round), hashes each round as one scheduler run,
/// and hands the buffers back. Owns both channel ends, so that returning
/// (an error, a cancel) stops the reader.
#[allow(clippy::too_many_arguments)]
fn hash_chunks(
    multi: &mut MultiHasher,
    tensors: &[TensorEntry],
    spans: &[Span],
    round_max: usize,
    filled: Receiver<Result<Chunk, Error>>,
    free: Sender<Buffer>,
    progress: &mut dyn FnMut(u64) -> bool,
    widest: &mut Option<RunShape>,
) -> Result<(), Error> {
    let mut done = 0u64;
    let mut reported = Instant::now();
    let mut round: Vec<Chunk> = Vec::with_capacity(round_max);
    loop {
        let first = match filled.recv_timeout(PROGRESS_EVERY) {
            Ok(chunk) => chunk?,
            Err(RecvTimeoutError::Timeout) => {
                // A slow disk: keep reporting (and let a cancel through).
                if !progress(done) {
                    return Err(Error::Cancelled);
                }
                reported = Instant::now();
                continue;
            }
            Err(RecvTimeoutError::Disconnected) => return Ok(()),
        };
        round.push(first);
        while round.len() < round_max {
            match filled.try_recv() {
                Ok(chunk) => round.push(chunk?),
                Err(_) => break,
            }
        }
        let mut feeds: Vec<(usize, &[u8])> = Vec::new();
        for chunk in &round {
            pieces(chunk, &spans[chunk.span], tensors, &mut feeds);
        }
        multi.update(&feeds)?;
        drop(feeds);
        if let Some(run) = crate::scheduler::last_run() {
            if widest.is_none_or(|w| run.messages >= w.messages) {
                *widest = Some(run);
            }
        }
        for chunk in round.drain(..) {
            done += chunk.len as u64;
            // The reader may be gone (it is done): the buffer is then freed.
            let _ = free.send(chunk.buffer);
        }
        if reported.elapsed() >= PROGRESS_EVERY {
            reported = Instant::now();
            if !progress(done) {
                return Err(Error::Cancelled);
            }
        }
    }
}
