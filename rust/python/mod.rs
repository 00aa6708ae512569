//! The PyO3 binding: the Python API of `weight_checker._core`. It adapts and
//! nothing more: `acquire` turns Python objects into byte views without
//! copying (`dlpack` holds the C ABI it reads), `hashing` overlaps that with
//! the scheduler, `walk` reads a torch module's parameters as torch's own
//! `named_parameters()` does; `multi` (the `MultiHasher` class),
//! `checkpoints` (safetensors files), `copy` (the staging copier) and
//! `diagnostics` (the scheduler's choices and calibrations) are one entry
//! point each; `runs` says how the latest hashing call ran and whether the
//! settings are valid. Here: the exceptions and the digest entry points.
//! Everything else lives in the pure-Rust modules.
//!
//! Every entry point that reads the core's settings checks them first
//! (`runs::settings_valid`: `ValueError` naming the invalid one); every one
//! that hashes does so through `runs::recorded`, which checks them and
//! records how the call ran for `_core.last_run()`.

mod acquire;
mod background;
mod checkpoints;
mod copy;
mod diagnostics;
mod dlpack;
mod fp8;
mod hashing;
mod multi;
mod runs;
mod torch_types;
mod walk;

use pyo3::exceptions::{PyIndexError, PyOSError, PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyString};

use acquire::Names;
use hashing::{digest_as_acquired, digest_objects};
use runs::recorded;

use crate::error::Error;
use crate::scheduler::RunSummary;
use crate::sha256::Digest;

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
    let digests = recorded(|| {
        let (digests, ran) = digest_objects(py, collect_objects(buffers)?, names)?;
        Ok((digests, Some(ran)))
    })?;
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
    let digests = recorded(|| {
        let (digests, ran) = digest_objects(py, collect_objects(buffers)?, names)?;
        Ok((digests, Some(ran)))
    })?;
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
/// in device memory and `ValueError` for a name given twice or an invalid
/// setting.
#[pyfunction]
#[pyo3(signature = (module, expand, prefix=""))]
fn checksum_module<'py>(
    py: Python<'py>,
    module: &Bound<'py, PyAny>,
    expand: &Bound<'py, PyAny>,
    prefix: &str,
) -> PyResult<Option<Checksums<'py>>> {
    recorded(|| checksum_walked(py, module, expand, prefix))
}

/// `checksum_module`'s answer: the digests by name and the bytes hashed.
type Checksums<'py> = (Bound<'py, PyDict>, u64);

/// `checksum_module`'s work, and how the hashing ran (`None` where the
/// module was left to Python's walk).
fn checksum_walked<'py>(
    py: Python<'py>,
    module: &Bound<'py, PyAny>,
    expand: &Bound<'py, PyAny>,
    prefix: &str,
) -> PyResult<(Option<Checksums<'py>>, Option<RunSummary>)> {
    let Some(mut leaves) = walk::Leaves::new(module, expand)? else {
        return Ok((None, None));
    };
    let names = leaves.names.clone();
    let mut out = Entries::new(PyDict::new(py), &names, prefix);
    let (total, ran) = digest_as_acquired(py, leaves.by_ref(), Names(Some(names.as_any())), &mut |i, d| {
        out.put(i, d)
    })?;
    if let Some(e) = leaves.error {
        return Err(e);
    }
    if leaves.declined {
        return Ok((None, None));
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
    Ok((Some((out, total)), Some(ran)))
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
    torch_types::tensor_impl_offset(py)
}

#[pymodule]
#[pyo3(name = "_core")]
fn core_module(m: &Bound<'_, PyModule>) -> PyResult<()> {
    use checkpoints::{checksum_safetensors, safetensors_cached_fraction, safetensors_tensors};
    use copy::copy_into;
    use diagnostics::{
        calibrate, calibrate_small, calibrate_wide, describe_assignment, dominant_chains, hash_floor, kernel, lanes,
        set_threads, small_lanes, streams, threads,
    };
    use multi::MultiHasher;
    use runs::{check_settings, last_run, wide_kernel_available};
    m.add_function(wrap_pyfunction!(sha256_many, m)?)?;
    m.add_function(wrap_pyfunction!(digest_many, m)?)?;
    m.add_class::<background::BackgroundHasher>()?;
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
    m.add_function(wrap_pyfunction!(describe_assignment, m)?)?;
    m.add_function(wrap_pyfunction!(dominant_chains, m)?)?;
    m.add_function(wrap_pyfunction!(hash_floor, m)?)?;
    m.add_function(wrap_pyfunction!(copy_into, m)?)?;
    m.add_function(wrap_pyfunction!(fp8::fp8_row_abs_max, m)?)?;
    m.add_function(wrap_pyfunction!(fp8::fp8_quantize_rows, m)?)?;
    m.add_function(wrap_pyfunction!(fp8::fp8_row_abs_max_piece, m)?)?;
    m.add_function(wrap_pyfunction!(fp8::fp8_quantize_piece, m)?)?;
    m.add_function(wrap_pyfunction!(fp8::fp8_amax_quantize_piece, m)?)?;
    m.add_function(wrap_pyfunction!(set_threads, m)?)?;
    m.add_function(wrap_pyfunction!(checksum_safetensors, m)?)?;
    m.add_function(wrap_pyfunction!(safetensors_tensors, m)?)?;
    m.add_function(wrap_pyfunction!(safetensors_cached_fraction, m)?)?;
    m.add_function(wrap_pyfunction!(check_settings, m)?)?;
    m.add_function(wrap_pyfunction!(last_run, m)?)?;
    m.add_function(wrap_pyfunction!(wide_kernel_available, m)?)?;
    m.add_class::<MultiHasher>()?;
    m.add("SafetensorsError", m.py().get_type::<SafetensorsError>())?;
    m.add("DeviceTensorError", m.py().get_type::<DeviceTensorError>())?;
    Ok(())
}
