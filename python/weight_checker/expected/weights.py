"""The weights :func:`weight_checker.expected_digests` feeds each rank's
loader: a safetensors checkpoint as zero-copy views of a private memory map,
or the trainer's own ``(name, tensor)`` pairs, re-iterable once per rank."""

from __future__ import annotations

import json
import mmap
import struct
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from weight_checker.errors import ExpectedDigestsError

SAFETENSORS_DTYPES = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
    "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
    "U16": "uint16", "U32": "uint32", "U64": "uint64",
    "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
}  # fmt: skip


#: The checkpoint files mapped by the latest call (see CheckpointWeights._map).
MAPPINGS: dict[tuple[Any, ...], tuple[dict[str, Any], int, mmap.mmap]] = {}


class CheckpointWeights:
    """The ``(name, tensor)`` pairs of a safetensors checkpoint, re-iterable,
    each tensor a zero-copy view of a private (copy-on-write) memory map, so a
    loader that narrows it reads only the pages it copies. Each file is mapped
    once for every rank, and kept for the next call while it is unchanged. Headers are
    validated by the Rust core first (truncated files, overlapping or
    out-of-range offsets, a shard missing from the index)."""

    def __init__(self, paths: str | Path | Iterable[str | Path]):
        from weight_checker import _core
        from weight_checker.errors import CheckpointError
        from weight_checker.hashing.checkpoint import resolve

        paths = [paths] if isinstance(paths, (str, Path)) else list(paths)
        try:
            self.files, _ = resolve(paths)
            for f in self.files:
                _core.safetensors_tensors(str(f))
        except (CheckpointError, ValueError) as e:
            raise ExpectedDigestsError(str(e)) from e
        self.nbytes = sum(f.stat().st_size for f in self.files)
        self._used: dict[tuple[Any, ...], tuple[dict[str, Any], int, mmap.mmap]] = {}

    def _map(self, path: Path) -> tuple[dict[str, Any], int, mmap.mmap]:
        """``(header, data offset, mapping)`` of one file, mapped once for
        every rank and kept for the next call while the file is unchanged
        (same device, inode, size and mtime): a page is faulted in once per
        mapping, and unmapping 2 GB of mapped pages costs tens of ms a call."""
        st = path.stat()
        key = (str(path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
        if key not in MAPPINGS:
            with open(path, "rb") as f:
                (header_len,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(header_len))
                MAPPINGS[key] = (header, 8 + header_len, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY))
        self._used[key] = MAPPINGS[key]
        return MAPPINGS[key]

    def forget_others(self) -> None:
        """Drops the kept mappings this object did not use."""
        for key in [k for k in MAPPINGS if k not in self._used]:
            del MAPPINGS[key]

    def __iter__(self) -> Iterator[tuple[str, Any]]:
        import torch

        for path in self.files:
            header, base, mapping = self._map(path)
            for name, info in header.items():
                if name == "__metadata__":
                    continue
                start, end = info["data_offsets"]
                dtype = getattr(torch, SAFETENSORS_DTYPES.get(info["dtype"], ""), None)
                if dtype is None:
                    raise ExpectedDigestsError(f"{path}: tensor '{name}': dtype {info['dtype']} is not supported")
                if end == start:
                    yield name, torch.empty(info["shape"], dtype=dtype)
                    continue
                flat = torch.frombuffer(mapping, dtype=torch.uint8, count=end - start, offset=base + start)
                yield name, flat.view(dtype).reshape(info["shape"])


class Pass:
    """One rank's reading of the weights: the pairs, and whether their tensors
    are *stable*: held all at once and unchanged until the call returns (a
    checkpoint's mapping, a dict, a list or a tuple the caller built), so
    that a copy of their bytes may be deferred and hashed where they lie
    (:mod:`.vllm.deferred`). Anything else (a generator, an iterator, a lazy
    mapping, what a callable returns that is not such a collection) may hand
    out a reused buffer refilled for the next pair, by torch or outside it
    (numpy, ``readinto``, a receive), or free a tensor once the next is asked
    for: its tensors are copied as they are read, never deferred."""

    __slots__ = ("pairs", "stable")

    def __init__(self, pairs: Iterable[tuple[str, Any]], stable: bool):
        self.pairs = pairs
        self.stable = stable


#: What holds its pairs already, and hands out the tensors it holds: a dict
#: (a state dict), a list, a tuple, a dict's ``items()``. Exact types only: a
#: subclass may make its items as they are asked for.
HELD: tuple[type, ...] = (dict, OrderedDict, list, tuple, type({}.items()), type(OrderedDict().items()))


def _held(weights: Any) -> bool:
    return type(weights) in HELD


class WeightsSource:
    """The weights of a call, read once per rank: :meth:`read` gives one
    rank's :class:`Pass`. ``fresh_per_rank``: a callable, made anew for each
    rank (what one rank's pass holds may be reused by the next: hashed before
    the next is read)."""

    def __init__(self, read: Callable[[], Pass], fresh_per_rank: bool = False, checkpoint: Any = None):
        self.read = read
        self.fresh_per_rank = fresh_per_rank
        #: The :class:`CheckpointWeights` read (``None``: the trainer's tensors), whose files a recompute checks.
        self.checkpoint = checkpoint

    def forget_others(self) -> None:
        """Drops the checkpoint mappings kept from earlier calls that this one did not use."""
        if self.checkpoint is not None:
            self.checkpoint.forget_others()


def _checkpoint_source(weights: CheckpointWeights) -> WeightsSource:
    return WeightsSource(lambda: Pass(weights, stable=True), checkpoint=weights)


def _pass_of(items: Any) -> Pass:
    if isinstance(items, Mapping):
        return Pass(items.items(), stable=_held(items))
    return Pass(items, stable=_held(items))


def weights_source(weights: Any, checkpoint: Path | None, ranks: int) -> WeightsSource:
    """The weights of a call, for each of ``ranks`` ranks."""
    if weights is None:
        if checkpoint is None:
            raise ExpectedDigestsError("no weights given and the model is not a checkpoint directory")
        return _checkpoint_source(CheckpointWeights(checkpoint))
    if isinstance(weights, (str, Path)):
        return _checkpoint_source(CheckpointWeights(weights))
    if isinstance(weights, Mapping):
        return WeightsSource(lambda: _pass_of(weights))
    if callable(weights):
        return WeightsSource(lambda: _pass_of(weights()), fresh_per_rank=True)
    if iter(weights) is weights:
        if ranks > 1:
            raise ExpectedDigestsError(
                "weights is a one-shot iterator: every rank reads every pair, so pass a list, a mapping "
                "(state_dict), dict.items(), or a callable that returns a fresh iterable"
            )
        used: list[bool] = []

        def once() -> Pass:
            if used:  # never reached: an unstable pass is read once, into a zeroed arena
                raise ExpectedDigestsError("weights is a one-shot iterator and was read already")
            used.append(True)
            return Pass(weights, stable=False)

        return WeightsSource(once)
    return WeightsSource(lambda: _pass_of(weights))


class Tracked:
    """Iterates the weights while remembering the tensor being loaded, so a
    loader failure names it; ``on_tensor(name, tensor)`` sees each pair first."""

    def __init__(self, items: Iterable[tuple[str, Any]], on_tensor: Callable[[str, Any], None] | None = None):
        self.items = items
        self.on_tensor = on_tensor
        self.current: str | None = None

    def __iter__(self) -> Iterator[tuple[str, Any]]:
        for item in self.items:
            if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)):
                raise ExpectedDigestsError(f"weights must be (name, tensor) pairs, got {type(item).__name__}")
            self.current = item[0]
            if self.on_tensor is not None:
                self.on_tensor(item[0], item[1])
            yield item
        self.current = None
