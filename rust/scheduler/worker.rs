//! One run's worker threads: the shared task list (largest first, the
//! biggest dealt across threads), and each worker's lanes, kept full and
//! advanced together through the kernel.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Condvar, Mutex};

use super::dephase::dephase;
use super::ChunkSource;
use crate::error::Error;
use crate::sha256::{Digest, Kernel, Sha256, BLOCK_LEN, STEP_BYTES};

/// One message for one lane: its bytes hashed in order into `state`.
pub(super) struct Task<'a, S> {
    pub(super) state: &'a mut Sha256,
    pub(super) source: S,
    /// Where to put the digest when the message is complete; `None` leaves
    /// the state open for further updates.
    pub(super) digest_out: Option<&'a mut Digest>,
    pub(super) bytes: u64,
}

pub(super) struct Lane<'a, S> {
    pub(super) task: Task<'a, S>,
    /// How far into the source's current chunk the state has absorbed.
    pub(super) pos: usize,
    /// Bytes of the message not yet absorbed.
    pub(super) left: u64,
}

impl<S: ChunkSource> Lane<'_, S> {
    /// The hash state and the unhashed rest of the current chunk, borrowed
    /// together (they are different fields).
    fn parts(&mut self) -> (&mut [u32; 8], &[u8]) {
        (&mut self.task.state.h, &self.task.source.chunk()[self.pos..])
    }

    pub(super) fn pending_len(&self) -> usize {
        self.task.source.chunk().len() - self.pos
    }
}

/// What the workers of one run share.
pub(super) struct Shared<'a, S> {
    pub(super) kernel: Kernel,
    pub(super) lanes: usize,
    pub(super) workers: usize,
    /// The first `dealt` tasks (the largest) are dealt to the workers before
    /// any runs, see [`Shared::next_task`].
    pub(super) dealt: usize,
    /// Tasks in scheduling order; each is taken exactly once, by the worker
    /// it was dealt to or whichever bumps the cursor to it. The per-task locks
    /// are all but uncontended; they make the hand-over safe without `unsafe`.
    pub(super) queue: Vec<Mutex<Option<Task<'a, S>>>>,
    /// The next task after the dealt ones, counted from `dealt`.
    pub(super) cursor: AtomicUsize,
    /// Set on the first error or a cancel: every worker returns at its next step.
    pub(super) stop: AtomicBool,
    pub(super) error: Mutex<Option<Error>>,
    pub(super) count_progress: bool,
    pub(super) done: AtomicU64,
    pub(super) finished: Mutex<usize>,
    pub(super) finished_cv: Condvar,
}

impl<'a, S> Shared<'a, S> {
    pub(super) fn new(
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
            queue: tasks.into_iter().map(|t| Mutex::new(Some(t))).collect(),
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
        self.queue.get(i)?.lock().unwrap_or_else(|e| e.into_inner()).take()
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
            if i >= self.queue.len() {
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
    pub(super) fn fail(&self, e: Error) {
        self.stop.store(true, Ordering::Relaxed);
        let mut first = self.error.lock().unwrap_or_else(|e| e.into_inner());
        if first.is_none() {
            *first = Some(e);
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
            match l.task.source.next_chunk() {
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

pub(super) fn worker<S: ChunkSource>(shared: &Shared<'_, S>, w: usize) {
    let mut held: [Option<Lane<'_, S>>; 4] = [None, None, None, None];
    let held = &mut held[..shared.lanes];
    let mut deal = Deal::default();
    while !shared.stop.load(Ordering::Relaxed) {
        for lane in held.iter_mut() {
            prepare(shared, w, &mut deal, lane);
        }
        // Open lanes first (a stable partition of at most four lanes: no
        // allocation in this loop, which runs once per small tensor).
        held.sort_by_key(Option::is_none);
        let mut n = held.iter().take_while(|l| l.is_some()).count();
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
            let shorter = if left(&held[0]) <= left(&held[1]) { 0 } else { 1 };
            if left(&held[2]) > left(&held[shorter]).saturating_add(SWAP_BYTES) {
                held.swap(2, shorter);
            }
            n = 2;
        }
        let active = &mut held[..n];
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
        hash_step(shared, active, step);
    }
    let mut finished = shared.finished.lock().unwrap_or_else(|e| e.into_inner());
    *finished += 1;
    shared.finished_cv.notify_all();
}

/// Hashes the next `step` bytes (whole blocks, ready in each chunk) of every
/// lane given, all open, through the widest kernel that fits.
pub(super) fn hash_step<S: ChunkSource>(shared: &Shared<'_, S>, lanes: &mut [Option<Lane<'_, S>>], step: usize) {
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
/// fits. Every lane passed in is open.
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

#[cfg(test)]
mod tests {
    use super::super::Slices;
    use super::*;
    use sha2::Digest as _;

    const UNSET: Digest = Digest {
        bytes: [0; 32],
        all_zero: true,
    };

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
