"""One rank of a tiny FSDP2 trainer on a gloo CPU mesh (run by
tests/test_collective.py, one process a rank, torchrun's environment):
loads the checkpoint, shards every layer with ``fully_shard``, optionally
takes one real optimizer step, then asks for the engine's expected digests
collectively from its shards (no gather).

Without ``--server``, rank 0 writes them, with the whole-tensor path's
digests of the same weights (gathered here only to be the oracle), to the
JSON file named on the command line; ``--like URL``: both for the engine
that server runs (an SGLang one too: then run in SGLang's environment). ``PERTURB_RANK``: that rank zeroes its
first row of layer 0's ``down_proj`` after the oracle's gather.

With ``--server URL WORKERS`` (a real vLLM server of this checkpoint with the
tests' gloo transfer engine, ``WORKERS`` ranks), the expected digests are the
server's (``like=URL``), and the trainer updates it: every rank gathers each
tensor for the send (as a trainer's send does), rank 0 broadcasts them to the
engine's workers through vLLM's own sync client and ``verify`` checks the
update against the shards' digests. Then ``PERTURB_RANK`` zeroes its first
row of layer 0's ``down_proj`` and the same weights are sent and verified
again. Rank 0 writes both verdicts, and the keys that a whole-tensor oracle
(the gathered, perturbed weights) says differ.

    python tests/fsdp_worker.py CHECKPOINT OUT.json TP STEPS [PERTURB_RANK] [--server URL WORKERS | --like URL]
"""

from __future__ import annotations

import json
import sys
from typing import Any

DOWN = "model.layers.0.mlp.down_proj.weight"


def main() -> None:
    argv = sys.argv[1:]
    server = like = None
    if "--server" in argv:
        at = argv.index("--server")
        server, argv = (argv[at + 1], int(argv[at + 2])), argv[:at] + argv[at + 3 :]
    if "--like" in argv:
        at = argv.index("--like")
        like, argv = argv[at + 1], argv[:at] + argv[at + 2 :]
    ckpt, out, tp, steps = argv[0], argv[1], int(argv[2]), int(argv[3])
    perturb = int(argv[4]) if len(argv) > 4 else None
    import torch
    import torch.distributed as dist
    import transformers
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    for _ in range(steps):  # a real step: forward, backward, reduce-scattered gradients, update
        tokens = torch.randint(0, model.config.vocab_size, (2, 16))
        model(input_ids=tokens, labels=tokens).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    weights = model.state_dict()  # DTensors, Shard(0): fp32 masters
    if server:
        result = against_server(ckpt, weights, tp, perturb, rank, server)
    else:
        result = against_oracle(ckpt, weights, tp, perturb, rank, like)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(result, f)
    dist.destroy_process_group()


def zero_first_row(weights: dict) -> None:
    """This rank's first row of one layer's down_proj, zeroed in place."""
    import torch

    with torch.no_grad():
        weights[DOWN].to_local()[0].fill_(0)


def against_oracle(ckpt: str, weights: dict, tp: int, perturb: int | None, rank: int, like: str | None) -> dict:
    import torch
    import weight_checker

    # The oracle's gather, before any perturbation: what the engine must hold.
    whole = {n: t.full_tensor().bfloat16() for n, t in weights.items()}
    if perturb is not None and rank == perturb:
        zero_first_row(weights)
    # The public call: sharded weights make it collective; fp32 masters are
    # cast to the engine's bf16 where each piece lies. ``like``: the engine a
    # server runs (vLLM or SGLang: its family, layout and dtype read from it).
    layout = {"like": like} if like else {"tp": tp}
    got = weight_checker.expected_digests(None if like else ckpt, weights, **layout)
    # A trainer's next steps: the same shards (the layout kept), then new
    # bytes in them (every shard doubled in place: exact in bf16).
    again = weight_checker.expected_digests(None if like else ckpt, weights, **layout)
    with torch.no_grad():
        for t in weights.values():
            t.to_local().mul_(2)
    stepped = weight_checker.expected_digests(None if like else ckpt, weights, weight_version="2", **layout)
    if rank != 0:
        return {}
    oracle = weight_checker.expected_digests(None if like else ckpt, whole, **layout)
    doubled = weight_checker.expected_digests(None if like else ckpt, {n: t * 2 for n, t in whole.items()}, **layout)
    held = {n: t.to_local().shape[0] for n, t in weights.items()}
    return {"got": dict(got), "oracle": dict(oracle), "exchanged": got.bytes_exchanged, "rows": held,
            "batches": got.batches, "again": dict(again), "stepped": dict(stepped), "doubled": dict(doubled),
            "layout_seconds": [r.seconds.get("layout") for r in (got, again, stepped)],
            "load_seconds": [r.seconds.get("load") for r in (got, again, stepped)],
            "versions": [again.weight_version, stepped.weight_version]}  # fmt: skip


def against_server(ckpt: str, weights: dict, _tp: int, perturb: int | None, rank: int, server: tuple) -> dict:
    import torch.distributed as dist
    import weight_checker
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
    from weight_checker.testing.gloo_engine import GlooTrainer, GlooTrainerInitInfo
    from weight_checker.testing.launch import free_port

    url, workers = server
    # The engine's layout and dtype are the server's; nothing is gathered.
    expected = weight_checker.expected_digests(None, weights, like=url)
    trainer = None
    if rank == 0:
        info = GlooTrainerInitInfo(master_address="127.0.0.1", master_port=free_port(), world_size=1 + workers, rank=0)
        trainer = GlooTrainer.trainer_init(info, client=HTTPVLLMWeightSyncClient(url))

    def send_and_verify(version: str) -> tuple[dict, Any]:
        sent = {n: t.full_tensor().bfloat16() for n, t in weights.items()}  # the send's own gather, every rank
        if trainer is None:
            return sent, None
        verdict = weight_checker.verify(url, lambda: trainer.send_weights(sent.items(), weight_version=version),
                                        expected=expected)  # fmt: skip
        return sent, verdict

    _, good = send_and_verify("fsdp-step")
    if perturb is not None and rank == perturb:
        zero_first_row(weights)
    dist.barrier()
    sent, bad = send_and_verify("fsdp-step-perturbed")
    if trainer is None:
        return {}
    trainer.shutdown()
    oracle = weight_checker.expected_digests(None, sent, like=url)
    before = weight_checker.expected_digests(None, ckpt, like=url)  # the checkpoint the server started from
    return {
        "expected": dict(expected),
        "before": dict(before),
        "exchanged": expected.bytes_exchanged,
        "good": {"match": good.match, "keys": good.key_count, "mismatches": good.mismatches},
        "bad": {"match": bad.match, "keys": bad.key_count, "mismatches": bad.mismatches},
        "oracle_differs": sorted(k for k in expected if expected[k] != oracle[k]),
    }


if __name__ == "__main__":
    main()
