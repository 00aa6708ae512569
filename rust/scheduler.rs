//! The parallel scheduler: many messages, all cores, several streams per core.
//!
//! SHA-256 of one message is one sequential chain, so all parallelism comes
//! from having many messages in flight. The scheduler is a *streaming
//! feeder*: every message is a [`ChunkSource`] that yields its bytes in
//! order, one bounded chunk at a time (a slice of memory, a window of a
//! memory-mapped file, a staged copy). Messages are queued largest first, so
//! one big tensor never starts last and runs alone at the end. Each worker
//! thread keeps `lanes` messages open and advances them together, block for
//! block, through the kernel's multi-stream compression; the moment a message
//! ends (its padding included) its lane takes the next one from the shared
//! queue. So `threads x lanes` messages are in flight at any time, and memory
//! is bounded by that many chunks, whatever the size of the work.
//!
//! Three refinements matter when a few tensors of hundreds of MB make up
//! the work, since one of them then ends the run: the largest are dealt
//! across the threads when taking them in order would put more than a
//! thread's share on the first to start (`Shared::next_task`); a thread
//! holding three messages runs the two with the most bytes left at full
//! two-lane speed rather than all three at two-plus-one (`worker`); and
//! lanes whose addresses alias are moved apart (`dephase`).

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Condvar, Mutex, OnceLock};
use std::time::Duration;

use crate::error::Error;
use crate::sha256::{Digest, Kernel, Sha256, BLOCK_LEN, STEP_BYTES};

/// Environment variable that sets the worker threads of every scheduler in this
/// process (overrides [`set_default_threads`]).
pub const THREADS_ENV: &str = "WEIGHT_CHECKER_THREADS";

/// Below this many bytes in total, threads cost more than they save.
const PARALLEL_MIN_BYTES: u64 = 256 * 1024;

/// A digest slot not yet written (every slot is written before a run returns Ok).
const UNSET: Digest = Digest {
    bytes: [0; 32],
    all_zero: true,
};

/// How often a progress callback is called while a run is in flight.
const PROGRESS_EVERY: Duration = Duration::from_millis(100);

static DEFAULT_THREADS: AtomicUsize = AtomicUsize::new(0);

/// Sets the worker threads an [`Scheduler::default`] uses (0: all cores), unless
/// [`THREADS_ENV`] is set, which always wins. A vLLM worker sets its share of
/// the host here, so that eight workers on one host do not each start one
/// thread per core.
pub fn set_default_threads(threads: usize) {
    DEFAULT_THREADS.store(threads, Ordering::Relaxed);
}

fn env_threads() -> Option<usize> {
    static ENV: OnceLock<Option<usize>> = OnceLock::new();
    *ENV.get_or_init(|| {
        std::env::var(THREADS_ENV)
            .ok()
            .and_then(|v| v.trim().parse::<usize>().ok())
            .filter(|&n| n > 0)
    })
}

/// The worker threads a default scheduler runs: [`THREADS_ENV`], else what
/// [`set_default_threads`] set, else rayon's pool size (the cores in this
/// process's CPU affinity).
pub fn default_threads() -> usize {
    if let Some(n) = env_threads() {
        return n;
    }
    match DEFAULT_THREADS.load(Ordering::Relaxed) {
        0 => rayon::current_num_threads(),
        n => n,
    }
}

/// One message whose bytes arrive in order, a chunk at a time.
///
/// The scheduler calls [`advance`](ChunkSource::advance) to make the first chunk
/// current, reads [`chunk`](ChunkSource::chunk) (possibly over several steps),
/// then calls `advance` again, until it returns `Ok(false)`. A source may
/// reuse or release a chunk's memory once `advance` is called again.
pub trait ChunkSource: Send {
    /// Total bytes of the message: the scheduling order and progress.
    fn total_bytes(&self) -> u64;
    /// The current chunk (empty before the first `advance`).
    fn chunk(&self) -> &[u8];
    /// Done with the current chunk: makes the next one current. `Ok(false)`
    /// when the message has no more bytes; an error stops the whole run.
    fn advance(&mut self) -> Result<bool, Error>;
}

/// A message already in memory, as consecutive slices.
pub struct Slices<'a> {
    chunks: &'a [&'a [u8]],
    next: usize,
    current: &'a [u8],
    total: u64,
}

impl<'a> Slices<'a> {
    pub fn new(chunks: &'a [&'a [u8]]) -> Slices<'a> {
        Slices {
            chunks,
            next: 0,
            current: &[],
            total: chunks.iter().map(|c| c.len() as u64).sum(),
        }
    }
}

impl ChunkSource for Slices<'_> {
    fn total_bytes(&self) -> u64 {
        self.total
    }

    fn chunk(&self) -> &[u8] {
        self.current
    }

    fn advance(&mut self) -> Result<bool, Error> {
        match self.chunks.get(self.next) {
            Some(c) => {
                self.current = c;
                self.next += 1;
                Ok(true)
            }
            None => {
                self.current = &[];
                Ok(false)
            }
        }
    }
}

/// How to hash: which kernel, how many streams per thread, how many threads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Scheduler {
    pub kernel: Kernel,
    /// Streams advanced together per thread (1, 2 or 4; capped by the kernel).
    pub lanes: usize,
    /// Worker threads: 0 means [`default_threads`].
    pub threads: usize,
    /// Whether a run may use two lanes instead of four when a few big
    /// messages make up the work (see [`Scheduler::run`]); set when `lanes`
    /// comes from this CPU's calibration, not when it was given.
    pub fit_lanes: bool,
}

