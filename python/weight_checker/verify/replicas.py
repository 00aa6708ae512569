"""Replica consistency: the replicas of a model (the ``dp`` ranks of one
engine, or several independent engines) compared with each other, with no
pause and no reset."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from weight_checker.keys import key_name, split_key
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
    #: Keys an engine's DP ranks shard between them (a MoE model's experts):
    #: not replicas of each other, compared only between engines.
    sharded: int = 0

    def to_json(self) -> dict[str, Any]:
        return {
            "consistent": self.consistent,
            "replicas": self.replicas,
            "groups": self.groups,
            "inconsistent": self.inconsistent,
            "sharded": self.sharded,
        }


#: vLLM's fused-MoE expert parameters (``w13_weight``, ``w2_weight`` and
#: their scales and biases): what a MoE engine's DP ranks shard, where the
#: engine cannot say itself (a vLLM without this package's plugin).
_EXPERT_PARAMETER = re.compile(r"(^|\.)w(13|2)_[^.]*$")


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
    per_source = t.per_engine("checksum")
    several = len(per_source) > 1
    is_sharded = _sharded(t, per_source)
    # Replicas: a group per key less its DP rank. An engine's DP ranks that
    # shard a parameter hold different parts of it: those keys are grouped
    # with their DP rank, across engines only.
    groups: dict[str, dict[str, str]] = {}
    shard_groups: dict[str, dict[str, str]] = {}
    names: list[str] = []
    shards = 0
    for source, sums in per_source.items():
        for key, digest in sums.items():
            dp, rest = split_key(key)
            if is_sharded(key_name(key)):
                shards += 1
                shard_groups.setdefault(f"{dp}:{rest}", {})[source] = digest
                continue
            replica = f"{source} {dp}" if several else dp
            groups.setdefault(rest, {})[replica] = digest
            if replica not in names:
                names.append(replica)
    inconsistent = _inconsistent(groups, names)
    if several:
        groups |= shard_groups
        inconsistent |= _inconsistent(shard_groups, list(per_source))
    return ReplicaResult(
        not inconsistent, sorted(names), len(groups), dict(sorted(inconsistent.items())), sharded=shards
    )


def _inconsistent(groups: dict[str, dict[str, str]], members: list[str]) -> dict[str, dict[str, str]]:
    """The groups whose members disagree, or that some member lacks (it holds nothing)."""
    out = {}
    for group, held in groups.items():
        if len(set(held.values())) > 1 or len(held) < len(members):
            out[group] = dict(sorted({**dict.fromkeys(members, "(missing)"), **held}.items()))
    return out


def _sharded(t: Any, per_source: dict[str, dict[str, str]]) -> Callable[[str], bool]:
    """Whether a parameter name is one an engine's DP ranks shard: asked of
    the engines where one of them holds several DP ranks (vLLM's own MoE
    layers say), or vLLM's expert parameter names where an engine cannot
    say; never where no engine holds several DP ranks."""
    if not any(len({split_key(k)[0] for k in sums}) > 1 for sums in per_source.values()):
        return lambda name: False
    told = t.dp_sharded("replicas: sharded parameters")
    if told is not None:
        return lambda name: name in told
    return lambda name: bool(_EXPERT_PARAMETER.search(name))
