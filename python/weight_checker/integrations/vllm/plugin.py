"""The ``vllm.general_plugins`` entry point: :func:`register`.

vLLM calls it in the API server, the engine cores and every worker. It
checks the ``WEIGHT_CHECKER_*`` settings (a bad value stops vLLM's start-up
with a message naming the variable), then patches, as they are imported,
the worker class (:mod:`.worker`; ``WEIGHT_CHECKER_VLLM_PLUGIN=0`` leaves it
alone) and the API-key middleware (:mod:`.guard`; ``WEIGHT_CHECKER_GUARD=0``).
"""

from __future__ import annotations

import os
import threading
from typing import Any

from weight_checker import settings
from weight_checker.integrations.vllm import guard, logger
from weight_checker.integrations.vllm.hooks import Patches, patch_on_import
from weight_checker.integrations.vllm.scope_walk import patch_lora_module
from weight_checker.integrations.vllm.worker import patch_worker_class

PLUGIN_ENV = "WEIGHT_CHECKER_VLLM_PLUGIN"
DEV_MODE_ENV = "VLLM_SERVER_DEV_MODE"
WORKER_MODULE = "vllm.v1.worker.gpu_worker"
#: Where vLLM's worker LoRA managers are defined (adapter names, :mod:`.scope_walk`).
LORA_MODULE = "vllm.lora.worker_manager"

_registered = False
_lock = threading.Lock()


def dev_mode_enabled() -> bool:
    """vLLM mounts its dev-mode routes (and so we mount ours) only with this."""
    return os.environ.get(DEV_MODE_ENV, "0") == "1"


def plugin_enabled() -> bool:
    return settings.enabled(PLUGIN_ENV)


def _patch_module(module: Any) -> None:
    worker_cls = getattr(module, "Worker", None)
    if worker_cls is None:
        logger.warning("weight_checker: %s has no Worker class; vLLM left as is", module.__name__)
        return
    try:
        patch_worker_class(worker_cls)
    except Exception:  # a plugin must never take vLLM down
        logger.exception("weight_checker: patching %s failed; vLLM left as is", worker_cls)


def register() -> None:
    """``vllm.general_plugins`` entry point (idempotent, cheap). Raises
    :class:`~weight_checker.errors.SettingsError` for a ``WEIGHT_CHECKER_*``
    variable set to a value it does not accept."""
    global _registered
    with _lock:
        if _registered:
            return
        settings.check(read_by=("core", "python"))  # not the test suite's own variables
        _registered = True
    patches: Patches = {}
    if plugin_enabled():
        patches[WORKER_MODULE] = _patch_module
        patches[LORA_MODULE] = patch_lora_module
    else:
        logger.info("weight_checker: plugin disabled by %s", PLUGIN_ENV)
    if guard.guard_enabled():
        patches[guard.AUTH_MODULE] = guard.patch_module
    else:
        logger.info("weight_checker: dev-mode route guard disabled by %s", guard.GUARD_ENV)
    patch_on_import(patches)
