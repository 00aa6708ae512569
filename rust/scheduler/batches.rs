//! Many small messages hashed in batches while the caller produces them.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Condvar, Mutex, OnceLock};
use std::time::Duration;

use super::{BatchTally, Scheduler};
use crate::sha256::{same_length_split, Digest, Kernel, STEP_BYTES};

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
    tally: Tally,
}

/// How the batches ran ([`BatchQueue::tally`]): counted once a batch.
#[derive(Default)]
struct Tally {
    kernel: OnceLock<Kernel>,
    threads: AtomicUsize,
    wide: AtomicUsize,
    narrow: AtomicUsize,
    narrow_lanes: AtomicUsize,
}

impl Tally {
    fn add(&self, kernel: Kernel, wide: usize, narrow: usize, narrow_lanes: usize) {
        self.kernel.get_or_init(|| kernel);
        if wide > 0 {
            self.wide.fetch_add(wide, Ordering::Relaxed);
        }
        if narrow > 0 {
            self.narrow.fetch_add(narrow, Ordering::Relaxed);
            self.narrow_lanes.fetch_max(narrow_lanes, Ordering::Relaxed);
        }
    }
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

    /// How the batches hashed so far ran: on how many threads, how many
    /// messages through the wide kernel and how many on narrow lanes.
    pub fn tally(&self) -> BatchTally {
        let t = &self.tally;
        BatchTally {
            kernel: t.kernel.get().copied(),
            threads: t.threads.load(Ordering::Relaxed),
            wide: t.wide.load(Ordering::Relaxed),
            narrow: t.narrow.load(Ordering::Relaxed),
            narrow_lanes: t.narrow_lanes.load(Ordering::Relaxed),
        }
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
        let kernel = scheduler.kernel;
        let digests = if same_length && slices.first().is_some_and(|m| m.len() <= STEP_BYTES) {
            // Small parameters of one shape (the usual batch); the zero
            // check and the hash then read the same cache-resident bytes.
            let lanes = scheduler.same_length_lanes();
            let (_, wide, narrow_lanes) = same_length_split(kernel, lanes, slices.len());
            self.tally.add(kernel, wide, slices.len() - wide, narrow_lanes);
            crate::sha256::digest_same_length(kernel, lanes, &slices)
        } else {
            let (digests, shape) = scheduler.hash_many_shaped(&slices);
            match shape {
                Some(s) if s.wide() => self.tally.add(kernel, s.messages, 0, 0),
                Some(s) => self.tally.add(kernel, 0, s.messages, s.narrow_lanes),
                None => {}
            }
            digests
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
        let threads = scheduler.effective_threads();
        queue.tally.threads.fetch_max(threads, Ordering::Relaxed);
        for _ in 1..threads {
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
    // run of addresses for the prefetcher); the content does not change the
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
