//! The PyO3 binding: the Python API of `weight_checker._core`. It adapts and
//! nothing more: `acquire` turns Python objects into byte views without
//! copying (`dlpack` holds the C ABI it reads), `hashing` overlaps that with
//! the scheduler, `walk` reads a torch module's parameters as torch's own
//! `named_parameters()` does, and everything else lives in the pure-Rust
//! modules.

mod acquire;
mod dlpack;
mod hashing;
mod walk;

use std::path::PathBuf;

use pyo3::exceptions::{PyBufferError, PyIndexError, PyOSError, PyRuntimeError, PyTypeError, PyValueError};
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyString, PyTuple};

use acquire::{acquire, Names, Source};
use hashing::{digest_objects, digest_stream};

use crate::checkpoint::{self, CheckpointFile};
use crate::error::Error;
use crate::scheduler::{MultiHasher as CoreMultiHasher, Scheduler};
use crate::sha256::{Digest, Kernel};

pyo3::create_exception!(
    _core,
    SafetensorsError,
    PyValueError,
    "A malformed safetensors file or index."
);
pyo3::create_exception!(
    _core,
    DeviceTensorError,
    PyValueError,
    "A tensor in device memory was given to an entry point that reads host memory."
);

fn to_py_err(e: Error) -> PyErr {
    match e {
        Error::DigestIndex { .. } => PyIndexError::new_err(e.to_string()),
        Error::Io { .. } => PyOSError::new_err(e.to_string()),
        Error::Safetensors { .. } => SafetensorsError::new_err(e.to_string()),
        Error::Cancelled => PyRuntimeError::new_err("cancelled"),
    }
}

fn collect_objects<'py>(buffers: &Bound<'py, PyAny>) -> PyResult<Vec<Bound<'py, PyAny>>> {
    buffers.try_iter()?.collect()
}

/// SHA-256 (lowercase hex) of each buffer's bytes in C order.
#[pyfunction]
#[pyo3(signature = (buffers, names=None))]
fn sha256_many<'py>(
    py: Python<'py>,
    buffers: &Bound<'py, PyAny>,
    names: Option<&Bound<'py, PyAny>>,
) -> PyResult<Vec<String>> {
    let digests = digest_objects(py, collect_objects(buffers)?, names)?;
    Ok(digests.iter().map(Digest::hex).collect())
}

/// Like `sha256_many`, also returning whether each input was all zero bytes.
#[pyfunction]
#[pyo3(signature = (buffers, names=None))]
fn digest_many<'py>(
    py: Python<'py>,
    buffers: &Bound<'py, PyAny>,
    names: Option<&Bound<'py, PyAny>>,
) -> PyResult<(Vec<String>, Vec<bool>)> {
    let digests = digest_objects(py, collect_objects(buffers)?, names)?;
    Ok((
        digests.iter().map(Digest::hex).collect(),
        digests.iter().map(|d| d.all_zero).collect(),
    ))
}

/// `({prefix + name: sha256 hex}, bytes hashed)` for the tensors
/// `weight_checker.walk.collect(module)` gives, walking torch's
/// `named_parameters()` here and hashing while the walk goes on; `expand` is
/// `weight_checker.walk.expand`, called for tensors that are not exactly a
/// `Tensor` or `Parameter`. `None` when `module` does not use torch's own walk
/// (the caller walks it in Python). Raises `DeviceTensorError` for a tensor
/// in device memory and `ValueError` for a name given twice.
#[pyfunction]
#[pyo3(signature = (module, expand, prefix=""))]
fn checksum_module<'py>(
    py: Python<'py>,
    module: &Bound<'py, PyAny>,
    expand: &Bound<'py, PyAny>,
    prefix: &str,
) -> PyResult<Option<(Bound<'py, PyDict>, u64)>> {
    let Some(mut leaves) = walk::Leaves::new(module, expand)? else {
        return Ok(None);
    };
    let names = leaves.names.clone();
    let mut out = Entries::new(PyDict::new(py), &names, prefix);
    let total = digest_stream(py, leaves.by_ref(), Names(Some(names.as_any())), &mut |i, d| {
        out.put(i, d)
    })?;
    if let Some(e) = leaves.error {
        return Err(e);
    }
    if leaves.declined {
        return Ok(None);
    }
    let out = out.finish()?;
    if out.len() != names.len() {
        let mut seen = std::collections::HashSet::new();
        for name in names.iter() {
            let key = name.str()?.to_cow()?.into_owned();
            if !seen.insert(key) {
                return Err(PyValueError::new_err(format!(
                    "tensor {} appears more than once",
                    name.repr()?
                )));
            }
        }
    }
    Ok(Some((out, total)))
}

