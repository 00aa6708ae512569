//! `_core.BackgroundHasher`: the binding of [`crate::background`], the
//! idle-policy hasher whose thread never runs Python. What keeps each
//! buffer alive (a reference to its object) travels with the job and comes
//! back with its digest, to be dropped here, attached to Python; one the
//! thread drops itself (where this object was freed before the thread
//! ended) is released by PyO3 the next time a thread attaches.

use std::time::Duration;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use super::acquire::{acquire, Names};
use crate::background::{Background, Job};

/// A background hasher: one thread at Linux's ``SCHED_IDLE`` policy that
/// hashes the buffers submitted, on itself alone, waiting between steps
/// while an FP8 kernel runs; it never takes the GIL.
#[pyclass(module = "weight_checker._core", frozen)]
pub(super) struct BackgroundHasher {
    inner: Background<Py<PyAny>>,
}

#[pymethods]
impl BackgroundHasher {
    /// Starts the thread; runs take about ``run_bytes`` (at least one buffer).
    #[new]
    fn new(run_bytes: usize) -> PyResult<Self> {
        Ok(BackgroundHasher {
            inner: Background::start(run_bytes)?,
        })
    }

    /// Queues contiguous host tensors (torch's, or DLPack exports) under
    /// the caller's ids; the caller's contract: nothing writes them until
    /// their digests are taken. ``ValueError`` naming the first that is not
    /// one (nothing is queued then).
    fn submit(&self, ids: Vec<u64>, buffers: &Bound<'_, PyAny>) -> PyResult<()> {
        let objs = buffers.try_iter()?.collect::<PyResult<Vec<_>>>()?;
        if objs.len() != ids.len() {
            return Err(PyValueError::new_err(format!(
                "{} ids for {} buffers",
                ids.len(),
                objs.len()
            )));
        }
        let mut jobs = Vec::with_capacity(objs.len());
        for (i, (id, obj)) in ids.into_iter().zip(&objs).enumerate() {
            let Some((ptr, len, owner)) = acquire(obj, Names(None), i)?.into_contiguous() else {
                return Err(PyValueError::new_err(format!(
                    "buffer {i} is not a contiguous tensor: a background run reads only those \
                     (a buffer-protocol export is released attached to Python, which its thread never is)"
                )));
            };
            // SAFETY: `owner` keeps `ptr..ptr+len` alive (`into_contiguous`),
            // and travels with the job; nobody writes the bytes until the
            // digest is taken: the caller's contract, as for every digest.
            jobs.push(unsafe { Job::new(id, ptr, len, owner) });
        }
        self.inner.submit(jobs);
        Ok(())
    }

    /// ``[(id, hex digest or None)]`` of the buffers finished since the last
    /// call (``None``: its run was stopped or failed); their objects are let go of.
    fn take_digests(&self) -> Vec<(u64, Option<String>)> {
        self.inner
            .take_digests()
            .into_iter()
            .map(|d| (d.id, d.digest.map(|g| g.hex())))
            .collect()
    }

    /// Whether nothing is queued or being hashed.
    fn idle(&self) -> bool {
        self.inner.idle()
    }

    /// Bytes hashed so far.
    #[getter]
    fn hashed_bytes(&self) -> u64 {
        self.inner.hashed_bytes()
    }

    /// The thread's Linux id, once it runs.
    #[getter]
    fn thread_id(&self) -> Option<u64> {
        self.inner.thread_id()
    }

    /// Whether the host refused the idle policy: then nothing is hashed.
    #[getter]
    fn refused(&self) -> bool {
        self.inner.refused()
    }

    /// Stops the run under way at its next step; what was queued comes back
    /// undigested (:meth:`take_digests`). Returns at once.
    fn close(&self) {
        self.inner.close()
    }

    /// After :meth:`close`, waits up to ``timeout_s`` (the GIL released) for
    /// the thread to end and let go of every buffer; whether it did.
    fn wait(&self, py: Python<'_>, timeout_s: f64) -> bool {
        let timeout = Duration::try_from_secs_f64(timeout_s.max(0.0)).unwrap_or(Duration::MAX);
        py.detach(|| self.inner.wait(timeout))
    }
}
