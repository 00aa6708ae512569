"""Type stubs for the compiled core (rust/python/mod.rs), checked against the
module by ``python -m mypy.stubtest weight_checker._core`` in ``make lint``."""

from collections.abc import Callable, Iterable, Sequence
from typing import Any, final

__all__ = [
    "DeviceTensorError",
    "MultiHasher",
    "SafetensorsError",
    "__version__",
    "calibrate",
    "calibrate_small",
    "calibrate_wide",
    "checksum_module",
    "checksum_safetensors",
    "copy_into",
    "describe_assignment",
    "digest_many",
    "hash_floor",
    "kernel",
    "lanes",
    "safetensors_tensors",
    "set_threads",
    "sha256_many",
    "small_lanes",
    "streams",
    "tensor_impl_offset",
    "threads",
]

__version__: str

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

def checksum_module(
    module: Any,
    expand: Callable[[str, Any], Iterable[tuple[str, Any]]],
    prefix: str = "",
) -> tuple[dict[str, str], int] | None:
    """``({prefix + name: sha256 hex}, bytes hashed)`` of the tensors
    ``weight_checker.walk.collect(module)`` gives, walking torch's
    ``named_parameters()`` in Rust and hashing while it goes; ``expand`` is
    called for tensors that are not exactly a ``Tensor`` or ``Parameter``.
    ``None`` when the module does not use torch's own walk (an override, a
    non-dict ``_parameters``...): the caller walks it in Python. Raises
    ``DeviceTensorError`` for device memory, ``ValueError`` for a name given
    twice."""

def kernel() -> str:
    """The SHA-256 kernel in use: ``"sha-ni"`` or ``"portable"``."""

def threads() -> int:
    """Worker threads the scheduler uses (``WEIGHT_CHECKER_THREADS``, else
    :func:`set_threads`, else the cores in this process's CPU affinity)."""

def tensor_impl_offset() -> int | None:
    """Where torch's tensor objects keep their ``TensorImpl`` address, as the
    walk found it to prefetch with; ``None``: layout not recognised (then
    nothing is prefetched, digests are the same)."""

def lanes() -> int:
    """Messages each scheduler thread holds open: 1, 2 or 4 SHA-NI lanes, the
    fastest on this CPU as measured at first use, or 16 where
    ``WEIGHT_CHECKER_LANES=16`` asks for the 16-lane AVX-512 kernel and the
    CPU has it. Where it is 4, a run may use 2 (a few big tensors) or the
    AVX-512 kernel (many tensors, where ``calibrate_wide()`` finds it faster)."""

def calibrate() -> list[tuple[int, float]]:
    """This core's GB/s with 1, 2 and 4 interleaved streams (best of 5 short runs)."""

def calibrate_wide() -> tuple[float, float]:
    """``(wide, four)`` GB/s of one core streaming 16 x 256 KiB through the
    16-lane AVX-512 kernel and through four SHA-NI lanes, measured once at
    first use; what a run decides by whether to use the wide kernel.
    ``(0.0, 0.0)`` without AVX-512, with the portable kernel, or where
    ``WEIGHT_CHECKER_LANES`` fixes the lanes."""

def small_lanes() -> int:
    """Lanes for many small tensors of one length: 16 where the 16-lane
    AVX-512 kernel was measured faster on this CPU at first use, else ``lanes()``."""

def calibrate_small() -> tuple[float, float]:
    """``(wide, narrow)`` GB/s of one core on 64 x 4 KiB: the 16-lane AVX-512
    kernel and the active kernel's lanes (0.0, 0.0 without AVX-512)."""

def hash_floor(count: int, nbytes: int, repeat: int = 3) -> list[float]:
    """Seconds each of ``repeat`` passes takes to hash ``count`` separately
    allocated ``nbytes`` buffers on all threads through the batch path
    :func:`checksum_module` uses, with no Python objects: the floor under the
    binding's per-tensor work, on this machine as it is now. Raises
    ``ValueError`` for a zero count or repeat, or more than 4 GiB."""

def describe_assignment(sizes: list[int]) -> str:
    """How a run of messages of ``sizes`` bytes would be laid out on this CPU:
    workers, each one's kernel and lanes (some on SHA-NI for the largest, then
    wide, and the rest on the 16-lane AVX-512 kernel, where the run model says
    that ends sooner), and how many of the largest are dealt. For benchmarks."""

def streams() -> int:
    """The most messages a run keeps in flight: threads x lanes, with 16 lanes
    where ``calibrate_wide()`` finds the AVX-512 kernel faster than four SHA-NI
    lanes (a run of that many messages may then use it). The staging pipeline
    opens this many tensors at once."""

def set_threads(threads: int) -> None:
    """Sets the scheduler's default threads for this process (0: all cores)."""

def copy_into(dst: Any, *srcs: Any) -> None:
    """Copies the C-order bytes of ``srcs``, back to back, into the writable
    contiguous buffer ``dst`` of exactly their total size, on this thread,
    with the GIL released."""

def checksum_safetensors(
    paths: Sequence[str], progress: Callable[[int, int], object] | None = None
) -> list[tuple[str, str, bool]]:
    """``[(name, hex, all_zero)]`` of every tensor of the files, in file order.

    Every tensor is a stream of the scheduler (memory-mapped, read ahead,
    pages dropped once hashed). ``progress(done, total)`` is called about
    every 100 ms; an exception from it (or a signal) stops the run.
    """

def safetensors_tensors(path: str) -> list[tuple[str, str, list[int], int]]:
    """``[(name, dtype, shape, nbytes)]`` of one file, after validating its header."""

@final
class MultiHasher:
    """Several digests open at once, each fed its bytes in order."""

    def __new__(cls, n: int) -> MultiHasher: ...
    def __len__(self) -> int: ...
    def bytes_fed(self, index: int) -> int: ...
    def update(self, feeds: Iterable[tuple[int, Any]]) -> None:
        """Feed contiguous buffers; pairs for one digest apply in order."""
    def update_at(self, buffer: Any, feeds: Sequence[tuple[int, int, int]]) -> None:
        """Feed ``(index, offset, length)`` slices of one contiguous buffer."""
    def finish(self) -> tuple[list[str], list[bool]]:
        """Finish every digest: (hex digests, all-zero flags) in index order."""
