"""Engine digests from dim-0 shards, the SHA-256 chain handed from holder to holder.

A key's bytes are runs of the trainer's tensors (:mod:`.vllm.layout`). Under
dim-0 sharding (FSDP2's ``Shard(0)``) each tensor's C-order elements are cut
into contiguous ranges, one per holder, so every run lies in one holder or
crosses into the next. A key's digest is then made where the bytes are: the
holder of its first bytes hashes them, hands on the chain state (the state
words, the length, the pending tail: ``MultiHasher.export_states``), and the
holder of the next bytes continues it (``MultiHasher.resume``). The result
is bit-identical to hashing the gathered tensor.

:func:`segments` cuts a key's runs at the holders' boundaries;
:func:`chained_digests` hashes every key from shards that are all in this
process, handing the state on exactly as a holder on another rank would
receive it (the transport over ``torch.distributed`` builds on the same
segments).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from weight_checker.errors import ExpectedDigestsError


@dataclass(frozen=True)
class Shard:
    """Holder ``rank``'s elements ``[start, start + numel)`` of a tensor's
    C-order flattening, as ``tensor`` (any shape, contiguous)."""

    rank: int
    start: int
    tensor: Any

    @property
    def end(self) -> int:
        return self.start + int(self.tensor.numel())


@dataclass(frozen=True)
class Segment:
    """Bytes of one key held by one holder: elements ``[start, start + length)``
    of weight ``source`` (``None``: ``length`` zero bytes, any holder's); with
    ``rows`` above 1, that many such runs, each ``stride`` elements after the
    one before (a column slice of rows that lie in one shard)."""

    rank: int | None
    source: str | None
    start: int
    length: int
    rows: int = 1
    stride: int = 0

    def spans(self) -> Iterator[tuple[int, int]]:
        """``(start, length)`` of each run, in order."""
        for row in range(self.rows):
            yield self.start + row * self.stride, self.length


class Rows(NamedTuple):
    """``rows`` runs of ``length`` elements of weight ``source``, the first
    at element ``start``, each ``stride`` after the one before (a column
    slice of rows: one 2-D view); ``source`` ``None``: ``length * rows`` zero bytes."""

    source: str | None
    start: int
    length: int
    rows: int
    stride: int


def compact(segs: list[Segment]) -> list[Rows]:
    """A leg's segments as :class:`Rows`: a row-parallel shard's column
    slice of every row is one, not a segment a row (what a layout kept
    between calls holds: tens of millions of rows at 70B)."""
    out = []
    for run in _strided_runs(segs):
        first = run[0]
        if first.rows > 1:  # cut as rows already (:func:`segments`)
            out.append(Rows(first.source, first.start, first.length, first.rows, first.stride))
            continue
        stride = run[1].start - first.start if len(run) > 1 else 0
        out.append(Rows(first.source, first.start, first.length, len(run), stride))
    return out


def flat_elements(t: Any) -> Any:
    """``t``'s elements in C order as a 1-D view with unit stride (a copy
    only where its layout has none: a one-element tensor may carry any stride)."""
    import torch

    flat = t.detach().contiguous().reshape(-1)
    return flat if flat.numel() == 0 or flat.stride(0) == 1 else flat.clone(memory_format=torch.contiguous_format)


def check_shards(name: str, shards: Sequence[Any], numel: int) -> list[Any]:
    """``shards`` (anything with ``rank``, ``start`` and ``end``: a :class:`Shard`,
    a :class:`Held`) in order, refused in one line unless they tile the
    tensor's ``numel`` elements exactly once."""
    ordered = sorted(shards, key=lambda s: s.start)
    at = 0
    for s in ordered:
        if s.start != at:
            what = "overlaps the one before" if s.start < at else f"leaves elements {at}..{s.start} unheld"
            raise ExpectedDigestsError(f"weight '{name}': the shard of rank {s.rank} at element {s.start} {what}")
        at = s.end
    if at != numel:
        raise ExpectedDigestsError(f"weight '{name}': the shards hold {at} of its {numel} elements")
    return ordered


class Held(NamedTuple):
    """Rank ``rank`` holds elements ``[start, end)`` of a tensor's flattening."""

    rank: int
    start: int
    end: int


def check_agreement(every: list[dict[str, Any]]) -> dict[str, list[Held]]:
    """The shards of every weight across the ranks, refused in one line
    where the ranks disagree on its shape or dtype, or its shards do not tile it."""
    import math

    names = every[0].keys()
    for rank, described in enumerate(every):
        for name in sorted(set(names) ^ set(described)):
            which = f"rank {rank} gives it, rank 0 does not" if name in described else f"rank {rank} does not give it"
            raise ExpectedDigestsError(
                f"weight '{name}': {which} (every rank passes every weight, its shard empty or not)"
            )
    held: dict[str, list[Held]] = {}
    for name in names:
        shape, dtype = every[0][name][0], every[0][name][1]
        for rank, described in enumerate(every):
            if list(described[name][:2]) != [shape, dtype]:
                raise ExpectedDigestsError(
                    f"weight '{name}': rank {rank} has shape {described[name][0]} {described[name][1]}, "
                    f"rank 0 {shape} {dtype}"
                )
        parts = [Held(r, d[name][2], d[name][2] + d[name][3]) for r, d in enumerate(every) if d[name][3]]
        held[name] = check_shards(name, parts, math.prod(shape))
    return held


