//! A hasher on a thread of its own, at Linux's idle scheduling policy, for
//! work that may use only the time the rest of the process leaves idle.
//!
//! The caller queues buffers ([`Background::submit`]) while it does other
//! work, and collects their digests later ([`Background::take_digests`]).
//! The thread hashes them in runs of about `run_bytes` on itself alone,
//! waiting between two steps while foreground work runs
//! ([`crate::scheduler::foreground`]); [`Background::close`] drops what is
//! queued and stops the run under way at its next step.
//!
//! The thread is Rust's and never runs Python. A thread at the idle policy
//! on a host whose cores other processes keep busy may wait seconds to run
//! again; one that held Python's GIL when it was preempted would make every
//! Python thread of the process wait that long. This one holds nothing a
//! caller needs between its runs: jobs and digests travel through channels,
//! and what keeps a buffer alive (its owner) goes back to the caller with
//! its digest, to be dropped where the caller may drop it.

use std::collections::VecDeque;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{channel, Receiver, Sender, TryRecvError};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
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

/// The background hasher (see the module docs).
pub struct Background<O: Send + 'static> {
    jobs: Mutex<Option<Sender<Job<O>>>>,
    done: Mutex<Receiver<Done<O>>>,
    shared: Arc<Shared>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

/// What the thread and its owner both see: atomics, and a flag the thread
/// sets once, when it has let go of every job.
struct Shared {
    cancelled: Arc<AtomicBool>,
    /// Jobs submitted and not yet given back.
    pending: AtomicUsize,
    hashed_bytes: AtomicU64,
    /// The thread's id (Linux `gettid`), 0 until it runs.
    thread_id: AtomicU64,
    /// Whether the thread runs at the idle policy (else it hashes nothing).
    refused: AtomicBool,
    ended: (Mutex<bool>, Condvar),
}

