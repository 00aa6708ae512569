//! A guard that turns a read past the end of a truncated, mapped file into
//! zeros and a recorded fault, instead of SIGBUS killing the process.
//!
//! A checkpoint is hashed in place through a shared mapping. If another
//! process truncates the file meanwhile (a trainer's `save_file` opens the
//! next step with `"wb"`, which truncates first), every page past the new
//! end stops being backed, and the next read of one raises SIGBUS: the
//! process dies, whatever it was doing. No check before a read can rule
//! that out (the truncation can come between the check and the read), so
//! the fault itself is caught:
//!
//! * every mapping that is read is [registered](Registration::new) with
//!   its address range, in a fixed table a signal handler can read
//!   (atomics only, no allocation, no lock; each slot behind a sequence
//!   number, so that a handler never takes a range half written by a
//!   registration or a drop on another thread for a live one);
//! * a process-wide SIGBUS handler looks the faulting address up; inside a
//!   registered range it maps anonymous zero pages over the rest of that
//!   range (one `mmap(MAP_FIXED)`, so each lane faults at most once),
//!   records the lowest faulting offset and returns: the read that faulted
//!   is restarted by the CPU and reads zeros;
//! * the reader asks [`Registration::fault`] as it goes and at the end, and
//!   reports an error naming the file and the tensor: digests of those
//!   zeros are never returned.
//!
//! A fault anywhere else is not ours: the handler calls the handler that
//! was there before in place (Python's `faulthandler` dumps the traceback),
//! then makes the default action the disposition, so the fault kills the
//! process with SIGBUS as it would have without this guard. Calling it in
//! place, once, rather than putting it back: `faulthandler`, enabled after
//! this guard and then displaced by it, saved this guard as *its* previous
//! handler, and the two handing the fault to each other dumped again and
//! again until the stack overflowed (or spun for ever once `faulthandler`
//! was disabled). The handler is installed lazily, when the first mapping is
//! registered, and installed again by a later registration if something
//! replaced it since. (A previous handler that recovers from a SIGBUS of its
//! own, as this guard does, is called but loses its later faults to the
//! default action.)

use std::sync::atomic::{AtomicU8, AtomicUsize, Ordering};
use std::sync::Mutex;

/// Mappings guarded at once. Each open checkpoint file takes one for as
/// long as it is open (every shard of a checkpoint is open during its
/// run); a file that finds none free is refused with an error (see
/// `CheckpointFile::open`), never read unguarded. Linux allows 65,530
/// mappings a process by default (`vm.max_map_count`); the table is in
/// zero pages until used, and a fault scans it once.
pub const SLOTS: usize = 1 << 16;

const FREE: u8 = 0;
const BUSY: u8 = 1;
const ACTIVE: u8 = 2;

struct Slot {
    /// Odd while `start`/`end`/`state` are being changed (a seqlock: the
    /// handler reads it before and after the range and skips the slot
    /// where it is odd or moved).
    sequence: AtomicUsize,
    state: AtomicU8,
    start: AtomicUsize,
    /// One past the last byte of the mapping, rounded up to a page.
    end: AtomicUsize,
    /// `usize::MAX - ` the lowest faulting offset from `start`; 0: none
    /// (so that the whole table starts as zeros: in `.bss`, not 2.6 MB of
    /// the library's data).
    fault: AtomicUsize,
}

#[allow(clippy::declare_interior_mutable_const)] // the array's initialiser: each slot is its own
const EMPTY: Slot = Slot {
    sequence: AtomicUsize::new(0),
    state: AtomicU8::new(FREE),
    start: AtomicUsize::new(0),
    end: AtomicUsize::new(0),
    fault: AtomicUsize::new(0),
};

static TABLE: [Slot; SLOTS] = [EMPTY; SLOTS];

/// The page size, read before the handler can run (sysconf is not
/// async-signal-safe).
static PAGE: AtomicUsize = AtomicUsize::new(4096);

