//! How many worker threads a scheduler runs: the process-wide default
//! (a vLLM worker's share of the host) and its environment override.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::OnceLock;

use crate::settings;
pub use crate::settings::THREADS_ENV;

static DEFAULT_THREADS: AtomicUsize = AtomicUsize::new(0);

/// Sets the worker threads an [`Scheduler::default`] uses (0: all cores), unless
/// [`THREADS_ENV`] is set, which always wins. A vLLM worker sets its share of
/// the host here, so that eight workers on one host do not each start one
/// thread per core.
///
/// [`Scheduler::default`]: super::Scheduler::default
pub fn set_default_threads(threads: usize) {
    DEFAULT_THREADS.store(threads, Ordering::Relaxed);
}

/// [`THREADS_ENV`] as it was at first use.
///
/// # Panics
/// At first use, on a value the variable does not accept (see
/// [`crate::settings`]).
fn env_threads() -> Option<usize> {
    static ENV: OnceLock<Option<usize>> = OnceLock::new();
    *ENV.get_or_init(|| settings::or_panic(settings::threads()))
}

/// The worker threads a default scheduler runs: [`THREADS_ENV`], else what
/// [`set_default_threads`] set, else rayon's pool size (the cores in this
/// process's CPU affinity).
pub fn default_threads() -> usize {
    if let Some(n) = env_threads() {
        return n;
    }
    match DEFAULT_THREADS.load(Ordering::Relaxed) {
        0 => rayon::current_num_threads(),
        n => n,
    }
}
