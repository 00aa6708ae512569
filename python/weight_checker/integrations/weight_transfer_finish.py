"""The finish of an in-process update that hashes as it commits: :func:`finish_weight_update` and its async twin."""

from __future__ import annotations

from typing import Any

from weight_checker.errors import WeightCheckerError
from weight_checker.keys import merge_digests
from weight_checker.scope import parse_include


def finish_weight_update(llm: Any, weight_version: str | None = None, include: Any = None) -> dict[str, str]:
    """``llm.finish_weight_update(weight_version)`` for an in-process
    ``vllm.LLM``, returning the digests of the weights it committed: each
    worker finishes the update and hashes what it holds in one call (this
    package's vLLM plugin), then the version is set as vLLM sets it.
    ``include``: the scope (default: what vLLM's own checksum covers)."""
    scope = parse_include(include) if include is not None else None
    answers = llm.collective_rpc("weight_checker_finish_weight_update", args=(list(scope) if scope else None,))
    if weight_version is not None:
        llm.llm_engine.set_weight_version(weight_version)
    return _merged(answers)


async def finish_weight_update_async(
    engine: Any, weight_version: str | None = None, include: Any = None
) -> dict[str, str]:
    """:func:`finish_weight_update` for an in-process ``vllm.AsyncLLM``: every
    worker of every engine (DP ranks included)."""
    # Imported here: the endpoint module mounts the route, so it imports FastAPI (the optional
    # ``server`` extra), which the wrapper does not otherwise need.
    from weight_checker.integrations.vllm.endpoint import all_engines

    scope = parse_include(include) if include is not None else None
    answers = await all_engines(engine, "weight_checker_finish_weight_update", (list(scope) if scope else None,))
    if weight_version is not None:
        await engine.update_weight_version(weight_version)
    return _merged(answers)


def _merged(answers: Any) -> dict[str, str]:
    if isinstance(answers, list) and all(isinstance(a, dict) for a in answers):
        failed = [f"{a.get('rank', '?')}: {a['error']}" for a in answers if "error" in a]
        if failed:  # the update committed; its digests did not
            raise WeightCheckerError(f"the update committed but its digests failed: {'; '.join(failed)[:500]}")
    if not isinstance(answers, list) or not all(isinstance(a, dict) and "checksums" in a for a in answers):
        raise WeightCheckerError(f"unexpected answer from the workers' finish: {str(answers)[:200]}")
    return merge_digests(a["checksums"] for a in answers)
