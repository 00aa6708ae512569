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
        out["explained"] = await explain_async(engine, model, tp)
        params = vllm.SamplingParams(max_tokens=4)
        final = None
        async for o in engine.generate({"prompt_token_ids": [1, 2, 3, 4]}, params, request_id="after-verify"):
            final = o
        out["generated"] = len(final.outputs[0].token_ids)
    finally:
        engine.shutdown()
    return out


async def explain_async(engine, model: str, tp: int) -> dict:
    """issue 43 on an AsyncLLM: the checkpoint pushed with the embedding
    delivered as zeros, verified against the expected digests of the
    checkpoint; the explanation asks this engine for block digests (through
    its event loop) and names the cause. The engine is reloaded after."""
    import shutil
    import tempfile
    from pathlib import Path

    import torch
    import weight_checker
    from safetensors.torch import load_file, save_file

    state = load_file(model + "/model.safetensors")
    expected = weight_checker.expected_digests(model, state, tp=tp)
    faulty = Path(tempfile.mkdtemp())
    try:
        shutil.copy(Path(model) / "config.json", faulty / "config.json")
        sent = {k: torch.zeros_like(v) if k == EMBED else v for k, v in state.items()}
        save_file(sent, str(faulty / "model.safetensors"))

        async def push() -> None:
            await engine.collective_rpc("reload_weights", kwargs={"weights_path": str(faulty)})

        result = await weight_checker.verify_async(engine, transfer=push, expected=expected)
    finally:  # reload_weights(weights_path=...) makes that folder the engine's model: back to its own
        await engine.collective_rpc("reload_weights", kwargs={"weights_path": model})
        shutil.rmtree(faulty, ignore_errors=True)
    return {
        "classes": result.classes(),
        "explanation": result.explanation.to_json() if result.explanation is not None else None,
        "warnings": result.warnings,
    }


EMBED = "model.embed_tokens.weight"


def run_transfer(model: str, tp: int) -> dict:
    """vLLM's weight-update API in process: a trainer sends one step over the
    tests' gloo engine through ``verified(llm, ...)``, then another whose
    finish is the library's :func:`finish_weight_update` (the digests of what
    it committed), compared with a checksum of the engine."""
    import torch
    import vllm
    import weight_checker
    from safetensors.torch import load_file
    from weight_checker.integrations.weight_transfer import finish_weight_update, verified
    from weight_checker.testing.gloo_engine import GlooTrainer, GlooTrainerInitInfo
    from weight_checker.testing.launch import free_port

    llm = vllm.LLM(
        model=model, skip_tokenizer_init=True, enforce_eager=True, dtype="bfloat16", max_model_len=256,
        tensor_parallel_size=tp, weight_transfer_config={"backend": "gloo"},
    )  # fmt: skip
    state = load_file(model + "/model.safetensors")
    g = torch.Generator().manual_seed(3)
    steps = [{k: (v.float() + 0.01 * torch.randn(v.shape, generator=g)).to(v.dtype) for k, v in state.items()}]
    steps.append({k: (v.float() * 1.01).to(v.dtype) for k, v in steps[0].items()})
    client = verified(llm, lambda version: weight_checker.expected_digests(model, steps[int(version)], tp=tp))
    info = GlooTrainerInitInfo(master_address="127.0.0.1", master_port=free_port(), world_size=1 + tp, rank=0)
    trainer = GlooTrainer.trainer_init(info, client=client)
    trainer.send_weights(steps[0].items(), weight_version="0")
    first = client.results[-1]
    out: dict = {"first": {"match": first.match, "keys": first.key_count, "from": first.digests_from}}

    class Library:
        """vLLM's own methods, the finish the library's."""

        def init_weight_transfer_engine(self, init_info):  # joined already
            raise AssertionError("not called")

        def start_weight_update(self):
            llm.start_weight_update()

        def update_weights(self, update_info):
            llm.update_weights({"update_info": update_info})

        def finish_weight_update(self, weight_version=None):
            out["committed"] = finish_weight_update(llm, weight_version)

    trainer.client = Library()
    trainer.send_weights(steps[1].items(), weight_version="1")
    engine = {k: v for w in llm.collective_rpc("weight_checker_checksums") for k, v in w.items()}
    out["committed_is_the_engine"] = out["committed"] == engine
    out["committed_is_expected"] = out["committed"] == dict(weight_checker.expected_digests(model, steps[1], tp=tp))
    out["version"] = llm.get_weight_version()
    trainer.shutdown()
    return out


