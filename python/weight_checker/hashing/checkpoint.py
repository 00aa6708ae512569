"""Per-tensor digests of safetensors checkpoints, without torch.

A checkpoint is given as ``.safetensors`` files, a directory of them, or a
``model.safetensors.index.json``. The Rust core validates each header and
hashes every tensor's byte range in parallel: through the file's mapping where
the file is in the page cache, else with large sequential reads hashed as they
arrive (cold pages of a mapping fault in small pieces: a cold checkpoint read
through its mapping runs at half the disk's speed or less); a tensor's digest
equals ``weight_checker.checksum`` of the same tensor loaded by torch. An
engine fuses and shards tensors, so its keys are not a checkpoint's: the
digests an engine must hold come from :mod:`weight_checker.expected`.

The files must not be modified while they are read: the core maps them
(read-only, shared with the page cache) and reads them in place.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Literal

from weight_checker import _core
from weight_checker.errors import CheckpointError

INDEX_SUFFIX = ".safetensors.index.json"

#: How :func:`checksum_checkpoint` reads each file: ``"auto"`` (the mapping
#: where at least 3/4 of the file's data is in the page cache, else large
#: sequential reads), ``"map"`` or ``"read"`` (forced).
ReadMode = Literal["auto", "map", "read"]
READ_MODES: tuple[str, ...] = ("auto", "map", "read")


def _read_index(index: Path) -> object:
    """The index's JSON. An error names the index and says what went wrong
    while it was read: changed meanwhile (its size or times differ after the
    read), cut short (the JSON ends before it closes), or not JSON."""
    try:
        before = index.stat()
        raw = index.read_bytes()
        after = index.stat()
    except OSError as e:
        raise CheckpointError(f"{index}: its index: cannot be read: {e}") from e
    stamp = lambda s: (s.st_ino, s.st_size, s.st_mtime_ns, s.st_ctime_ns)  # noqa: E731
    if stamp(before) != stamp(after) or len(raw) != before.st_size:
        raise CheckpointError(
            f"{index}: its index: changed while it was read ({before.st_size} bytes when opened, "
            f"{after.st_size} now, {len(raw)} read): it must not change until the checksum ends"
        )
    try:
        return json.loads(raw.decode())
    except UnicodeDecodeError as e:
        raise CheckpointError(f"{index}: its index: not UTF-8 text ({e})") from e
    except json.JSONDecodeError as e:
        if e.msg.startswith("Unterminated string") or e.pos >= len(e.doc.rstrip()):
            raise CheckpointError(
                f"{index}: its index: truncated: its JSON ends at byte {len(raw)} before it closes"
            ) from e
        raise CheckpointError(f"{index}: its index: not valid JSON: {e}") from e


def _index_shards(index: Path) -> tuple[list[Path], dict[str, Path]]:
    data = _read_index(index)
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
    ):
        raise CheckpointError(f"{index}: 'weight_map' must map tensor names to shard files")
    expected = {name: index.parent / shard for name, shard in weight_map.items()}
    shards: list[Path] = []
    for name, shard in expected.items():
        if not shard.is_file():
            raise CheckpointError(f"{index}: tensor '{name}': shard {shard.name} not found")
        if shard not in shards:
            shards.append(shard)
    return shards, expected


def resolve(paths: Iterable[str | Path]) -> tuple[list[Path], dict[str, Path]]:
    """Shard files to hash, and for tensors named by an index the shard the
    index says holds them."""
    files: list[Path] = []
    expected: dict[str, Path] = {}
    for raw in paths:
        p = Path(raw)
        if p.is_dir():
            indexes = sorted(p.glob("*" + INDEX_SUFFIX))
            if len(indexes) > 1:
                raise CheckpointError(f"{p}: several index files: {', '.join(i.name for i in indexes)}")
            if indexes:
                shards, exp = _index_shards(indexes[0])
                files += shards
                expected |= exp
            else:
                found = sorted(p.glob("*.safetensors"))
                if not found:
                    raise CheckpointError(f"{p}: no .safetensors files")
                files += found
        elif p.name.endswith(INDEX_SUFFIX):
            shards, exp = _index_shards(p)
            files += shards
            expected |= exp
        elif p.is_file():
            files.append(p)
        else:
            raise CheckpointError(f"{p}: no such file or directory")
    unique: list[Path] = []
    seen: set[Path] = set()
    for f in files:  # a shard named twice (a directory and its index) is hashed once
        if (real := f.resolve()) not in seen:
            seen.add(real)
            unique.append(f)
    return unique, expected


def checksum_checkpoint(
    paths: Iterable[str | Path],
    prefix: str = "",
    progress: Callable[[int, int], None] | None = None,
    *,
    io: ReadMode = "auto",
) -> dict[str, str]:
    """``{prefix + tensor name: sha256 hex}`` of every tensor of the checkpoint.

    ``progress(done_bytes, total_bytes)`` is called about every 100 ms. ``io``
    chooses how files are read (:data:`ReadMode`); the digests are the same.
    """
    if io not in READ_MODES:
        raise ValueError(f"io={io!r}: expected one of {', '.join(map(repr, READ_MODES))}")
    files, expected = resolve(paths)
    try:
        if expected:
            _check_index(files, expected)
        digests = _core.checksum_safetensors([str(f) for f in files], progress, mode=io)
    except (_core.SafetensorsError, OSError) as e:
        raise CheckpointError(str(e)) from e
    if expected:  # again after the run: a shard replaced between the check and the run
        found = {name for name, _, _ in digests}
        for name, shard in expected.items():
            if name not in found:
                raise CheckpointError(f"{shard}: tensor '{name}': named by the index but not in the shard")
        for name, _, _ in digests:
            if name not in expected:
                raise CheckpointError(f"tensor '{name}': in a shard but not in the index")
    return {prefix + name: hexd for name, hexd, _ in sorted(digests)}


def _check_index(files: list[Path], expected: dict[str, Path]) -> None:
    """Every tensor an index names is in the shard it names, and every
    tensor of its shards is named (what a loader that follows the index
    finds), checked from the headers before anything is hashed."""
    holder: dict[str, Path] = {}
    for f in files:
        for name, _, _, _ in _core.safetensors_tensors(str(f)):
            if name in holder:
                raise CheckpointError(f"{f}: tensor '{name}': also in {holder[name]}")
            holder[name] = f
    for name, shard in expected.items():
        found = holder.get(name)
        if found is None:
            raise CheckpointError(f"{shard}: tensor '{name}': named by the index but not in the shard")
        if found.resolve() != shard.resolve():
            raise CheckpointError(
                f"{shard}: tensor '{name}': the index names {shard.name} for it, but it is in {found.name}"
            )
    for name, f in holder.items():
        if name not in expected:
            raise CheckpointError(f"{f}: tensor '{name}': in a shard but not in the index")
