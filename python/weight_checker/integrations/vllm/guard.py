"""Dev-mode control routes behind vLLM's API key.

vLLM's ``--api-key`` (or ``VLLM_API_KEY``) middleware checks the token only on
paths under ``/v1``, ``/v2``, ``/inference`` and ``/cohere``. The routes that
``VLLM_SERVER_DEV_MODE=1`` adds (``/weight_checker``, ``/collective_rpc``,
``/pause``, ``/sleep``, ``/update_weights``, ...) are open to anyone who can
reach the port: one unauthenticated ``reset`` zeroes the model.

With this package installed, the general plugin extends vLLM's own
``AuthenticationMiddleware`` to those routes too. It changes nothing else:

- the routes are derived from the app, not listed here: every route whose
  endpoint is defined in vLLM's dev-mode or RL modules, or in this package;
- the guard is active exactly when vLLM's is (an API key is configured) and
  checks the token with vLLM's own constant-time comparison;
- a refusal is HTTP 401 in vLLM's error shape;
- ``/health``, ``/ping``, ``/metrics``, ``/version`` and ``/v1/*`` behave as
  before; ``WEIGHT_CHECKER_GUARD=0`` switches the guard off.
"""

from __future__ import annotations

import sys
from collections.abc import Awaitable, Callable
from typing import Any

from weight_checker import settings
from weight_checker.integrations.vllm import logger

GUARD_ENV = "WEIGHT_CHECKER_GUARD"
#: The module that defines vLLM's ``AuthenticationMiddleware`` (0.31 and 0.32).
AUTH_MODULE = "vllm.entrypoints.serve.middleware.authenticate"
#: Endpoints defined under these modules exist only in dev mode (vLLM's
#: ``serve.dev.*`` routers, the RL routers) or are this package's route.
GUARDED_MODULES = ("vllm.entrypoints.serve.dev.", "vllm.entrypoints.rl.", "weight_checker.")


def guard_enabled() -> bool:
    return settings.enabled(GUARD_ENV)


def guarded_paths(app: Any) -> list[str]:
    """The paths of ``app``'s dev-mode control routes, sorted."""
    paths = set()
    for route in getattr(app, "routes", ()):
        endpoint = getattr(route, "endpoint", None)
        module = getattr(endpoint, "__module__", "") or ""
        path = getattr(route, "path", None)
        if isinstance(path, str) and module.startswith(GUARDED_MODULES):
            paths.add(path)
    return sorted(paths)


def unauthorized_body(path: str) -> dict[str, Any]:
    """vLLM's error shape for a refused request."""
    message = f"Unauthorized: {path} requires the API key (Authorization: Bearer <key>)"
    return {"error": {"message": message, "type": "Unauthorized", "param": None, "code": 401}}


def _paths_for(app: Any) -> frozenset[str]:
    """Guarded paths of ``app``, computed once per app (and logged once)."""
    if app is None:  # not a Starlette app's scope: nothing to derive from
        return frozenset()
    state = getattr(app, "state", None)
    cached = getattr(state, "weight_checker_guarded", None) if state is not None else None
    if cached is not None:
        return cached
    paths = frozenset(guarded_paths(app))
    if state is not None:
        state.weight_checker_guarded = paths
    logger.info(
        "weight_checker: the API key is required on %d dev-mode route(s): %s",
        len(paths),
        ", ".join(sorted(paths)) or "(none)",
    )
    return paths


def install(middleware_cls: type) -> bool:
    """Extends ``middleware_cls`` (vLLM's ``AuthenticationMiddleware``) to the
    dev-mode routes. Idempotent; returns whether it patched now."""
    if getattr(middleware_cls, "_weight_checker_guard", False):
        return False
    from starlette.datastructures import Headers
    from starlette.responses import JSONResponse

    original: Callable[..., Awaitable[None]] = middleware_cls.__call__
    vllm_prefixes = tuple(getattr(sys.modules.get(middleware_cls.__module__), "GUARDED_PREFIX", ()))

    def __call__(self: Any, scope: dict, receive: Any, send: Any) -> Awaitable[None]:
        if scope.get("type") in ("http", "websocket") and scope.get("method") != "OPTIONS":
            path = scope.get("path", "").removeprefix(scope.get("root_path", ""))
            # vLLM's own prefixes keep vLLM's own check and answer, unchanged.
            if not path.startswith(vllm_prefixes) and path in _paths_for(scope.get("app")):
                if not self.verify_token(Headers(scope=scope)):
                    return JSONResponse(unauthorized_body(path), status_code=401)(scope, receive, send)
        return original(self, scope, receive, send)

    # setattr: the class is vLLM's, patched in place (mypy sees a method assignment).
    setattr(middleware_cls, "__call__", __call__)  # noqa: B010
    setattr(middleware_cls, "_weight_checker_guard", True)  # noqa: B010
    return True


def patch_module(module: Any) -> None:
    """Import hook target: guards with the module's middleware class."""
    cls = getattr(module, "AuthenticationMiddleware", None)
    if cls is None or not hasattr(cls, "verify_token"):
        logger.warning(
            "weight_checker: %s has no AuthenticationMiddleware with verify_token; "
            "dev-mode routes are NOT guarded by the API key",
            module.__name__,
        )
        return
    if install(cls):
        logger.debug("weight_checker: dev-mode route guard installed on %s", cls.__qualname__)
