//! `_core.MultiHasher`: digests fed over many calls (large staged tensors).

use pyo3::exceptions::{PyBufferError, PyIndexError, PyRuntimeError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyTuple};

use super::acquire::{acquire, Names, Source};
use super::runs::{recorded, settings_valid};
use super::to_py_err;
use crate::error::Error;
use crate::scheduler::{self as scheduler_mod, MultiHasher as CoreMultiHasher, RunSummary, Scheduler};
use crate::sha256::{Digest, Sha256};

/// Several SHA-256 digests open at once, each fed its bytes in order over
/// many `update` calls (the staging pipeline streams large tensors this way).
/// Each update is one run of the scheduler, recorded for `_core.last_run()`.
#[pyclass(module = "weight_checker._core")]
pub(super) struct MultiHasher {
    inner: Option<CoreMultiHasher>,
}

impl MultiHasher {
    fn open(&mut self) -> PyResult<&mut CoreMultiHasher> {
        self.inner
            .as_mut()
            .ok_or_else(|| PyRuntimeError::new_err("MultiHasher already finished"))
    }
}

#[pymethods]
impl MultiHasher {
    /// Raises `ValueError` where one of the core's settings is invalid (the
    /// hasher keeps the scheduler it was built with).
    #[new]
    fn new(n: usize) -> PyResult<Self> {
        settings_valid()?;
        Ok(MultiHasher {
            inner: Some(Scheduler::default().multi(n)),
        })
    }

    /// A hasher whose digest `i` continues chain state `states[i]` (bytes
    /// from `export_states`, here or in another process; `None`: a fresh
    /// digest). Raises `ValueError` naming the first state that is not one.
    #[staticmethod]
    fn resume(states: Vec<Option<Vec<u8>>>) -> PyResult<Self> {
        settings_valid()?;
        let mut chains = Vec::with_capacity(states.len());
        for (i, state) in states.iter().enumerate() {
            chains.push(match state {
                None => Sha256::new(),
                Some(bytes) => {
                    Sha256::import(bytes).map_err(|why| PyValueError::new_err(format!("state #{i}: {why}")))?
                }
            });
        }
        Ok(MultiHasher {
            inner: Some(Scheduler::default().resume(chains)),
        })
    }

