//! What the scheduler chose on this CPU, and the figures it chose by:
//! `_core.kernel`, `threads`, `lanes`, `streams`, the calibrations, a run's
//! assignment, the hashing floor, `set_threads`. Each one that reads the
//! core's settings raises `ValueError` for an invalid one first.

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use super::runs::settings_valid;
use crate::scheduler::Scheduler;
use crate::sha256::Kernel;

/// The SHA-256 kernels this process's runs may use: the narrow kernel
/// (`sha-ni` or `portable`), with `+avx512-x16` where this CPU has the
/// 16-lane wide kernel and the calibration (or `WEIGHT_CHECKER_LANES=16`)
/// lets runs use it, e.g. `sha-ni+avx512-x16`. Calibrates at first use
/// (milliseconds, with the GIL released); cheap after that.
#[pyfunction]
pub(super) fn kernel(py: Python<'_>) -> PyResult<&'static str> {
    settings_valid()?;
    Ok(py.detach(|| Scheduler::default().kernel_name()))
}

/// Worker threads the scheduler uses.
#[pyfunction]
pub(super) fn threads() -> PyResult<usize> {
    settings_valid()?;
    Ok(Scheduler::default().effective_threads())
}

/// Messages each scheduler thread holds open: its lanes (measured at first
/// use, or `WEIGHT_CHECKER_LANES`); where it is 4, a run may use 2 (a few
/// big tensors, `Scheduler::fit_to_largest`) or the wide kernel's 16 (many,
/// `Scheduler::fit_wide`).
#[pyfunction]
pub(super) fn lanes() -> PyResult<usize> {
    settings_valid()?;
    Ok(Scheduler::default().effective_lanes())
}

/// This core's SHA-256 throughput with 1, 2 and 4 interleaved narrow
/// streams, as the lane calibration measures it: `{lanes: GB/s}`. Its best
/// figure times the threads is the machine's hashing ceiling, which
/// benchmarks report their figures against.
#[pyfunction]
pub(super) fn calibrate(py: Python<'_>) -> PyResult<Vec<(usize, f64)>> {
    settings_valid()?;
    Ok(py.detach(|| Kernel::active().calibrate_lanes().1.to_vec()))
}

/// Lanes for many small tensors of one length: 16 where the wide
/// (AVX-512 multi-buffer) kernel was measured faster on this CPU at first
/// use, else [`lanes`].
#[pyfunction]
pub(super) fn small_lanes(py: Python<'_>) -> PyResult<usize> {
    settings_valid()?;
    Ok(py.detach(|| Scheduler::default().same_length_lanes()))
}

/// `(wide, four)`: this core's GB/s streaming 16 x 256 KiB through the
/// 16-lane AVX-512 kernel and four narrow lanes (see
/// [`Kernel::wide_stream_rates`]); `(0.0, 0.0)` where that is not measured.
#[pyfunction]
pub(super) fn calibrate_wide(py: Python<'_>) -> PyResult<(f64, f64)> {
    settings_valid()?;
    Ok(py.detach(|| Kernel::active().wide_stream_rates().unwrap_or((0.0, 0.0))))
}

/// How a run of messages of `sizes` bytes would be laid out on this CPU:
/// workers, the kernel and lanes of each, what is dealt (a sentence, for
/// benchmarks to print beside their figures).
#[pyfunction]
pub(super) fn describe_assignment(py: Python<'_>, sizes: Vec<u64>) -> PyResult<String> {
    settings_valid()?;
    Ok(py.detach(|| Scheduler::default().describe_assignment(&sizes)))
}

/// `(wide, narrow)`: this core's GB/s on 64 messages of 4 KiB with the
/// 16-lane AVX-512 kernel and with the active narrow kernel's lanes, as the
/// small-message calibration measured them (`wide` is 0.0 where the CPU has
/// no AVX-512 or the portable kernel is forced).
#[pyfunction]
pub(super) fn calibrate_small(py: Python<'_>) -> PyResult<(f64, f64)> {
    settings_valid()?;
    Ok(py.detach(|| {
        let kernel = Kernel::active();
        if kernel == Kernel::Portable || crate::sha256::Wide::detect().is_none() {
            (0.0, 0.0)
        } else {
            kernel.calibrate_small()
        }
    }))
}

/// Seconds each of `repeat` passes takes to hash `count` separately
/// allocated buffers of `nbytes` on all threads, through the batch path
/// `checksum_module` feeds small tensors to, with no Python objects
/// involved: the hashing floor under the binding's per-tensor work, on this
/// machine as it is now (benchmarks print it beside their own figure).
#[pyfunction]
#[pyo3(signature = (count, nbytes, repeat=3))]
pub(super) fn hash_floor(py: Python<'_>, count: usize, nbytes: usize, repeat: usize) -> PyResult<Vec<f64>> {
    const LIMIT: usize = 4 << 30;
    settings_valid()?;
    if count == 0 || repeat == 0 {
        return Err(PyValueError::new_err("hash_floor: count and repeat must be at least 1"));
    }
    if count.checked_mul(nbytes).is_none_or(|total| total > LIMIT) {
        return Err(PyValueError::new_err(format!(
            "hash_floor: {count} x {nbytes} bytes is more than the 4 GiB this measurement allocates at most"
        )));
    }
    let times = py.detach(|| crate::scheduler::batches_floor(Scheduler::default(), count, nbytes, repeat));
    Ok(times.iter().map(|t| t.as_secs_f64()).collect())
}

/// How many of the largest of messages of `sizes` bytes end a run, each
/// alone on a worker of its own (0 where none does, or where this CPU's
/// rates were not calibrated): what a feeder that plans a whole set
/// (device staging) gives the most of each slot to.
#[pyfunction]
pub(super) fn dominant_chains(py: Python<'_>, sizes: Vec<u64>) -> PyResult<usize> {
    settings_valid()?;
    let mut sorted = sizes;
    sorted.sort_unstable_by(|a, b| b.cmp(a));
    Ok(py.detach(|| Scheduler::default().dominant_chains(&sorted)))
}

/// Messages the scheduler keeps in flight: threads x lanes.
#[pyfunction]
pub(super) fn streams() -> PyResult<usize> {
    settings_valid()?;
    Ok(Scheduler::default().streams())
}

/// Sets the scheduler's default worker threads for this process (0: all cores
/// in the CPU affinity). `WEIGHT_CHECKER_THREADS`, when set, wins.
#[pyfunction]
pub(super) fn set_threads(threads: usize) {
    crate::scheduler::set_default_threads(threads)
}
