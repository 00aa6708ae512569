"""Chain states at block boundaries: where a tensor differs, told without its bytes.

SHA-256 is a chain: after ``n`` bytes its state is 32 bytes of words, the
length and a tail under one block (``MultiHasher.export_states``). The one
pass that gives a tensor's digest can record that state at each boundary of
the blocks an explanation cuts the tensor into (:func:`block_bytes_for`):
``s_0`` (the empty chain), ``s_1`` after the first block, ... ``s_n`` after
the last, at a cost of a few dozen bytes a block and no second read.

Another copy of the tensor (an engine's) then says which of its blocks
differ without either side holding the other's bytes: the engine continues
``s_i`` over its own block ``i``; that equals ``s_{i+1}`` exactly when its
block ``i`` equals the expected one (a different block gives a different
state, as different messages give different digests). Every block is
continued on its own, so the engine's lanes take them all at once: one read
of its tensor, as its block digests cost, and none of the expected tensor.

A candidate cause is tried the same way: a block of a previous version's
tensor, or of another rank's, equals the engine's where the engine continues
that tensor's recorded states to the next one; a block computed here (a
dtype round trip of the weights) equals the engine's where it continues
``s_i`` to the state the engine reached from ``s_i``.

Recorded while :func:`recording` is open (``expected_digests`` opens it);
the states are :class:`BlockStates`, by key.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, NamedTuple

from weight_checker.hashing.blocks import MAX_BLOCKS, block_bytes_for, flat_bytes, worker_blocks, zero_blocks

#: Bytes of a device tensor's blocks brought to the host at a time to be continued.
HOST_GROUP_BYTES = 256 << 20

#: Tensors smaller than this record no states (``WEIGHT_CHECKER_BLOCK_STATES_MIN_MB``
#: sets it; by default every tensor records them). The 65 marks of a tensor
#: cost about 20 us (its stream cut into pieces, the states kept): nothing
#: beside a model's large tensors, but 2,000 tensors of 8 KB alone hashed
#: 12x slower with them. A tensor without states is explained by block
#: digests instead (its expected tensor recomputed).
STATE_MIN_BYTES = 0


def _min_bytes() -> int:
    from weight_checker import settings

    mb = settings.get("WEIGHT_CHECKER_BLOCK_STATES_MIN_MB")
    return STATE_MIN_BYTES if mb is None else int(mb * (1 << 20))


class BlockStates(NamedTuple):
    """One tensor's chain states at its block boundaries."""

    #: The block size (:func:`~weight_checker.hashing.blocks.block_bytes_for` of its shape).
    block_bytes: int
    #: The tensor's bytes.
    nbytes: int
    shape: tuple[int, ...]
    #: torch's name for its dtype, without ``torch.``.
    dtype: str
    #: ``blocks + 1`` exported states (up to 109 bytes each): at 0,
    #: ``block_bytes``, ... and ``nbytes``.
    states: tuple[bytes, ...]

    @property
    def blocks(self) -> int:
        return len(self.states) - 1

    def block_range(self, i: int) -> tuple[int, int]:
        return i * self.block_bytes, min((i + 1) * self.block_bytes, self.nbytes)


def boundaries(nbytes: int, block_bytes: int) -> list[int]:
    """The lengths at which a tensor's states are recorded: ``0``, each block's end."""
    return [*range(0, nbytes, block_bytes), nbytes] if nbytes else [0]


_RECORD = threading.local()


@contextlib.contextmanager
def recording() -> Iterator[dict[str, BlockStates]]:
    """On this thread, inside: the digests that :func:`marks_for` names a
    tensor's blocks for record their states, into the dict yielded (key ->
    :class:`BlockStates`)."""
    previous = getattr(_RECORD, "states", None)
    states: dict[str, BlockStates] = {}
    _RECORD.states = states
    try:
        yield states
    finally:
        _RECORD.states = previous


class Marking(NamedTuple):
    """What a digest records for one key: where, and how to label it."""

    key: str
    block_bytes: int
    nbytes: int
    shape: tuple[int, ...]
    dtype: str