impl Default for Scheduler {
    fn default() -> Self {
        let kernel = Kernel::active();
        Scheduler {
            kernel,
            lanes: kernel.default_lanes(),
            threads: 0,
            fit_lanes: kernel.lane_rates().is_some(),
        }
    }
}

impl Scheduler {
    pub fn new(kernel: Kernel, lanes: usize, threads: usize) -> Scheduler {
        Scheduler {
            kernel,
            lanes,
            threads,
            fit_lanes: false,
        }
    }

    /// Streams each thread interleaves (the kernel's widest fit to `lanes`).
    pub fn effective_lanes(&self) -> usize {
        match self.lanes.clamp(1, self.kernel.max_lanes()) {
            3 => 2,
            n => n,
        }
    }

    /// Lanes for a batch of small messages of one length: the wide
    /// (16-lane AVX-512) kernel where the calibration at first use found it
    /// faster on this CPU ([`Kernel::small_message_lanes`]) or where 16 lanes
    /// were asked for; else this scheduler's lanes.
    pub fn same_length_lanes(&self) -> usize {
        if self.fit_lanes || (crate::sha256::wide_requested() && self.lanes == self.kernel.default_lanes()) {
            self.kernel.small_message_lanes()
        } else if self.lanes >= crate::sha256::WIDE_LANES {
            crate::sha256::WIDE_LANES
        } else {
            self.effective_lanes()
        }
    }

    /// Worker threads this scheduler runs.
    pub fn effective_threads(&self) -> usize {
        if self.threads == 0 {
            default_threads()
        } else {
            self.threads
        }
    }

    /// Messages in flight at once: threads x lanes.
    pub fn streams(&self) -> usize {
        self.effective_threads() * self.effective_lanes()
    }

    /// SHA-256 of each buffer, in input order.
    pub fn hash_many(&self, buffers: &[&[u8]]) -> Vec<Digest> {
        let sources: Vec<Slices<'_>> = buffers.iter().map(std::slice::from_ref).map(Slices::new).collect();
        self.hash_sources(sources, None)
            .expect("in-memory sources cannot fail and nothing can cancel")
    }

    /// SHA-256 of each streamed message, in input order. `progress(done,
    /// total)` (bytes) is called on the calling thread about every 100 ms and
    /// once at the end; returning false cancels the run ([`Error::Cancelled`]).
    /// The first error a source returns stops every worker and is returned.
    pub fn hash_sources<S: ChunkSource>(
        &self,
        mut sources: Vec<S>,
        progress: Option<&mut dyn FnMut(u64, u64) -> bool>,
    ) -> Result<Vec<Digest>, Error> {
        let mut states: Vec<Sha256> = vec![Sha256::new(); sources.len()];
        let mut digests = vec![UNSET; sources.len()];
        let tasks = states
            .iter_mut()
            .zip(digests.iter_mut())
            .zip(sources.drain(..))
            .map(|((state, out), source)| Task {
                bytes: source.total_bytes(),
                state,
                source,
                digest_out: Some(out),
            })
            .collect();
        self.run(tasks, progress)?;
        Ok(digests)
    }

    /// An incremental hasher of `n` digests driven by this scheduler.
    pub fn multi(&self, n: usize) -> MultiHasher {
        MultiHasher {
            scheduler: *self,
            states: vec![Sha256::new(); n],
        }
    }

    /// Four lanes or two for a run whose largest message has `largest` of
    /// `total` bytes. Four give a core a few percent more than two (3.48 vs
    /// 3.37 GB/s on a 2-vCPU AMD EPYC, Zen 4) but each stream half the speed, and one stream is as
    /// fast as a message can go: a run ends no sooner than
    /// `max(total / (workers x core rate), largest / stream rate)`. Two are
    /// used where that estimate, with this CPU's calibrated rates, is
    /// lower: on the Llama-shaped set (largest 131 MB of 0.98 GB) and on 70B
    /// layers, not on eight equal tensors or many small ones.
    fn fit_to_largest(&self, largest: u64, total: u64, workers: usize) -> usize {
        // `fit_lanes` is only set where the count came from the calibration.
        let rates = self.kernel.calibrated().1;
        let rate = |lanes: usize| rates.iter().find(|r| r.0 == lanes).map_or(0.0, |r| r.1);
        lanes_for_run(rate(2), rate(4), largest, total, workers)
    }

