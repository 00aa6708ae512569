//! A hasher on a thread of its own, at Linux's idle scheduling policy, for
//! work that may use only the time the rest of the process leaves idle.
//!
//! The caller queues buffers ([`Background::submit`]) while it does other
//! work, and collects their digests later ([`Background::take_digests`]).
//! The thread hashes them in runs of about `run_bytes` on itself alone,
//! waiting between two steps while foreground work runs
//! ([`crate::scheduler::foreground`]); [`Background::close`] stops the run
//! under way at its next step, and what was queued comes back undigested.
//!
//! The thread is Rust's and never runs Python. A thread at the idle policy
//! on a host whose cores other processes keep busy may wait seconds to run
//! again; one that held Python's GIL when it was preempted would make every
//! Python thread of the process wait that long. For the same reason a
//! caller never blocks on anything the thread holds: it only *tries* the
//! two queues they share (a busy one is tried again at the next call), wakes
//! the thread with `unpark`, and reads atomics. What keeps a buffer alive
//! (its owner) goes back to the caller with its digest, to be dropped where
//! the caller may drop it (attached to Python, for a Python owner).

use std::collections::VecDeque;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, TryLockError};
use std::thread::{JoinHandle, Thread};
use std::time::{Duration, Instant};

use crate::scheduler::{in_background, Scheduler, Slices};
use crate::sha256::Digest;

/// One buffer to hash: its bytes, and `owner`, whatever keeps them alive.
pub struct Job<O> {
    pub id: u64,
    ptr: *const u8,
    len: usize,
    owner: O,
}

// SAFETY: a job is moved to the hasher's thread, which only reads
// `ptr..ptr+len` while the job (and so `owner`, which keeps the bytes alive
// and is itself `Send`) exists; `Job::new`'s caller promised that.
unsafe impl<O: Send> Send for Job<O> {}

impl<O> Job<O> {
    /// # Safety
    /// `ptr..ptr+len` must be readable, and must not be written or freed,
    /// for as long as `owner` is alive (`len` may be 0).
    pub unsafe fn new(id: u64, ptr: *const u8, len: usize, owner: O) -> Job<O> {
        Job { id, ptr, len, owner }
    }

    fn bytes(&self) -> &[u8] {
        if self.len == 0 {
            return &[];
        }
        // SAFETY: readable and unchanged while `self.owner` lives (`new`'s
        // contract); the slice borrows `self`, which holds the owner.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

/// A finished job: its digest (`None` if its run was stopped or failed),
/// and its owner, given back.
pub struct Done<O> {
    pub id: u64,
    pub digest: Option<Digest>,
    pub owner: O,
}

/// How often a caller tries the thread's queue before it leaves the jobs
/// for its next call (see [`Background::hand_over`]).
const HAND_OVER_TRIES: usize = 256;

/// The background hasher (see the module docs).
pub struct Background<O: Send + 'static> {
    shared: Arc<Shared<O>>,
    /// Jobs submitted while the thread held the queue: queued by a later
    /// call. Only callers take this lock.
    held_back: Mutex<Vec<Job<O>>>,
    waker: Thread,
    /// Kept while it runs; dropped (detached), never joined, once it ended.
    thread: Mutex<Option<JoinHandle<()>>>,
}

/// What the thread and its owner share. The owner only tries the two
/// locks; the thread takes them as it needs (it may wait for a caller).
struct Shared<O> {
    cancelled: Arc<AtomicBool>,
    queue: Mutex<VecDeque<Job<O>>>,
    done: Mutex<Vec<Done<O>>>,
    /// Jobs submitted and not yet given back.
    pending: AtomicUsize,
    hashed_bytes: AtomicU64,
    /// The thread's id (Linux `gettid`), 0 until it runs.
    thread_id: AtomicU64,
    /// Whether the host refused the idle policy (nothing is hashed then).
    refused: AtomicBool,
    /// Set once, when the thread has given back every job it took.
    ended: AtomicBool,
    /// What [`Background::wait`] sleeps on.
    ended_signal: (Mutex<()>, Condvar),
}

/// `lock`, also after a panic elsewhere (the data stay consistent: every
/// critical section here only moves jobs between containers).
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// `try_lock`: `None` while someone else holds it.
fn try_lock<T>(m: &Mutex<T>) -> Option<MutexGuard<'_, T>> {
    match m.try_lock() {
        Ok(guard) => Some(guard),
        Err(TryLockError::Poisoned(e)) => Some(e.into_inner()),
        Err(TryLockError::WouldBlock) => None,
    }
}

