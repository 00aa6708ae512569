//! The PyO3 binding: turns Python objects into byte views without copying,
//! releases the GIL, and hands the views to the engine. All hashing logic
//! lives in the pure-Rust modules; this file only adapts.

use std::ffi::{c_int, c_void, CStr};
use std::path::PathBuf;
use std::sync::Mutex;

use pyo3::exceptions::{PyBufferError, PyIndexError, PyOSError, PyRuntimeError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyCapsule, PyCapsuleMethods, PyTuple, PyType};
use pyo3::{ffi, intern};

use crate::checkpoint::{self, CheckpointFile};
use crate::engine::{Engine, MultiHasher as CoreMultiHasher};
use crate::error::Error;
use crate::sha256::{Backend, Digest};
use crate::strided::StridedView;

/// Above this many bytes, the GIL is released while hashing (as hashlib does
/// above 2 KiB): other Python threads run while we compute.
const RELEASE_GIL_BYTES: usize = 2048;

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

// --- DLPack (https://dmlc.github.io/dlpack/latest/c_api.html) -------------

const KDL_CPU: i32 = 1;
const KDL_CUDA_HOST: i32 = 3;
const KDL_COMPLEX: u8 = 5;
const DLPACK_CAPSULE: &CStr = c"dltensor";

#[repr(C)]
struct DLDevice {
    device_type: i32,
    device_id: i32,
}

#[repr(C)]
struct DLDataType {
    code: u8,
    bits: u8,
    lanes: u16,
}

#[repr(C)]
struct DLTensor {
    data: *mut c_void,
    device: DLDevice,
    ndim: i32,
    dtype: DLDataType,
    shape: *const i64,
    strides: *const i64,
    byte_offset: u64,
}

#[repr(C)]
struct DLManagedTensor {
    dl_tensor: DLTensor,
    manager_ctx: *mut c_void,
    deleter: Option<unsafe extern "C" fn(*mut DLManagedTensor)>,
}

fn device_name(device_type: i32, id: i32) -> String {
    match device_type {
        2 => format!("cuda:{id}"),
        4 => format!("opencl:{id}"),
        7 => format!("vulkan:{id}"),
        8 => format!("metal:{id}"),
        10 => format!("rocm:{id}"),
        14 => format!("oneapi:{id}"),
        t => format!("DLPack device type {t}:{id}"),
    }
}

/// The bytes of one input, and what keeps them alive.
enum Held<'py> {
    /// A contiguous range inside an object we hold a reference to.
    Slice {
        ptr: *const u8,
        len: usize,
        _owner: Bound<'py, PyAny>,
    },
    /// A strided view inside a DLPack capsule (or tensor) we hold.
    Strided {
        view: StridedView,
        _owner: Bound<'py, PyAny>,
    },
    /// A buffer-protocol export, released on drop (with the GIL held, since
    /// `Held` is dropped before the binding returns).
    Buffer {
        view: Box<ffi::Py_buffer>,
        strided: StridedView,
    },
}

impl Drop for Held<'_> {
    fn drop(&mut self) {
        if let Held::Buffer { view, .. } = self {
            // SAFETY: the view was filled by a successful PyObject_GetBuffer
            // and is released exactly once, here, while attached to Python.
            unsafe { ffi::PyBuffer_Release(view.as_mut()) };
        }
    }
}

/// What the engine reads: a byte slice, or a view it must gather.
enum Source<'a> {
    Slice(&'a [u8]),
    Strided(&'a StridedView),
}

impl Held<'_> {
    fn source(&self) -> Source<'_> {
        match self {
            Held::Slice { ptr, len, .. } => Source::Slice(if *len == 0 {
                &[]
            } else {
                // SAFETY: `ptr..ptr+len` is the data of a contiguous CPU
                // tensor (or export) that `_owner` keeps alive; we only read.
                unsafe { std::slice::from_raw_parts(*ptr, *len) }
            }),
            Held::Strided { view, .. } | Held::Buffer { strided: view, .. } => match view.as_contiguous() {
                Some(s) => Source::Slice(s),
                None => Source::Strided(view),
            },
        }
    }
}

/// The caller's names for the inputs, looked up only to word an error (so
/// the happy path never converts them).
#[derive(Clone, Copy)]
struct Names<'a, 'py>(Option<&'a Bound<'py, PyAny>>);

