"""The ``POST /weight_checker`` router over an engine adapter (see the
package docstring for the contract)."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse

from weight_checker.errors import DuplicateKeysError
from weight_checker.hashing.digests import compare
from weight_checker.keys import merge_digests
from weight_checker.server.openapi import OPENAPI
from weight_checker.server.requests import BadRequest, error_response, parse_request


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
    An adapter that can cover more than the target model (a request's
    ``include``) also gives ``scoped_checksums(include)``, one
    ``{"checksums": {...}, "rank": ..., "lora_slots": {...}}`` per worker,
    and ``scoped_reset(include)``; without them a request with ``include``
    is refused (400), never answered with less than it asked for.
    """

    checksums: Callable[[], Awaitable[list[dict[str, str]]]]
    reset: Callable[[], Awaitable[None]]
    scoped_checksums: Callable[[list[str]], Awaitable[list[dict[str, Any]]]] | None = None
    scoped_reset: Callable[[list[str]], Awaitable[None]] | None = None
    #: ``block_digests(keys, block_bytes, chain)``: one answer per worker,
    #: ``{"blocks": {key: {...}}, "errors": {key: message}}`` for the keys it
    #: holds (see ``weight_checker_block_digests``; ``chain``: ``None``, or
    #: the states to continue, :mod:`weight_checker.hashing.block_states`);
    #: ``None``: not offered.
    block_digests: Callable[..., Awaitable[list[dict[str, Any]]]] | None = None
    lock: _SharedExclusiveLock = field(default_factory=_SharedExclusiveLock, repr=False)


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
        ``baseline`` (missing and extra keys included), sorted. ``include``
        (``target``, ``draft``, ``lora``) widens the scope of all three."""
        try:
            req = parse_request(request.headers.get("content-type"), await request.body())
        except BadRequest as e:
            return error_response(HTTPStatus.BAD_REQUEST, e.message, e.param)
        adapter = get_adapter(request)
        if req.action == "block_digests":
            return await _block_digests(adapter, req)
        if req.include is not None and (adapter.scoped_checksums is None or adapter.scoped_reset is None):
            message = "this engine cannot checksum a scope ('include')"
            return error_response(HTTPStatus.BAD_REQUEST, message, "body.include")
        if req.action == "reset":
            async with adapter.lock.exclusive():
                if req.include is None:
                    await adapter.reset()
                else:
                    assert adapter.scoped_reset is not None
                    await adapter.scoped_reset(list(req.include))
            return JSONResponse({"status": "reset"} | ({"include": list(req.include)} if req.include else {}))
        extra: dict[str, Any] = {}
        async with adapter.lock.shared():
            if req.include is None:
                per_worker = await adapter.checksums()
            else:
                assert adapter.scoped_checksums is not None
                answers = await adapter.scoped_checksums(list(req.include))
                per_worker = [a["checksums"] for a in answers]
                extra["include"] = list(req.include)
                if "lora" in req.include:
                    extra["lora_slots"] = {a.get("rank", str(i)): a.get("lora_slots") for i, a in enumerate(answers)}
        try:
            checksums = merge_digests(per_worker)
        except DuplicateKeysError as e:
            return error_response(HTTPStatus.INTERNAL_SERVER_ERROR, f"Duplicate weight checksum keys: {e.keys}")
        if req.action == "checksum":
            return JSONResponse({"checksums": checksums} | extra)
        assert req.baseline is not None
        return JSONResponse(dict(compare(req.baseline, checksums)) | extra)

    return router


def _takes_chain(block_digests: Callable[..., Any]) -> bool:
    """Whether an adapter's ``block_digests`` takes the third argument, ``chain``."""
    try:
        params = list(inspect.signature(block_digests).parameters.values())
    except (TypeError, ValueError):
        return False
    return len(params) >= 3 or any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params)


async def _block_digests(adapter: EngineAdapter, req: Any) -> JSONResponse:
    """Every named key's block digests, from the worker that holds it; a key
    no worker holds, or a block size above a tensor's size, is a 400 naming
    it (nothing else is answered)."""
    if adapter.block_digests is None:
        return error_response(HTTPStatus.BAD_REQUEST, "this engine cannot give block digests", "body.action")
    if req.chain is not None and not _takes_chain(adapter.block_digests):
        return error_response(HTTPStatus.BAD_REQUEST, "this engine cannot continue chain states", "body.chain")
    async with adapter.lock.shared():
        if req.chain is None:  # an adapter of two arguments (before chain states) still serves block digests
            answers = await adapter.block_digests(list(req.keys), req.block_bytes)
        else:
            answers = await adapter.block_digests(list(req.keys), req.block_bytes, req.chain)
    blocks: dict[str, Any] = {}
    for answer in answers:
        errors = answer.get("errors") or {}
        if errors:
            key = min(errors)
            param = "body.chain" if req.chain is not None and key in req.chain else "body.block_bytes"
            return error_response(HTTPStatus.BAD_REQUEST, f"{key}: {errors[key]}", param)
        for key, value in (answer.get("blocks") or {}).items():
            if key in blocks:
                return error_response(HTTPStatus.INTERNAL_SERVER_ERROR, f"Duplicate weight checksum keys: [{key!r}]")
            blocks[key] = value
    unknown = [k for k in req.keys if k not in blocks]
    if unknown:
        more = f" (and {len(unknown) - 1} more)" if len(unknown) > 1 else ""
        return error_response(HTTPStatus.BAD_REQUEST, f"no worker holds the key {unknown[0]!r}{more}", "body.keys")
    return JSONResponse({"block_digests": blocks})


def mount(app: FastAPI, get_adapter: Callable[[Request], EngineAdapter], *, enabled: bool = True) -> bool:
    """Adds the route to ``app`` if ``enabled``; returns whether it was added."""
    if not enabled:
        return False
    app.include_router(create_router(get_adapter))
    return True
