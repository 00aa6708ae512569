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
//! Lanes are 1, 2 or 4 SHA-NI streams, or 16 for the wide AVX-512 kernel
//! where this CPU's rates say a run of many messages ends sooner with it
//! (`Scheduler::fit_wide`); a thread holding 16 runs them wide while enough
//! are open and SHA-NI for the rest (`worker`).
//!
//! Three refinements matter when a few tensors of hundreds of MB make up
//! the work, since one of them then ends the run: the largest are dealt
//! across the threads when taking them in order would put more than a
//! thread's share on the first to start (`Shared::next_task`); a thread
//! runs the messages with the most bytes left on SHA-NI (two of three at
//! full two-lane speed rather than all three at two-plus-one; the one that
//! would crawl in a wide lane alone), see `worker`; and lanes whose
//! addresses alias are moved apart (`dephase`).

mod batches;
mod dephase;
mod multi;
mod source;
mod threads;
mod worker;

use std::sync::atomic::Ordering;
use std::time::Duration;

pub use batches::{batches_floor, hash_batched, BatchQueue, Batches};
pub use multi::MultiHasher;
pub use source::{ChunkSource, Slices};
pub use threads::{default_threads, set_default_threads, THREADS_ENV};
use worker::{worker, Shared, Task, WidePlan};

use crate::error::Error;
use crate::sha256::{Digest, Kernel, Sha256, Wide, WIDE_LANES};

/// Below this many bytes in total, threads cost more than they save.
const PARALLEL_MIN_BYTES: u64 = 256 * 1024;

/// A digest not yet written (every one is written before a run returns Ok).
const UNSET: Digest = Digest {
    bytes: [0; 32],
    all_zero: true,
};

/// How often a progress callback is called while a run is in flight.
const PROGRESS_EVERY: Duration = Duration::from_millis(100);