impl<O: Send + 'static> Background<O> {
    /// Starts the thread. Where the idle policy is refused (or missing: not
    /// Linux), it hashes nothing: every job comes back without a digest.
    pub fn start(run_bytes: usize) -> std::io::Result<Background<O>> {
        Background::start_with(run_bytes, set_idle_policy)
    }

    /// [`start`](Self::start), with `set_policy` putting the thread at the
    /// idle policy (whether the host allowed it).
    fn start_with(run_bytes: usize, set_policy: fn() -> bool) -> std::io::Result<Background<O>> {
        // The calibrations, measured once a process, are measured here if
        // they were not yet: never on the idle thread (at that policy, with
        // every other thread that hashes waiting for them).
        if let Ok(scheduler) = Scheduler::from_env() {
            let _ = scheduler.kernel.small_message_lanes();
            let _ = scheduler.kernel.wide_stream_rates();
        }
        let shared = Arc::new(Shared {
            cancelled: Arc::new(AtomicBool::new(false)),
            queue: Mutex::new(VecDeque::new()),
            done: Mutex::new(Vec::new()),
            pending: AtomicUsize::new(0),
            hashed_bytes: AtomicU64::new(0),
            thread_id: AtomicU64::new(0),
            refused: AtomicBool::new(false),
            ended: AtomicBool::new(false),
            ended_signal: (Mutex::new(()), Condvar::new()),
        });
        let for_thread = shared.clone();
        let thread = std::thread::Builder::new()
            .name("weight-checker-idle-hashing".into())
            .spawn(move || {
                /// Tells the owner the thread let go of everything, also on a panic.
                struct Ended<O>(Arc<Shared<O>>);
                impl<O> Drop for Ended<O> {
                    fn drop(&mut self) {
                        self.0.ended.store(true, Ordering::SeqCst);
                        let (signal, ended) = &self.0.ended_signal;
                        drop(lock(signal)); // a waiter between its check and its wait is not missed
                        ended.notify_all();
                    }
                }
                let ended = Ended(for_thread);
                run(&ended.0, run_bytes.max(1), set_policy);
            })?;
        Ok(Background {
            shared,
            held_back: Mutex::new(Vec::new()),
            waker: thread.thread().clone(),
            thread: Mutex::new(Some(thread)),
        })
    }

    /// Queues jobs, in order. After [`close`](Self::close) they are dropped
    /// here; where the host refused the idle policy they come back undigested.
    pub fn submit(&self, jobs: impl IntoIterator<Item = Job<O>>) {
        if self.shared.cancelled.load(Ordering::SeqCst) {
            return; // the jobs, and their owners, dropped here
        }
        let mut held = lock(&self.held_back);
        for job in jobs {
            self.shared.pending.fetch_add(1, Ordering::SeqCst);
            held.push(job);
        }
        self.hand_over(&mut held);
    }

    /// Moves the held-back jobs to the thread's queue. The thread holds the
    /// queue only to move jobs (well under a microsecond): a busy queue is
    /// tried again a few times, yielding between tries. If it stays busy
    /// the thread was preempted holding it, and a later call hands them over.
    fn hand_over(&self, held: &mut Vec<Job<O>>) {
        if held.is_empty() {
            return;
        }
        for _ in 0..HAND_OVER_TRIES {
            if let Some(mut queue) = try_lock(&self.shared.queue) {
                queue.extend(held.drain(..));
                drop(queue);
                self.waker.unpark();
                return;
            }
            std::thread::yield_now();
        }
    }

    /// The jobs finished since the last call, in the order they finished
    /// (none while the thread is handing some back: they come next time).
    pub fn take_digests(&self) -> Vec<Done<O>> {
        self.hand_over(&mut lock(&self.held_back));
        try_lock(&self.shared.done)
            .map(|mut d| std::mem::take(&mut *d))
            .unwrap_or_default()
    }

    /// Whether nothing is queued or being hashed: every job submitted has
    /// been given back, or the thread has ended (after a close).
    pub fn idle(&self) -> bool {
        self.hand_over(&mut lock(&self.held_back)); // jobs held back would never count as done
        self.shared.pending.load(Ordering::SeqCst) == 0 || self.shared.ended.load(Ordering::SeqCst)
    }

    /// Bytes hashed so far.
    pub fn hashed_bytes(&self) -> u64 {
        self.shared.hashed_bytes.load(Ordering::SeqCst)
    }

    /// The thread's id (Linux `gettid`), once it runs; `None` before.
    pub fn thread_id(&self) -> Option<u64> {
        match self.shared.thread_id.load(Ordering::SeqCst) {
            0 => None,
            id => Some(id),
        }
    }

    /// Whether the host refused the idle policy (nothing is hashed then).
    pub fn refused(&self) -> bool {
        self.shared.refused.load(Ordering::SeqCst)
    }

    /// Nothing more is hashed: the run under way stops at its next step,
    /// and every job not hashed comes back undigested
    /// ([`take_digests`](Self::take_digests)). Returns at once;
    /// [`wait`](Self::wait) waits for the thread to give everything back.
    pub fn close(&self) {
        self.shared.cancelled.store(true, Ordering::SeqCst);
        let held: Vec<Job<O>> = std::mem::take(&mut *lock(&self.held_back));
        self.shared.pending.fetch_sub(held.len(), Ordering::SeqCst);
        drop(held); // never handed over: their owners dropped here
        self.waker.unpark();
    }

    /// After [`close`](Self::close): waits up to `timeout` for the thread to
    /// end; whether it did. Every owner it held is then given back.
    pub fn wait(&self, timeout: Duration) -> bool {
        let deadline = Instant::now().checked_add(timeout); // None: no deadline
        let (signal, ended) = &self.shared.ended_signal;
        let mut guard = lock(signal);
        while !self.shared.ended.load(Ordering::SeqCst) {
            let left = match deadline {
                Some(d) => d.saturating_duration_since(Instant::now()),
                None => Duration::from_secs(3600),
            };
            if left.is_zero() {
                return false;
            }
            guard = ended.wait_timeout(guard, left).unwrap_or_else(|e| e.into_inner()).0;
        }
        drop(guard);
        // Not joined: the thread may still be between its last signal and its
        // exit, and at the idle policy it may not run again for a while.
        drop(lock(&self.thread).take());
        true
    }
}

