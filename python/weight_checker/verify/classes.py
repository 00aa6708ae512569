"""Mismatch classes: what a key's digests say about where an update went.

Against a baseline (the seed's flow, with a reset): ``missing`` (baseline
only), ``unexpected`` (current only), ``untouched-since-reset`` (still its
post-reset digest: the update never reached it), ``changed``. Against the
digests each rank must hold (:func:`weight_checker.expected_digests`, no
reset): ``stale`` (unchanged by the transfer), ``wrong-shard`` (the expected
digest of another tp rank or key), ``changed``, ``missing``, ``unexpected``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from weight_checker.hashing.digests import compare
from weight_checker.keys import split_rank
from weight_checker.tally import class_counts

__all__ = [
    "EMPTY_DIGEST",
    "already_zeroed_warning",
    "class_counts",
    "classify",
    "classify_expected",
    "partial_wrong_shards",
]

EMPTY_DIGEST = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"


def classify(
    baseline: Mapping[str, str], current: Mapping[str, str], post_reset: Mapping[str, str] | None = None
) -> dict[str, str]:
    """key -> class for every key whose digests differ (missing and extra keys included)."""
    out: dict[str, str] = {}
    for k in compare(baseline, current)["mismatches"]:
        if k not in current:
            out[k] = "missing"
        elif k not in baseline:
            out[k] = "unexpected"
        elif post_reset is not None and post_reset.get(k) == current[k]:
            out[k] = "untouched-since-reset"
        else:
            out[k] = "changed"
    return out


def _rank_and_name(key: str) -> tuple[str, str]:
    """``("dp0:pp0:pcp0:name", "tp1")``: the key less its tp rank, and the tp
    rank apart: keys that differ only in their tp rank are shards of one
    tensor (either key form: an ``ep`` field stays with the rest)."""
    rank, name = split_rank(key)
    if not rank:
        return key, ""
    fields = rank.split(":")
    return ":".join(fields[:3] + fields[4:] + [name]), fields[3]


def classify_expected(
    expected: Mapping[str, str], before: Mapping[str, str] | None, after: Mapping[str, str]
) -> tuple[dict[str, str], dict[str, str]]:
    """``(key -> class, key -> detail)`` for every key whose digest after the
    transfer is not the expected one.

    ``wrong-shard`` first where the key holds the expected digest of the same
    tensor on another tp rank (every rank loading shard 0 looks the same
    before and after); then ``stale`` where it is unchanged by the transfer;
    then ``wrong-shard`` where it holds another key's expected digest;
    else ``changed``. ``missing`` / ``unexpected``: expected only / after only.
    """
    by_digest: dict[str, list[str]] = {}
    for k, v in expected.items():
        by_digest.setdefault(v, []).append(k)
    classes: dict[str, str] = {}
    details: dict[str, str] = {}
    for k in sorted(set(expected) | set(after)):
        if k not in after:
            classes[k] = "missing"
            continue
        if k not in expected:
            classes[k] = "unexpected"
            continue
        got = after[k]
        if got == expected[k]:
            continue
        holders = [h for h in by_digest.get(got, []) if h != k]
        name, _ = _rank_and_name(k)
        shards = [h for h in holders if _rank_and_name(h)[0] == name]
        if shards:
            other = shards[0]
            classes[k], details[k] = "wrong-shard", f"holds the expected digest of {_rank_and_name(other)[1]} ({other})"
        elif before is not None and before.get(k) == got:
            classes[k] = "stale"
        elif holders:
            classes[k], details[k] = "wrong-shard", f"holds the expected digest of {holders[0]}"
        else:
            classes[k] = "changed"
    return classes, details


def partial_wrong_shards(explained: Mapping[str, Any]) -> dict[str, str]:
    """shown key -> detail for every ``changed`` key whose differing blocks
    all hold another tp rank's bytes (``explained``: shown key ->
    :class:`~weight_checker.verify.explain.model.KeyExplanation`).

    A rank that took another rank's rows in part of a fused tensor (tp1's
    ``gate_up_proj`` with tp0's gate half, its up half right) holds no whole
    digest of another key, so :func:`classify_expected` calls it
    ``changed``; its block digests prove it ``wrong-shard`` all the same."""
    out: dict[str, str] = {}
    for key, e in explained.items():
        causes = list(e.block_causes)
        if e.cls != "changed" or not causes or not all(c.startswith("shard-of:") for c in causes):
            continue
        ranks = " and ".join(c.removeprefix("shard-of:") for c in causes)
        where = f" in {e.where}" if e.where else ""
        rest = "" if e.whole else "; the rest as expected"
        out[key] = f"holds {ranks}'s bytes{where}{rest}"
    return out


def already_zeroed_warning(baseline: Mapping[str, str], post_reset: Mapping[str, str]) -> str | None:
    """The diagnosis when the baseline equals the post-reset digests: the
    engine was zeroed before this run started (an earlier update failed?)."""
    if baseline == post_reset and any(v != EMPTY_DIGEST for v in baseline.values()):
        return (
            "the baseline digests equal the post-reset digests: the engine's weights were already "
            "zeroed (reset) before this run, so the baseline is not the model you loaded; "
            "reload the model, then verify again"
        )
    return None
