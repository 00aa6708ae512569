//! Choosing lanes on this CPU: the lane counts measured at first use
//! (once per process) and the environment override.

use std::sync::OnceLock;

use super::{digest_same_length, Kernel, Wide, H0, WIDE_LANES};
use crate::settings;

/// `WEIGHT_CHECKER_LANES` as it is now: the lanes per thread (1, 2 or 4 narrow
/// lanes) instead of measuring them at first use; `16` asks for the wide
/// kernel where the CPU has it, for small messages of one length and for
/// streamed ones (narrow lanes still take the few messages that end a run).
///
/// # Panics
/// On a value the variable does not accept (see [`crate::settings`]).
fn env_lanes() -> Option<usize> {
    settings::or_panic(settings::lanes())
}

/// True when `WEIGHT_CHECKER_LANES` asks for the wide kernel (`16`).
pub fn wide_requested() -> bool {
    static REQUESTED: OnceLock<bool> = OnceLock::new();
    *REQUESTED.get_or_init(|| env_lanes() == Some(WIDE_LANES))
}

impl Kernel {
    /// How many streams the scheduler interleaves per thread by default:
    /// `WEIGHT_CHECKER_LANES` if set, else the fastest of 1, 2 and 4 as measured on
    /// this CPU at first use (CPUs differ: 2 lanes win on some, 4 on others).
    pub fn default_lanes(self) -> usize {
        if self.max_lanes() == 1 {
            return 1;
        }
        match env_lanes() {
            Some(WIDE_LANES) if Wide::detect().is_some() => WIDE_LANES,
            Some(n) => n.min(self.max_lanes()),
            None => self.calibrated().0,
        }
    }

    /// This core's GB/s with 1, 2 and 4 lanes as measured for
    /// [`Kernel::default_lanes`], when the lane count comes from that
    /// measurement (`None` for a one-lane kernel or when `WEIGHT_CHECKER_LANES` fixes
    /// it). A scheduler uses them to run fewer lanes on a few big messages.
    pub fn lane_rates(self) -> Option<[(usize, f64); 3]> {
        (self.max_lanes() > 1 && env_lanes().is_none()).then(|| self.calibrated().1)
    }

    /// GB/s of one core streaming 16 messages of 256 KiB (4 MiB, more than
    /// an L2 holds, so nearer the DRAM-fed rate of real tensors than the
    /// L2-hot lane calibration) through (the wide kernel, this kernel's four
    /// lanes), best of at least five runs ([`BestOf`]), measured once per
    /// process at first use.
    /// `None` where this CPU lacks the wide kernel, for the portable kernel,
    /// and where `WEIGHT_CHECKER_LANES` fixes the lanes. The scheduler hashes a run
    /// through the wide kernel only where these rates say it ends sooner
    /// (runs of many tensors on cores whose AVX-512 outruns four narrow
    /// SHA-NI lanes: on a 2-vCPU AMD EPYC Zen 5, 5.3 against 3.8 GB/s);
    /// elsewhere it keeps the narrow lanes.
    pub fn wide_stream_rates(self) -> Option<(f64, f64)> {
        if self == Kernel::Portable || env_lanes().is_some() {
            return None;
        }
        let wide = Wide::detect()?;
        static RATES: OnceLock<(f64, f64)> = OnceLock::new();
        Some(*RATES.get_or_init(|| {
            const LEN: usize = 256 * 1024;
            let data: Vec<u8> = (0..WIDE_LANES * LEN)
                .map(|i| (i as u32).wrapping_mul(2654435761) as u8)
                .collect();
            let msgs: [&[u8]; WIDE_LANES] = std::array::from_fn(|i| &data[i * LEN..(i + 1) * LEN]);
            let gbps = |start: std::time::Instant| (WIDE_LANES * LEN) as f64 / start.elapsed().as_secs_f64() / 1e9;
            let mut best = BestOf::new(MAX_STREAM_ROUNDS);
            loop {
                let mut states = [H0; WIDE_LANES];
                let start = std::time::Instant::now();
                wide.compress16(states.each_mut(), msgs);
                std::hint::black_box(&states);
                let wide_rate = gbps(start);
                let start = std::time::Instant::now();
                for (s, m) in states.chunks_exact_mut(4).zip(msgs.chunks_exact(4)) {
                    let [a, b, c, d] = s else { unreachable!() };
                    self.compress4([a, b, c, d], [m[0], m[1], m[2], m[3]]);
                }
                std::hint::black_box(&states);
                if !best.record([wide_rate, gbps(start)]) {
                    break;
                }
            }
            let [wide_rate, four] = best.figures();
            (wide_rate, four)
        }))
    }

