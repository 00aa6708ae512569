"""Requests to ``POST /weight_checker``, validated as strictly as vLLM's
route does, and vLLM's error shape ``{"error": {"message", "type", "param",
"code"}}``."""

from __future__ import annotations

import json
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

from fastapi.responses import JSONResponse

from weight_checker.errors import InputError
from weight_checker.keys import first_repeated
from weight_checker.scope import SCOPES, parse_include

ACTIONS = ("checksum", "reset", "compare", "block_digests")


class BadRequest(Exception):
    """A request the route answers with HTTP 400 (never leaves the route)."""

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
        raise _DuplicateKey(first_repeated(k for k, _ in pairs))
    return out


@dataclass(frozen=True)
class WeightCheckerRequest:
    """A valid request: the action, the baseline of ``compare``, and the
    scope (``None``: the target model only, exactly as vLLM's route)."""

    action: str
    baseline: dict[str, str] | None = None
    include: tuple[str, ...] | None = None
    #: ``block_digests`` (this package's action, not vLLM's): the keys whose
    #: tensors are hashed in blocks of ``block_bytes``.
    keys: tuple[str, ...] = ()
    block_bytes: int = 0
    #: ``block_digests`` with ``chain``: for the keys it names, ``[[block,
    #: state_hex], ...]`` to continue over those blocks
    #: (:mod:`weight_checker.hashing.block_states`) instead of block digests.
    chain: dict[str, list[list[Any]]] | None = None


def parse_request(content_type: str | None, raw: bytes) -> WeightCheckerRequest:
    """Validates a request body exactly as strictly as vLLM's route does
    (plus a JSON content type, and the optional ``include`` scope)."""
    if not raw.strip():
        raise BadRequest("Field required: the body must be a JSON object with 'action'", "body.action")
    media = (content_type or "").split(";")[0].strip().lower()
    # No Content-Type: JSON, as vLLM's own route takes it; another type is refused.
    if media and media != "application/json" and not media.endswith("+json"):
        raise BadRequest(f"Content-Type must be application/json, got {content_type!r}", "body")
    try:
        body = json.loads(raw, object_pairs_hook=_no_duplicate_keys)
    except _DuplicateKey as e:
        raise BadRequest(f"Invalid JSON: duplicate key {e.args[0]!r:.80}", "body") from e
    except RecursionError as e:
        raise BadRequest("Invalid JSON: nested too deeply", "body") from e
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, a number too long to convert
        raise BadRequest(f"Invalid JSON: {e}", "body") from e
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
    include = None
    if "include" in body:
        scope = body["include"]
        try:
            if not isinstance(scope, list) or not all(isinstance(s, str) for s in scope):
                raise InputError("not a list of strings")
            include = parse_include(scope)
        except InputError as e:
            raise BadRequest(
                f"'include' must be a non-empty list of {', '.join(SCOPES)}; got {scope!r:.80}", "body.include"
            ) from e
    keys: tuple[str, ...] = ()
    block_bytes = 0
    chain = None
    if action == "block_digests":
        keys, block_bytes = _block_request(body)
        chain = _chain_request(body, keys)
    return WeightCheckerRequest(action, baseline, include, keys, block_bytes, chain)


def _chain_request(body: dict[str, object], keys: tuple[str, ...]) -> dict[str, list[list[Any]]] | None:
    """``chain`` of a ``block_digests`` request, where given: an object
    whose keys are among ``keys``, each ``[[block, state_hex], ...]`` (at
    most :data:`MAX_BLOCKS` pairs, the states at most 109 bytes each)."""
    from weight_checker.hashing.blocks import MAX_BLOCKS

    if "chain" not in body:
        return None
    chain = body["chain"]
    if not isinstance(chain, dict):
        raise BadRequest(f"'chain' must be an object of key -> [[block, state], ...], got {chain!r:.80}", "body.chain")
    for key, pairs in chain.items():
        if key not in keys:
            raise BadRequest(f"'chain' names {key!r:.80}, which 'keys' does not", "body.chain")
        ok = isinstance(pairs, list) and 0 < len(pairs) <= MAX_BLOCKS
        ok = ok and all(
            isinstance(p, list) and len(p) == 2 and type(p[0]) is int and p[0] >= 0
            and isinstance(p[1], str) and 0 < len(p[1]) <= 218
            for p in pairs
        )  # fmt: skip
        if not ok:
            raise BadRequest(
                f"'chain' for {key!r:.80} must list 1 to {MAX_BLOCKS} [block, state_hex] pairs", "body.chain"
            )
        if len({p[0] for p in pairs}) != len(pairs):  # each block costs a hash of it: at most once
            raise BadRequest(f"'chain' for {key!r:.80} names a block twice", "body.chain")
    return chain


def _block_request(body: dict[str, object]) -> tuple[tuple[str, ...], int]:
    """``keys`` and ``block_bytes`` of a ``block_digests`` request: a
    non-empty list of distinct keys (at most :data:`MAX_KEYS`), a whole
    number of bytes of at least 1."""
    from weight_checker.hashing.blocks import MAX_KEYS

    keys = body.get("keys")
    if not isinstance(keys, list) or not keys or not all(isinstance(k, str) and k for k in keys):
        raise BadRequest(f"'keys' must be a non-empty list of keys, got {keys!r:.80}", "body.keys")
    if len(keys) > MAX_KEYS:
        raise BadRequest(f"'keys' names {len(keys)} keys: at most {MAX_KEYS} a request", "body.keys")
    if len(set(keys)) != len(keys):
        raise BadRequest(f"'keys' names {first_repeated(keys)!r:.80} twice", "body.keys")
    size = body.get("block_bytes")
    if isinstance(size, float) and size.is_integer():  # JSON's 1.0 is the integer 1 (as JSON Schema says)
        size = int(size)
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise BadRequest(f"'block_bytes' must be a whole number of bytes >= 1, got {size!r:.80}", "body.block_bytes")
    return tuple(keys), size
