"""The streaming feeder on real model shapes, side by side in one run.

    .venv/bin/python benches/bench_feeders.py [--repeat 3] [--no-cold] [--only a|b|c]

(a) Checkpoints: a 70B-shaped checkpoint (2 shards x 2 tensors of
    8192 x 28672 bf16, 1.88 GB; written once under .bench/feeders/).
    warm: `weight_checker.checkpoint.checksum_checkpoint` with the files in
          the page cache, against `weight_checker.sha256_many` on tensors of
          the same shapes already in memory (the scheduler's ceiling here);
    cold: the same after dropping the page cache (needs root), against a
          plain sequential read of the files after dropping it (the disk's
          ceiling here).
(b) GPU staging, CPU proxy: `staging.digest_staged(..., engine=HostCopyEngine())`
    (the device-staging scheduler with host copies) against `_core.digest_many`
    on the same tensors: a Llama-8B layer mix (3 layers, 1.31 GB bf16) and
    5,000 tensors of 4 KiB.
(c) A few large tensors: Llama-70B decoder layers in Hugging Face's layout
    (q/o 128 MiB, k/v 16 MiB, gate/up/down 448 MiB, two norms; names sorted,
    so equal tensors lie back to back), one layer and two in memory (allocated
    in file order, as a loader does) and two in one safetensors shard (3.4 GB,
    page cache), against hashlib one tensor at a time (vLLM's routine; for the
    file, over its mapping). One tensor is one stream, so the bound here is
    not only the machine's ceiling: no scheduler ends before the largest tensor
    has gone through one stream (``bound = max(bytes / ceiling, largest /
    one-stream speed)``); each figure is also given as a fraction of it.
    That bound asks for every core at its best rate and the largest tensor
    alone on a core at once, which three 448 MiB tensors on two cores cannot
    have; the shape's schedule bound (benches/schedule_bound.py, an LP over
    the calibrated rates of every lane count) is the soonest any scheduler
    of these kernels ends, and each figure is given against it too.

Each pair alternates, the median of each side is reported, with the ratio.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import mmap
import os
import statistics
import time
from pathlib import Path

import torch
import weight_checker
from ceiling import cpu_model, describe, shani_core_gbps
from schedule_bound import describe_bounds
from weight_checker import _core, staging
from weight_checker.checkpoint import checksum_checkpoint

ROOT = Path(__file__).resolve().parent.parent


def random_bf16(shape: tuple[int, ...]) -> torch.Tensor:
    t = torch.empty(shape, dtype=torch.bfloat16)
    t.view(torch.int16).random_(-32768, 32767)
    return t


SHAPE_70B = (8192, 28672)


def make_checkpoint(root: Path) -> list[Path]:
    from safetensors.torch import save_file

    root.mkdir(parents=True, exist_ok=True)
    files = [root / f"model-{i:05d}-of-00002.safetensors" for i in (1, 2)]
    stamp = root / "done"
    if not stamp.exists():
        torch.manual_seed(0)
        for i, f in enumerate(files):
            save_file({f"model.layers.{i}.mlp.{j}.weight": random_bf16(SHAPE_70B) for j in range(2)}, f)
        stamp.touch()
    return files


def drop_caches() -> bool:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def read_sequentially(files: list[Path]) -> None:
    buf = bytearray(8 << 20)
    view = memoryview(buf)
    for f in files:
        with open(f, "rb", buffering=0) as fh:
            while fh.readinto(view):
                pass


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def pair(label_a: str, fn_a, label_b: str, fn_b, repeat: int, nbytes: int, *, before=None) -> tuple[float, float]:
    """Median seconds of ``fn_a`` and ``fn_b``, alternating."""
    ta, tb = [], []
    for _ in range(repeat):
        if before:
            before()
        ta.append(timed(fn_a))
        if before:
            before()
        tb.append(timed(fn_b))
    a, b = statistics.median(ta), statistics.median(tb)
    for label, t in ((label_a, a), (label_b, b)):
        print(f"  {label:52} {t:8.3f} s {nbytes / t / 1e9:7.2f} GB/s")
    return a, b


#: One Llama-70B decoder layer as a Hugging Face checkpoint stores it (sorted names).
LAYER_70B = {
    "input_layernorm.weight": (8192,),
    "mlp.down_proj.weight": (8192, 28672),
    "mlp.gate_proj.weight": (28672, 8192),
    "mlp.up_proj.weight": (28672, 8192),
    "post_attention_layernorm.weight": (8192,),
    "self_attn.k_proj.weight": (1024, 8192),
    "self_attn.o_proj.weight": (8192, 8192),
    "self_attn.q_proj.weight": (8192, 8192),
    "self_attn.v_proj.weight": (1024, 8192),
}


def layers_70b(n: int) -> dict[str, torch.Tensor]:
    return {f"model.layers.{i}.{k}": random_bf16(shape) for i in range(n) for k, shape in LAYER_70B.items()}


def make_layer_checkpoint(root: Path) -> Path:
    from safetensors.torch import save_file

    root.mkdir(parents=True, exist_ok=True)
    path = root / "llama70b-2-layers.safetensors"
    stamp = root / "done-70b-layers"
    if not stamp.exists():
        torch.manual_seed(1)
        save_file(layers_70b(2), path)
        stamp.touch()
    return path


def hashlib_over_mapping(path: Path) -> dict[str, str]:
    """hashlib, one tensor at a time, over the file's mapping (no copy)."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        n = int.from_bytes(m[:8], "little")
        header = json.loads(m[8 : 8 + n])
        view = memoryview(m)[8 + n :]
        try:
            return {
                name: hashlib.sha256(view[meta["data_offsets"][0] : meta["data_offsets"][1]]).hexdigest()
                for name, meta in header.items()
                if name != "__metadata__"
            }
        finally:
            view.release()


