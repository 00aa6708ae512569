//! The DLPack C ABI (https://dmlc.github.io/dlpack/latest/c_api.html) and
//! torch's DLPack exchange API: the structs, as C lays them out, and the few
//! facts read from them. No Python objects are handled here.

use std::ffi::{c_int, c_void, CStr};

use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyCapsule, PyCapsuleMethods, PyType};

pub(super) const KDL_CPU: i32 = 1;
pub(super) const KDL_CUDA_HOST: i32 = 3;
pub(super) const KDL_COMPLEX: u8 = 5;
pub(super) const DLPACK_CAPSULE: &CStr = c"dltensor";

#[repr(C)]
pub(super) struct DLDevice {
    pub(super) device_type: i32,
    pub(super) device_id: i32,
}

#[repr(C)]
pub(super) struct DLDataType {
    pub(super) code: u8,
    pub(super) bits: u8,
    pub(super) lanes: u16,
}

#[repr(C)]
pub(super) struct DLTensor {
    pub(super) data: *mut c_void,
    pub(super) device: DLDevice,
    pub(super) ndim: i32,
    pub(super) dtype: DLDataType,
    pub(super) shape: *const i64,
    pub(super) strides: *const i64,
    pub(super) byte_offset: u64,
}

#[repr(C)]
pub(super) struct DLManagedTensor {
    pub(super) dl_tensor: DLTensor,
    pub(super) manager_ctx: *mut c_void,
    pub(super) deleter: Option<unsafe extern "C" fn(*mut DLManagedTensor)>,
}

pub(super) fn device_name(device_type: i32, id: i32) -> String {
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

// --- torch's DLPack exchange API (dlpack.h >= 1.3, torch >= 2.10) ------------
//
// `Tensor.__dlpack_c_exchange_api__` is a capsule holding a static table of C
// functions; `dltensor_from_py_object_no_sync` fills a DLTensor for a tensor
// without any Python call: one C call instead of the five attribute reads
// (~0.5 us) the fallback needs. It is what keeps models with thousands of
// small parameters fast.

#[repr(C)]
pub(super) struct DLPackVersion {
    pub(super) major: u32,
    pub(super) minor: u32,
}

#[repr(C)]
pub(super) struct DLPackExchangeApi {
    pub(super) version: DLPackVersion,
    pub(super) prev_api: *const c_void,
    pub(super) managed_tensor_allocator: *const c_void,
    pub(super) managed_tensor_from_py_object_no_sync: *const c_void,
    pub(super) managed_tensor_to_py_object_no_sync: *const c_void,
    pub(super) dltensor_from_py_object_no_sync: Option<unsafe extern "C" fn(*mut c_void, *mut DLTensor) -> c_int>,
    pub(super) current_work_stream: *const c_void,
}

pub(super) type DlTensorFromPy = unsafe extern "C" fn(*mut c_void, *mut DLTensor) -> c_int;

/// torch's exchange function, with the exact tensor types it was read from.
pub(super) struct Exchange {
    pub(super) fill: DlTensorFromPy,
    pub(super) tensor: Py<PyType>,
    pub(super) parameter: Option<Py<PyType>>,
}

pub(super) fn torch_exchange(py: Python<'_>) -> Option<&Exchange> {
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

/// The byte length of a C-contiguous DLTensor of whole bytes, or `None`
/// when it is strided (or has sub-byte elements).
///
/// # Safety
/// `t.shape` (and `t.strides` when non-null) must point to `t.ndim` integers.
pub(super) unsafe fn contiguous_len(t: &DLTensor) -> Option<usize> {
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
