//! How many worker threads a scheduler runs: the process-wide default
//! (a vLLM worker's share of the host) and its environment override; and
//! background runs, on their own thread, that give way to foreground work
//! (the FP8 kernels) and stop when their owner cancels them.

use std::cell::RefCell;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::Duration;

use crate::settings;
pub use crate::settings::THREADS_ENV;

static DEFAULT_THREADS: AtomicUsize = AtomicUsize::new(0);

thread_local! {
    /// Inside [`in_background`], the run's cancel flag: the runs this thread
    /// starts use it alone, give way to [`foreground`] work between steps,
    /// and stop once the flag is set.
    static BACKGROUND: RefCell<Option<Arc<AtomicBool>>> = const { RefCell::new(None) };
}

/// Foreground calls under way ([`foreground`]), and what a background run
/// waiting for them to end sleeps on.
static FOREGROUND: AtomicUsize = AtomicUsize::new(0);
static FOREGROUND_ENDED: (Mutex<()>, Condvar) = (Mutex::new(()), Condvar::new());

/// Runs `f` as a background hasher: every default scheduler it starts on
/// this thread runs one worker, this thread itself (no pool thread takes
/// part, whatever [`THREADS_ENV`] or [`set_default_threads`] say), and
/// waits between two steps while [`foreground`] work runs anywhere in the
/// process. For a thread at the idle scheduling policy: on this 2-vCPU
/// Intel Xeon, a task at that policy hashing beside the FP8 kernels slowed
/// them from 2.9 to 2.0 GB/s (the pool's threads did not get their cores
/// back at once); waiting leaves it only the time they leave idle. A run
/// under way when `cancelled` is set stops at its next step
/// ([`crate::Error::Cancelled`]); the flag is its owner's alone, so one
/// owner's cancel stops no other's runs.
pub fn in_background<T>(cancelled: &Arc<AtomicBool>, f: impl FnOnce() -> T) -> T {
    /// Restores the flag as it was, also when `f` panics.
    struct Restore(Option<Arc<AtomicBool>>);
    impl Drop for Restore {
        fn drop(&mut self) {
            BACKGROUND.with(|flag| *flag.borrow_mut() = self.0.take());
        }
    }
    let _restore = Restore(BACKGROUND.with(|flag| flag.replace(Some(cancelled.clone()))));
    f()
}

/// Runs `f` as foreground work: background runs ([`in_background`]) wait
/// until it returns (each after the step it is in).
pub fn foreground<T>(f: impl FnOnce() -> T) -> T {
    /// Ends the foreground call, also when `f` panics; the last one wakes the waiters.
    struct End;
    impl Drop for End {
        fn drop(&mut self) {
            if FOREGROUND.fetch_sub(1, Ordering::SeqCst) == 1 {
                // Not under the waiters' lock: a waiter at the idle policy may
                // hold it, preempted, for a while. One between its check and
                // its wait misses this, and wakes by its 5 ms timeout.
                FOREGROUND_ENDED.1.notify_all();
            }
        }
    }
    FOREGROUND.fetch_add(1, Ordering::SeqCst);
    let _end = End;
    f()
}

/// On a background thread ([`in_background`]): waits while [`foreground`]
/// work runs, then `false` if the run was cancelled. Elsewhere `true` at once.
pub(super) fn give_way() -> bool {
    let Some(cancelled) = BACKGROUND.with(|flag| flag.borrow().clone()) else {
        return true;
    };
    let live = || !cancelled.load(Ordering::SeqCst);
    if FOREGROUND.load(Ordering::SeqCst) > 0 {
        let (lock, ended) = &FOREGROUND_ENDED;
        let mut guard = lock.lock().unwrap_or_else(|e| e.into_inner());
        while FOREGROUND.load(Ordering::SeqCst) > 0 && live() {
            // Timed: a wait is never longer than this, whatever the order of
            // events (a cancel sets its flag without waking anyone).
            guard = ended
                .wait_timeout(guard, Duration::from_millis(5))
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }
    live()
}

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

/// The worker threads a default scheduler runs: 1 inside
/// [`in_background`], else [`THREADS_ENV`], else what
/// [`set_default_threads`] set, else rayon's pool size (the cores in this
/// process's CPU affinity).
pub fn default_threads() -> usize {
    if BACKGROUND.with(|flag| flag.borrow().is_some()) {
        return 1;
    }
    if let Some(n) = env_threads() {
        return n;
    }
    match DEFAULT_THREADS.load(Ordering::Relaxed) {
        0 => rayon::current_num_threads(),
        n => n,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The foreground count is the process's: the tests that move it run
    /// one at a time.
    static SERIAL: Mutex<()> = Mutex::new(());

    fn serial() -> std::sync::MutexGuard<'static, ()> {
        SERIAL.lock().unwrap_or_else(|e| e.into_inner())
    }

    #[test]
    fn one_thread_inside_only_and_restored_after_a_panic() {
        let flag = Arc::new(AtomicBool::new(false));
        let outside = default_threads();
        assert_eq!(in_background(&flag, default_threads), 1);
        assert_eq!(in_background(&flag, || in_background(&flag, default_threads)), 1);
        assert_eq!(default_threads(), outside);
        let panicked = std::panic::catch_unwind(|| in_background(&flag, || panic!("inside")));
        assert!(panicked.is_err());
        assert_eq!(default_threads(), outside);
        // Another thread is not affected.
        in_background(&flag, || {
            assert_eq!(std::thread::spawn(default_threads).join().unwrap(), outside)
        });
    }

    #[test]
    fn background_waits_while_foreground_runs() {
        let _serial = serial();
        let (entered, leave) = (Arc::new(AtomicBool::new(false)), Arc::new(AtomicBool::new(false)));
        let (e, l) = (entered.clone(), leave.clone());
        let fg = std::thread::spawn(move || {
            foreground(|| {
                e.store(true, Ordering::SeqCst);
                while !l.load(Ordering::SeqCst) {
                    std::thread::sleep(Duration::from_millis(1));
                }
            })
        });
        while !entered.load(Ordering::SeqCst) {
            std::thread::sleep(Duration::from_millis(1));
        }
        assert!(give_way()); // not a background thread: at once
        let waited = Arc::new(AtomicBool::new(false));
        let w = waited.clone();
        let bg = std::thread::spawn(move || {
            in_background(&Arc::new(AtomicBool::new(false)), || {
                assert!(give_way());
                w.store(true, Ordering::SeqCst);
            })
        });
        std::thread::sleep(Duration::from_millis(30));
        assert!(
            !waited.load(Ordering::SeqCst),
            "a background run went on beside foreground work"
        );
        leave.store(true, Ordering::SeqCst);
        fg.join().unwrap();
        bg.join().unwrap();
        assert!(waited.load(Ordering::SeqCst));
        assert_eq!(FOREGROUND.load(Ordering::SeqCst), 0);
    }

    #[test]
    fn a_cancelled_run_stops_and_no_other_owner_s_run_does() {
        let (mine, theirs) = (Arc::new(AtomicBool::new(false)), Arc::new(AtomicBool::new(false)));
        in_background(&mine, || {
            assert!(give_way());
            mine.store(true, Ordering::SeqCst);
            assert!(!give_way());
        });
        in_background(&theirs, || assert!(give_way()));
    }
}
