//! Safetensors checkpoints: header validation and per-tensor digests,
//! without torch: files in the page cache are hashed through their mapping,
//! the others read with large sequential reads ([`cold`]).
//!
//! Format: an 8-byte little-endian header length N, N bytes of JSON
//! (`{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}`),
//! then the data; offsets are relative to the data. Every malformed file is
//! reported with the file and, where one is at fault, the tensor.

use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::{Advice, Mmap, UncheckedAdvice};
use safetensors::SafeTensors;
use serde_json::Value;

use crate::error::Error;
use crate::fault_guard::{self, Registration};
use crate::scheduler::{ChunkSource, RunShape, Scheduler};
use crate::sha256::Digest;

#[path = "checkpoint_cold.rs"]
mod cold;

pub use cold::{cursors_for, BUFFER_BYTES, MAX_BUFFER_BYTES};

/// Headers larger than this are refused (as the safetensors crate does).
const MAX_HEADER_BYTES: u64 = 100_000_000;

/// One tensor of a checkpoint file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorEntry {
    pub name: String,
    pub dtype: String,
    pub shape: Vec<u64>,
    /// Absolute byte range in the file.
    pub start: u64,
    pub end: u64,
}

impl TensorEntry {
    pub fn nbytes(&self) -> u64 {
        self.end - self.start
    }
}

/// Bits per element of each safetensors dtype (the `safetensors` crate's
/// list), for the diagnosis of a rejected header.
fn dtype_bits(dtype: &str) -> Option<u64> {
    Some(match dtype {
        "F4" => 4,
        "F6_E2M3" | "F6_E3M2" => 6,
        "BOOL" | "U8" | "I8" | "F8_E5M2" | "F8_E4M3" | "F8_E8M0" | "F8_E4M3FNUZ" | "F8_E5M2FNUZ" => 8,
        "I16" | "U16" | "F16" | "BF16" => 16,
        "I32" | "U32" | "F32" => 32,
        "I64" | "U64" | "F64" | "C64" => 64,
        _ => return None,
    })
}

fn bad(path: &Path, tensor: Option<&str>, reason: impl Into<String>) -> Error {
    Error::Safetensors {
        path: path.to_path_buf(),
        tensor: tensor.map(str::to_string),
        reason: reason.into(),
    }
}

/// Parses and validates the header of a whole safetensors file (`file`, all
/// its bytes) and returns the tensors in file order.
///
/// The verdict is the `safetensors` crate's (`SafeTensors::read_metadata`,
/// what Python's `safe_open` runs): tensors back to back from offset 0 with
/// no gap or overlap, sizes exactly dtype x shape in whole bytes, the data
/// covering the file to its last byte. When it refuses a file, [`diagnose`]
/// words the reason and names the tensor at fault.
pub fn parse_header(path: &Path, file: &[u8]) -> Result<Vec<TensorEntry>, Error> {
    let (n, metadata) = match SafeTensors::read_metadata(file) {
        Ok(ok) => ok,
        Err(e) => {
            return Err(diagnose(path, file)
                .err()
                .unwrap_or_else(|| bad(path, None, format!("invalid safetensors file: {e}"))))
        }
    };
    let data_start = (8 + n) as u64;
    Ok(metadata
        .offset_keys()
        .into_iter()
        .filter_map(|name| {
            let info = metadata.info(&name)?;
            let (begin, end) = info.data_offsets;
            Some(TensorEntry {
                dtype: format!("{:?}", info.dtype),
                shape: info.shape.iter().map(|&d| d as u64).collect(),
                start: data_start + begin as u64,
                end: data_start + end as u64,
                name,
            })
        })
        .collect())
}

