//! torch's `Module.named_parameters()`, walked in Rust when the model uses
//! torch's own walk.
//!
//! On a model with many small parameters the Python generators of
//! `named_parameters` cost about a third of a microsecond per parameter, a
//! quarter of hashing a 4 KiB tensor on one core, and they ran before any
//! hashing could start. This walk reads the same dicts (`_modules`,
//! `_parameters`) in the same order with the same de-duplication, so its
//! output is exactly torch's, in a sixth of the time, and it yields the
//! parameters one by one so that hashing starts with the first. It only
//! runs where that equality is certain: every module type on the way must
//! inherit torch's `named_modules`, `named_parameters`, `_named_members`,
//! `__getattribute__` and identity hash, with no instance attribute
//! shadowing those methods; every dict must be a plain `dict` with `str`
//! keys, and every parameter a tensor hashed by identity. Anything else
//! answers `None` (or sets [`Leaves::declined`]) and the caller walks in
//! Python, as before. Going through a module's parameters, it asks the cache
//! for each one's `TensorImpl` a few parameters early ([`prefetch_impl`]),
//! since torch's exchange call otherwise waits on those misses.

use std::collections::HashSet;
use std::hash::{BuildHasherDefault, Hasher};

use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyString, PyTuple};
use pyo3::{ffi, intern};

use super::torch_types::{prefetch_impl, torch, Torch};

/// Hashes an object's address for the identity sets below (SipHash, the
/// default, costs more than the rest of a set insertion).
#[derive(Default)]
struct AddressHasher(u64);

impl Hasher for AddressHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 << 8 | b as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        }
    }

    fn write_usize(&mut self, n: usize) {
        // Fibonacci hashing: the multiply spreads the aligned low bits.
        self.0 = (n as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    }
}

/// A set of object or type addresses.
type AddressSet<T> = HashSet<*mut T, BuildHasherDefault<AddressHasher>>;

/// Parameters ahead of the current one whose `TensorImpl` is prefetched:
/// far enough for the lines to arrive before torch's exchange call reads
/// them, near enough for them to stay in L1/L2.
const IMPL_LOOKAHEAD: usize = 16;

/// Types already checked during one walk (a model has a handful).
struct Checked<'py> {
    torch: &'py Torch,
    modules: AddressSet<ffi::PyTypeObject>,
    tensors: AddressSet<ffi::PyTypeObject>,
}

impl<'py> Checked<'py> {
    /// A module whose `named_modules` is torch's, whose attribute lookup is
    /// the standard one and whose hash is identity (so torch's `memo` set
    /// de-duplicates by identity, as ours does); and no instance attribute
    /// shadows one of the methods torch's walk calls on it.
    fn module_ok(&mut self, m: &Bound<'py, PyAny>) -> PyResult<bool> {
        let py = m.py();
        let ty = m.get_type();
        if !self.modules.contains(&ty.as_type_ptr()) {
            let t = self.torch;
            let ok = ty.is_subclass(t.module.bind(py))?
                && ty.getattr(intern!(py, "named_modules"))?.is(t.named_modules.bind(py))
                && ty.getattr(intern!(py, "__hash__"))?.is(t.module_hash.bind(py))
                && ty
                    .getattr(intern!(py, "__getattribute__"))?
                    .is(t.module_getattribute.bind(py));
            if !ok {
                return Ok(false);
            }
            self.modules.insert(ty.as_type_ptr());
        }
        let Ok(own) = m.getattr(intern!(py, "__dict__"))?.cast_into::<PyDict>() else {
            return Ok(false);
        };
        for method in [
            intern!(py, "named_modules"),
            intern!(py, "named_parameters"),
            intern!(py, "_named_members"),
        ] {
            if own.contains(method)? {
                return Ok(false);
            }
        }
        Ok(true)
    }

    /// A tensor whose hash is `Tensor.__hash__` (identity).
    fn tensor_ok(&mut self, v: &Bound<'py, PyAny>) -> PyResult<bool> {
        let ty = v.get_type();
        if self.tensors.contains(&ty.as_type_ptr()) {
            return Ok(true);
        }
        let py = v.py();
        let t = self.torch;
        let ok = ty.is_subclass(t.tensor.bind(py))? && ty.getattr(intern!(py, "__hash__"))?.is(t.tensor_hash.bind(py));
        if ok {
            self.tensors.insert(ty.as_type_ptr());
        }
        Ok(ok)
    }
}

/// `attr` of `m` as a plain dict (not a subclass: its iteration could differ).
fn plain_dict<'py>(m: &Bound<'py, PyAny>, attr: &Bound<'py, PyString>) -> PyResult<Option<Bound<'py, PyDict>>> {
    let d = m.getattr(attr)?;
    // SAFETY: `d` is a valid object and we are attached to Python.
    if unsafe { ffi::PyDict_CheckExact(d.as_ptr()) } == 0 {
        return Ok(None);
    }
    Ok(d.cast_into::<PyDict>().ok())
}

