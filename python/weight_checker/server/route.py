"""``POST /weight_checker``: vLLM's weight-checker route, contract for contract.

The route is a FastAPI ``APIRouter`` over an engine adapter: an async
callable returning one ``{key: hex}`` dict per worker, and an async callable
that zeroes the weights. Nothing here is specific to one inference engine.
It merges the workers' digests (a key produced twice is an HTTP 500 naming
the duplicates), compares with vLLM's union-and-sorted
semantics, and answers every malformed request with HTTP 400 in vLLM's error
shape ``{"error": {"message", "type", "param", "code"}}``.

    app = FastAPI()
    adapter = EngineAdapter(checksums=..., reset=...)  # one adapter, one lock:
    mount(app, lambda request: adapter)                # resets wait for running checksums

``get_adapter`` must return the same adapter for every request: the adapter
holds the lock that orders a reset after the checksums already running, and
a new adapter per request would have a new lock.

Whether to mount it is the caller's decision (vLLM's glue mounts it only
when ``VLLM_SERVER_DEV_MODE=1``, as vLLM does).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from http import HTTPStatus

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse

from weight_checker.digests import compare
from weight_checker.keys import DuplicateKeysError, merge_digests

ACTIONS = ("checksum", "reset", "compare")


class _SharedExclusiveLock:
    """Many checksums at once, but a reset runs alone: a reset never
    interleaves with a checksum that is reading the same weights."""

    def __init__(self) -> None:
        self._cond = asyncio.Condition()
        self._readers = 0
        self._writer = False

    async def _acquire(self, exclusive: bool) -> None:
        async with self._cond:
            if exclusive:
                await self._cond.wait_for(lambda: not self._writer and self._readers == 0)
                self._writer = True
            else:
                await self._cond.wait_for(lambda: not self._writer)
                self._readers += 1

    async def _release(self, exclusive: bool) -> None:
        async with self._cond:
            if exclusive:
                self._writer = False
            else:
                self._readers -= 1
            self._cond.notify_all()

    def shared(self) -> _Held:
        return _Held(self, exclusive=False)

    def exclusive(self) -> _Held:
        return _Held(self, exclusive=True)


@dataclass
class _Held:
    lock: _SharedExclusiveLock
    exclusive: bool

    async def __aenter__(self) -> None:
        await self.lock._acquire(self.exclusive)

    async def __aexit__(self, *exc: object) -> None:
        await self.lock._release(self.exclusive)


@dataclass(eq=False)
class EngineAdapter:
    """What the route needs from an inference engine.

    ``checksums`` returns one ``{key: hex}`` dict per worker, over every
    engine behind this API server; ``reset`` zeroes every worker's weights.
    """

    checksums: Callable[[], Awaitable[list[dict[str, str]]]]
    reset: Callable[[], Awaitable[None]]
    lock: _SharedExclusiveLock = field(default_factory=_SharedExclusiveLock, repr=False)


class BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param


def error_response(status: HTTPStatus, message: str, param: str | None = None) -> JSONResponse:
    """vLLM's error body: ``{"error": {"message", "type", "param", "code"}}``."""
    body = {"error": {"message": message, "type": status.phrase, "param": param, "code": status.value}}
    return JSONResponse(body, status_code=status.value)


class _DuplicateKey(Exception):
    pass


def _no_duplicate_keys(pairs: list[tuple[str, object]]) -> dict[str, object]:
    """``json.loads`` hook: an object that names a key twice is ambiguous
    (which ``action``?), so it is refused rather than last-one-wins."""
    out = dict(pairs)
    if len(out) != len(pairs):
        from weight_checker.keys import first_repeated

        raise _DuplicateKey(first_repeated(k for k, _ in pairs))
    return out


def parse_request(content_type: str | None, raw: bytes) -> tuple[str, dict[str, str] | None]:
    """Validates a request body exactly as strictly as vLLM's route does
    (plus a JSON content type); returns ``(action, baseline)``."""
    if not raw.strip():
        raise BadRequest("Field required: the body must be a JSON object with 'action'", "body.action")
    media = (content_type or "").split(";")[0].strip().lower()
    if media != "application/json" and not media.endswith("+json"):
        raise BadRequest(f"Content-Type must be application/json, got {content_type!r}", "body")
    try:
        body = json.loads(raw, object_pairs_hook=_no_duplicate_keys)
    except _DuplicateKey as e:
        raise BadRequest(f"Invalid JSON: duplicate key {e.args[0]!r:.80}", "body") from None
    except RecursionError:
        raise BadRequest("Invalid JSON: nested too deeply", "body") from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, a number too long to convert
        raise BadRequest(f"Invalid JSON: {str(e)[:200]}", "body") from None
    if not isinstance(body, dict):
        raise BadRequest(f"The body must be a JSON object, got {type(body).__name__}", "body")
    if "action" not in body:
        raise BadRequest("Field required: 'action'", "body.action")
    action = body["action"]
    if not isinstance(action, str) or action not in ACTIONS:
        raise BadRequest(f"'action' must be one of {list(ACTIONS)}, got {action!r:.80}", "body.action")
    baseline = body.get("baseline")
    if baseline is not None:
        if not isinstance(baseline, dict):
            raise BadRequest(
                f"'baseline' must be an object key -> sha256 hex, got {type(baseline).__name__}",
                "body.baseline",
            )
        for key, digest in baseline.items():
            if not isinstance(digest, str):
                raise BadRequest(
                    f"baseline[{key!r}] must be a string, got {digest!r:.80}",
                    f"body.baseline.{key}",
                )
    if action == "compare" and baseline is None:
        raise BadRequest("action='compare' requires a 'baseline' object", "body.baseline")
    return action, baseline