impl<O: Send + 'static> Drop for Background<O> {
    /// Closes; never waits for the thread (at the idle policy it may not run
    /// for a while), which ends on its own and drops what it still holds.
    fn drop(&mut self) {
        self.close();
    }
}

/// The thread: at the idle policy, runs of jobs until closed; then every
/// job not hashed goes back undigested, so that the owner drops what keeps
/// its bytes alive.
fn run<O: Send>(shared: &Shared<O>, run_bytes: usize, set_policy: fn() -> bool) {
    shared.thread_id.store(this_thread_id(), Ordering::SeqCst);
    if !set_policy() {
        shared.refused.store(true, Ordering::SeqCst);
        shared.cancelled.store(true, Ordering::SeqCst);
    }
    loop {
        let cancelled = shared.cancelled.load(Ordering::SeqCst);
        let mut batch = Vec::new();
        let mut bytes = 0usize;
        {
            let mut queue = lock(&shared.queue);
            while let Some(job) = queue.front() {
                if !cancelled && !batch.is_empty() && bytes >= run_bytes {
                    break;
                }
                bytes += job.len;
                batch.extend(queue.pop_front());
            }
        }
        if batch.is_empty() {
            if cancelled {
                return;
            }
            std::thread::park(); // `unpark` before this returns at once
            continue;
        }
        let digests = if cancelled { None } else { hash(shared, &batch) };
        if digests.is_some() {
            shared.hashed_bytes.fetch_add(bytes as u64, Ordering::SeqCst);
        }
        let n = batch.len();
        lock(&shared.done).extend(batch.into_iter().enumerate().map(|(i, job)| Done {
            id: job.id,
            digest: digests.as_ref().map(|d| d[i]),
            owner: job.owner,
        }));
        shared.pending.fetch_sub(n, Ordering::SeqCst);
    }
}

/// One run on this thread alone; `None` if it was stopped, failed or panicked.
fn hash<O>(shared: &Shared<O>, batch: &[Job<O>]) -> Option<Vec<Digest>> {
    let slices: Vec<&[u8]> = batch.iter().map(Job::bytes).collect();
    let sources: Vec<Slices<'_>> = slices.iter().map(std::slice::from_ref).map(Slices::new).collect();
    catch_unwind(AssertUnwindSafe(|| {
        in_background(&shared.cancelled, || Scheduler::default().hash_sources(sources, None))
    }))
    .ok()?
    .ok()
}

