"""Digests as each update commits, inside vLLM's own weight-update API.

vLLM ≥ 0.32 updates weights through ``POST /start_weight_update``,
``/update_weights`` and ``/finish_weight_update``; its route answers the
finish with ``{"message": "Weight update finished"}`` and nothing else. vLLM's
main branch adds ``"checksum": true`` on ``/update_weights``, and then returns
the committed weights' digests from ``/finish_weight_update``. This gives
0.32 and 0.33 the same, through this package's endpoint plugin:

- ``POST /update_weights`` takes ``"checksum": true`` and ``"include"`` (the
  checksum's scope, as ``/weight_checker``'s) beside ``update_info``. The
  update itself is vLLM's own route's, given the body without them; the
  request is remembered for the session once that succeeds. Before it runs,
  every worker is asked to hash each layer as it commits, while the rest is
  transferred (:mod:`weight_checker.integrations.vllm.commit_digests`); an
  update or finish without the flag after that asks them to drop it.
- ``POST /finish_weight_update`` of such a session finishes the update and
  hashes the weights in one call to every worker of every engine (each
  worker finishes, then hashes what it now holds: nothing else can run on it
  in between), sets the weight version as vLLM does, and answers
  ``{"message": "Weight update finished", "checksums": {key: hex}}`` (with
  ``"include"`` and ``"lora_slots"`` for a scope, as ``/weight_checker``).
  The update is committed and its version set before the digests are
  merged: digests that fail then are answered as ``"checksum_error"`` beside
  the finish's message (the client takes a checksum), never as a failed
  finish. Where the workers cannot run the combined call (the worker plugin
  not loaded), vLLM's own finish answers instead; any other failure of it is
  a 500 naming it (some engines may have committed: vLLM's finish would only
  say "no matching start").
- Without the flag (and every other request), both routes are vLLM's own:
  the request goes to vLLM's original route, and its answer comes back byte
  for byte, headers included.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response

from weight_checker.errors import DuplicateKeysError, InputError
from weight_checker.keys import merge_digests
from weight_checker.scope import SCOPES, parse_include
from weight_checker.server.requests import error_response

logger = logging.getLogger("weight_checker.server")

UPDATE = "/update_weights"
FINISH = "/finish_weight_update"
#: The fields this route adds to ``/update_weights``.
FIELDS = ("checksum", "include")


@dataclass
class UpdateSession:
    """What an update asked for, between its ``update_weights`` and its finish."""

    #: The checksum's scope (``None``: the target model, as vLLM's own checksum).
    include: tuple[str, ...] | None = None


@dataclass(eq=False)
class WeightUpdateRoutes:
    """The two routes over vLLM's own (``original``: path -> its route) and
    ``finish_and_hash(include)``: every worker's answer to finishing the
    update and hashing its weights (one dict per worker)."""

    original: dict[str, Any]
    finish_and_hash: Callable[[list[str] | None], Awaitable[list[dict[str, Any]]]]
    set_weight_version: Callable[[str], Awaitable[None]]
    #: Every worker begins hashing each layer as it commits (before a
    #: flagged update), or drops what it hashed so (before one without the
    #: flag, where a session was begun). Optional: without them the finish
    #: hashes everything.
    begin_digests: Callable[[], Awaitable[None]] | None = None
    end_digests: Callable[[], Awaitable[None]] | None = None
    session: UpdateSession | None = field(default=None)
    #: Whether the workers may hold a session of early digests.
    early: bool = False

    async def begin(self) -> None:
        """Workers begin hashing as layers commit; a failure only costs the
        overlap (the finish then hashes everything)."""
        if self.begin_digests is None:
            return
        self.early = True  # some workers may have begun even if others failed
        try:
            await self.begin_digests()
        except Exception as e:
            logger.warning("weight_checker: the workers cannot hash as layers commit (%s); digests at the finish", e)

    async def end(self) -> None:
        if self.early and self.end_digests is not None:
            self.early = False
            try:
                await self.end_digests()
            except Exception as e:
                logger.warning("weight_checker: cannot drop the workers' early digests (%s)", e)


def original_routes(app: FastAPI) -> dict[str, Any]:
    """vLLM's own ``POST`` routes of :data:`UPDATE` and :data:`FINISH`, found
    before this package's replace them."""
    out: dict[str, Any] = {}
    for route in app.router.routes:
        path, methods = getattr(route, "path", None), getattr(route, "methods", None) or set()
        if path in (UPDATE, FINISH) and "POST" in methods:
            out.setdefault(path, route)
    return out


async def delegate(route: Any, request: Request, body: bytes) -> Response:
    """``request`` (with ``body``) answered by ``route``, vLLM's own, as a
    response of the same status, headers and bytes. Its errors become its
    app's answers (vLLM's exception handlers run inside the route)."""
    scope = dict(request.scope)
    scope["headers"] = [(k, v) for k, v in scope["headers"] if k.lower() != b"content-length"] + [
        (b"content-length", str(len(body)).encode())
    ]
    given = False

    async def receive() -> dict[str, Any]:
        nonlocal given
        if not given:
            given = True
            return {"type": "http.request", "body": body, "more_body": False}
        return {"type": "http.disconnect"}

    messages: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        messages.append(message)

    await route.handle(scope, receive, send)
    start = next(m for m in messages if m["type"] == "http.response.start")
    response = Response(
        content=b"".join(m.get("body", b"") for m in messages if m["type"] == "http.response.body"),
        status_code=start["status"],
    )
    response.raw_headers = list(start.get("headers", []))
    return response


