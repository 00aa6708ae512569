//! The parallel scheduler: many messages, all cores, several streams per core.
//!
//! Every message (a whole buffer, or the chunks one update feeds to one
//! digest of a [`MultiHasher`]) is a task. Tasks are queued largest first,
//! so one big tensor never starts last and runs alone at the end. Each worker
//! thread keeps `lanes` tasks open and advances them together, block for
//! block, through the backend's multi-stream kernel; the moment a task ends
//! (its padding included) its lane takes the next one from the shared queue.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

use crate::error::Error;
use crate::sha256::{Backend, Digest, Sha256, BLOCK_LEN};

/// Bytes each lane advances per kernel call. Small enough that the zero
/// check and the hash read the same bytes while they sit in L2, large enough
/// that per-call overhead vanishes.
pub const STEP_BYTES: usize = 64 * 1024;

/// Called with each hashed piece of a buffer (see `hash_many_releasing`).
pub type ReleaseHook<'a> = &'a (dyn Fn(&[u8]) + Sync);

/// How much of a buffer is hashed before `hash_many_releasing` hands it back.
pub const RELEASE_BYTES: usize = 8 << 20;

/// Below this many bytes in total, threads cost more than they save.
const PARALLEL_MIN_BYTES: usize = 256 * 1024;

/// How to hash: which kernel, how many streams per thread, how many threads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Engine {
    pub backend: Backend,
    /// Streams advanced together per thread (1, 2 or 4; capped by the backend).
    pub lanes: usize,
    /// Worker threads: 0 means rayon's pool size (all cores).
    pub threads: usize,
}

impl Default for Engine {
    fn default() -> Self {
        let backend = Backend::active();
        Engine {
            backend,
            lanes: backend.default_lanes(),
            threads: 0,
        }
    }
}

impl Engine {
    pub fn new(backend: Backend, lanes: usize, threads: usize) -> Engine {
        Engine {
            backend,
            lanes,
            threads,
        }
    }

    fn effective_lanes(&self) -> usize {
        match self.lanes.clamp(1, self.backend.max_lanes()) {
            3 => 2,
            n => n,
        }
    }

    /// SHA-256 of each buffer, in input order.
    pub fn hash_many(&self, buffers: &[&[u8]]) -> Vec<Digest> {
        self.hash_many_with(buffers, None)
    }

    /// Like [`Engine::hash_many`], calling `release` with consecutive pieces
    /// of each buffer (about [`RELEASE_BYTES`] each) once they are hashed.
    /// Hashing a memory-mapped checkpoint uses it to drop pages already read,
    /// so resident memory stays bounded however large the file.
    pub fn hash_many_releasing(&self, buffers: &[&[u8]], release: ReleaseHook<'_>) -> Vec<Digest> {
        self.hash_many_with(buffers, Some(release))
    }

    fn hash_many_with(&self, buffers: &[&[u8]], release: Option<ReleaseHook<'_>>) -> Vec<Digest> {
        let mut states: Vec<Sha256> = vec![Sha256::new(); buffers.len()];
        let mut digests = vec![
            Digest {
                bytes: [0; 32],
                all_zero: true
            };
            buffers.len()
        ];
        let tasks = states
            .iter_mut()
            .zip(digests.iter_mut())
            .zip(buffers)
            .map(|((state, out), buf)| Task {
                state,
                chunks: std::slice::from_ref(buf),
                digest_out: Some(out),
                bytes: buf.len(),
            })
            .collect();
        self.run(tasks, release);
        digests
    }

    /// An incremental hasher of `n` digests driven by this engine.
    pub fn multi(&self, n: usize) -> MultiHasher {
        MultiHasher {
            engine: *self,
            states: vec![Sha256::new(); n],
        }
    }

    fn run(&self, mut tasks: Vec<Task<'_>>, release: Option<ReleaseHook<'_>>) {
        if tasks.is_empty() {
            return;
        }
        let lanes = self.effective_lanes();
        let backend = self.backend;
        // Stable sort: equal sizes keep input order, which keeps runs repeatable.
        tasks.sort_by_key(|t| std::cmp::Reverse(t.bytes));
        let total: usize = tasks.iter().map(|t| t.bytes).sum();
        let threads = if self.threads == 0 {
            rayon::current_num_threads()
        } else {
            self.threads
        };
        let workers = threads.min(tasks.len().div_ceil(lanes)).max(1);
        let queue = Queue {
            release,
            slots: tasks.into_iter().map(|t| Mutex::new(Some(t))).collect(),
            cursor: AtomicUsize::new(0),
        };
        if workers == 1 || total < PARALLEL_MIN_BYTES {
            worker(backend, lanes, &queue);
            return;
        }
        rayon::scope(|scope| {
            for _ in 0..workers {
                scope.spawn(|_| worker(backend, lanes, &queue));
            }
        });
    }
}

/// SHA-256 of each buffer with the default engine (all cores, best backend).
pub fn hash_many(buffers: &[&[u8]]) -> Vec<Digest> {
    Engine::default().hash_many(buffers)
}

/// One message for one lane: chunks hashed in order into `state`.
struct Task<'a> {
    state: &'a mut Sha256,
    chunks: &'a [&'a [u8]],
    /// Where to put the digest when the message is complete; `None` leaves
    /// the state open for further updates.
    digest_out: Option<&'a mut Digest>,
    bytes: usize,
}

struct Lane<'a> {
    task: Task<'a>,
    chunk: usize,
    pos: usize,
    /// How far into the current chunk `release` has been called.
    released: usize,
}

impl<'a> Lane<'a> {
    /// Hands the hashed-but-unreleased part of the current chunk to the
    /// queue's `release` hook once it is at least `min` bytes.
    fn release_hashed(&mut self, queue: &Queue<'_>, min: usize) {
        if let Some(release) = queue.release {
            if self.pos - self.released >= min.max(1) {
                release(&self.task.chunks[self.chunk][self.released..self.pos]);
                self.released = self.pos;
            }
        }
    }

