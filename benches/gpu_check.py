"""One prepared script for a lent GPU machine: build, check, time.

    python3 benches/gpu_check.py            # on the GPU machine, from the repo root
    python3 benches/gpu_check.py --smoke    # here, without a GPU: tiny sizes, host staging

Steps:
1. build and install weight-checker (`pip install .`, needs cargo there;
   `--no-build` uses what is installed);
2. check CUDA digests against the CPU path (and hashlib) on random tensors of
   every dtype, contiguous and not;
3. time an 8B-shaped bf16 parameter set (Llama-3-8B, vLLM-fused: ~16 GB)
   against vLLM's per-tensor `.cpu()` + hashlib routine, side by side, and
   print GB/s, the ratio and the peak pinned memory;
4. where the time goes: K (streams in flight), slots and streams per slot,
   time issuing copies, the hashing thread's time waiting for copies vs
   hashing; and staged vs direct hashing of pinned host tensors.
Results are printed and written as JSON to $OUT/gpu_check.json (or ./).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def build() -> None:
    cmd = [sys.executable, "-m", "pip", "install", "--no-build-isolation", "-q", str(ROOT)]
    print("build:", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)


def reference(t) -> str:
    import torch

    return hashlib.sha256(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy()).hexdigest()


def check_digests(device: str, results: dict) -> None:
    import torch
    from weight_checker import checksum
    from weight_checker.staging import HostCopyEngine, StagingStats, digest_staged

    dtypes = [
        torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
        torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64,
    ]  # fmt: skip
    extra = ("float8_e4m3fn", "float8_e5m2", "uint16", "uint32")
    dtypes += [getattr(torch, n) for n in extra if hasattr(torch, n)]
    g = torch.Generator().manual_seed(0)
    tensors = {}
    for dt in dtypes:
        for shape in [(), (0,), (7,), (33, 65), (3, 300, 17), (1 << 20,)]:
            n = 1
            for s in shape:
                n *= s
            size = max(n, 1) * torch.empty((), dtype=dt).element_size()
            raw = torch.randint(0, 2 if dt == torch.bool else 256, (size,), dtype=torch.uint8, generator=g)
            t = raw.view(dt)[:n].reshape(shape).to(device)
            tensors[f"{dt}.{shape}"] = t
            if t.dim() >= 2:
                tensors[f"{dt}.{shape}.T"] = t.transpose(0, -1)
                tensors[f"{dt}.{shape}.step"] = t[..., ::3]
    got = checksum(tensors)
    cpu = checksum({k: v.cpu() for k, v in tensors.items()})
    want = {k: reference(v) for k, v in tensors.items()}
    bad = sorted(k for k in want if got[k] != want[k] or cpu[k] != want[k])
    results["digest_check"] = {"tensors": len(tensors), "mismatches": bad, "device": device}
    print(
        f"digest check on {device}: {len(tensors)} tensors, {len(bad)} mismatches {bad[:5]}",
        flush=True,
    )
    if device == "cpu":  # --smoke: the staging scheduler through host copies
        stats = StagingStats()
        names = list(tensors)
        d, _ = digest_staged(
            [tensors[n] for n in names],
            names,
            engine=HostCopyEngine(pin=True),
            budget=1 << 20,
            stats=stats,
        )
        bad_staged = [n for n, x in zip(names, d, strict=True) if x != want[n]]
        results["staged_check"] = {"mismatches": bad_staged, "host_bytes": stats.host_bytes}
        print(f"host-staged check: {len(bad_staged)} mismatches", flush=True)
        bad += bad_staged
    if bad:
        raise SystemExit("digest mismatch")


def check_blocks(device: str, smoke: bool, results: dict) -> None:
    """Block digests of device tensors (issue 43's engine side) against
    hashlib of each byte range, zero blocks (scanned on the device, never
    staged) among them; an explanation whose engine holds device tensors
    names each fault; and what block digests cost against a checksum."""
    import torch
    from weight_checker.hashing.blocks import block_bytes_for, block_digests, block_ranges
    from weight_checker.verify.explain import TensorMap, Version, explain

    g = torch.Generator().manual_seed(1)
    rows, cols = (256, 192) if smoke else (4096, 14336)
    cases = {
        "random": torch.randn(rows, cols, generator=g).to(torch.bfloat16),
        "zeros": torch.zeros(rows, cols, dtype=torch.bfloat16),
        "half-zero": torch.cat([torch.zeros(rows // 2, cols), torch.randn(rows - rows // 2, cols, generator=g)]).to(
            torch.bfloat16
        ),
        "vector": torch.randn(rows * 3 + 1, generator=g),
        # Every block starts with zeros and ends with a one: read whole on the device, not zero.
        "zero-heads": torch.zeros(rows, cols, dtype=torch.bfloat16).index_fill_(1, torch.tensor([cols - 1]), 1.0),
    }
    bad = []
    for name, t in cases.items():
        size = block_bytes_for(list(t.shape), t.element_size())
        raw = t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
        want = [hashlib.sha256(raw[a:b]).hexdigest() for a, b in block_ranges(len(raw), size)]
        if block_digests([t.to(device)], [size])[0] != want:
            bad.append(name)
    # The explanation, the engine's tensors on the device.
    new = (torch.randn(rows, rows, generator=g) * 0.02).to(torch.bfloat16)
    old = (new.float() + 0.001 * torch.randn(rows, rows, generator=g)).to(torch.bfloat16)
    faults = {
        "zeros": torch.zeros_like(new),
        "version:step-11": torch.cat([new[: rows // 2], old[rows // 2 :]]),
        "transposed": new.t().contiguous(),
        "dtype-roundtrip:float16": new.float().half().bfloat16(),
    }
    key = "dp0:pp0:pcp0:tp0:w"

    def sha(t):
        return reference(t)

    named = {}
    for cause, t in faults.items():
        held = {key: t.to(device)}

        def fetch(keys, block_bytes, held=held):
            d = block_digests([held[k] for k in keys], [block_bytes] * len(keys), keys)
            return {
                k: {"digests": x, "block_bytes": block_bytes, "nbytes": held[k].numel() * held[k].element_size(),
                    "shape": list(held[k].shape), "dtype": "bfloat16"}
                for k, x in zip(keys, d, strict=True)
            }  # fmt: skip

        hist = [Version("step-11", {key: sha(old)}, TensorMap({key: old}))]
        got = explain({key: "changed"}, {key: sha(t)}, {key: sha(new)}, fetch, TensorMap({key: new}), history=hist)
        named[cause] = got.keys[key].cause
    wrong = {c: n for c, n in named.items() if c != n}
    results["blocks_check"] = {"device": device, "mismatches": bad, "causes": named, "wrong_causes": wrong}
    print(f"block digests on {device}: mismatches {bad}; causes {named}", flush=True)
    # Cost on the device: block digests of 8 x 117 MB against their checksum, and of zeros.
    n = 2 if smoke else 8
    ts = [torch.empty(rows, cols, dtype=torch.bfloat16, device=device) for _ in range(n)]
    for t in ts:
        t.view(torch.int16).random_(-32768, 32767)
    zs = [torch.zeros(rows, cols, dtype=torch.bfloat16, device=device) for _ in range(n)]
    from weight_checker import checksum

    size = block_bytes_for([rows, cols], 2)
    timing = {}
    for label, fn in [
        ("checksum_s", lambda: checksum({str(i): t for i, t in enumerate(ts)})),
        ("blocks_s", lambda: block_digests(ts, [size] * n)),
        ("checksum_zeros_s", lambda: checksum({str(i): t for i, t in enumerate(zs)})),
        ("blocks_zeros_s", lambda: block_digests(zs, [size] * n)),
    ]:
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        timing[label] = time.perf_counter() - start
    timing["bytes"] = n * rows * cols * 2
    results["blocks_timing"] = timing
    print(json.dumps(timing, indent=2), flush=True)
    if bad or wrong:
        raise SystemExit("block digest or cause mismatch")


def llama8b_shapes(scale: float = 1.0) -> dict[str, tuple[int, ...]]:
    h, inter, layers, vocab, kv = 4096, 14336, 32, 128256, 1024
    if scale != 1.0:  # --smoke: same structure, tiny
        h, inter, layers, vocab, kv = 256, 512, 2, 1000, 64
    shapes = {"model.embed_tokens.weight": (vocab, h)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "self_attn.qkv_proj.weight": (h + 2 * kv, h),
            p + "self_attn.o_proj.weight": (h, h),
            p + "mlp.gate_up_proj.weight": (2 * inter, h),
            p + "mlp.down_proj.weight": (h, inter),
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
        }
    shapes |= {"model.norm.weight": (h,), "lm_head.weight": (vocab, h)}
    return shapes


def time_model(device: str, smoke: bool, results: dict) -> None:
    import torch
    import weight_checker
    from weight_checker import staging

    shapes = llama8b_shapes(0.01 if smoke else 1.0)
    params = {}
    for name, shape in shapes.items():
        t = torch.empty(shape, dtype=torch.bfloat16, device=device)
        t.view(torch.int16).random_(-32768, 32767)
        params[name] = t
    nbytes = sum(t.numel() * t.element_size() for t in params.values())
    if device == "cuda":
        torch.cuda.synchronize()
    print(f"timing: {len(params)} tensors, {nbytes / 1e9:.2f} GB on {device}", flush=True)

    def ours():
        return weight_checker.checksum(params)

    def vllm_routine():
        return {n: reference(t) for n, t in params.items()}

    ours()  # warm-up: pinned slots, CUDA context, threads
    rows = []
    for _ in range(2 if not smoke else 1):
        s = time.perf_counter()
        want = vllm_routine()
        t_ref = time.perf_counter() - s
        s = time.perf_counter()
        got = ours()
        t_ours = time.perf_counter() - s
        assert got == want, "digests differ from vLLM's routine"
        rows.append((t_ref, t_ours))
    t_ref, t_ours = min(r[0] for r in rows), min(r[1] for r in rows)
    stats = staging.StagingStats()
    if device == "cuda":
        staging.digest_staged(list(params.values()), engine=staging.CudaCopyEngine(device), stats=stats)
    else:
        staging.digest_staged(list(params.values()), engine=staging.HostCopyEngine(), stats=stats)
    results["phases"] = {
        "streams_K": stats.streams,
        "slots": len(stats.slot_streams),
        "slot_bytes": stats.slot_bytes,
        "streams_per_slot_min": min(stats.slot_streams, default=0),
        "copy_issue_s": stats.copy_seconds,
        "hash_thread_waiting_for_copies_s": stats.wait_seconds,
        "hash_thread_hashing_s": stats.hash_seconds,
    }
    print(json.dumps(results["phases"], indent=2), flush=True)
    # Staged vs direct on pinned host tensors (a ~4 GB subset): what the
    # staging scheduler itself costs when the copy is a host memcpy.
    from weight_checker import _core

    subset, size = [], 0
    for t in params.values():
        if size > (4e9 if not smoke else 1e7):
            break
        subset.append(t.cpu().pin_memory() if device == "cuda" else t.clone())
        size += t.numel() * t.element_size()
    s = time.perf_counter()
    direct = _core.digest_many(subset)
    t_direct = time.perf_counter() - s
    s = time.perf_counter()
    staged = staging.digest_staged(subset, engine=staging.HostCopyEngine(pin=device == "cuda"))
    t_staged = time.perf_counter() - s
    assert staged == direct, "staged digests differ from direct ones"
    results["pinned_host"] = {"bytes": size, "direct_s": t_direct, "staged_s": t_staged, "ratio": t_staged / t_direct}
    print(json.dumps(results["pinned_host"], indent=2), flush=True)
    results["timing"] = {
        "tensors": len(params),
        "bytes": nbytes,
        "reference_s": t_ref,
        "ours_s": t_ours,
        "reference_GBps": nbytes / t_ref / 1e9,
        "ours_GBps": nbytes / t_ours / 1e9,
        "ratio_ours_over_reference": t_ours / t_ref,
        "peak_pinned_bytes": stats.host_bytes,
    }
    print(json.dumps(results["timing"], indent=2), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--no-build", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes; CPU is fine")
    ap.add_argument("--checks", action="store_true", help="the correctness checks only (no 16 GB timing)")
    args = ap.parse_args()
    if not args.no_build and not args.smoke:
        build()
    import torch
    import weight_checker

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not args.smoke:
        raise SystemExit("no CUDA device: run with --smoke for the CPU dry run")
    results = {
        "date": time.strftime("%Y-%m-%d"),
        "card": torch.cuda.get_device_name() if device == "cuda" else platform.processor(),
        "kernel": weight_checker.kernel(),
        "torch": torch.__version__,
    }
    results["host_cpu"] = host_cpu()
    print(f"host cpu: {results['host_cpu']}; kernel {results['kernel']}", flush=True)
    out = Path(os.environ.get("OUT", "."))
    try:
        check_digests(device, results)
        check_blocks(device, args.smoke, results)
        if not args.checks:
            time_model(device, args.smoke, results)
    finally:
        (out / "gpu_check.json").write_text(json.dumps(results, indent=2))


def host_cpu() -> str:
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    fields = {k.strip(): v.strip() for k, v in (line.split(":", 1) for line in info.splitlines() if ":" in line)}
    flags = fields.get("flags", "").split()
    name, family, model = fields.get("model name", "?"), fields.get("cpu family", "?"), fields.get("model", "?")
    return (
        f"{name} (family {family} model {model}), {os.cpu_count()} cpus, "
        f"sha_ni={'sha_ni' in flags}, avx512f={'avx512f' in flags}"
    )


if __name__ == "__main__":
    main()
