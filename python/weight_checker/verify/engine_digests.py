"""Several engines' digests, kept by engine, and how the engines relate.

- ``single``: one engine.
- ``merge``: the engines serve disjoint ranks (servers behind an external
  load balancer: ``dp0`` on one, ``dp1`` on the next), so together they are
  one model; their maps are merged.
- ``fleet``: every engine serves the same keys (independent replicas, each
  ``dp0``); each engine is compared on its own, with the same reference.

Without a request, the first checksum's key sets decide: all disjoint is a
merge, all equal a fleet. Any partial overlap is an error naming two
engines and a key, and so is a request the key sets contradict (``merge``
where two servers serve the same ranks: both started as ``dp0``?).
Digests stay ``engine -> key -> hex`` through classification and
comparison; engine and key are joined only for display.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from weight_checker.errors import InputError
from weight_checker.scope import scope_of

Layout = Literal["single", "merge", "fleet"]


def display_key(engine: str, key: str) -> str:
    """How a fleet's key is shown: ``"{engine} {key}"``."""
    return f"{engine} {key}"


@dataclass
class EngineDigests:
    """One checksum step's digests: ``engine -> {key: hex}``, and the layout."""

    per_engine: dict[str, dict[str, str]]
    layout: Layout

    def merged(self) -> dict[str, str]:
        """One map of every key (``single`` and ``merge``; a fleet's keys repeat)."""
        if self.layout == "fleet":
            raise ValueError("a fleet's digests are compared engine by engine, not merged")
        out: dict[str, str] = {}
        for digests in self.per_engine.values():
            out.update(digests)
        return out


def _first_shared(a: Mapping[str, str], b: Mapping[str, str]) -> str | None:
    shared = a.keys() & b.keys()
    return min(shared) if shared else None


def _first_unshared(a: Mapping[str, str], b: Mapping[str, str]) -> tuple[str, str] | None:
    """``(key, "a"|"b")``: a key only one of them serves, and which."""
    only_a, only_b = a.keys() - b.keys(), b.keys() - a.keys()
    if only_a:
        return min(only_a), "a"
    if only_b:
        return min(only_b), "b"
    return None


def decide_layout(per_engine: Mapping[str, Mapping[str, str]], layout: Layout | None) -> Layout:
    """The layout of these engines' digests: the one their key sets show,
    which must be ``layout`` where that was asked for. Raises
    :class:`InputError` naming two engines and a key where the key sets
    contradict the request or overlap partly.

    LoRA keys do not decide: replicas load adapters on demand, so a replica
    that lacks one is a fleet whose adapter is ``missing``, not a layout
    error. With only LoRA keys in scope the caller must say which it is."""
    names = list(per_engine)
    if len(names) == 1:
        return "single"
    if layout not in (None, "merge", "fleet"):
        raise InputError(f"layout must be 'merge' or 'fleet', got {layout!r}")
    per_engine = {n: {k: v for k, v in d.items() if scope_of(k) != "lora"} for n, d in per_engine.items()}
    if not any(per_engine.values()):
        if layout is None:
            raise InputError(
                "with only LoRA adapters in scope, say whether the servers are a fleet (--fleet) or one model (--merge)"
            )
        return layout
    if layout != "fleet":
        # Merge, or not decided: any shared key between two engines?
        for i, a in enumerate(names):
            for b in names[i + 1 :]:
                key = _first_shared(per_engine[a], per_engine[b])
                if key is None:
                    continue
                if layout == "merge":
                    raise InputError(
                        f"{a} and {b} both serve {key}: servers behind one load balancer must serve disjoint "
                        "ranks (were both started as the same data-parallel rank?); without --merge, engines "
                        "that serve the same keys are checked as a fleet of replicas"
                    )
                return _fleet_or_partial(per_engine, names)
        return "merge"
    return _fleet_or_partial(per_engine, names, asked=True)


def _fleet_or_partial(per_engine: Mapping[str, Mapping[str, str]], names: list[str], asked: bool = False) -> Layout:
    """``fleet`` if every engine serves the first one's keys, else an error."""
    first = names[0]
    for other in names[1:]:
        unshared = _first_unshared(per_engine[first], per_engine[other])
        if unshared is None:
            continue
        key, side = unshared
        has, lacks = (first, other) if side == "a" else (other, first)
        if asked:
            raise InputError(
                f"--fleet: {has} serves {key} but {lacks} does not: the engines of a fleet are replicas "
                "and must serve the same keys"
            )
        raise InputError(
            f"{has} serves {key} but {lacks} does not, while they share other keys: neither one model split "
            "by rank (--merge) nor replicas of one (--fleet)"
        )
    return "fleet"
