//! torch's types and methods, looked up once per process (the one cache of
//! them, which the walk and the acquisition compare with), and where a
//! tensor object keeps its `TensorImpl`, to prefetch it.

use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::PyType;

/// The torch objects the walk compares against, read once.
pub(super) struct Torch {
    pub(super) module: Py<PyType>,
    pub(super) named_modules: Py<PyAny>,
    pub(super) named_parameters: Py<PyAny>,
    pub(super) named_members: Py<PyAny>,
    pub(super) module_hash: Py<PyAny>,
    pub(super) module_getattribute: Py<PyAny>,
    pub(super) tensor: Py<PyType>,
    pub(super) tensor_hash: Py<PyAny>,
    pub(super) parameter: Py<PyType>,
    /// Where a `Tensor` or `Parameter` object holds its `TensorImpl*`, when
    /// found (see [`impl_offset`]); only ever used as a prefetch address.
    pub(super) impl_offset: Option<usize>,
}

/// torch's types and methods the walk and the acquisition compare with,
/// looked up once per process (the one cache of them).
pub(super) fn torch(py: Python<'_>) -> Option<&Torch> {
    static TORCH: PyOnceLock<Torch> = PyOnceLock::new();
    if let Some(t) = TORCH.get(py) {
        return Some(t);
    }
    // Not cached while torch is not imported: then no module exists yet.
    let torch = py.import("sys").ok()?.getattr("modules").ok()?.get_item("torch").ok()?;
    let module = torch
        .getattr("nn")
        .ok()?
        .getattr("Module")
        .ok()?
        .cast_into::<PyType>()
        .ok()?;
    let tensor = torch.getattr("Tensor").ok()?.cast_into::<PyType>().ok()?;
    let found = Torch {
        named_modules: module.getattr("named_modules").ok()?.unbind(),
        named_parameters: module.getattr("named_parameters").ok()?.unbind(),
        named_members: module.getattr("_named_members").ok()?.unbind(),
        module_hash: module.getattr("__hash__").ok()?.unbind(),
        module_getattribute: module.getattr("__getattribute__").ok()?.unbind(),
        tensor_hash: tensor.getattr("__hash__").ok()?.unbind(),
        parameter: torch
            .getattr("nn")
            .ok()?
            .getattr("Parameter")
            .ok()?
            .cast_into::<PyType>()
            .ok()?
            .unbind(),
        module: module.unbind(),
        tensor: tensor.unbind(),
        impl_offset: None,
    };
    let found = Torch {
        impl_offset: impl_offset(&torch, &found),
        ..found
    };
    Some(TORCH.get_or_init(py, || found))
}

/// The byte offset at which both a `Tensor` and a `Parameter` object store
/// the address of their `TensorImpl`, found by comparing each word of two
/// probes of each type with what torch reports (`_cdata`); `None` when no
/// offset fits all four (another torch layout: then nothing is prefetched).
///
/// Reading a tensor's address costs a chain of cache misses when 10,000
/// parameters have been evicted by the hashing of their bytes. Knowing
/// where the object keeps its `TensorImpl*`, the walk asks the cache for
/// that `TensorImpl` a few parameters early ([`prefetch_impl`]). The word is
/// only a hint: it is never dereferenced, and a wrong one costs a wasted
/// prefetch, never a wrong digest.
fn impl_offset(torch: &Bound<'_, PyAny>, t: &Torch) -> Option<usize> {
    let py = torch.py();
    let mut probes = Vec::new();
    for _ in 0..2 {
        let kwargs = pyo3::types::PyDict::new(py);
        kwargs.set_item("device", "cpu").ok()?;
        let plain = torch.call_method("empty", (1,), Some(&kwargs)).ok()?;
        let param = t.parameter.bind(py).call1((plain.clone(), false)).ok()?;
        probes.push(plain);
        probes.push(param);
    }
    let size = |o: &Bound<'_, PyAny>| -> Option<usize> { o.get_type().getattr("__basicsize__").ok()?.extract().ok() };
    let words = probes
        .iter()
        .map(&size)
        .collect::<Option<Vec<usize>>>()?
        .into_iter()
        .min()?
        / 8;
    let expected = probes
        .iter()
        .map(|p| p.getattr("_cdata").ok()?.extract::<usize>().ok())
        .collect::<Option<Vec<usize>>>()?;
    // Past the object header (reference count and type).
    (2..words).map(|w| 8 * w).find(|&offset| {
        probes.iter().zip(&expected).all(|(p, &want)| {
            // SAFETY: `offset + 8 <= tp_basicsize` of the probe's exact type,
            // so the read stays inside the live object `p`.
            let word = unsafe { std::ptr::read_unaligned((p.as_ptr() as *const u8).add(offset) as *const usize) };
            word == want && want != 0
        })
    })
}

/// Where this torch's `Tensor` objects keep their `TensorImpl*` (the
/// walk's prefetch hint), or `None` when the layout was not recognised.
pub(super) fn tensor_impl_offset(py: Python<'_>) -> Option<usize> {
    torch(py)?.impl_offset
}

/// Asks the cache for the first 256 bytes of `v`'s `TensorImpl`, when `v` is
/// exactly a `Tensor` or `Parameter` and the layout was recognised.
pub(super) fn prefetch_impl(t: &Torch, v: &Bound<'_, PyAny>) {
    let Some(offset) = t.impl_offset else {
        return;
    };
    let py = v.py();
    let ty = v.get_type();
    if !(ty.is(t.tensor.bind(py)) || ty.is(t.parameter.bind(py))) {
        return;
    }
    // SAFETY: `v` is alive and of a type whose basic size exceeds
    // `offset + 8` (checked by `impl_offset` on both types), so the read is
    // inside the object. The word is only a prefetch address.
    let address = unsafe { std::ptr::read_unaligned((v.as_ptr() as *const u8).add(offset) as *const usize) };
    crate::prefetch::lines(address, 4);
}