/// The first defect of a file the crate refused, as one message naming the
/// file and, where one is at fault, the tensor. Checks what the crate
/// checks, in the order a reader would look.
fn diagnose(path: &Path, file: &[u8]) -> Result<(), Error> {
    let file_len = file.len() as u64;
    if file_len < 8 {
        return Err(bad(
            path,
            None,
            format!("truncated: {file_len} bytes, shorter than the 8-byte header length"),
        ));
    }
    let n = u64::from_le_bytes(file[..8].try_into().unwrap());
    if n > MAX_HEADER_BYTES {
        return Err(bad(
            path,
            None,
            format!("header length {n} is larger than the limit {MAX_HEADER_BYTES}"),
        ));
    }
    if 8 + n > file_len {
        return Err(bad(
            path,
            None,
            format!("header length {n} runs past the end of the file ({file_len} bytes)"),
        ));
    }
    let header = &file[8..8 + n as usize];
    let json: Value =
        serde_json::from_slice(header).map_err(|e| bad(path, None, format!("invalid JSON header: {e}")))?;
    let map = json
        .as_object()
        .ok_or_else(|| bad(path, None, "header is not a JSON object"))?;
    let data_len = file_len - 8 - n;
    let mut spans = Vec::with_capacity(map.len());
    for (name, info) in map {
        if name == "__metadata__" {
            if !info.as_object().is_some_and(|m| m.values().all(Value::is_string)) {
                return Err(bad(path, None, "__metadata__ must map strings to strings"));
            }
            continue;
        }
        let t = Some(name.as_str());
        let info = info.as_object().ok_or_else(|| bad(path, t, "entry is not an object"))?;
        let dtype = info
            .get("dtype")
            .and_then(Value::as_str)
            .ok_or_else(|| bad(path, t, "missing or non-string dtype"))?;
        let bits = dtype_bits(dtype).ok_or_else(|| bad(path, t, format!("unknown dtype {dtype:?}")))?;
        let shape: Vec<u64> = info
            .get("shape")
            .and_then(Value::as_array)
            .ok_or_else(|| bad(path, t, "missing or non-list shape"))?
            .iter()
            .map(|d| {
                d.as_u64()
                    .ok_or_else(|| bad(path, t, format!("shape entry {d} is not a non-negative integer")))
            })
            .collect::<Result<_, _>>()?;
        let offsets = info
            .get("data_offsets")
            .and_then(Value::as_array)
            .filter(|o| o.len() == 2)
            .ok_or_else(|| bad(path, t, "data_offsets must be [begin, end]"))?;
        let (begin, end) = match (offsets[0].as_u64(), offsets[1].as_u64()) {
            (Some(b), Some(e)) => (b, e),
            _ => return Err(bad(path, t, "data_offsets must be non-negative integers")),
        };
        if begin > end {
            return Err(bad(path, t, format!("data_offsets [{begin}, {end}] are reversed")));
        }
        if end > data_len {
            return Err(bad(
                path,
                t,
                format!(
                    "data_offsets [{begin}, {end}] run past the end of the data ({data_len} bytes): truncated file?"
                ),
            ));
        }
        let numel = shape
            .iter()
            .try_fold(1u64, |acc, &d| acc.checked_mul(d))
            .ok_or_else(|| bad(path, t, "shape overflows"))?;
        let nbits = numel.checked_mul(bits).ok_or_else(|| bad(path, t, "shape overflows"))?;
        if nbits % 8 != 0 {
            return Err(bad(
                path,
                t,
                format!("dtype {dtype} and shape {shape:?} make {nbits} bits, not whole bytes"),
            ));
        }
        if nbits / 8 != end - begin {
            return Err(bad(
                path,
                t,
                format!(
                    "dtype {dtype} and shape {shape:?} need {} bytes, but data_offsets span {}",
                    nbits / 8,
                    end - begin
                ),
            ));
        }
        spans.push((begin, end, name.as_str()));
    }
    spans.sort();
    let mut at = 0;
    let mut previous: Option<&str> = None;
    for &(begin, end, name) in &spans {
        if begin < at {
            let other = previous.unwrap_or("?");
            return Err(bad(path, Some(name), format!("data overlaps tensor {other:?}")));
        }
        if begin > at {
            return Err(bad(
                path,
                Some(name),
                format!(
                    "a gap of {} bytes before it (data must be back to back from 0)",
                    begin - at
                ),
            ));
        }
        at = end;
        previous = Some(name);
    }
    if at != data_len {
        return Err(bad(
            path,
            None,
            format!("the tensors cover {at} of the {data_len} data bytes: the file has bytes no tensor owns"),
        ));
    }
    Ok(())
}