/// The disposition found when the handler was last installed, which a
/// fault that is not ours is handed back to. Written only under
/// [`INSTALL`] while our handler is not the installed one.
struct Previous(std::cell::UnsafeCell<std::mem::MaybeUninit<libc::sigaction>>);
// SAFETY: written only under `INSTALL` before the handler that reads it is
// installed (sigaction is a full barrier for the thread that then faults
// into it); read only by the handler.
unsafe impl Sync for Previous {}
static PREVIOUS: Previous = Previous(std::cell::UnsafeCell::new(std::mem::MaybeUninit::zeroed()));
static INSTALL: Mutex<()> = Mutex::new(());

/// A guarded mapping: faults inside it are recorded, not fatal, until this
/// is dropped (which must happen before the mapping is unmapped, so that a
/// later mapping at the same address is never taken for it).
#[derive(Debug)]
pub struct Registration {
    slot: usize,
}

impl Registration {
    /// Guards `len` bytes mapped at `start`; `None` where every slot is
    /// taken (the caller then must not read the mapping) or the handler
    /// cannot be installed.
    pub fn new(start: *const u8, len: usize) -> Option<Registration> {
        if len == 0 || !install() {
            return None;
        }
        let page = PAGE.load(Ordering::Relaxed);
        let start = start as usize;
        let end = (start.checked_add(len)?).checked_next_multiple_of(page)?;
        for (i, slot) in TABLE.iter().enumerate() {
            if slot
                .state
                .compare_exchange(FREE, BUSY, Ordering::Acquire, Ordering::Relaxed)
                .is_ok()
            {
                // The slot is ours (BUSY): only we write it; the sequence
                // tells a handler on another thread not to trust it meanwhile.
                slot.sequence.fetch_add(1, Ordering::AcqRel);
                slot.start.store(start, Ordering::Relaxed);
                slot.end.store(end, Ordering::Relaxed);
                slot.fault.store(0, Ordering::Relaxed);
                slot.state.store(ACTIVE, Ordering::Relaxed);
                slot.sequence.fetch_add(1, Ordering::Release);
                return Some(Registration { slot: i });
            }
        }
        None
    }

    /// The lowest offset into the mapping at which a read faulted (the
    /// file was truncated below it), if any did.
    pub fn fault(&self) -> Option<usize> {
        match TABLE[self.slot].fault.load(Ordering::Acquire) {
            0 => None,
            flipped => Some(usize::MAX - flipped),
        }
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        let slot = &TABLE[self.slot];
        slot.sequence.fetch_add(1, Ordering::AcqRel);
        slot.state.store(BUSY, Ordering::Relaxed);
        slot.start.store(0, Ordering::Relaxed);
        slot.end.store(0, Ordering::Relaxed);
        slot.sequence.fetch_add(1, Ordering::Release);
        slot.state.store(FREE, Ordering::Release);
    }
}

