"""expected_digests hashes the weights where they lie instead of copying them
into each rank's parameters (``weight_checker.expected.vllm.deferred``). Every
result here is compared with its oracle: the same computation with every
write done for real (the mode switched off), or hashlib over the bytes the
writes leave; test_expected.py compares both with real engines."""

from __future__ import annotations

import hashlib

import pytest
import torch
import weight_checker
from weight_checker import _core
from weight_checker.expected.vllm import deferred
from weight_checker.expected.vllm.deferred import DeferredWrites, PendingDigests
from weight_checker.testing.launch import vllm_available
from weight_checker.testing.models import write_tiny_llama


def sha(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().contiguous().view(-1).view(torch.uint8).numpy()).hexdigest()


class Layout(torch.nn.Module):
    """Three parameters bound to one arena, as a rank's are."""

    def __init__(self, arena: torch.Tensor):
        super().__init__()
        sizes = {"qkv": (6, 8), "o": (8, 4), "norm": (8,)}
        offset = 0
        for name, shape in sizes.items():
            n = torch.Size(shape).numel() * 2
            view = arena[offset : offset + n].view(torch.bfloat16).view(shape)
            self.register_parameter(name, torch.nn.Parameter(view, requires_grad=False))
            offset += -(-n // 64) * 64


def weights(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "q": torch.randn(2, 8, generator=g).bfloat16(),
        "k": torch.randn(2, 8, generator=g).bfloat16(),
        "v": torch.randn(2, 8, generator=g).bfloat16(),
        "o": torch.randn(8, 8, generator=g).bfloat16(),  # the rank's shard: its first 4 columns
        "norm": torch.randn(8, generator=g).bfloat16(),
    }


def load(model: Layout, w: dict[str, torch.Tensor], between=None, after=None) -> None:
    """A loader as vLLM's: narrowed copies, a shard along the last dimension."""
    with torch.no_grad():
        for i, name in enumerate("qkv"):
            model.qkv.data.narrow(0, 2 * i, 2).copy_(w[name])
        if between is not None:
            between(model, w)
        model.o.data.copy_(w["o"].narrow(1, 0, 4))
        model.norm.data.copy_(w["norm"])
        if after is not None:
            after(model, w)


def run(between=None, seed: int = 0, after=None) -> tuple[dict[str, str], dict[str, str], DeferredWrites]:
    """(the digests with the writes deferred, the oracle's)."""
    arena = torch.full((512,), 0xAB, dtype=torch.uint8)  # stale bytes, never to be hashed
    model = Layout(arena)
    w = weights(seed)
    writes = DeferredWrites(arena, list(model.parameters()))
    for name, t in w.items():
        writes.note_source(name, t)
    with writes:
        load(model, w, between, after)
    later = PendingDigests()
    got = writes.checksum(model, "p:", later)
    got.update(later.finish())
    real = Layout(torch.full((512,), 0xAB, dtype=torch.uint8))
    load(real, weights(seed), between, after)
    return got, {"p:" + n: sha(p) for n, p in real.named_parameters()}, writes


def test_plain_copies_are_hashed_from_the_weights_not_the_arena():
    got, want, writes = run()
    assert got == want
    assert writes.replayed_bytes == 0
    assert writes.in_place_bytes == sum(p.nbytes for p in Layout(torch.empty(512, dtype=torch.uint8)).parameters())


def test_an_operation_that_reads_the_arena_makes_every_pending_write_real_first():
    seen = []

    def read(model, w):
        seen.append(torch.equal(model.qkv, model.qkv.clone()))

    got, want, writes = run(read)
    assert got == want and seen == [True, True]  # the deferred run, then the oracle's
    assert writes.replayed_bytes == 3 * 2 * 8 * 2  # q, k and v, written before the read


def test_a_source_written_in_place_is_copied_before_it_changes():
    def scale(model, w):
        w["q"].mul_(2)  # the loader changes a weight it already copied from

    got, want, _ = run(scale)
    assert got == want


def test_a_cast_is_done_for_real_and_a_part_written_twice_or_not_at_all_is_hashed_from_the_arena():
    def odd(model, w):
        model.qkv.data.narrow(0, 0, 2).copy_(w["q"].float() * 0 + 1)  # a cast, over a deferred piece
        model.o.data.narrow(0, 0, 1).fill_(0)  # then `o` is written again below: an overlap

    got, want, writes = run(odd)
    assert got == want
    assert writes.replayed_bytes > 0


@pytest.mark.parametrize(
    "after",  # every parameter written (and pending) first
    [
        # a copy from another parameter whose own bytes are still pending
        lambda model, w: model.norm.data.copy_(model.qkv.data[0]),
        # advanced indexing and a list argument read the arena too
        lambda model, w: model.norm.data.copy_(model.qkv.data[torch.tensor([1]), :].view(-1)),
        lambda model, w: model.norm.data.copy_(torch.cat([model.qkv.data[2, :4], w["k"][0, :4]])),
        # one zero write over a whole parameter (a TP rank with no vocabulary rows), and -0.0, which is not zeros
        lambda model, w: (model.o.data.fill_(0), model.norm.data.fill_(-0.0)),
    ],
    ids=["copy-from-a-parameter", "advanced-index", "cat-of-a-list", "zero-fills"],
)
def test_what_reads_the_arena_or_is_not_zero_gives_the_real_bytes(after):
    got, want, _ = run(after=after)
    assert got == want


def test_a_parameter_only_zeroed_is_hashed_as_zeros():
    arena = torch.full((512,), 0xAB, dtype=torch.uint8)
    model = Layout(arena)
    writes = DeferredWrites(arena, list(model.parameters()))
    with writes, torch.no_grad():
        model.o.data.fill_(0)
    later = PendingDigests()
    got = writes.checksum(model, "", later)
    got.update(later.finish())
    assert got["o"] == sha(torch.zeros(8, 4, dtype=torch.bfloat16))


def recording() -> tuple[Layout, dict[str, torch.Tensor], DeferredWrites]:
    """A zeroed arena's parameters, the weights, and the mode watching them."""
    arena = torch.zeros(512, dtype=torch.uint8)
    model = Layout(arena)
    w = weights()
    writes = DeferredWrites(arena, list(model.parameters()))
    for name, t in w.items():
        writes.note_source(name, t)
    return model, w, writes


def test_a_weight_written_after_it_was_recorded_is_an_error_not_a_wrong_digest():
    from weight_checker.errors import ExpectedDigestsError

    model, w, writes = recording()
    with writes:
        load(model, w)
    later = PendingDigests()
    writes.checksum(model, "", later)
    w["o"].add_(1)  # a staging buffer refilled before the digests are made
    with pytest.raises(ExpectedDigestsError, match=r"^weight 'o': it was written while expected_digests ran"):
        later.finish()


def test_a_gap_left_by_the_loader_is_the_arena_s_bytes():
    model, w, writes = recording()
    with writes, torch.no_grad():
        model.norm.data.narrow(0, 0, 4).copy_(w["norm"][:4])  # half of it
    later = PendingDigests()
    got = writes.checksum(model, "", later)
    got.update(later.finish())
    want = torch.zeros(8, dtype=torch.bfloat16)
    want[:4] = w["norm"][:4]
    assert got["norm"] == sha(want)


def test_the_multi_hasher_reads_a_shard_s_rows_in_place():
    w = torch.randn(64, 300).bfloat16()
    shard = w[:, 100:200]
    multi = _core.MultiHasher(2)
    multi.update([(0, shard), (1, w[:2]), (1, shard)])
    both = (
        w[:2].contiguous().view(torch.uint8).numpy().tobytes() + shard.contiguous().view(torch.uint8).numpy().tobytes()
    )
    assert multi.finish()[0] == [sha(shard), hashlib.sha256(both).hexdigest()]
    with pytest.raises(BufferError, match="rows are contiguous"):
        _core.MultiHasher(1).update([(0, w.t())])


@pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed")
@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_expected_digests_equal_those_of_a_load_done_for_real(tmp_path, monkeypatch, tp, dtype):
    from safetensors.torch import load_file
    from weight_checker.expected.vllm.rank_model import release_buffers

    path = write_tiny_llama(tmp_path / "tiny")
    state = {k: v.to(dtype) for k, v in load_file(str(path / "model.safetensors")).items()}
    release_buffers()
    got = weight_checker.expected_digests(path, state.items(), tp=tp, dtype="bfloat16")
    total = sum(v.nbytes for v in state.values())
    if dtype == torch.bfloat16:
        assert got.bytes_in_place >= 0.95 * total, "the weights are hashed where they lie"
    else:
        assert got.bytes_in_place == 0, "a cast is a real copy"
    every_write_real = lambda self, f, t, a=(), k=None: f(*a, **(k or {}))  # noqa: E731
    monkeypatch.setattr(deferred.DeferredWrites, "__torch_function__", every_write_real)
    release_buffers()
    want = weight_checker.expected_digests(path, state.items(), tp=tp, dtype="bfloat16")
    assert want.bytes_in_place == 0
    assert dict(got) == dict(want)