/// An opened checkpoint file: its tensors and a read-only shared mapping
/// (see [`CheckpointFile::open`]).
pub struct CheckpointFile {
    pub path: PathBuf,
    pub tensors: Vec<TensorEntry>,
    /// Faults of reads past a truncated end, recorded instead of SIGBUS
    /// (see [`fault_guard`]). Declared before `map`: dropped before the
    /// mapping is unmapped.
    guard: Registration,
    map: Mmap,
    /// `(st_dev, st_ino)` of the file the mapping was made from: the read
    /// path ([`cold`]) opens it again by path and checks it is the same
    /// file. No descriptor is kept open (a checkpoint of more shards than
    /// the open-file limit maps as it always did).
    identity: (u64, u64),
    /// Size and modification and change times when it was opened: a file
    /// still named by its path but changed since (rewritten in place, or
    /// truncated and written again) is refused at the end of the run
    /// ([`CheckpointFile::unchanged`]).
    stamp: Stamp,
}

impl CheckpointFile {
    /// Opens and maps `path` and validates its header.
    ///
    /// The file is mapped read-only and shared (`PROT_READ`, `MAP_SHARED`:
    /// memmap2's `Mmap::map`), so its bytes are read in place, from the page
    /// cache, never copied. The caller's contract: the file is not modified
    /// or truncated while it is open (see the SAFETY note below).
    pub fn open(path: &Path) -> Result<CheckpointFile, Error> {
        let io = |source| Error::Io {
            path: path.to_path_buf(),
            source,
        };
        let file = File::open(path).map_err(io)?;
        let meta = file.metadata().map_err(io)?;
        let len = meta.len();
        if len == 0 {
            return Err(bad(path, None, "empty file"));
        }
        // SAFETY: `Mmap::map` maps the file read-only and shared (PROT_READ,
        // MAP_SHARED), and the mapping derefs to a `&[u8]` that must not
        // change while it is borrowed. We never write it. Another process
        // may: a write shows through a shared mapping (bytes that change
        // under a `&[u8]`, read as plain integers by the hashing, so a
        // digest of mixed bytes, never undefined behaviour of ours in
        // practice), and a truncation unbacks the pages past the new end.
        // Neither gives a wrong answer: a read of an unbacked page is
        // caught by the fault guard (zeros and a recorded fault, not
        // SIGBUS; registered below before any read), and a file changed
        // in any way during the run is refused at its end
        // ([`CheckpointFile::unchanged`]).
        let map = unsafe { Mmap::map(&file) }.map_err(io)?;
        let guard = Registration::new(map.as_ptr(), map.len()).ok_or_else(|| {
            bad(
                path,
                None,
                format!(
                    "cannot guard its mapping against a truncation (the SIGBUS handler could not be installed, or \
                     more than {} checkpoint files are open at once)",
                    fault_guard::SLOTS
                ),
            )
        })?;
        let parsed = parse_header(path, &map);
        if let Some(offset) = guard.fault() {
            return Err(truncated(path, None, offset as u64));
        }
        Ok(CheckpointFile {
            path: path.to_path_buf(),
            tensors: parsed?,
            guard,
            map,
            identity: identity(&meta),
            stamp: Stamp::of(&meta),
        })
    }

    /// The tensor that holds byte `offset` of the file, if any.
    fn tensor_at(&self, offset: u64) -> Option<&str> {
        let i = self.tensors.partition_point(|t| t.end <= offset);
        self.tensors
            .get(i)
            .filter(|t| t.start <= offset)
            .map(|t| t.name.as_str())
    }

