"""The `dp{dp}:pp{pp}:pcp{pcp}:tp{tp}:{name}` key format of vLLM's checker
(and its main branch's `dp{dp}:pp{pp}:pcp{pcp}:tp{tp}:ep{ep}:{name}`)."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

from weight_checker.errors import DuplicateKeysError, InputError


def rank_prefix(dp: int, pp: int, pcp: int, tp: int) -> str:
    """The key prefix of one worker: ``"dp{dp}:pp{pp}:pcp{pcp}:tp{tp}:"``.

    ``dp`` is vLLM's ``parallel_config.data_parallel_index`` (not
    ``data_parallel_rank``, which is 0 on every dense-DP replica).
    """
    for label, value in (("dp", dp), ("pp", pp), ("pcp", pcp), ("tp", tp)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise InputError(f"rank_prefix: {label} must be a non-negative int, got {value!r}")
    return f"dp{dp}:pp{pp}:pcp{pcp}:tp{tp}:"


def merge_digests(maps: Iterable[Mapping[str, str]], sources: Iterable[object] | None = None) -> dict[str, str]:
    """One ``{key: hex}`` from several (every worker's, every server's). A key
    found twice is an error naming the duplicates (and the source that
    repeated them, when ``sources`` names them)."""
    merged: dict[str, str] = {}
    names = iter(sources) if sources is not None else None
    for m in maps:
        source = next(names, None) if names is not None else None
        if duplicates := merged.keys() & m.keys():
            raise DuplicateKeysError(sorted(duplicates), source)
        merged.update(m)
    return merged


def first_repeated(items: Iterable[str]) -> str:
    """The first item that appeared before (``ValueError`` if none did)."""
    seen: set[str] = set()
    for item in items:
        if item in seen:
            return item
        seen.add(item)
    raise ValueError("no item appears twice")


#: The rank fields of a key, in order: vLLM 0.32/0.33's four
#: (``dp:pp:pcp:tp``), and its main branch's five (``:ep`` after ``tp``).
RANK_FIELDS = ("dp", "pp", "pcp", "tp", "ep")
_FIELD = re.compile(r"(dp|pp|pcp|tp|ep)(\d+)$")


def _rank_fields(key: str) -> int:
    """How many of the key's leading ``:``-separated parts are rank fields
    (4 or 5; 0 for a key without a rank prefix)."""
    parts = key.split(":", 5)
    n = 0
    for want, part in zip(RANK_FIELDS, parts[:-1], strict=False):
        m = _FIELD.match(part)
        if m is None or m.group(1) != want:
            break
        n += 1
    return n if n >= 4 else 0


def split_rank(key: str) -> tuple[str, str]:
    """``("dp0:pp0:pcp0:tp0", "name")``: a key's rank and its name (which may
    itself hold colons, e.g. ``lora:NAME:module.lora_a``); ``("", key)`` for a
    key without the rank prefix. Both key forms: vLLM 0.32's
    ``dp:pp:pcp:tp:name`` and its main branch's ``dp:pp:pcp:tp:ep:name``
    (then the rank is ``"dp0:pp0:pcp0:tp0:ep0"``)."""
    n = _rank_fields(key)
    if not n:
        return "", key
    parts = key.split(":", n)
    return ":".join(parts[:n]), parts[n]


def key_name(key: str) -> str:
    """The tensor's name in a key (what follows its rank prefix)."""
    return split_rank(key)[1]


def split_key(key: str) -> tuple[str, str]:
    """``("dp0", "pp0:pcp0:tp0:name")`` of a key: the data-parallel replica
    and everything else (what replicas of one model share)."""
    dp, _, rest = key.partition(":")
    return dp, rest
