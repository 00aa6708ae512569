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
//! Two kernel families run the lanes. A *narrow* kernel hashes one message
//! per stream and interleaves 1, 2 or 4 streams on a thread (SHA-NI on x86,
//! the portable `sha2` path elsewhere); the *wide* kernel (16-lane AVX-512
//! multi-buffer) hashes sixteen messages in the lanes of one vector. A
//! thread holds 1, 2 or 4 narrow lanes, or 16 where this CPU's rates say a
//! run of many messages ends sooner with the wide kernel
//! (`Scheduler::fit_wide`); a thread holding 16 runs them wide while enough
//! are open and on narrow lanes for the rest (`worker`). Where a small
//! simulation of the run with this CPU's rates says so (`model`,
//! `assignment`), some threads hold the largest messages on narrow lanes
//! while the others run the rest wide: a Llama-shaped set's two embeddings
//! on one core, its layers on the other.
//!
//! Three refinements matter when a few tensors of hundreds of MB make up
//! the work, since one of them then ends the run: the largest are dealt
//! across the threads when taking them in order would put more than a
//! thread's share on the first to start (`Shared::next_task`); a thread
//! runs the messages with the most bytes left on narrow lanes (two of three
//! at full two-lane speed rather than all three at two-plus-one; the one
//! that would crawl in a wide lane alone), see `worker`; and lanes whose
//! addresses alias are moved apart (`dephase`).

mod assignment;
mod batches;
mod dephase;
mod model;
mod multi;
mod report;
mod source;
mod threads;
mod worker;

use std::sync::atomic::Ordering;
use std::time::Duration;

use assignment::Assignment;
pub use batches::{batches_floor, hash_batched, BatchQueue, Batches};
pub use multi::MultiHasher;
pub use report::{last_run, BatchTally, RunShape, RunSummary};
pub use source::{ChunkSource, Slices};
pub use threads::{default_threads, foreground, in_background, set_default_threads, THREADS_ENV};
use worker::{worker, Shared, Task};

use crate::error::Error;
use crate::settings::{self, SettingError};
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

