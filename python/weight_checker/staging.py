"""Device tensors: staged through pinned host memory (not yet implemented)."""

from __future__ import annotations

from typing import Any


def digest_mixed(names: list[str], tensors: list[Any]) -> tuple[list[str], list[bool]]:
    bad = next(n for n, t in zip(names, tensors, strict=True) if not t.is_cpu)
    raise NotImplementedError(f"tensor {bad!r}: device tensors are not supported yet")