    /// The lane calibration, run once per process.
    pub(crate) fn calibrated(self) -> (usize, [(usize, f64); 3]) {
        static CHOSEN: OnceLock<(usize, [(usize, f64); 3])> = OnceLock::new();
        *CHOSEN.get_or_init(|| self.calibrate_lanes())
    }

    /// Measures this core's throughput with 1, 2 and 4 interleaved streams
    /// (best of at least five short runs over 4 x 256 KiB, [`BestOf`], a few
    /// ms in all) and
    /// returns the lane count to use (the fewest within 2% of the fastest)
    /// with the GB/s of each.
    pub fn calibrate_lanes(self) -> (usize, [(usize, f64); 3]) {
        const LEN: usize = 256 * 1024;
        let data: Vec<u8> = (0..4 * LEN)
            .map(|i| (i as u32).wrapping_mul(2654435761) as u8)
            .collect();
        const LANES: [usize; 3] = [1, 2, 4];
        let mut best = BestOf::new(MAX_LANE_ROUNDS);
        loop {
            let mut round = [0f64; 3];
            for (entry, &lanes) in round.iter_mut().zip(&LANES) {
                let lanes = lanes.min(self.max_lanes());
                let mut states = [H0; 4];
                let start = std::time::Instant::now();
                match lanes {
                    1 => (0..4).for_each(|i| self.compress1(&mut states[i], &data[i * LEN..(i + 1) * LEN])),
                    2 => {
                        for pair in 0..2 {
                            let (a, b) = states.split_at_mut(2 * pair + 1);
                            let d = &data[2 * pair * LEN..];
                            self.compress2([&mut a[2 * pair], &mut b[0]], [&d[..LEN], &d[LEN..2 * LEN]]);
                        }
                    }
                    _ => {
                        let [a, b, c, d] = &mut states;
                        let p: [&[u8]; 4] = std::array::from_fn(|i| &data[i * LEN..(i + 1) * LEN]);
                        self.compress4([a, b, c, d], p);
                    }
                }
                std::hint::black_box(&states);
                *entry = (4 * LEN) as f64 / start.elapsed().as_secs_f64() / 1e9;
            }
            if !best.record(round) {
                break;
            }
        }
        let rates = best.figures();
        let figures = std::array::from_fn(|i| (LANES[i], rates[i]));
        (fewest_lanes_near_the_fastest(&figures).min(self.max_lanes()), figures)
    }

    /// Lanes for many small messages of one length ([`digest_same_length`]):
    /// [`WIDE_LANES`] where this CPU has the wide kernel and it hashed 64
    /// messages of 4 KiB at least 2% faster than this kernel's own lanes at
    /// first use, else [`Kernel::default_lanes`]. `WEIGHT_CHECKER_LANES=16`
    /// asks for the wide kernel, any other value for this kernel's lanes.
    pub fn small_message_lanes(self) -> usize {
        if self == Kernel::Portable || Wide::detect().is_none() {
            return self.default_lanes();
        }
        // Decided once per process (the scheduler asks for every batch), like
        // the kernel and the lane calibration; only a multi-lane narrow
        // kernel (SHA-NI) gets this far.
        static CHOSEN: OnceLock<usize> = OnceLock::new();
        *CHOSEN.get_or_init(|| match env_lanes() {
            Some(WIDE_LANES) => WIDE_LANES,
            Some(_) => self.default_lanes(),
            None => {
                let (wide, own) = self.calibrate_small();
                if wide > 1.02 * own {
                    WIDE_LANES
                } else {
                    self.default_lanes()
                }
            }
        })
    }