    fn run<S: ChunkSource>(
        &self,
        mut tasks: Vec<Task<'_, S>>,
        mut progress: Option<&mut dyn FnMut(u64, u64) -> bool>,
    ) -> Result<(), Error> {
        if tasks.is_empty() {
            if let Some(p) = progress {
                if !p(0, 0) {
                    return Err(Error::Cancelled);
                }
            }
            return Ok(());
        }
        // Stable sort: equal sizes keep input order, which keeps runs repeatable.
        tasks.sort_by_key(|t| std::cmp::Reverse(t.bytes));
        let total: u64 = tasks.iter().map(|t| t.bytes).sum();
        let mut workers = self.effective_threads().min(tasks.len()).max(1);
        let parallel = !(total < PARALLEL_MIN_BYTES || (workers == 1 && progress.is_none()));
        if !parallel {
            workers = 1;
        }
        // Messages are spread over the threads before lanes are stacked:
        // four big tensors on two threads run as 2 x 2 lanes on both cores,
        // not as 4 lanes on one. (A thread holding three runs the two with
        // the most bytes left, see `worker`.)
        let mut lanes = self.effective_lanes().min(tasks.len().div_ceil(workers)).max(1);
        if lanes == 4 && self.fit_lanes {
            lanes = self.fit_to_largest(tasks[0].bytes, total, workers);
        }
        // Dealing (see `Shared::next_task`) only where the first thread to
        // start would otherwise take more than its share of all the bytes
        // with its first lanes (a few big tensors). Elsewhere it costs: a
        // thread that wakes late then starts its dealt big tensor late, and
        // that tensor ends the run (Llama-shaped set: -5%).
        let first: u64 = tasks.iter().take(lanes).map(|t| t.bytes).sum();
        let dealt = if first.saturating_mul(workers as u64) > total {
            (workers * lanes).min(tasks.len())
        } else {
            0
        };
        let shared = Shared::new(self.kernel, lanes, workers, dealt, tasks, progress.is_some());
        if !parallel {
            worker(&shared, 0);
        } else {
            rayon::in_place_scope(|scope| {
                for w in 0..workers {
                    let shared = &shared;
                    scope.spawn(move |_| worker(shared, w));
                }
                if let Some(p) = progress.as_deref_mut() {
                    // The calling thread is not one of the workers: it reports
                    // progress until they are all done, and cancels on request.
                    let mut finished = shared.finished.lock().unwrap_or_else(|e| e.into_inner());
                    while *finished < workers {
                        let (guard, _) = shared
                            .finished_cv
                            .wait_timeout(finished, PROGRESS_EVERY)
                            .unwrap_or_else(|e| e.into_inner());
                        finished = guard;
                        let running = *finished < workers && !shared.stop.load(Ordering::Relaxed);
                        if running && !p(shared.done.load(Ordering::Relaxed), total) {
                            shared.fail(Error::Cancelled);
                        }
                    }
                }
            });
        }
        if let Some(e) = shared.error.into_inner().unwrap_or_else(|e| e.into_inner()) {
            return Err(e);
        }
        if let Some(p) = progress {
            if !p(total, total) {
                return Err(Error::Cancelled);
            }
        }
        Ok(())
    }
}

/// See [`Scheduler::fit_to_largest`]: 2 or 4, from a core's GB/s with two
/// and four lanes.
fn lanes_for_run(two: f64, four: f64, largest: u64, total: u64, workers: usize) -> usize {
    if two.is_nan() || four.is_nan() || two <= 0.0 || four <= 0.0 {
        return 4;
    }
    let end = |lanes: usize, core: f64| {
        let (total, largest) = (total as f64, largest as f64);
        (total / (workers as f64 * core)).max(largest * lanes as f64 / core)
    };
    if end(2, two) < end(4, four) {
        2
    } else {
        4
    }
}

/// Small messages hashed in batches while the caller is still producing
/// them (when producing one costs about as much as hashing it, e.g. reading
/// a tensor's address from Python).
///
/// Each batch closes at [`Batches::MAX_ITEMS`] messages or
/// [`Batches::MAX_BYTES`] and goes to a [`BatchQueue`]. `threads - 1`
/// helpers on the pool hash batches from the queue while the caller
/// produces; when it is done, the caller hashes what is left alongside them
/// ([`Batches::finish`]). So `threads` threads are busy at any time, never
/// `threads + 1` on `threads` cores: the producer is one of the hashers.
/// A producer with work of its own per digest (the Python binding builds a
/// string for each) collects finished digests as it goes
/// ([`BatchQueue::take_done`]) and, after [`Batches::close`], alternates
/// hashing one batch ([`BatchQueue::work_one`]) and collecting.
///
/// ```
/// # use weight_checker::scheduler::{BatchQueue, Batches, Scheduler};
/// let data = [vec![1u8; 100], vec![2u8; 300]];
/// let queue = BatchQueue::new();
/// rayon::in_place_scope(|scope| {
///     let mut batches = Batches::new(scope, Scheduler::default(), &queue);
///     for (i, d) in data.iter().enumerate() {
///         batches.push(i, d);
///     }
///     batches.finish(); // hashes what the helpers have not taken
/// });
/// assert_eq!(queue.into_digests().len(), 2);
/// ```
pub struct Batches<'s, 'a: 's> {
    scheduler: Scheduler,
    batch: Vec<(usize, &'a [u8])>,
    bytes: usize,
    queue: &'s BatchQueue<'a>,
    /// Closed by the producer, not abandoned: the queued batches are wanted.
    closed: bool,
}

/// Where [`Batches`] leaves full batches for the hashing threads, and the
/// `(index, digest)` pairs they produce.
#[derive(Default)]
pub struct BatchQueue<'a> {
    pending: Mutex<Pending<'a>>,
    ready: Condvar,
    done: Mutex<Vec<(usize, Digest)>>,
}

#[derive(Default)]
struct Pending<'a> {
    batches: std::collections::VecDeque<Vec<(usize, &'a [u8])>>,
    /// No more batches will come: a thread that finds the queue empty leaves.
    closed: bool,
}