/// Installs the handler unless it is the one installed; false if the
/// system refuses.
fn install() -> bool {
    let _lock = INSTALL.lock().unwrap_or_else(|e| e.into_inner());
    // SAFETY: sysconf has no preconditions; -1 (unknown) keeps 4 KiB.
    if let Ok(page) = usize::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) }) {
        if page.is_power_of_two() {
            PAGE.store(page, Ordering::Relaxed);
        }
    }
    // SAFETY: a zeroed sigaction is a valid value of that plain C struct;
    // sigaction with a null new action only reads the current one into it.
    let mut current: libc::sigaction = unsafe { std::mem::zeroed() };
    if unsafe { libc::sigaction(libc::SIGBUS, std::ptr::null(), &mut current) } != 0 {
        return false;
    }
    let ours = on_sigbus as extern "C" fn(libc::c_int, *mut libc::siginfo_t, *mut libc::c_void) as usize;
    if current.sa_sigaction == ours {
        return true;
    }
    // SAFETY: our handler is not installed, so it does not read PREVIOUS
    // now (one that was entered before a replacement has finished: the
    // process was either killed or returned); INSTALL serialises writers.
    unsafe { (*PREVIOUS.0.get()).write(current) };
    let mut action: libc::sigaction = unsafe { std::mem::zeroed() };
    action.sa_sigaction = ours;
    // SA_ONSTACK: run on the thread's alternate stack where one is set up
    // (Python's faulthandler sets one); SA_SIGINFO: we need the address.
    action.sa_flags = libc::SA_SIGINFO | libc::SA_ONSTACK;
    // SAFETY: an empty mask is a valid mask; the handler only uses atomics
    // and sigaction and raise (async-signal-safe by POSIX) and mmap (not on
    // POSIX's list, but a plain system call on Linux, where this runs: no
    // lock or allocation in the C library is taken).
    unsafe {
        libc::sigemptyset(&mut action.sa_mask);
        libc::sigaction(libc::SIGBUS, &action, std::ptr::null_mut()) == 0
    }
}

extern "C" fn on_sigbus(signal: libc::c_int, info: *mut libc::siginfo_t, context: *mut libc::c_void) {
    // SAFETY: the kernel passes a valid siginfo (SA_SIGINFO); errno is the
    // interrupted code's and is put back before returning. PREVIOUS was
    // written (initialised) before this handler was installed; a handler
    // address it holds is a function of that kind (SA_SIGINFO says which),
    // called with the arguments the kernel gave us, as the kernel would.
    unsafe {
        let errno = *libc::__errno_location();
        if !info.is_null() && (*info).si_code > 0 && recover((*info).si_addr() as usize) {
            *libc::__errno_location() = errno;
            return;
        }
        // Not ours (or the zero pages could not be mapped): the handler
        // that was there before runs in place, once, then the default
        // action is the disposition: a fault repeats when we return and
        // kills the process with SIGBUS; a SIGBUS sent by kill() or raise()
        // is sent again (pending until we return: SIGBUS is blocked in here).
        let previous = (*PREVIOUS.0.get()).assume_init_ref();
        let handler = previous.sa_sigaction;
        if handler != libc::SIG_DFL && handler != libc::SIG_IGN {
            if previous.sa_flags & libc::SA_SIGINFO != 0 {
                let call: extern "C" fn(libc::c_int, *mut libc::siginfo_t, *mut libc::c_void) =
                    std::mem::transmute(handler);
                call(signal, info, context);
            } else {
                let call: extern "C" fn(libc::c_int) = std::mem::transmute(handler);
                call(signal);
            }
        }
        let mut default: libc::sigaction = std::mem::zeroed();
        default.sa_sigaction = libc::SIG_DFL;
        libc::sigaction(libc::SIGBUS, &default, std::ptr::null_mut());
        if info.is_null() || (*info).si_code <= 0 {
            libc::raise(signal);
        }
        *libc::__errno_location() = errno;
    }
}

