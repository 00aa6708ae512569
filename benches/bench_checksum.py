"""weight_checker.checksum against vLLM's built-in routine, side by side.

    .venv/bin/python benches/bench_checksum.py [--repeat 5]

Models are built on the CPU with random bf16 weights:
- "llama": vLLM-shaped (fused qkv / gate_up) Llama with hidden 2048,
  intermediate 5632, 8 layers, vocab 32000, kv width 512: 51 parameters, 0.98 GB;
- "small": 10,000 parameters of 4 KiB.
The reference is ``vllm.model_executor.model_loader.weight_checksum.compute_tensor_digests``
when vLLM is importable, else a faithful copy of it. Each repetition runs both,
alternating, and the median of each is reported with the ratio ours / reference
(and the best run of each). For the small tensors, each repetition also times
the scheduler alone hashing the same shapes (``_core.hash_floor``: no Python), so
that a loaded minute, which slows everything, is told apart from the binding's
own per-tensor cost.
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import time

import torch
import weight_checker
from ceiling import contention, cpu_model, describe, scheduler_choice, shani_core_gbps
from schedule_bound import describe_bounds
from torch import nn
from weight_checker import _core


def reference_digests():
    try:
        from vllm.model_executor.model_loader.weight_checksum import compute_tensor_digests

        return compute_tensor_digests, "vllm.compute_tensor_digests"
    except Exception:

        def compute_tensor_digests(model: nn.Module) -> dict[str, str]:
            return {
                name: hashlib.sha256(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy()).hexdigest()
                for name, t in model.named_parameters()
            }

        return compute_tensor_digests, "copy of vLLM's routine (vLLM not importable)"


def llama_like(hidden=2048, inter=5632, layers=8, vocab=32000, kv=512) -> nn.Module:
    torch.manual_seed(0)
    m = nn.Module()
    p = {"model.embed_tokens.weight": (vocab, hidden)}
    for i in range(layers):
        pre = f"model.layers.{i}."
        p[pre + "self_attn.qkv_proj.weight"] = (hidden + 2 * kv, hidden)
        p[pre + "self_attn.o_proj.weight"] = (hidden, hidden)
        p[pre + "mlp.gate_up_proj.weight"] = (2 * inter, hidden)
        p[pre + "mlp.down_proj.weight"] = (hidden, inter)
        p[pre + "input_layernorm.weight"] = (hidden,)
        p[pre + "post_attention_layernorm.weight"] = (hidden,)
    p["model.norm.weight"] = (hidden,)
    p["lm_head.weight"] = (vocab, hidden)
    for name, shape in p.items():
        t = torch.empty(shape, dtype=torch.bfloat16)
        t.view(torch.int16).random_(-32768, 32767)
        m.register_parameter(name.replace(".", "_"), nn.Parameter(t, requires_grad=False))
    return m


def many_small(n=10_000, nbytes=4096) -> nn.Module:
    m = nn.Module()
    for i in range(n):
        t = torch.empty(nbytes // 2, dtype=torch.bfloat16)
        t.view(torch.int16).random_(-32768, 32767)
        m.register_parameter(f"p{i}", nn.Parameter(t, requires_grad=False))
    return m


def bench(label, model, ref, repeat, ceiling, floor=None, shape_bound=False):
    """Runs reference and ours alternately ``repeat`` times (and ``floor``,
    the scheduler's hash-only time for the same shapes, when given)."""
    nbytes = sum(p.nbytes for p in model.parameters())
    count = sum(1 for _ in model.parameters())
    t_ref, t_ours, t_floor = [], [], []
    want = got = None
    for _ in range(repeat):
        # The previous results are freed here, not inside the timed calls.
        want = got = None
        s = time.perf_counter()
        want = ref(model)
        t_ref.append(time.perf_counter() - s)
        s = time.perf_counter()
        got = weight_checker.checksum(model)
        t_ours.append(time.perf_counter() - s)
        if floor is not None:
            t_floor.append(floor())
    assert got == want, "digests differ from the reference"
    r, o = statistics.median(t_ref), statistics.median(t_ours)
    print(f"\n{label}: {count} tensors, {nbytes / 1e9:.3f} GB (median of {repeat}; best in the last column)")
    print(f"  on {cpu_model()}; {scheduler_choice()}")
    print(f"  assignment: {_core.describe_assignment([p.nbytes for p in model.parameters()])}")
    print(f"  {'':28} {'seconds':>9} {'GB/s':>7} {'us/tensor':>10} {'best':>7}")

    def row(name, times):
        m = statistics.median(times)
        per, best = m / count * 1e6, min(times) / count * 1e6
        print(f"  {name:28} {m:9.4f} {nbytes / m / 1e9:7.2f} {per:10.2f} {best:7.2f}")

    row("reference", t_ref)
    row("weight_checker.checksum", t_ours)
    if t_floor:
        f = statistics.median(t_floor)
        row("hash-only floor (no Python)", t_floor)
    print(f"  ratio ours / reference: {o / r:.3f}   (speed-up {r / o:.2f}x)")
    print(f"  ours = {nbytes / o / 1e9 / ceiling:.2f} of the machine's hashing ceiling ({ceiling:.2f} GB/s)")
    if shape_bound:
        print(f"  {describe_bounds([p.nbytes for p in model.parameters()], o, _core.threads())}")
    if t_floor:
        print(
            f"  the binding adds {(o - f) / count * 1e6:.2f} us/tensor to the scheduler's own hashing of these"
            " shapes (measured in the same minute: on a loaded machine both move)"
        )
    warning = contention(shani_core_gbps())
    if warning:
        print(f"  {warning}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--only", choices=["llama", "small"])
    args = ap.parse_args()
    ref, ref_name = reference_digests()
    print(f"reference: {ref_name}; ours: kernel {_core.kernel()}, {_core.threads()} threads")
    line, ceiling = describe()
    print(line)
    if args.only in (None, "llama"):
        bench("llama-shaped bf16", llama_like(), ref, args.repeat, ceiling, shape_bound=True)
    if args.only in (None, "small"):
        # The same shapes hashed by the scheduler alone, as separate allocations.
        floor = lambda: _core.hash_floor(10_000, 4096, 1)[0]  # noqa: E731
        # Small messages have their own ceiling where the 16-lane kernel is faster.
        small_ceiling = max(ceiling, _core.calibrate_small()[0] * _core.threads())
        bench("10,000 x 4 KiB", many_small(), ref, args.repeat, small_ceiling, floor)


if __name__ == "__main__":
    main()