/// The `{prefix + name: hex}` dict, filled while hashing goes on: digests
/// arrive in any order and become strings at once; entries go into the dict
/// in `names` order (the walk's, as vLLM's dict has them) as soon as every
/// earlier one is in.
struct Entries<'a, 'py> {
    out: Bound<'py, PyDict>,
    names: &'a Bound<'py, PyList>,
    prefix: &'a str,
    key: String,
    ready: Vec<Option<Bound<'py, PyString>>>,
    next: usize,
}

impl<'a, 'py> Entries<'a, 'py> {
    fn new(out: Bound<'py, PyDict>, names: &'a Bound<'py, PyList>, prefix: &'a str) -> Self {
        Entries {
            out,
            names,
            prefix,
            key: String::from(prefix),
            ready: Vec::new(),
            next: 0,
        }
    }

    fn put(&mut self, index: usize, digest: Digest) -> PyResult<()> {
        let py = self.out.py();
        let hex = digest.hex_ascii();
        let hex = PyString::new(py, std::str::from_utf8(&hex).expect("hex digits are ASCII"));
        if self.ready.len() <= index {
            self.ready.resize(index + 1, None);
        }
        self.ready[index] = Some(hex);
        while let Some(Some(hex)) = self.ready.get_mut(self.next).map(Option::take) {
            let name = self.names.get_item(self.next)?;
            if self.prefix.is_empty() {
                self.out.set_item(name, hex)?;
            } else {
                self.key.truncate(self.prefix.len());
                self.key.push_str(&name.cast_into::<PyString>()?.to_cow()?);
                self.out.set_item(PyString::new(py, &self.key), hex)?;
            }
            self.next += 1;
        }
        Ok(())
    }

    /// The dict, once every name has its digest.
    fn finish(self) -> PyResult<Bound<'py, PyDict>> {
        if self.next != self.names.len() {
            return Err(PyRuntimeError::new_err(format!(
                "internal error: {} of {} digests",
                self.next,
                self.names.len()
            )));
        }
        Ok(self.out)
    }
}

/// Where torch's tensor objects keep their `TensorImpl` address, as the walk
/// found it to prefetch with (`None`: layout not recognised, no prefetch).
#[pyfunction]
fn tensor_impl_offset(py: Python<'_>) -> Option<usize> {
    walk::tensor_impl_offset(py)
}

/// Several SHA-256 digests open at once, each fed its bytes in order over
/// many `update` calls (the staging pipeline streams large tensors this way).
#[pyclass(module = "weight_checker._core")]
struct MultiHasher {
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
    #[new]
    fn new(n: usize) -> Self {
        MultiHasher {
            inner: Some(Scheduler::default().multi(n)),
        }
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

    /// Feeds `(index, buffer)` pairs; pairs for one digest apply in order.
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
            if matches!(h.source(), Source::Strided(_)) {
                return Err(PyBufferError::new_err(format!(
                    "feed #{i}: MultiHasher.update needs contiguous buffers"
                )));
            }
            held.push(h);
        }
        let sources: Vec<&[u8]> = held
            .iter()
            .map(|h| match h.source() {
                Source::Slice(s) => s,
                Source::Strided(_) => unreachable!(),
            })
            .collect();
        let feeds: Vec<(usize, &[u8])> = indices.into_iter().zip(sources).collect();
        let inner = self.open()?;
        py.detach(|| inner.update(&feeds)).map_err(to_py_err)
    }

    /// Feeds `(index, offset, length)` slices of one contiguous buffer (a
    /// staging slot): one acquisition for any number of pieces. Pieces for
    /// one digest apply in the order given.
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
        py.detach(|| inner.update(&slices)).map_err(to_py_err)
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

