"""The ``vllm.endpoint_plugins`` entry point: :class:`WeightCheckerEndpoint`
mounts this package's route (:mod:`weight_checker.server`) in vLLM's API
server, replacing a built-in route of the same path, over every worker of
every engine behind it. vLLM loads it only when ``VLLM_PLUGINS`` names it
(``VLLM_PLUGINS=weight_checker,weight_checker_route``); it is the route for
vLLM ≤ 0.31, which has none, and for data parallelism (vLLM's
``collective_rpc`` answers for one engine only there)."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from weight_checker.integrations.vllm import logger
from weight_checker.integrations.vllm.plugin import dev_mode_enabled
from weight_checker.server import EngineAdapter, mount


async def all_engines(engine_client: Any, method: str, args: tuple[Any, ...] = ()) -> list[Any]:
    """``collective_rpc(method, args=args)`` on every worker of every engine
    behind this API server, flattened. ``engine_client.collective_rpc`` alone
    answers for one engine only under data parallelism."""
    core = getattr(engine_client, "engine_core", None)
    if core is not None and hasattr(core, "call_utility_all_async"):
        per_engine = await core.call_utility_all_async("collective_rpc", method, None, args, None)
    elif core is not None and hasattr(core, "_call_utility_async") and hasattr(core, "core_engines"):
        per_engine = await asyncio.gather(
            *(core._call_utility_async("collective_rpc", method, None, args, None, engine=e) for e in core.core_engines)
        )
    else:
        logger.warning("weight_checker: cannot reach engines one by one; asking collective_rpc")
        per_engine = [await engine_client.collective_rpc(method, args=args)]
    return [worker for workers in per_engine for worker in workers]


def adapter_for(engine_client: Any) -> EngineAdapter:
    """The route's engine adapter over vLLM's engine client: every worker of
    every engine core."""

    async def checksums() -> list[dict[str, str]]:
        return await all_engines(engine_client, "weight_checker_checksums")

    async def reset() -> None:
        await all_engines(engine_client, "weight_checker_reset")

    async def scoped_checksums(include: list[str]) -> list[dict[str, Any]]:
        return await all_engines(engine_client, "weight_checker_scope_checksums", (include,))

    async def scoped_reset(include: list[str]) -> None:
        await all_engines(engine_client, "weight_checker_reset", (include,))

    async def block_digests(keys: list[str], block_bytes: int, chain: Any = None) -> list[dict[str, Any]]:
        args = (keys, block_bytes) if chain is None else (keys, block_bytes, chain)
        return await all_engines(engine_client, "weight_checker_block_digests", args)

    return EngineAdapter(
        checksums=checksums,
        reset=reset,
        scoped_checksums=scoped_checksums,
        scoped_reset=scoped_reset,
        block_digests=block_digests,
    )


def weight_update_routes_for(app: Any, engine_client: Any) -> Any:
    """The weight-update routes' glue (:mod:`weight_checker.server.weight_update`)
    over vLLM's engine client: every worker of every engine finishes the update
    and hashes its weights in one call (the plugin's worker method)."""
    # Loaded only where this vLLM has the weight-update API (>= 0.32).
    from weight_checker.server.weight_update import WeightUpdateRoutes

    async def finish_and_hash(include: list[str] | None) -> list[dict[str, Any]]:
        try:  # vLLM's own metrics of the finish, as its route records them
            from vllm.entrypoints.rl.online.metrics import weight_operation_metrics

            record: Any = weight_operation_metrics().record("finish")
        except ImportError:
            record = contextlib.nullcontext()
        with record:
            return await all_engines(engine_client, "weight_checker_finish_weight_update", (include,))

    async def set_weight_version(version: str) -> None:
        await engine_client.update_weight_version(version)

    async def begin_digests() -> None:
        await all_engines(engine_client, "weight_checker_begin_update_digests")

    async def end_digests() -> None:
        await all_engines(engine_client, "weight_checker_end_update_digests")

    return WeightUpdateRoutes(
        app.state.weight_checker_original_routes,
        finish_and_hash,
        set_weight_version,
        begin_digests=begin_digests,
        end_digests=end_digests,
    )


class WeightCheckerEndpoint:
    """``vllm.endpoint_plugins`` entry point: mounts ``POST /weight_checker``
    (replacing vLLM's built-in route of the same path) when
    ``VLLM_SERVER_DEV_MODE=1``."""

    name = "weight_checker_route"
    required_tasks = None

    def attach_router(self, app: Any) -> None:
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
            return
        self._attach_weight_update(app)

    def _attach_weight_update(self, app: Any) -> None:
        """``/update_weights`` and ``/finish_weight_update`` over vLLM's own
        (where this vLLM has them: ≥ 0.32), for digests as each update commits."""
        # Loaded only where this vLLM has the weight-update API (>= 0.32).
        from weight_checker.server.weight_update import UPDATE, create_weight_update_router, original_routes

        originals = original_routes(app)
        if len(originals) != 2:
            logger.info("weight_checker: this vLLM has no weight-update routes; digests at finish not served")
            return
        app.state.weight_checker_original_routes = originals

        def get_routes(request: Any):
            state = request.app.state
            routes = getattr(state, "weight_checker_update_routes", None)
            if routes is None:
                routes = state.weight_checker_update_routes = weight_update_routes_for(request.app, state.engine_client)
            return routes

        app.include_router(create_weight_update_router(get_routes))
        logger.info(
            "weight_checker: POST %s and /finish_weight_update served by weight_checker.server "
            '(vLLM\'s own unless an update is sent with "checksum": true)',
            UPDATE,
        )

    async def init_state(self, engine_client: Any, state: Any, args: Any) -> None:
        if engine_client is not None:
            state.weight_checker_adapter = adapter_for(engine_client)