/// Maps zeros from the faulting page to the end of the registered mapping
/// that holds `address`, and records the fault; false if no registered
/// mapping holds it.
fn recover(address: usize) -> bool {
    let page = PAGE.load(Ordering::Relaxed);
    for slot in &TABLE {
        // A consistent snapshot of the slot or none: the sequence is even
        // and unchanged across the reads (a registration or a drop on
        // another thread makes it odd, then moves it on).
        let before = slot.sequence.load(Ordering::Acquire);
        if before % 2 == 1 {
            continue;
        }
        let active = slot.state.load(Ordering::Relaxed) == ACTIVE;
        let (start, end) = (slot.start.load(Ordering::Relaxed), slot.end.load(Ordering::Relaxed));
        std::sync::atomic::fence(Ordering::Acquire);
        if !active || slot.sequence.load(Ordering::Relaxed) != before || !(start..end).contains(&address) {
            continue;
        }
        let from = address & !(page - 1);
        // SAFETY: [from, end) lies inside a live mapping of ours: the
        // snapshot above is consistent (the sequence), and a mapping stays
        // registered until it is dropped, which happens only after every
        // read of it has ended (the faulting read is one of them):
        // replacing those pages with private zero pages changes only what
        // our own reads of a truncated file see, and munmap of the original
        // range later removes them with it.
        let mapped = unsafe {
            libc::mmap(
                from as *mut libc::c_void,
                end - from,
                libc::PROT_READ,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED,
                -1,
                0,
            )
        };
        if mapped == libc::MAP_FAILED {
            return false;
        }
        slot.fault.fetch_max(usize::MAX - (address - start), Ordering::AcqRel);
        return true;
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    /// A mapped file truncated under a reader: the read gives zeros and a
    /// recorded fault, and the process lives.
    #[test]
    fn a_read_past_a_truncated_end_is_recorded_not_fatal() {
        let dir = std::env::temp_dir().join(format!("wc-fault-guard-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("f.bin");
        let mut f = std::fs::File::create(&path).unwrap();
        f.write_all(&vec![7u8; 1 << 20]).unwrap();
        drop(f);
        let file = std::fs::File::open(&path).unwrap();
        // SAFETY: a test mapping, truncated below on purpose.
        let map = unsafe { memmap2::Mmap::map(&file) }.unwrap();
        let guard = Registration::new(map.as_ptr(), map.len()).unwrap();
        assert_eq!(map[100_000], 7);
        std::fs::OpenOptions::new()
            .write(true)
            .open(&path)
            .unwrap()
            .set_len(65536)
            .unwrap();
        let sum: u64 = map[70_000..].iter().map(|&b| u64::from(b)).sum();
        assert_eq!(sum, 0);
        assert_eq!(guard.fault(), Some(70_000), "the first byte read past the new end");
        assert_eq!(map[1000], 7, "the bytes before the new end are the file's");
        drop(guard);
        drop(map);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// Faults while other threads register and drop slots (the seqlock):
    /// each fault is recorded in its own mapping's slot, never elsewhere.
    #[test]
    fn faults_land_in_their_own_slot_while_others_churn() {
        use std::sync::atomic::AtomicBool;
        use std::sync::Arc;

        let dir = std::env::temp_dir().join(format!("wc-fault-churn-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let other = dir.join("other.bin");
        std::fs::write(&other, vec![1u8; 1 << 16]).unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let churn: Vec<_> = (0..2)
            .map(|_| {
                let (stop, other) = (stop.clone(), other.clone());
                std::thread::spawn(move || {
                    let file = std::fs::File::open(&other).unwrap();
                    // SAFETY: a test mapping of a file nobody changes.
                    let map = unsafe { memmap2::Mmap::map(&file) }.unwrap();
                    while !stop.load(Ordering::Relaxed) {
                        let guard = Registration::new(map.as_ptr(), map.len()).unwrap();
                        assert_eq!(guard.fault(), None);
                        drop(guard);
                    }
                })
            })
            .collect();
        for round in 0..50 {
            let path = dir.join(format!("f{round}.bin"));
            std::fs::write(&path, vec![3u8; 1 << 18]).unwrap();
            let file = std::fs::File::open(&path).unwrap();
            // SAFETY: a test mapping, truncated below on purpose.
            let map = unsafe { memmap2::Mmap::map(&file) }.unwrap();
            let guard = Registration::new(map.as_ptr(), map.len()).unwrap();
            std::fs::OpenOptions::new()
                .write(true)
                .open(&path)
                .unwrap()
                .set_len(0)
                .unwrap();
            assert_eq!(map[4096 * 10], 0);
            assert_eq!(guard.fault(), Some(4096 * 10));
            drop(guard);
            drop(map);
        }
        stop.store(true, Ordering::Relaxed);
        churn.into_iter().for_each(|t| t.join().unwrap());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
