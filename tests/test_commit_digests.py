"""Digests as each layer commits (weight_checker.integrations.vllm.commit_digests),
driven through vLLM's own layerwise reload (record, initialize, the wrapped
weight loaders, finalize) on a small torch model, with the worker's finish
(``weight_checker_finish_weight_update``) on a stand-in worker. The oracle:
hashlib over each tensor after the finish."""

from __future__ import annotations

import hashlib
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from vllm.model_executor.model_loader.reload import layerwise
from weight_checker.integrations.vllm import commit_digests
from weight_checker.integrations.vllm.worker import (
    weight_checker_begin_update_digests,
    weight_checker_finish_weight_update,
    weight_checker_reset,
)

PREFIX = "dp0:pp0:pcp0:tp0:"


class Scaled(torch.nn.Module):
    """A layer with two parameters: it commits once both have been loaded."""

    def __init__(self, weight: torch.nn.Parameter | None = None):
        super().__init__()
        self.weight = weight if weight is not None else torch.nn.Parameter(torch.zeros(64, 32), requires_grad=False)
        self.scale = torch.nn.Parameter(torch.zeros(64), requires_grad=False)


class Worker:
    """What the plugin's worker methods use of vLLM's worker: the model, the
    key prefix, and a finish that finalizes the layerwise reload."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.model_runner = SimpleNamespace(get_model=lambda: model)
        self.parallel_config = SimpleNamespace(world_size=1, local_world_size=1, data_parallel_size_local=1)

    def _weight_checksum_prefix(self) -> str:
        return PREFIX

    def finish_weight_update(self) -> None:
        layerwise.finalize_layerwise_reload(self.model, None)


def oracle(model: torch.nn.Module) -> dict[str, str]:
    return {
        PREFIX + name: hashlib.sha256(p.detach().contiguous().view(-1).view(torch.uint8).numpy()).hexdigest()
        for name, p in model.named_parameters()
    }


def start(model: torch.nn.Module) -> None:
    """vLLM's start of a checkpoint-format update."""
    layerwise.initialize_layerwise_reload(model)


def load(model: torch.nn.Module, name: str, value: torch.Tensor) -> None:
    """One checkpoint tensor through the layer's (wrapped) weight loader, as
    a model's ``load_weights`` does."""
    module_name, _, param_name = name.rpartition(".")
    param = getattr(model.get_submodule(module_name), param_name)
    param.weight_loader(param, value)


@pytest.fixture
def model():
    m = torch.nn.ModuleDict({f"layer{i}": Scaled() for i in range(4)})
    layerwise.record_metadata_for_reloading(m)
    yield m
    commit_digests.end()