fn label(names: Names<'_, '_>, index: usize) -> String {
    match names
        .0
        .and_then(|n| n.get_item(index).ok())
        .and_then(|n| n.extract::<String>().ok())
    {
        Some(n) => format!("tensor '{n}'"),
        None => format!("buffer #{index}"),
    }
}

/// `torch.Tensor`, if torch is already imported (if not, no tensor exists).
fn torch_tensor_type<'py>(py: Python<'py>) -> Option<&'py Bound<'py, PyType>> {
    static TENSOR: PyOnceLock<Py<PyType>> = PyOnceLock::new();
    if let Some(t) = TENSOR.get(py) {
        return Some(t.bind(py));
    }
    let modules = py.import("sys").ok()?.getattr("modules").ok()?;
    let torch = modules.get_item("torch").ok()?;
    let t = torch.getattr("Tensor").ok()?.cast_into::<PyType>().ok()?;
    Some(TENSOR.get_or_init(py, || t.unbind()).bind(py))
}

/// Zero-copy access to one object's bytes in C order.
fn acquire<'py>(obj: &Bound<'py, PyAny>, names: Names<'_, '_>, index: usize) -> PyResult<Held<'py>> {
    let py = obj.py();
    if let Some(tensor_type) = torch_tensor_type(py) {
        if obj.is_instance(tensor_type)? {
            return acquire_tensor(obj, names, index);
        }
    }
    // The buffer protocol first: it covers bytes-likes and numpy (including
    // read-only arrays, which legacy DLPack refuses to export).
    // SAFETY: `obj` is a valid object and we are attached to Python.
    if unsafe { ffi::PyObject_CheckBuffer(obj.as_ptr()) } != 0 {
        return acquire_buffer(obj, names, index);
    }
    if obj.hasattr(intern!(py, "__dlpack__"))? {
        return acquire_dlpack(obj, names, index);
    }
    acquire_buffer(obj, names, index)
}

/// The fast path for torch: a contiguous CPU tensor is read at `data_ptr()`
/// (which includes the storage offset). Everything else goes through DLPack.
fn acquire_tensor<'py>(t: &Bound<'py, PyAny>, names: Names<'_, '_>, index: usize) -> PyResult<Held<'py>> {
    if let Some(held) = exchange_view(t, names, index) {
        return Ok(held);
    }
    let py = t.py();
    if !t.getattr(intern!(py, "is_cpu"))?.is_truthy()? {
        let device = t.getattr(intern!(py, "device"))?.str()?;
        return Err(DeviceTensorError::new_err(format!(
            "{} is on device {device}; this entry point hashes host memory only \
             (weight_checker.checksum stages device tensors through pinned memory)",
            label(names, index)
        )));
    }
    // A conjugate view stores unresolved bits: its logical bytes differ from
    // memory. (Negative-bit views cannot be exported by vLLM's reference at
    // all, so they are not models' weights.)
    let tricky = t.call_method0(intern!(py, "is_conj"))?.is_truthy()?;
    if !tricky && t.call_method0(intern!(py, "is_contiguous"))?.is_truthy()? {
        let ptr: usize = t.call_method0(intern!(py, "data_ptr"))?.extract()?;
        let len: usize = t.getattr(intern!(py, "nbytes"))?.extract()?;
        if ptr == 0 && len != 0 {
            return Err(PyValueError::new_err(format!(
                "{} has no data (meta tensor?)",
                label(names, index)
            )));
        }
        return Ok(Held::Slice {
            ptr: ptr as *const u8,
            len,
            _owner: t.clone(),
        });
    }
    // Non-contiguous: DLPack describes the strides. If torch refuses to
    // export (a conjugate bit, a dtype DLPack lacks), a view prepared in
    // Python (resolved conj bits, uint8 reinterpretation) is exported instead.
    if !tricky {
        if let Ok(held) = acquire_dlpack(t, names, index) {
            return Ok(held);
        }
    }
    let helper = py.import(intern!(py, "weight_checker._tensors"))?;
    let exportable = helper.call_method1(intern!(py, "dlpack_exportable"), (t,))?;
    acquire_dlpack(&exportable, names, index)
}

