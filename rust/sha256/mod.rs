//! SHA-256 with pluggable compression kernels.
//!
//! The state machine (buffering, padding, length) lives here once; the
//! kernels only implement the compression function, for one stream or for
//! several independent streams advanced together. That split lets the
//! scheduler in [`crate::scheduler`] pair unrelated messages block-for-block
//! without knowing which instruction set runs them.

mod calibrate;
mod portable;
mod same_length;
mod state;
#[cfg(target_arch = "x86_64")]
mod x86_avx512;
#[cfg(target_arch = "x86_64")]
mod x86_shani;

use std::cell::Cell;
use std::fmt;
use std::sync::OnceLock;

pub use calibrate::wide_requested;
pub use same_length::digest_same_length;
pub(crate) use same_length::same_length_split;
pub(crate) use state::is_all_zero;
pub use state::{digest_with, Digest, Sha256};

use crate::settings::{self, KernelSetting};
pub use crate::settings::{KERNEL_ENV, LANES_ENV};

/// Messages the wide (AVX-512 multi-buffer) kernel advances together.
pub const WIDE_LANES: usize = 16;

thread_local! {
    /// Calls of the wide kernel made for work this thread started (see
    /// [`Wide::calls_on_this_thread`]): thread-local, so that counting costs
    /// no shared cache line.
    static WIDE_CALLS: Cell<u64> = const { Cell::new(0) };
}

/// The 16-lane AVX-512 multi-buffer kernel: a token that exists only once
/// run-time detection found `avx512f` and `avx512bw`, so that its
/// compression function is safe to call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Wide(());

impl Wide {
    /// The wide kernel's name where one is shown to users (the narrow
    /// kernel's is [`Kernel::name`]).
    pub const NAME: &'static str = "avx512";

    /// The kernel, where this CPU has it (detected at run time, whatever
    /// the settings).
    pub fn detect() -> Option<Wide> {
        #[cfg(target_arch = "x86_64")]
        {
            if x86_avx512::is_supported() {
                return Some(Wide(()));
            }
        }
        None
    }

    /// How many times the wide kernel's compression ran for work the
    /// calling thread started: [`digest_same_length`] called on it, and
    /// scheduler runs it started (whichever threads ran their workers; each
    /// call advances sixteen messages by up to one step). The calibrations'
    /// own measurements are not counted. The tests' evidence that they
    /// exercised the kernel, not a guess from the settings.
    pub fn calls_on_this_thread() -> u64 {
        WIDE_CALLS.with(Cell::get)
    }

    /// Adds `calls` made for work this thread started (counted by the
    /// caller, once per run or batch, never per call).
    pub(crate) fn count_calls(calls: u64) {
        if calls > 0 {
            WIDE_CALLS.with(|c| c.set(c.get() + calls));
        }
    }

    /// Compresses sixteen independent streams of the same number of whole blocks.
    #[inline]
    pub(crate) fn compress16(self, states: [&mut [u32; 8]; WIDE_LANES], blocks: [&[u8]; WIDE_LANES]) {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: a `Wide` is only constructed by `detect`, after
        // `is_supported` confirmed every target feature the kernel enables.
        unsafe {
            x86_avx512::compress(states, blocks)
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            let _ = (states, blocks);
            unreachable!("Wide is only constructed on x86-64")
        }
    }
}

pub const BLOCK_LEN: usize = 64;

/// Bytes a stream advances per kernel call. Small enough that the all-zero
/// check and the hash read the same bytes while they sit in L2, large enough
/// that per-call overhead vanishes.
pub const STEP_BYTES: usize = 64 * 1024;

/// SHA-256's 64 round constants, aligned for whole-vector loads.
#[repr(align(64))]
pub(crate) struct RoundConstants(pub(crate) [u32; 64]);

pub(crate) static ROUND_CONSTANTS: RoundConstants = RoundConstants([
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5, 0xd807aa98,
    0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174, 0xe49b69c1, 0xefbe4786,
    0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da, 0x983e5152, 0xa831c66d, 0xb00327c8,
    0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967, 0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13,
    0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85, 0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819,
    0xd6990624, 0xf40e3585, 0x106aa070, 0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a,
    0x5b9cca4f, 0x682e6ff3, 0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7,
    0xc67178f2,
]);

const H0: [u32; 8] = [
    0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a, 0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19,
];

