"""Expected digests from a sharded trainer, collectively, with no gather.

Every rank of the trainer's process group calls :func:`collective_digests`
with its local shards (FSDP2 ``DTensor``s placed ``Shard(0)``, or
:class:`LocalShard`). Each rank asks the engine's loaders (vLLM's or
SGLang's) for the layout (shapes only: :mod:`.vllm.layout`), so all agree
on every key's runs; the runs are
cut where the holder changes (:func:`.sharded.segments`) into *legs*, and a
key's legs are hashed in turn by their holders, the SHA-256 chain state (at
most 109 bytes) sent from each to the next. Legs are taken in rounds (every
key's first leg, then every key's second...), so while one rank continues a
key the others hash theirs. Where each rank has cores of its own, a round
is hashed in batches whose states are sent as each ends, so the next holder
starts before the round ends, and at a world of 2 where both ranks start
chains the legs the other continues go first (:func:`.run_plan.plan_batches`);
where ranks share a host's cores, each round is one multi-buffer run on all
of them. Only states and digests travel; no
weight leaves its rank. The layout is kept for the next call with the same
shards (:mod:`.layout_cache`).

Deadlock-free by construction: every rank walks the same rounds in the same
order, sends never wait (``isend``), and a receive waits only for a leg
earlier in that order. A rank that does not answer within ``timeout`` is
named, never waited on for ever.
"""

from __future__ import annotations

import contextlib
import datetime
import itertools
import time
from collections.abc import ItemsView, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

from weight_checker.errors import ExpectedDigestsError
from weight_checker.expected.run_plan import plan_batches
from weight_checker.expected.sharded import feed_in_pieces, leg_buffers, sharing_cores, whereabouts
from weight_checker.expected.weights import HELD

#: Bytes of a chain state on the wire: its length, then its bytes (at most 109).
_WIRE = 128


@dataclass(frozen=True)
class LocalShard:
    """This rank's rows ``[offset, offset + tensor.shape[0])`` of a tensor of
    ``shape`` (dim-0 sharding; ``tensor`` holds whole rows)."""

    tensor: Any
    offset: int
    shape: tuple[int, ...]


#: What a rank that could not describe its shards sends instead.
_FAILED = "\x00failed"
#: The process group's gloo twin, made once: chain states travel on it, so
#: an NCCL trainer's group is never asked to send CPU tensors, and a timeout
#: here never closes the trainer's own connections.
_SIDE: dict[Any, Any] = {}


def _arguments(cast_to: Any, expected_args: Mapping[str, Any]) -> str:
    """What this rank asks the engine's loaders for, as every rank must
    (an object shown by its address, such as a callback, by its type)."""
    shown = []
    for key, value in sorted(expected_args.items()):
        if key != "weight_version":
            text = repr(value)
            shown.append(f"{key}={type(value).__name__ if ' at 0x' in text else text}")
    return ", ".join([f"cast_to={cast_to}", *shown])


def _side_group(group: Any, timeout: float) -> Any:
    """A gloo group over ``group``'s ranks (the world's by default), made
    once, by every rank of ``group`` (each calls expected_digests); its
    exchanges wait at most ``timeout`` seconds (the first call's)."""
    import torch.distributed as dist

    key = id(group) if group is not None else None
    if key not in _SIDE:
        ranks = None if group is None else dist.get_process_group_ranks(group)
        # A subgroup's twin is made by its members alone (the other ranks
        # of the world never call expected_digests for it).
        with _within(timeout, "make the chain's gloo group"):
            _SIDE[key] = dist.new_group(
                ranks=ranks, backend="gloo", timeout=datetime.timedelta(seconds=timeout),
                use_local_synchronization=ranks is not None,
            )  # fmt: skip
    return _SIDE[key]


@contextlib.contextmanager
def _within(timeout: float, what: str) -> Iterator[None]:
    """A collective step every rank must reach: one that fails or times out
    (a rank that never called, or failed and left) is said in one line."""
    try:
        yield
    except RuntimeError as e:
        _SIDE.clear()  # its connections may be closed: the next call makes the group afresh
        raise ExpectedDigestsError(
            f"not every rank of the trainer's group took part within {timeout:g} s to {what} (every rank calls "
            f"expected_digests with its shards): {str(e).splitlines()[0] if str(e) else type(e).__name__}"
        ) from e


