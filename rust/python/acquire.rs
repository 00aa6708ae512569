//! Zero-copy access to the bytes of Python objects: torch tensors (through
//! torch's exchange API, else DLPack), objects with `__dlpack__`, and the
//! buffer protocol. What comes out is a byte range or a strided view, and
//! the Python object that keeps it alive.
//!
//! The bytes are read in place, not copied, and mostly with the GIL
//! released. Besides their owner keeping them alive, that needs the
//! caller's contract: nobody writes an input (another Python thread, a
//! device copy, an optimizer step) from its acquisition until its digest is
//! out. For a model: it is not being updated during a checksum. A write in
//! that window is a data race on memory Rust reads through `&[u8]`, and the
//! digest would mix old and new bytes.

use std::ffi::c_int;

use pyo3::exceptions::{PyBufferError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyCapsule, PyCapsuleMethods, PyType};
use pyo3::{ffi, intern};

use super::dlpack::{
    contiguous_len, device_name, torch_exchange, DLManagedTensor, DLTensor, DLPACK_CAPSULE, KDL_COMPLEX, KDL_CPU,
    KDL_CUDA_HOST,
};
use super::DeviceTensorError;
use crate::strided::StridedView;

/// The bytes of one input, and what keeps them alive.
pub(super) enum Held<'py> {
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
    /// A buffer-protocol export (released when dropped).
    Buffer {
        _export: BufferExport,
        strided: StridedView,
    },
}

/// One buffer-protocol export of an object, released exactly once when
/// dropped. Dropped while attached to Python: every holder is dropped before
/// its binding call returns.
pub(super) struct BufferExport(Box<ffi::Py_buffer>);

impl BufferExport {
    /// `PyObject_GetBuffer(obj, flags)`; the exporter's error as is.
    pub(super) fn new(obj: &Bound<'_, PyAny>, flags: c_int) -> PyResult<BufferExport> {
        // SAFETY: a zeroed Py_buffer is valid storage for the exporter to fill.
        let mut view: Box<ffi::Py_buffer> = Box::new(unsafe { std::mem::zeroed() });
        // SAFETY: `view` is writable storage for a Py_buffer and we are
        // attached to Python; on success `Drop` releases it once.
        if unsafe { ffi::PyObject_GetBuffer(obj.as_ptr(), view.as_mut(), flags) } != 0 {
            return Err(PyErr::fetch(obj.py()));
        }
        Ok(BufferExport(view))
    }

    pub(super) fn view(&self) -> &ffi::Py_buffer {
        &self.0
    }
}

impl Drop for BufferExport {
    fn drop(&mut self) {
        // SAFETY: filled by a successful PyObject_GetBuffer (`new`), released
        // exactly once, here, while attached to Python.
        unsafe { ffi::PyBuffer_Release(self.0.as_mut()) };
    }
}

/// What the scheduler reads: a byte slice, or a view it must gather.
pub(super) enum Source<'a> {
    Slice(&'a [u8]),
    Strided(&'a StridedView),
}

impl Source<'_> {
    /// Bytes of the input in C order.
    pub(super) fn len(&self) -> usize {
        match self {
            Source::Slice(b) => b.len(),
            Source::Strided(v) => v.nbytes(),
        }
    }
}

impl Held<'_> {
    pub(super) fn source(&self) -> Source<'_> {
        match self {
            Held::Slice { ptr, len, .. } => Source::Slice(if *len == 0 {
                &[]
            } else {
                // SAFETY: `ptr..ptr+len` is the data of a contiguous CPU
                // tensor (or export) that `_owner` keeps alive for as long
                // as `self`, which the slice borrows; we only read it. It
                // does not change while the slice is used: by the caller's
                // contract (see the module doc), nobody writes the tensor
                // while it is hashed, though the GIL is released then.
                unsafe { std::slice::from_raw_parts(*ptr, *len) }
            }),
            Held::Strided { view, .. } | Held::Buffer { strided: view, .. } => match view.as_contiguous() {
                Some(s) => Source::Slice(s),
                None => Source::Strided(view),
            },
        }
    }
}

impl<'py> Held<'py> {
    /// A contiguous input as its address, length and the object that keeps
    /// the bytes alive, for a reader past this call (a background thread);
    /// `None` for a strided view, or a buffer export (released attached to
    /// Python). The bytes stay valid while the owner lives (the variants'
    /// invariant, see [`Held::source`]).
    pub(super) fn into_contiguous(self) -> Option<(*const u8, usize, Py<PyAny>)> {
        match self {
            Held::Slice { ptr, len, _owner } => Some((ptr, len, _owner.unbind())),
            Held::Strided { view, _owner } if view.nbytes() == 0 => Some((std::ptr::null(), 0, _owner.unbind())),
            Held::Strided { view, _owner } => {
                let (ptr, len) = view.as_contiguous().map(|s| (s.as_ptr(), s.len()))?;
                Some((ptr, len, _owner.unbind()))
            }
            Held::Buffer { .. } => None,
        }
    }
}

