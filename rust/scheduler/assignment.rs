//! A run's assignment: worker threads, lanes per worker, which kernel
//! each worker runs, and which of the largest messages are dealt to whom.
//! The closed-form estimates choose between narrow lanes (2 or 4) and the
//! wide kernel for every worker; the run model (`model`) may then give some
//! workers narrow lanes for the largest messages (then the wide kernel) and
//! the others the wide kernel.

use super::model::{self, Rates, Split};
use super::worker::WidePlan;
use super::{Scheduler, PARALLEL_MIN_BYTES};
use crate::sha256::{Wide, WIDE_LANES};

/// One run's assignment (see the module's doc).
#[derive(Clone, Copy, Debug)]
pub(super) struct Assignment {
    pub(super) workers: usize,
    /// Whether the workers run on rayon threads (else on the caller's).
    pub(super) parallel: bool,
    /// Messages each worker holds open (a narrow worker: `narrow.1`).
    pub(super) lanes: usize,
    /// How wide workers use the wide kernel; `None`: no worker does.
    pub(super) wide: Option<WidePlan>,
    /// A mixed split: the first `narrow.0` workers hold `narrow.1` messages
    /// each on narrow lanes and are the ones dealt to; once its dealt messages
    /// have ended, a narrow worker runs as the wide ones do. `(0, 0)`: every
    /// worker runs the same.
    pub(super) narrow: (usize, usize),
    /// The first `dealt` messages are dealt (see `Shared::next_task`).
    pub(super) dealt: usize,
}

impl Scheduler {
    /// The assignment for a run of messages of `sizes` bytes, largest first;
    /// `progress`: whether a callback reports progress (the caller's thread
    /// then waits, so even one worker runs on its own thread).
    pub(super) fn assignment(&self, sizes: &[u64], progress: bool) -> Assignment {
        let total: u64 = sizes.iter().sum();
        let mut workers = self.effective_threads().min(sizes.len()).max(1);
        let parallel = !(total < PARALLEL_MIN_BYTES || (workers == 1 && !progress));
        if !parallel {
            workers = 1;
        }
        // Messages are spread over the threads before lanes are stacked:
        // four big tensors on two threads run as 2 x 2 lanes on both cores,
        // not as 4 lanes on one. (A thread holding three runs the two with
        // the most bytes left, see `worker`.)
        let mut lanes = self.effective_lanes().min(sizes.len().div_ceil(workers)).max(1);
        // Where lanes were given, the wide kernel runs while at least half of
        // its lanes hold a message, and counts as 2.5 narrow streams (the
        // ratio measured on AMD Zen 5 and Intel Emerald Rapids cores was
        // 2.1-2.5); where they were calibrated, by this CPU's rates (see
        // `fit_wide`).
        let mut plan = self.wide().map(|kernel| WidePlan {
            kernel,
            min_open: WIDE_LANES / 2,
            over_one_stream: 2.5,
        });
        // Calibrated lanes, not cut by a short run: the run may choose the
        // wide kernel, or fewer narrow lanes for its largest message.
        if self.fit_lanes && lanes >= 2 && lanes == self.effective_lanes() {
            match self.fit_wide(sizes[0], total, workers, sizes.len()) {
                Some((min_open, over_one_stream)) => {
                    lanes = WIDE_LANES;
                    plan = plan.map(|p| WidePlan {
                        min_open,
                        over_one_stream,
                        ..p
                    });
                }
                None => lanes = self.fit_to_largest(sizes[0], total, workers),
            }
        }
        let mut wide = plan.filter(|_| lanes > 4);
        // Dealing (see `Shared::next_task`) only where the first thread to
        // start would otherwise take more than its share of all the bytes
        // with its first lanes (a few big tensors). Elsewhere it costs: a
        // thread that wakes late then starts its dealt big tensor late, and
        // that tensor ends the run (Llama-shaped set: -5%).
        let first: u64 = sizes.iter().take(lanes).sum();
        let mut dealt = if first.saturating_mul(workers as u64) > total {
            (workers * lanes).min(sizes.len())
        } else {
            0
        };
        // Some cores on narrow lanes for the largest messages and the others on
        // the wide kernel, where the run model says so (see `model`).
        let mut narrow = (0, 0);
        // (`fit_mixed` needs calibrated lanes: see `wide_may_run`.)
        if let (Some(p), true) = (plan, parallel) {
            let uniform = Split {
                narrow: if lanes > 4 { 0 } else { workers },
                narrow_lanes: lanes.min(4),
            };
            if let Some((mixed, min_open, over_one_stream)) = self.fit_mixed(sizes, workers, uniform, dealt > 0) {
                narrow = (mixed.narrow, mixed.narrow_lanes);
                lanes = WIDE_LANES;
                dealt = (mixed.narrow * mixed.narrow_lanes).min(sizes.len());
                wide = Some(WidePlan {
                    min_open,
                    over_one_stream,
                    ..p
                });
            }
        }
        // A message whose one stream outlasts everything else spread over
        // the other cores (a 1 GB embedding among 0.5 GB of others on two
        // cores) gets a worker of its own, from the start, on one lane: shared
        // with others on a core it would advance at a fraction of a stream and
        // end the run late (see `dominant_count`).
        if parallel && narrow == (0, 0) && workers >= 2 {
            if let Some((one, core)) = self.dedication_rates() {
                let d = dominant_count(sizes, workers, one, core);
                if d > 0 {
                    narrow = (d, 1);
                    dealt = d;
                }
            }
        }
        Assignment {
            workers,
            parallel,
            lanes,
            wide,
            narrow,
            dealt,
        }
    }