#[cfg(target_os = "linux")]
fn this_thread_id() -> u64 {
    // SAFETY: gettid takes no arguments and cannot fail.
    unsafe { libc::gettid() as u64 }
}

#[cfg(not(target_os = "linux"))]
fn this_thread_id() -> u64 {
    0
}

/// Puts this thread (only) at `SCHED_IDLE`; whether the host allowed it.
#[cfg(target_os = "linux")]
fn set_idle_policy() -> bool {
    let param = libc::sched_param { sched_priority: 0 };
    // SAFETY: pid 0 is the calling thread; `param` is a valid sched_param.
    unsafe { libc::sched_setscheduler(0, libc::SCHED_IDLE, &param) == 0 }
}

#[cfg(not(target_os = "linux"))]
fn set_idle_policy() -> bool {
    false
}

#[cfg(test)]
mod tests {
    use super::*;
    use sha2::Digest as _;

    fn job(id: u64, bytes: &Arc<Vec<u8>>) -> Job<Arc<Vec<u8>>> {
        // SAFETY: the Arc owns the bytes, never written, and is the owner.
        unsafe { Job::new(id, bytes.as_ptr(), bytes.len(), bytes.clone()) }
    }

    /// The `sha2` crate's digest: the oracle.
    fn expected(bytes: &[u8]) -> [u8; 32] {
        sha2::Sha256::digest(bytes).into()
    }

    #[test]
    fn digests_every_job_and_gives_its_owner_back() {
        let hasher = Background::start(1 << 20).unwrap();
        let buffers: Vec<Arc<Vec<u8>>> = (0..6u8)
            .map(|i| Arc::new(vec![i; [0, 1, 63, 64, 3 << 20, 5 << 20][i as usize]]))
            .collect();
        hasher.submit(buffers.iter().enumerate().map(|(i, b)| job(i as u64, b)));
        let deadline = Instant::now() + Duration::from_secs(60);
        while !hasher.idle() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        let mut done = hasher.take_digests();
        if hasher.refused() {
            return; // a host without the idle policy: `refused_policy_hashes_nothing` covers it
        }
        done.sort_by_key(|d| d.id);
        assert_eq!(done.len(), 6);
        for d in &done {
            assert_eq!(
                d.digest.map(|g| g.bytes),
                Some(expected(&buffers[d.id as usize])),
                "job {}",
                d.id
            );
        }
        assert_eq!(hasher.hashed_bytes(), (8 << 20) + 128);
        drop(done);
        assert!(buffers.iter().all(|b| Arc::strong_count(b) == 1), "an owner kept");
    }

    #[test]
    fn closing_stops_the_run_and_gives_every_owner_back() {
        let hasher = Background::start(1 << 30).unwrap();
        let big = Arc::new(vec![7u8; 256 << 20]);
        hasher.submit((0..4).map(|i| job(i, &big)));
        hasher.close();
        hasher.submit([job(9, &big)]); // after close: dropped at once
        assert!(hasher.wait(Duration::from_secs(60)));
        assert!(hasher.idle());
        let done = hasher.take_digests();
        let mut ids: Vec<u64> = done.iter().map(|d| d.id).collect();
        ids.sort_unstable();
        assert_eq!(ids, [0, 1, 2, 3], "every job queued before the close comes back");
        for d in &done {
            if let Some(digest) = d.digest {
                assert_eq!(digest.bytes, expected(&big)); // finished before the close
            }
        }
        drop(done);
        assert_eq!(Arc::strong_count(&big), 1, "an owner kept after the thread ended");
    }

    #[test]
    fn a_refused_policy_hashes_nothing_and_gives_every_owner_back() {
        let hasher = Background::start_with(1 << 20, || false).unwrap();
        let bytes = Arc::new(vec![1u8; 1 << 20]);
        hasher.submit((0..3).map(|i| job(i, &bytes)));
        let deadline = Instant::now() + Duration::from_secs(60);
        while !hasher.idle() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        assert!(hasher.refused());
        let done = hasher.take_digests();
        assert!(done.len() <= 3 && done.iter().all(|d| d.digest.is_none()));
        assert_eq!(hasher.hashed_bytes(), 0);
        drop(done);
        assert!(hasher.wait(Duration::MAX), "an unbounded wait");
        drop(hasher.take_digests());
        assert_eq!(Arc::strong_count(&bytes), 1, "an owner kept");
    }
}