impl<O: Send + 'static> Background<O> {
    /// Starts the thread. Where the idle policy is refused (or missing: not
    /// Linux), it hashes nothing: every job comes back without a digest.
    pub fn start(run_bytes: usize) -> std::io::Result<Background<O>> {
        let (jobs, jobs_rx) = channel::<Job<O>>();
        let (done_tx, done) = channel::<Done<O>>();
        let shared = Arc::new(Shared {
            cancelled: Arc::new(AtomicBool::new(false)),
            pending: AtomicUsize::new(0),
            hashed_bytes: AtomicU64::new(0),
            thread_id: AtomicU64::new(0),
            refused: AtomicBool::new(false),
            ended: (Mutex::new(false), Condvar::new()),
        });
        let for_thread = shared.clone();
        let thread = std::thread::Builder::new()
            .name("weight-checker-idle-hashing".into())
            .spawn(move || {
                /// Tells the owner the thread let go of everything, also on a panic.
                struct Ended(Arc<Shared>);
                impl Drop for Ended {
                    fn drop(&mut self) {
                        let (lock, ended) = &self.0.ended;
                        *lock.lock().unwrap_or_else(|e| e.into_inner()) = true;
                        ended.notify_all();
                    }
                }
                let _ended = Ended(for_thread.clone());
                run(&for_thread, &jobs_rx, &done_tx, run_bytes.max(1));
            })?;
        Ok(Background {
            jobs: Mutex::new(Some(jobs)),
            done: Mutex::new(done),
            shared,
            thread: Mutex::new(Some(thread)),
        })
    }

    /// Queues jobs, in order. After [`close`](Self::close) they are dropped
    /// here; where the host refused the idle policy they come back undigested.
    pub fn submit(&self, jobs: impl IntoIterator<Item = Job<O>>) {
        let sender = self.jobs.lock().unwrap_or_else(|e| e.into_inner());
        for job in jobs {
            match sender.as_ref() {
                Some(s) => {
                    self.shared.pending.fetch_add(1, Ordering::SeqCst);
                    if let Err(returned) = s.send(job) {
                        // The thread has ended (it panicked): nothing is hashed.
                        self.shared.pending.fetch_sub(1, Ordering::SeqCst);
                        drop(returned);
                    }
                }
                None => drop(job),
            }
        }
    }

    /// The jobs finished since the last call, in the order they finished.
    pub fn take_digests(&self) -> Vec<Done<O>> {
        let done = self.done.lock().unwrap_or_else(|e| e.into_inner());
        let mut out = Vec::new();
        loop {
            match done.try_recv() {
                Ok(d) => out.push(d),
                Err(TryRecvError::Empty | TryRecvError::Disconnected) => return out,
            }
        }
    }

    /// Whether nothing is queued or being hashed: every job submitted has
    /// been given back, or the thread has ended (after a close).
    pub fn idle(&self) -> bool {
        self.shared.pending.load(Ordering::SeqCst) == 0
            || *self.shared.ended.0.lock().unwrap_or_else(|e| e.into_inner())
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

    /// Nothing more is hashed: the queue is dropped and the run under way
    /// stops at its next step. Returns at once; [`wait`](Self::wait) waits
    /// for the thread to let go of the jobs' owners.
    pub fn close(&self) {
        self.shared.cancelled.store(true, Ordering::SeqCst);
        drop(self.jobs.lock().unwrap_or_else(|e| e.into_inner()).take());
    }

    /// After [`close`](Self::close): waits up to `timeout` for the thread to
    /// end; whether it did. Every owner it held is then dropped or given back.
    pub fn wait(&self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        let (lock, ended) = &self.shared.ended;
        let mut done = lock.lock().unwrap_or_else(|e| e.into_inner());
        while !*done {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            done = ended.wait_timeout(done, left).unwrap_or_else(|e| e.into_inner()).0;
        }
        drop(done);
        if let Some(thread) = self.thread.lock().unwrap_or_else(|e| e.into_inner()).take() {
            let _ = thread.join(); // ended: returns at once
        }
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
/// its bytes alive (attached to Python, for a Python owner).
fn run<O: Send>(shared: &Shared, jobs: &Receiver<Job<O>>, done: &Sender<Done<O>>, run_bytes: usize) {
    shared.thread_id.store(this_thread_id(), Ordering::SeqCst);
    let mut waiting: VecDeque<Job<O>> = VecDeque::new();
    if !set_idle_policy() {
        shared.refused.store(true, Ordering::SeqCst);
        shared.cancelled.store(true, Ordering::SeqCst);
    }
    loop {
        if waiting.is_empty() {
            match jobs.recv() {
                Ok(job) => waiting.push_back(job),
                Err(_) => return, // closed, and every job given back
            }
        }
        while let Ok(job) = jobs.try_recv() {
            waiting.push_back(job);
        }
        let mut batch = Vec::new();
        let mut bytes = 0usize;
        if shared.cancelled.load(Ordering::SeqCst) {
            batch.extend(waiting.drain(..)); // given back undigested
        }
        while let Some(job) = waiting.front() {
            if !batch.is_empty() && bytes >= run_bytes {
                break;
            }
            bytes += job.len;
            batch.extend(waiting.pop_front());
        }
        let digests = if shared.cancelled.load(Ordering::SeqCst) {
            None
        } else {
            hash(shared, &batch)
        };
        if digests.is_some() {
            shared.hashed_bytes.fetch_add(bytes as u64, Ordering::SeqCst);
        }
        let n = batch.len();
        for (i, job) in batch.into_iter().enumerate() {
            let digest = digests.as_ref().map(|d| d[i]);
            // An owner that is gone stopped listening: the job is dropped here then.
            let _ = done.send(Done {
                id: job.id,
                digest,
                owner: job.owner,
            });
        }
        shared.pending.fetch_sub(n, Ordering::SeqCst);
    }
}

/// One run on this thread alone; `None` if it was stopped, failed or panicked.
fn hash<O>(shared: &Shared, batch: &[Job<O>]) -> Option<Vec<Digest>> {
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
            assert!(done.is_empty());
            return; // a host without the idle policy: nothing to check
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
}