/// `(key, value)` pairs of a dict with `str` keys, copied out so that no
/// Python code can change the dict while we go through it. `None` when a
/// key is not an exact `str`.
fn str_items<'py>(d: &Bound<'py, PyDict>) -> Option<Vec<Named<'py>>> {
    let mut out = Vec::with_capacity(d.len());
    for (k, v) in d.iter() {
        // SAFETY: `k` is a valid object and we are attached to Python.
        if unsafe { ffi::PyUnicode_CheckExact(k.as_ptr()) } == 0 {
            return None;
        }
        out.push((k.cast_into::<PyString>().ok()?, v));
    }
    Some(out)
}

/// `prefix + ("." if prefix else "") + name`, as torch builds names; `None`
/// for a name that is not valid UTF-8 (lone surrogates: Python walks those).
fn join(prefix: &str, name: &Bound<'_, PyString>) -> Option<String> {
    let name = name.to_str().ok()?;
    Some(if prefix.is_empty() {
        name.to_owned()
    } else {
        let mut s = String::with_capacity(prefix.len() + 1 + name.len());
        s.push_str(prefix);
        s.push('.');
        s.push_str(name);
        s
    })
}

/// The modules `root.named_modules()` visits, with their prefixes, or
/// `None` when `root` is not a torch module walked by torch's own code.
fn named_modules<'py>(root: &Bound<'py, PyAny>, checked: &mut Checked<'py>) -> PyResult<Option<Vec<Module<'py>>>> {
    let py = root.py();
    let t = checked.torch;
    let root_type = root.get_type();
    if !root_type.is_subclass(t.module.bind(py))?
        || !root_type
            .getattr(intern!(py, "named_parameters"))?
            .is(t.named_parameters.bind(py))
        || !root_type
            .getattr(intern!(py, "_named_members"))?
            .is(t.named_members.bind(py))
    {
        return Ok(None);
    }
    let (modules_attr, parameters_attr) = (intern!(py, "_modules"), intern!(py, "_parameters"));
    // Depth first, a module before its children, each module once (the
    // first path to it). The stack holds children in reverse so they pop in
    // dict order; the memo test at pop time sees the modules in the order
    // torch's recursion does.
    let mut seen: AddressSet<ffi::PyObject> = AddressSet::default();
    let mut stack: Vec<(String, Bound<'py, PyAny>)> = vec![(String::new(), root.clone())];
    let mut modules = Vec::new();
    while let Some((prefix, m)) = stack.pop() {
        if !checked.module_ok(&m)? {
            return Ok(None);
        }
        // The stack and `modules` hold a reference to `m`, so its address
        // identifies it for the whole walk.
        if !seen.insert(m.as_ptr()) {
            continue;
        }
        let Some(children) = plain_dict(&m, modules_attr)? else {
            return Ok(None);
        };
        let Some(children) = str_items(&children) else {
            return Ok(None);
        };
        for (name, child) in children.into_iter().rev() {
            if child.is_none() {
                continue;
            }
            let Some(name) = join(&prefix, &name) else {
                return Ok(None);
            };
            stack.push((name, child));
        }
        let Some(parameters) = plain_dict(&m, parameters_attr)? else {
            return Ok(None);
        };
        modules.push(Module { prefix, parameters });
    }
    Ok(Some(modules))
}

/// A `(name, tensor)` pair of the walk.
type Named<'py> = (Bound<'py, PyString>, Bound<'py, PyAny>);

/// A module on the walk: its name prefix and its `_parameters` dict.
struct Module<'py> {
    prefix: String,
    parameters: Bound<'py, PyDict>,
}

/// The leaves `weight_checker.walk.collect` gives for a torch module, one at
/// a time, so that they are hashed while the walk goes on: its
/// `named_parameters()` (`_named_members` over the modules: each module's
/// `_parameters` in order, a tensor once under its first name, `None`
/// entries skipped), with every tensor that is not exactly a `Tensor` or
/// `Parameter` handed to `expand(name, tensor)` (Python: shared-weight
/// partitions, wrapper subclasses), which yields the `(name, tensor)` pairs
/// holding its bytes. Each leaf's name is appended to [`Leaves::names`]
/// before the leaf is yielded.
///
/// The walk stops early when it finds something torch's walk would treat
/// differently ([`Leaves::declined`]: the caller walks in Python instead) or
/// when `expand` fails ([`Leaves::error`]).
pub(super) struct Leaves<'py> {
    pub(super) names: Bound<'py, PyList>,
    pub(super) declined: bool,
    pub(super) error: Option<PyErr>,
    checked: Checked<'py>,
    expand: Bound<'py, PyAny>,
    modules: std::vec::IntoIter<Module<'py>>,
    /// The current module's prefix and its remaining parameters.
    current: Option<(String, std::vec::IntoIter<Named<'py>>)>,
    seen: AddressSet<ffi::PyObject>,
    /// Leaves of an expanded tensor not yielded yet.
    expanded: std::vec::IntoIter<Bound<'py, PyAny>>,
}