    /// How many of the largest messages of `sizes` (largest first) end the
    /// run, each alone on a worker of its own ([`dominant_count`] by this
    /// CPU's calibrated rates; 0 where they were not calibrated).
    pub fn dominant_chains(&self, sizes: &[u64]) -> usize {
        let workers = self.effective_threads().min(sizes.len()).max(1);
        match self.dedication_rates() {
            Some((one, core)) if workers >= 2 => dominant_count(sizes, workers, one, core),
            _ => 0,
        }
    }

    /// `(one stream's GB/s, a core's best GB/s)` for [`dominant_count`]:
    /// streaming rates where the wide kernel may run (see `model_rates`),
    /// else the lane calibration's; `None` where lanes were not calibrated.
    fn dedication_rates(&self) -> Option<(f64, f64)> {
        if !self.fit_lanes {
            return None;
        }
        if let Some((r, _)) = self.model_rates() {
            return Some((r.one, r.wide.max(r.four).max(r.two)));
        }
        let rates = self.kernel.calibrated().1;
        let rate = |lanes: usize| rates.iter().find(|r| r.0 == lanes).map_or(0.0, |r| r.1);
        let (one, core) = (rate(1), rate(2).max(rate(4)));
        (one > 0.0 && core > 0.0).then_some((one, core))
    }