/// The host-memory view a DLTensor describes, or the error naming the input.
///
/// # Safety
/// `t` must be a DLTensor filled by its producer: `shape` (and `strides`
/// when non-null) point to `ndim` integers, and the elements it describes
/// stay readable for as long as the returned view is used.
unsafe fn view_of(t: &DLTensor, names: Names<'_, '_>, index: usize) -> PyResult<StridedView> {
    if t.device.device_type != KDL_CPU && t.device.device_type != KDL_CUDA_HOST {
        return Err(DeviceTensorError::new_err(format!(
            "{} is on device {}; this entry point hashes host memory only",
            label(names, index),
            device_name(t.device.device_type, t.device.device_id)
        )));
    }
    let bits = t.dtype.bits as usize * t.dtype.lanes as usize;
    if !bits.is_multiple_of(8) {
        return Err(PyBufferError::new_err(format!(
            "{}: {bits}-bit elements are not byte-addressable",
            label(names, index)
        )));
    }
    let itemsize = bits / 8;
    let ndim = t.ndim.max(0) as usize;
    // SAFETY: per this function's contract.
    let shape: Vec<usize> = (0..ndim).map(|d| unsafe { *t.shape.add(d) } as usize).collect();
    let strides: Vec<isize> = if t.strides.is_null() {
        let mut acc = itemsize as isize;
        let mut s = vec![0isize; ndim];
        for d in (0..ndim).rev() {
            s[d] = acc;
            acc *= shape[d] as isize;
        }
        s
    } else {
        // SAFETY: per this function's contract.
        (0..ndim)
            .map(|d| unsafe { *t.strides.add(d) } as isize * itemsize as isize)
            .collect()
    };
    let ptr = (t.data as *const u8).wrapping_add(t.byte_offset as usize);
    // SAFETY: the elements are readable host memory (device checked above)
    // for as long as the caller keeps the producer alive.
    Ok(unsafe { StridedView::new(ptr, itemsize, shape, strides) })
}

fn acquire_dlpack<'py>(obj: &Bound<'py, PyAny>, names: Names<'_, '_>, index: usize) -> PyResult<Held<'py>> {
    let py = obj.py();
    let capsule = obj
        .call_method0(intern!(py, "__dlpack__"))
        .map_err(|e| PyBufferError::new_err(format!("{}: DLPack export failed: {e}", label(names, index))))?;
    let capsule = capsule.cast_into::<PyCapsule>().map_err(|_| {
        PyTypeError::new_err(format!(
            "{}: __dlpack__() did not return a capsule",
            label(names, index)
        ))
    })?;
    let managed = capsule.pointer_checked(Some(DLPACK_CAPSULE))?.as_ptr() as *const DLManagedTensor;
    // SAFETY: a capsule named "dltensor" holds a DLManagedTensor that stays
    // valid, with the tensor it describes, until the capsule's destructor
    // runs; the capsule is kept in `Held` for as long as the view is used.
    let view = unsafe { view_of(&(*managed).dl_tensor, names, index)? };
    Ok(Held::Strided {
        view,
        _owner: capsule.into_any(),
    })
}

// --- torch's DLPack exchange API (dlpack.h >= 1.3, torch >= 2.10) ------------
//
// `Tensor.__dlpack_c_exchange_api__` is a capsule holding a static table of C
// functions; `dltensor_from_py_object_no_sync` fills a DLTensor for a tensor
// without any Python call: one C call instead of the five attribute reads
// (~0.5 us) the fallback needs. It is what keeps models with thousands of
// small parameters fast.

#[repr(C)]
struct DLPackVersion {
    major: u32,
    minor: u32,
}

#[repr(C)]
struct DLPackExchangeApi {
    version: DLPackVersion,
    prev_api: *const c_void,
    managed_tensor_allocator: *const c_void,
    managed_tensor_from_py_object_no_sync: *const c_void,
    managed_tensor_to_py_object_no_sync: *const c_void,
    dltensor_from_py_object_no_sync: Option<unsafe extern "C" fn(*mut c_void, *mut DLTensor) -> c_int>,
    current_work_stream: *const c_void,
}

type DlTensorFromPy = unsafe extern "C" fn(*mut c_void, *mut DLTensor) -> c_int;

/// torch's exchange function, with the exact tensor types it was read from.
struct Exchange {
    fill: DlTensorFromPy,
    tensor: Py<PyType>,
    parameter: Option<Py<PyType>>,
}