    /// An error if a read of the mapping faulted (the file was truncated
    /// while it was read), naming the tensor it was in.
    fn fault_error(&self) -> Option<Error> {
        let offset = self.guard.fault()? as u64;
        Some(truncated(&self.path, self.tensor_at(offset), offset))
    }

    /// The error of a path that names another file now (or none): the
    /// digests may be of either file, from the first tensor on.
    fn gone(&self, how: &str) -> Error {
        bad(
            &self.path,
            self.tensors.first().map(|t| t.name.as_str()),
            format!(
                "{how} while it was read: this tensor and those after it may be of either file; checksum it \
                 once nothing writes it"
            ),
        )
    }

    /// Whether the file is, at the end of a run, what was opened: no read of
    /// its mapping faulted, its path names the same file, of the same size,
    /// not modified or changed since. Otherwise the error names the file
    /// and the first tensor that may hold bytes of another version.
    pub(crate) fn unchanged(&self) -> Result<(), Error> {
        if let Some(e) = self.fault_error() {
            return Err(e);
        }
        let meta = match std::fs::metadata(&self.path) {
            Ok(meta) => meta,
            Err(e) => return Err(self.gone(&format!("removed or renamed ({e})"))),
        };
        if identity(&meta) != self.identity {
            return Err(self.gone("replaced by another file"));
        }
        let now = Stamp::of(&meta);
        if now == self.stamp {
            return Ok(());
        }
        let (was, is) = (self.stamp.len, now.len);
        let first = match is < was {
            true => self.tensors.iter().find(|t| t.end > is),
            false => self.tensors.first(),
        };
        Err(bad(
            &self.path,
            first.map(|t| t.name.as_str()),
            format!(
                "the file changed while it was read ({was} bytes when opened, {is} now, modified since): \
                 this tensor and those after it may mix bytes of two versions; checksum it once nothing \
                 writes it"
            ),
        ))
    }

    /// The file opened again by path, for reading: an error if the path
    /// now names another file than the one opened (replaced since).
    pub(crate) fn reopen(&self) -> Result<File, Error> {
        let io = |source| Error::Io {
            path: self.path.clone(),
            source,
        };
        let file = File::open(&self.path).map_err(io)?;
        if identity(&file.metadata().map_err(io)?) != self.identity {
            return Err(self.gone("replaced by another file"));
        }
        Ok(file)
    }

    /// Bytes of tensor data (the file after its header).
    pub fn data_bytes(&self) -> u64 {
        self.tensors.iter().map(TensorEntry::nbytes).sum()
    }

    /// The fraction of the data's pages found in the page cache (1.0 for a
    /// file without data), asked without reading a byte: `cachestat(2)`
    /// (Linux 6.5+), else `mincore` over the mapping (which, on Linux 5.2 to
    /// 6.4, counts only pages this process has mapped for a file it could
    /// not write: such a file, even cached, then takes the read path, slower
    /// but the same digests), else a few non-blocking reads
    /// (`RWF_NOWAIT`). The probes are the last resort because a probe that
    /// misses still starts read-ahead of its page: probed again, a cold file
    /// would look cached.
    pub fn resident_fraction(&self) -> f64 {
        let Some(first) = self.tensors.first() else { return 1.0 };
        let (start, end) = (first.start as usize, self.map.len());
        if start >= end {
            return 1.0;
        }
        if let Some(f) = self.cachestat_fraction(start as u64, end as u64) {
            return f;
        }
        if let Some(f) = self.mincore_fraction(start, end) {
            return f;
        }
        self.probe_fraction(start as u64, end as u64)
    }