    /// The unhashed rest of the current chunk.
    fn pending(&self) -> &'a [u8] {
        &self.task.chunks[self.chunk][self.pos..]
    }
}

/// Tasks in scheduling order; each is taken exactly once by whichever
/// worker bumps the cursor to it. The per-slot locks are never contended
/// (the cursor hands each slot to one worker); they only make the hand-over
/// safe without `unsafe`.
struct Queue<'a> {
    /// Called with each hashed piece of a buffer (see `hash_many_releasing`).
    release: Option<ReleaseHook<'a>>,
    slots: Vec<Mutex<Option<Task<'a>>>>,
    cursor: AtomicUsize,
}

fn next_task<'a>(queue: &Queue<'a>) -> Option<Task<'a>> {
    let i = queue.cursor.fetch_add(1, Ordering::Relaxed);
    // A poisoned lock means another worker panicked; the scope re-raises
    // that panic, so taking the data is fine here.
    queue.slots.get(i)?.lock().unwrap_or_else(|e| e.into_inner()).take()
}

/// Brings a lane to a state where its current chunk has at least one whole
/// block ready and its partial-block buffer is empty, finishing tasks and
/// pulling new ones on the way. Leaves `None` when the queue is drained.
fn prepare<'a>(backend: Backend, lane: &mut Option<Lane<'a>>, queue: &Queue<'a>) {
    loop {
        let Some(l) = lane else {
            match next_task(queue) {
                Some(task) => {
                    *lane = Some(Lane {
                        task,
                        chunk: 0,
                        pos: 0,
                        released: 0,
                    })
                }
                None => return,
            }
            continue;
        };
        if l.chunk == l.task.chunks.len() {
            let done = lane.take().unwrap();
            if let Some(out) = done.task.digest_out {
                *out = std::mem::take(done.task.state).finalize_with(backend);
            }
            continue;
        }
        let data = l.pending();
        if data.is_empty() {
            l.release_hashed(queue, 0);
            l.chunk += 1;
            l.pos = 0;
            l.released = 0;
        } else if l.task.state.buf_len > 0 || data.len() < BLOCK_LEN {
            l.pos += l.task.state.absorb_into_buffer(backend, data);
        } else {
            return;
        }
    }
}

fn worker(backend: Backend, lanes: usize, queue: &Queue<'_>) {
    let mut slots: [Option<Lane<'_>>; 4] = [None, None, None, None];
    let slots = &mut slots[..lanes];
    loop {
        for slot in slots.iter_mut() {
            prepare(backend, slot, queue);
        }
        // Open lanes first (a stable partition of at most four slots: no
        // allocation in this loop, which runs once per small tensor).
        slots.sort_by_key(Option::is_none);
        let n = slots.iter().take_while(|l| l.is_some()).count();
        if n == 0 {
            return;
        }
        let active = &mut slots[..n];
        // Advance every open lane by the same number of whole blocks.
        let step = active
            .iter()
            .flatten()
            .map(|l| l.pending().len() / BLOCK_LEN * BLOCK_LEN)
            .min()
            .unwrap()
            .min(STEP_BYTES);
        for l in active.iter_mut().flatten() {
            let bytes = &l.pending()[..step];
            l.task.state.observe(bytes);
        }
        compress_lanes(backend, active, step);
        for l in active.iter_mut().flatten() {
            l.task.state.note_blocks(step);
            l.pos += step;
            l.release_hashed(queue, RELEASE_BYTES);
        }
    }
}

/// Runs the `step` bytes ahead of each lane through the widest kernel that
/// fits. Every slot passed in is open.
fn compress_lanes(backend: Backend, lanes: &mut [Option<Lane<'_>>], step: usize) {
    match lanes {
        [] => {}
        [Some(a)] => {
            let d = &a.pending()[..step];
            backend.compress1(&mut a.task.state.h, d);
        }
        [Some(a), Some(b)] => {
            let (da, db) = (&a.pending()[..step], &b.pending()[..step]);
            backend.compress2([&mut a.task.state.h, &mut b.task.state.h], [da, db]);
        }
        [Some(a), Some(b), Some(c), Some(d)] => {
            let data = [a.pending(), b.pending(), c.pending(), d.pending()].map(|p| &p[..step]);
            backend.compress4(
                [
                    &mut a.task.state.h,
                    &mut b.task.state.h,
                    &mut c.task.state.h,
                    &mut d.task.state.h,
                ],
                data,
            );
        }
        [first @ .., last] if lanes_open(first) && last.is_some() => {
            compress_lanes(backend, first, step);
            compress_lanes(backend, std::slice::from_mut(last), step);
        }
        _ => unreachable!("compress_lanes is only given open lanes"),
    }
}

fn lanes_open(lanes: &[Option<Lane<'_>>]) -> bool {
    lanes.iter().all(Option::is_some)
}

/// Several digests open at once, each fed its bytes in order over many
/// calls, from many buffers in parallel. This is how a tensor larger than a
/// staging slot is hashed one slot-sized chunk at a time.
pub struct MultiHasher {
    engine: Engine,
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
            let group = &chunks[start..end];
            tasks.push(Task {
                state,
                chunks: group,
                digest_out: None,
                bytes: group.iter().map(|c| c.len()).sum(),
            });
            start = end;
        }
        self.engine.run(tasks, None);
        Ok(())
    }

    /// Pads and finishes every digest, in index order.
    pub fn finish(self) -> Vec<Digest> {
        let backend = self.engine.backend;
        self.states.into_iter().map(|s| s.finalize_with(backend)).collect()
    }
}