impl<'a> BatchQueue<'a> {
    pub fn new() -> BatchQueue<'a> {
        BatchQueue::default()
    }

    /// Every `(index, digest)` hashed, in no particular order.
    pub fn into_digests(self) -> Vec<(usize, Digest)> {
        self.done.into_inner().unwrap_or_else(|e| e.into_inner())
    }

    fn pending(&self) -> std::sync::MutexGuard<'_, Pending<'a>> {
        self.pending.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn put(&self, batch: Vec<(usize, &'a [u8])>) {
        self.pending().batches.push_back(batch);
        self.ready.notify_one();
    }

    /// Ends the queue; with `drop_pending`, batches nobody took are dropped
    /// (the producer failed: their digests are not wanted).
    fn close(&self, drop_pending: bool) {
        let mut pending = self.pending();
        pending.closed = true;
        if drop_pending {
            pending.batches.clear();
        }
        drop(pending);
        self.ready.notify_all();
    }

    /// Every `(index, digest)` hashed since the last call, in no particular
    /// order: a producer turns them into its results while hashing goes on.
    pub fn take_done(&self) -> Vec<(usize, Digest)> {
        std::mem::take(&mut *self.done.lock().unwrap_or_else(|e| e.into_inner()))
    }

    /// Hashes one waiting batch with `scheduler`, if there is one; `false`
    /// when none is waiting (others may still be hashing theirs).
    pub fn work_one(&self, scheduler: Scheduler) -> bool {
        let Some(batch) = self.pending().batches.pop_front() else {
            return false;
        };
        self.hash(scheduler, batch);
        true
    }

    /// Hashes batches until the queue is closed and empty.
    fn work(&self, scheduler: Scheduler) {
        loop {
            let batch = {
                let mut pending = self.pending();
                loop {
                    if let Some(batch) = pending.batches.pop_front() {
                        break batch;
                    }
                    if pending.closed {
                        return;
                    }
                    pending = self.ready.wait(pending).unwrap_or_else(|e| e.into_inner());
                }
            };
            self.hash(scheduler, batch);
        }
    }

    fn hash(&self, scheduler: Scheduler, batch: Vec<(usize, &'a [u8])>) {
        let (index, slices): (Vec<usize>, Vec<&[u8]>) = batch.into_iter().unzip();
        let same_length = slices.windows(2).all(|w| w[0].len() == w[1].len());
        let digests = if same_length && slices.first().is_some_and(|m| m.len() <= STEP_BYTES) {
            // Small parameters of one shape (the usual batch); the zero
            // check and the hash then read the same cache-resident bytes.
            crate::sha256::digest_same_length(scheduler.kernel, scheduler.same_length_lanes(), &slices)
        } else {
            scheduler.hash_many(&slices)
        };
        self.done
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .extend(index.into_iter().zip(digests));
    }
}

impl<'s, 'a: 's> Batches<'s, 'a> {
    pub const MAX_ITEMS: usize = 64;
    pub const MAX_BYTES: usize = 8 << 20;

    /// Starts `scheduler`'s threads minus one helpers in `scope`, each
    /// hashing whole batches from `queue` with one thread.
    pub fn new(scope: &rayon::Scope<'s>, scheduler: Scheduler, queue: &'s BatchQueue<'a>) -> Batches<'s, 'a> {
        let one_thread = Scheduler {
            threads: 1,
            ..scheduler
        };
        for _ in 1..scheduler.effective_threads() {
            scope.spawn(move |_| queue.work(one_thread));
        }
        Batches {
            scheduler: one_thread,
            batch: Vec::new(),
            bytes: 0,
            queue,
            closed: false,
        }
    }

    /// Queues message `index`; a full batch goes to the helpers at once
    /// (then `true`: a good moment to collect [`BatchQueue::take_done`]).
    pub fn push(&mut self, index: usize, bytes: &'a [u8]) -> bool {
        self.bytes += bytes.len();
        self.batch.push((index, bytes));
        if self.batch.len() >= Self::MAX_ITEMS || self.bytes >= Self::MAX_BYTES {
            self.bytes = 0;
            self.queue.put(std::mem::take(&mut self.batch));
            return true;
        }
        false
    }

    /// Queues the last, partial batch and hashes, on this thread, batches
    /// until none is left. The helpers finish theirs when the scope ends.
    pub fn finish(self) {
        let (queue, scheduler) = (self.queue, self.close());
        while queue.work_one(scheduler) {}
    }

    /// Queues the last, partial batch and tells the helpers that no more
    /// will come. The caller then hashes what is left with the returned
    /// one-thread scheduler ([`BatchQueue::work_one`]) and collects digests
    /// ([`BatchQueue::take_done`]) between batches, as it likes.
    pub fn close(mut self) -> Scheduler {
        let last = std::mem::take(&mut self.batch);
        if !last.is_empty() {
            self.queue.put(last);
        }
        self.queue.close(false);
        self.closed = true;
        self.scheduler
    }
}

impl Drop for Batches<'_, '_> {
    /// Without [`Batches::finish`] or [`Batches::close`] (the producer
    /// failed), the helpers are released: they finish the batch in hand and
    /// leave, so the scope can end.
    fn drop(&mut self) {
        if !self.closed {
            self.queue.close(true);
        }
    }
}

/// `(index, digest)` of every message, hashed through [`Batches`] on all of
/// `scheduler`'s threads with nothing else to do between pushes (the
/// producer joins the hashing at once), in no particular order.
pub fn hash_batched(scheduler: Scheduler, messages: &[&[u8]]) -> Vec<(usize, Digest)> {
    let queue = BatchQueue::new();
    rayon::in_place_scope(|scope| {
        let mut batches = Batches::new(scope, scheduler, &queue);
        for (i, m) in messages.iter().enumerate() {
            batches.push(i, m);
        }
        batches.finish();
    });
    queue.into_digests()
}

/// The hashing floor for many small messages: `count` separately allocated
/// buffers of `nbytes` each, hashed `repeat` times through [`Batches`] on all
/// of `scheduler`'s threads (the path the Python binding feeds small tensors
/// through), after one untimed pass so that every timed pass finds the
/// buffers where a repeated checksum finds a model's (just hashed). Returns
/// each pass's time. No producer work is included: a benchmark prints this
/// beside the binding's figure, measured in the same minute, so that what
/// the machine could do right now and what the binding adds are told apart.
pub fn batches_floor(scheduler: Scheduler, count: usize, nbytes: usize, repeat: usize) -> Vec<Duration> {
    // Separate allocations, as a model's parameters are (each one a new
    // memory stream for the prefetcher); the content does not change the
    // cost, but a non-zero first byte keeps the all-zero check as short as
    // on real weights.
    let owned: Vec<Vec<u8>> = (0..count).map(|i| vec![(i % 251 + 1) as u8; nbytes]).collect();
    let messages: Vec<&[u8]> = owned.iter().map(Vec::as_slice).collect();
    let pass = || {
        let start = std::time::Instant::now();
        std::hint::black_box(hash_batched(scheduler, &messages));
        start.elapsed()
    };
    pass();
    (0..repeat).map(|_| pass()).collect()
}

/// One message for one lane: its bytes hashed in order into `state`.
struct Task<'a, S> {
    state: &'a mut Sha256,
    source: S,
    /// Where to put the digest when the message is complete; `None` leaves
    /// the state open for further updates.
    digest_out: Option<&'a mut Digest>,
    bytes: u64,
}

