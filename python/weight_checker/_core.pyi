"""Type stubs for the compiled core (rust/python/mod.rs), checked against the
module by ``python -m mypy.stubtest weight_checker._core`` in ``make lint``.

Two kernel families hash: a *narrow* one (one message per stream, 1, 2 or 4
interleaved streams a thread: ``sha-ni``, or ``portable``) and the *wide*
one (the 16-lane AVX-512 multi-buffer kernel, sixteen messages in the lanes
of one vector), used where the CPU has it and the calibration (or
``WEIGHT_CHECKER_LANES=16``) says so.

Every function that reads the core's settings (``WEIGHT_CHECKER_KERNEL``,
``WEIGHT_CHECKER_LANES``, ``WEIGHT_CHECKER_THREADS``) raises ``ValueError``
before any work where one holds a value it does not accept, with a message
such as ``WEIGHT_CHECKER_LANES='8': expected one of 1, 2, 4, 16 (unset:
measured at first use)``; :func:`check_settings` checks them up front."""

from collections.abc import Callable, Iterable, Sequence
from typing import Any, final

__all__ = [
    "BackgroundHasher",
    "DeviceTensorError",
    "MultiHasher",
    "SafetensorsError",
    "__version__",
    "calibrate",
    "calibrate_small",
    "calibrate_wide",
    "check_settings",
    "checksum_module",
    "checksum_safetensors",
    "copy_into",
    "describe_assignment",
    "digest_many",
    "dominant_chains",
    "fp8_amax_quantize_piece",
    "fp8_quantize_piece",
    "fp8_quantize_rows",
    "fp8_row_abs_max",
    "fp8_row_abs_max_piece",
    "hash_floor",
    "kernel",
    "lanes",
    "last_run",
    "safetensors_cached_fraction",
    "safetensors_tensors",
    "set_threads",
    "sha256_many",
    "small_lanes",
    "streams",
    "tensor_impl_offset",
    "threads",
    "wide_kernel_available",
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
    twice or an invalid setting."""

def kernel() -> str:
    """The SHA-256 kernels this process's runs may use: the narrow kernel
    (``"sha-ni"`` or ``"portable"``), with ``"+avx512-x16"`` where this CPU
    has the 16-lane wide kernel and the calibration (or
    ``WEIGHT_CHECKER_LANES=16``) lets runs use it: ``"sha-ni+avx512-x16"``.
    Calibrates at first use (milliseconds); cheap after that."""

def check_settings() -> None:
    """Raises ``ValueError`` naming the first invalid core setting
    (``WEIGHT_CHECKER_KERNEL``, ``WEIGHT_CHECKER_LANES``,
    ``WEIGHT_CHECKER_THREADS``), its value and the values it accepts, e.g.
    ``WEIGHT_CHECKER_LANES='8': expected one of 1, 2, 4, 16 (unset: measured
    at first use)``; ``None`` when all are valid (unset or empty means the
    default). Reads the environment as it is now."""

def last_run() -> str | None:
    """How the latest hashing call made on the calling thread ran, in one
    line (:func:`sha256_many`, :func:`digest_many`, :func:`checksum_module`,
    :func:`checksum_safetensors`, ``MultiHasher.update``/``update_at``): the
    threads, the narrow kernel and its lanes, the 16-lane wide kernel, and
    the tensor count, e.g. ``"1 thread on 4 narrow lanes (sha-ni); 15
    tensors"`` or ``"2 threads: 1 on 4 narrow lanes (sha-ni), 1 on the
    16-lane wide kernel (avx512); 51 tensors"``. Where small tensors were
    hashed in batches beside a run of the large ones, each part with its
    count: ``"9984 small by 2 threads in batches on the 16-lane wide kernel
    (avx512); 16 large by 2 threads on 4 narrow lanes (sha-ni); 10000
    tensors"``. ``None`` before any run on this thread, or when the latest
    one failed."""

def wide_kernel_available() -> bool:
    """Whether this CPU has the 16-lane wide (AVX-512) kernel, detected at
    run time, whatever the settings."""

def threads() -> int:
    """Worker threads the scheduler uses (``WEIGHT_CHECKER_THREADS``, else
    :func:`set_threads`, else the cores in this process's CPU affinity)."""

def tensor_impl_offset() -> int | None:
    """Where torch's tensor objects keep their ``TensorImpl`` address, as the
    walk found it to prefetch with; ``None``: layout not recognised (then
    nothing is prefetched, digests are the same)."""

def lanes() -> int:
    """Messages each scheduler thread holds open: 1, 2 or 4 narrow lanes, the
    fastest on this CPU as measured at first use, or 16 where
    ``WEIGHT_CHECKER_LANES=16`` asks for the 16-lane wide kernel and the
    CPU has it. Where it is 4, a run may use 2 (a few big tensors) or the
    wide kernel (many tensors, where ``calibrate_wide()`` finds it faster)."""

def calibrate() -> list[tuple[int, float]]:
    """This core's GB/s with 1, 2 and 4 interleaved narrow streams (best of at
    least 5 short runs)."""

def calibrate_wide() -> tuple[float, float]:
    """``(wide, four)`` GB/s of one core streaming 16 x 256 KiB through the
    16-lane wide kernel and through four narrow lanes, measured once at
    first use; what a run decides by whether to use the wide kernel.
    ``(0.0, 0.0)`` without AVX-512, with the portable kernel, or where
    ``WEIGHT_CHECKER_LANES`` fixes the lanes."""

def small_lanes() -> int:
    """Lanes for many small tensors of one length: 16 where the 16-lane
    wide kernel was measured faster on this CPU at first use, else ``lanes()``."""

def calibrate_small() -> tuple[float, float]:
    """``(wide, narrow)`` GB/s of one core on 64 x 4 KiB: the 16-lane wide
    kernel and the active narrow kernel's lanes (0.0, 0.0 without AVX-512)."""

def hash_floor(count: int, nbytes: int, repeat: int = 3) -> list[float]:
    """Seconds each of ``repeat`` passes takes to hash ``count`` separately
    allocated ``nbytes`` buffers on all threads through the batch path
    :func:`checksum_module` uses, with no Python objects: the floor under the
    binding's per-tensor work, on this machine as it is now. Raises
    ``ValueError`` for a zero count or repeat, or more than 4 GiB."""

def describe_assignment(sizes: list[int]) -> str:
    """How a run of messages of ``sizes`` bytes would be laid out on this CPU:
    workers, each one's kernel and lanes (some on narrow lanes for the
    largest, then wide, and the rest on the 16-lane wide kernel, where the run
    model says that ends sooner), and how many of the largest are dealt, e.g.
    ``"2 workers on 4 narrow lanes (sha-ni)"`` or ``"2 workers: 1 on 4 narrow
    lanes (sha-ni) each until the dealt ones end, then wide; 1 on the 16-lane
    wide kernel (avx512), the largest 4 dealt"``. For benchmarks."""

def dominant_chains(sizes: list[int]) -> int:
    """How many of the largest of messages of ``sizes`` bytes end a run,
    each alone on one stream: longer than everything after them spread over
    the other cores, by this CPU's calibrated rates (0 where none does, or
    where the rates were not calibrated). A run gives each a worker of its
    own; the staging planner gives each the most of every slot."""

def streams() -> int:
    """The most messages a run keeps in flight: threads x lanes, with 16 lanes
    where ``calibrate_wide()`` finds the wide kernel faster than four narrow
    lanes (a run of that many messages may then use it). The staging pipeline
    opens this many tensors at once."""

def set_threads(threads: int) -> None:
    """Sets the scheduler's default threads for this process (0: all cores)."""

def copy_into(dst: Any, *srcs: Any) -> None:
    """Copies the C-order bytes of ``srcs``, back to back, into the writable
    contiguous buffer ``dst`` of exactly their total size, on this thread,
    with the GIL released."""

def fp8_row_abs_max(weight: Any, cols: int, out: Any) -> bool:
    """Per-row ``max(|x|)`` of ``weight`` (bf16 bits as 2-byte items, C order,
    rows of ``cols``) into ``out`` (bf16 bits, one per row); ``True`` if an
    element is NaN (then ``out`` is not torch's)."""

def fp8_quantize_rows(weight: Any, cols: int, scale: Any, out: Any, transposed: bool) -> bool:
    """``clamp(w / scale, -448, 448)`` cast to float8_e4m3fn as torch casts it,
    one fp32 ``scale`` a row of ``weight`` (bf16 bits, rows of ``cols``), into
    ``out`` (one byte an element; transposed: ``out[k * rows + n]``); ``True``
    if a quotient was NaN (then ``out`` is not torch's)."""

def fp8_row_abs_max_piece(source: Any, offset: int, stride: int, rows: int, cols: int, out: Any) -> bool:
    """``fp8_row_abs_max`` of a piece of a weight read where it lies: row
    ``n`` is ``source[offset + n * stride:][:cols]`` (``source``: bf16 bits,
    C order), one result a row into ``out``; ``True`` if an element is NaN."""

def fp8_quantize_piece(
    source: Any, offset: int, stride: int, rows: int, cols: int, scale: Any, out: Any, first: int, total: int
) -> bool:
    """``fp8_quantize_rows`` of a piece of a weight read where it lies (rows as
    in ``fp8_row_abs_max_piece``, one fp32 ``scale`` each) into rows
    ``first..first + rows`` of the transposed ``[cols, total]`` output
    (``out[k * total + first + n]``); ``True`` if a quotient was NaN."""

def fp8_amax_quantize_piece(
    source: Any,
    offset: int,
    stride: int,
    rows: int,
    cols: int,
    amax: Any,
    scale: Any,
    out: Any,
    first: int,
    total: int,
) -> bool:
    """``fp8_quantize_piece`` by each row's own scale, vLLM's from its amax
    (``amax / 448`` in fp32, at least ``1 / (448 * 512)``), in one read of
    the piece: each row's amax (bf16 bits, 16-bit items) and scale (fp32)
    written into ``amax`` and ``scale``; ``True`` if a weight was NaN."""

def checksum_safetensors(
    paths: Sequence[str],
    progress: Callable[[int, int], object] | None = None,
    *,
    mode: str = "auto",
    buffer_bytes: int = 0,
) -> list[tuple[str, str, bool]]:
    """``[(name, hex, all_zero)]`` of every tensor of the files, in file order.

    ``mode="auto"`` chooses per file: one with at least 3/4 of its data in
    the page cache is hashed through its mapping (every tensor a stream of
    the scheduler, read ahead, pages dropped once hashed); the others are
    read with large sequential reads on a reader thread and hashed while the
    next buffers are read. ``"map"`` and ``"read"`` force one path;
    ``buffer_bytes`` sets the read path's buffer size (0: 8 MiB). The digests
    and errors are the same on both paths. ``progress(done, total)`` is
    called about every 100 ms; an exception from it (or a signal) stops the
    run.
    """

def safetensors_tensors(path: str) -> list[tuple[str, str, list[int], int]]:
    """``[(name, dtype, shape, nbytes)]`` of one file, after validating its header."""

def safetensors_cached_fraction(path: str) -> float:
    """The fraction of one file's tensor data in the page cache, as
    :func:`checksum_safetensors` measures it to choose its path."""

@final
class BackgroundHasher:
    """One thread at Linux's ``SCHED_IDLE`` policy (never taking the GIL)
    that hashes the contiguous tensors submitted, on itself alone, waiting
    between steps while an FP8 kernel runs. Where the host refuses the
    policy (:attr:`refused`), nothing is hashed and every buffer comes back
    without a digest. The buffers must stay unwritten until their digests
    are taken, as for every digest."""

    def __new__(cls, run_bytes: int) -> BackgroundHasher: ...
    def submit(self, ids: Sequence[int], buffers: Iterable[Any]) -> None:
        """Queues contiguous host tensors (torch's, or DLPack exports) under
        the caller's ids. Nothing is queued if one is not: ``ValueError``
        for a strided view or a buffer-protocol object, ``TypeError`` for
        an object with no bytes, ``DeviceTensorError`` for device memory."""
    def take_digests(self) -> list[tuple[int, str | None]]:
        """``(id, hex digest)`` of each buffer finished since the last call
        (``None``: not hashed: closed, stopped or failed); their objects are
        let go of. Never waits for the thread: what it is handing back right
        then comes at the next call."""
    def idle(self) -> bool:
        """Whether nothing is queued or being hashed."""
    @property
    def hashed_bytes(self) -> int: ...
    @property
    def thread_id(self) -> int | None:
        """The thread's Linux id, once it runs."""
    @property
    def refused(self) -> bool:
        """Whether the host refused the idle policy: then nothing is hashed."""
    def close(self) -> None:
        """Stops the run under way at its next step; what was queued comes
        back undigested (:meth:`take_digests`). Returns at once."""
    def wait(self, timeout_s: float) -> bool:
        """After :meth:`close`, waits up to ``timeout_s`` for the thread to end
        and let go of every buffer; whether it did."""

@final
class MultiHasher:
    """Several digests open at once, each fed its bytes in order. Each update
    is one scheduler run (see :func:`last_run`); a buffer is read in place
    with the GIL released, so it must not be written until the call returns."""

    def __new__(cls, n: int) -> MultiHasher: ...
    @staticmethod
    def resume(states: Sequence[bytes | None]) -> MultiHasher:
        """A hasher whose digest ``i`` continues chain state ``states[i]``
        (from :meth:`export_states`, here or on another rank; ``None``: a
        fresh digest). ``ValueError`` names the first state that is not one."""
    def export_states(self) -> list[bytes]:
        """Every digest's chain state (at most 109 bytes: the state words, the
        length, the pending tail), without finishing it."""
    def mark(self, index: int, at: Sequence[int]) -> None:
        """Record digest ``index``'s chain state when its message reaches
        each length of ``at`` (increasing, none behind the bytes fed; one at
        them is recorded now), replacing marks not reached yet."""
    def marked(self, index: int) -> list[bytes]:
        """The chain states recorded so far for digest ``index``, in mark order."""
    def __len__(self) -> int: ...
    def bytes_fed(self, index: int) -> int: ...
    def update(self, feeds: Iterable[tuple[int, Any]]) -> None:
        """Feed buffers, contiguous or with contiguous rows (a shard narrowed
        along its last dimension, read in place row by row); pairs for one
        digest apply in order."""
    def update_at(self, buffer: Any, feeds: Sequence[tuple[int, int, int]]) -> None:
        """Feed ``(index, offset, length)`` slices of one contiguous buffer."""
    def finish(self) -> tuple[list[str], list[bool]]:
        """Finish every digest: (hex digests, all-zero flags) in index order."""