#: The faults of ``run_explain``'s second update, each in the tensor the
#: trainer sends: (HF name, fault).
FAULTS = {
    "model.layers.0.mlp.down_proj.weight": "zeros",
    "model.embed_tokens.weight": "fp16",
    "model.layers.1.mlp.up_proj.weight": "stale-rows",
    "model.layers.1.self_attn.o_proj.weight": "transposed",
}


def run_explain(model: str, tp: int) -> dict:
    """issue 43 in process: ``verified(llm, expected)`` over vLLM's weight-update
    API (the tests' gloo engine); step 0 is sent whole, step 1 with one fault
    in each of four tensors (:data:`FAULTS`), made by the trainer as a sync
    bug would. The explanation of step 1 names each."""
    import torch
    import vllm
    import weight_checker
    from safetensors.torch import load_file
    from weight_checker.integrations.weight_transfer import verified
    from weight_checker.testing.gloo_engine import GlooTrainer, GlooTrainerInitInfo
    from weight_checker.testing.launch import free_port

    llm = vllm.LLM(
        model=model, skip_tokenizer_init=True, enforce_eager=True, dtype="bfloat16", max_model_len=256,
        tensor_parallel_size=tp, weight_transfer_config={"backend": "gloo"},
    )  # fmt: skip
    state = load_file(model + "/model.safetensors")
    g = torch.Generator().manual_seed(5)
    steps = [
        {k: (v.float() + 0.01 * torch.randn(v.shape, generator=g)).to(torch.bfloat16) for k, v in state.items()}
        for _ in range(2)
    ]
    client = verified(
        llm, lambda version: weight_checker.expected_digests(model, steps[int(version)], tp=tp), on_mismatch="warn"
    )
    info = GlooTrainerInitInfo(master_address="127.0.0.1", master_port=free_port(), world_size=1 + tp, rank=0)
    trainer = GlooTrainer.trainer_init(info, client=client)
    trainer.send_weights(steps[0].items(), weight_version="0")
    out: dict = {"first": {"match": client.results[-1].match, "explanation": client.results[-1].explanation}}
    sent = dict(steps[1])
    for name, fault in FAULTS.items():
        t = sent[name]
        if fault == "zeros":
            sent[name] = torch.zeros_like(t)
        elif fault == "fp16":
            sent[name] = t.float().half().to(t.dtype)
        elif fault == "stale-rows":
            half = t.shape[0] // 2
            sent[name] = torch.cat([t[:half], steps[0][name][half:]])
        else:
            sent[name] = t.t().contiguous()
    trainer.send_weights(sent.items(), weight_version="1")
    second = client.results[-1]
    explanation = second.explanation
    out["second"] = {
        "classes": second.classes(),
        "explanation": explanation.to_json() if explanation is not None else None,
        "warnings": second.warnings,
        "seconds": second.seconds,
    }
    trainer.shutdown()
    return out


def main() -> None:
    model, mode, tp = sys.argv[1], sys.argv[2], int(sys.argv[3])
    if mode == "explain":
        out = run_explain(model, tp)
    elif mode == "transfer":
        out = run_transfer(model, tp)
    else:
        out = run_llm(model, tp) if mode == "llm" else asyncio.run(run_async(model, tp))
    print("RESULT " + json.dumps(out))


if __name__ == "__main__":
    main()