impl<'py> Leaves<'py> {
    /// The walk of `root`, or `None` when `root` is not a torch module walked
    /// by torch's own code (the caller then asks Python).
    pub(super) fn new(root: &Bound<'py, PyAny>, expand: &Bound<'py, PyAny>) -> PyResult<Option<Leaves<'py>>> {
        let py = root.py();
        let Some(torch) = torch(py) else {
            return Ok(None);
        };
        let mut checked = Checked {
            torch,
            modules: AddressSet::default(),
            tensors: AddressSet::default(),
        };
        let Some(modules) = named_modules(root, &mut checked)? else {
            return Ok(None);
        };
        Ok(Some(Leaves {
            names: PyList::empty(py),
            declined: false,
            error: None,
            checked,
            expand: expand.clone(),
            modules: modules.into_iter(),
            current: None,
            seen: AddressSet::default(),
            expanded: Vec::new().into_iter(),
        }))
    }

    /// The next `(name, tensor)` of `named_parameters()`; `Ok(None)` at the end.
    fn next_parameter(&mut self) -> Result<Option<Named<'py>>, Stop> {
        loop {
            if let Some((prefix, params)) = &mut self.current {
                while let Some((name, v)) = params.next() {
                    if let Some((ahead_name, ahead)) = params.as_slice().get(IMPL_LOOKAHEAD) {
                        prefetch_impl(self.checked.torch, ahead);
                        crate::prefetch::lines(ahead_name.as_ptr() as usize, 1);
                    }
                    if v.is_none() {
                        continue;
                    }
                    if !self.checked.tensor_ok(&v)? {
                        return Err(Stop::Declined);
                    }
                    if !self.seen.insert(v.as_ptr()) {
                        continue;
                    }
                    // A top-level parameter's name is its key (torch's
                    // `"" + k` is `k` too); others are new strings, as in torch.
                    let name = if prefix.is_empty() {
                        name
                    } else {
                        let joined = join(prefix, &name).ok_or(Stop::Declined)?;
                        PyString::new(v.py(), &joined)
                    };
                    return Ok(Some((name, v)));
                }
            }
            let Some(module) = self.modules.next() else {
                return Ok(None);
            };
            // Its items are read when its turn comes, as torch's generator does.
            let params = str_items(&module.parameters).ok_or(Stop::Declined)?;
            self.seen.reserve(params.len());
            self.current = Some((module.prefix, params.into_iter()));
        }
    }

    fn next_leaf(&mut self) -> Result<Option<Bound<'py, PyAny>>, Stop> {
        if let Some(leaf) = self.expanded.next() {
            return Ok(Some(leaf));
        }
        let py = self.names.py();
        let t = self.checked.torch;
        while let Some((name, v)) = self.next_parameter()? {
            let ty = v.get_type();
            if ty.is(t.tensor.bind(py)) || ty.is(t.parameter.bind(py)) {
                self.names.append(&name)?;
                return Ok(Some(v));
            }
            let mut leaves = Vec::new();
            for item in self.expand.call1((name, v))?.try_iter()? {
                let item = item?;
                let pair = item.cast::<PyTuple>().ok().filter(|p| p.len() == 2);
                let Some(pair) = pair else {
                    return Err(not_a_pair(&item).into());
                };
                let (leaf_name, leaf) = (pair.get_item(0)?, pair.get_item(1)?);
                if !leaf_name.is_instance_of::<PyString>() {
                    return Err(not_a_pair(&item).into());
                }
                self.names.append(leaf_name)?;
                leaves.push(leaf);
            }
            // The names of all of them are in `names` already; the scheduler
            // takes the tensors one by one.
            self.expanded = leaves.into_iter();
            if let Some(leaf) = self.expanded.next() {
                return Ok(Some(leaf));
            }
        }
        Ok(None)
    }
}

fn not_a_pair(item: &Bound<'_, PyAny>) -> PyErr {
    let shown = item.repr().map(|r| r.to_string()).unwrap_or_default();
    pyo3::exceptions::PyTypeError::new_err(format!("expected (name, tensor) pairs, got {shown:.80}"))
}

/// Why the walk stopped before its end.
enum Stop {
    Declined,
    Error(PyErr),
}

impl From<PyErr> for Stop {
    fn from(e: PyErr) -> Stop {
        Stop::Error(e)
    }
}

impl<'py> Iterator for Leaves<'py> {
    type Item = Bound<'py, PyAny>;

    fn next(&mut self) -> Option<Bound<'py, PyAny>> {
        if self.declined || self.error.is_some() {
            return None;
        }
        match self.next_leaf() {
            Ok(leaf) => leaf,
            Err(Stop::Declined) => {
                self.declined = true;
                None
            }
            Err(Stop::Error(e)) => {
                self.error = Some(e);
                None
            }
        }
    }
}