fn torch_exchange(py: Python<'_>) -> Option<&Exchange> {
    static EXCHANGE: PyOnceLock<Option<Exchange>> = PyOnceLock::new();
    EXCHANGE
        .get_or_init(py, || {
            let torch = py.import("sys").ok()?.getattr("modules").ok()?.get_item("torch").ok()?;
            let tensor = torch.getattr("Tensor").ok()?.cast_into::<PyType>().ok()?;
            let capsule = tensor
                .getattr("__dlpack_c_exchange_api__")
                .ok()?
                .cast_into::<PyCapsule>()
                .ok()?;
            let api = capsule.pointer_checked(Some(c"dlpack_exchange_api")).ok()?.as_ptr() as *const DLPackExchangeApi;
            // SAFETY: the capsule points to torch's static, process-lifetime
            // DLPackExchangeApi; the major version is checked before any other
            // field is read, since only major 1 has this layout.
            let fill = unsafe {
                if (*api).version.major != 1 {
                    return None;
                }
                (*api).dltensor_from_py_object_no_sync?
            };
            let parameter = torch
                .getattr("nn")
                .and_then(|nn| nn.getattr("Parameter"))
                .ok()
                .and_then(|p| p.cast_into::<PyType>().ok())
                .map(Bound::unbind);
            Some(Exchange {
                fill,
                tensor: tensor.unbind(),
                parameter,
            })
        })
        .as_ref()
}

/// A host view of a plain `torch.Tensor` / `nn.Parameter` through the
/// exchange API; `None` when it does not apply (other types, a producer
/// error such as a conjugate or meta tensor), leaving the caller's fallback.
fn exchange_view<'py>(t: &Bound<'py, PyAny>, names: Names<'_, '_>, index: usize) -> Option<Held<'py>> {
    let py = t.py();
    let ex = torch_exchange(py)?;
    // The API is defined for the exact type it was discovered from; torch's
    // Parameter shares it (same table), other subclasses take the fallback.
    let ty = t.get_type();
    if !(ty.is(ex.tensor.bind(py)) || ex.parameter.as_ref().is_some_and(|p| ty.is(p.bind(py)))) {
        return None;
    }
    let mut dl = std::mem::MaybeUninit::<DLTensor>::zeroed();
    // SAFETY: `t` is a live torch tensor of the type the table belongs to and
    // we are attached to Python; the function writes only `*dl`.
    let rc = unsafe { (ex.fill)(t.as_ptr().cast(), dl.as_mut_ptr()) };
    if rc != 0 {
        let _ = PyErr::take(py); // the fallback path reports a proper error
        return None;
    }
    // SAFETY: rc == 0, so the producer filled the DLTensor.
    let dl = unsafe { dl.assume_init() };
    if dl.device.device_type != KDL_CPU {
        return None; // device tensors: the fallback names them
    }
    if dl.dtype.code == KDL_COMPLEX {
        // The export ignores a conjugate bit; the fallback resolves it.
        return None;
    }
    // The common case, a contiguous tensor, becomes a plain byte range with
    // no allocation (this path runs once per parameter).
    // SAFETY: `dl` was filled by torch for `t`: shape and strides point into
    // its TensorImpl, both alive while `t` is and read before anything can
    // resize it.
    if let Some(len) = unsafe { contiguous_len(&dl) } {
        return Some(Held::Slice {
            ptr: (dl.data as *const u8).wrapping_add(dl.byte_offset as usize),
            len,
            _owner: t.clone(),
        });
    }
    // SAFETY: as above; the data stays in `t`'s storage, kept alive in `Held`.
    let view = unsafe { view_of(&dl, names, index).ok()? };
    Some(Held::Strided {
        view,
        _owner: t.clone(),
    })
}

/// The byte length of a C-contiguous DLTensor of whole bytes, or `None`
/// when it is strided (or has sub-byte elements).
///
/// # Safety
/// `t.shape` (and `t.strides` when non-null) must point to `t.ndim` integers.
unsafe fn contiguous_len(t: &DLTensor) -> Option<usize> {
    let bits = t.dtype.bits as usize * t.dtype.lanes as usize;
    if bits == 0 || !bits.is_multiple_of(8) {
        return None;
    }
    let ndim = t.ndim.max(0) as usize;
    let mut expected: i64 = 1;
    for d in (0..ndim).rev() {
        // SAFETY: d < ndim, per this function's contract.
        let n = unsafe { *t.shape.add(d) };
        if !t.strides.is_null() && n != 1 && unsafe { *t.strides.add(d) } != expected {
            return None;
        }
        expected = expected.checked_mul(n)?;
    }
    usize::try_from(expected).ok()?.checked_mul(bits / 8)
}