def _object(body: bytes) -> dict[str, Any] | None:
    """The body as a JSON object, or ``None`` (then it is vLLM's to answer)."""
    try:
        parsed = json.loads(body) if body.strip() else None
    except ValueError:
        return None
    return parsed if isinstance(parsed, dict) else None


def create_weight_update_router(get_routes: Callable[[Request], WeightUpdateRoutes]) -> APIRouter:
    router = APIRouter()

    @router.post(UPDATE, response_model=None)
    async def update_weights(request: Request) -> Response:
        """vLLM's ``/update_weights``; with ``"checksum": true`` (and an
        optional ``"include"``), the finish of this update also returns the
        committed weights' digests."""
        routes = get_routes(request)
        body = await request.body()
        parsed = _object(body)
        if parsed is None or not set(FIELDS) & parsed.keys():
            routes.session = None  # an update without the flag: no digests at its finish
            await routes.end()
            return await delegate(routes.original[UPDATE], request, body)
        checksum = parsed.pop("checksum", False)
        if not isinstance(checksum, bool):
            return error_response(HTTPStatus.BAD_REQUEST, f"'checksum' must be true or false, got {checksum!r:.80}",
                                  "body.checksum")  # fmt: skip
        include = parsed.pop("include", None)
        try:
            scope = parse_include(include) if include is not None else None
        except InputError:
            message = f"'include' must be a non-empty list of {', '.join(SCOPES)}; got {include!r:.80}"
            return error_response(HTTPStatus.BAD_REQUEST, message, "body.include")
        if checksum and routes.session is None:
            # The first flagged update of this start: each worker hashes
            # every layer as it commits, while the rest is transferred (a
            # later update of the same start keeps the session).
            await routes.begin()
        elif not checksum:
            await routes.end()
        response = await delegate(routes.original[UPDATE], request, json.dumps(parsed).encode())
        # This update's finish hashes only if this update asked and was taken.
        routes.session = UpdateSession(scope) if response.status_code == HTTPStatus.OK and checksum else None
        return response

    @router.post(FINISH, response_model=None)
    async def finish_weight_update(request: Request) -> Response:
        """vLLM's ``/finish_weight_update``; after an update sent with
        ``"checksum": true``, also the digests of the weights it committed."""
        routes = get_routes(request)
        body = await request.body()
        session = routes.session
        if session is None:
            await routes.end()
            return await delegate(routes.original[FINISH], request, body)
        parsed = _object(body) if body.strip() else {}
        version = parsed.get("weight_version") if parsed is not None else None
        if parsed is None or not (version is None or isinstance(version, str)):
            message = "the body must be a JSON object with an optional string 'weight_version'"
            return error_response(HTTPStatus.BAD_REQUEST, message, "body.weight_version")
        routes.session = None
        try:
            answers = await routes.finish_and_hash(list(session.include) if session.include else None)
        except Exception as e:  # reported: the workers could not run it, or failed
            if "weight_checker_finish_weight_update" in str(e):
                # The workers' method is missing (the worker plugin is not
                # loaded): no worker finished, so vLLM's own route finishes
                # the update and answers as it always does (no digests: the
                # client takes a checksum and says so).
                logger.warning("weight_checker: the workers cannot finish with digests (%s); vLLM's own finish", e)
                return await delegate(routes.original[FINISH], request, body)
            message = f"finish_weight_update with digests failed: {type(e).__name__}: {e}"
            return error_response(HTTPStatus.INTERNAL_SERVER_ERROR, message[:2000])
        routes.early = False  # each worker's finish ended its session
        # The update is committed on every worker: its version is set
        # whatever the digests below do.
        if version is not None:
            await routes.set_weight_version(version)
        failed = [a for a in answers if "checksums" not in a]
        if failed:
            reasons = "; ".join(f"{a.get('rank', '?')}: {a.get('error', 'no digests')}" for a in failed)
            return JSONResponse({"message": "Weight update finished", "checksum_error": reasons})
        try:
            checksums = merge_digests(a["checksums"] for a in answers)
        except DuplicateKeysError as e:
            message = f"Duplicate weight checksum keys: {e.keys}"
            return JSONResponse({"message": "Weight update finished", "checksum_error": message})
        out: dict[str, Any] = {"message": "Weight update finished", "checksums": checksums}
        if session.include:
            out["include"] = list(session.include)
            if "lora" in session.include:
                out["lora_slots"] = {a.get("rank", str(i)): a.get("lora_slots") for i, a in enumerate(answers)}
        return JSONResponse(out)

    return router
