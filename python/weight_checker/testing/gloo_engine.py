"""A weight-transfer engine for vLLM's native update lifecycle on the CPU,
over gloo: what the tests (and the benchmark) drive vLLM's real
``init_weight_transfer_engine`` / ``start_weight_update`` / ``update_weights``
/ ``finish_weight_update`` with, where every built-in backend needs CUDA.

- :class:`GlooWeightTransferEngine` runs in each vLLM worker: it joins a
  gloo group with the trainer (rank 0; a worker's rank is
  ``rank_offset + data_parallel_index * world_size + rank``, as vLLM's NCCL
  engine counts them), receives each tensor by broadcast and loads it with
  ``model.load_weights`` inside vLLM's layerwise reload (started and
  finished with the update, as the NCCL engine does). It overrides
  ``update_weights``: the base class ends with ``torch.accelerator.synchronize()``,
  which raises on a CUDA build of torch with no GPU.
- :class:`GlooTrainer` is the trainer's side
  (``TrainerWeightTransferEngine``): ``trainer_init(init_info, client=...)``
  and ``send_weights(...)``, driving any ``VLLMWeightSyncClient`` (vLLM's HTTP
  client, an in-process engine adapter, or
  :func:`weight_checker.integrations.weight_transfer.verified` around one).

:func:`register` registers both under ``"gloo"``: the tests put it into every
process of a server through the GPU-layout site
(``weight_checker.testing.gpu_layout``), and a server selects it with
``--weight-transfer-config '{"backend": "gloo"}'``.

Faults a real transfer can have, injected on purpose (``send_weights(fault=...)``):
``"zero-bytes"`` (the update reports success having moved nothing: vLLM
#57022), ``"drop:NAME"`` (one tensor received but never loaded). Test support
only: nothing of a production engine uses this.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar

import torch
from vllm.distributed.weight_transfer.base import (
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

BACKEND = "gloo"
_registered = threading.Lock()


@dataclass
class GlooInitInfo(WeightTransferInitInfo):
    master_address: str
    master_port: int
    world_size: int
    rank_offset: int = 1


@dataclass
class GlooUpdateInfo(WeightTransferUpdateInfo):
    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    #: A fault to make on purpose (see the module docstring), or ``None``.
    fault: str | None = None

    def __post_init__(self) -> None:
        if not len(self.names) == len(self.dtype_names) == len(self.shapes):
            raise ValueError("names, dtype_names and shapes must have the same length")


class GlooWeightTransferEngine(WeightTransferEngine[GlooInitInfo, GlooUpdateInfo]):
    """The worker's side (see the module docstring)."""

    init_info_cls = GlooInitInfo
    update_info_cls = GlooUpdateInfo

    def __init__(self, config: Any, vllm_config: Any, device: Any, model: Any):
        super().__init__(config, vllm_config, device, model)
        self.group: Any = None

    def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
        from vllm.distributed.utils import stateless_init_torch_distributed_process_group

        pc = self.parallel_config
        rank = init_info.rank_offset + pc.data_parallel_index * pc.world_size + pc.rank
        self.group = stateless_init_torch_distributed_process_group(
            init_info.master_address, init_info.master_port, rank, init_info.world_size, backend="gloo"
        )

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.receive_weights(self.parse_update_info(update_info))  # no accelerator to synchronize

    def receive_weights(self, update_info: GlooUpdateInfo) -> None:
        if self.group is None:
            raise RuntimeError("gloo weight transfer not initialized: call init_weight_transfer_engine first")
        if update_info.fault == "zero-bytes":
            return  # "complete success while moving zero bytes"
        fault = update_info.fault or ""
        dropped = fault.removeprefix("drop:") if fault.startswith("drop:") else None
        for name, dtype_name, shape in zip(update_info.names, update_info.dtype_names, update_info.shapes, strict=True):
            weight = torch.empty(shape, dtype=getattr(torch, dtype_name))
            self.group.broadcast(weight, root=0).wait()
            if name != dropped:
                self.model.load_weights([(name, weight)])  # type: ignore[operator]

    def shutdown(self) -> None:
        if self.group is not None:
            from vllm.distributed.utils import stateless_destroy_torch_distributed_process_group

            stateless_destroy_torch_distributed_process_group(self.group)
            self.group = None


