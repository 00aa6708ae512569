"""One rank of an engine: its name, key prefix and digests, and vLLM set up to build and load its model.

Both :mod:`.digests` (every rank's digests) and :mod:`.recompute` (the
tensors of a few keys' ranks) build and load rank models through these.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

from weight_checker.expected.vllm.lora import cpu_punica
from weight_checker.expected.vllm.rank_groups import rank_groups
from weight_checker.keys import rank_prefix


class Rank:
    """What one rank gives: keys under its prefix. ``dp_rank`` is 0 but for a
    MoE model's data-parallel ranks, which hold different experts; a dense
    model's DP replicas hold their dp0 rank's digests."""

    def __init__(self, pp_rank: int, tp_rank: int, dp_rank: int | None = None):
        self.pp_rank, self.tp_rank, self.dp_rank = pp_rank, tp_rank, dp_rank or 0
        self.name = f"pp{pp_rank}:tp{tp_rank}" if dp_rank is None else f"dp{dp_rank}:pp{pp_rank}:tp{tp_rank}"
        self.prefix = rank_prefix(self.dp_rank, pp_rank, 0, tp_rank)
        self.digests: dict[str, str] = {}
        self.unwritten: list[str] = []
        self._skipped: set[str] = set()

    def add(self, namespace: str, digests: dict[str, str], unwritten: list[str]) -> None:
        skipped = {self.prefix + namespace + n for n in unwritten}
        self._skipped |= skipped
        self.unwritten += sorted(skipped)
        self.put(digests)

    def put(self, digests: Mapping[str, str]) -> None:
        """Digests of this rank's keys, less those of unwritten parameters."""
        for key, digest in digests.items():
            # A SharedWeightParameter or tensor subclass reports name.{part}.
            if key.startswith(self.prefix) and key not in self._skipped and key.rsplit(".", 1)[0] not in self._skipped:
                self.digests[key] = digest


@contextlib.contextmanager
def on_rank(
    config: Any,
    vllm_config: Any,
    model_config: Any,
    rank: Rank,
    tp: int,
    pp: int,
    dp: int,
    cached: Any,
    lora: bool = False,
) -> Iterator[None]:
    """vLLM set up to build and load ``rank``'s model of ``vllm_config`` on
    the CPU: its parallel state, current config and dtype (and the CPU
    punica wrapper for LoRA). A model built anew must not meet the layer
    names registered by an earlier one (the target and draft configs share them)."""
    # vllm and .default_dtype (torch): imported when a rank is built, so `import weight_checker` runs without them.
    from vllm.config import set_current_vllm_config

    # torch: default_dtype.py imports it; loaded only when a rank is built
    from weight_checker.expected.vllm.default_dtype import thread_default_dtype

    if cached is None:
        config.compilation_config.static_forward_context.clear()
        moe_layers = getattr(config.compilation_config, "static_all_moe_layers", None)
        if isinstance(moe_layers, list):
            moe_layers.clear()
    moe_dp = config.parallel_config.data_parallel_size > 1
    with (
        rank_groups(rank.tp_rank, tp, rank.pp_rank, pp, rank.dp_rank if moe_dp else 0, dp if moe_dp else 1),
        set_current_vllm_config(vllm_config),
        # vLLM's set_default_torch_dtype, for this thread only (torch's is the process's).
        thread_default_dtype(model_config.dtype, factories=False),
        cpu_punica() if lora else contextlib.nullcontext(),
    ):
        yield