def new_values(model: torch.nn.Module, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {name: torch.randn(p.shape, generator=g) for name, p in model.named_parameters()}


def test_the_finish_gives_a_checksum_of_what_committed_and_took_the_layers_hashed_as_they_committed(model):
    worker = Worker(model)
    start(model)
    assert weight_checker_begin_update_digests(worker)["early"] is True
    session = commit_digests.current()
    values = new_values(model, 1)
    for name, value in values.items():
        load(model, name, value)
    answer = weight_checker_finish_weight_update(worker)
    assert answer["checksums"] == oracle(model)
    assert all(torch.equal(p, values[n]) for n, p in model.named_parameters())  # the update did commit
    assert session is not None and session.hashed_bytes == sum(p.nbytes for p in model.parameters())
    assert commit_digests.current() is None  # the finish ended the session


def test_a_storage_written_again_by_the_finish_after_its_layer_was_hashed_is_hashed_again(model):
    """layer0 and layer1 share one weight (tied). layer0 commits during the
    update and is hashed; layer1 gets only its weight, so it commits at the
    finish (vLLM's delayed processing) and writes the shared storage again:
    the early digest no longer holds, and the finish hashes it anew."""
    tied = torch.nn.ModuleDict({"layer0": Scaled(), "layer2": Scaled()})
    tied["layer1"] = Scaled(tied["layer0"].weight)
    layerwise.record_metadata_for_reloading(tied)
    worker = Worker(tied)
    start(tied)
    weight_checker_begin_update_digests(worker)
    session = commit_digests.current()
    g = torch.Generator().manual_seed(2)
    for layer in ("layer0", "layer2"):
        load(tied, f"{layer}.weight", torch.randn(64, 32, generator=g))
        load(tied, f"{layer}.scale", torch.randn(64, generator=g))
    second = torch.randn(64, 32, generator=g)
    load(tied, "layer1.weight", second)  # layer1's scale never comes
    answer = weight_checker_finish_weight_update(worker)
    assert torch.equal(tied["layer0"].weight, second)  # the finish wrote the shared storage last
    assert answer["checksums"] == oracle(tied)
    assert session is not None and session.hashed_bytes > 0


def test_a_reset_between_the_update_and_its_finish_drops_the_early_digests(model):
    worker = Worker(model)
    start(model)
    weight_checker_begin_update_digests(worker)
    for name, value in new_values(model, 3).items():
        load(model, name, value)
    weight_checker_reset(worker)  # zeroes in place, outside vLLM's reload
    assert commit_digests.current() is None
    answer = weight_checker_finish_weight_update(worker)
    assert answer["checksums"] == oracle(model)
    assert all(not p.any() for p in model.parameters())


def test_early_digests_never_outlive_their_start(model):
    """A session begun in one start is ended by the next start (the worker
    methods that start, reload, load or reset are wrapped), so digests of an
    abandoned update are never used by a later finish."""
    from weight_checker.integrations.vllm.worker import patch_worker_class

    class VllmWorker:
        def _start_weight_update(self, is_draft: bool = False) -> str:
            return "started"

        def reload_weights(self) -> str:
            return "reloaded"

        def load_model(self) -> str:
            return "loaded"

    patch_worker_class(VllmWorker)
    for method in ("_start_weight_update", "reload_weights", "load_model"):
        assert commit_digests.begin()
        assert commit_digests.current() is not None
        assert getattr(VllmWorker(), method)() in ("started", "reloaded", "loaded")
        assert commit_digests.current() is None, method
    # A later update of the same start keeps the session (and its digests).
    assert commit_digests.begin()
    first = commit_digests.current()
    assert commit_digests.begin() and commit_digests.current() is first


def test_a_write_the_session_saw_after_a_digest_invalidates_only_that_storage():
    session = commit_digests.CommitDigests()
    a, b = torch.arange(1000, dtype=torch.float32), torch.ones(10)
    session.committed([a, b])
    view = a[:500]  # shares a's storage
    session.stop_queueing()
    session.committed([view])  # written again after a was queued
    got = session.take([a, b, torch.ones(10)])
    assert got[0] is None
    assert got[1] == hashlib.sha256(b.numpy().tobytes()).hexdigest()
    assert got[2] is None  # another object, even with equal bytes


def load_weights(model: torch.nn.Module, weights: list[tuple[str, torch.Tensor]]) -> None:
    """What a vLLM model's ``load_weights`` does: its parameters looked up at
    each call, each loaded by its ``weight_loader`` (vLLM's default one where
    it has none)."""
    from vllm.model_executor.model_loader.weight_utils import default_weight_loader

    params = dict(model.named_parameters())
    for name, value in weights:
        param = params[name]
        getattr(param, "weight_loader", default_weight_loader)(param, value)


def test_a_committed_tensor_loaded_again_in_the_same_start_is_hashed_at_the_finish():
    """Once a layer commits, vLLM puts its own tensors back with their
    original loaders: a later ``load_weights`` of the same start (a chunk sent
    again) writes them in place, outside the layerwise copy. That write is
    counted, so the digest taken when the layer committed is not used."""
    model = torch.nn.ModuleDict({f"layer{i}": torch.nn.Linear(16, 8, bias=False) for i in range(2)})
    model.requires_grad_(False)
    layerwise.record_metadata_for_reloading(model)
    worker = Worker(model)
    start(model)
    weight_checker_begin_update_digests(worker)
    load_weights(model, [("layer0.weight", torch.full((8, 16), 1.0))])  # commits: hashed
    commit_digests.current().wait_hashed(60)  # that hash has ended before the second write
    weight_checker_begin_update_digests(worker)  # a second flagged update of the same start
    load_weights(model, [("layer0.weight", torch.full((8, 16), 2.0)), ("layer1.weight", torch.ones(8, 16))])
    answer = weight_checker_finish_weight_update(worker)
    assert float(model["layer0"].weight[0, 0]) == 2.0
    assert answer["checksums"] == oracle(model)
    commit_digests.end()


def test_a_tensor_whose_loader_cannot_count_is_hashed_at_the_finish(monkeypatch):
    """A committed tensor that cannot take the counting loader (an object
    that refuses the attribute) is not hashed early: its later in-place
    load would go unseen."""
    monkeypatch.setattr(commit_digests, "_count_loads", lambda tensor: False)
    model = torch.nn.ModuleDict({f"layer{i}": torch.nn.Linear(16, 8, bias=False) for i in range(2)})
    model.requires_grad_(False)
    layerwise.record_metadata_for_reloading(model)
    worker = Worker(model)
    start(model)
    weight_checker_begin_update_digests(worker)
    load_weights(model, [("layer0.weight", torch.full((8, 16), 1.0))])  # commits
    commit_digests.current().wait_hashed(60)
    load_weights(model, [("layer0.weight", torch.full((8, 16), 2.0)), ("layer1.weight", torch.ones(8, 16))])
    answer = weight_checker_finish_weight_update(worker)
    assert float(model["layer0"].weight[0, 0]) == 2.0
    assert answer["checksums"] == oracle(model)


def test_a_commit_that_cannot_be_followed_leaves_every_digest_to_the_finish(monkeypatch):
    """layer0 and layer1 share one weight. layer0 commits and is hashed;
    following layer1's commit fails (here: giving its weight the counting
    loader raises), so its write into the shared storage is not counted:
    the session then takes no early digest at all."""
    model = torch.nn.ModuleDict({"layer0": torch.nn.Linear(16, 8, bias=False)})
    model["layer1"] = torch.nn.Linear(16, 8, bias=False)
    model["layer1"].weight = model["layer0"].weight
    model.requires_grad_(False)
    layerwise.record_metadata_for_reloading(model)
    worker = Worker(model)
    start(model)
    weight_checker_begin_update_digests(worker)
    load_weights(model, [("layer0.weight", torch.full((8, 16), 1.0))])  # commits: hashed
    session = commit_digests.current()
    session.wait_hashed(60)

    def fails(tensor: Any) -> bool:
        raise RuntimeError("cannot wrap")

    monkeypatch.setattr(commit_digests, "_count_loads", fails)
    load_weights(model, [("layer1.weight", torch.full((8, 16), 3.0))])  # commits into the shared storage
    answer = weight_checker_finish_weight_update(worker)
    assert float(model["layer0"].weight[0, 0]) == 3.0
    assert answer["checksums"] == oracle(model)
    assert session.broken


@pytest.mark.parametrize("swap", ["old-kept", "old-freed"])
def test_a_data_swap_while_the_layer_is_hashed_is_hashed_again_at_the_finish(swap):
    """``p.data = ...`` right after a layer commits, while its 64 MiB weight
    is still being hashed: the layout is the one taken when it was queued,
    so the finish sees the swap; and the bytes being read stay allocated
    (once a use after free in the hashing thread)."""
    model = torch.nn.ModuleDict({f"layer{i}": torch.nn.Linear(4096, 4096, bias=False) for i in range(2)})
    model.requires_grad_(False)
    layerwise.record_metadata_for_reloading(model)
    worker = Worker(model)
    start(model)
    weight_checker_begin_update_digests(worker)
    load_weights(model, [("layer0.weight", torch.full((4096, 4096), 1.0))])  # commits: queued
    p0 = model["layer0"].weight
    kept = p0.data
    p0.data = torch.full((4096, 4096), 5.0)
    if swap == "old-freed":
        del kept  # the hashing thread's alias still holds those bytes
    load_weights(model, [("layer1.weight", torch.full((4096, 4096), 2.0))])
    answer = weight_checker_finish_weight_update(worker)
    assert answer["checksums"] == oracle(model)


class Gate(torch.nn.Module):
    """A MoE gate as DeepSeek-V3's: ``e_score_correction_bias`` is one of the
    tensors vLLM's reload never moves to meta nor waits for."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(8, 16), requires_grad=False)
        self.e_score_correction_bias = torch.nn.Parameter(torch.zeros(8), requires_grad=False)


def test_a_tensor_vllm_leaves_in_place_written_after_its_layer_committed_is_hashed_at_the_finish():
    model = torch.nn.ModuleDict({"gate": Gate(), "other": torch.nn.Linear(4, 4, bias=False)})
    model.requires_grad_(False)
    layerwise.record_metadata_for_reloading(model)
    worker = Worker(model)
    start(model)
    weight_checker_begin_update_digests(worker)
    g = torch.Generator().manual_seed(1)
    load_weights(model, [("gate.weight", torch.randn(8, 16, generator=g))])  # the gate commits: hashed
    commit_digests.current().wait_hashed(60)
    load_weights(model, [("gate.e_score_correction_bias", torch.randn(8, generator=g))])
    load_weights(model, [("other.weight", torch.randn(4, 4, generator=g))])
    answer = weight_checker_finish_weight_update(worker)
    assert model["gate"].e_score_correction_bias.any()
    assert answer["checksums"] == oracle(model)
    commit_digests.end()


def _dropped_weight(begin: bool) -> Any:
    """A weak reference to a committed weight of a model dropped mid-update
    (its reload state dropped with it), with or without a session begun."""
    import weakref

    model = torch.nn.ModuleDict({"layer0": torch.nn.Linear(256, 256, bias=False)})
    model.requires_grad_(False)
    layerwise.record_metadata_for_reloading(model)
    start(model)
    if begin:
        weight_checker_begin_update_digests(Worker(model))
    load_weights(model, [("layer0.weight", torch.ones(256, 256))])
    if begin:
        commit_digests.current().wait_hashed(60)  # hashed, and the session still open
    for layer in model.modules():
        layerwise.LAYERWISE_INFO.pop(layer, None)
    return weakref.ref(model["layer0"].weight)


def test_a_session_never_keeps_a_dropped_model_alive():
    import gc

    without, within = _dropped_weight(False), _dropped_weight(True)
    gc.collect()
    assert without() is None  # the control
    assert commit_digests.current() is not None and within() is None
    commit_digests.end()


def _write_in_place(kind: str, p: torch.Tensor) -> None:
    """An in-place write torch counts (the tensor's version counter), made
    the ways a user's code or a framework's hook makes them."""
    with torch.no_grad():
        if kind == "add_":
            p.add_(1)
        elif kind == "copy_-through-a-view":
            p.view(-1)[:5].copy_(torch.full((5,), 9.0))
        elif kind == "index_put_":
            p.index_put_((torch.tensor([0, 3]),), torch.full((2, p.shape[1]), -4.0))
        elif kind == "slice-assign-of-a-detached-alias":
            p.detach()[1] = 7.0
        elif kind == "another-thread":
            import threading

            writer = threading.Thread(target=lambda: p.mul_(2).add_(0.5))
            writer.start()
            writer.join()
        else:
            raise AssertionError(kind)


@pytest.mark.parametrize(
    "kind", ["add_", "copy_-through-a-view", "index_put_", "slice-assign-of-a-detached-alias", "another-thread"]
)
def test_an_in_place_write_after_a_layers_early_digest_is_hashed_again_at_the_finish(kind):
    """Issue 42: a layer hashed as it committed, then written in place by a
    plain torch op before the finish (outside vLLM's copy and the weight
    loaders): torch's version counter sends it to be hashed at the finish,
    so the finish equals a checksum taken after it and hashlib of the bytes
    held (it kept the early, stale digest before)."""
    from weight_checker.integrations.vllm.worker import weight_checker_checksums

    model = torch.nn.ModuleDict({f"layer{i}": torch.nn.Linear(16, 8, bias=False) for i in range(2)})
    model.requires_grad_(False)
    layerwise.record_metadata_for_reloading(model)
    worker = Worker(model)
    start(model)
    weight_checker_begin_update_digests(worker)
    load_weights(model, [("layer0.weight", torch.full((8, 16), 1.0))])  # commits: hashed early
    session = commit_digests.current()
    assert session is not None and session.wait_hashed(60) and session.hashed_bytes > 0
    _write_in_place(kind, model["layer0"].weight)
    load_weights(model, [("layer1.weight", torch.ones(8, 16))])
    answer = weight_checker_finish_weight_update(worker)
    assert not torch.equal(model["layer0"].weight, torch.full((8, 16), 1.0))  # the write is held
    assert answer["checksums"] == oracle(model)
    assert answer["checksums"] == weight_checker_checksums(worker)


def test_an_inference_tensor_is_never_hashed_early():
    """An inference tensor keeps no version counter: its writes could not be
    seen, so it is hashed at the finish."""
    with torch.inference_mode():
        t = torch.ones(4)
    assert commit_digests._version(t) is None
    assert commit_digests._version(torch.ones(4)) == 0


def test_a_storage_swapped_for_another_at_the_same_address_is_hashed_again():
    """``p.data = ...`` after the early digest, with a new storage at the
    very address of the one hashed (the allocator reusing a freed block; here
    two ``frombuffer`` tensors of one buffer, whose bytes changed between):
    same object, layout, version and write count, but not the memory that
    was hashed: a weak reference to that storage, expired, says so."""
    import numpy as np

    buffer = np.zeros(16 * 8, dtype=np.float32)
    model = torch.nn.ModuleDict({f"layer{i}": torch.nn.Linear(8, 16, bias=False) for i in range(2)})
    model.requires_grad_(False)
    model["layer0"].weight.data = torch.frombuffer(buffer, dtype=torch.float32).view(16, 8)
    layerwise.record_metadata_for_reloading(model)
    worker = Worker(model)
    start(model)
    weight_checker_begin_update_digests(worker)
    load_weights(model, [("layer0.weight", torch.full((16, 8), 1.0))])  # commits into the buffer: hashed early
    session = commit_digests.current()
    assert session is not None and session.wait_hashed(60) and session.hashed_bytes > 0
    p = model["layer0"].weight
    before = (p.data_ptr(), p._version)
    buffer[:] = 7.0  # the memory changes...
    p.data = torch.frombuffer(buffer, dtype=torch.float32).view(16, 8)  # ...under a new storage, same address
    assert (p.data_ptr(), p._version) == before
    load_weights(model, [("layer1.weight", torch.ones(16, 8))])
    answer = weight_checker_finish_weight_update(worker)
    assert float(p[0, 0]) == 7.0
    assert answer["checksums"] == oracle(model)
