//! `_core.copy_into`: the host copy engine of the staging pipeline.

use pyo3::exceptions::PyValueError;
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::PyTuple;

use super::acquire::{self, acquire, Names, Source};
/// Copies the C-order bytes of `srcs`, back to back, into `dst`, a writable
/// contiguous buffer of exactly their total size, on this thread with the
/// GIL released: the host copy engine of the staging pipeline (one thread,
/// as a DMA engine takes none, where torch's `copy_` would fan out over the
/// cores the hashing needs), and its gather of many small tensors in one
/// call. Strided sources are gathered in bounded pieces.
#[pyfunction]
#[pyo3(signature = (dst, *srcs))]
pub(super) fn copy_into(py: Python<'_>, dst: &Bound<'_, PyAny>, srcs: &Bound<'_, PyTuple>) -> PyResult<()> {
    let held = srcs
        .iter()
        .enumerate()
        .map(|(i, src)| acquire(&src, Names(None), i))
        .collect::<PyResult<Vec<_>>>()?;
    let sources: Vec<Source<'_>> = held.iter().map(|h| h.source()).collect();
    let total: usize = sources.iter().map(Source::len).sum();
    let export = acquire::BufferExport::new(dst, ffi::PyBUF_WRITABLE | ffi::PyBUF_C_CONTIGUOUS)?;
    let view = export.view();
    let len = view.len.max(0) as usize;
    let result = if len != total {
        Err(PyValueError::new_err(format!(
            "copy_into: destination has {len} bytes, the sources {total}"
        )))
    } else {
        let to = view.buf as usize;
        py.detach(|| {
            // SAFETY: the exporter guarantees `len` writable, contiguous bytes
            // at `buf` until PyBuffer_Release (when `export` drops, after the
            // copies), and the sources' bytes are kept alive by `held`; the
            // pieces written add up to exactly `len` bytes (checked above).
            // With the GIL released, the caller's contract keeps the rest:
            // nobody writes the sources during the copy (the model is not
            // updated while it is staged), and nobody else reads or writes
            // the destination (a staging slot is handed to one copy at a
            // time, and hashed only once the copy has returned); nor does
            // the destination overlap a source. (`copy`, memmove, is used
            // rather than `copy_nonoverlapping` so that a caller breaking
            // that last rule gets memmove's bytes, not worse.)
            let mut at = to as *mut u8;
            let mut put = |piece: &[u8]| unsafe {
                std::ptr::copy(piece.as_ptr(), at, piece.len());
                at = at.add(piece.len());
            };
            for s in &sources {
                match s {
                    Source::Slice(b) => put(b),
                    Source::Strided(v) => v.for_each_piece(&mut put),
                }
            }
        });
        Ok(())
    };
    drop(export);
    result
}