# vLLM compares digest strings as they are (a wrong one is a mismatch, not a
# bad request), so the schema asks for strings and nothing more.
_DIGEST_MAP = {
    "type": "object",
    "additionalProperties": {"type": "string"},
}
_ERROR = {
    "type": "object",
    "properties": {
        "error": {
            "type": "object",
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": "integer"},
            },
            "required": ["message", "type", "code"],
        }
    },
}
OPENAPI = {
    "requestBody": {
        "required": True,
        "content": {
            "application/json": {
                "schema": {
                    "oneOf": [
                        {
                            "title": "checksum",
                            "type": "object",
                            "properties": {"action": {"const": "checksum"}},
                            "required": ["action"],
                        },
                        {
                            "title": "reset",
                            "type": "object",
                            "properties": {"action": {"const": "reset"}},
                            "required": ["action"],
                        },
                        {
                            "title": "compare",
                            "type": "object",
                            "properties": {"action": {"const": "compare"}, "baseline": _DIGEST_MAP},
                            "required": ["action", "baseline"],
                        },
                    ]
                }
            }
        },
    },
    "responses": {
        "200": {
            "description": "checksum: {checksums}; reset: {status}; compare: {match, mismatches}",
            "content": {
                "application/json": {
                    "schema": {
                        "oneOf": [
                            {
                                "type": "object",
                                "properties": {"checksums": _DIGEST_MAP},
                                "required": ["checksums"],
                            },
                            {
                                "type": "object",
                                "properties": {"status": {"const": "reset"}},
                                "required": ["status"],
                            },
                            {
                                "type": "object",
                                "properties": {
                                    "match": {"type": "boolean"},
                                    "mismatches": {"type": "array", "items": {"type": "string"}},
                                },
                                "required": ["match", "mismatches"],
                            },
                        ]
                    }
                }
            },
        },
        "400": {
            "description": "Invalid request",
            "content": {"application/json": {"schema": _ERROR}},
        },
        "500": {
            "description": "Two workers produced the same key",
            "content": {"application/json": {"schema": _ERROR}},
        },
    },
}


def create_router(get_adapter: Callable[[Request], EngineAdapter]) -> APIRouter:
    """The ``POST /weight_checker`` router over the engine adapter ``get_adapter(request)``."""
    router = APIRouter()

    @router.post(
        "/weight_checker",
        summary="Checksum, reset, or compare model weights against a baseline.",
        openapi_extra=OPENAPI,
        response_model=None,
    )
    async def weight_checker(request: Request) -> JSONResponse:
        """Per-tensor SHA-256 of every worker's weights (keys
        ``dp{dp}:pp{pp}:pcp{pcp}:tp{tp}:{name}``); ``reset`` zeroes them;
        ``compare`` recomputes and lists every key whose digest differs from
        ``baseline`` (missing and extra keys included), sorted."""
        try:
            action, baseline = parse_request(request.headers.get("content-type"), await request.body())
        except BadRequest as e:
            return error_response(HTTPStatus.BAD_REQUEST, e.message, e.param)
        adapter = get_adapter(request)
        if action == "reset":
            async with adapter.lock.exclusive():
                await adapter.reset()
            return JSONResponse({"status": "reset"})
        async with adapter.lock.shared():
            per_worker = await adapter.checksums()
        try:
            checksums = merge_digests(per_worker)
        except DuplicateKeysError as e:
            return error_response(HTTPStatus.INTERNAL_SERVER_ERROR, f"Duplicate weight checksum keys: {e.keys}")
        if action == "checksum":
            return JSONResponse({"checksums": checksums})
        assert baseline is not None
        return JSONResponse(dict(compare(baseline, checksums)))

    return router


def mount(app: FastAPI, get_adapter: Callable[[Request], EngineAdapter], *, enabled: bool = True) -> bool:
    """Adds the route to ``app`` if ``enabled``; returns whether it was added."""
    if not enabled:
        return False
    app.include_router(create_router(get_adapter))
    return True
