"""The one HTTP client of the package: JSON over urllib, no dependencies.

Used by the verify workflow, the CLI, the expected digests (a server's config) and the
local-server launcher: it sits below all of them. URLs are
validated before anything is sent; an API key is sent as
``Authorization: Bearer``; every failure becomes an :class:`HttpError` that
names the server.
"""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from weight_checker.errors import HttpError, InputError

API_KEY_ENV = "VLLM_API_KEY"


def validate_url(url: object) -> str:
    """``url`` without a trailing slash, if it is an ``http(s)://host[:port]``
    URL; else :class:`InputError` (a ``ValueError``) saying what is wrong."""
    if not isinstance(url, str) or not url.strip():
        raise InputError(f"invalid URL {url!r}: empty")
    try:
        parts = urllib.parse.urlsplit(url.strip())
        port = parts.port  # raises on a bad port
        host = parts.hostname
    except ValueError as e:
        raise InputError(f"invalid URL {url!r}: {e}") from e
    if parts.scheme not in ("http", "https"):
        raise InputError(f"invalid URL {url!r}: the scheme must be http or https")
    if not host:
        raise InputError(f"invalid URL {url!r}: no host")
    if port == 0:
        raise InputError(f"invalid URL {url!r}: port 0")
    if parts.query or parts.fragment:
        raise InputError(f"invalid URL {url!r}: no query or fragment expected")
    if any(c.isspace() or ord(c) < 32 for c in url.strip()):
        raise InputError(f"invalid URL {url!r}: control or space characters")
    return url.strip().rstrip("/")


def api_key_from_env(explicit: str | None = None) -> str | None:
    """``explicit`` if given, else ``VLLM_API_KEY`` (as vLLM's server reads it)."""
    if explicit:
        return explicit
    return os.environ.get(API_KEY_ENV) or None


def request(
    method: str,
    url: str,
    path: str,
    body: Any = None,
    *,
    timeout: float = 600.0,
    api_key: str | None = None,
) -> tuple[int, Any]:
    """``(status, decoded JSON or text)`` of one request. HTTP error statuses
    are returned, not raised; connection failures raise :class:`HttpError`."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data=data, method=method)
    if data is not None:
        req.add_header("Content-Type", "application/json")
    if api_key:
        req.add_header("Authorization", f"Bearer {api_key}")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status, raw = r.status, r.read()
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read()
    except (urllib.error.URLError, OSError, ValueError) as e:
        reason = getattr(e, "reason", e)
        raise HttpError(url, f"cannot connect: {reason}") from e
    try:
        return status, (json.loads(raw) if raw else None)
    except ValueError:
        return status, raw.decode(errors="replace")


def clip(text: str, limit: int = 2000) -> str:
    """A non-JSON body (an HTML error page) shortened for a message, saying so."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text) - limit} more characters)"


def post_json(url: str, path: str, body: Any = None, *, timeout: float = 600.0, api_key: str | None = None) -> Any:
    """The JSON answer of a POST that must succeed (2xx), else :class:`HttpError`."""
    status, answer = request("POST", url, path, body, timeout=timeout, api_key=api_key)
    if status == 401 or status == 403:
        raise HttpError(
            url, f"unauthorized (HTTP {status}): pass the server's API key (--api-key or VLLM_API_KEY)", status
        )
    if not 200 <= status < 300:
        detail = clip(answer) if isinstance(answer, str) else json.dumps(answer)
        raise HttpError(url, f"HTTP {status}: {detail}", status)
    if isinstance(answer, str):
        raise HttpError(url, f"answer is not JSON: {clip(answer)!r}", status)
    return answer
