"""A trainer-like process that drives vLLM in process and verifies with
weight_checker's library; run by tests/test_verify_inprocess.py.

    python tests/inprocess_verify.py MODEL_DIR {llm|async} TP

Prints one JSON object with what each case found.
"""

from __future__ import annotations

import asyncio
import json
import sys


def summary(result) -> dict:
    return {
        "match": result.match,
        "classes": result.classes(),
        "steps": [s.name for s in result.steps],
        "warnings": result.warnings,
        "key_count": result.key_count,
    }


def run_llm(model: str, tp: int) -> dict:
    import vllm
    import weight_checker

    llm = vllm.LLM(
        model=model,
        skip_tokenizer_init=True,
        enforce_eager=True,
        dtype="bfloat16",
        max_model_len=256,
        tensor_parallel_size=tp,
    )
    out: dict = {}
    good = weight_checker.verify(llm, transfer=lambda: llm.collective_rpc("reload_weights"))
    out["good"] = summary(good)
    noop = weight_checker.verify(llm, transfer=lambda: None)
    out["noop"] = summary(noop)
    try:
        noop.raise_for_mismatch()
        out["raised"] = None
    except weight_checker.WeightMismatchError as e:
        out["raised"] = str(e)
    llm.collective_rpc("reload_weights")
    # An engine left zeroed by a failed update: the next run says so.
    llm.collective_rpc("weight_checker_reset")
    zeroed = weight_checker.verify(llm, transfer=lambda: llm.collective_rpc("reload_weights"))
    out["zeroed"] = summary(zeroed)
    out["replicas"] = weight_checker.replicas(llm).to_json()
    params = vllm.SamplingParams(max_tokens=4)
    gen = llm.generate([{"prompt_token_ids": [1, 2, 3, 4]}], params)
    out["generated"] = len(gen[0].outputs[0].token_ids)
    return out


async def run_async(model: str, tp: int) -> dict:
    import vllm
    import weight_checker
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    args = AsyncEngineArgs(
        model=model,
        skip_tokenizer_init=True,
        enforce_eager=True,
        dtype="bfloat16",
        max_model_len=256,
        tensor_parallel_size=tp,
    )
    engine = AsyncLLM.from_engine_args(args)
    out: dict = {}
    try:

        async def reload() -> None:
            await engine.collective_rpc("reload_weights")

        out["good"] = summary(await weight_checker.verify_async(engine, transfer=reload))
        out["paused_after"] = await engine.is_paused()
        noop = await weight_checker.verify_async(engine, transfer=lambda: None)
        out["noop"] = summary(noop)
        try:
            noop.raise_for_mismatch()
            out["raised"] = None
        except weight_checker.WeightMismatchError as e:
            out["raised"] = str(e)
        await engine.collective_rpc("reload_weights")
        params = vllm.SamplingParams(max_tokens=4)
        final = None
        async for o in engine.generate({"prompt_token_ids": [1, 2, 3, 4]}, params, request_id="after-verify"):
            final = o
        out["generated"] = len(final.outputs[0].token_ids)
    finally:
        engine.shutdown()
    return out


def main() -> None:
    model, mode, tp = sys.argv[1], sys.argv[2], int(sys.argv[3])
    out = run_llm(model, tp) if mode == "llm" else asyncio.run(run_async(model, tp))
    print("RESULT " + json.dumps(out))


if __name__ == "__main__":
    main()