def hashlib_each(tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    """vLLM's routine: hashlib, one tensor at a time."""
    return {k: hashlib.sha256(t.view(-1).view(torch.uint8).numpy()).hexdigest() for k, t in tensors.items()}


def few_large_tensors(repeat: int, ceiling: float) -> None:
    one_stream = dict(_core.calibrate())[1]
    print(
        "\n(c) A few large tensors: Llama-70B decoder layers in Hugging Face's layout"
        f" (one stream here: {one_stream:.2f} GB/s)"
    )
    path = make_layer_checkpoint(ROOT / ".bench" / "feeders")
    cases = []
    for layers in (1, 2):
        cases.append((f"{layers} layer(s) in memory", layers, None))
    cases.append(("2 layers, one shard (page cache)", 2, path))
    for label, layers, file in cases:
        if file is None:
            tensors = layers_70b(layers)
            names = list(tensors)
            sizes = [t.nbytes for t in tensors.values()]
            ref_fn = lambda t=tensors: hashlib_each(t)  # noqa: E731
            ours_fn = lambda t=tensors, n=names: dict(zip(n, weight_checker.sha256_many(list(t.values())), strict=True))  # noqa: E731
        else:
            tensors = None
            read_sequentially([file])  # into the page cache
            sizes = [nbytes for _, _, _, nbytes in _core.safetensors_tensors(str(file))]
            ref_fn = lambda f=file: hashlib_over_mapping(f)  # noqa: E731
            ours_fn = lambda f=file: checksum_checkpoint([f])  # noqa: E731
        nbytes = sum(sizes)
        print(f" {label}: {len(sizes)} tensors, {nbytes / 1e9:.2f} GB, largest {max(sizes) / 2**20:.0f} MiB")
        print(f"  on {cpu_model()}; kernel {_core.kernel()}, {_core.lanes()} lanes; {_core.describe_assignment(sizes)}")
        assert ours_fn() == ref_fn(), "digests differ from hashlib"
        ref, ours = pair("hashlib, one tensor at a time", ref_fn, "weight_checker", ours_fn, repeat, nbytes)
        by_ceiling, by_stream = nbytes / 1e9 / ceiling, max(sizes) / 1e9 / one_stream
        bound = max(by_ceiling, by_stream)
        what = "the largest tensor through one stream" if by_stream > by_ceiling else "the SHA-NI ceiling"
        print(f"  ours / hashlib = {ours / ref:.3f};  ours = {bound / ours:.2f} of the bound ({bound:.3f} s: {what})")
        print(f"  {describe_bounds(sizes, ours, _core.threads())}")
        del tensors, ref_fn, ours_fn


def llama8b_layer_mix(layers: int = 3) -> list[torch.Tensor]:
    h, inter, kv = 4096, 14336, 1024
    out = []
    for _ in range(layers):
        out += [random_bf16((h, h)), random_bf16((kv, h)), random_bf16((kv, h)), random_bf16((h, h))]
        out += [random_bf16((inter, h)), random_bf16((inter, h)), random_bf16((h, inter))]
        out += [random_bf16((h,)), random_bf16((h,))]
    return out


def checkpoint_vs_memory(repeat: int, cold: bool, ceiling: float) -> None:
    files = make_checkpoint(ROOT / ".bench" / "feeders")
    nbytes = sum(f.stat().st_size for f in files)
    rows, cols = SHAPE_70B
    print(f"\n(a) 70B-shaped checkpoint: 2 shards x 2 tensors of {rows} x {cols} bf16, {nbytes / 1e9:.2f} GB")
    memory = [random_bf16(SHAPE_70B) for _ in range(4)]
    read_sequentially(files)  # into the page cache
    ckpt, mem = pair(
        "checksum_checkpoint (page cache)",
        lambda: checksum_checkpoint(files),
        "sha256_many, same shapes in memory",
        lambda: weight_checker.sha256_many(memory),
        repeat,
        nbytes,
    )
    print(f"  warm: checkpoint / in-memory throughput = {mem / ckpt:.3f}  (goal >= 0.8)")
    print(f"  warm checkpoint = {nbytes / ckpt / 1e9 / ceiling:.2f} of the machine's hashing ceiling")
    memory.clear()
    if not cold:
        pass
    elif not drop_caches():
        print("  cold: skipped (cannot write /proc/sys/vm/drop_caches; run as root)")
    else:
        ckpt, seq = pair(
            "checksum_checkpoint (cold cache)",
            lambda: checksum_checkpoint(files),
            "plain sequential read (cold cache)",
            lambda: read_sequentially(files),
            repeat,
            nbytes,
            before=drop_caches,
        )
        print(f"  cold: checkpoint / sequential-read throughput = {seq / ckpt:.3f}  (goal >= 0.75)")


def staging_proxy(repeat: int) -> None:
    print("\n(b) GPU staging scheduler, CPU proxy (HostCopyEngine)")
    for label, tensors, goal in (
        ("Llama-8B layer mix x3", llama8b_layer_mix(), 1.5),
        ("5,000 x 4 KiB", [random_bf16((2048,)) for _ in range(5000)], 4.0),
    ):
        size = sum(t.nbytes for t in tensors)
        names = [f"t{i}" for i in range(len(tensors))]
        print(f" {label}: {len(tensors)} tensors, {size / 1e9:.3f} GB")
        staged_out = staging.digest_staged(tensors, names, engine=staging.HostCopyEngine())  # warm the slots
        assert staged_out == _core.digest_many(tensors, names), "staged digests differ"
        stats = staging.StagingStats()
        st, direct = pair(
            "staging.digest_staged(engine=HostCopyEngine())",
            lambda t=tensors, n=names: staging.digest_staged(t, n, engine=staging.HostCopyEngine()),
            "_core.digest_many",
            lambda t=tensors, n=names: _core.digest_many(t, n),
            repeat,
            size,
        )
        staging.digest_staged(tensors, names, engine=staging.HostCopyEngine(), stats=stats)
        print(
            f"  staged / direct time = {st / direct:.2f}  (goal <= {goal});  K={stats.streams}, "
            f"{len(stats.slot_streams)} slots of {stats.slot_bytes >> 20} MiB carrying {stats.slot_streams[:4]}... "
            f"streams; copies {stats.copy_seconds:.3f} s, hash thread waiting {stats.wait_seconds:.3f} s, "
            f"hashing {stats.hash_seconds:.3f} s"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--no-cold", action="store_true", help="skip the cold-cache checkpoint run")
    ap.add_argument("--only", choices=["a", "b", "c"], help="run one part")
    args = ap.parse_args()
    line, ceiling = describe()
    print(f"scheduler: {_core.streams()} messages in flight")
    print(line)
    if args.only in (None, "a"):
        checkpoint_vs_memory(args.repeat, not args.no_cold, ceiling)
    if args.only in (None, "b"):
        staging_proxy(args.repeat)
    if args.only in (None, "c"):
        # 9-18 tensors cannot keep 16 AVX-512 lanes per thread busy (the
        # scheduler keeps SHA-NI for them), so their bound is SHA-NI's.
        few_large_tensors(args.repeat, shani_core_gbps() * _core.threads())


if __name__ == "__main__":
    main()