class _Leg(NamedTuple):
    key: int
    rank: int
    segments: list[Any]


def _is_shard(value: Any) -> bool:
    return isinstance(value, LocalShard) or type(value).__name__ == "DTensor"


def is_sharded(weights: Any) -> bool:
    """Whether ``weights`` (a mapping or pairs) holds a ``DTensor`` or a :class:`LocalShard`."""
    if not isinstance(weights, Mapping | list | tuple):
        return False
    values = weights.values() if isinstance(weights, Mapping) else [p[1] for p in weights if isinstance(p, tuple)]
    return any(_is_shard(v) for v in values)


_NOTHING = object()


def sharded_weights(weights: Any) -> tuple[Any, bool]:
    """``(weights, whether they are sharded)``. A dict's ``.items()`` is
    looked at whole. Pairs from an iterator, or from the items of any other
    mapping (one that may make each value as it is asked for), are judged by
    their first pair: sharded ones are listed (references only) for every
    rank to see them all; anything else is handed on as it came (an
    iterator with its first pair put back), read one pair at a time as before."""
    if isinstance(weights, ItemsView) and type(weights) in HELD:  # a dict's: pairs held by reference
        listed = list(weights)
        return listed, is_sharded(listed)
    if not isinstance(weights, Iterator | ItemsView):
        return weights, is_sharded(weights)
    pairs = iter(weights)
    try:
        first = next(pairs, _NOTHING)
    except Exception as e:
        raise ExpectedDigestsError(f"the weights: reading the first pair failed: {type(e).__name__}: {e}") from e
    if first is _NOTHING:
        return iter(()), False
    if isinstance(first, tuple) and len(first) == 2 and _is_shard(first[1]):
        return list(itertools.chain([first], pairs)), True
    if isinstance(weights, ItemsView):
        return weights, False  # read afresh by the loader
    return itertools.chain([first], pairs), False


def _local(name: str, value: Any, me: int) -> tuple[tuple[int, ...], Any, int, Any]:
    """``(whole shape, dtype, first element, local tensor)`` of one weight on this rank."""
    import torch

    row: int | None
    if isinstance(value, LocalShard):
        shape, local, row = tuple(value.shape), value.tensor, value.offset
    elif type(value).__name__ == "DTensor":
        from torch.distributed.tensor import Replicate
        from torch.distributed.tensor import Shard as Dim

        placements = tuple(value.placements)
        if value.device_mesh.ndim != 1 or not all(isinstance(p, Dim | Replicate) for p in placements):
            raise ExpectedDigestsError(
                f"weight '{name}' on rank {me}: placements {placements} on a {value.device_mesh.ndim}-D mesh: "
                "only Shard(0) or Replicate on one mesh dimension is supported"
            )
        if isinstance(placements[0], Dim) and placements[0].dim != 0:
            raise ExpectedDigestsError(
                f"weight '{name}' on rank {me}: {placements[0]} is not supported (only dim-0 shards: Shard(0))"
            )
        shape, local = tuple(value.shape), value.to_local()
        if isinstance(placements[0], Replicate):
            row = 0 if value.device_mesh.get_local_rank() == 0 else None
        else:
            from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

            _, offset = compute_local_shape_and_global_offset(value.shape, value.device_mesh, placements)
            row = int(offset[0]) if len(offset) else 0
    elif isinstance(value, torch.Tensor):
        shape, local, row = tuple(value.shape), value, 0 if me == 0 else None  # whole on every rank: rank 0's
    else:
        raise ExpectedDigestsError(f"weight '{name}' on rank {me}: {type(value).__name__} is not a tensor or a shard")
    if not all(isinstance(d, int | torch.SymInt) for d in shape):  # a shape of floats is no shape
        raise ExpectedDigestsError(f"weight '{name}' on rank {me}: shape {list(shape)} is not whole numbers")
    shape = tuple(int(d) for d in shape)
    if row is None:
        return shape, local.dtype, 0, None
    per_row = torch.Size(shape[1:]).numel() if len(shape) > 1 else 1
    if (
        tuple(local.shape[1:]) != tuple(shape[1:])
        or row < 0
        or row + (local.shape[0] if local.dim() else 1) > (shape[0] if shape else 1)
    ):
        raise ExpectedDigestsError(
            f"weight '{name}' on rank {me}: a shard of shape {list(local.shape)} at row {row} is not whole rows "
            f"of its tensor of shape {list(shape)}"
        )
    from weight_checker.expected.sharded import flat_elements

    return shape, local.dtype, row * per_row, flat_elements(local)