fn acquire_buffer<'py>(obj: &Bound<'py, PyAny>, names: Names<'_, '_>, index: usize) -> PyResult<Held<'py>> {
    let mut view: Box<ffi::Py_buffer> = Box::new(unsafe { std::mem::zeroed() });
    // SAFETY: `view` is writable storage for a Py_buffer; on success it must
    // be released exactly once (done by `Held::drop`).
    let rc: c_int = unsafe { ffi::PyObject_GetBuffer(obj.as_ptr(), view.as_mut(), ffi::PyBUF_RECORDS_RO) };
    if rc != 0 {
        let cause = PyErr::fetch(obj.py());
        return Err(PyTypeError::new_err(format!(
            "{}: expected a tensor, an object with __dlpack__, or a bytes-like object, got {} ({cause})",
            label(names, index),
            obj.get_type().name().map(|n| n.to_string()).unwrap_or_default()
        )));
    }
    let ndim = view.ndim.max(0) as usize;
    let itemsize = view.itemsize.max(1) as usize;
    // SAFETY: with PyBUF_STRIDES the exporter fills `shape` and `strides`
    // for `ndim` dimensions (both may be null only when ndim == 0).
    let (shape, strides): (Vec<usize>, Vec<isize>) = if ndim == 0 {
        (vec![view.len as usize / itemsize], vec![itemsize as isize])
    } else {
        (0..ndim)
            .map(|d| unsafe { (*view.shape.add(d) as usize, *view.strides.add(d)) })
            .unzip()
    };
    if !view.suboffsets.is_null() {
        let held = Held::Buffer {
            strided: unsafe { StridedView::new(std::ptr::null(), 1, vec![0], vec![1]) },
            view,
        };
        drop(held);
        return Err(PyBufferError::new_err(format!(
            "{}: indirect (PIL-style) buffers are not supported",
            label(names, index)
        )));
    }
    // SAFETY: the exporter guarantees the described memory stays valid until
    // PyBuffer_Release, which only `Held::drop` calls.
    let strided = unsafe { StridedView::new(view.buf as *const u8, itemsize, shape, strides) };
    Ok(Held::Buffer { view, strided })
}

// --- hashing ---------------------------------------------------------------

/// Hashes every held input: contiguous ones together through the engine,
/// strided ones gathered in bounded pieces, all with the GIL released.
fn digest_held(py: Python<'_>, held: &[Held<'_>]) -> Vec<Digest> {
    digest_held_refs(py, &held.iter().collect::<Vec<_>>())
}

fn digest_held_refs(py: Python<'_>, held: &[&Held<'_>]) -> Vec<Digest> {
    let sources: Vec<Source<'_>> = held.iter().map(|h| h.source()).collect();
    let total: usize = sources
        .iter()
        .map(|s| match s {
            Source::Slice(b) => b.len(),
            Source::Strided(v) => v.nbytes(),
        })
        .sum();
    let work = move || {
        let engine = Engine::default();
        let slices: Vec<&[u8]> = sources
            .iter()
            .map(|s| match s {
                Source::Slice(b) => *b,
                Source::Strided(_) => &[][..],
            })
            .collect();
        let mut digests = engine.hash_many(&slices);
        use rayon::prelude::*;
        let strided: Vec<(usize, Digest)> = sources
            .par_iter()
            .enumerate()
            .filter_map(|(i, s)| match s {
                Source::Strided(v) => Some((i, v.digest(engine.backend))),
                Source::Slice(_) => None,
            })
            .collect();
        for (i, d) in strided {
            digests[i] = d;
        }
        digests
    };
    if total > RELEASE_GIL_BYTES {
        py.detach(work)
    } else {
        work()
    }
}

fn check_names(names: Option<&Bound<'_, PyAny>>, n: usize) -> PyResult<()> {
    if let Some(names) = names {
        let len = names.len()?;
        if len != n {
            return Err(PyValueError::new_err(format!("{len} names for {n} buffers")));
        }
    }
    Ok(())
}