    /// `cachestat(2)` over bytes `[start, end)` of the file: the fraction of
    /// their pages cached (`None` where the kernel has no such call).
    #[cfg(target_os = "linux")]
    fn cachestat_fraction(&self, start: u64, end: u64) -> Option<f64> {
        use std::os::fd::AsRawFd;
        /// `struct cachestat_range` and `struct cachestat` of
        /// `<linux/mman.h>`; the syscall's number is the same on every
        /// architecture (451, from the unified table).
        #[repr(C)]
        struct Range {
            off: u64,
            len: u64,
        }
        #[repr(C)]
        #[derive(Default)]
        struct Stat {
            nr_cache: u64,
            nr_dirty: u64,
            nr_writeback: u64,
            nr_evicted: u64,
            nr_recently_evicted: u64,
        }
        const SYS_CACHESTAT: libc::c_long = 451;
        let file = self.reopen().ok()?;
        let page = page_size() as u64;
        let off = start / page * page;
        let range = Range { off, len: end - off };
        let mut stat = Stat::default();
        // SAFETY: `range` and `stat` are live, properly laid out (`repr(C)`,
        // as the kernel's structs) for the call; the kernel reads `range`
        // and writes `stat` only; the descriptor is open (borrowed from
        // `file`); flags must be 0. An unknown syscall fails with ENOSYS.
        let rc = unsafe {
            libc::syscall(
                SYS_CACHESTAT,
                file.as_raw_fd(),
                &range as *const Range,
                &mut stat as *mut Stat,
                0u32,
            )
        };
        if rc != 0 {
            return None;
        }
        let pages = (end - off).div_ceil(page).max(1);
        Some((stat.nr_cache as f64 / pages as f64).min(1.0))
    }

    #[cfg(not(target_os = "linux"))]
    fn cachestat_fraction(&self, _start: u64, _end: u64) -> Option<f64> {
        None
    }

    /// `mincore` over bytes `[start, end)` of the mapping: the fraction of
    /// their pages resident (`None` where the call fails).
    #[cfg(target_os = "linux")]
    fn mincore_fraction(&self, start: usize, end: usize) -> Option<f64> {
        const WINDOW_PAGES: usize = 1 << 16;
        let page = page_size();
        let mut vec = vec![0u8; WINDOW_PAGES];
        let (mut at, mut resident, mut pages) = (start / page * page, 0usize, 0usize);
        while at < end {
            let len = (end - at).min(WINDOW_PAGES * page);
            let n = len.div_ceil(page);
            // SAFETY: `[at, at + len)` lies inside the live mapping (`at` is
            // page-aligned, as the mapping's base is, and `at + len <= end
            // == map.len()`); mincore writes one byte for each of its `n`
            // pages into `vec`, which holds `WINDOW_PAGES >= n`. It reads
            // no byte of the mapping and changes nothing.
            let rc = unsafe { libc::mincore(self.map.as_ptr().add(at) as *mut libc::c_void, len, vec.as_mut_ptr()) };
            if rc != 0 {
                return None;
            }
            resident += vec[..n].iter().filter(|&&b| b & 1 != 0).count();
            pages += n;
            at += len;
        }
        Some(resident as f64 / pages.max(1) as f64)
    }

    #[cfg(not(target_os = "linux"))]
    fn mincore_fraction(&self, _start: usize, _end: usize) -> Option<f64> {
        None
    }

    /// The fraction of [`PROBES`] pages spread over bytes `[start, end)` that
    /// a non-blocking read (`preadv2(RWF_NOWAIT)`: data only from the page
    /// cache, `EAGAIN` otherwise) finds cached.
    #[cfg(target_os = "linux")]
    fn probe_fraction(&self, start: u64, end: u64) -> f64 {
        use std::os::fd::AsRawFd;
        let Ok(file) = self.reopen() else { return 1.0 };
        let mut byte = 0u8;
        let mut hits = 0;
        for i in 0..PROBES {
            let at = start + (end - start) * (2 * i + 1) / (2 * PROBES);
            let iov = libc::iovec {
                iov_base: (&mut byte as *mut u8).cast(),
                iov_len: 1,
            };
            // SAFETY: `iov` describes one writable byte (`byte`, alive for the
            // call); the descriptor is open (borrowed from `file`).
            let n = unsafe { libc::preadv2(file.as_raw_fd(), &iov, 1, at as libc::off_t, libc::RWF_NOWAIT) };
            if n == 1 {
                hits += 1;
            }
        }
        f64::from(hits) / PROBES as f64
    }

