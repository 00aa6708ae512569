"""checksum / reset / compare: the three actions of the weight checker."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, TypedDict

from weight_checker import _core
from weight_checker.errors import InputTypeError
from weight_checker.hashing.walk import collect, expand


class CompareResult(TypedDict):
    match: bool
    mismatches: list[str]


def sha256_many(buffers: Iterable[Any]) -> list[str]:
    """SHA-256 (lowercase hex) of each buffer's bytes in C order.

    Buffers are torch CPU tensors, objects with ``__dlpack__`` (CPU or pinned
    host memory; numpy arrays among them) or bytes-like objects. Contiguous
    inputs are read in place; others are gathered in bounded pieces, giving
    the digest of their ``.contiguous()`` form.
    """
    return _core.sha256_many(list(buffers))


def digest_tensors(names: list[str], tensors: list[Any]) -> tuple[list[str], list[bool]]:
    """Digests and all-zero flags of named tensors, CPU or device."""
    try:
        # The common case (all in host memory) pays no device check here:
        # the core refuses device tensors before hashing anything.
        return _core.digest_many(tensors, names)
    except _core.DeviceTensorError:
        pass
    from weight_checker.hashing import staging

    return staging.digest_mixed(names, tensors)


def checksum_sized(source: Any, prefix: str = "") -> tuple[dict[str, str], int]:
    """:func:`checksum` and the bytes it hashed."""
    if not isinstance(prefix, str):
        raise InputTypeError(f"prefix must be a str, got {type(prefix).__name__}")
    if hasattr(source, "named_parameters"):
        # A torch module walked by torch's own code: walked and hashed in
        # one pass in the core. Device tensors go through staging below.
        try:
            fast = _core.checksum_module(source, expand, prefix)
        except _core.DeviceTensorError:
            fast = None
        if fast is not None:
            return fast
    names, tensors = collect(source)
    digests, _ = digest_tensors(names, tensors)
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    return {prefix + n: d for n, d in zip(names, digests, strict=True)}, nbytes


def checksum(source: Any, prefix: str = "") -> dict[str, str]:
    """``{prefix + name: sha256 hex}`` for every tensor vLLM's checker covers.

    ``source`` is an ``nn.Module`` (walked like vLLM: de-duplicated
    ``named_parameters()``, shared-weight partitions and traceable tensor
    subclasses expanded), a mapping name → tensor, or an iterable of
    ``(name, tensor)`` pairs. Digests equal
    ``hashlib.sha256(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy())``.
    """
    return checksum_sized(source, prefix)[0]


def reset(source: Any) -> None:
    """Zeroes, in place, exactly the tensors :func:`checksum` covers (buffers
    are left alone). Everything is validated before anything is written."""
    _, tensors = collect(source)
    for t in tensors:
        if not hasattr(t, "zero_"):
            raise InputTypeError(f"cannot zero a {type(t).__name__}")
    import torch

    with torch.no_grad():
        for t in tensors:
            t.data.zero_()


def _check_digest_map(label: str, m: Any) -> Mapping[str, str]:
    if not isinstance(m, Mapping):
        raise InputTypeError(f"{label} must be a mapping key -> sha256 hex, got {type(m).__name__}")
    for k, v in m.items():
        if not isinstance(k, str) or not isinstance(v, str):
            raise InputTypeError(f"{label}: entry {k!r} -> {v!r:.80} is not str -> str")
    return m


def compare(baseline: Mapping[str, str], current: Mapping[str, str]) -> CompareResult:
    """vLLM's comparison: every key in either map whose digests differ, sorted.

    A key missing on either side counts as a mismatch.
    """
    _check_digest_map("baseline", baseline)
    _check_digest_map("current", current)
    mismatches = sorted(k for k in current.keys() | baseline.keys() if current.get(k) != baseline.get(k))
    return {"match": not mismatches, "mismatches": mismatches}
