//! How much of a checkpoint file the page cache holds, asked without
//! reading it: what [`ReadMode::Auto`](super::ReadMode::Auto) chooses the
//! mapping or the read path by.

use super::{page_size, CheckpointFile};

/// A file with at least this fraction of its data in the page cache is
/// hashed through its mapping
/// ([`ReadMode::Auto`](super::ReadMode::Auto)); one with less is read.
pub const CACHED_FRACTION: f64 = 0.75;

/// Pages probed by a non-blocking read where neither `cachestat` nor
/// `mincore` can tell.
const PROBES: u64 = 16;

impl CheckpointFile {
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
}