/// How to hash: which narrow kernel, how many lanes per thread, how many
/// threads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Scheduler {
    /// The narrow kernel (the wide one is used where the CPU has it and
    /// `lanes` or this CPU's rates ask for it).
    pub kernel: Kernel,
    /// Messages each thread holds open (1, 2 or 4 narrow lanes; 16 for the
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
    /// The process's scheduler: the active kernel, the lanes
    /// `WEIGHT_CHECKER_LANES` fixes or this CPU's calibration chose, the
    /// default threads.
    ///
    /// # Panics
    /// If one of the core's settings holds a value it does not accept (see
    /// [`crate::settings`]; [`Scheduler::from_env`] returns the error).
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
    /// [`Scheduler::default`], after checking the core's settings as the
    /// environment holds them now: an invalid one is an error naming it.
    pub fn from_env() -> Result<Scheduler, SettingError> {
        settings::check()?;
        Ok(Scheduler::default())
    }

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
    /// choose the wide kernel: it exists here and outruns four narrow lanes.
    /// Whichever narrow count the calibration chose (2 or 4): on an Intel Xeon
    /// (family 6 model 167, 2 vCPUs) two SHA-NI lanes win the L2-hot calibration
    /// (2.27 vs 2.21 GB/s) while the wide kernel streams 3.4 GB/s, and asking
    /// for four here kept every run of that CPU off the wide kernel (a
    /// Llama-shaped set 0.25 s where the wide kernel took 0.20).
    fn wide_may_run(&self) -> Option<(f64, f64)> {
        if !self.fit_lanes || self.effective_lanes() < 2 {
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

    /// Whether runs of this scheduler may use the wide kernel: this CPU has
    /// it, the narrow kernel may hand it work, and 16 lanes were asked for
    /// or this CPU's calibration lets runs choose it (streamed runs of many
    /// messages, [`Scheduler::streams`], or small messages of one length,
    /// [`Scheduler::same_length_lanes`]). Calibrates at first use.
    pub fn may_use_wide(&self) -> bool {
        self.wide().is_some()
            && (self.effective_lanes() == WIDE_LANES
                || self.wide_may_run().is_some()
                || self.same_length_lanes() == WIDE_LANES)
    }

    /// The kernels runs of this scheduler may use: the narrow kernel's name
    /// (`sha-ni`, `portable`), with `+avx512-x16` where they may use the
    /// 16-lane wide kernel ([`Scheduler::may_use_wide`]).
    pub fn kernel_name(&self) -> &'static str {
        match self.kernel {
            #[cfg(target_arch = "x86_64")]
            Kernel::ShaNi if self.may_use_wide() => "sha-ni+avx512-x16",
            kernel => kernel.name(),
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

    /// SHA-256 of each buffer, in input order. Records the run's shape for
    /// [`last_run`].
    pub fn hash_many(&self, buffers: &[&[u8]]) -> Vec<Digest> {
        let (digests, shape) = self.hash_many_shaped(buffers);
        report::record(shape);
        digests
    }

    /// [`Scheduler::hash_many`] and the run's shape (`None`: no buffers),
    /// not recorded for [`last_run`] (a batch of [`Batches`] is no run of
    /// its caller's).
    pub(crate) fn hash_many_shaped(&self, buffers: &[&[u8]]) -> (Vec<Digest>, Option<RunShape>) {
        let sources: Vec<Slices<'_>> = buffers.iter().map(std::slice::from_ref).map(Slices::new).collect();
        let (digests, shape) = self.hash_sources_shaped(sources, None);
        let digests = digests.expect("in-memory sources cannot fail and nothing can cancel");
        (digests, shape)
    }

    /// SHA-256 of each streamed message, in input order. `progress(done,
    /// total)` (bytes) is called on the calling thread about every 100 ms and
    /// once at the end; returning false cancels the run ([`Error::Cancelled`]).
    /// The first error a source returns stops every worker and is returned.
    ///
    /// Records the run's shape for [`last_run`], whether it succeeded or not.
    pub fn hash_sources<S: ChunkSource>(
        &self,
        sources: Vec<S>,
        progress: Option<&mut dyn FnMut(u64, u64) -> bool>,
    ) -> Result<Vec<Digest>, Error> {
        let (digests, shape) = self.hash_sources_shaped(sources, progress);
        report::record(shape);
        digests
    }

    fn hash_sources_shaped<S: ChunkSource>(
        &self,
        mut sources: Vec<S>,
        progress: Option<&mut dyn FnMut(u64, u64) -> bool>,
    ) -> (Result<Vec<Digest>, Error>, Option<RunShape>) {
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
                marks: None,
            })
            .collect();
        let (result, shape) = self.run(tasks, progress);
        (result.map(|()| digests), shape)
    }

    /// An incremental hasher of `n` digests driven by this scheduler.
    pub fn multi(&self, n: usize) -> MultiHasher {
        MultiHasher::new(*self, n)
    }

    /// A multi-hasher continuing these chain states (each an exported
    /// [`crate::sha256::Sha256`] state, already checked by its import).
    pub fn resume(&self, states: Vec<crate::sha256::Sha256>) -> MultiHasher {
        MultiHasher::resume(*self, states)
    }

    /// Hashes `tasks`; returns the outcome and the run's shape (`None`: no
    /// tasks).
    fn run<S: ChunkSource>(
        &self,
        tasks: Vec<Task<'_, S>>,
        progress: Option<&mut dyn FnMut(u64, u64) -> bool>,
    ) -> (Result<(), Error>, Option<RunShape>) {
        if tasks.is_empty() {
            let outcome = match progress.map(|p| p(0, 0)) {
                Some(false) => Err(Error::Cancelled),
                _ => Ok(()),
            };
            return (outcome, None);
        }
        let messages = tasks.len();
        let mut shape = None;
        let outcome = self.run_tasks(tasks, progress, &mut shape);
        debug_assert!(shape.is_some_and(|s| s.messages == messages));
        (outcome, shape)
    }

    fn run_tasks<S: ChunkSource>(
        &self,
        mut tasks: Vec<Task<'_, S>>,
        mut progress: Option<&mut dyn FnMut(u64, u64) -> bool>,
        shape: &mut Option<RunShape>,
    ) -> Result<(), Error> {
        // Stable sort: equal sizes keep input order, which keeps runs repeatable.
        tasks.sort_by_key(|t| std::cmp::Reverse(t.bytes));
        let total: u64 = tasks.iter().map(|t| t.bytes).sum();
        let sizes: Vec<u64> = tasks.iter().map(|t| t.bytes).collect();
        let assignment = self.assignment(&sizes, progress.is_some());
        *shape = Some(RunShape::of(self.kernel, &assignment, tasks.len()));
        let Assignment { workers, parallel, .. } = assignment;
        let shared = Shared::new(self.kernel, &assignment, tasks, progress.is_some());
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
        // The run was started on this thread: its wide-kernel calls count here.
        Wide::count_calls(shared.wide_calls.load(Ordering::Relaxed));
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
