"""Engine families behind one seam: what differs between vLLM and SGLang
servers, for everything above that never names an engine.

An :class:`EngineFamily` says how a server of its family is paused, resumed,
reloaded from disk, and asked for its version, its weight version and its
data-parallel-sharded parameters. The checksum, the reset and the compare go
through the same ``POST /weight_checker`` contract on every family (this
package's route). One module a family (:mod:`.vllm`, :mod:`.sglang`);
:func:`family_named` maps a name to one, :func:`detect` reads a server's
family from what it answers.
"""

from __future__ import annotations

from weight_checker.engines.family import DEFAULT_PAUSE, PAUSE_MODES, EngineFamily, Get, Post, check_pause_mode
from weight_checker.engines.sglang import SGLANG
from weight_checker.engines.vllm import VLLM
from weight_checker.errors import HttpError, InputError

__all__ = [
    "DEFAULT_PAUSE",
    "FAMILIES",
    "PAUSE_MODES",
    "EngineFamily",
    "Get",
    "Post",
    "check_pause_mode",
    "detect",
    "family_named",
]

#: Every family by name: a new engine is one module and one entry here.
_BY_NAME: dict[str, EngineFamily] = {"vllm": VLLM, "sglang": SGLANG}
FAMILIES = tuple(_BY_NAME)


def family_named(name: str) -> EngineFamily:
    """The family called ``name`` (``vllm``, ``sglang``); :class:`InputError` otherwise."""
    if name not in _BY_NAME:
        raise InputError(f"unknown engine {name!r}: expected {', '.join(FAMILIES)}")
    return _BY_NAME[name]


def detect(get: Get, url: str) -> EngineFamily | None:
    """The family of the server at ``url``, read from what it answers: an
    SGLang server describes the model it serves at ``/model_info`` (its
    ``model_path``, whether it ``is_generation``), a path vLLM does not
    serve. Any other answer is vLLM's, the family this package served first
    (a vLLM server is asked nothing new but one cheap 404). ``None`` where
    nothing answered: nothing is known yet."""
    try:
        status, body = get(url, "/model_info")
    except HttpError:
        return None
    if status == 200 and isinstance(body, dict) and "model_path" in body and "is_generation" in body:
        return family_named("sglang")
    return family_named("vllm")
