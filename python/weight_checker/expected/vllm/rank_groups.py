"""vLLM's parallel state set to one rank's coordinates, with no process
group: what model construction and ``load_weights`` read of it (nothing is
communicated while a model is built and loaded)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass


@dataclass
class ProcessGroupShape:
    """The size and rank of a torch process group, without the group (model
    constructors read them, e.g. Mixtral's expert-parallel size)."""

    world_size: int
    rank_in_group: int

    def size(self) -> int:
        return self.world_size

    def rank(self) -> int:
        return self.rank_in_group


@dataclass
class RankGroup:
    """What model construction and ``load_weights`` read of a vLLM group
    coordinator: one rank's coordinates, no communicator."""

    rank_in_group: int
    world_size: int
    ranks: list[int]
    rank: int
    local_rank: int = 0

    @property
    def device_group(self) -> ProcessGroupShape:
        return ProcessGroupShape(self.world_size, self.rank_in_group)

    cpu_group = device_group

    @property
    def is_first_rank(self) -> bool:
        return self.rank_in_group == 0

    @property
    def is_last_rank(self) -> bool:
        return self.rank_in_group == self.world_size - 1


@contextlib.contextmanager
def rank_groups(tp_rank: int, tp: int, pp_rank: int, pp: int, dp_rank: int = 0, dp: int = 1) -> Iterator[None]:
    """vLLM's groups as worker (``dp_rank``, ``pp_rank``, ``tp_rank``) of an
    engine of ``dp`` x ``pp`` x ``tp`` sees them, while the block runs.

    ``dp`` > 1 is for a MoE model only, whose data-parallel ranks share one
    torch world and shard the experts between them: vLLM's MoE layers take
    their tensor- (or expert-) parallel rank and size from the DP group
    flattened with the TP group (``FusedMoEParallelConfig.make``). A dense
    model's DP replicas are independent engines, each a world of its own with a
    DP group of one: ``dp`` = 1 for them, whatever the engine's DP size."""
    from vllm.distributed import parallel_state as ps

    names = ("_TP", "_PP", "_DP", "_EP", "_PCP", "_DCP", "_WORLD")
    saved = {n: getattr(ps, n, None) for n in names}
    world = tp * pp  # one engine's workers
    base = dp_rank * world
    global_rank = base + pp_rank * tp + tp_rank
    groups = {
        "_TP": RankGroup(tp_rank, tp, [base + pp_rank * tp + i for i in range(tp)], global_rank),
        "_PP": RankGroup(pp_rank, pp, [base + p * tp + tp_rank for p in range(pp)], global_rank),
        "_DP": RankGroup(dp_rank, dp, [e * world + pp_rank * tp + tp_rank for e in range(dp)], global_rank),
        "_EP": RankGroup(
            dp_rank * tp + tp_rank,
            dp * tp,
            [e * world + pp_rank * tp + i for e in range(dp) for i in range(tp)],
            global_rank,
        ),
        "_PCP": RankGroup(0, 1, [global_rank], global_rank),
        "_DCP": RankGroup(0, 1, [global_rank], global_rank),
        "_WORLD": RankGroup(global_rank, dp * world, list(range(dp * world)), global_rank),
    }
    try:
        for n, g in groups.items():
            if hasattr(ps, n):
                setattr(ps, n, g)
        yield
    finally:
        for n, old in saved.items():
            if hasattr(ps, n):
                setattr(ps, n, old)