/// Per-tensor digests of safetensors files (memory-mapped, every tensor a
/// stream of the scheduler, pages dropped once hashed): `[(name, hex,
/// all_zero)]` in file order. `progress(done_bytes, total_bytes)` is called
/// about every 100 ms with the GIL held; an exception from it (or a signal
/// such as Ctrl-C) stops the run.
#[pyfunction]
#[pyo3(signature = (paths, progress=None))]
fn checksum_safetensors(
    py: Python<'_>,
    paths: Vec<PathBuf>,
    progress: Option<Py<PyAny>>,
) -> PyResult<Vec<(String, String, bool)>> {
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
        checkpoint::checksum_files(&files, &scheduler, Some(&mut report))
    });
    if let Some(e) = callback_error {
        return Err(e);
    }
    let out = result.map_err(to_py_err)?;
    Ok(out.into_iter().map(|(name, d)| (name, d.hex(), d.all_zero)).collect())
}

/// `(name, dtype, shape, nbytes)` of one checkpoint tensor.
type TensorInfo = (String, String, Vec<u64>, u64);

/// The tensors of one safetensors file as `[(name, dtype, shape, nbytes)]`,
/// after validating its header.
#[pyfunction]
fn safetensors_tensors(path: PathBuf) -> PyResult<Vec<TensorInfo>> {
    let f = CheckpointFile::open(&path).map_err(to_py_err)?;
    Ok(f.tensors
        .iter()
        .map(|t| (t.name.clone(), t.dtype.clone(), t.shape.clone(), t.nbytes()))
        .collect())
}

/// Copies the C-order bytes of `srcs`, back to back, into `dst`, a writable
/// contiguous buffer of exactly their total size, on this thread with the
/// GIL released: the host copy engine of the staging pipeline (one thread,
/// as a DMA engine takes none, where torch's `copy_` would fan out over the
/// cores the hashing needs), and its gather of many small tensors in one
/// call. Strided sources are gathered in bounded pieces.
#[pyfunction]
#[pyo3(signature = (dst, *srcs))]
fn copy_into(py: Python<'_>, dst: &Bound<'_, PyAny>, srcs: &Bound<'_, PyTuple>) -> PyResult<()> {
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
            // at `buf` until PyBuffer_Release (when `export` drops, after the copies), and
            // the sources' bytes are kept alive by `held`; the pieces written
            // add up to exactly `len` bytes (checked above). `copy` (memmove)
            // keeps even overlapping ranges sound.
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

/// The SHA-256 kernel in use (`sha-ni` or `portable`).
#[pyfunction]
fn kernel() -> &'static str {
    Kernel::active().name()
}

/// Worker threads the scheduler uses.
#[pyfunction]
fn threads() -> usize {
    Scheduler::default().effective_threads()
}

/// Streams each scheduler thread interleaves (measured at first use, or
/// `WEIGHT_CHECKER_LANES`); where it is 4, a run of a few big tensors may
/// use 2 (see `Scheduler::fit_to_largest`).
#[pyfunction]
fn lanes() -> usize {
    Scheduler::default().effective_lanes()
}

/// This core's SHA-256 throughput with 1, 2 and 4 interleaved streams, as
/// the lane calibration measures it: `{lanes: GB/s}`. Its best figure times
/// the threads is the machine's hashing ceiling, which benchmarks report
/// their figures against.
#[pyfunction]
fn calibrate(py: Python<'_>) -> Vec<(usize, f64)> {
    py.detach(|| Kernel::active().calibrate_lanes().1.to_vec())
}