def sharded_call(
    expected: Any,
    model: Any,
    weights: Any,
    family: str,
    layout: dict[str, int],
    args: dict[str, Any],
    group: Any,
    allow_unwritten: bool,
    extra: dict[str, Any],
) -> Any:
    """``expected_digests`` (passed as ``expected``) with sharded weights:
    what it covers checked, then :func:`collective_digests`."""
    if extra["loras"] or extra["draft"] is not None or extra["buffers"] or args.get("enable_lora"):
        raise ExpectedDigestsError(
            "sharded weights (DTensor / LocalShard) are covered for an engine's target model only: no "
            "LoRA adapters, draft model or buffers"
        )
    args = {k: v for k, v in args.items() if k not in ("enable_lora", "num_speculative_tokens", "draft")}
    if family != "vllm":
        args["engine"] = family  # the layout's load runs that engine's model classes
    out = collective_digests(
        model, weights, expected=expected, group=group, allow_unwritten=allow_unwritten,
        weight_version=extra["weight_version"], **layout, **args,
    )  # fmt: skip
    if extra["like"] is not None:
        out.layout["server"] = extra["like"]
    return out


def collective_digests(
    model: Any,
    weights: Mapping[str, Any] | Iterable[tuple[str, Any]],
    *,
    expected: Any,
    group: Any = None,
    cast_to: Any = "engine",
    timeout: float = 300.0,
    **expected_args: Any,
) -> Any:
    """The ``ExpectedDigests`` of ``model`` loaded with the trainer's
    tensors, on every rank of ``group``, each rank passing its own shards
    (see the module's note); ``expected``: ``expected_digests`` itself
    (it runs the layout's load). ``cast_to``: the dtype the trainer sends
    (fp32 masters sent as bf16), cast where each piece lies; ``"engine"``:
    each floating-point weight in the engine's dtype where the loader's
    copies would cast it (as vLLM's ``copy_`` rounds), ``None``: as held."""
    import torch.distributed as dist

    from weight_checker.expected import layout_cache
    from weight_checker.expected.sharded import check_agreement

    started = time.perf_counter()
    group = _side_group(group, timeout)
    me, world = dist.get_rank(group), dist.get_world_size(group)
    items = list(weights.items() if isinstance(weights, Mapping) else weights)
    described: dict[str, Any]
    try:
        mine = {name: _local(name, value, me) for name, value in items}
        described = {
            n: (list(s), str(d), start, 0 if t is None else int(t.numel())) for n, (s, d, start, t) in mine.items()
        }
    except ExpectedDigestsError as e:  # told to every rank at the first exchange: none waits on this one
        mine, described = {}, {_FAILED: str(e)}
    every: list[Any] = [None] * world
    # Where this rank runs and what it asks for go with its shards: the one
    # exchange before the chain's, whose receives name a rank that does not answer in time.
    asked = _arguments(cast_to, expected_args)
    with _within(timeout, "exchange the shards' shapes"):
        dist.all_gather_object(every, (whereabouts(), asked, described), group=group)
    places = [where for where, _, _ in every]
    for rank, (_, theirs, _) in enumerate(every):
        if theirs != every[0][1]:  # chains cut for one engine, continued for another
            raise ExpectedDigestsError(
                f"rank {rank} asks for another engine than rank 0 (every rank passes the same arguments): "
                f"{theirs} against {every[0][1]}"
            )
    every = [theirs for _, _, theirs in every]
    for rank, theirs in enumerate(every):
        if _FAILED in theirs:
            raise ExpectedDigestsError(theirs[_FAILED] if rank == me else f"rank {rank} failed: {theirs[_FAILED]}")
    # The same shards as the last call (a trainer's next step): its layout, kept.
    laid = time.perf_counter()
    failure, made = None, None
    try:
        sig = layout_cache.signature(model, every, cast_to, expected_args)
        made = layout_cache.kept(sig, expected_args)
        if made is None:
            made = _layout(expected, model, mine, check_agreement(every), cast_to, expected_args)
            layout_cache.keep(sig, made)
    except Exception as e:  # told to every rank, or the others would wait on this one's states
        failure = str(e) if isinstance(e, ExpectedDigestsError) else f"{type(e).__name__}: {e}".splitlines()[0]
    outcomes: list[Any] = [None] * world
    with _within(timeout, "agree on the layout"):
        dist.all_gather_object(outcomes, failure, group=group)
    for rank, failed in enumerate(outcomes):
        if failed:
            raise ExpectedDigestsError(failed if rank == me else f"rank {rank} failed: {failed}")
    assert made is not None
    layout, shell, keys, legs, plans = made
    shell.seconds["layout"] = time.perf_counter() - laid  # next to nothing where kept
    batches = 1 if sharing_cores(places) else PIPELINED_BATCHES
    digests, exchanged = _hash_in_rounds(keys, legs, layout, mine, me, group, timeout, batches, plans)
    gathered: list[Any] = [None] * world
    with _within(timeout, "gather the digests"):
        dist.all_gather_object(gathered, digests, group=group)
    for part in gathered:
        for key, hex_digest in part.items():
            shell[key] = hex_digest
    missing = [k for k in shell if not shell[k]]
    if missing:
        raise ExpectedDigestsError(f"{missing[0]}: no rank finished its digest")
    shell.seconds["hash"] = time.perf_counter() - started
    shell.bytes_exchanged = exchanged
    shell.batches = batches
    return shell