def segments(runs: Iterable[Any], shards: Mapping[str, Sequence[Any]]) -> list[Segment]:
    """A key's runs cut where the holder changes, in byte order, adjacent
    pieces of one holder and weight merged. ``shards``: each weight's
    holders in order, anything with ``rank``, ``start`` and ``end``.
    A run of equally spaced rows (a row-parallel shard's column slice)
    stays one segment for each shard its rows lie in, not a segment a row
    (70B at TP=8: tens of millions of rows); a row across two shards is cut."""
    bounds = {name: [s.start for s in held] for name, held in shards.items()}
    out: list[Segment] = []

    def put(rank: int | None, source: str | None, start: int, length: int) -> None:
        last = out[-1] if out else None
        if (
            last
            and last.rows == 1
            and last.rank == rank
            and last.source == source
            and last.start + last.length == start
        ):
            out[-1] = Segment(rank, source, last.start, last.length + length)
        else:
            out.append(Segment(rank, source, start, length))

    def cut(source: str, held: Sequence[Any], starts: list[int], start: int, length: int) -> None:
        while length > 0:
            shard = held[bisect.bisect_right(starts, start) - 1]
            take = min(length, shard.end - start)
            if take <= 0 or start < shard.start:
                raise ExpectedDigestsError(f"weight '{source}': elements {start}..{start + length} lie past its shards")
            put(shard.rank, source, start, take)
            start, length = start + take, length - take

    for run in runs:
        if run.source is None:
            put(None, None, 0, run.length)
            continue
        held = shards.get(run.source)
        if held is None:
            raise ExpectedDigestsError(f"weight '{run.source}': no rank holds a shard of it")
        starts = bounds[run.source]
        if run.count < 2 or run.step <= run.length:  # one run, or rows that touch: spans merge
            for start, length in run.spans():
                cut(run.source, held, starts, start, length)
            continue
        row = 0
        while row < run.count:
            start = run.start + row * run.step
            shard = held[max(0, bisect.bisect_right(starts, start) - 1)]
            # The rows from this one that lie whole in its shard.
            inside = (shard.end - start - run.length) // run.step + 1 if start + run.length <= shard.end else 0
            inside = min(inside, run.count - row)
            if inside >= 2:
                out.append(Segment(shard.rank, run.source, start, run.length, inside, run.step))
                row += inside
            else:
                cut(run.source, held, starts, start, run.length)
                row += 1
    return out


def chained_digests(layout: Mapping[str, Any], shards: Mapping[str, Sequence[Shard]]) -> dict[str, str]:
    """``{key: hex}`` for every key of ``layout`` that is a sequence of pieces,
    each hashed holder by holder from ``shards`` (weight name -> its dim-0
    shards), the chain state handed on wherever the holder changes; a key
    whose bytes are not pieces is refused by name."""
    import torch

    from weight_checker import _core

    flat: dict[tuple[int, Any], Any] = {}

    def local(shard: Shard, dtype: Any) -> Any:
        # Cast where the shard lies (fp32 masters to the engine's bf16), as
        # vLLM's copy_ casts: once per shard and dtype.
        at = (id(shard.tensor), dtype)
        if at not in flat:
            flat[at] = flat_elements(flat_elements(shard.tensor).to(device="cpu", dtype=dtype)).view(torch.uint8)
        return flat[at]

    # Every weight's shards tile it exactly, or nothing is hashed (a gap
    # would read another shard's bytes): the runs say how long each is.
    extent: dict[str, int] = {}
    for key_layout in layout.values():
        for run in key_layout.runs or ():
            if run.source is not None:
                end = run.start + (run.count - 1) * run.step + run.length
                extent[run.source] = max(extent.get(run.source, 0), end)
    ordered = {
        name: check_shards(name, held, max(extent.get(name, 0), sum(int(s.tensor.numel()) for s in held)))
        for name, held in shards.items()
    }
    starts = {name: [s.start for s in held] for name, held in ordered.items()}
    out: dict[str, str] = {}
    for key, key_layout in layout.items():
        if key_layout.runs is None:
            raise ExpectedDigestsError(f"{key}: {key_layout.why}: gather its tensor, or leave the key out")
        size = torch.empty((), dtype=key_layout.dtype).element_size()
        state: bytes | None = None
        holder: int | None = None
        hasher = None
        for seg in segments(key_layout.runs, ordered):
            if hasher is None or (seg.rank is not None and seg.rank != holder):
                if hasher is not None:
                    state = hasher.export_states()[0]  # what travels to the next holder
                hasher = _core.MultiHasher.resume([state])
                holder = seg.rank if seg.rank is not None else holder
            # A segment's rows lie in one shard (segments cuts them so).
            shard = None
            if seg.source is not None:
                shard = ordered[seg.source][bisect.bisect_right(starts[seg.source], seg.start) - 1]
            for start, length in seg.spans():
                if shard is None:
                    data = torch.zeros(length, dtype=torch.uint8)
                else:
                    data = local(shard, key_layout.dtype)[(start - shard.start) * size :][: length * size]
                hasher.update([(0, data)])
        if hasher is None:
            hasher = _core.MultiHasher(1)
        out[key] = hasher.finish()[0][0]
    return out