/// The caller's names for the inputs, looked up only to word an error (so
/// the happy path never converts them).
#[derive(Clone, Copy)]
pub(super) struct Names<'a, 'py>(pub(super) Option<&'a Bound<'py, PyAny>>);

pub(super) fn label(names: Names<'_, '_>, index: usize) -> String {
    match names
        .0
        .and_then(|n| n.get_item(index).ok())
        .and_then(|n| n.extract::<String>().ok())
    {
        Some(n) => format!("tensor '{n}'"),
        None => format!("buffer #{index}"),
    }
}

/// `torch.Tensor`, if torch is already imported (if not, no tensor exists):
/// from the one cache of torch's types ([`super::torch_types::torch`]).
pub(super) fn torch_tensor_type<'py>(py: Python<'py>) -> Option<&'py Bound<'py, PyType>> {
    super::torch_types::torch(py).map(|t| t.tensor.bind(py))
}

/// Zero-copy access to one object's bytes in C order.
pub(super) fn acquire<'py>(obj: &Bound<'py, PyAny>, names: Names<'_, '_>, index: usize) -> PyResult<Held<'py>> {
    // A plain tensor or parameter first, with one C call and no isinstance:
    // this runs once per parameter.
    if let Some(held) = exchange_view(obj, names, index) {
        return Ok(held);
    }
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

/// A tensor the exchange API declined (a subclass, a device or conjugate
/// tensor, an older torch): a contiguous CPU tensor is read at `data_ptr()`
/// (which includes the storage offset), everything else through DLPack.
fn acquire_tensor<'py>(t: &Bound<'py, PyAny>, names: Names<'_, '_>, index: usize) -> PyResult<Held<'py>> {
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
    let helper = py.import(intern!(py, "weight_checker.hashing.dlpack_export"))?;
    let exportable = helper.call_method1(intern!(py, "dlpack_exportable"), (t,))?;
    acquire_dlpack(&exportable, names, index)
}

/// The host-memory view a DLTensor describes, or the error naming the input.
///
/// # Safety
/// `t` must be a DLTensor filled by its producer: `shape` (and `strides`
/// when non-null) point to `ndim` integers, and the elements it describes
/// stay readable, and unwritten by anyone (the caller's contract: the
/// tensor is not updated while it is hashed), for as long as the returned
/// view is used.
pub(super) unsafe fn view_of(t: &DLTensor, names: Names<'_, '_>, index: usize) -> PyResult<StridedView> {
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
    // for as long as the caller keeps the producer alive, and nobody writes
    // them meanwhile: both per this function's contract.
    Ok(unsafe { StridedView::new(ptr, itemsize, shape, strides) })
}

pub(super) fn acquire_dlpack<'py>(obj: &Bound<'py, PyAny>, names: Names<'_, '_>, index: usize) -> PyResult<Held<'py>> {
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
    // Nobody writes the tensor meanwhile: the caller's contract (module doc).
    let view = unsafe { view_of(&(*managed).dl_tensor, names, index)? };
    Ok(Held::Strided {
        view,
        _owner: capsule.into_any(),
    })
}

/// A host view of a plain `torch.Tensor` / `nn.Parameter` through the
/// exchange API; `None` when it does not apply (other types, a producer
/// error such as a conjugate or meta tensor), leaving the caller's fallback.
pub(super) fn exchange_view<'py>(t: &Bound<'py, PyAny>, names: Names<'_, '_>, index: usize) -> Option<Held<'py>> {
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
    // SAFETY: as above; the data stays in `t`'s storage, kept alive in
    // `Held`, and unwritten while it is hashed (the caller's contract).
    let view = unsafe { view_of(&dl, names, index).ok()? };
    Some(Held::Strided {
        view,
        _owner: t.clone(),
    })
}

pub(super) fn acquire_buffer<'py>(obj: &Bound<'py, PyAny>, names: Names<'_, '_>, index: usize) -> PyResult<Held<'py>> {
    let export = BufferExport::new(obj, ffi::PyBUF_RECORDS_RO).map_err(|cause| {
        PyTypeError::new_err(format!(
            "{}: expected a tensor, an object with __dlpack__, or a bytes-like object, got {} ({cause})",
            label(names, index),
            obj.get_type().name().map(|n| n.to_string()).unwrap_or_default()
        ))
    })?;
    let view = export.view();
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
        drop(export);
        return Err(PyBufferError::new_err(format!(
            "{}: indirect (PIL-style) buffers are not supported",
            label(names, index)
        )));
    }
    // SAFETY: the exporter guarantees the described memory stays valid until
    // PyBuffer_Release, which only the export's `drop` calls, and `Held`
    // keeps the export alive as long as the view. A read-only export does
    // not stop others writing the object (a numpy array, a bytearray): that
    // nobody does while it is hashed is the caller's contract (module doc).
    let strided = unsafe { StridedView::new(view.buf as *const u8, itemsize, shape, strides) };
    Ok(Held::Buffer {
        _export: export,
        strided,
    })
}