def _layout(
    expected: Any, model: Any, mine: Mapping[str, Any], held: Any, cast_to: Any, expected_args: dict[str, Any]
) -> tuple[Any, ...]:
    """``(layout, shell, keys, legs, plans)``: every key's runs from the
    engine's loaders (:mod:`.vllm.layout`), cut into legs at the holders'
    boundaries; ``plans``, empty, the legs' plans as each rank makes them
    (kept with the layout: :func:`_hash_in_rounds`)."""
    import torch

    from weight_checker.expected.sharded import compact, segments
    from weight_checker.expected.vllm.layout import layout_and_shell

    meta = {n: torch.empty(mine[n][0], dtype=mine[n][1], device="meta") for n in mine}
    layout, shell = layout_and_shell(
        expected, model, meta, cast_to=None if cast_to == "engine" else cast_to, **expected_args
    )
    engine_dtype = getattr(torch, str(shell.layout.get("dtype", "")), None)
    if cast_to == "engine" and isinstance(engine_dtype, torch.dtype):
        differ = {n: t for n, t in meta.items() if t.is_floating_point() and t.dtype != engine_dtype}
        if differ and any(v.runs is None for v in layout.values()):
            # fp32 masters into a bf16 engine: each copy casts; the same
            # bytes as pieces cast where they lie.
            meta.update({n: t.to(engine_dtype) for n, t in differ.items()})
            layout, shell = layout_and_shell(expected, model, meta, **expected_args)
    refused = [k for k, v in layout.items() if v.runs is None]
    if refused:
        more = f" (and {len(refused) - 1} more)" if len(refused) > 1 else ""
        raise ExpectedDigestsError(
            f"{refused[0]}{more}: {layout[refused[0]].why}: these keys need their tensors gathered"
        )
    keys = sorted(layout)
    legs = [_legs(index, segments(layout[key].runs or (), held)) for index, key in enumerate(keys)]
    # Kept as runs of rows, not a segment a row (kept between calls: :mod:`.layout_cache`).
    legs = [[_Leg(leg.key, leg.rank, compact(leg.segments)) for leg in chain] for chain in legs]
    return layout, shell, keys, legs, {}


def _legs(index: int, segs: list[Any]) -> list[_Leg]:
    """A key's segments as legs: runs of one holder; zeros go with the holder beside them."""
    legs: list[_Leg] = []
    pending: list[Any] = []
    for seg in segs:
        if seg.rank is None:
            (legs[-1].segments if legs else pending).append(seg)
        elif legs and legs[-1].rank == seg.rank:
            legs[-1].segments.append(seg)
        else:
            legs.append(_Leg(index, seg.rank, [*pending, seg]))
            pending = []
    if not legs:  # all zeros (or empty): rank 0 hashes them
        legs.append(_Leg(index, 0, pending))
    return legs


