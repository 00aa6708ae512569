//! `_core.checksum_safetensors`, `_core.safetensors_tensors` and
//! `_core.safetensors_cached_fraction`: checkpoints hashed (mapped or read),
//! listed and probed by the pure-Rust `checkpoint` module.

use std::path::PathBuf;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use super::runs::recorded;
use super::to_py_err;
use crate::checkpoint::{self, CheckpointFile, ReadMode, ReadOptions};
use crate::error::Error;
use crate::scheduler::{RunSummary, Scheduler};

/// `(name, hex digest, all zero)` of one checkpoint tensor.
type TensorDigest = (String, String, bool);

/// Per-tensor digests of safetensors files: `[(name, hex, all_zero)]` in
/// file order. Files in the page cache are hashed through their mapping
/// (every tensor a stream of the scheduler, pages dropped once hashed), the
/// others read with large sequential reads, hashed as they arrive; `mode`
/// forces one (`"map"`, `"read"`; `"auto"` chooses per file) and
/// `buffer_bytes` sets the read path's buffer size (0: the default).
/// `progress(done_bytes, total_bytes)` is called about every 100 ms with
/// the GIL held; an exception from it (or a signal such as Ctrl-C) stops the
/// run. Each file must not be modified or truncated while it is read (see
/// `CheckpointFile::open`).
#[pyfunction]
#[pyo3(signature = (paths, progress=None, *, mode="auto", buffer_bytes=0))]
pub(super) fn checksum_safetensors(
    py: Python<'_>,
    paths: Vec<PathBuf>,
    progress: Option<Py<PyAny>>,
    mode: &str,
    buffer_bytes: usize,
) -> PyResult<Vec<TensorDigest>> {
    let mode = match mode {
        "auto" => ReadMode::Auto,
        "map" => ReadMode::Mapped,
        "read" => ReadMode::Read,
        other => {
            return Err(PyValueError::new_err(format!(
                "mode={other:?}: expected \"auto\", \"map\" or \"read\""
            )))
        }
    };
    if buffer_bytes > checkpoint::MAX_BUFFER_BYTES {
        return Err(PyValueError::new_err(format!(
            "buffer_bytes={buffer_bytes}: at most {} (0: the default, {})",
            checkpoint::MAX_BUFFER_BYTES,
            checkpoint::BUFFER_BYTES
        )));
    }
    let options = ReadOptions {
        mode,
        buffer_bytes,
        cursors: 0,
    };
    recorded(|| hash_files(py, paths, progress, options))
}

/// `checksum_safetensors`' work, and how the run went.
fn hash_files(
    py: Python<'_>,
    paths: Vec<PathBuf>,
    progress: Option<Py<PyAny>>,
    options: ReadOptions,
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
        checkpoint::checksum_files_with(&files, &scheduler, options, Some(&mut report))
    });
    if let Some(e) = callback_error {
        return Err(e);
    }
    let out = result.map_err(to_py_err)?;
    let ran = RunSummary {
        streamed: out.shape,
        ..RunSummary::default()
    };
    Ok((
        out.digests
            .into_iter()
            .map(|(name, d)| (name, d.hex(), d.all_zero))
            .collect(),
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

/// The fraction of one file's tensor data found in the page cache (as
/// `checksum_safetensors(mode="auto")` measures it to choose between the
/// mapping and the read path), after validating its header.
#[pyfunction]
pub(super) fn safetensors_cached_fraction(path: PathBuf) -> PyResult<f64> {
    let f = CheckpointFile::open(&path).map_err(to_py_err)?;
    Ok(f.resident_fraction())
}
