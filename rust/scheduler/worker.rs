//! One run's worker threads: the shared task list (largest first, the
//! biggest dealt across threads), and each worker's lanes, kept full and
//! advanced together through the kernel.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Condvar, Mutex};

use super::assignment::Assignment;
use super::dephase::dephase;
use super::ChunkSource;
use crate::error::Error;
use crate::sha256::{Digest, Kernel, Sha256, Wide, BLOCK_LEN, STEP_BYTES, WIDE_LANES};

/// One message for one lane: its bytes hashed in order into `state`.
pub(super) struct Task<'a, S> {
    pub(super) state: &'a mut Sha256,
    pub(super) source: S,
    /// Where to put the digest when the message is complete; `None` leaves
    /// the state open for further updates.
    pub(super) digest_out: Option<&'a mut Digest>,
    pub(super) bytes: u64,
    /// Chain states to record on the way (the source's chunks end at each
    /// mark, so a lane's state passes through it between two chunks).
    pub(super) marks: Option<&'a mut Marks>,
}

/// Where in a message to record its chain state, and the states recorded:
/// a whole-tensor digest that also gives the state at each block boundary,
/// so that another copy's block can later be checked against it by
/// continuing that state over the block (`MultiHasher.mark`).
#[derive(Default)]
pub struct Marks {
    /// Message lengths at which to record, increasing.
    pub(super) at: Vec<u64>,
    /// How many of `at` are recorded.
    pub(super) next: usize,
    /// The states recorded ([`Sha256::export`]), one per reached mark.
    pub(super) states: Vec<Vec<u8>>,
}

impl Marks {
    /// Records `state` for every mark it stands at.
    pub(super) fn record(&mut self, state: &Sha256) {
        debug_assert!(
            self.at.get(self.next).is_none_or(|&mark| mark >= state.len()),
            "a chunk ended past a mark"
        );
        while self.at.get(self.next) == Some(&state.len()) {
            self.states.push(state.export());
            self.next += 1;
        }
    }
}

pub(super) struct Lane<'a, S> {
    pub(super) task: Task<'a, S>,
    /// How far into the source's current chunk the state has absorbed.
    pub(super) pos: usize,
    /// Bytes of the message not yet absorbed.
    pub(super) left: u64,
    /// Whether the wide kernel has hashed part of this message (counted
    /// by the tests when narrow lanes then take it over).
    went_wide: bool,
    /// Whether the message is one of the dealt (largest) ones: a narrow
    /// worker turns wide once it holds none (see [`worker`]).
    dealt: bool,
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
    /// Workers, lanes, kernels, the mixed split and what is dealt.
    pub(super) assignment: Assignment,
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
    /// Calls of the wide kernel, all workers together (each adds its own
    /// count once, as it ends): see `Wide::calls_on_this_thread`.
    pub(super) wide_calls: AtomicU64,
}

