"""The `dp{dp}:pp{pp}:pcp{pcp}:tp{tp}:{name}` key format of vLLM's checker."""

from __future__ import annotations

import re

_KEY = re.compile(r"^dp(\d+):pp(\d+):pcp(\d+):tp(\d+):(.+)$")


def rank_prefix(dp: int, pp: int, pcp: int, tp: int) -> str:
    """The key prefix of one worker: ``"dp{dp}:pp{pp}:pcp{pcp}:tp{tp}:"``.

    ``dp`` is vLLM's ``parallel_config.data_parallel_index`` (not
    ``data_parallel_rank``, which is 0 on every dense-DP replica).
    """
    for label, value in (("dp", dp), ("pp", pp), ("pcp", pcp), ("tp", tp)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"rank_prefix: {label} must be a non-negative int, got {value!r}")
    return f"dp{dp}:pp{pp}:pcp{pcp}:tp{tp}:"


def split_key(key: str) -> tuple[str, str] | None:
    """``(prefix, tensor name)`` of a full key, or None if it has no rank prefix."""
    m = _KEY.match(key)
    if m is None:
        return None
    return rank_prefix(*(int(g) for g in m.groups()[:4])), m.group(5)