/// Which narrow compression function runs the blocks: one message per
/// stream, up to [`Kernel::max_lanes`] streams interleaved on one thread.
/// (The wide kernel, sixteen messages in the lanes of one vector, is
/// [`Wide`].)
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Kernel {
    /// `sha2::compress256`: one stream at a time (itself SHA-NI accelerated
    /// when available, detected at run time by `sha2`).
    Portable,
    /// Our interleaved SHA-NI kernels: up to four streams in one loop. Only
    /// constructed after run-time detection of the required CPU features.
    #[cfg(target_arch = "x86_64")]
    ShaNi,
}

impl Kernel {
    /// The fastest kernel this CPU supports.
    pub fn best_available() -> Kernel {
        #[cfg(target_arch = "x86_64")]
        {
            if x86_shani::is_supported() {
                return Kernel::ShaNi;
            }
        }
        Kernel::Portable
    }

    /// The kernel [`KERNEL_ENV`] selects on this CPU: `portable`, else the
    /// best available (`sha-ni` fails over to `portable` where the CPU
    /// lacks the instructions).
    pub fn from_setting(setting: KernelSetting) -> Kernel {
        match setting {
            KernelSetting::Portable => Kernel::Portable,
            KernelSetting::Auto | KernelSetting::ShaNi => Kernel::best_available(),
        }
    }

    /// The kernel in force for this process: [`KERNEL_ENV`] as it was at
    /// first use, else the best.
    ///
    /// # Panics
    /// If [`KERNEL_ENV`] holds a value it does not accept at first use
    /// (check with [`crate::settings::check`] first).
    pub fn active() -> Kernel {
        static ACTIVE: OnceLock<Kernel> = OnceLock::new();
        *ACTIVE.get_or_init(|| Kernel::from_setting(settings::or_panic(settings::kernel())))
    }

    /// Every kernel usable on this CPU (for tests and benchmarks).
    pub fn all_available() -> Vec<Kernel> {
        let mut all = vec![Kernel::Portable];
        let best = Kernel::best_available();
        if best != Kernel::Portable {
            all.push(best);
        }
        all
    }

    /// How many streams the kernel advances together at best.
    pub fn max_lanes(self) -> usize {
        match self {
            Kernel::Portable => 1,
            #[cfg(target_arch = "x86_64")]
            Kernel::ShaNi => 4,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Kernel::Portable => "portable",
            #[cfg(target_arch = "x86_64")]
            Kernel::ShaNi => "sha-ni",
        }
    }

    /// Compresses `blocks.len() / 64` whole blocks into `state`.
    #[inline]
    pub(crate) fn compress1(self, state: &mut [u32; 8], blocks: &[u8]) {
        debug_assert_eq!(blocks.len() % BLOCK_LEN, 0);
        match self {
            Kernel::Portable => portable::compress(state, blocks),
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `ShaNi` is only returned by `best_available`, after
            // `is_supported` confirmed every target feature the kernel enables.
            Kernel::ShaNi => unsafe { x86_shani::compress::<1>([state], [blocks]) },
        }
    }

    /// Compresses two independent streams of the same number of blocks.
    #[inline]
    pub(crate) fn compress2(self, s: [&mut [u32; 8]; 2], blocks: [&[u8]; 2]) {
        debug_assert_eq!(blocks[0].len(), blocks[1].len());
        match self {
            Kernel::Portable => {
                let [a, b] = s;
                portable::compress(a, blocks[0]);
                portable::compress(b, blocks[1]);
            }
            #[cfg(target_arch = "x86_64")]
            // SAFETY: as in `compress1`, the features were detected.
            Kernel::ShaNi => unsafe { x86_shani::compress::<2>(s, blocks) },
        }
    }

    /// Compresses four independent streams of the same number of blocks.
    #[inline]
    pub(crate) fn compress4(self, s: [&mut [u32; 8]; 4], blocks: [&[u8]; 4]) {
        match self {
            Kernel::Portable => {
                for (state, b) in s.into_iter().zip(blocks) {
                    portable::compress(state, b);
                }
            }
            #[cfg(target_arch = "x86_64")]
            // SAFETY: as in `compress1`, the features were detected.
            Kernel::ShaNi => unsafe { x86_shani::compress::<4>(s, blocks) },
        }
    }
}

impl fmt::Display for Kernel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}
