"""Which tensors are checked: the walk of vLLM's built-in weight checker.

``model.named_parameters()`` with its default de-duplication (a tied
parameter appears once, under its first name; buffers are not covered).
A ``SharedWeightParameter`` expands to ``name.{index}`` per partition and a
traceable tensor subclass to ``name.{attr}`` per inner tensor, recursively;
everything else is the tensor itself. Duck-typed so vLLM need not be
importable.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from weight_checker.errors import InputError, InputTypeError
from weight_checker.keys import first_repeated


def _is_shared_weight_parameter(t: Any) -> bool:
    # vLLM's class, recognised by name so that vLLM need not be imported.
    return any(c.__name__ == "SharedWeightParameter" for c in type(t).__mro__) and isinstance(
        getattr(t, "partitions", None), Mapping
    )


def _is_traceable_wrapper_subclass(t: Any) -> bool:
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    return is_traceable_wrapper_subclass(t)


def expand(name: str, tensor: Any) -> Iterator[tuple[str, Any]]:
    """The leaf tensors that hold ``tensor``'s bytes, with their names."""
    if _is_shared_weight_parameter(tensor):
        for index, partition in tensor.partitions.items():
            yield from expand(f"{name}.{index}", partition)
    elif type(tensor) not in _plain_types() and _is_traceable_wrapper_subclass(tensor):
        for attr in tensor.__tensor_flatten__()[0]:
            yield from expand(f"{name}.{attr}", getattr(tensor, attr))
    else:
        yield name, tensor


@functools.cache
def _plain_types() -> tuple[type, ...]:
    # Exact types that are never wrapper subclasses: skipping the check for
    # them keeps the walk cheap on models with many small parameters.
    import torch

    return (torch.nn.Parameter, torch.Tensor)


def _pairs(source: Any) -> Iterable[Any]:
    if hasattr(source, "named_parameters") and callable(source.named_parameters):
        pairs: Iterable[tuple[str, Any]] = source.named_parameters()
    elif isinstance(source, Mapping):
        pairs = source.items()
    elif isinstance(source, Iterable) and not isinstance(source, (str, bytes)):
        pairs = source
    else:
        raise InputTypeError(
            "expected an nn.Module, a mapping name -> tensor, or an iterable of "
            f"(name, tensor) pairs, got {type(source).__name__}"
        )
    return pairs


def collect(source: Any) -> tuple[list[str], list[Any]]:
    """Names and leaf tensors, in walk order, of an ``nn.Module``, a mapping
    name → tensor, or an iterable of ``(name, tensor)`` pairs. Rejects
    malformed pairs and repeated names."""
    names: list[str] = []
    tensors: list[Any] = []
    plain = _plain_types() if _torch_loaded() else ()
    for item in _pairs(source):
        if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)):
            raise InputTypeError(f"expected (name, tensor) pairs, got {item!r:.80}")
        if type(item[1]) in plain:
            # The common case, without the generator of `expand`.
            names.append(item[0])
            tensors.append(item[1])
            continue
        for name, tensor in expand(*item):
            names.append(name)
            tensors.append(tensor)
    if len(set(names)) != len(names):
        dup = first_repeated(names)
        raise InputError(f"tensor {dup!r} appears more than once")
    return names, tensors


def _torch_loaded() -> bool:
    import sys

    return "torch" in sys.modules


def persistent_buffers(model: Any) -> list[tuple[str, Any]]:
    """``(name, buffer)`` of every persistent buffer of ``model``: those a
    state dict holds (``register_buffer(..., persistent=False)`` ones are
    left out: rotary caches and other values derived at construction), each
    once, under its first name, in module order. vLLM's checksum covers none
    of them; its main branch's covers persistent buffers, and a buffer can be
    the one thing a weight update got wrong (vLLM #44371: a Gemma buffer took
    KL from 0.01 to 1.5)."""
    seen: set[int] = set()
    out: list[tuple[str, Any]] = []
    for module_name, module in model.named_modules():
        skipped: set[str] = getattr(module, "_non_persistent_buffers_set", set())
        for name, buffer in module.named_buffers(recurse=False):
            if buffer is None or name in skipped or id(buffer) in seen:
                continue
            seen.add(id(buffer))
            out.append((f"{module_name}.{name}" if module_name else name, buffer))
    return out
