"""What a checksum covers inside a vLLM worker (:mod:`weight_checker.scope`):

- ``target``: the target model's parameters, walked like vLLM's own checker
  (the default: ``{"action": "checksum"}`` is byte-identical to vLLM's).
- ``draft``: the draft model of draft-model speculative decoding, its
  parameters under ``draft:{name}``.
- ``buffers``: the target model's persistent buffers, under ``buffer:{name}``.
- ``lora``: every LoRA adapter in a slot, as the layers compute with it: each
  wrapped module's rows of the slot buffers (``lora_a_stacked`` /
  ``lora_b_stacked``) on this rank, under ``lora:{adapter}:{module}.lora_a``
  / ``.lora_b``. A packed module (``qkv_proj``) gives one key per packed
  sub-module (``q_proj``, ``k_proj``, ``v_proj``). The buffers hold what
  vLLM's ``set_lora`` wrote: the adapter's ``A``, its ``B`` scaled by
  ``alpha / r``, both sliced for this tensor-parallel rank and zero-padded
  to ``max_lora_rank``. A slot that no adapter holds is never hashed (its
  bytes are whatever its last adapter left).

The worker keeps adapters by id only; :func:`remember_adapter_names` makes
it keep the name each one was loaded under, so keys name adapters as users
do. The same slot walk (:func:`lora_slot_tensors`) runs in the engine and in
:mod:`weight_checker.expected.vllm.lora`, so both sides name and slice alike.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable, Iterator
from typing import Any

from weight_checker.hashing.walk import collect, persistent_buffers

#: The attribute of a LoRA-wrapped layer and the key suffix it is hashed under.
SLOT_BUFFERS = (("lora_a_stacked", "lora_a"), ("lora_b_stacked", "lora_b"))
#: Where the worker's LoRA manager keeps ``{lora_int_id: lora_name}``.
NAMES_ATTR = "_weight_checker_lora_names"


def lora_slot_tensors(manager: Any, slot: int) -> Iterator[tuple[str, Any]]:
    """``(module.lora_a | .lora_b, tensor)`` of every wrapped module's rows of
    ``slot``, in the manager's module order: what the layers compute with."""
    packed = getattr(manager, "packed_modules_mapping", {}) or {}
    for module, layer in manager.modules.items():
        parent, _, leaf = module.rpartition(".")
        for attr, suffix in SLOT_BUFFERS:
            buffers = layer.__dict__.get(attr)
            if buffers is None:
                continue
            if not isinstance(buffers, (tuple, list)):
                yield f"{module}.{suffix}", buffers[slot]
                continue
            parts = packed.get(leaf, [])
            for k, buffer in enumerate(buffers):
                if len(buffers) == 1:
                    name = module
                elif len(parts) == len(buffers):
                    name = f"{parent}.{parts[k]}" if parent else parts[k]
                else:
                    name = f"{module}.{k}"
                yield f"{name}.{suffix}", buffer[slot]


def active_adapters(manager: Any) -> Iterator[tuple[int, int]]:
    """``(slot, lora_int_id)`` of every slot that holds an adapter."""
    for slot, lora_id in enumerate(manager.lora_index_to_id):
        if lora_id is not None:
            yield slot, lora_id


def adapter_name(worker_manager: Any, lora_id: int) -> str:
    """The name adapter ``lora_id`` was loaded under, ``id{N}`` if unknown
    (e.g. vLLM's warm-up adapters)."""
    return getattr(worker_manager, NAMES_ATTR, {}).get(lora_id, f"id{lora_id}")


def lora_pairs(worker_manager: Any, prefix: str) -> tuple[list[tuple[str, Any]], dict[str, str | None]]:
    """``([(key, tensor)], {slot: adapter name or None})`` of every adapter in a slot."""
    manager = worker_manager._adapter_manager
    pairs: list[tuple[str, Any]] = []
    slots: dict[str, str | None] = {str(s): None for s in range(len(manager.lora_index_to_id))}
    for slot, lora_id in active_adapters(manager):
        name = adapter_name(worker_manager, lora_id)
        slots[str(slot)] = name
        pairs += [(f"{prefix}lora:{name}:{key}", t) for key, t in lora_slot_tensors(manager, slot)]
    return pairs, slots


def remember_adapter_names(manager_cls: type) -> None:
    """Makes ``manager_cls.add_adapter`` (vLLM's worker LoRA manager) keep the
    name of each adapter it loads, by id (an in-place reload keeps its id)."""
    original = manager_cls.__dict__.get("add_adapter")
    if original is None or getattr(original, "_weight_checker_names", False):
        return

    def add_adapter(self: Any, lora_request: Any) -> Any:
        loaded = original(self, lora_request)
        names = self.__dict__.setdefault(NAMES_ATTR, {})
        name = getattr(lora_request, "lora_name", None)
        if isinstance(name, str):
            names[lora_request.lora_int_id] = name
        return loaded

    add_adapter._weight_checker_names = True  # type: ignore[attr-defined]
    add_adapter.__doc__ = original.__doc__
    # setattr: vLLM's class, patched in place.
    setattr(manager_cls, "add_adapter", add_adapter)  # noqa: B010


def patch_lora_module(module: Any) -> None:
    """Import hook target for ``vllm.lora.worker_manager``."""
    for name in ("WorkerLoRAManager", "LRUCacheWorkerLoRAManager"):
        cls = getattr(module, name, None)
        if isinstance(cls, type):
            remember_adapter_names(cls)


def vllm_checksum_targets(model: Any) -> list[tuple[str, Any]] | None:
    """The ``(name, tensor)`` pairs the running vLLM's own checksum covers,
    where vLLM says (its main branch's ``_iter_checksum_targets``: parameters
    and persistent buffers); ``None`` where it walks the parameters as
    0.32/0.33 do (:mod:`weight_checker.hashing.walk`)."""
    try:
        weight_checksum = importlib.import_module("vllm.model_executor.model_loader.weight_checksum")
    except ImportError:
        return None
    targets = getattr(weight_checksum, "_iter_checksum_targets", None)
    return list(targets(model)) if callable(targets) else None


def scoped_pairs(worker: Any, include: Iterable[str], prefix: str) -> tuple[list[tuple[str, Any]], dict[str, Any]]:
    """``([(key, tensor)], extra)`` of a worker's scope; ``extra`` holds
    ``lora_slots`` (slot -> adapter name) when ``lora`` is in scope."""
    runner = worker.model_runner
    pairs: list[tuple[str, Any]] = []
    extra: dict[str, Any] = {}
    if "target" in include:
        model = runner.get_model()
        targets = vllm_checksum_targets(model)  # what the running vLLM's own checksum covers
        names, tensors = collect(model if targets is None else targets)
        pairs += [(prefix + n, t) for n, t in zip(names, tensors, strict=True)]
    if "draft" in include:
        draft = runner.get_draft_model() if hasattr(runner, "get_draft_model") else None
        if draft is not None:
            names, tensors = collect(draft)
            pairs += [(f"{prefix}draft:{n}", t) for n, t in zip(names, tensors, strict=True)]
    if "buffers" in include:
        pairs += [(f"{prefix}buffer:{n}", t) for n, t in persistent_buffers(runner.get_model())]
    if "lora" in include:
        manager = getattr(runner, "lora_manager", None)
        if manager is not None and getattr(manager, "_adapter_manager", None) is not None:
            lora, slots = lora_pairs(manager, prefix)
            pairs += lora
            extra["lora_slots"] = slots
        else:
            extra["lora_slots"] = {}
    return pairs, extra