    /// GB/s of (the wide kernel, this kernel's default lanes) on 64 messages
    /// of 4 KiB, L2-hot, best of at least five short runs ([`BestOf`]): what
    /// [`Kernel::small_message_lanes`] decides by, measured once.
    pub fn calibrate_small(self) -> (f64, f64) {
        static RATES: OnceLock<(f64, f64)> = OnceLock::new();
        *RATES.get_or_init(|| {
            const N: usize = 64;
            const LEN: usize = 4096;
            let data: Vec<u8> = (0..N * LEN)
                .map(|i| (i as u32).wrapping_mul(2654435761) as u8)
                .collect();
            let msgs: Vec<&[u8]> = data.chunks(LEN).collect();
            let own = self.default_lanes();
            let mut best = BestOf::new(MAX_LANE_ROUNDS);
            loop {
                let round = [WIDE_LANES, own].map(|lanes| {
                    let start = std::time::Instant::now();
                    std::hint::black_box(digest_same_length(self, lanes, &msgs));
                    (N * LEN) as f64 / start.elapsed().as_secs_f64() / 1e9
                });
                if !best.record(round) {
                    break;
                }
            }
            let [wide, own] = best.figures();
            (wide, own)
        })
    }
}

/// Rounds every calibration runs at least (each round measures every
/// candidate once, interleaved, so that load hits them alike).
const MIN_ROUNDS: usize = 5;
/// Rounds in a row that raise no figure by more than [`RAISE`] before a
/// calibration stops.
const SETTLED_ROUNDS: usize = 3;
/// What counts as a raise: timing jitter alone (about 1% on an idle core)
/// does not keep a calibration going.
const RAISE: f64 = 1.01;
/// Upper bounds on the rounds: about 1 ms a round for the lane and
/// small-message calibrations (40 ms at most, once per process), about
/// 2 ms for the streaming one.
const MAX_LANE_ROUNDS: usize = 40;
const MAX_STREAM_ROUNDS: usize = 20;

/// The best of each candidate's throughput over rounds of measurement,
/// measuring on while rounds still raise a figure.
///
/// Load only ever slows a measurement, so the best round is the nearest to
/// the core's own rate. A fixed five rounds keep whatever the first few
/// milliseconds gave, and the lane choice made from them lasts the whole
/// process: a core still raising its clock after idling, or load that
/// eases off as calibration runs, leaves figures that are still rising at
/// the fifth round. Measuring until [`SETTLED_ROUNDS`] rounds in a row add
/// nothing follows them to the top. (It cannot see past load that lasts
/// longer than the calibration itself: seen once on a 2-vCPU AMD EPYC, 4
/// lanes at 2.89 GB/s against 3.5-3.7 usually, so 2 lanes were chosen for
/// that process. `WEIGHT_CHECKER_LANES` fixes the lanes where that matters.)
#[derive(Clone, Debug)]
struct BestOf<const N: usize> {
    best: [f64; N],
    rounds: usize,
    max_rounds: usize,
    unraised: usize,
}

impl<const N: usize> BestOf<N> {
    fn new(max_rounds: usize) -> BestOf<N> {
        BestOf {
            best: [0.0; N],
            rounds: 0,
            max_rounds: max_rounds.max(MIN_ROUNDS),
            unraised: 0,
        }
    }

    /// Records one round's figures (GB/s, one per candidate; non-finite
    /// figures, from a timer that read zero, are ignored) and says whether
    /// to measure another round.
    fn record(&mut self, round: [f64; N]) -> bool {
        let mut raised = false;
        for (best, figure) in self.best.iter_mut().zip(round) {
            if figure.is_finite() && figure > *best {
                raised |= figure > RAISE * *best;
                *best = figure;
            }
        }
        self.rounds += 1;
        self.unraised = if raised { 0 } else { self.unraised + 1 };
        self.rounds < self.max_rounds && (self.rounds < MIN_ROUNDS || self.unraised < SETTLED_ROUNDS)
    }

    fn figures(&self) -> [f64; N] {
        self.best
    }
}

