//! Choosing lanes on this CPU: the lane counts measured at first use
//! (once per process) and the environment override.

use std::sync::OnceLock;

use super::{digest_same_length, Kernel, Wide, H0, WIDE_LANES};

/// Environment variable that fixes the lanes per thread (1, 2 or 4 SHA-NI
/// lanes) instead of measuring them at first use; `16` asks for the wide
/// kernel where the CPU has it, for small messages of one length and for
/// streamed ones (SHA-NI lanes still take the few messages that end a run).
pub const LANES_ENV: &str = "WEIGHT_CHECKER_LANES";

fn env_lanes() -> Option<usize> {
    match std::env::var(LANES_ENV).ok()?.trim() {
        "1" => Some(1),
        "2" => Some(2),
        "4" => Some(4),
        "16" => Some(WIDE_LANES),
        _ => None,
    }
}

/// True when [`LANES_ENV`] asks for the wide kernel (`16`).
pub fn wide_requested() -> bool {
    static REQUESTED: OnceLock<bool> = OnceLock::new();
    *REQUESTED.get_or_init(|| env_lanes() == Some(WIDE_LANES))
}

impl Kernel {
    /// How many streams the scheduler interleaves per thread by default:
    /// [`LANES_ENV`] if set, else the fastest of 1, 2 and 4 as measured on
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
    /// measurement (`None` for a one-lane kernel or when [`LANES_ENV`] fixes
    /// it). A scheduler uses them to run fewer lanes on a few big messages.
    pub fn lane_rates(self) -> Option<[(usize, f64); 3]> {
        (self.max_lanes() > 1 && env_lanes().is_none()).then(|| self.calibrated().1)
    }

    /// GB/s of one core streaming 16 messages of 256 KiB (4 MiB, more than
    /// an L2 holds, so nearer the DRAM-fed rate of real tensors than the
    /// L2-hot lane calibration) through (the wide kernel, this kernel's four
    /// lanes), best of several runs, measured once per process at first use.
    /// `None` where this CPU lacks the wide kernel, for the portable kernel,
    /// and where [`LANES_ENV`] fixes the lanes. The scheduler hashes a run
    /// through the wide kernel only where these rates say it ends sooner
    /// (runs of many tensors on cores whose AVX-512 outruns SHA-NI x4: on a
    /// 2-vCPU AMD EPYC Zen 5, 5.3 against 3.8 GB/s); elsewhere it keeps SHA-NI.
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
            let mut best = (0f64, 0f64);
            for _ in 0..5 {
                let mut states = [H0; WIDE_LANES];
                let start = std::time::Instant::now();
                wide.compress16(states.each_mut(), msgs);
                std::hint::black_box(&states);
                best.0 = best
                    .0
                    .max((WIDE_LANES * LEN) as f64 / start.elapsed().as_secs_f64() / 1e9);
                let start = std::time::Instant::now();
                for (s, m) in states.chunks_exact_mut(4).zip(msgs.chunks_exact(4)) {
                    let [a, b, c, d] = s else { unreachable!() };
                    self.compress4([a, b, c, d], [m[0], m[1], m[2], m[3]]);
                }
                std::hint::black_box(&states);
                best.1 = best
                    .1
                    .max((WIDE_LANES * LEN) as f64 / start.elapsed().as_secs_f64() / 1e9);
            }
            best
        }))
    }

    /// The lane calibration, run once per process.
    pub(crate) fn calibrated(self) -> (usize, [(usize, f64); 3]) {
        static CHOSEN: OnceLock<(usize, [(usize, f64); 3])> = OnceLock::new();
        *CHOSEN.get_or_init(|| self.calibrate_lanes())
    }

    /// Measures this core's throughput with 1, 2 and 4 interleaved streams
    /// (best of several short runs over 4 x 256 KiB, a few ms in all) and
    /// returns the lane count to use (the fewest within 2% of the fastest)
    /// with the GB/s of each.
    pub fn calibrate_lanes(self) -> (usize, [(usize, f64); 3]) {
        const LEN: usize = 256 * 1024;
        let data: Vec<u8> = (0..4 * LEN)
            .map(|i| (i as u32).wrapping_mul(2654435761) as u8)
            .collect();
        let mut best = [(1usize, 0f64), (2, 0.0), (4, 0.0)];
        for _ in 0..5 {
            for entry in best.iter_mut() {
                let lanes = entry.0.min(self.max_lanes());
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
                let gbps = (4 * LEN) as f64 / start.elapsed().as_secs_f64() / 1e9;
                entry.1 = entry.1.max(gbps);
            }
        }
        (fewest_lanes_near_the_fastest(&best).min(self.max_lanes()), best)
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
        // the kernel and the lane calibration; only SHA-NI gets this far.
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
    /// of 4 KiB, L2-hot, best of several short runs: what
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
            let mut best = (0f64, 0f64);
            for _ in 0..7 {
                for (lanes, best_rate) in [(WIDE_LANES, &mut best.0), (own, &mut best.1)] {
                    let start = std::time::Instant::now();
                    std::hint::black_box(digest_same_length(self, lanes, &msgs));
                    let gbps = (N * LEN) as f64 / start.elapsed().as_secs_f64() / 1e9;
                    *best_rate = best_rate.max(gbps);
                }
            }
            best
        })
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