impl<'a, S> Shared<'a, S> {
    pub(super) fn new(kernel: Kernel, assignment: &Assignment, tasks: Vec<Task<'a, S>>, count_progress: bool) -> Self {
        Shared {
            kernel,
            assignment: *assignment,
            queue: tasks.into_iter().map(|t| Mutex::new(Some(t))).collect(),
            cursor: AtomicUsize::new(0),
            stop: AtomicBool::new(false),
            error: Mutex::new(None),
            count_progress,
            done: AtomicU64::new(0),
            finished: Mutex::new(0),
            finished_cv: Condvar::new(),
            wide_calls: AtomicU64::new(0),
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
    /// then dealt tasks whose worker has not started yet. In a mixed split
    /// only the narrow workers are dealt to.
    fn next_task(&self, w: usize, deal: &mut Deal) -> Option<(Task<'a, S>, bool)> {
        let (seats, rounds) = self.dealing();
        while w < seats && deal.round < rounds {
            let r = deal.round;
            deal.round += 1;
            let seat = if r.is_multiple_of(2) { w } else { seats - 1 - w };
            let i = r * seats + seat;
            if i < self.assignment.dealt {
                if let Some(task) = self.take(i) {
                    return Some((task, true));
                }
            }
        }
        loop {
            let i = self.assignment.dealt + self.cursor.fetch_add(1, Ordering::Relaxed);
            if i >= self.queue.len() {
                break;
            }
            if let Some(task) = self.take(i) {
                return Some((task, false));
            }
        }
        if !deal.scanned {
            if let Some(task) = (0..self.assignment.dealt).find_map(|i| self.take(i)) {
                return Some((task, true));
            }
            // Dealt tasks are never put back: once none is left, none comes.
            deal.scanned = true;
        }
        None
    }

    /// How many workers are dealt to (the first ones) and how many rounds.
    fn dealing(&self) -> (usize, usize) {
        match self.assignment.narrow {
            (0, _) => (self.assignment.workers, self.assignment.lanes),
            narrow => narrow,
        }
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

/// See [`narrow_lanes`].
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
                Some((task, dealt)) => {
                    let left = task.bytes;
                    *lane = Some(Lane {
                        task,
                        pos: 0,
                        left,
                        went_wide: false,
                        dealt,
                    });
                }
                None => return,
            }
            continue;
        };
        let pending = l.pending_len();
        if pending == 0 {
            if let Some(marks) = l.task.marks.as_deref_mut() {
                marks.record(l.task.state);
            }
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
    let mut all_lanes: [Option<Lane<'_, S>>; WIDE_LANES] = std::array::from_fn(|_| None);
    // A narrow worker of a mixed split hashes the largest messages, dealt
    // to it, on narrow lanes (a wide lane would give each a sixteenth of the
    // core), refilling freed lanes from the queue. Once every dealt message
    // it held has ended it runs as the wide workers do: left narrow, it
    // would hash the rest of the run at its narrow rate beside wide cores
    // (on a Llama-8B-shaped set, two 1 GB embeddings among 3.5-117 MB
    // tensors: 7% later by the run model on a 2-vCPU AMD EPYC).
    let all = &shared.assignment;
    let mut narrow = w < all.narrow.0;
    let (mut lanes, mut wide_plan) = match narrow {
        true => (all.narrow.1, None),
        false => (all.lanes, all.wide.as_ref()),
    };
    let mut deal = Deal::default();
    let mut wide_calls = 0u64;
    while !shared.stop.load(Ordering::Relaxed) {
        let held = &mut all_lanes[..lanes];
        for lane in held.iter_mut() {
            prepare(shared, w, &mut deal, lane);
        }
        // Open lanes first (a stable partition of at most sixteen lanes: no
        // allocation in this loop, which runs once per small tensor).
        held.sort_by_key(Option::is_none);
        let open = held.iter().take_while(|l| l.is_some()).count();
        if open == 0 {
            break;
        }
        if narrow && deal.round >= shared.dealing().1 && held.iter().flatten().all(|l| !l.dealt) {
            narrow = false;
            (lanes, wide_plan) = (all.lanes, all.wide.as_ref());
            #[cfg(test)]
            tests::TURNED_WIDE.fetch_add(1, Ordering::Relaxed);
            continue; // fill the wide lanes first
        }
        // The wide kernel while enough messages are open to be worth its
        // sixteen lanes and none would end the run at a sixteenth of a
        // core (`runs_alone`); else narrow lanes on the ones with the most
        // bytes left. A message
        // moves between the two at a step boundary: both work on the same
        // state, whole blocks at a time.
        let (run, wide) = match wide_plan {
            Some(plan) if open >= plan.min_open => match runs_alone(plan, &mut held[..open]) {
                true => (1, None),
                false => (open, Some(plan.kernel)),
            },
            _ => (narrow_lanes(&mut held[..open]), None),
        };
        let active = &mut held[..run];
        // Advance every running lane by the same number of whole blocks.
        let step = active
            .iter()
            .flatten()
            .map(|l| l.pending_len() / BLOCK_LEN * BLOCK_LEN)
            .min()
            .unwrap()
            .min(STEP_BYTES);
        // Only long runs are worth de-phasing (and the check stays out of the
        // loop that small tensors go through once each).
        if wide.is_none() && step == STEP_BYTES && run > 1 && dephase(shared, active) {
            continue;
        }
        // A background run waits here while foreground work runs, and stops if cancelled.
        if !super::threads::give_way() {
            shared.fail(Error::Cancelled);
            break;
        }
        wide_calls += u64::from(wide.is_some());
        hash_step(shared, active, step, wide);
    }
    if wide_calls > 0 {
        shared.wide_calls.fetch_add(wide_calls, Ordering::Relaxed);
    }
    let mut finished = shared.finished.lock().unwrap_or_else(|e| e.into_inner());
    *finished += 1;
    shared.finished_cv.notify_all();
}

/// Of `open` lanes (all open), how many run on narrow lanes, moved to the front:
/// four, or two of three, or all of one or two. The ones left waiting swap
/// in once they have [`SWAP_BYTES`] more left than the running one with the
/// fewest. So the longest messages, which end the run, get the streams, and
/// level ones take turns in runs long enough that each stays sequential for
/// the prefetcher (swapping every step ran at 3.0 GB/s, not 3.3, on a Zen 4
/// core). Three lanes at equal steps would run as two plus one, below what
/// two alone do (2.5 vs 3.3 GB/s there).
fn narrow_lanes<S>(open: &mut [Option<Lane<'_, S>>]) -> usize {
    let run = narrow_run(open.len());
    let left = |l: &Option<Lane<'_, S>>| l.as_ref().map_or(0, |l| l.left);
    for waiting in run..open.len() {
        let fewest = (0..run).min_by_key(|&i| left(&open[i])).unwrap_or(0);
        if left(&open[waiting]) > left(&open[fewest]).saturating_add(SWAP_BYTES) {
            open.swap(waiting, fewest);
        }
    }
    run
}

/// Of `open` messages on narrow lanes, how many run: four, or two of three, or
/// all of one or two (see [`narrow_lanes`]; the run model uses it too).
pub(super) fn narrow_run(open: usize) -> usize {
    match open {
        3 => 2,
        n => n.min(4),
    }
}

/// How a run uses the wide kernel.
#[derive(Clone, Copy, Debug)]
pub(super) struct WidePlan {
    pub(super) kernel: Wide,
    /// The fewest open lanes a worker runs it with (fewer: narrow lanes).
    pub(super) min_open: usize,
    /// A core's rate through it over one narrow stream's (2-2.5 measured
    /// against SHA-NI).
    pub(super) over_one_stream: f64,
}

/// With the wide kernel in use on `open` lanes (all open): whether the
/// message with the most bytes left should run alone on one narrow lane
/// instead, moved to the front. In a wide lane it gets a sixteenth of the
/// core, so the lanes end when it does: `16 L / wide`. Hashed first at
/// one stream's rate and the rest wide after, they end at
/// `L / one + 16 L2 / wide` (`L2` the next largest). So it runs alone
/// while `L x wide / one < 16 (L - L2)`: on a Llama-shaped set, the
/// embedding (131 MB against 23 MB); among tensors of one size, never.
fn runs_alone<S>(plan: &WidePlan, open: &mut [Option<Lane<'_, S>>]) -> bool {
    let left = |l: &Option<Lane<'_, S>>| l.as_ref().map_or(0, |l| l.left);
    let Some(top) = (0..open.len()).max_by_key(|&i| left(&open[i])) else {
        return false;
    };
    open.swap(0, top);
    let (largest, next) = (left(&open[0]), open[1..].iter().map(left).max().unwrap_or(0));
    largest_runs_alone(largest, next, plan.over_one_stream)
}

/// [`runs_alone`]'s rule on the bytes left of the two largest open
/// messages (the run model uses it too).
pub(super) fn largest_runs_alone(largest: u64, next: u64, over_one_stream: f64) -> bool {
    (largest as f64) * over_one_stream < (WIDE_LANES as f64) * (largest - next) as f64
}

/// Hashes the next `step` bytes (whole blocks, ready in each chunk) of every
/// lane given, all open: through the wide kernel if given, else through the
/// widest of the kernel's own lane counts that fits.
pub(super) fn hash_step<S: ChunkSource>(
    shared: &Shared<'_, S>,
    lanes: &mut [Option<Lane<'_, S>>],
    step: usize,
    wide: Option<Wide>,
) {
    for l in lanes.iter_mut().flatten() {
        let bytes = &l.task.source.chunk()[l.pos..l.pos + step];
        l.task.state.observe(bytes);
    }
    match wide {
        Some(wide) => compress_wide(wide, lanes, step),
        None => compress_lanes(shared.kernel, lanes, step),
    }
    for l in lanes.iter_mut().flatten() {
        l.task.state.note_blocks(step);
        l.pos += step;
        l.left = l.left.saturating_sub(step as u64);
        #[cfg(test)]
        if wide.is_none() && l.went_wide {
            tests::MOVED.fetch_add(1, Ordering::Relaxed);
        }
        l.went_wide = wide.is_some();
    }
    if shared.count_progress {
        shared.done.fetch_add((step * lanes.len()) as u64, Ordering::Relaxed);
    }
}

/// Zero bytes for the wide kernel's idle lanes (at most one step each).
static IDLE_BLOCKS: [u8; STEP_BYTES] = [0; STEP_BYTES];

/// Runs the `step` bytes ahead of each lane (at most sixteen, all open)
/// through the wide kernel; lanes without a message hash zeros into a
/// scratch state. Its compression ends with `vzeroupper`, so the narrow
/// SHA-NI kernel's legacy-SSE instructions after it pay no AVX-512
/// transition penalty.
fn compress_wide<S: ChunkSource>(wide: Wide, lanes: &mut [Option<Lane<'_, S>>], step: usize) {
    let mut scratch = [[0u32; 8]; WIDE_LANES];
    let mut scratch = scratch.iter_mut();
    let mut open = lanes.iter_mut().flatten();
    let mut blocks: [&[u8]; WIDE_LANES] = [&[]; WIDE_LANES];
    let states: [&mut [u32; 8]; WIDE_LANES] = std::array::from_fn(|i| match open.next() {
        Some(l) => {
            let (h, d) = l.parts();
            blocks[i] = &d[..step];
            h
        }
        None => {
            blocks[i] = &IDLE_BLOCKS[..step];
            scratch.next().expect("sixteen scratch states for sixteen lanes")
        }
    });
    debug_assert!(open.next().is_none(), "at most sixteen lanes run wide");
    wide.compress16(states, blocks);
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
#[path = "worker_tests.rs"]
mod tests;
