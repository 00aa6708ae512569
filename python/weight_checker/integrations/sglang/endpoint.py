"""``POST /weight_checker`` on an SGLang server: this package's route
(:mod:`weight_checker.server`) over every rank, through SGLang's own fan-out.

SGLang's ``/weights_checker`` request already reaches every scheduler (one
per rank, every data-parallel replica) and gathers one answer per
tensor-parallel rank; this route sends it this package's actions
(:mod:`.worker`) and answers with the same JSON as on vLLM. It sits behind
SGLang's API key like SGLang's own weight routes (``ADMIN_OPTIONAL``: the
admin key where one is set, else the API key).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from weight_checker.engines.sglang import BLOCKS, CHECKSUM, RESET, block_request, rank_blocks, rank_digests
from weight_checker.errors import WeightCheckerError
from weight_checker.integrations.sglang import logger
from weight_checker.server import EngineAdapter, mount

ROUTE = "/weight_checker"


def adapter_for(check_weights: Callable[[Any], Any]) -> EngineAdapter:
    """The route's engine adapter over ``check_weights(request)``: SGLang's
    ``TokenizerManager.check_weights`` (its fan-out to every rank)."""

    async def ask(action: str, args: list[str] | None = None) -> list[dict[str, Any]]:
        # sglang: imported in the server, where SGLang runs; the package imports without it.
        from sglang.srt.managers.io_struct import CheckWeightsReqInput

        request = CheckWeightsReqInput(action=action, selector="target", skip_tensor_list=args)
        success, message, ranks, _ = await check_weights(request)
        if not success:
            raise WeightCheckerError(f"SGLang's ranks answered {action!r} with: {message}")
        return list(ranks or ())

    async def checksums() -> list[dict[str, str]]:
        return rank_digests(await ask(CHECKSUM))

    async def reset() -> None:
        await ask(RESET)

    async def block_digests(keys: list[str], block_bytes: int, chain: Any = None) -> list[dict[str, Any]]:
        return rank_blocks(await ask(BLOCKS, block_request(keys, block_bytes, chain)))

    return EngineAdapter(checksums=checksums, reset=reset, block_digests=block_digests)


def mount_route() -> bool:
    """Mounts the route on SGLang's server app, behind its API key; whether it was mounted."""
    # sglang: imported in the server process only (the plugin loads in every rank too).
    from sglang.srt.entrypoints import http_server
    from sglang.srt.utils.auth import AuthLevel

    def check_weights(obj: Any) -> Any:
        # The server's state is set once it starts, after the plugin loaded: read it per request.
        return http_server._global_state.tokenizer_manager.check_weights(obj, None)

    adapter = adapter_for(check_weights)
    mount(http_server.app, lambda request: adapter)
    for route in http_server.app.routes:
        if getattr(route, "path", None) == ROUTE:
            # What SGLang's own @auth_level(AuthLevel.ADMIN_OPTIONAL) sets on its weight routes.
            route.endpoint._auth_level = AuthLevel.ADMIN_OPTIONAL  # type: ignore[attr-defined]
    logger.info("weight_checker: POST %s mounted on the SGLang server", ROUTE)
    return True
