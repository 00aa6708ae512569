"""A default dtype for the calling thread only.

vLLM builds and loads a model under ``set_default_torch_dtype(model dtype)``,
which calls ``torch.set_default_dtype``: a setting of the whole process. A
trainer that computes expected digests in a thread of its own saw its other
threads' ``torch.tensor(0.5)`` come out bfloat16 while a call ran.

:func:`thread_default_dtype` gives the thread that enters it its own default
dtype instead, leaving the process's as it is:

- ``torch.get_default_dtype`` and ``torch.set_default_dtype`` answer and set
  this thread's value inside the block (vLLM's own nested
  ``set_default_torch_dtype`` included); other threads reach torch's;
- a torch function mode (modes are per thread) gives the tensor factories
  (``empty``, ``zeros``, ``ones``, ``full``, ``tensor``, ``arange``...) that
  dtype where they would have taken the default one: a call that gives a
  floating tensor of the process's default dtype, with no ``dtype`` asked for
  (and, for ``tensor``/``as_tensor``, made from Python numbers), is made again
  with this thread's.

Not covered: an operation that promotes integers to the default floating
dtype (``torch.arange(3) / 3``). Parameters are written by the loader or
zeroed whatever their initial values; buffers computed that way at
construction could differ from an engine's (none of vLLM's own do).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._device import _device_constructors

_local = threading.local()
_process_get = torch.get_default_dtype
_process_set = torch.set_default_dtype
_install_lock = threading.Lock()
#: Made from their data, which decides the dtype unless it is Python numbers.
_FROM_DATA = frozenset({"tensor", "as_tensor", "asarray"})


def _stack() -> list[Any]:
    stack: list[Any] | None = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = []
    return stack


def _get_default_dtype() -> Any:
    stack = _stack()
    return stack[-1] if stack else _process_get()


def _set_default_dtype(d: Any) -> None:
    stack = _stack()
    if stack:
        stack[-1] = d
    else:
        _process_set(d)


def _install() -> None:
    """Thread-aware ``torch.get_default_dtype`` / ``set_default_dtype``
    (once per process): torch's own wherever no block is active."""
    with _install_lock:
        if torch.get_default_dtype is not _get_default_dtype:
            torch.get_default_dtype = _get_default_dtype
            torch.set_default_dtype = _set_default_dtype


@contextlib.contextmanager
def thread_default_dtype(dtype: Any, factories: bool = True) -> Iterator[None]:
    """This thread's default dtype is ``dtype`` inside the block (see the
    module docstring). ``factories=False``: ``torch.get_default_dtype`` and
    ``set_default_dtype`` only, without the function mode (which costs a
    Python call per torch call: a load's copies do not need it)."""
    _install()
    _stack().append(dtype)
    try:
        with _Factories() if factories else contextlib.nullcontext():
            yield
    finally:
        _stack().pop()


class _Factories(TorchFunctionMode):
    """The tensor factories of this thread take its default dtype."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if (
            func in _CONSTRUCTORS
            and kwargs.get("dtype") is None
            and isinstance(out, torch.Tensor)
            and out.is_floating_point()
            and out.dtype == _process_get()
            and out.dtype != _stack()[-1]
            and (func.__name__ not in _FROM_DATA or not _has_its_own_dtype(args, kwargs))
        ):
            return func(*args, **{**kwargs, "dtype": _stack()[-1]})
        return out


def _has_its_own_dtype(args: Any, kwargs: Any) -> bool:
    """Whether ``tensor(data)``'s data carries a dtype (a tensor, an array)."""
    data = args[0] if args else kwargs.get("data", kwargs.get("obj"))
    return isinstance(data, torch.Tensor) or hasattr(data, "dtype")


_CONSTRUCTORS = frozenset(_device_constructors())