/// Below this many inputs, acquire everything first, then hash.
const STREAM_MIN_ITEMS: usize = 512;
/// Streamed batches close at this many inputs or bytes.
const STREAM_BATCH_ITEMS: usize = 256;
const STREAM_BATCH_BYTES: usize = 8 << 20;
/// Inputs larger than this are not streamed: they wait for the final
/// all-threads pass, which schedules them largest first.
const STREAM_MAX_ITEM_BYTES: usize = 1 << 20;

/// Digests of many Python objects.
///
/// Reading each tensor's address costs a few Python calls (~0.5 us), about as
/// much as hashing a 4 KiB tensor. With many inputs, batches of small ones
/// are therefore hashed on the pool while this thread, holding the GIL, goes
/// on acquiring the next ones; large and strided inputs are hashed at the
/// end by all threads. The result does not depend on the path taken.
fn digest_objects<'py>(
    py: Python<'py>,
    objs: Vec<Bound<'py, PyAny>>,
    names: Option<&Bound<'py, PyAny>>,
) -> PyResult<Vec<Digest>> {
    check_names(names, objs.len())?;
    let names = Names(names);
    if objs.len() < STREAM_MIN_ITEMS {
        let held = objs
            .iter()
            .enumerate()
            .map(|(i, o)| acquire(o, names, i))
            .collect::<PyResult<Vec<_>>>()?;
        return Ok(digest_held(py, &held));
    }
    // Declared before the scope so that it outlives every spawned batch, even
    // when an acquisition fails part-way (the scope joins its tasks first).
    let mut held: Vec<Held<'_>> = Vec::with_capacity(objs.len());
    let streamed: Mutex<Vec<(Vec<usize>, Vec<Digest>)>> = Mutex::new(Vec::new());
    let engine = Engine {
        threads: 1,
        ..Engine::default()
    };
    let hash_batch = |batch: Vec<(usize, &[u8])>| {
        let (idx, slices): (Vec<usize>, Vec<&[u8]>) = batch.into_iter().unzip();
        let digests = engine.hash_many(&slices);
        streamed.lock().unwrap_or_else(|e| e.into_inner()).push((idx, digests));
    };
    rayon::in_place_scope(|scope| -> PyResult<()> {
        let mut batch: Vec<(usize, &[u8])> = Vec::new();
        let mut batch_bytes = 0;
        for (i, obj) in objs.iter().enumerate() {
            let h = acquire(obj, names, i)?;
            if let Source::Slice(s) = h.source() {
                if s.len() <= STREAM_MAX_ITEM_BYTES {
                    // SAFETY: the bytes belong to the object `h` keeps alive;
                    // `h` goes into `held`, which outlives this scope and so
                    // every task reading the slice.
                    let s: &[u8] = unsafe { std::slice::from_raw_parts(s.as_ptr(), s.len()) };
                    batch.push((i, s));
                    batch_bytes += s.len();
                }
            }
            held.push(h);
            if batch.len() >= STREAM_BATCH_ITEMS || batch_bytes >= STREAM_BATCH_BYTES {
                let full = std::mem::take(&mut batch);
                batch_bytes = 0;
                scope.spawn(|_| hash_batch(full));
            }
        }
        py.detach(|| hash_batch(batch));
        Ok(())
    })?;
    let mut digests: Vec<Option<Digest>> = vec![None; held.len()];
    for (idx, ds) in streamed.into_inner().unwrap_or_else(|e| e.into_inner()) {
        for (i, d) in idx.into_iter().zip(ds) {
            digests[i] = Some(d);
        }
    }
    // What was not streamed (large or strided) goes through the full engine.
    let rest: Vec<usize> = (0..held.len()).filter(|&i| digests[i].is_none()).collect();
    if !rest.is_empty() {
        let rest_held: Vec<&Held<'_>> = rest.iter().map(|&i| &held[i]).collect();
        for (i, d) in rest.iter().zip(digest_held_refs(py, &rest_held)) {
            digests[*i] = Some(d);
        }
    }
    Ok(digests.into_iter().map(|d| d.expect("every input digested")).collect())
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
            inner: Some(Engine::default().multi(n)),
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
/// stream of the engine, pages dropped once hashed): `[(name, hex,
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
    let engine = Engine::default();
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
        checkpoint::checksum_files(&files, &engine, Some(&mut report))
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

/// Copies `src`'s C-order bytes into `dst`, a writable contiguous buffer of
/// the same size, on this thread with the GIL released: the host copy engine
/// of the staging pipeline (one thread, as a DMA engine takes none, where
/// torch's `copy_` would fan out over the cores the hashing needs).
#[pyfunction]
fn copy_into(py: Python<'_>, dst: &Bound<'_, PyAny>, src: &Bound<'_, PyAny>) -> PyResult<()> {
    let held = acquire(src, Names(None), 0)?;
    let Source::Slice(from) = held.source() else {
        return Err(PyBufferError::new_err("copy_into: the source must be contiguous"));
    };
    let mut view: Box<ffi::Py_buffer> = Box::new(unsafe { std::mem::zeroed() });
    // SAFETY: `view` is writable storage for a Py_buffer; on success it is
    // released exactly once below.
    let flags = ffi::PyBUF_WRITABLE | ffi::PyBUF_C_CONTIGUOUS;
    if unsafe { ffi::PyObject_GetBuffer(dst.as_ptr(), view.as_mut(), flags) } != 0 {
        return Err(PyErr::fetch(py));
    }
    let len = view.len.max(0) as usize;
    let result = if len != from.len() {
        Err(PyValueError::new_err(format!(
            "copy_into: destination has {len} bytes, source {}",
            from.len()
        )))
    } else {
        let to = view.buf as usize;
        let from_ptr = from.as_ptr() as usize;
        // SAFETY: the exporter guarantees `len` writable, contiguous bytes at
        // `buf` until PyBuffer_Release (below, after the copy); the source's
        // bytes are kept alive by `held`. `copy` (memmove) is used, so even
        // overlapping ranges are sound.
        py.detach(|| unsafe { std::ptr::copy(from_ptr as *const u8, to as *mut u8, len) });
        Ok(())
    };
    // SAFETY: released exactly once, attached to Python.
    unsafe { ffi::PyBuffer_Release(view.as_mut()) };
    result
}

/// The compression backend in use (`sha-ni` or `portable`).
#[pyfunction]
fn backend() -> &'static str {
    Backend::active().name()
}

