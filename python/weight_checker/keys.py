"""The `dp{dp}:pp{pp}:pcp{pcp}:tp{tp}:{name}` key format of vLLM's checker."""

from __future__ import annotations


def rank_prefix(dp: int, pp: int, pcp: int, tp: int) -> str:
    """The key prefix of one worker: ``"dp{dp}:pp{pp}:pcp{pcp}:tp{tp}:"``.

    ``dp`` is vLLM's ``parallel_config.data_parallel_index`` (not
    ``data_parallel_rank``, which is 0 on every dense-DP replica).
    """
    for label, value in (("dp", dp), ("pp", pp), ("pcp", pcp), ("tp", tp)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"rank_prefix: {label} must be a non-negative int, got {value!r}")
    return f"dp{dp}:pp{pp}:pcp{pcp}:tp{tp}:"
