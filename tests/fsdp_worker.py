"""One rank of a tiny FSDP2 trainer on a gloo CPU mesh (run by
tests/test_collective.py, one process a rank, torchrun's environment):
loads the checkpoint, shards every layer with ``fully_shard``, optionally
takes one real optimizer step, then asks for the engine's expected digests
collectively from its shards (no gather). Rank 0 writes them, with the
whole-tensor path's digests of the same weights (gathered here only to be
the oracle), to the JSON file named on the command line. ``PERTURB_RANK``: that rank
zeroes its first row of layer 0's ``down_proj`` after the oracle's gather.

    python tests/fsdp_worker.py CHECKPOINT OUT.json TP STEPS [PERTURB_RANK]
"""

from __future__ import annotations

import json
import sys


def main() -> None:
    ckpt, out, tp, steps = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    perturb = int(sys.argv[5]) if len(sys.argv) > 5 else None
    import torch
    import torch.distributed as dist
    import transformers
    import weight_checker
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
    # The oracle's gather, before any perturbation: what the engine must hold.
    whole = {n: t.full_tensor().bfloat16() for n, t in weights.items()}
    if perturb is not None and rank == perturb:
        local = weights["model.layers.0.mlp.down_proj.weight"].to_local()
        with torch.no_grad():
            local[0].fill_(0)  # this rank's first row of one layer's down_proj
    # The public call: sharded weights make it collective; fp32 masters are
    # cast to the engine's bf16 where each piece lies.
    got = weight_checker.expected_digests(ckpt, weights, tp=tp)
    if rank == 0:
        oracle = weight_checker.expected_digests(ckpt, whole, tp=tp)
        held = {n: t.to_local().shape[0] for n, t in weights.items()}
        result = {"got": dict(got), "oracle": dict(oracle), "exchanged": got.bytes_exchanged, "rows": held}
        with open(out, "w") as f:
            json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
