"""What each SGLang rank answers: the Rust core's checksum and reset of the
tensors SGLang's own weight checker walks, keyed ``dp{d}:pp{p}:pcp0:tp{t}:{name}``.

SGLang already carries a request to every rank and back: ``/weights_checker``
reaches each scheduler's ``WeightChecker.handle(action, ...)`` and gathers
one answer per tensor-parallel rank. :func:`handle` wraps that method (an
around-hook, :mod:`.plugin`) and answers this package's actions itself;
every other action is SGLang's own. The tensors are the ones SGLang's
checksum walks: the model's parameters, then its buffers, less the rotary
caches and the parameters it marks to skip (its own ``_model_state`` and
``_is_skip_weight_check``, so both walks stay one walk). Two differences,
both stricter: a quantized weight and its scale are hashed as they are held
(SGLang hashes the weight dequantized and drops the scale; expected digests
refuse quantization anyway), and a buffer that shares a parameter's name is
kept, not collapsed. The route asks for the target model only (SGLang's
``selector="target"``); a draft model is not covered yet (docs/sglang.md).
"""

from __future__ import annotations

import json
import time
from typing import Any

from weight_checker.engines.sglang import BLOCKS, BLOCKS_ENTRY, CHAIN_ARG, CHECKSUM, RESET
from weight_checker.hashing.block_states import worker_answer
from weight_checker.hashing.digests import checksum_sized, reset
from weight_checker.integrations.sglang import logger
from weight_checker.keys import rank_prefix


def handle(
    original: Any,
    checker: Any,
    action: str,
    allow_quant_error: bool = False,
    skip_tensor_list: list[str] | None = None,
    *,
    role: str,
) -> dict[str, Any] | None:
    """An around-hook on ``WeightChecker.handle``: this package's actions
    here, SGLang's own by ``original``."""
    if action == CHECKSUM:
        return checksum(checker, role)
    if action == RESET:
        reset(walk(checker))
        logger.info("weight_checker: %s weights reset on %s", role, prefix_of(checker).rstrip(":"))
        return None
    if action == BLOCKS:
        # SGLang's request carries one list of strings: the block size, then the keys.
        return blocks(checker, role, list(skip_tensor_list or []))
    return original(checker, action, allow_quant_error, skip_tensor_list, role=role)


def prefix_of(checker: Any) -> str:
    """The rank's key prefix, from the placement SGLang's checker captured
    (its ``dp_rank`` is ``None`` without data parallelism: 0)."""
    placement = checker._placement
    return rank_prefix(placement.get("dp_rank") or 0, placement["pp_rank"], 0, placement["tp_rank"])


def walk(checker: Any) -> list[tuple[str, Any]]:
    """``(name, tensor)`` of what SGLang's own checksum covers, in its order."""
    # sglang: imported in the scheduler, where SGLang runs; the package imports without it.
    from sglang.srt.utils.weight_checker import _is_skip_weight_check

    return [(name, t) for name, t in checker._model_state() if not _is_skip_weight_check(name, t, None)]


def checksum(checker: Any, role: str) -> dict[str, Any]:
    """One rank's answer in SGLang's shape (``ChecksumInfo``: ``checksums``,
    ``per_gpu_checksum``, ``parallelism_info``), with this package's keys
    and full SHA-256 digests. Were a draft model asked for, its keys would
    carry ``draft:`` after the rank, as on vLLM (SGLang adds its ``{role}.``
    in front, which :func:`weight_checker.engines.sglang.rank_digests` takes off)."""
    # sglang: imported in the scheduler, where SGLang runs.
    from sglang.srt.utils.weight_checker import overall_checksum

    start = time.perf_counter()
    prefix = prefix_of(checker) + ("" if role == "target" else "draft:")
    checksums, nbytes = checksum_sized(walk(checker), prefix)
    seconds = time.perf_counter() - start
    logger.info(
        "weight_checker: %d tensors (%s), %d bytes in %.4f s (%.2f GB/s) on %s by the Rust core",
        len(checksums),
        role,
        nbytes,
        seconds,
        nbytes / seconds / 1e9 if seconds > 0 else 0.0,
        prefix.rstrip(":"),
    )
    return {
        "checksums": checksums,
        "per_gpu_checksum": overall_checksum(checksums),
        "parallelism_info": checker._parallelism_info(role=role).model_dump(),
    }


def blocks(checker: Any, role: str, request: list[str]) -> dict[str, Any]:
    """Block digests of the keys this rank holds of ``request`` (the block
    size, then the keys; :func:`weight_checker.hashing.blocks.worker_blocks`),
    in SGLang's answer shape: the answer as JSON under ``BLOCKS_ENTRY``. A
    bad request is an answer naming why, never an exception: every rank must
    reach SGLang's gather of the answers, or those that did would wait there
    for good."""
    prefix = prefix_of(checker) + ("" if role == "target" else "draft:")
    size, keys = (request[0], request[1:]) if request else ("", [])
    chain: Any = None
    if keys and isinstance(keys[-1], str) and keys[-1].startswith(CHAIN_ARG):
        try:
            chain = json.loads(keys[-1][len(CHAIN_ARG) :])
        except ValueError:
            chain = "not JSON"
        keys = keys[:-1]
    try:
        block_bytes = int(size)
    except ValueError:
        block_bytes = 0
    wanted = [k for k in keys if isinstance(k, str) and k.startswith(prefix)]
    if block_bytes <= 0:
        answer: dict[str, Any] = {
            "rank": prefix.rstrip(":"), "blocks": {},
            "errors": {k: f"block_bytes must be a positive integer, got {size!r}" for k in wanted or [prefix + "*"]},
        }  # fmt: skip
    else:
        held = dict(walk(checker)) if wanted else {}
        named = [(k, held[k[len(prefix) :]]) for k in wanted if k[len(prefix) :] in held]
        if chain is not None and not isinstance(chain, dict):
            errors = {k: "chain is not a JSON object" for k, _ in named}
            answer = {"rank": prefix.rstrip(":"), "blocks": {}, "errors": errors}
        else:
            answer = worker_answer(named, block_bytes, prefix.rstrip(":"), chain)
    return {
        "checksums": {BLOCKS_ENTRY: json.dumps(answer)},
        "per_gpu_checksum": "",
        "parallelism_info": checker._parallelism_info(role=role).model_dump(),
    }
