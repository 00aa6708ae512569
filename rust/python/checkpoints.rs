//! `_core.checksum_safetensors` and `_core.safetensors_tensors`: checkpoints
//! hashed and listed by the pure-Rust `checkpoint` module.

use std::path::PathBuf;

use pyo3::prelude::*;

use super::runs::recorded;
use super::to_py_err;
use crate::checkpoint::{self, CheckpointFile};
use crate::error::Error;
use crate::scheduler::{self as scheduler_mod, RunSummary, Scheduler};

/// `(name, hex digest, all zero)` of one checkpoint tensor.
type TensorDigest = (String, String, bool);

/// Per-tensor digests of safetensors files (memory-mapped, every tensor a
/// stream of the scheduler, pages dropped once hashed): `[(name, hex,
/// all_zero)]` in file order. `progress(done_bytes, total_bytes)` is called
/// about every 100 ms with the GIL held; an exception from it (or a signal
/// such as Ctrl-C) stops the run. Each file must not be modified or
/// truncated while it is read (see `CheckpointFile::open`).
#[pyfunction]
#[pyo3(signature = (paths, progress=None))]
pub(super) fn checksum_safetensors(
    py: Python<'_>,
    paths: Vec<PathBuf>,
    progress: Option<Py<PyAny>>,
) -> PyResult<Vec<TensorDigest>> {
    recorded(|| hash_files(py, paths, progress))
}

/// `checksum_safetensors`' work, and how the run went.
fn hash_files(
    py: Python<'_>,
    paths: Vec<PathBuf>,
    progress: Option<Py<PyAny>>,
) -> PyResult<(Vec<TensorDigest>, Option<RunSummary>)> {
    let scheduler = Scheduler::default();
    let mut callback_error: Option<PyErr> = None;
    let result = py.detach(|| {
        let files = paths
            .iter()
            .map(|p| CheckpointFile::open(p))
            .collect::<Result<Vec<_>, Error>>()?;
        let mut report = |done: u64, total: u64| {
            Python::attach(|py| {
                let outcome = py.check_signals().and_then(|()| match &progress {
                    Some(cb) => cb.call1(py, (done, total)).map(drop),
                    None => Ok(()),
                });
                match outcome {
                    Ok(()) => true,
                    Err(e) => {
                        callback_error.get_or_insert(e);
                        false
                    }
                }
            })
        };
        let digests = checkpoint::checksum_files(&files, &scheduler, Some(&mut report))?;
        // The run was started on this thread (the closure runs on it).
        Ok((digests, scheduler_mod::last_run()))
    });
    if let Some(e) = callback_error {
        return Err(e);
    }
    let (out, streamed) = result.map_err(to_py_err)?;
    let ran = RunSummary {
        streamed,
        ..RunSummary::default()
    };
    Ok((
        out.into_iter().map(|(name, d)| (name, d.hex(), d.all_zero)).collect(),
        Some(ran),
    ))
}

/// `(name, dtype, shape, nbytes)` of one checkpoint tensor.
type TensorInfo = (String, String, Vec<u64>, u64);

/// The tensors of one safetensors file as `[(name, dtype, shape, nbytes)]`,
/// after validating its header.
#[pyfunction]
pub(super) fn safetensors_tensors(path: PathBuf) -> PyResult<Vec<TensorInfo>> {
    let f = CheckpointFile::open(&path).map_err(to_py_err)?;
    Ok(f.tensors
        .iter()
        .map(|t| (t.name.clone(), t.dtype.clone(), t.shape.clone(), t.nbytes()))
        .collect())
}
