//! `_core.last_run()`, `_core.check_settings()` and
//! `_core.wide_kernel_available()`: what the latest hashing call on this
//! thread used, whether the settings are valid, whether this CPU has the
//! wide kernel.

use std::cell::Cell;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::scheduler::RunSummary;
use crate::sha256::Wide;

thread_local! {
    /// How the latest hashing call made on this thread ran (`None`: none
    /// yet, or the latest one failed). A `Copy` summary: recording a run
    /// allocates nothing; `last_run()` formats it.
    static LAST_RUN: Cell<Option<RunSummary>> = const { Cell::new(None) };
}

/// Runs one hashing entry point: forgets the previous run, checks the
/// settings ([`settings_valid`]), runs `call` and, when it succeeds,
/// records the summary it returns.
pub(super) fn recorded<T>(call: impl FnOnce() -> PyResult<(T, Option<RunSummary>)>) -> PyResult<T> {
    LAST_RUN.with(|last| last.set(None));
    settings_valid()?;
    let (out, summary) = call()?;
    LAST_RUN.with(|last| last.set(summary));
    Ok(out)
}

/// The core's settings (`WEIGHT_CHECKER_KERNEL`, `_LANES`, `_THREADS`) as
/// the environment holds them now, or the `ValueError` naming the first
/// invalid one, its value and the values it accepts. Every entry point
/// that reads them calls this before any work.
pub(super) fn settings_valid() -> PyResult<()> {
    crate::settings::check().map_err(|e| PyValueError::new_err(e.to_string()))
}

/// Raises `ValueError` where one of the core's settings holds a value it
/// does not accept (e.g. `WEIGHT_CHECKER_LANES='8': expected one of 1, 2, 4,
/// 16 (unset: measured at first use)`); `None` when all three are valid.
#[pyfunction]
pub(super) fn check_settings() -> PyResult<()> {
    settings_valid()
}

/// How the latest hashing run made on the calling thread ran, in one line
/// (`sha256_many`, `digest_many`, `checksum_module`, `checksum_safetensors`,
/// `MultiHasher.update`/`update_at`): threads, the narrow kernel and its
/// lanes, the 16-lane wide kernel, and the tensor count, e.g. `"2 threads:
/// 1 on 4 narrow lanes (sha-ni), 1 on the 16-lane wide kernel (avx512); 51
/// tensors"`. `None` before any run on this thread, or when the latest one
/// failed.
#[pyfunction]
pub(super) fn last_run() -> Option<String> {
    LAST_RUN.with(Cell::get).map(|run| run.to_string())
}

/// Whether this CPU has the 16-lane wide (AVX-512) kernel, detected at run
/// time, whatever the settings.
#[pyfunction]
pub(super) fn wide_kernel_available() -> bool {
    Wide::detect().is_some()
}
