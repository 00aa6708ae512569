"""SGLang engines' digests from dim-0 shards, in SGLang's own environment:
run by tests/test_sglang.py as ``python tests/sglang_sharded.py ROOT``.

For each case (architecture, TP, trainer world, whether the engine runs on
the CPU, config), a tiny checkpoint is written under ROOT and its weights
given new values for every norm (Qwen3's ``q_norm`` and ``k_norm`` too: the
checkpoint's are all ones, which no mix-up would change). The layout comes
from SGLang's own loaders fed with shapes only (``engine_layout(...,
engine="sglang")``); each key is hashed from the shards of ``torch.chunk``
(FSDP2's ``Shard(0)`` split), the chain state handed from holder to holder.
Printed, one JSON object: case -> the chained digests, the whole-tensor
path's, the independent oracle's (tests/sglang_oracle.py: hashlib over the
tensors SGLang's layout gives each rank, no code of this package), the keys
that are not pieces, and whether some key's bytes span two holders; and
``refused``: the errors of the layout and of the whole-tensor path for
weights missing a ``k_proj`` and the final norm; ``staged``: whether a
callable refilling the same staging buffers for each rank gives the
oracle's digests.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import weight_checker
from safetensors.torch import load_file
from weight_checker.expected.sharded import Shard, chained_digests, segments
from weight_checker.expected.vllm.layout import engine_layout
from weight_checker.testing.sglang.models import write_tiny_sglang_model

sys.path.insert(0, str(Path(__file__).parent))
from sglang_oracle import rank_tensors, sha256

#: name -> (architecture, TP, trainer world, the engine on the CPU, config).
CASES = {
    # 1000 vocabulary rows, 64 and 128 dims: not divisible by 3; the vocabulary padded to 1024.
    "llama-tp1-world3": ("llama", 1, 3, False, {}),
    "llama-tp2-world3-cpu": ("llama", 2, 3, True, {}),
    # q/k/v biases; an MLP of 80 the CPU engine pads to 128 at TP=2 (zero columns of down_proj).
    "qwen2-tp2-world2-cpu": ("qwen2", 2, 2, True, {"intermediate_size": 80}),
    "qwen3-tp2-world4-cpu": ("qwen3", 2, 4, True, {}),
    "qwen3-tp1-world2": ("qwen3", 1, 2, False, {}),
}


def dim0_shards(weights: dict[str, torch.Tensor], world: int) -> dict[str, list[Shard]]:
    out = {}
    for name, t in weights.items():
        held, at = [], 0
        for rank, chunk in enumerate(torch.chunk(t, world, dim=0)):
            held.append(Shard(rank, at, chunk.clone()))
            at += chunk.numel()
        out[name] = held
    return out


def main() -> None:
    root = Path(sys.argv[1])
    out = {}
    g = torch.Generator().manual_seed(7)
    for case, (arch, tp, world, cpu, config) in CASES.items():
        checkpoint = write_tiny_sglang_model(root / f"{arch}-{'-'.join(f'{k}{v}' for k, v in config.items())}",
                                             arch, **config)  # fmt: skip
        weights = load_file(str(checkpoint / "model.safetensors"))
        for name, t in weights.items():
            if t.dim() == 1 and "norm" in name:
                weights[name] = (1 + torch.randn(t.shape, generator=g) * 0.1).to(t.dtype)
        engine = {"engine": "sglang", **({"device": "cpu"} if cpu else {})}
        meta = {n: t.to("meta") for n, t in weights.items()}
        layout = engine_layout(str(checkpoint), meta, expected=weight_checker.expected_digests, tp=tp, **engine)
        pieces = {k: v for k, v in layout.items() if v.runs is not None}
        shards = dim0_shards(weights, world)
        oracle = {}
        for rank in range(tp):
            held = rank_tensors(checkpoint, tp, rank, cpu_engine=cpu, weights=weights)
            oracle.update({f"dp0:pp0:pcp0:tp{rank}:{n}": sha256(t) for n, t in held.items()})
        out[case] = {
            "chained": chained_digests(pieces, shards),
            "whole": dict(weight_checker.expected_digests(str(checkpoint), weights, tp=tp, **engine)),
            "oracle": oracle,
            "not_pieces": sorted(set(layout) - set(pieces)),
            "spans_holders": any(
                len({s.rank for s in segments(k.runs, shards) if s.rank is not None}) > 1 for k in pieces.values()
            ),
        }
    # A weight the trainer left out: the layout refuses it as the
    # whole-tensor path does, naming the parameter it never wrote.
    checkpoint = write_tiny_sglang_model(root / "llama-", "llama")
    weights = load_file(str(checkpoint / "model.safetensors"))
    del weights["model.layers.0.self_attn.k_proj.weight"], weights["model.norm.weight"]
    refused = {}
    for how, call in {
        "layout": lambda: engine_layout(
            str(checkpoint), {n: t.to("meta") for n, t in weights.items()}, expected=weight_checker.expected_digests,
            tp=2, engine="sglang", device="cpu",
        ),
        "whole": lambda: weight_checker.expected_digests(str(checkpoint), weights, tp=2, engine="sglang", device="cpu"),
    }.items():  # fmt: skip
        try:
            call()
            refused[how] = None
        except weight_checker.ExpectedDigestsError as e:
            refused[how] = str(e)
    out["refused"] = refused
    # The whole-tensor path from a callable that refills the same staging
    # buffers for each rank: each rank hashed before the next call.
    checkpoint = write_tiny_sglang_model(root / "qwen2-intermediate_size80", "qwen2", intermediate_size=80)
    weights = load_file(str(checkpoint / "model.safetensors"))
    staging = {n: torch.empty_like(t) for n, t in weights.items()}

    def staged() -> dict[str, torch.Tensor]:
        for n, t in weights.items():
            staging[n].copy_(t)
        return staging

    got = weight_checker.expected_digests(str(checkpoint), staged, tp=2, engine="sglang", device="cpu")
    oracle = {}
    for rank in range(2):
        held = rank_tensors(checkpoint, 2, rank, cpu_engine=True)
        oracle.update({f"dp0:pp0:pcp0:tp{rank}:{n}": sha256(t) for n, t in held.items()})
    out["staged"] = dict(got) == oracle
    print(json.dumps(out))


if __name__ == "__main__":
    main()