struct Lane<'a, S> {
    task: Task<'a, S>,
    /// How far into the source's current chunk the state has absorbed.
    pos: usize,
    /// Bytes of the message not yet absorbed.
    left: u64,
}

impl<S: ChunkSource> Lane<'_, S> {
    /// The hash state and the unhashed rest of the current chunk, borrowed
    /// together (they are different fields).
    fn parts(&mut self) -> (&mut [u32; 8], &[u8]) {
        (&mut self.task.state.h, &self.task.source.chunk()[self.pos..])
    }

    fn pending_len(&self) -> usize {
        self.task.source.chunk().len() - self.pos
    }
}

/// What the workers of one run share.
struct Shared<'a, S> {
    kernel: Kernel,
    lanes: usize,
    workers: usize,
    /// The first `dealt` tasks (the largest) are dealt to the workers before
    /// any runs, see [`Shared::next_task`].
    dealt: usize,
    /// Tasks in scheduling order; each is taken exactly once, by the worker
    /// it was dealt to or whichever bumps the cursor to it. The per-slot locks
    /// are all but uncontended; they make the hand-over safe without `unsafe`.
    slots: Vec<Mutex<Option<Task<'a, S>>>>,
    /// The next task after the dealt ones, counted from `dealt`.
    cursor: AtomicUsize,
    /// Set on the first error or a cancel: every worker returns at its next step.
    stop: AtomicBool,
    error: Mutex<Option<Error>>,
    count_progress: bool,
    done: AtomicU64,
    finished: Mutex<usize>,
    finished_cv: Condvar,
}

impl<'a, S> Shared<'a, S> {
    fn new(
        kernel: Kernel,
        lanes: usize,
        workers: usize,
        dealt: usize,
        tasks: Vec<Task<'a, S>>,
        count_progress: bool,
    ) -> Self {
        Shared {
            kernel,
            lanes,
            workers,
            dealt,
            slots: tasks.into_iter().map(|t| Mutex::new(Some(t))).collect(),
            cursor: AtomicUsize::new(0),
            stop: AtomicBool::new(false),
            error: Mutex::new(None),
            count_progress,
            done: AtomicU64::new(0),
            finished: Mutex::new(0),
            finished_cv: Condvar::new(),
        }
    }

    fn take(&self, i: usize) -> Option<Task<'a, S>> {
        // A poisoned lock means another worker panicked; the scope re-raises
        // that panic, so taking the data is fine here.
        self.slots.get(i)?.lock().unwrap_or_else(|e| e.into_inner()).take()
    }

    /// The next task for worker `w`. The largest tasks are dealt first, one
    /// per worker per round, in a snake order (0 1, 1 0, 0 1...), so that a
    /// few big tensors start on different cores at once: taken in plain
    /// order, the first thread to start fills all its lanes before the
    /// second one runs, and a 70B layer's three 448 MiB tensors ran as
    /// lanes of one core while the other finished the rest and idled (3.0
    /// GB/s instead of 5+ on a 2-vCPU AMD EPYC, Zen 4). Then the rest, in order, whoever is free first;
    /// then dealt tasks whose worker has not started yet.
    fn next_task(&self, w: usize, deal: &mut Deal) -> Option<Task<'a, S>> {
        while deal.round < self.lanes {
            let r = deal.round;
            deal.round += 1;
            let seat = if r.is_multiple_of(2) { w } else { self.workers - 1 - w };
            let i = r * self.workers + seat;
            if i < self.dealt {
                if let Some(task) = self.take(i) {
                    return Some(task);
                }
            }
        }
        loop {
            let i = self.dealt + self.cursor.fetch_add(1, Ordering::Relaxed);
            if i >= self.slots.len() {
                break;
            }
            if let Some(task) = self.take(i) {
                return Some(task);
            }
        }
        if !deal.scanned {
            if let Some(task) = (0..self.dealt).find_map(|i| self.take(i)) {
                return Some(task);
            }
            // Dealt tasks are never put back: once none is left, none comes.
            deal.scanned = true;
        }
        None
    }

    /// Records the first error and stops every worker.
    fn fail(&self, e: Error) {
        self.stop.store(true, Ordering::Relaxed);
        let mut slot = self.error.lock().unwrap_or_else(|e| e.into_inner());
        if slot.is_none() {
            *slot = Some(e);
        }
    }
}

/// See the three-lane case in [`worker`].
const SWAP_BYTES: u64 = 1 << 20;

/// A worker's progress through its dealt tasks.
#[derive(Default)]
struct Deal {
    round: usize,
    scanned: bool,
}

