"""A set whose largest tensor, last in model order, ends the run (issue 50):
each path's time over the shape's bound, beside vLLM's routine, in one run.

    .venv/bin/python benches/bench_dominated.py [--repeat 3] [--big-mib 1024] [--small 8x64]

The set: ``--small`` tensors (8 x 64 MiB) then one ``--big-mib`` tensor (1
GiB), bf16, in that model order: an 8B model's ``lm_head`` on a many-core
host, in small. On two cores the big tensor's one SHA-256 chain is the
bound. Paths, each timed (median of ``--repeat``):

- in memory: ``_core.digest_many`` (the checksum's own path);
- the staging path through the CPU proxy: ``staging.digest_staged(...,
  engine=HostCopyEngine())``;
- a checkpoint of the same set (one safetensors file, in the page cache):
  ``checkpoint.checksum_checkpoint``;
- vLLM's routine: ``hashlib.sha256`` one tensor at a time.

Each is printed with its ratio to the shape's schedule bound
(benches/schedule_bound.py, this machine's calibrated rates). It imports
whichever ``weight_checker`` is first on ``sys.path``, so an older tree runs
it too (``PYTHONPATH=OLD/python``): the A/B of issue 50.
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import tempfile
import time
from pathlib import Path

import torch
from ceiling import cpu_model
from schedule_bound import describe_bounds, measured_rates, schedule_bound


def random_bf16(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    t = torch.empty(n, dtype=torch.bfloat16)
    t.view(torch.int16).random_(-32768, 32767, generator=g)
    return t


def median_time(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--big-mib", type=int, default=1024)
    ap.add_argument("--small", default="8x64", help="COUNTxMIB")
    args = ap.parse_args()
    import weight_checker
    from safetensors.torch import save_file
    from weight_checker import _core, staging
    from weight_checker.checkpoint import checksum_checkpoint

    count, mib = (int(x) for x in args.small.split("x"))
    tensors = [random_bf16(mib << 19, i) for i in range(count)] + [random_bf16(args.big_mib << 19, 99)]
    names = [f"model.layers.{i}.w" for i in range(count)] + ["lm_head.weight"]
    sizes = [t.nbytes for t in tensors]
    threads = _core.threads()
    bound = schedule_bound(sizes, measured_rates(), threads)
    print(f"package: {Path(weight_checker.__file__).parent}")
    print(f"cpu: {cpu_model()}; {threads} threads; kernel {weight_checker.kernel()}")
    print(f"set: {count} x {mib} MiB then {args.big_mib} MiB last, {sum(sizes) / 1e9:.2f} GB; bound {bound:.3f} s")
    want = [hashlib.sha256(t.view(torch.uint8).numpy()).hexdigest() for t in tensors]
    with tempfile.TemporaryDirectory(prefix="bench-dominated-", dir=Path(__file__).parent.parent) as tmp:
        path = Path(tmp) / "model.safetensors"
        save_file(dict(zip(names, tensors, strict=True)), str(path))
        checkpoint_digests = checksum_checkpoint([str(path)], prefix="")  # warm: the file is in the page cache
        assert [checkpoint_digests[n] for n in names] == want, "checkpoint digests differ"
        assert _core.digest_many(tensors, names)[0] == want, "in-memory digests differ"
        assert staging.digest_staged(tensors, names, engine=staging.HostCopyEngine())[0] == want, "staged differ"
        paths = {
            "in memory (_core.digest_many)": lambda: _core.digest_many(tensors, names),
            "staging proxy (digest_staged, HostCopyEngine)": lambda: staging.digest_staged(
                tensors, names, engine=staging.HostCopyEngine()
            ),
            "checkpoint, warm (checksum_checkpoint)": lambda: checksum_checkpoint([str(path)], prefix=""),
            "vLLM's routine (hashlib, one at a time)": lambda: [
                hashlib.sha256(t.view(torch.uint8).numpy()).hexdigest() for t in tensors
            ],
        }
        times = {label: median_time(fn, args.repeat) for label, fn in paths.items()}
    reference = times["vLLM's routine (hashlib, one at a time)"]
    for label, seconds in times.items():
        print(f"  {label:48s} {seconds:.3f} s = {seconds / bound:.2f}x the bound, {seconds / reference:.3f} of vLLM's")
    print(f"  assignment in memory: {_core.describe_assignment(sizes)}")
    staged = times["staging proxy (digest_staged, HostCopyEngine)"]
    print(f"  staging proxy: {describe_bounds(sizes, staged, threads)}")


if __name__ == "__main__":
    main()
