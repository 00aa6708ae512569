"""Expected digests from dim-0 shards at trainer world 2 (collective, no
gather), against the whole-tensor path on one rank, on a ~1 GB Llama-shaped
bf16 checkpoint (bench_quantized.py's).

    .venv/bin/python benches/bench_collective.py [--repeat 3] [--node-per-rank] [--tp 2]

Two processes on a gloo group each hold their rows of every tensor
(``LocalShard`` views of the checkpoint's mapping: FSDP2's ``Shard(0)``
split) and call ``expected_digests`` collectively at TP=1 (``--tp 2``: TP=2); rank 0 also times
the whole-tensor path over the full tensors. Each figure is the second call
in its process (a trainer makes one per step; the layout is kept). Printed: seconds, their
ratio, the bytes of chain state sent between the ranks, and each rank's
peak resident memory during the call (VmHWM reset first: file pages of the
checkpoint it touches count too). Both ranks share this machine's cores, as
the whole-tensor path alone has them all: on a real trainer each rank has
its own. ``--node-per-rank`` gives each its own, scaled down: rank ``r``
pinned to core ``r`` with one hashing thread (``WEIGHT_CHECKER_THREADS=1``),
and the whole-tensor path on rank 0 with the same one core, as one rank of a
real trainer has the same node as any other (the issue's goal: at most 0.6x).
Neither path's figure counts a gather: the whole-tensor path is timed from
whole tensors already in memory.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

from bench_quantized import setup

RANK = """
import json, os, sys, time
import torch, torch.distributed as dist
from safetensors import safe_open
import weight_checker
from weight_checker.expected.collective import LocalShard
ckpt, out, tp = sys.argv[1], sys.argv[2], int(sys.argv[3])
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
f = safe_open(os.path.join(ckpt, "model.safetensors"), "pt")
full = {n: f.get_slice(n) for n in f.keys()}
def local(n):
    shape = full[n].get_shape()
    rows = -(-shape[0] // world)
    lo, hi = min(rank * rows, shape[0]), min((rank + 1) * rows, shape[0])
    return LocalShard(full[n][lo:hi], lo, tuple(shape))
shards = {n: local(n) for n in full}
def hwm_reset():
    with open("/proc/self/clear_refs", "w") as c:
        c.write("5")
def hwm():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM"):
            return int(line.split()[1]) * 1024
result = {}
weight_checker.expected_digests(ckpt, shards, tp=tp)  # imports, the layout's first build
dist.barrier()
hwm_reset()
t = time.perf_counter()
e = weight_checker.expected_digests(ckpt, shards, tp=tp)
result["collective"] = time.perf_counter() - t
result["collective_hwm"] = hwm()
result["exchanged"] = e.bytes_exchanged
dist.barrier()
if rank == 0:
    whole = {n: f.get_tensor(n) for n in f.keys()}
    weight_checker.expected_digests(ckpt, whole, tp=tp)
    hwm_reset()
    t = time.perf_counter()
    w = weight_checker.expected_digests(ckpt, whole, tp=tp)
    result["whole"] = time.perf_counter() - t
    result["whole_hwm"] = hwm()
    result["equal"] = dict(w) == dict(e)
dist.barrier()
all_results = [None] * world
dist.all_gather_object(all_results, result)
if rank == 0:
    open(out, "w").write(json.dumps(all_results))
dist.destroy_process_group()
"""


def run(ckpt: Path, world: int, node_per_rank: bool = False, tp: int = 1) -> list[dict]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = Path(tempfile.mkdtemp(prefix="bench-collective-")) / "out.json"
    procs = []
    for rank in range(world):
        env = os.environ | {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                            "WORLD_SIZE": str(world)}  # fmt: skip
        pin = []
        if node_per_rank:
            cores = sorted(os.sched_getaffinity(0))
            env |= {"WEIGHT_CHECKER_THREADS": "1", "OMP_NUM_THREADS": "1"}
            pin = ["taskset", "-c", str(cores[rank % len(cores)])]
        procs.append(subprocess.Popen([*pin, sys.executable, "-c", RANK, str(ckpt), str(out), str(tp)], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))  # fmt: skip
    logs = [p.communicate()[0] for p in procs]
    if any(p.returncode for p in procs):
        raise SystemExit("a rank failed:\n" + "\n".join(log[-3000:] for log in logs))
    return json.loads(out.read_text())


def main() -> None:
    node_per_rank = "--node-per-rank" in sys.argv
    if node_per_rank:
        sys.argv.remove("--node-per-rank")
    tp = 1
    if "--tp" in sys.argv:
        at = sys.argv.index("--tp")
        tp = int(sys.argv[at + 1])
        del sys.argv[at : at + 2]
    how = "one core and one hashing thread a rank" if node_per_rank else "both ranks on every core"
    args, ckpt = setup(__doc__ or "", f"; trainer world 2, engine TP={tp}; {how}")
    for _ in range(args.repeat):
        ranks = run(ckpt, 2, node_per_rank, tp)
        collective = max(r["collective"] for r in ranks)
        whole = ranks[0]["whole"]
        sent = " + ".join(str(r["exchanged"]) for r in ranks)
        peaks = " / ".join(f"{r['collective_hwm'] / 1e9:.2f}" for r in ranks)
        print(
            f"  collective {collective:.2f} s = {collective / whole:.2f}x whole-tensor path {whole:.2f} s "
            f"(digests equal: {ranks[0]['equal']}); chain state sent: {sent} bytes; "
            f"peak RSS: collective {peaks} GB a rank, whole {ranks[0]['whole_hwm'] / 1e9:.2f} GB"
        )


if __name__ == "__main__":
    main()
