//! Choosing lanes on this CPU: the lane counts measured at first use
//! (once per process) and the environment override.

use std::sync::OnceLock;

use super::{digest_same_length, Kernel, Wide, H0, WIDE_LANES};

/// Environment variable that fixes the streams interleaved per thread (1, 2
/// or 4) instead of measuring them at first use; `16` asks for the wide
/// kernel for small messages of one length (large ones keep 4 SHA-NI lanes).
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
        if let Some(n) = env_lanes() {
            return n.min(self.max_lanes());
        }
        self.calibrated().0
    }

    /// This core's GB/s with 1, 2 and 4 lanes as measured for
    /// [`Kernel::default_lanes`], when the lane count comes from that
    /// measurement (`None` for a one-lane kernel or when [`LANES_ENV`] fixes
    /// it). A scheduler uses them to run fewer lanes on a few big messages.
    pub fn lane_rates(self) -> Option<[(usize, f64); 3]> {
        (self.max_lanes() > 1 && env_lanes().is_none()).then(|| self.calibrated().1)
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
        // The fewest lanes within 2% of the fastest: fewer open messages per
        // thread balance better at the end of a run, and the L2-hot figures
        // here flatter wide kernels a little against data streamed from DRAM.
        let top = best.iter().map(|b| b.1).fold(0.0, f64::max);
        let chosen = best.iter().find(|b| b.1 >= 0.98 * top).unwrap().0;
        (chosen.min(self.max_lanes()), best)
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
                for (lanes, slot) in [(WIDE_LANES, &mut best.0), (own, &mut best.1)] {
                    let start = std::time::Instant::now();
                    std::hint::black_box(digest_same_length(self, lanes, &msgs));
                    let gbps = (N * LEN) as f64 / start.elapsed().as_secs_f64() / 1e9;
                    *slot = slot.max(gbps);
                }
            }
            best
        })
    }
}
