"""The order in which each trainer rank hashes its legs of the engine's
keys (:mod:`.collective`): runs of one multi-buffer call each, planned
alike on every rank from the legs' holders and sizes alone, so that a
receive only ever waits on a leg of an earlier round (deadlock-free) and the
next holders begin early."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any


def batches_of(todo: list[Any], sizes: list[int], batches: int) -> list[list[Any]]:
    """``todo`` (items of ``sizes`` bytes) in order, cut into ``batches`` runs of about equal bytes."""
    if batches <= 1:
        return [todo] if todo else []
    target = sum(sizes) / batches
    out: list[list[Any]] = []
    current: list[Any] = []
    held = 0
    for item, size in zip(todo, sizes, strict=True):
        current.append(item)
        held += size
        if held >= target:
            out.append(current)
            current, held = [], 0
    if current:
        out.append(current)
    return out


def plan_batches(chains: Sequence[Sequence[tuple[int, int]]], me: int, batches: int) -> list[list[tuple[int, int]]]:
    """Rank ``me``'s batches, each a list of ``(key, leg)`` hashed in one
    multi-buffer run, in the order it runs them; ``chains[key]``: that key's
    legs as ``(holder, bytes)``.

    Round by round (every key's first leg, then every second one...), so a
    receive only ever waits for a leg of an earlier round: deadlock-free.
    With ``batches`` 1 (ranks sharing a host's cores) a round is one run.
    Else each rank has cores of its own, and:

    - where some rank holds no key's first bytes (a TP=1 engine: every
      chain starts on rank 0), or a chain has more than two legs, the next
      holders relay each run: :func:`_relayed`;
    - else (a TP=2 engine from a world of 2: each rank holds whole shards
      of its own, and no chain has more than two legs) the
      first round's legs that others continue are one run, first (their
      next holders wait on them). Its legs that end their chain wait on no
      one: where this rank continues others' chains later, only the long
      ones run now, while the others hash what it will continue, and the
      rest join its next run (more messages open, the lanes fuller: one
      run of a lane per long leg is what narrow lanes do best). Every later
      round is one run.

    Measured at world 2 on 0.98 GB, a core a rank: docs/benchmarks.md."""
    rounds = max((len(c) for c in chains), default=0)
    holders = {r for c in chains for r, _ in c}
    # Measured where no chain has more than two legs (world 2); a longer
    # chain would go rank to rank one whole run at a time.
    everyone_starts = {c[0][0] for c in chains if c} >= holders and rounds <= 2
    if batches > 1 and not everyone_starts:
        return _relayed(chains, me, batches)
    continues_later = any(r == me for c in chains for r, _ in c[1:])
    plan: list[list[tuple[int, int]]] = []
    deferred: list[tuple[int, int]] = []
    for j in range(rounds):
        todo = [(i, j) for i, c in enumerate(chains) if j < len(c) and c[j][0] == me]
        if batches <= 1:
            plan += [todo] if todo else []
        elif j == 0:
            feeding = [leg for leg in todo if leg[1] + 1 < len(chains[leg[0]])]
            ending = [leg for leg in todo if leg[1] + 1 == len(chains[leg[0]])]
            if continues_later:
                long = sum(chains[i][0][1] for i, _ in ending) / 8
                deferred = [leg for leg in ending if chains[leg[0]][0][1] < long]
                ending = [leg for leg in ending if chains[leg[0]][0][1] >= long]
            plan += [run for run in (feeding, ending) if run]
        elif todo or deferred:
            plan.append(todo + deferred)
            deferred = []
    if deferred:
        plan.append(deferred)
    return plan


#: The fewest legs of one size a run of their own takes: the 16-lane
#: kernel's lanes all busy to the end (fewer, or mixed lengths, and the core
#: runs two SHA-NI lanes a thread, about 0.65x as fast on an Intel Xeon).
LANES = 16


def _size_class(size: int) -> int:
    """Legs whose sizes lie within a quarter of an octave share a class: in
    one 16-lane run, the shortest lane then idles at most a fifth of it."""
    return round(math.log2(size) * 4) if size > 0 else -1


def _first_round(todo: list[tuple[int, int]], sizes: list[int], batches: int) -> list[list[tuple[int, int]]]:
    """The runs of a round no one waits on: every :data:`LANES` legs of one
    size class together, the rest cut into up to ``batches`` runs of about
    equal bytes, in order of their longest leg (short ones first, so that
    the next holders begin soon), and the longest legs (each over an eighth
    of the round) one run, last: a lane each, they end when it ends."""
    long = sum(sizes) / 8
    position = {leg: n for n, leg in enumerate(todo)}
    classes: dict[int, list[tuple[tuple[int, int], int]]] = {}
    for leg, size in zip(todo, sizes, strict=True):
        if size <= long:
            classes.setdefault(_size_class(size), []).append((leg, size))
    runs: list[list[tuple[tuple[int, int], int]]] = []
    rest: list[tuple[tuple[int, int], int]] = []
    for members in classes.values():
        whole = len(members) - len(members) % LANES
        runs += [members[at : at + LANES] for at in range(0, whole, LANES)]
        rest += members[whole:]
    rest.sort(key=lambda m: position[m[0]])  # the keys' order: a layer's legs together
    # Runs of at least an eighth of the round each: a run of a few small
    # legs would only wait on the transport.
    cuts = max(1, min(batches, int(sum(size for _, size in rest) // long))) if long else 1
    runs += [
        [(leg, sizes[position[leg]]) for leg in cut]
        for cut in batches_of([leg for leg, _ in rest], [size for _, size in rest], cuts)
    ]
    runs.sort(key=lambda run: max(size for _, size in run))
    longest = [leg for leg, size in zip(todo, sizes, strict=True) if size > long]
    return [[leg for leg, _ in run] for run in runs] + ([longest] if longest else [])


def _relayed(chains: Sequence[Sequence[tuple[int, int]]], me: int, batches: int) -> list[list[tuple[int, int]]]:
    """Rank ``me``'s runs where some rank starts no chain (a TP=1 engine:
    every chain starts on rank 0), or a chain has more than two legs. Each
    rank's first round is cut by :func:`_first_round`; every later leg then
    runs with the others whose previous legs ended in the same run of the
    same holder, in the order those runs end on each holder: the next
    holder relays each run as soon as it is handed on (rounds cut by bytes
    alone had it waiting on runs of 131 MB for legs of 4 MB, and ran mixed
    lengths at two lanes' speed). Every rank plans every rank's alike.

    Measured at world 2 on 0.98 GB, a core a rank: docs/benchmarks.md."""
    # Each round's legs by holder, in key order (one pass over the chains).
    legs_of: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for i, chain in enumerate(chains):
        for j, (rank, _) in enumerate(chain):
            legs_of.setdefault((j, rank), []).append((i, j))
    rounds = max((len(c) for c in chains), default=0)
    holders = sorted({r for c in chains for r, _ in c})
    plans: dict[int, list[list[tuple[int, int]]]] = {r: [] for r in holders}
    made: dict[tuple[int, int], tuple[int, int]] = {}  # a leg -> (its run's index in its holder's plan, holder)
    for j in range(rounds):
        for rank in holders:
            todo = legs_of.get((j, rank))
            if not todo:
                continue
            if j == 0:
                runs = _first_round(todo, [chains[i][0][1] for i, _ in todo], batches)
            else:
                after: dict[tuple[int, int], list[tuple[int, int]]] = {}
                for i, _ in todo:
                    after.setdefault(made[(i, j - 1)], []).append((i, j))
                runs = [after[k] for k in sorted(after)]
            for run in runs:
                made.update((leg, (len(plans[rank]), rank)) for leg in run)
                plans[rank].append(run)
    return plans.get(me, [])