def whereabouts() -> tuple[str, list[int] | None]:
    """This process's host and the cores it may run on."""
    import os
    import socket

    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    return socket.gethostname(), cores


def sharing_cores(places: list[tuple[str, list[int] | None]]) -> bool:
    """Whether some ranks (each's :func:`whereabouts`) run on one host with
    CPU affinities that overlap: then they share cores, and a round is best
    hashed at once. Every rank decides from the same gathered list."""
    for a, (host, mine) in enumerate(places):
        for other_host, theirs in places[a + 1 :]:
            if host == other_host and (mine is None or theirs is None or set(mine) & set(theirs)):
                return True
    return False


#: Bytes of copies (a cast to the engine's dtype, a device shard brought to
#: the host, zero padding) one piece of a leg may be: a rank holds its
#: shards and at most a run's worth of these (:data:`COPIES_A_RUN`).
COPY_PIECE = 16 << 20
#: Bytes of copies a multi-buffer run is fed at most: the rest of its
#: buffers wait for the next update of the same digests.
COPIES_A_RUN = 64 << 20


def leg_buffers(runs: list[Rows], dtype: Any, mine: Mapping[str, Any]) -> Iterator[tuple[Any, bool]]:
    """The bytes of a leg (its :func:`compact` runs), in order, from this
    rank's shards, as ``(buffer, whether it is a copy)``. A run of rows is
    one strided view, rows read in place. Where a shard is not in the
    engine's dtype, or not on the host, it is cast or brought over a piece
    of at most :data:`COPY_PIECE` bytes (whole rows) at a time, as it is
    asked for: a rank holds its shards and a bounded buffer."""
    import torch

    itemsize = torch.empty((), dtype=dtype).element_size()
    zeros: Any = None
    for run in runs:
        if run.source is None:
            left = run.length * run.rows
            while left > 0:
                take = min(left, COPY_PIECE)
                if zeros is None or take > zeros.numel():
                    zeros = torch.zeros(take, dtype=torch.uint8)
                yield zeros[:take], True
                left -= take
            continue
        _, _, first, local = mine[run.source]
        at, end = run.start - first, run.start - first + (run.rows - 1) * run.stride + run.length
        if local.dim() != 1 or local.stride(0) != 1 or at < 0 or end > local.numel():
            raise ExpectedDigestsError(
                f"weight '{run.source}': elements {run.start}..{run.start + end - at} are not in this rank's "
                f"shard of {local.numel()} elements from element {first}"
            )
        part = local[at:]
        part = part[: run.length] if run.rows == 1 else part.as_strided((run.rows, run.length), (run.stride, 1))
        if part.dtype == dtype and part.device.type == "cpu":
            yield part.view(torch.uint8), False
            continue
        # Cast (or brought to the host) a piece at a time: whole rows of a 2-D view.
        per = max(1, COPY_PIECE // (itemsize * (part.shape[1] if part.dim() == 2 else 1)))
        for row in range(0, part.shape[0], per):
            yield part[row : row + per].to(device="cpu", dtype=dtype).view(torch.uint8), True


def feed_in_pieces(hasher: Any, feeds: Iterable[tuple[int, tuple[Any, bool]]]) -> None:
    """``hasher.update`` over ``(digest, (buffer, is_copy))`` in order, in
    runs of at most :data:`COPIES_A_RUN` bytes of copies each (each
    digest's bytes stay in order: a run ends where the next begins)."""
    run: list[tuple[int, Any]] = []
    copied = 0
    for index, (buffer, is_copy) in feeds:
        run.append((index, buffer))
        copied += buffer.numel() if is_copy else 0
        if copied >= COPIES_A_RUN:
            hasher.update(run)
            run, copied = [], 0
    if run:
        hasher.update(run)


def _strided_runs(segs: list[Segment]) -> list[list[Segment]]:
    """``segs`` grouped into runs of one weight, one length, and starts
    equally spaced (at least a segment apart): each run is one 2-D view."""
    runs: list[list[Segment]] = []
    for seg in segs:
        run = runs[-1] if runs else None
        if (
            run is not None
            and seg.rows == 1
            and run[0].rows == 1
            and seg.source is not None
            and seg.source == run[0].source
            and seg.length == run[0].length
            and seg.start - run[-1].start >= seg.length
            and (len(run) == 1 or seg.start - run[-1].start == run[1].start - run[0].start)
        ):
            run.append(seg)
        else:
            runs.append([seg])
    return runs