    /// Every digest's chain state, in index order, without finishing it: up
    /// to 109 bytes each, from which `MultiHasher.resume` (here or on another
    /// rank) continues the same digest, bit-identical to hashing the whole
    /// message in one place.
    fn export_states<'py>(&mut self, py: Python<'py>) -> PyResult<Vec<Bound<'py, PyBytes>>> {
        Ok(self.open()?.export().iter().map(|s| PyBytes::new(py, s)).collect())
    }

    /// Records digest `index`'s chain state when its message reaches each
    /// length of `at` (increasing; none below the bytes fed so far, one
    /// equal to them recorded now), replacing marks not reached yet: the
    /// states at a tensor's block boundaries, taken by the one pass that
    /// gives its digest. Read them with `marked`. Raises `ValueError` for
    /// marks out of order or behind, `IndexError` for no such digest.
    fn mark(&mut self, index: usize, at: Vec<u64>) -> PyResult<()> {
        let n = self.__len__();
        let inner = self.open()?;
        if index >= n {
            return Err(to_py_err(Error::DigestIndex { index, len: n }));
        }
        inner
            .mark(index, &at)
            .map_err(|why| PyValueError::new_err(format!("digest #{index}: {why}")))
    }

    /// The chain states recorded so far for digest `index` (as
    /// `export_states` gives them), in mark order.
    fn marked<'py>(&mut self, py: Python<'py>, index: usize) -> PyResult<Vec<Bound<'py, PyBytes>>> {
        let n = self.__len__();
        let states = self
            .open()?
            .marked(index)
            .ok_or_else(|| to_py_err(Error::DigestIndex { index, len: n }))?;
        Ok(states.iter().map(|s| PyBytes::new(py, s)).collect())
    }

    fn __len__(&self) -> usize {
        self.inner.as_ref().map_or(0, |m| m.len())
    }

    /// Bytes fed so far to digest `index`.
    fn bytes_fed(&mut self, index: usize) -> PyResult<u64> {
        let n = self.__len__();
        self.open()?
            .bytes_fed(index)
            .ok_or_else(|| to_py_err(Error::DigestIndex { index, len: n }))
    }

    /// Feeds `(index, buffer)` pairs; pairs for one digest apply in order. A
    /// buffer is contiguous, or strided with contiguous rows (read in place).
    fn update(&mut self, py: Python<'_>, feeds: &Bound<'_, PyAny>) -> PyResult<()> {
        let mut indices = Vec::new();
        let mut held = Vec::new();
        for (i, item) in feeds.try_iter()?.enumerate() {
            let item = item?;
            let pair = item
                .cast::<PyTuple>()
                .map_err(|_| PyTypeError::new_err("feeds must be (index, buffer) tuples"))?;
            indices.push(pair.get_item(0)?.extract::<usize>()?);
            let h = acquire(&pair.get_item(1)?, Names(None), i)?;
            if let Source::Strided(view) = h.source() {
                if view.contiguous_rows().is_none() {
                    return Err(PyBufferError::new_err(format!(
                        "feed #{i}: MultiHasher.update needs a buffer whose rows are contiguous"
                    )));
                }
            }
            held.push(h);
        }
        // A strided buffer (a shard narrowed along its last dimension) is fed
        // its rows where they lie: nothing is copied.
        let mut feeds: Vec<(usize, &[u8])> = Vec::with_capacity(held.len());
        for (&index, h) in indices.iter().zip(&held) {
            match h.source() {
                Source::Slice(s) => feeds.push((index, s)),
                Source::Strided(view) => {
                    let rows = view.contiguous_rows().expect("checked above");
                    feeds.extend(rows.into_iter().map(|row| (index, row)));
                }
            }
        }
        let inner = self.open()?;
        // The fed buffers are read in place with the GIL released: the caller
        // must not write them until this call returns (see `Held::source`).
        recorded(|| update_recorded(py, inner, &feeds))
    }

    /// Feeds `(index, offset, length)` slices of one contiguous buffer (a
    /// staging slot): one acquisition for any number of pieces. Pieces for
    /// one digest apply in the order given. The caller must not refill the
    /// slot (nor let a copy into it run) until this call returns: it is read
    /// in place, with the GIL released.
    fn update_at(
        &mut self,
        py: Python<'_>,
        buffer: &Bound<'_, PyAny>,
        feeds: Vec<(usize, usize, usize)>,
    ) -> PyResult<()> {
        let held = acquire(buffer, Names(None), 0)?;
        let Source::Slice(bytes) = held.source() else {
            return Err(PyBufferError::new_err(
                "MultiHasher.update_at needs a contiguous buffer",
            ));
        };
        let mut slices = Vec::with_capacity(feeds.len());
        for (i, &(index, offset, len)) in feeds.iter().enumerate() {
            let piece = offset
                .checked_add(len)
                .and_then(|end| bytes.get(offset..end))
                .ok_or_else(|| {
                    PyIndexError::new_err(format!(
                        "feed #{i}: bytes [{offset}, {offset}+{len}) outside a buffer of {} bytes",
                        bytes.len()
                    ))
                })?;
            slices.push((index, piece));
        }
        let inner = self.open()?;
        recorded(|| update_recorded(py, inner, &slices))
    }

    /// Finishes every digest: `(hex digests, all-zero flags)`, in index order.
    fn finish(&mut self, py: Python<'_>) -> PyResult<(Vec<String>, Vec<bool>)> {
        let inner = self
            .inner
            .take()
            .ok_or_else(|| PyRuntimeError::new_err("MultiHasher already finished"))?;
        let digests = py.detach(|| inner.finish());
        Ok((
            digests.iter().map(Digest::hex).collect(),
            digests.iter().map(|d| d.all_zero).collect(),
        ))
    }
}

/// One update through the scheduler, with the GIL released, and how it ran
/// (the run starts on this thread: the closure runs on it).
fn update_recorded(
    py: Python<'_>,
    inner: &mut CoreMultiHasher,
    feeds: &[(usize, &[u8])],
) -> PyResult<((), Option<RunSummary>)> {
    let streamed = py.detach(|| inner.update(feeds).map(|()| scheduler_mod::last_run()));
    let streamed = streamed.map_err(to_py_err)?;
    Ok((
        (),
        Some(RunSummary {
            streamed,
            ..RunSummary::default()
        }),
    ))
}