/// How to hash: which kernel, how many lanes per thread, how many threads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Scheduler {
    pub kernel: Kernel,
    /// Messages each thread holds open (1, 2 or 4 SHA-NI lanes; 16 for the
    /// wide AVX-512 kernel where the CPU has it; capped by the kernel).
    pub lanes: usize,
    /// Worker threads: 0 means [`default_threads`].
    pub threads: usize,
    /// Whether a run may fit its lanes to the work (see [`Scheduler::run`]):
    /// two lanes instead of four when a few big messages make it up, the
    /// wide kernel where this CPU's rates say it ends sooner. Set when
    /// `lanes` comes from this CPU's calibration, not when it was given.
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

    /// Messages each thread holds open: 16 where `lanes` asks for the wide
    /// kernel and the CPU has it, else the kernel's widest fit to `lanes`.
    pub fn effective_lanes(&self) -> usize {
        if self.lanes >= WIDE_LANES && self.wide().is_some() {
            return WIDE_LANES;
        }
        match self.lanes.clamp(1, self.kernel.max_lanes()) {
            3 => 2,
            n => n,
        }
    }

    /// The wide kernel, where this CPU has it and this kernel may use it.
    fn wide(&self) -> Option<Wide> {
        Wide::detect().filter(|_| self.kernel != Kernel::Portable)
    }

    /// `(wide, four)` streaming GB/s of a core where a calibrated run may
    /// choose the wide kernel: it exists here and outruns four SHA-NI lanes.
    fn wide_may_run(&self) -> Option<(f64, f64)> {
        if !self.fit_lanes || self.effective_lanes() != 4 {
            return None;
        }
        self.wide()?;
        let (wide, four) = self.kernel.wide_stream_rates()?;
        (four > 0.0 && wide.is_finite() && wide > four).then_some((wide, four))
    }

    /// Lanes for a batch of small messages of one length: the wide
    /// (16-lane AVX-512) kernel where the calibration at first use found it
    /// faster on this CPU ([`Kernel::small_message_lanes`]) or where 16 lanes
    /// were asked for; else this scheduler's lanes.
    pub fn same_length_lanes(&self) -> usize {
        if self.fit_lanes {
            self.kernel.small_message_lanes()
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

    /// The most messages a run keeps in flight: threads x lanes, where the
    /// lanes are 16 when this CPU's rates let a run of many messages use
    /// the wide kernel (see `fit_wide`). A feeder that hands the scheduler
    /// this many messages at once (the staging pipeline) lets it choose.
    pub fn streams(&self) -> usize {
        let lanes = if self.wide_may_run().is_some() {
            WIDE_LANES
        } else {
            self.effective_lanes()
        };
        self.effective_threads() * lanes
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
        MultiHasher::new(*self, n)
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

    /// Whether a run whose largest message has `largest` of `total` bytes in
    /// `count` messages ends sooner through the wide kernel, by this CPU's
    /// streaming rates ([`Kernel::wide_stream_rates`]); if so, the fewest
    /// open messages for which it still beats four SHA-NI lanes (break-even:
    /// `open x wide / 16 = four-lane rate`) and its rate over one SHA-NI
    /// stream's, which the workers plan by (see `WidePlan`).
    ///
    /// The estimate, per worker, with the wide kernel: its share of the bytes
    /// at the wide rate, unless the largest message ends it: at a sixteenth
    /// of the core, or hashed alone first at one stream's rate and the rest
    /// wide after, whichever is sooner (the workers choose so). Against it,
    /// four or two SHA-NI lanes as in [`Scheduler::fit_to_largest`].
    fn fit_wide(&self, largest: u64, total: u64, workers: usize, count: usize) -> Option<(usize, f64)> {
        let (wide, four) = self.wide_may_run()?;
        let break_even = ((WIDE_LANES as f64 * four / wide).ceil() as usize).max(2);
        if count < workers * break_even {
            return None;
        }
        // One and two lanes from the (L2-hot) lane calibration, scaled to
        // the streaming rate of four measured beside the wide kernel.
        let rates = self.kernel.calibrated().1;
        let rate = |lanes: usize| rates.iter().find(|r| r.0 == lanes).map_or(0.0, |r| r.1);
        if rate(4) <= 0.0 || rate(1) <= 0.0 {
            return None;
        }
        let (one, two) = (rate(1) * four / rate(4), rate(2) * four / rate(4));
        let share = total as f64 / workers as f64 / 1e9;
        let largest_gb = largest as f64 / 1e9;
        let in_a_lane = largest_gb * WIDE_LANES as f64 / wide;
        let alone_first = largest_gb / one + (share - largest_gb).max(0.0) / wide;
        let end_wide = (share / wide).max(in_a_lane.min(alone_first));
        let narrow = lanes_for_run(two, four, largest, total, workers);
        let core = if narrow == 2 { two } else { four };
        let end_narrow = (share / core).max(largest_gb * narrow as f64 / core);
        (end_wide < end_narrow).then_some((break_even, wide / one))
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
        // Where lanes were given, the wide kernel runs while at least half of
        // its lanes hold a message, and counts as 2.5 SHA-NI streams (the
        // ratio measured on AMD Zen 5 and Intel Emerald Rapids cores was
        // 2.1-2.5); where they were calibrated, by this CPU's rates (see
        // `fit_wide`).
        let mut plan = self.wide().map(|kernel| WidePlan {
            kernel,
            min_open: WIDE_LANES / 2,
            over_one_stream: 2.5,
        });
        if lanes == 4 && self.fit_lanes {
            match self.fit_wide(tasks[0].bytes, total, workers, tasks.len()) {
                Some((min_open, over_one_stream)) => {
                    lanes = WIDE_LANES;
                    plan = plan.map(|p| WidePlan {
                        min_open,
                        over_one_stream,
                        ..p
                    });
                }
                None => lanes = self.fit_to_largest(tasks[0].bytes, total, workers),
            }
        }
        let wide = plan.filter(|_| lanes > 4);
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
        let shared = Shared::new(self.kernel, wide, lanes, workers, dealt, tasks, progress.is_some());
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

#[cfg(test)]
mod tests {
    use super::*;

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
}
