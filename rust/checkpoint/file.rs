//! An opened checkpoint file ([`CheckpointFile`]): its tensors and its
//! read-only mapping, guarded against a truncation, and the checks that its
//! path still names the file that was opened, unchanged (at the end of a
//! run, and when the read path opens it again).

use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::Mmap;

use super::{bad, parse_header, TensorEntry};
use crate::error::Error;
use crate::fault_guard::{self, Registration};

/// An opened checkpoint file: its tensors and a read-only shared mapping
/// (see [`CheckpointFile::open`]).
pub struct CheckpointFile {
    pub path: PathBuf,
    pub tensors: Vec<TensorEntry>,
    /// Faults of reads past a truncated end, recorded instead of SIGBUS
    /// (see [`fault_guard`]). Declared before `map`: dropped before the
    /// mapping is unmapped.
    guard: Registration,
    /// The whole file, mapped: hashed by the mapped path and asked about by
    /// the residency queries (`mapped.rs`, `residency.rs`).
    pub(super) map: Mmap,
    /// `(st_dev, st_ino)` of the file the mapping was made from: the read
    /// path ([`cold`](super::cold)) opens it again by path and checks it is
    /// the same file. No descriptor is kept open (a checkpoint of more
    /// shards than the open-file limit maps as it always did).
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
        let parsed = parse_guarded(path, &map, &guard);
        Ok(CheckpointFile {
            path: path.to_path_buf(),
            tensors: parsed?,
            guard,
            map,
            identity: identity(&meta),
            stamp: Stamp::of(&meta),
        })
    }

    /// What holds byte `offset` of the file: the header (before the first
    /// tensor's data), a tensor, or data no tensor describes.
    fn place_of(&self, offset: u64) -> Place<'_> {
        let data_start = self.tensors.iter().map(|t| t.start).min().unwrap_or(u64::MAX);
        if offset < data_start {
            return Place::Header;
        }
        let i = self.tensors.partition_point(|t| t.end <= offset);
        match self.tensors.get(i).filter(|t| t.start <= offset) {
            Some(t) => Place::Tensor(&t.name),
            None => Place::Data,
        }
    }

    /// An error if a read of the mapping faulted (the file was truncated
    /// while it was read), naming where: its header, or the tensor.
    pub(super) fn fault_error(&self) -> Option<Error> {
        let offset = self.guard.fault()? as u64;
        Some(truncated(&self.path, self.place_of(offset), offset))
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
}

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

/// Parses the header of a guarded mapping. A read of it that faulted (the
/// file truncated after it was opened, before or while its header was
/// read) is that error, naming the header: the bytes parsed were the
/// guard's zeros, whatever the parse made of them.
pub(super) fn parse_guarded(path: &Path, map: &[u8], guard: &Registration) -> Result<Vec<TensorEntry>, Error> {
    let parsed = parse_header(path, map);
    match guard.fault() {
        Some(offset) => Err(truncated(path, Place::Header, offset as u64)),
        None => parsed,
    }
}

/// Where in a file a read failed: every error of a truncation says which
/// part was being read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Place<'a> {
    /// The 8-byte length and the JSON header before the tensor data.
    Header,
    /// One tensor's bytes.
    Tensor(&'a str),
    /// Bytes after the header that no tensor describes (a valid file has
    /// none; kept so that no fault goes unplaced).
    Data,
}

/// The error of a read that faulted at `offset`: the file was truncated
/// below it while it was read. Names the part being read.
pub(super) fn truncated(path: &Path, place: Place<'_>, offset: u64) -> Error {
    let (tensor, what) = match place {
        Place::Header => (None, "its header: "),
        Place::Tensor(name) => (Some(name), ""),
        Place::Data => (None, "its data: "),
    };
    bad(
        path,
        tensor,
        format!(
            "{what}truncated while it was read, or its storage failed (no byte at offset {offset} could be \
             read): it must not change until the checksum ends"
        ),
    )
}

/// `(st_dev, st_ino)`: which file a path named when it was opened.
fn identity(meta: &std::fs::Metadata) -> (u64, u64) {
    use std::os::unix::fs::MetadataExt;
    (meta.dev(), meta.ino())
}