/// Lanes for many small tensors of one length: 16 where the wide
/// (AVX-512 multi-buffer) kernel was measured faster on this CPU at first
/// use, else [`lanes`].
#[pyfunction]
fn small_lanes(py: Python<'_>) -> usize {
    py.detach(|| Scheduler::default().same_length_lanes())
}

/// `(wide, four)`: this core's GB/s streaming 16 x 256 KiB through the
/// 16-lane AVX-512 kernel and four SHA-NI lanes (see
/// [`Kernel::wide_stream_rates`]); `(0.0, 0.0)` where that is not measured.
#[pyfunction]
fn calibrate_wide(py: Python<'_>) -> (f64, f64) {
    py.detach(|| Kernel::active().wide_stream_rates().unwrap_or((0.0, 0.0)))
}

/// `(wide, narrow)`: this core's GB/s on 64 messages of 4 KiB with the
/// 16-lane AVX-512 kernel and with the active kernel's lanes, as the
/// small-message calibration measured them (`wide` is 0.0 where the CPU has
/// no AVX-512 or the portable kernel is forced).
#[pyfunction]
fn calibrate_small(py: Python<'_>) -> (f64, f64) {
    py.detach(|| {
        let kernel = Kernel::active();
        if kernel == Kernel::Portable || crate::sha256::Wide::detect().is_none() {
            (0.0, 0.0)
        } else {
            kernel.calibrate_small()
        }
    })
}

/// Seconds each of `repeat` passes takes to hash `count` separately
/// allocated buffers of `nbytes` on all threads, through the batch path
/// `checksum_module` feeds small tensors to, with no Python objects
/// involved: the hashing floor under the binding's per-tensor work, on this
/// machine as it is now (benchmarks print it beside their own figure).
#[pyfunction]
#[pyo3(signature = (count, nbytes, repeat=3))]
fn hash_floor(py: Python<'_>, count: usize, nbytes: usize, repeat: usize) -> PyResult<Vec<f64>> {
    const LIMIT: usize = 4 << 30;
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

/// Messages the scheduler keeps in flight: threads x lanes.
#[pyfunction]
fn streams() -> usize {
    Scheduler::default().streams()
}

/// Sets the scheduler's default worker threads for this process (0: all cores
/// in the CPU affinity). `WEIGHT_CHECKER_THREADS`, when set, wins.
#[pyfunction]
fn set_threads(threads: usize) {
    crate::scheduler::set_default_threads(threads)
}

#[pymodule]
#[pyo3(name = "_core")]
fn core_module(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(sha256_many, m)?)?;
    m.add_function(wrap_pyfunction!(digest_many, m)?)?;
    m.add_function(wrap_pyfunction!(checksum_module, m)?)?;
    m.add_function(wrap_pyfunction!(tensor_impl_offset, m)?)?;
    m.add_function(wrap_pyfunction!(kernel, m)?)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add_function(wrap_pyfunction!(threads, m)?)?;
    m.add_function(wrap_pyfunction!(streams, m)?)?;
    m.add_function(wrap_pyfunction!(lanes, m)?)?;
    m.add_function(wrap_pyfunction!(calibrate, m)?)?;
    m.add_function(wrap_pyfunction!(small_lanes, m)?)?;
    m.add_function(wrap_pyfunction!(calibrate_small, m)?)?;
    m.add_function(wrap_pyfunction!(calibrate_wide, m)?)?;
    m.add_function(wrap_pyfunction!(hash_floor, m)?)?;
    m.add_function(wrap_pyfunction!(copy_into, m)?)?;
    m.add_function(wrap_pyfunction!(set_threads, m)?)?;
    m.add_function(wrap_pyfunction!(checksum_safetensors, m)?)?;
    m.add_function(wrap_pyfunction!(safetensors_tensors, m)?)?;
    m.add_class::<MultiHasher>()?;
    m.add("SafetensorsError", m.py().get_type::<SafetensorsError>())?;
    m.add("DeviceTensorError", m.py().get_type::<DeviceTensorError>())?;
    Ok(())
}
