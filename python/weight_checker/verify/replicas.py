"""Replica consistency: the replicas of a model (the ``dp`` ranks of one
engine, or several independent engines) compared with each other, with no
pause and no reset."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from weight_checker.keys import split_key
from weight_checker.verify.fanout import DEFAULT_CONCURRENCY
from weight_checker.verify.targets import target_for


@dataclass
class ReplicaResult:
    """Replica consistency: every key group whose replicas disagree."""

    consistent: bool
    replicas: list[str]
    groups: int
    #: group key (``pp..:pcp..:tp..:name``) -> replica -> digest, for groups
    #: with more than one distinct digest.
    inconsistent: dict[str, dict[str, str]]

    def to_json(self) -> dict[str, Any]:
        return {
            "consistent": self.consistent,
            "replicas": self.replicas,
            "groups": self.groups,
            "inconsistent": self.inconsistent,
        }


def replicas(
    target: Any,
    *,
    timeout: float | None = None,
    api_key: str | None = None,
    concurrency: int = DEFAULT_CONCURRENCY,
    include: Any = None,
) -> ReplicaResult:
    """One checksum of every replica (no pause, no reset), keys grouped by
    everything but the replica: the ``dp`` rank inside one engine, and the
    engine itself when several are given. ``target``: URL(s), ``vllm.LLM``
    engines or Ray actor handles (an ``AsyncLLM``'s replicas: over HTTP, or
    ``verify_async``). ``include``: the checksum's scope, as for :func:`verify`."""
    t = target_for(target, api_key=api_key, timeout=timeout, concurrency=concurrency, include=include)
    per_source = t.per_engine("checksum").items()
    several = len(per_source) > 1
    groups: dict[str, dict[str, str]] = {}
    names: list[str] = []
    for source, sums in per_source:
        for key, digest in sums.items():
            dp, rest = split_key(key)
            replica = f"{source} {dp}" if several else dp
            groups.setdefault(rest, {})[replica] = digest
            if replica not in names:
                names.append(replica)
    inconsistent = {g: dict(sorted(r.items())) for g, r in sorted(groups.items()) if len(set(r.values())) > 1}
    # A group that some replica lacks is inconsistent too: that replica holds nothing.
    for g, r in groups.items():
        if len(r) < len(names) and g not in inconsistent:
            inconsistent[g] = dict(sorted({**dict.fromkeys(names, "(missing)"), **r}.items()))
    return ReplicaResult(not inconsistent, sorted(names), len(groups), dict(sorted(inconsistent.items())))