/// The fewest lanes within 2% of the fastest of `(lanes, GB/s)` figures:
/// fewer open messages per thread balance better at the end of a run, and
/// L2-hot figures flatter wide kernels a little against data streamed from
/// DRAM. 1 where no figure is usable.
fn fewest_lanes_near_the_fastest(figures: &[(usize, f64)]) -> usize {
    let top = figures
        .iter()
        .map(|f| f.1)
        .filter(|r| r.is_finite())
        .fold(0.0, f64::max);
    figures
        .iter()
        .find(|f| f.1.is_finite() && f.1 >= 0.98 * top && f.1 > 0.0)
        .map_or(1, |f| f.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Feeds `rounds` to a fresh [`BestOf`] until it stops; returns how many
    /// it took and the figures.
    fn calibrate_over(rounds: impl IntoIterator<Item = [f64; 2]>, max_rounds: usize) -> (usize, [f64; 2]) {
        let mut best = BestOf::new(max_rounds);
        let mut taken = 0;
        for round in rounds {
            taken += 1;
            if !best.record(round) {
                break;
            }
        }
        (taken, best.figures())
    }

    #[test]
    fn a_steady_core_is_measured_for_the_minimum_rounds() {
        let steady = std::iter::repeat([3.0, 3.6]);
        assert_eq!(calibrate_over(steady, 40), (MIN_ROUNDS, [3.0, 3.6]));
        // Jitter under 1% raises the figures but does not prolong it.
        let jitter = [
            [3.0, 3.6],
            [3.02, 3.61],
            [3.0, 3.62],
            [3.025, 3.6],
            [3.0, 3.6],
            [3.0, 3.6],
        ];
        assert_eq!(calibrate_over(jitter, 40), (MIN_ROUNDS, [3.025, 3.62]));
    }

    #[test]
    fn figures_still_rising_after_the_minimum_rounds_are_followed_to_the_top() {
        // A core raising its clock (or load easing off) over the first rounds:
        // five fixed rounds would keep 3.3 GB/s for 4 lanes.
        let ramp = (0..7).map(|i| [2.5 + 0.1 * f64::from(i), 2.9 + 0.1 * f64::from(i)]);
        let top = std::iter::repeat([3.1, 3.6]);
        let (taken, figures) = calibrate_over(ramp.chain(top), 40);
        assert_eq!(figures, [3.1, 3.6]);
        assert_eq!(taken, 7 + 1 + SETTLED_ROUNDS);
        // Load that lasts the whole minimum is not seen past (documented).
        let loaded = std::iter::repeat_n([2.8, 2.89], MIN_ROUNDS);
        let (taken, figures) = calibrate_over(loaded.chain(std::iter::repeat([3.3, 3.7])), 40);
        assert_eq!((taken, figures), (MIN_ROUNDS, [2.8, 2.89]));
    }

    #[test]
    fn a_calibration_that_never_settles_stops_at_its_bound() {
        let rising = (0..).map(|i| [1.0 + 0.1 * f64::from(i), 2.0]);
        let (taken, figures) = calibrate_over(rising, 12);
        assert_eq!(taken, 12);
        assert!((figures[0] - 2.1).abs() < 1e-9, "{figures:?}");
        // Unusable figures neither count as a raise nor replace a figure.
        let broken = std::iter::repeat([f64::NAN, f64::INFINITY]);
        assert_eq!(calibrate_over(broken, 40), (MIN_ROUNDS, [0.0, 0.0]));
    }

    /// Figures as the calibration measured them on real cores, and the
    /// lanes each must give.
    #[test]
    fn the_fewest_lanes_within_two_percent_of_the_fastest_are_chosen() {
        // AMD EPYC Zen 4 and Zen 5 (2 vCPUs): four lanes well ahead.
        assert_eq!(fewest_lanes_near_the_fastest(&[(1, 1.8), (2, 3.3), (4, 3.6)]), 4);
        assert_eq!(fewest_lanes_near_the_fastest(&[(1, 2.12), (2, 3.21), (4, 3.81)]), 4);
        // Intel Emerald Rapids: two lanes 5% behind four, still four.
        assert_eq!(fewest_lanes_near_the_fastest(&[(1, 1.4), (2, 1.8), (4, 1.9)]), 4);
        // Two lanes within 2% of four: two (fewer open messages).
        assert_eq!(fewest_lanes_near_the_fastest(&[(1, 1.4), (2, 1.88), (4, 1.9)]), 2);
        // A core where interleaving gains nothing: one.
        assert_eq!(fewest_lanes_near_the_fastest(&[(1, 2.0), (2, 1.99), (4, 2.0)]), 1);
        // Unusable figures (a timer that read zero, NaN): one, no panic.
        assert_eq!(fewest_lanes_near_the_fastest(&[(1, 0.0), (2, 0.0), (4, 0.0)]), 1);
        assert_eq!(fewest_lanes_near_the_fastest(&[(1, f64::NAN), (2, 3.0), (4, 2.0)]), 2);
    }
}
