"""Where in each tensor from the chain states the expected digests recorded: no expected tensor is read.

Expected digests computed in this process carry each key's SHA-256 chain at
its block boundaries (:mod:`weight_checker.hashing.block_states`). The
engine is sent those states and continues each over its own block; a block
whose continued state is not the next recorded one differs. The engine
reads its tensors once, every block on its own lanes; this side hashes
nothing, and recomputes no expected tensor unless a candidate cause needs
one (a transform of the weights). A previous version's or another rank's
block is tried the same way, from its own recorded states: the engine
continues them, nothing is recomputed (:func:`state_matcher`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from weight_checker.errors import WeightCheckerError
from weight_checker.hashing.block_states import BlockStates, continue_many
from weight_checker.hashing.blocks import block_ranges, flat_bytes, rows_text
from weight_checker.verify.explain.blocks import Differing, merge_ranges
from weight_checker.verify.explain.fetchers import BlockFetcher, fetch_all
from weight_checker.verify.explain.model import ExpectedTensors, Explanation, KeyExplanation

#: ``matcher([(key, block), ...])`` -> whether each block of the engine's
#: tensor equals the candidate's.
Matcher = Callable[[Sequence[tuple[str, int]]], list[bool]]


class StateBlocks:
    """One key's blocks as its recorded states cut them (what
    :class:`~weight_checker.verify.explain.blocks.Blocks` is, without the tensor)."""

    def __init__(self, states: BlockStates):
        self.states = states
        self.block_bytes = states.block_bytes
        self.nbytes = states.nbytes
        self.ranges = block_ranges(states.nbytes, states.block_bytes)


def _chain_of(states: BlockStates, blocks: Sequence[int]) -> list[list[Any]]:
    return [[i, states.states[i].hex()] for i in blocks]


def _answers(
    fetch: BlockFetcher, asked: Mapping[str, tuple[BlockStates, Sequence[int]]]
) -> tuple[dict[str, Mapping[str, Any]], dict[str, str]]:
    """The engine's continued states of ``asked`` (key -> (the states to
    continue, which blocks)), a request per block size."""
    by_size: dict[int, list[str]] = {}
    for key, (states, _) in asked.items():
        by_size.setdefault(states.block_bytes, []).append(key)
    answers: dict[str, Mapping[str, Any]] = {}
    refused: dict[str, str] = {}
    for size, keys in by_size.items():
        chain = {k: _chain_of(*asked[k]) for k in keys}
        # A refusal is not asked again key by key: such keys go to block digests, which do.
        got, why = fetch_all(fetch, keys, size, chain, each=False)
        answers.update(got)
        refused.update(why)
    return answers, refused


def _continued(answer: Mapping[str, Any], blocks: Sequence[int], block_bytes: int) -> list[str] | None:
    """The answer's continued states of ``blocks`` (lower-case hex), in that
    order, where it gives exactly those, cut in blocks of ``block_bytes``."""
    states, asked = answer.get("states"), answer.get("blocks")
    try:
        cut = int(answer.get("block_bytes", -1))
    except (TypeError, ValueError):
        return None
    if cut != block_bytes or not isinstance(states, list) or not isinstance(asked, list):
        return None
    if asked != list(blocks) or len(states) != len(blocks) or not all(isinstance(s, str) for s in states):
        return None
    return [s.lower() for s in states]


def compare_chained(
    pending: list[KeyExplanation],
    fetch: BlockFetcher,
    states: Mapping[str, BlockStates],
    tensors: ExpectedTensors | None,
    out: Explanation,
) -> tuple[Differing | None, list[KeyExplanation]]:
    """The blocks of ``pending``'s keys (each with recorded ``states``) that
    differ on the engine, into each key's explanation: the engine continues
    every recorded state over its block, nothing is read here. ``tensors``:
    where the candidates that need the expected tensors come from. Also
    the keys the engine gave no states for (it refused them, or predates
    chain states): the caller asks for their block digests instead."""
    started = time.perf_counter()
    blocks = {e.key: StateBlocks(states[e.key]) for e in pending}
    for e in pending:
        s = states[e.key]
        e.shape, e.dtype, e.block_bytes = list(s.shape), s.dtype, s.block_bytes
        e.nbytes, e.blocks = s.nbytes, s.blocks
    try:
        answers, refused = _answers(fetch, {k: (states[k], range(states[k].blocks)) for k in blocks})
    except WeightCheckerError:  # an engine that takes no chain at all: its block digests, as before
        return None, pending
    out.seconds["blocks"] = time.perf_counter() - started
    unexplained: dict[str, list[int]] = {}
    engine: dict[str, Mapping[str, Any]] = {}
    fallback: list[KeyExplanation] = []
    for e in pending:
        s, theirs = states[e.key], answers.get(e.key)
        if e.key in refused or theirs is None or (isinstance(theirs, Mapping) and "states" not in theirs):
            fallback.append(e)  # refused, or answered with block digests (a route that predates chains)
            continue
        if not isinstance(theirs, Mapping):
            e.note = f"the engine's answer does not compare with this tensor's blocks: {str(theirs)[:120]}"
            continue
        if _int(theirs.get("nbytes")) != s.nbytes or list(theirs.get("shape") or []) != e.shape:
            e.note = f"the engine holds shape {theirs.get('shape')} ({theirs.get('nbytes')} bytes), expected {e.shape}"
            continue
        continued = _continued(theirs, range(s.blocks), s.block_bytes)
        zeros = theirs.get("zeros")
        if continued is None or not isinstance(zeros, list) or len(zeros) != s.blocks:
            e.note = f"the engine's answer does not compare with this tensor's blocks: {str(theirs)[:120]}"
            continue
        if theirs.get("dtype") not in (None, e.dtype):
            e.note = f"the engine holds {theirs.get('dtype')}, expected {e.dtype}"
        engine[e.key] = {**theirs, "digests": continued, "zeros": [bool(z) for z in zeros]}
        e.located_by = "chain states"
        differ = [i for i in range(s.blocks) if continued[i] != s.states[i + 1].hex()]
        b = blocks[e.key]
        e.ranges = merge_ranges([b.ranges[i] for i in differ])
        e.where = rows_text(e.ranges, e.shape or [], s.nbytes // max(1, _numel(e.shape)))
        if not differ:
            e.note = "every block equals the expected one: the tensor changed since its digest was taken"
            continue
        unexplained[e.key] = differ
    source = tensors if tensors is not None else _NoTensors()
    found = Differing(unexplained, blocks, engine, None, source, dict(states), fetch)  # type: ignore[arg-type]
    return found, fallback


class _NoTensors:
    """Where no expected tensors can be had: every candidate that needs one is refused."""

    def __init__(self) -> None:
        self.refused: dict[str, str] = {}

    def tensors(self, keys: Sequence[str], transforms: Sequence[str]) -> Mapping[str, Mapping[str | None, Any]]:
        raise WeightCheckerError("no expected tensors to compute it from")


def _int(value: Any) -> int | None:
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def _numel(shape: Sequence[int] | None) -> int:
    n = 1
    for d in shape or []:
        n *= d
    return n


def _block(flat: Any, a: int, b: int) -> Any:
    return flat.block(a, b) if hasattr(flat, "block") else flat[a:b]


def tensor_matcher(
    differing: Differing,
    flats: Mapping[str, Any],
    base: Mapping[str, Any] | None = None,
    failed: set[str] | None = None,
) -> Matcher:
    """Blocks of candidate tensors (``flats``: flat bytes, or objects with
    ``block(start, end)``) against the engine's: each continued from the
    expected state before it, as the engine continued its own block.
    ``base``: the expected tensors the candidates were computed beside,
    unchecked; each block tried is checked with them (continued to the next
    recorded state). A key whose block fails that check matches nowhere
    and goes into ``failed``."""
    chained, blocks, engine = differing.chained or {}, differing.blocks, differing.engine
    flat_base: dict[str, Any] = {}

    def base_of(key: str) -> Any:
        if key not in flat_base:
            t = (base or {}).get(key)
            flat_base[key] = t if t is None or hasattr(t, "block") else flat_bytes(t)
        return flat_base[key]

    def match(at: Sequence[tuple[str, int]]) -> list[bool]:
        checked = [(key, i) for key, i in at if base_of(key) is not None]
        items = [(chained[key].states[i], _block(flats[key], *blocks[key].ranges[i])) for key, i in at]
        items += [(chained[key].states[i], _block(base_of(key), *blocks[key].ranges[i])) for key, i in checked]
        got = continue_many(items)
        tried = zip(checked, got[len(at) :], strict=True)
        bad = {key for (key, i), g in tried if g != chained[key].states[i + 1].hex()}
        if failed is not None:
            failed.update(bad)
        return [
            key not in bad and g == engine[key]["digests"][i] for g, (key, i) in zip(got[: len(at)], at, strict=True)
        ]

    return match


def state_matcher(fetch: BlockFetcher, candidate: Mapping[str, BlockStates]) -> Matcher:
    """Blocks of candidates known by their recorded states (a previous
    version's, another rank's) against the engine's: the engine continues
    the candidate's state before each block over its own block, equal to the
    candidate's next state where the blocks are equal. ``WeightCheckerError``
    where the engine refuses."""

    def match(at: Sequence[tuple[str, int]]) -> list[bool]:
        asked: dict[str, list[int]] = {}
        for key, i in at:
            asked.setdefault(key, []).append(i)
        answers, refused = _answers(fetch, {k: (candidate[k], sorted(set(v))) for k, v in asked.items()})
        if refused:
            key = min(refused)
            raise WeightCheckerError(f"{key}: {refused[key]}")
        out = []
        for key, i in at:
            order = sorted(set(asked[key]))
            continued = _continued(answers.get(key) or {}, order, candidate[key].block_bytes)
            out.append(continued is not None and continued[order.index(i)] == candidate[key].states[i + 1].hex())
        return out

    return match


def candidate_states(
    keys: Sequence[str], blocks: Mapping[str, Any], of: Callable[[str], BlockStates | None]
) -> dict[str, BlockStates]:
    """The recorded states ``of(key)`` gives for ``keys`` where they cut the tensor as ``blocks`` do."""
    out = {}
    for key in keys:
        s = of(key)
        if s is not None and s.nbytes == blocks[key].nbytes and s.block_bytes == blocks[key].block_bytes:
            out[key] = s
    return out