def marks_for(key: str, like: Any) -> Marking | None:
    """The states to record for ``key``, a tensor shaped like ``like`` (the
    engine's parameter), where :func:`recording` is open on this thread and
    the tensor has bytes; else ``None``."""
    if getattr(_RECORD, "states", None) is None:
        return None
    shape = tuple(int(d) for d in like.shape)
    itemsize = like.element_size()
    nbytes = itemsize * int(like.numel())
    size = block_bytes_for(shape, itemsize)
    if nbytes < _min_bytes() or size == 0 or -(-nbytes // size) > MAX_BLOCKS:
        return None
    return Marking(key, size, nbytes, shape, str(like.dtype).removeprefix("torch."))


def mark(multi: Any, index: int, marking: Marking | None) -> None:
    """Asks digest ``index`` of ``multi`` (a fresh ``_core.MultiHasher``) to record ``marking``'s states."""
    if marking is not None:
        multi.mark(index, boundaries(marking.nbytes, marking.block_bytes))


def collect(multi: Any, markings: Sequence[tuple[int, Marking | None]]) -> None:
    """Puts the states ``multi`` recorded (its feeds done) where :func:`recording` gathers them."""
    states = getattr(_RECORD, "states", None)
    if states is None:
        return
    for index, marking in markings:
        if marking is None:
            continue
        got = tuple(multi.marked(index))
        if len(got) == len(boundaries(marking.nbytes, marking.block_bytes)):
            states[marking.key] = BlockStates(marking.block_bytes, marking.nbytes, marking.shape, marking.dtype, got)


def digests_marked(keys: Sequence[str], names: Sequence[str], sources: Sequence[Any], like: Sequence[Any]) -> list[str]:
    """The digests of ``sources`` (the bytes of parameters shaped as
    ``like``, labelled ``names`` in errors), recording the block states of
    ``keys`` where :func:`recording` is open: the CPU ones whose rows are
    contiguous go through one ``MultiHasher`` run that records them, the
    rest through :func:`~weight_checker.hashing.digests.digest_tensors`."""
    from weight_checker import _core
    from weight_checker.hashing.digests import digest_tensors

    markings = [marks_for(k, t) for k, t in zip(keys, like, strict=True)]
    marked = [i for i, m in enumerate(markings) if m is not None and _fed_in_place(sources[i])]
    if not marked:
        return digest_tensors(list(names), list(sources))[0]
    out = [""] * len(sources)
    multi = _core.MultiHasher(len(marked))
    for j, i in enumerate(marked):
        mark(multi, j, markings[i])
    multi.update([(j, _bytes_of(sources[i])) for j, i in enumerate(marked)])
    collect(multi, [(j, markings[i]) for j, i in enumerate(marked)])
    for i, digest in zip(marked, multi.finish()[0], strict=True):
        out[i] = digest
    taken = set(marked)
    rest = [i for i in range(len(sources)) if i not in taken]
    for i, digest in zip(rest, digest_tensors([names[i] for i in rest], [sources[i] for i in rest])[0], strict=True):
        out[i] = digest
    return out


def _fed_in_place(t: Any) -> bool:
    """Whether a ``MultiHasher`` reads ``t`` where it lies (a CPU tensor, contiguous or with contiguous rows)."""
    if t.device.type != "cpu":
        return False
    return bool(t.is_contiguous() or (t.dim() == 2 and t.stride(1) == 1 and t.stride(0) >= t.shape[1]))


def _bytes_of(t: Any) -> Any:
    """``t`` as a ``MultiHasher`` is fed it: its bytes as a flat ``uint8``
    view where contiguous, else the tensor itself (read row by row)."""
    if t.is_contiguous():
        return flat_bytes(t)
    return t


def _asked(tensor: Any, block_bytes: int, asked: Any) -> tuple[Any, list[int], list[bytes]]:
    """A chained request for one key, checked: the tensor's flat bytes, the
    blocks and the states to continue. ``ValueError`` says what is wrong: not
    ``[block, state_hex]`` pairs, a block outside the tensor or asked twice
    (each block costs a hash of it: at most every block once), not hex, not a state."""
    from weight_checker import _core

    if not isinstance(asked, list) or not all(
        isinstance(a, list | tuple) and len(a) == 2 and type(a[0]) is int and isinstance(a[1], str) for a in asked
    ):
        raise ValueError(f"a chained request lists [block, state] pairs, got {str(asked)[:80]}")
    flat = flat_bytes(tensor)
    nbytes = int(flat.numel())
    blocks = [int(i) for i, _ in asked]
    outside = [i for i in blocks if i < 0 or i * block_bytes >= nbytes]
    if outside:
        raise ValueError(
            f"block {outside[0]} is outside the tensor held: shape {list(tensor.shape)}, {nbytes} bytes in "
            f"blocks of {block_bytes}"
        )
    if len(set(blocks)) != len(blocks):
        raise ValueError("a block is asked twice")
    try:
        states = [bytes.fromhex(h) for _, h in asked]
    except ValueError as e:
        raise ValueError(f"a state is not hex ({e})") from None
    try:
        _core.MultiHasher.resume(states)
    except ValueError as e:  # "state #i" of this key's list
        raise ValueError(f"a chain state is not one: {e}") from None
    return flat, blocks, states


def continue_blocks(
    jobs: Sequence[tuple[Any, int, Sequence[int], Sequence[bytes]]],
) -> list[tuple[list[bytes], list[bool]]]:
    """The engine's side: for each ``(flat bytes, block_bytes, blocks,
    states)``, each state continued over its block of that tensor (a host
    tensor's blocks in one parallel run, read where they lie), and whether
    each block is all zero. ``ValueError`` names a state that is not one."""
    from weight_checker import _core

    ranges = [[(i * size, min((i + 1) * size, int(flat.numel()))) for i in blocks] for flat, size, blocks, _ in jobs]
    try:
        multi = _core.MultiHasher.resume([s for _, _, _, states in jobs for s in states])
    except ValueError as e:
        raise ValueError(f"a chain state is not one ({e})") from None
    feeds: list[tuple[int, Any]] = []  # device blocks brought to the host, not hashed yet
    size = 0
    at = 0
    for (flat, _, _, _), cut in zip(jobs, ranges, strict=True):
        if flat.device.type == "cpu":  # one buffer and its offsets: a run of every block of the tensor
            multi.update_at(flat, [(at + j, a, b - a) for j, (a, b) in enumerate(cut)])
            at += len(cut)
            continue
        for a, b in cut:  # a device tensor's blocks come to the host a bounded group at a time
            if size + b - a > HOST_GROUP_BYTES and feeds:
                multi.update(feeds)
                feeds, size = [], 0
            feeds.append((at, flat[a:b].cpu()))
            size += b - a
            at += 1
    if feeds:
        multi.update(feeds)
    states = multi.export_states()
    out = []
    at = 0
    for (flat, _, _, _), cut in zip(jobs, ranges, strict=True):
        out.append((list(states[at : at + len(cut)]), zero_blocks(flat, cut)))
        at += len(cut)
    return out


def continue_many(items: Sequence[tuple[bytes, Any]]) -> list[str]:
    """Each ``state`` continued over its ``block`` (a flat ``uint8``
    tensor), as the engine continues it (hex of the exported state), in
    one parallel run."""
    from weight_checker import _core

    if not items:
        return []
    multi = _core.MultiHasher.resume([s for s, _ in items])
    multi.update([(j, b) for j, (_, b) in enumerate(items)])
    return [s.hex() for s in multi.export_states()]


def states_of(expected: Any) -> dict[str, BlockStates]:
    """The block states ``expected`` (expected digests) carries, by key,
    each only where its last state finishes to the key's digest in
    ``expected`` (a digest replaced since, or merged from elsewhere, has no
    states of its own); empty where it has none."""
    got = getattr(expected, "block_states", None)
    if not isinstance(got, Mapping) or not got:
        return {}
    keys = [k for k, s in got.items() if isinstance(s, BlockStates) and s.states and k in expected]
    finished = _finished([got[k].states[-1] for k in keys])
    return {k: got[k] for k, digest in zip(keys, finished, strict=True) if digest == expected[k]}


def _finished(states: Sequence[bytes]) -> list[str]:
    """Each state finished (its digest; ``""`` for a state that is not one)."""
    from weight_checker import _core

    out = []
    for state in states:
        try:
            out.append(_core.MultiHasher.resume([state]).finish()[0][0])
        except ValueError:
            out.append("")
    return out


def worker_answer(
    named: Sequence[tuple[str, Any]], block_bytes: int, rank: str, chain: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """One worker's answer to a block request, whatever the engine:
    :func:`~weight_checker.hashing.blocks.worker_blocks`' answer for the
    keys ``chain`` does not name; for each key it names (``{key: [[i,
    state_hex], ...]}``) the states continued over those blocks, in order
    (hex), whether each block is all zero, and the tensor's size, shape and
    dtype, every key's states in one hasher. What is wrong with a key's
    request is an error for that key, and then nothing is hashed."""
    chain = chain or {}
    answer = worker_blocks([(k, t) for k, t in named if k not in chain], block_bytes, rank)
    jobs: list[tuple[str, Any, Any, list[int], list[bytes]]] = []
    for key, tensor in named:
        if key not in chain:
            continue
        nbytes = tensor.numel() * tensor.element_size()
        if not 1 <= block_bytes <= nbytes:
            answer["errors"][key] = f"block_bytes {block_bytes} is not within the tensor's {nbytes} bytes"
            continue
        try:
            jobs.append((key, tensor, *_asked(tensor, block_bytes, chain[key])))
        except ValueError as e:
            answer["errors"][key] = str(e)
    if answer["errors"] or not jobs:
        return answer
    try:
        done = continue_blocks([(flat, block_bytes, blocks, states) for _, _, flat, blocks, states in jobs])
    except ValueError as e:  # a state that is not one: named for the keys it may be of
        for key, *_ in jobs:
            answer["errors"][key] = str(e)
        return answer
    for (key, tensor, _, blocks, _), (states, zeros) in zip(jobs, done, strict=True):
        answer["blocks"][key] = {
            "blocks": blocks,
            "states": [x.hex() for x in states],
            "zeros": zeros,
            "block_bytes": int(block_bytes),
            "nbytes": int(tensor.numel()) * tensor.element_size(),
            "shape": list(tensor.shape),
            "dtype": str(tensor.dtype).removeprefix("torch."),
        }
    return answer


def digests_with_states(named: Mapping[str, Any]) -> tuple[dict[str, str], dict[str, BlockStates]]:
    """``({key: hex}, {key: BlockStates})`` of tensors held here (CPU, rows
    contiguous, at least ``WEIGHT_CHECKER_BLOCK_STATES_MIN_MB``: the others
    get a digest and no states), from one pass."""
    keys = list(named)
    tensors = [named[k] for k in keys]
    with recording() as got:
        digests = digests_marked(keys, keys, tensors, tensors)
    return dict(zip(keys, digests, strict=True)), dict(got)