    #[cfg(not(target_os = "linux"))]
    fn probe_fraction(&self, _start: u64, _end: u64) -> f64 {
        1.0
    }

    /// Drops the whole pages inside bytes `[start, end)` of the mapping from
    /// our page tables; the page cache keeps them.
    fn release(&self, start: usize, end: usize) {
        let page = page_size();
        let (lo, hi) = (start.div_ceil(page) * page, end / page * page);
        if hi > lo {
            // SAFETY: MADV_DONTNEED on a read-only shared file mapping only
            // drops page-table entries: a later read of the same pages faults
            // them back in from the page cache with identical contents (the
            // file is not modified while it is read: `open`'s precondition),
            // so no reader (including other threads hashing neighbouring
            // tensors) can observe a change.
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

/// A file with at least this fraction of its data in the page cache is
/// hashed through its mapping ([`ReadMode::Auto`]); one with less is read.
pub const CACHED_FRACTION: f64 = 0.75;

/// Pages probed by a non-blocking read where neither `cachestat` nor
/// `mincore` can tell.
const PROBES: u64 = 16;

/// What tells a file changed under the same name: its size and its
/// modification and change times (nanoseconds: a truncation or a write
/// sets both; Linux gives a changed file a later time than any it reported
/// before, even within one clock tick, on filesystems with multigrain
/// timestamps).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Stamp {
    len: u64,
    modified: (i64, i64),
    changed: (i64, i64),
}

impl Stamp {
    fn of(meta: &std::fs::Metadata) -> Stamp {
        use std::os::unix::fs::MetadataExt;
        Stamp {
            len: meta.len(),
            modified: (meta.mtime(), meta.mtime_nsec()),
            changed: (meta.ctime(), meta.ctime_nsec()),
        }
    }
}

/// The error of a read that faulted at `offset`: the file was truncated
/// below it while it was read.
fn truncated(path: &Path, tensor: Option<&str>, offset: u64) -> Error {
    bad(
        path,
        tensor,
        format!(
            "truncated while it was read, or its storage failed (no byte at offset {offset} could be \
             read): it must not change until the checksum ends"
        ),
    )
}

/// `(st_dev, st_ino)`: which file a path named when it was opened.
fn identity(meta: &std::fs::Metadata) -> (u64, u64) {
    use std::os::unix::fs::MetadataExt;
    (meta.dev(), meta.ino())
}

fn page_size() -> usize {
    static PAGE: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    // SAFETY: sysconf has no preconditions; a failure (-1) falls back to 4 KiB.
    *PAGE.get_or_init(|| usize::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) }).unwrap_or(4096))
}

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
const RESIDENT_BYTES: usize = 8 * CHUNK_BYTES;
const MIN_CHUNK_BYTES: usize = 1 << 20;

/// Read-ahead requested for all lanes together; each lane's share is
/// [`READ_AHEAD_BYTES`] at 8 lanes, less with more (so the disk sees the
/// same depth of requests), never under a quarter of it.
const READ_AHEAD_TOTAL_BYTES: usize = 8 * READ_AHEAD_BYTES;

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
struct MappedTensor<'a> {
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
    fn new(file: &'a CheckpointFile, t: &TensorEntry, windows: Windows) -> MappedTensor<'a> {
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
struct Windows {
    chunk: usize,
    read_ahead: usize,
}

impl Windows {
    fn for_streams(streams: usize) -> Windows {
        let streams = streams.max(1);
        let page = page_size();
        let chunk = (RESIDENT_BYTES / streams).clamp(MIN_CHUNK_BYTES, CHUNK_BYTES) / page * page;
        let read_ahead = (READ_AHEAD_TOTAL_BYTES / streams).clamp(READ_AHEAD_BYTES / 4, READ_AHEAD_BYTES);
        Windows { chunk, read_ahead }
    }
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
#[path = "checkpoint_tests.rs"]
mod tests;
