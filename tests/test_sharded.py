"""Engine digests from dim-0 shards, no tensor gathered (issue 56's layout
and chain): the layout comes from vLLM's own loaders fed with shapes only
(``expected/vllm/layout.py``), and each key's digest is hashed holder by
holder with the SHA-256 chain state handed on (``expected/sharded.py``).
Every digest is held against two oracles: the whole-tensor path
(``expected_digests`` on the gathered tensors) and hashlib over the tensor
the rank must hold (``expected_tensors``)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch
import weight_checker
from safetensors.torch import load_file
from weight_checker.errors import ExpectedDigestsError
from weight_checker.expected.recompute import expected_tensors
from weight_checker.expected.sharded import Shard, chained_digests, check_shards, segments
from weight_checker.expected.vllm.layout import Run, engine_layout
from weight_checker.testing.launch import vllm_available

EXPECTED = weight_checker.expected_digests

pytestmark = [pytest.mark.vllm, pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed")]


def dim0_shards(weights: dict[str, torch.Tensor], world: int, dtype: torch.dtype | None = None) -> dict:
    """FSDP2's Shard(0) split (torch.chunk: the last shards smaller, or
    missing where there are fewer rows than ranks), each shard a copy."""
    out = {}
    for name, t in weights.items():
        held, at = [], 0
        for rank, chunk in enumerate(torch.chunk(t, world, dim=0)):
            held.append(Shard(rank, at, chunk.to(dtype or chunk.dtype).clone()))
            at += chunk.numel()
        out[name] = held
    return out


def sha(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().contiguous().view(-1).view(torch.uint8).numpy()).hexdigest()


@pytest.mark.parametrize(
    ("family", "tp", "world"),
    [("llama", 1, 3), ("llama", 2, 2), ("tied", 2, 3), ("qwen3", 2, 2), ("phi3", 2, 3), ("mixtral", 2, 2)],
)
def test_every_key_from_shards_equals_the_whole_tensor_path_and_hashlib(models, family, tp, world):
    # llama: 3 ranks over dims not divisible by 3; tied: a padded vocabulary
    # (500 rows, zeros after them on the last TP rank) and q/k/v/o biases;
    # qwen3: q_norm and k_norm; phi3: q/k/v fused on disk; mixtral: experts.
    path = models.path(family)  # the session's checkpoints: written one at a time
    weights = load_file(str(Path(path) / "model.safetensors"))
    layout = engine_layout(str(path), {n: t.to("meta") for n, t in weights.items()}, expected=EXPECTED, tp=tp)
    whole = weight_checker.expected_digests(str(path), weights, tp=tp)
    assert set(layout) == set(whole)
    assert all(k.runs is not None for k in layout.values())
    got = chained_digests(layout, dim0_shards(weights, world))
    assert got == dict(whole)
    sample = sorted(whole)[:: max(1, len(whole) // 6)]
    tensors = expected_tensors(whole, sample)
    assert {k: sha(tensors[k][None]) for k in sample} == {k: got[k] for k in sample}
    # The chain really is handed on: some key is held by more than one rank.
    assert any(len({s.rank for s in segments(k.runs, dim0_shards(weights, world)) if s.rank is not None}) > 1
               for k in layout.values())  # fmt: skip


def test_fp32_masters_are_cast_where_they_lie(models):
    path = models.path("llama")
    masters = {n: t.float() + 1e-3 for n, t in load_file(str(Path(path) / "model.safetensors")).items()}
    # Shapes of fp32 masters the trainer sends as bf16: plain pieces.
    layout = engine_layout(
        str(path), {n: t.to("meta") for n, t in masters.items()}, expected=EXPECTED, cast_to=torch.bfloat16, tp=2
    )
    whole = weight_checker.expected_digests(str(path), {n: t.bfloat16() for n, t in masters.items()}, tp=2)
    assert chained_digests(layout, dim0_shards(masters, 2)) == dict(whole)
    # Sent as fp32 into a bf16 engine, every copy casts: no key is a plain
    # sequence of pieces, and each is refused by name, never hashed.
    casting = engine_layout(str(path), {n: t.to("meta") for n, t in masters.items()}, expected=EXPECTED, tp=2)
    assert all(k.runs is None for k in casting.values())
    first = sorted(casting)[0]
    with pytest.raises(ExpectedDigestsError, match=first.replace(".", r"\.") + ": not a sequence of pieces"):
        chained_digests({first: casting[first]}, dim0_shards(masters, 2))


def test_shards_that_do_not_tile_a_tensor_are_refused_naming_it_and_the_rank():
    t = torch.arange(12, dtype=torch.bfloat16).reshape(6, 2)
    a, b = Shard(0, 0, t[:3].clone()), Shard(1, 6, t[3:].clone())
    assert check_shards("w", [b, a], 12) == [a, b]
    with pytest.raises(ExpectedDigestsError, match=r"weight 'w': the shard of rank 1 at element 4 overlaps"):
        check_shards("w", [a, Shard(1, 4, t[2:].clone())], 12)
    gap = r"weight 'w': the shard of rank 1 at element 8 leaves elements 6\.\.8"
    with pytest.raises(ExpectedDigestsError, match=gap):
        check_shards("w", [a, Shard(1, 8, t[4:].clone())], 12)
    with pytest.raises(ExpectedDigestsError, match=r"weight 'w': the shards hold 6 of its 12 elements"):
        check_shards("w", [a], 12)
    with pytest.raises(ExpectedDigestsError, match=r"weight 'v': no rank holds a shard of it"):
        segments([Run("v", 0, 4)], {"w": [a, b]})


def test_segments_cut_runs_at_holder_boundaries_and_merge_a_holders_neighbours():
    t = torch.zeros(5, 4)
    held = {"w": [Shard(0, 0, t[:2]), Shard(1, 8, t[2:])]}
    # Columns 1..3 of every row (a TP column slice), then 3 zero bytes.
    got = segments([Run("w", 1, 2, count=5, step=4), Run(None, 0, 3)], held)
    assert [(s.rank, start, length) for s in got for start, length in s.spans()] == [
        (0, 1, 2), (0, 5, 2), (1, 9, 2), (1, 13, 2), (1, 17, 2), (None, 0, 3),
    ]  # fmt: skip
    # The rows stay one segment for each shard they lie in, not a segment a row.
    assert [(s.rank, s.rows) for s in got] == [(0, 2), (1, 3), (None, 1)]
    # A row across the boundary is cut there; the rows on either side stay whole.
    got = segments([Run("w", 2, 3, count=4, step=4)], {"w": [Shard(0, 0, t.view(-1)[:8]), Shard(1, 8, t[2:])]})
    assert [(s.rank, start, length) for s in got for start, length in s.spans()] == [
        (0, 2, 3), (0, 6, 2), (1, 8, 1), (1, 10, 3), (1, 14, 3),
    ]  # fmt: skip
    assert [s.rows for s in got] == [1, 1, 1, 2]
    # A run past the last shard is refused, never looped on.
    with pytest.raises(ExpectedDigestsError, match=r"weight 'w': elements 20\.\.21 lie past its shards"):
        segments([Run("w", 2, 3, count=5, step=4)], {"w": [Shard(0, 0, t.view(-1)[:8]), Shard(1, 8, t[2:])]})
    # A flat run across the boundary is cut there, and whole runs merge.
    got = segments([Run("w", 6, 4), Run("w", 10, 2)], held)
    assert [(s.rank, s.start, s.length) for s in got] == [(0, 6, 2), (1, 8, 4)]


def test_shards_with_a_gap_are_refused_never_hashed_from_a_neighbour():
    from weight_checker.expected.vllm.layout import KeyLayout

    t = torch.arange(8, dtype=torch.bfloat16)
    layout = {"k": KeyLayout(torch.bfloat16, (Run("w", 0, 8),))}
    whole = chained_digests(layout, {"w": [Shard(0, 0, t[:3].clone()), Shard(1, 3, t[3:].clone())]})
    assert whole == {"k": sha(t)}
    with pytest.raises(
        ExpectedDigestsError, match=r"weight 'w': the shard of rank 0 at element 4 leaves elements 0\.\.4"
    ):
        chained_digests(layout, {"w": [Shard(0, 4, t[4:].clone())]})
    with pytest.raises(
        ExpectedDigestsError, match=r"weight 'w': the shard of rank 1 at element 6 leaves elements 3\.\.6"
    ):
        chained_digests(layout, {"w": [Shard(0, 0, t[:3].clone()), Shard(1, 6, t[6:].clone())]})
    # A one-element shard may carry any stride: its bytes are still the element's.
    odd = torch.arange(8, dtype=torch.bfloat16)[7:8].as_strided((1,), (5,), 3)
    got = chained_digests(layout, {"w": [Shard(0, 0, t[:7].clone()), Shard(1, 7, odd)]})
    assert got == {"k": sha(torch.cat([t[:7], odd.reshape(1).clone()]))}
