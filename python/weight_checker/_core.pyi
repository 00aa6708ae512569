"""Type stubs for the compiled core (rust/python.rs)."""

from collections.abc import Iterable, Sequence
from typing import Any

class SafetensorsError(ValueError):
    """A malformed safetensors file or index."""

class DeviceTensorError(ValueError):
    """A device (e.g. CUDA) tensor reached an entry point that reads host memory."""

def sha256_many(buffers: Iterable[Any], names: Sequence[str] | None = None) -> list[str]:
    """SHA-256 (lowercase hex) of each buffer's bytes in C order.

    Accepts torch tensors (CPU), objects with ``__dlpack__`` (CPU or CUDA-host
    memory) and bytes-like objects. Non-contiguous inputs are gathered in
    bounded pieces; the GIL is released while hashing.
    """

def digest_many(buffers: Iterable[Any], names: Sequence[str] | None = None) -> tuple[list[str], list[bool]]:
    """Like :func:`sha256_many`, plus whether each input was all zero bytes."""

def backend() -> str:
    """The compression backend in use: ``"sha-ni"`` or ``"portable"``."""

def threads() -> int:
    """Worker threads the engine uses."""

class MultiHasher:
    """Several digests open at once, each fed its bytes in order."""

    def __init__(self, n: int) -> None: ...
    def __len__(self) -> int: ...
    def bytes_fed(self, index: int) -> int: ...
    def update(self, feeds: Iterable[tuple[int, Any]]) -> None:
        """Feed contiguous buffers; pairs for one digest apply in order."""
    def finish(self) -> tuple[list[str], list[bool]]:
        """Finish every digest: (hex digests, all-zero flags) in index order."""