/// Brings a lane to a state where its current chunk has at least one whole
/// block ready and its partial-block buffer is empty, finishing messages and
/// pulling new ones on the way. Leaves `None` when the queue is drained (or
/// a source failed).
fn prepare<'a, S: ChunkSource>(shared: &Shared<'a, S>, w: usize, deal: &mut Deal, lane: &mut Option<Lane<'a, S>>) {
    let kernel = shared.kernel;
    loop {
        let Some(l) = lane else {
            match shared.next_task(w, deal) {
                Some(task) => {
                    let left = task.bytes;
                    *lane = Some(Lane { task, pos: 0, left });
                }
                None => return,
            }
            continue;
        };
        let pending = l.pending_len();
        if pending == 0 {
            match l.task.source.advance() {
                Ok(true) => l.pos = 0,
                Ok(false) => {
                    let done = lane.take().unwrap();
                    if let Some(out) = done.task.digest_out {
                        *out = std::mem::take(done.task.state).finalize_with(kernel);
                    }
                }
                Err(e) => {
                    *lane = None;
                    shared.fail(e);
                    return;
                }
            }
        } else if l.task.state.buf_len > 0 || pending < BLOCK_LEN {
            let took = l.task.state.absorb_into_buffer(kernel, &l.task.source.chunk()[l.pos..]);
            l.pos += took;
            l.left = l.left.saturating_sub(took as u64);
            if shared.count_progress {
                shared.done.fetch_add(took as u64, Ordering::Relaxed);
            }
        } else {
            return;
        }
    }
}

fn worker<S: ChunkSource>(shared: &Shared<'_, S>, w: usize) {
    let mut slots: [Option<Lane<'_, S>>; 4] = [None, None, None, None];
    let slots = &mut slots[..shared.lanes];
    let mut deal = Deal::default();
    while !shared.stop.load(Ordering::Relaxed) {
        for slot in slots.iter_mut() {
            prepare(shared, w, &mut deal, slot);
        }
        // Open lanes first (a stable partition of at most four slots: no
        // allocation in this loop, which runs once per small tensor).
        slots.sort_by_key(Option::is_none);
        let mut n = slots.iter().take_while(|l| l.is_some()).count();
        if n == 0 {
            break;
        }
        if n == 3 {
            // Three lanes at equal steps run as two plus one, below what two
            // alone do (2.5 vs 3.3 GB/s on a Zen 4 core). Run two: the waiting one (the
            // third) swaps in once it has `SWAP_BYTES` more left than the
            // shorter running one. So the longest messages, which end the
            // run, get the faster streams, and level ones take turns, in
            // runs long enough that each stream stays sequential for the
            // prefetcher (swapping every step ran at 3.0).
            let left = |l: &Option<Lane<'_, S>>| l.as_ref().map_or(0, |l| l.left);
            let shorter = if left(&slots[0]) <= left(&slots[1]) { 0 } else { 1 };
            if left(&slots[2]) > left(&slots[shorter]).saturating_add(SWAP_BYTES) {
                slots.swap(2, shorter);
            }
            n = 2;
        }
        let active = &mut slots[..n];
        // Advance every open lane by the same number of whole blocks.
        let step = active
            .iter()
            .flatten()
            .map(|l| l.pending_len() / BLOCK_LEN * BLOCK_LEN)
            .min()
            .unwrap()
            .min(STEP_BYTES);
        // Only long runs are worth de-phasing (and the check stays out of the
        // loop that small tensors go through once each).
        if step == STEP_BYTES && n > 1 && dephase(shared, active) {
            continue;
        }
        advance(shared, active, step);
    }
    let mut finished = shared.finished.lock().unwrap_or_else(|e| e.into_inner());
    *finished += 1;
    shared.finished_cv.notify_all();
}

/// Read positions of two lanes closer than this to a multiple of
/// [`ALIAS_PERIOD`] are de-phased (see [`dephase`]).
const ALIAS_GUARD: usize = 16 * 1024;
/// Measured on Zen 4 (one core, four lanes, 16 MiB messages `d` bytes apart
/// in one mapping): any `d` within 4 KiB of a multiple of 32 MiB is slower,
/// by 1-4% at 32, 64 and 96 MiB and by 15-25% at 128 and 256 MiB; 8 KiB away,
/// or at multiples of 16 MiB that are not of 32, nothing is lost. It follows
/// virtual addresses (the guest's physical pages are scattered), and real
/// layouts hit it: tensors of one size lie back to back in a safetensors
/// file (128 MiB `q_proj`/`o_proj` in a 70B model) or in consecutive
/// allocations (`size + 4 KiB` apart), and largest-first scheduling starts
/// equal sizes together, so they run the whole tensor in lockstep.
const ALIAS_PERIOD: usize = 32 << 20;
/// How far a lane is moved ahead alone to leave the aliasing window.
const DEPHASE_BYTES: usize = 2 * ALIAS_GUARD;

/// Whether two read positions `d` bytes apart alias (see [`ALIAS_PERIOD`]).
fn aliases(d: usize) -> bool {
    // |d| modulo the period, below the guard: shift the window to start at 0.
    d.wrapping_add(ALIAS_GUARD - 1) & (ALIAS_PERIOD - 1) <= 2 * (ALIAS_GUARD - 1)
}

/// If two open lanes read at positions that alias, advances the later one
/// alone by [`DEPHASE_BYTES`] (one-stream kernel) and returns `true`. Lanes
/// of a group advance by equal steps, so the offset then holds for as long as
/// both messages run: a pair costs one short solo run (~20 us), against up to
/// a quarter of the core for the rest of two long tensors. Each call moves
/// the highest-index lane of the first aliasing pair, so repeated calls end
/// (a lane is moved out of at most three windows; earlier lanes never move).
fn dephase<S: ChunkSource>(shared: &Shared<'_, S>, lanes: &mut [Option<Lane<'_, S>>]) -> bool {
    let at = |l: &Option<Lane<'_, S>>| {
        l.as_ref()
            .map_or(0, |l| l.task.source.chunk()[l.pos..].as_ptr() as usize)
    };
    let Some(j) = (1..lanes.len()).find(|&j| (0..j).any(|i| aliases(at(&lanes[j]).wrapping_sub(at(&lanes[i]))))) else {
        return false;
    };
    let Some(l) = lanes[j].as_mut() else {
        return false;
    };
    // The caller checked that every lane has a full step of whole blocks ready.
    let bytes = DEPHASE_BYTES.min(l.pending_len() / BLOCK_LEN * BLOCK_LEN);
    #[cfg(test)]
    tests::DEPHASED.fetch_add(1, Ordering::Relaxed);
    advance(shared, std::slice::from_mut(&mut lanes[j]), bytes);
    true
}