    /// The assignment for a run of messages of `sizes` bytes in words, for
    /// benchmarks and diagnostics: `"2 workers on 4 narrow lanes (sha-ni)"`,
    /// `"2 workers on the 16-lane wide kernel (avx512, while 8+ open)"`, or
    /// a mixed split, `"2 workers: 1 on 4 narrow lanes (sha-ni) each until
    /// the dealt ones end, then wide; 1 on the 16-lane wide kernel
    /// (avx512)"`; each followed by `", the largest N dealt"` where some are.
    pub fn describe_assignment(&self, sizes: &[u64]) -> String {
        let mut sorted = sizes.to_vec();
        sorted.sort_unstable_by(|a, b| b.cmp(a));
        if sorted.is_empty() {
            return "no messages".into();
        }
        let l = self.assignment(&sorted, false);
        let dealt = if l.dealt > 0 {
            format!(", the largest {} dealt", l.dealt)
        } else {
            String::new()
        };
        let kernel = self.kernel;
        let plural = |n: usize| if n == 1 { "" } else { "s" };
        match (l.wide, l.narrow) {
            (Some(_), (n, lanes)) if n > 0 => format!(
                "{} workers: {n} on {lanes} narrow lane{} ({kernel}) each until the dealt ones end, then wide; \
                 {} on the {WIDE_LANES}-lane wide kernel ({}){dealt}",
                l.workers,
                plural(lanes),
                l.workers - n,
                Wide::NAME,
            ),
            (Some(p), _) => format!(
                "{} worker{} on the {WIDE_LANES}-lane wide kernel ({}, while {}+ open){dealt}",
                l.workers,
                plural(l.workers),
                Wide::NAME,
                p.min_open
            ),
            (None, (n, _)) if n > 0 => format!(
                "{} workers: {n} on 1 narrow lane ({kernel}) for {} largest alone, then as the others; {} on {} \
                 narrow lane{} ({kernel}){dealt}",
                l.workers,
                if n == 1 { "the" } else { "a" },
                l.workers - n,
                l.lanes,
                plural(l.lanes)
            ),
            (None, _) => format!(
                "{} worker{} on {} narrow lane{} ({kernel}){dealt}",
                l.workers,
                plural(l.workers),
                l.lanes,
                plural(l.lanes)
            ),
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

    /// Whether a run whose largest message has `largest` of `total` bytes in
    /// `count` messages ends sooner through the wide kernel, by this CPU's
    /// streaming rates ([`Kernel::wide_stream_rates`]); if so, the fewest
    /// open messages for which it still beats four narrow lanes (break-even:
    /// `open x wide / 16 = four-lane rate`) and its rate over one narrow
    /// stream's, which the workers plan by (see `WidePlan`).
    ///
    /// The estimate, per worker, with the wide kernel: its share of the bytes
    /// at the wide rate, unless the largest message ends it: at a sixteenth
    /// of the core, or hashed alone first at one stream's rate and the rest
    /// wide after, whichever is sooner (the workers choose so). Against it,
    /// four or two narrow lanes as in [`Scheduler::fit_to_largest`].
    fn fit_wide(&self, largest: u64, total: u64, workers: usize, count: usize) -> Option<(usize, f64)> {
        let (rates, break_even) = self.model_rates()?;
        wide_fits(rates, break_even, largest, total, workers, count)
    }

    /// This CPU's rates for the run model, where the wide kernel may run:
    /// the wide kernel and four narrow lanes streaming beside it, one and
    /// two lanes from the (L2-hot) lane calibration scaled to that
    /// streaming rate of four; and the break-even open count for the wide
    /// kernel, `16 x four / wide`.
    fn model_rates(&self) -> Option<(Rates, usize)> {
        let (wide, four) = self.wide_may_run()?;
        let rates = self.kernel.calibrated().1;
        let rate = |lanes: usize| rates.iter().find(|r| r.0 == lanes).map_or(0.0, |r| r.1);
        model_rates_from(wide, four, rate(1), rate(2), rate(4))
    }

    /// A mixed split by this CPU's rates (see [`model::best_mixed`]), with
    /// the wide workers' break-even open count and the wide kernel's rate
    /// over one narrow stream's.
    fn fit_mixed(&self, sizes: &[u64], workers: usize, uniform: Split, deal: bool) -> Option<(Split, usize, f64)> {
        let (rates, break_even) = self.model_rates()?;
        let split = model::best_mixed(sizes, rates, workers, uniform, deal, break_even)?;
        Some((split, break_even, rates.wide / rates.one))
    }
}

/// See [`Scheduler::model_rates`]: from the streaming rates `(wide, four)`
/// and the L2-hot lane calibration's 1, 2 and 4.
fn model_rates_from(wide: f64, four: f64, hot_one: f64, hot_two: f64, hot_four: f64) -> Option<(Rates, usize)> {
    let break_even = ((WIDE_LANES as f64 * four / wide).ceil() as usize).max(2);
    if hot_four <= 0.0 || hot_one <= 0.0 {
        return None;
    }
    let (one, two) = (hot_one * four / hot_four, hot_two * four / hot_four);
    Some((Rates { one, two, four, wide }, break_even))
}

/// Messages below this are never given a worker of their own: the gain
/// would not pay for the worker's wake-up.
const DOMINANT_MIN_BYTES: u64 = 8 << 20;

/// How many of the largest messages of `sizes_desc` (largest first) each
/// take longer alone, on one stream at `one` GB/s, than everything after
/// them spread over the other workers at `core` GB/s a core: those end the
/// run however the rest is laid out, so each is worth a worker of its own
/// from the start. At most `workers - 1` (one worker is left for the rest).
/// On two cores: one 1 GiB tensor among 0.5 GiB of others, 1; the
/// Llama-8B-shaped set (two 1 GB embeddings of 16 GB), 0.
pub(super) fn dominant_count(sizes_desc: &[u64], workers: usize, one: f64, core: f64) -> usize {
    if one <= 0.0 || core <= 0.0 || !one.is_finite() || !core.is_finite() {
        return 0;
    }
    let total: u64 = sizes_desc.iter().sum();
    let (mut d, mut top) = (0usize, 0u64);
    while d + 1 < workers && d < sizes_desc.len() && sizes_desc[d] >= DOMINANT_MIN_BYTES {
        top += sizes_desc[d];
        let rest = (total - top) as f64 / 1e9 / ((workers - d - 1) as f64 * core);
        if (sizes_desc[d] as f64 / 1e9) / one < rest {
            break;
        }
        d += 1;
    }
    d
}

/// See [`Scheduler::fit_wide`], by `rates`.
fn wide_fits(
    rates: Rates,
    break_even: usize,
    largest: u64,
    total: u64,
    workers: usize,
    count: usize,
) -> Option<(usize, f64)> {
    if count < workers * break_even {
        return None;
    }
    let Rates { one, two, four, wide } = rates;
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
    fn a_scheduler_calibrated_to_two_lanes_may_choose_the_wide_kernel() {
        // As on an Intel Xeon whose calibration chose two SHA-NI lanes: the
        // wide kernel must stay in the running wherever it outruns four
        // narrow lanes on this CPU (it used to need four lanes calibrated).
        let mut s = Scheduler::new(crate::sha256::Kernel::active(), 2, 2);
        s.fit_lanes = true;
        let Some((wide, four)) = s.kernel.wide_stream_rates().filter(|_| s.wide().is_some()) else {
            return; // no wide kernel on this CPU, or lanes fixed by the environment
        };
        if wide <= four {
            return;
        }
        let (rates, break_even) = s.model_rates().expect("calibrated two lanes kept the wide kernel out");
        let sizes = vec![16u64 << 20; 64];
        let fits = wide_fits(rates, break_even, sizes[0], sizes.iter().sum(), 2, sizes.len()).is_some();
        assert_eq!(s.assignment(&sizes, false).wide.is_some(), fits);
    }

    #[test]
    fn the_wide_kernel_fits_where_two_narrow_lanes_won_the_calibration() {
        // Intel Xeon (family 6 model 167, 2 vCPUs), as its calibration measured:
        // L2-hot 1 / 2 / 4 lanes 1.76 / 2.27 / 2.21 GB/s (two lanes chosen),
        // streaming wide 3.44, four narrow 2.21.
        let (rates, break_even) = model_rates_from(3.44, 2.21, 1.76, 2.27, 2.21).unwrap();
        assert_eq!(break_even, 11);
        let mib16 = 16u64 << 20;
        assert!(wide_fits(rates, break_even, mib16, 64 * mib16, 2, 64).is_some());
        // Too few messages to fill the lanes: narrow.
        assert!(wide_fits(rates, break_even, mib16, 8 * mib16, 2, 8).is_none());
        // A 70B layer (one 448 MiB tensor among 9): the largest ends the run
        // on a sixteenth of a core; narrow.
        assert!(wide_fits(rates, break_even, 448 << 20, 1_710_000_000, 2, 9).is_none());
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

    #[test]
    fn a_message_that_outlasts_the_rest_on_the_other_cores_gets_a_worker_of_its_own() {
        const M: u64 = 1 << 20;
        // An Intel Xeon's rates, as calibrated here: one stream 1.19 GB/s, a core 1.9.
        let (one, core) = (1.19, 1.9);
        // One 1 GiB tensor and 8 x 64 MiB, two cores: the tensor alone takes 0.90 s, the rest 0.28 s on a core.
        let dominated: Vec<u64> = std::iter::once(1024 * M).chain([64 * M; 8]).collect();
        assert_eq!(dominant_count(&dominated, 2, one, core), 1);
        // Llama-8B's shape (two 1.05 GB embeddings of 16 GB): on two cores the rest is the bound...
        let llama: Vec<u64> = [1050 * M; 2].into_iter().chain([116 * M; 120]).collect();
        assert_eq!(dominant_count(&llama, 2, one, core), 0);
        // ... on sixteen, both embeddings end the run.
        assert_eq!(dominant_count(&llama, 16, 1.28, 3.0), 2);
        // Equal tensors, one worker, small messages, no rates: none.
        assert_eq!(dominant_count(&[64 * M; 8], 2, one, core), 0);
        assert_eq!(dominant_count(&dominated, 1, one, core), 0);
        assert_eq!(dominant_count(&[4 * M, 1024], 2, one, core), 0);
        assert_eq!(dominant_count(&dominated, 2, 0.0, core), 0);
        assert_eq!(dominant_count(&dominated, 2, f64::NAN, core), 0);
        // Never every worker: one is left for the rest.
        assert_eq!(dominant_count(&[1024 * M, 1024 * M], 2, one, core), 1);
    }
}