@dataclass
class GlooTrainerInitInfo(TrainerInitInfo):
    backend: ClassVar[str] = BACKEND

    master_address: str
    master_port: int
    #: The trainer and every worker of every engine it updates.
    world_size: int


@dataclass
class _Sent:
    """What the trainer sent in its latest update."""

    names: list[str] = field(default_factory=list)
    nbytes: int = 0


class GlooTrainer(TrainerWeightTransferEngine[GlooTrainerInitInfo]):
    """The trainer's side (see the module docstring): rank 0 of the group."""

    init_info_cls = GlooTrainerInitInfo

    def __init__(self, *, client: Any, source: Any = None, is_sender: bool = True):
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.group: Any = None
        self.world_size = 0
        self.sent = _Sent()

    @classmethod
    def trainer_init(cls, init_info: GlooTrainerInitInfo, *, client: Any, source: Any = None) -> GlooTrainer:
        """Joins the group with every worker: the workers' init runs beside it."""
        from vllm.distributed.utils import stateless_init_torch_distributed_process_group

        self = cls(client=client, source=source, is_sender=init_info.is_sender)
        self.world_size = init_info.world_size
        payload = asdict(GlooInitInfo(init_info.master_address, init_info.master_port, init_info.world_size))
        with ThreadPoolExecutor(1) as pool:
            workers = pool.submit(client.init_weight_transfer_engine, payload)
            self.group = stateless_init_torch_distributed_process_group(
                init_info.master_address, init_info.master_port, 0, init_info.world_size, backend="gloo"
            )
            workers.result()
        return self

    def send_weights(
        self,
        weights: Any = None,
        *,
        weight_version: str | None = None,
        per_rank: bool = False,
        fault: str | None = None,
    ) -> None:
        """One update: ``start``, ``update_weights`` beside the broadcast of
        every tensor, ``finish`` (with ``weight_version``). ``weights``: the
        ``(name, tensor)`` pairs (default: the source given at init);
        ``per_rank``: one ``update_info`` per worker (a list), as vLLM's
        routes take it for DP; ``fault``: see the module docstring."""
        given: Any = weights if weights is not None else self.source
        pairs = [(n, t.detach().contiguous().cpu()) for n, t in given]
        info = asdict(
            GlooUpdateInfo(
                names=[n for n, _ in pairs],
                dtype_names=[str(t.dtype).removeprefix("torch.") for _, t in pairs],
                shapes=[list(t.shape) for _, t in pairs],
                fault=fault,
            )
        )
        self.client.start_weight_update()
        with ThreadPoolExecutor(1) as pool:
            workers = pool.submit(self.client.update_weights, [info] * (self.world_size - 1) if per_rank else info)
            if fault != "zero-bytes":
                for _, t in pairs:
                    self.group.broadcast(t, root=0).wait()
            workers.result()
        self.sent = _Sent([n for n, _ in pairs], sum(t.nbytes for _, t in pairs) if fault != "zero-bytes" else 0)
        self.client.finish_weight_update(weight_version)

    def shutdown(self) -> None:
        if self.group is not None:
            from vllm.distributed.utils import stateless_destroy_torch_distributed_process_group

            stateless_destroy_torch_distributed_process_group(self.group)
            self.group = None


def register() -> None:
    """Registers the worker and trainer engines under ``"gloo"`` (idempotent)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory

    with _registered:
        if BACKEND not in WeightTransferEngineFactory._registry:
            WeightTransferEngineFactory.register_engine(BACKEND, GlooWeightTransferEngine)
        if BACKEND not in WeightTransferTrainerFactory._registry:
            WeightTransferTrainerFactory.register_engine(BACKEND, GlooTrainer)
