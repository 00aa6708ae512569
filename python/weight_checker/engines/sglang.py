"""SGLang's servers: paused and resumed by ``/pause_generation`` and
``/continue_generation``, reloaded by ``/update_weights_from_disk`` (the
checkpoint it runs, read at ``/model_info``), its version at
``/server_info`` and its weight version at ``/model_info``.

SGLang's pause modes: ``abort`` (the requests in flight are aborted),
``in_place`` (they stay where they are and go on after the resume: this
package's ``keep``) and ``retract`` (they go back to the queue and are
recomputed). It has no ``wait``; a check asked to wait on SGLang is refused."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from weight_checker.engines.family import Get, Post
from weight_checker.errors import HttpError, InputError

#: The actions this package's plugin adds to every SGLang rank's
#: ``WeightChecker.handle`` (:mod:`weight_checker.integrations.sglang.worker`),
#: sent through SGLang's own fan-out (``check_weights``) by the route and by
#: an in-process engine's target alike.
CHECKSUM = "weight_checker.checksum"
RESET = "weight_checker.reset"
BLOCKS = "weight_checker.block_digests"
ACTIONS = (CHECKSUM, RESET, BLOCKS)
#: The one entry of a rank's ``checksums`` that carries its block digests:
#: SGLang's answer is ``{str: str}``, so the answer travels as JSON.
BLOCKS_ENTRY = "weight_checker.blocks"


def rank_digests(ranks: Sequence[Mapping[str, Any]]) -> list[dict[str, str]]:
    """Each rank's ``{key: hex}`` from SGLang's answer (one ``ChecksumInfo``
    a rank), with the ``{role}.`` that SGLang puts in front of a draft
    model's keys taken off (the keys already say ``draft:`` after the rank)."""
    out = []
    for rank in ranks:
        roles = [p["role"] + "." for p in rank.get("parallelism_info") or () if p.get("role") != "target"]
        digests = {}
        for key, digest in rank["checksums"].items():
            role = next((r for r in roles if key.startswith(r)), "")
            digests[key[len(role) :]] = digest
        out.append(digests)
    return out


def rank_blocks(ranks: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Each rank's block-digest answer (``worker_blocks``' shape) from SGLang's answer."""
    return [json.loads(rank["checksums"][BLOCKS_ENTRY]) for rank in ranks]


#: Marks the element of a block request that carries its ``chain`` (as JSON).
CHAIN_ARG = "@chain:"


def block_request(keys: Sequence[str], block_bytes: int, chain: Mapping[str, Any] | None = None) -> list[str]:
    """A block-digest request's arguments as SGLang carries them (its one
    list of strings): the block size, the keys, and the ``chain`` where one is given."""
    return [str(int(block_bytes)), *keys, *([CHAIN_ARG + json.dumps(chain)] if chain else [])]


#: This package's pause modes in SGLang's words.
SGLANG_MODES = {"abort": "abort", "keep": "in_place"}


class SGLangFamily:
    name = "sglang"
    display = "SGLang"
    pause_modes: tuple[str, ...] = tuple(SGLANG_MODES)

    def pause(self, post: Post, url: str, mode: str, step: str) -> Any:
        if mode not in SGLANG_MODES:
            raise InputError(f"SGLang has no {mode!r} pause: use {' or '.join(SGLANG_MODES)}")
        return post(url, "/pause_generation", {"mode": SGLANG_MODES[mode]}, step)

    def resume(self, post: Post, url: str, step: str) -> Any:
        return post(url, "/continue_generation", {}, step)

    def reload(self, post: Post, get: Get, url: str, step: str, pause_mode: str = "abort") -> Any:
        # The checkpoint the server runs now (after an earlier update from disk, that one), as SGLang says.
        try:
            status, body = get(url, "/model_info")
        except HttpError as e:
            raise InputError(f"{url}: cannot read the model it serves: {e.message}") from e
        path = body.get("model_path") if status == 200 and isinstance(body, dict) else None
        if not isinstance(path, str):
            raise InputError(f"{url}: /model_info names no model_path")
        # Requests kept in place hold their cache: SGLang refuses to flush it
        # under them (the update then reports a failure), as its own in-place
        # updates do not flush. Otherwise the prefixes the old weights cached go.
        body = {"model_path": path, "flush_cache": pause_mode != "keep"}
        answer = post(url, "/update_weights_from_disk", body, step)
        if isinstance(answer, dict) and answer.get("success") is False:
            raise InputError(f"{url}: update_weights_from_disk: {answer.get('message')}")
        return answer

    def version(self, get: Get, url: str) -> str | None:
        # What the version is compared with today: the vLLM version that computed expected digests.
        return None

    def weight_version(self, get: Get, url: str) -> str | None:
        try:
            status, body = get(url, "/model_info")
        except HttpError:
            return None
        version = body.get("weight_version") if status == 200 and isinstance(body, dict) else None
        return version if isinstance(version, str) else None

    def dp_sharded(self, post: Post, url: str, step: str) -> list[str] | None:
        return None  # not told: the classes then read replicas from the keys alone


SGLANG = SGLangFamily()