/// Worker threads the engine uses.
#[pyfunction]
fn threads() -> usize {
    Engine::default().effective_threads()
}

/// Streams each engine thread interleaves (measured at first use, or
/// `WEIGHT_CHECKER_LANES`).
#[pyfunction]
fn lanes() -> usize {
    Engine::default().effective_lanes()
}

/// This core's SHA-256 throughput with 1, 2 and 4 interleaved streams, as
/// the lane calibration measures it: `{lanes: GB/s}`. Its best figure times
/// the threads is the machine's hashing ceiling, which benchmarks report
/// their figures against.
#[pyfunction]
fn calibrate(py: Python<'_>) -> Vec<(usize, f64)> {
    py.detach(|| Backend::active().calibrate_lanes().1.to_vec())
}

/// Messages the engine keeps in flight: threads x lanes.
#[pyfunction]
fn streams() -> usize {
    Engine::default().streams()
}

/// Sets the engine's default worker threads for this process (0: all cores
/// in the CPU affinity). `WEIGHT_CHECKER_THREADS`, when set, wins.
#[pyfunction]
fn set_threads(threads: usize) {
    crate::engine::set_default_threads(threads)
}

#[pymodule]
#[pyo3(name = "_core")]
fn core_module(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(sha256_many, m)?)?;
    m.add_function(wrap_pyfunction!(digest_many, m)?)?;
    m.add_function(wrap_pyfunction!(backend, m)?)?;
    m.add_function(wrap_pyfunction!(threads, m)?)?;
    m.add_function(wrap_pyfunction!(streams, m)?)?;
    m.add_function(wrap_pyfunction!(lanes, m)?)?;
    m.add_function(wrap_pyfunction!(calibrate, m)?)?;
    m.add_function(wrap_pyfunction!(copy_into, m)?)?;
    m.add_function(wrap_pyfunction!(set_threads, m)?)?;
    m.add_function(wrap_pyfunction!(checksum_safetensors, m)?)?;
    m.add_function(wrap_pyfunction!(safetensors_tensors, m)?)?;
    m.add_class::<MultiHasher>()?;
    m.add("SafetensorsError", m.py().get_type::<SafetensorsError>())?;
    m.add("DeviceTensorError", m.py().get_type::<DeviceTensorError>())?;
    Ok(())
}
