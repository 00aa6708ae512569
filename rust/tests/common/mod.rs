//! Helpers shared by the integration tests.
#![allow(dead_code)]

pub mod wide_check;

use weight_checker::sha256::Wide;
use weight_checker::Kernel;

/// Whether the crate may run the wide kernel here: it detected it, and a
/// narrow kernel that hands it work (SHA-NI, not the portable one).
pub fn wide_usable() -> bool {
    Wide::detect().is_some() && Kernel::best_available() != Kernel::Portable
}

/// Counts the wide kernel's calls made for this thread from `start` to
/// `finish`, and reports by [`wide_check::report`]: a notice where the CPU
/// lacks the kernel, a failure in CI where it has it and the test did not
/// exercise it.
pub struct WideCheck {
    test: &'static str,
    before: u64,
}

impl WideCheck {
    pub fn start(test: &'static str) -> WideCheck {
        WideCheck {
            test,
            before: Wide::calls_on_this_thread(),
        }
    }

    pub fn finish(self) {
        let exercised = Wide::calls_on_this_thread() > self.before;
        wide_check::report(self.test, wide_usable(), exercised);
    }
}