/// Hashes the next `step` bytes (whole blocks, ready in each chunk) of every
/// lane given, all open, through the widest kernel that fits.
fn advance<S: ChunkSource>(shared: &Shared<'_, S>, lanes: &mut [Option<Lane<'_, S>>], step: usize) {
    for l in lanes.iter_mut().flatten() {
        let bytes = &l.task.source.chunk()[l.pos..l.pos + step];
        l.task.state.observe(bytes);
    }
    compress_lanes(shared.kernel, lanes, step);
    for l in lanes.iter_mut().flatten() {
        l.task.state.note_blocks(step);
        l.pos += step;
        l.left = l.left.saturating_sub(step as u64);
    }
    if shared.count_progress {
        shared.done.fetch_add((step * lanes.len()) as u64, Ordering::Relaxed);
    }
}

/// Runs the `step` bytes ahead of each lane through the widest kernel that
/// fits. Every slot passed in is open.
fn compress_lanes<S: ChunkSource>(kernel: Kernel, lanes: &mut [Option<Lane<'_, S>>], step: usize) {
    match lanes {
        [] => {}
        [Some(a)] => {
            let (h, d) = a.parts();
            kernel.compress1(h, &d[..step]);
        }
        [Some(a), Some(b)] => {
            let ((ha, da), (hb, db)) = (a.parts(), b.parts());
            kernel.compress2([ha, hb], [&da[..step], &db[..step]]);
        }
        [Some(a), Some(b), Some(c), Some(d)] => {
            let ((ha, da), (hb, db), (hc, dc), (hd, dd)) = (a.parts(), b.parts(), c.parts(), d.parts());
            kernel.compress4([ha, hb, hc, hd], [&da[..step], &db[..step], &dc[..step], &dd[..step]]);
        }
        [first @ .., last] if first.iter().all(Option::is_some) && last.is_some() => {
            compress_lanes(kernel, first, step);
            compress_lanes(kernel, std::slice::from_mut(last), step);
        }
        _ => unreachable!("compress_lanes is only given open lanes"),
    }
}

/// Several digests open at once, each fed its bytes in order over many
/// calls, from many buffers in parallel. This is how a tensor larger than a
/// staging slot is hashed one slot-sized chunk at a time.
pub struct MultiHasher {
    scheduler: Scheduler,
    states: Vec<Sha256>,
}

impl MultiHasher {
    pub fn len(&self) -> usize {
        self.states.len()
    }

    pub fn is_empty(&self) -> bool {
        self.states.is_empty()
    }

    /// Bytes fed so far to digest `index`.
    pub fn bytes_fed(&self, index: usize) -> Option<u64> {
        self.states.get(index).map(|s| s.len())
    }

    /// Feeds each `(digest index, bytes)` pair. Pairs for the same digest are
    /// applied in the order given; different digests are hashed in parallel.
    pub fn update(&mut self, feeds: &[(usize, &[u8])]) -> Result<(), Error> {
        if let Some(&(bad, _)) = feeds.iter().find(|(i, _)| *i >= self.states.len()) {
            return Err(Error::DigestIndex {
                index: bad,
                len: self.states.len(),
            });
        }
        let mut order: Vec<usize> = (0..feeds.len()).collect();
        order.sort_by_key(|&i| feeds[i].0); // stable: keeps each digest's order
        let chunks: Vec<&[u8]> = order.iter().map(|&i| feeds[i].1).collect();
        let mut tasks = Vec::new();
        let mut start = 0;
        let mut states = self.states.iter_mut().enumerate();
        while start < order.len() {
            let index = feeds[order[start]].0;
            let mut end = start;
            while end < order.len() && feeds[order[end]].0 == index {
                end += 1;
            }
            let state = states.find(|(i, _)| *i == index).unwrap().1;
            let source = Slices::new(&chunks[start..end]);
            tasks.push(Task {
                bytes: source.total_bytes(),
                state,
                source,
                digest_out: None,
            });
            start = end;
        }
        self.scheduler.run(tasks, None)
    }

    /// Pads and finishes every digest, in index order.
    pub fn finish(self) -> Vec<Digest> {
        let kernel = self.scheduler.kernel;
        self.states.into_iter().map(|s| s.finalize_with(kernel)).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sha2::Digest as _;

    /// How many times [`dephase`] moved a lane (all tests of this binary).
    pub(super) static DEPHASED: AtomicUsize = AtomicUsize::new(0);

    #[test]
    fn alias_window_is_a_few_pages_either_side_of_each_period() {
        for k in [0usize, 1, 2, 4, 7] {
            let base = k * ALIAS_PERIOD;
            for near in [0, 4096, ALIAS_GUARD - 1] {
                assert!(aliases(base + near), "{base} + {near}");
                assert!(aliases(base.wrapping_sub(near)), "{base} - {near}");
                // Distances are taken as `later - earlier`, so both signs occur.
                assert!(aliases(0usize.wrapping_sub(base + near)));
            }
            for far in [ALIAS_GUARD, DEPHASE_BYTES, 64 << 10, 16 << 20] {
                assert!(!aliases(base + far), "{base} + {far}");
                assert!(
                    !aliases(base.wrapping_sub(far).wrapping_add(ALIAS_PERIOD)),
                    "{base} - {far}"
                );
            }
        }
    }

    /// Messages laid out so that lanes alias (and are moved apart), with
    /// lengths around the step and the de-phasing size, through every lane
    /// count: digests equal `sha2`, and the all-zero flag sees a byte that
    /// only the de-phasing pass read.
    #[test]
    fn aliasing_layouts_hash_exactly() {
        let lens = [
            (1 << 20) + 37,
            STEP_BYTES + DEPHASE_BYTES + 13,
            STEP_BYTES + 64,
            3 << 20,
            STEP_BYTES + DEPHASE_BYTES - 64,
        ];
        let jitter = [0usize, 4096, 0, 8192, 64 << 10];
        let starts: Vec<usize> = (0..5).map(|i| i * ALIAS_PERIOD + jitter[i]).collect();
        let pool_len = starts[4] + (3 << 20) + 4096;
        assert!(starts.windows(2).take(3).all(|w| aliases(w[1] - w[0])));
        let mut pool = vec![0u8; pool_len];
        let mut x = 0x2545_f491_4f6c_dd1du64;
        for b in pool.iter_mut() {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            *b = (x >> 24) as u8;
        }
        let check = |pool: &[u8]| {
            let msgs: Vec<&[u8]> = starts.iter().zip(lens).map(|(&s, l)| &pool[s..s + l]).collect();
            for kernel in Kernel::all_available() {
                for lanes in [1, 2, 4] {
                    for threads in [1, 2] {
                        let scheduler = Scheduler::new(kernel, lanes, threads);
                        for (m, d) in msgs.iter().zip(scheduler.hash_many(&msgs)) {
                            let want: [u8; 32] = sha2::Sha256::digest(m).into();
                            assert_eq!(d.bytes, want, "{scheduler:?} len {}", m.len());
                            assert_eq!(d.all_zero, m.iter().all(|&b| b == 0), "{scheduler:?}");
                        }
                    }
                }
            }
        };
        check(&pool);
        // All zero but one byte, inside the part a de-phased lane hashes
        // alone, then after it.
        for at in [100, DEPHASE_BYTES + 100] {
            pool.fill(0);
            for &s in &starts {
                pool[s + at] = 1;
            }
            check(&pool);
        }
        pool.fill(0);
        check(&pool);
        assert!(
            DEPHASED.load(Ordering::Relaxed) > 0,
            "no lane was de-phased: the layout does not test it"
        );
    }

    #[test]
    fn two_lanes_only_where_the_largest_message_would_end_the_run() {
        let llama: Vec<u64> = [
            [131_072_000u64; 2].as_slice(),
            &[46_137_344; 8],
            &[23_068_672; 8],
            &[12_582_912; 8],
        ]
        .concat();
        let total: u64 = llama.iter().sum();
        // This CPU's kind of rates (4 lanes a few percent ahead of 2).
        assert_eq!(lanes_for_run(3.37, 3.48, llama[0], total, 2), 2);
        assert_eq!(lanes_for_run(3.37, 3.48, 470_000_000, 3_420_000_000, 2), 2);
        // Eight equal tensors, or many small ones: four.
        assert_eq!(lanes_for_run(3.37, 3.48, 134_217_728, 8 * 134_217_728, 2), 4);
        assert_eq!(lanes_for_run(3.37, 3.48, 4096, 10_000 * 4096, 2), 4);
        // A CPU where four lanes are far ahead keeps four even on Llama.
        assert_eq!(lanes_for_run(2.0, 3.48, llama[0], total, 2), 4);
        // More threads: each one's share shrinks, so the largest matters sooner.
        assert_eq!(lanes_for_run(3.37, 3.48, 134_217_728, 8 * 134_217_728, 8), 2);
        // No usable rates: four.
        assert_eq!(lanes_for_run(0.0, 3.48, llama[0], total, 2), 4);
        assert_eq!(lanes_for_run(f64::NAN, 3.48, llama[0], total, 2), 4);
    }

    /// Tasks dealt to workers that never start are hashed by the one that
    /// runs, after its own and the undealt ones; every digest is right,
    /// with one, two, three or four lanes held (three: two run, in turns).
    #[test]
    fn a_lone_worker_takes_the_tasks_dealt_to_others() {
        let data: Vec<Vec<u8>> = (0..11)
            .map(|i| vec![i as u8 + 1; (11 - i) * (300 << 10) + i * 77])
            .collect();
        let chunks: Vec<[&[u8]; 1]> = data.iter().map(|d| [d.as_slice()]).collect();
        for kernel in Kernel::all_available() {
            for lanes in 1..=4 {
                let mut states = vec![Sha256::new(); data.len()];
                let mut digests = vec![UNSET; data.len()];
                let tasks: Vec<_> = states
                    .iter_mut()
                    .zip(digests.iter_mut())
                    .zip(&chunks)
                    .map(|((state, out), c)| Task {
                        bytes: c[0].len() as u64,
                        state,
                        source: Slices::new(c),
                        digest_out: Some(out),
                    })
                    .collect();
                let workers = 3;
                let shared = Shared::new(kernel, lanes, workers, (workers * lanes).min(data.len()), tasks, false);
                worker(&shared, 1);
                drop(shared);
                for (d, got) in data.iter().zip(&digests) {
                    let want: [u8; 32] = sha2::Sha256::digest(d).into();
                    assert_eq!(got.bytes, want, "{kernel:?} lanes {lanes} len {}", d.len());
                }
            }
        }
    }
}