def _hash_in_rounds(
    keys: list[str],
    legs: list[list[_Leg]],
    layout: Mapping[str, Any],
    mine: Mapping[str, Any],
    me: int,
    group: Any,
    timeout: float,
    batches: int = 1,
    plans: dict[tuple[int, int], Any] | None = None,
) -> tuple[dict[str, str], int]:
    """This rank's legs hashed batch by batch as :func:`.run_plan.plan_batches`
    plans them (every rank plans every rank's alike, from the legs' sizes);
    ``({key: hex} of the keys whose last leg is this rank's, bytes of chain
    state sent)``. Each batch is one multi-buffer run, its states sent as
    soon as it is hashed: the next holder continues those keys while this
    one hashes its next batch. ``plans``: the plans made for these legs so
    far, by ``(rank, batches)``; this one's is added (a kept layout's next
    call plans nothing: 0.3 s at 70B, world 64)."""
    import torch
    import torch.distributed as dist

    from weight_checker import _core

    wait = datetime.timedelta(seconds=timeout)
    sends: list[Any] = []
    done: dict[str, str] = {}
    exchanged = 0
    plans = {} if plans is None else plans
    plan = plans.get((me, batches))
    if plan is None:
        itemsize = {i: torch.empty((), dtype=layout[key].dtype).element_size() for i, key in enumerate(keys)}
        chains = [
            [
                (leg.rank, sum(r.length * r.rows * (1 if r.source is None else itemsize[i]) for r in leg.segments))
                for leg in chain
            ]
            for i, chain in enumerate(legs)
        ]
        plan = plans[(me, batches)] = plan_batches(chains, me, batches)
    for batch in plan:
        states = [None if j == 0 else _received(keys, legs, i, j, group, wait, timeout) for i, j in batch]
        hasher = _core.MultiHasher.resume(states)
        feed_in_pieces(
            hasher,
            (
                (n, piece)
                for n, (i, j) in enumerate(batch)
                for piece in leg_buffers(legs[i][j].segments, layout[keys[i]].dtype, mine)
            ),
        )
        ended = [n for n, (i, j) in enumerate(batch) if j == len(legs[i]) - 1]
        exported = hasher.export_states()
        for n, (i, j) in enumerate(batch):
            if n in ended:
                continue
            state = exported[n]
            wire = torch.zeros(_WIRE, dtype=torch.uint8)
            wire[0] = len(state)
            wire[1 : 1 + len(state)] = torch.frombuffer(bytearray(state), dtype=torch.uint8)
            target = legs[i][j + 1].rank
            sends.append(dist.isend(wire, dst=_global(group, target), group=group, tag=_tag(j, i, len(keys))))
            exchanged += len(state)
        if ended:
            finished = _core.MultiHasher.resume([exported[n] for n in ended]).finish()[0]
            done.update({keys[batch[n][0]]: h for n, h in zip(ended, finished, strict=True)})
    with _within(timeout, "take the chain states this rank handed on"):
        for work in sends:
            work.wait(wait)
    return done, exchanged


#: Where each rank hashes on cores of its own, its rounds are cut into
#: pipelined runs (:func:`.run_plan.plan_batches`; measured, trainer world 2 on
#: 0.98 GB, a core a rank: one run a round 0.50-0.55 s, pipelined 0.32-0.40 s
#: at TP=1; docs/benchmarks.md). Ranks sharing cores run a round at a time.
PIPELINED_BATCHES = 4


def _received(keys: list[str], legs: list[list[_Leg]], i: int, j: int, group: Any, wait: Any, timeout: float) -> bytes:
    """The chain state of key ``i`` that the holder of its leg ``j - 1`` hands on."""
    import torch
    import torch.distributed as dist

    source = legs[i][j - 1].rank
    wire = torch.empty(_WIRE, dtype=torch.uint8)
    work: Any = dist.irecv(wire, src=_global(group, source), group=group, tag=_tag(j - 1, i, len(keys)))
    try:
        work.wait(wait)
    except RuntimeError as e:
        _SIDE.clear()  # its connections may be closed: the next call makes the group afresh
        raise ExpectedDigestsError(
            f"{keys[i]}: rank {source} did not hand on its chain state within {timeout:g} s ({e})"
        ) from e
    return bytes(wire[1 : 1 + int(wire[0])].tolist())


def _tag(round_: int, key: int, keys: int) -> int:
    return round_ * keys + key


def _global(group: Any, rank: int) -> int:
    import torch.distributed as dist

    return rank if group is None else dist.get_global_rank(group, rank)
