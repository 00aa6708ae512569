"""The ``sglang.srt.plugins`` entry point: :func:`register`.

SGLang calls it in the server, in an in-process ``sglang.Engine`` and in every
scheduler (one per rank). It refuses, with one line, an SGLang it does not
know (its internals are what the hook and the route stand on), checks the
``WEIGHT_CHECKER_*`` settings, hooks every rank's ``WeightChecker.handle``
(:mod:`.worker`), and in the server process mounts ``POST /weight_checker``
(:mod:`.endpoint`) when ``WEIGHT_CHECKER_SGLANG_DEV_MODE=1``.
"""

from __future__ import annotations

import importlib.metadata
import multiprocessing
import threading

from weight_checker import settings
from weight_checker.integrations.sglang import logger, worker

PLUGIN_ENV = "WEIGHT_CHECKER_SGLANG_PLUGIN"
DEV_MODE_ENV = "WEIGHT_CHECKER_SGLANG_DEV_MODE"
#: The SGLang versions whose weight checker, fan-out and server this plugin was
#: built and tested against.
KNOWN_VERSIONS = ("0.5.23",)
#: The method every rank's weight-checker request ends in.
HANDLE = "sglang.srt.utils.weight_checker.WeightChecker.handle"

_registered = False
_lock = threading.Lock()


def sglang_version() -> str | None:
    try:
        return importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        return None


def dev_mode_enabled() -> bool:
    return settings.enabled(DEV_MODE_ENV, default=False)


def register() -> bool:
    """``sglang.srt.plugins`` entry point (idempotent): whether this process was
    hooked. Raises :class:`~weight_checker.errors.SettingsError` for a
    ``WEIGHT_CHECKER_*`` variable set to a value it does not accept (SGLang
    logs it and starts without the plugin)."""
    global _registered
    with _lock:
        if _registered:
            return True
        version = sglang_version()
        if version not in KNOWN_VERSIONS:
            logger.warning(
                "weight_checker: SGLang %s is not a version this plugin knows (%s); SGLang left as is",
                version,
                ", ".join(KNOWN_VERSIONS),
            )
            return False
        settings.check(read_by=("core", "python"))
        if not settings.enabled(PLUGIN_ENV):
            logger.info("weight_checker: plugin disabled by %s", PLUGIN_ENV)
            return False
        # sglang: the plugin runs inside SGLang's processes; the package imports without it.
        from sglang.srt.plugins.hook_registry import HookRegistry, HookType

        HookRegistry.register(HANDLE, worker.handle, HookType.AROUND)
        _registered = True
    # The schedulers are SGLang's child processes; the server (or an Engine) is the main one.
    if multiprocessing.current_process().name == "MainProcess":
        if dev_mode_enabled():
            # fastapi: the route's, imported only where a server mounts it.
            from weight_checker.integrations.sglang.endpoint import mount_route

            mount_route()
        else:
            logger.info("weight_checker: no POST /weight_checker on this server: set %s=1", DEV_MODE_ENV)
    return True
