"""Exact or refused, whatever form the trainer's tensors take: the cases an
outside review of the deferred writes found wrong with no error (issue 35),
each against its oracle: the same weights given as a plain dict, whose
digests test_expected.py holds against real engines, or the same computation
with every copy done for real."""

from __future__ import annotations

import pytest
import torch
import weight_checker
from weight_checker.errors import ExpectedDigestsError
from weight_checker.expected.vllm import deferred
from weight_checker.expected.vllm.deferred import DeferredWrites, PendingDigests
from weight_checker.testing.launch import vllm_available
from weight_checker.testing.models import write_tiny_llama

from .test_expected_deferred import Layout, load, weights

pytestmark = pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed")

V_PROJ = "model.layers.0.self_attn.v_proj.weight"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from safetensors.torch import load_file

    path = write_tiny_llama(tmp_path_factory.mktemp("forms") / "tiny")
    return path, load_file(str(path / "model.safetensors"))


def every_copy_real(monkeypatch) -> None:
    """The oracle's computation: vLLM's loaders with every copy done as they run it."""
    real = lambda self, f, t, a=(), k=None: f(*a, **(k or {}))  # noqa: E731
    monkeypatch.setattr(deferred.DeferredWrites, "__torch_function__", real)


# --- case 1: a one-shot source is read once ---------------------------------------------------


def test_a_one_shot_generator_missing_a_shard_is_read_once_and_gives_the_digests_of_a_dict(tiny):
    """A push that misses v_proj leaves qkv_proj part-written: the rank used to be
    loaded a second time by calling the source again, which a generator could
    not give (0 digests, every key "unwritten"). A one-shot source is read once,
    into a zeroed arena: the same digests as the same pairs as a dict."""
    path, state = tiny
    pushed = {k: v for k, v in state.items() if k != V_PROJ}
    want = weight_checker.expected_digests(path, pushed, allow_unwritten=True)
    got = weight_checker.expected_digests(path, ((k, v) for k, v in pushed.items()), allow_unwritten=True)
    assert len(want) == 15 and want.unwritten == []
    assert dict(got) == dict(want) and got.unwritten == want.unwritten
    # Without allow_unwritten it is not an error either: every parameter was written, one of them in part.
    assert dict(weight_checker.expected_digests(path, iter(list(pushed.items())))) == dict(want)


# --- case 2: a staging buffer refilled outside torch ----------------------------------------------


def staged(state: dict[str, torch.Tensor], refill: str):
    """A trainer's callable that hands out one reused staging buffer, refilled for
    each tensor through torch, numpy, or ``readinto`` (as a receive would)."""
    largest = max(t.nbytes for t in state.values())

    def weights():
        buffer = torch.empty(largest, dtype=torch.uint8)
        for name, t in state.items():
            view = buffer[: t.nbytes]
            raw = t.contiguous().view(-1).view(torch.uint8)
            if refill == "torch":
                view.copy_(raw)
            elif refill == "numpy":
                view.numpy()[:] = raw.numpy()
            else:  # readinto, as from a socket or a file
                import io

                io.BytesIO(raw.numpy().tobytes()).readinto(memoryview(view.numpy()))
            yield name, view.view(t.dtype).view(t.shape)

    return weights


@pytest.mark.parametrize("refill", ["torch", "numpy", "readinto"])
def test_a_reused_staging_buffer_refilled_in_or_outside_torch_gives_the_digests_of_a_dict(tiny, refill):
    path, state = tiny
    want = weight_checker.expected_digests(path, state)
    got = weight_checker.expected_digests(path, staged(state, refill))
    assert dict(got) == dict(want)
    assert got.bytes_in_place == 0  # copied as they were read: never read again


# --- case 3: writes the mode did not see, and versions checked wherever bytes are read again -----


@pytest.mark.parametrize(
    "write",
    [
        pytest.param(lambda w: torch.nn.functional.relu(w["o"], inplace=True), id="relu-inplace"),
        pytest.param(lambda w: w["o"].view(torch.int16).numpy().__setitem__(slice(None), 0), id="numpy"),
        pytest.param(lambda w: w["o"].untyped_storage().fill_(7), id="untyped-storage"),
        pytest.param(lambda w: w["o"].mul_(3), id="mul_"),
        pytest.param(lambda w: torch.add(w["o"], 1, out=w["o"]), id="out="),
    ],
)
def test_a_source_written_by_the_loader_in_any_way_gives_the_real_loads_digests(write):
    """The loader writes a weight it was given after copying part of it: through
    an in-place functional, numpy, the raw storage. The copy made before the
    write must hold the bytes before it, as a real load's."""
    from .test_expected_deferred import run

    got, want, _ = run(after=lambda model, w: write(w))
    assert got == want


def test_a_replayed_piece_whose_weight_changed_is_an_error():
    arena = torch.zeros(512, dtype=torch.uint8)
    model = Layout(arena)
    w = weights()
    writes = DeferredWrites(arena, list(model.parameters()))
    for name, t in w.items():
        writes.note_source(name, t)
    with writes:
        load(model, w)
    w["norm"].add_(1)  # outside the load: a staging buffer refilled before the pieces are replayed
    with pytest.raises(ExpectedDigestsError, match=r"weight 'norm': it was written"):
        writes.flush()


def test_a_strided_piece_hashed_at_once_is_checked_too():
    """A single piece that is not row-contiguous (a transposed weight) is hashed at
    once from where it lies: its version is checked there too."""
    arena = torch.zeros(512, dtype=torch.uint8)
    model = Layout(arena)
    w = {"t": torch.randn(4, 8).bfloat16()}
    writes = DeferredWrites(arena, list(model.parameters()))
    writes.note_source("t", w["t"])
    with writes:
        model.o.data.copy_(w["t"].t())
    w["t"].add_(1)
    with pytest.raises(ExpectedDigestsError, match=r"weight 't': it was written"):
        writes.checksum(model, "", PendingDigests())


# --- case 5: a tied model whose checkpoint keeps a copy of lm_head ---------------------------------


def test_a_tied_models_trainer_pairs_give_its_checkpoints_digests_in_a_fresh_process(tmp_path):
    """The config ties the embeddings, the checkpoint ships an lm_head copy: the
    engine built lm_head untied and tied it again once loaded. The trainer's own
    model (tied) names no lm_head: that is not "never wrote lm_head"."""
    from safetensors.torch import load_file
    from weight_checker.expected.vllm.rank_model import release_buffers

    from .models import write_model

    path = write_model(tmp_path / "tied-copy", "tied-copy")
    trainer = {k: v for k, v in load_file(str(path / "model.safetensors")).items() if k != "lm_head.weight"}
    release_buffers()  # as in a fresh process: no model cached by an earlier call
    got = weight_checker.expected_digests(path, trainer)
    release_buffers()
    want = weight_checker.expected_digests(path)
    assert dict(got) == dict(want) and not any(k.endswith("lm_head.weight") for k in got)


# --- case 6: inference tensors -----------------------------------------------------------------


def test_inference_tensors_give_the_digests_of_plain_ones(tiny):
    path, state = tiny
    with torch.inference_mode():
        frozen = {k: v.clone() for k, v in state.items()}
    assert all(t.is_inference() for t in frozen.values())
    assert dict(weight_checker.expected_digests(path, frozen)) == dict(weight_checker.expected_digests(path, state))


# --- case 7: a weight freed while its copy is pending --------------------------------------------


def test_a_weight_freed_after_its_copy_was_recorded_is_an_error_not_a_crash():
    arena = torch.zeros(512, dtype=torch.uint8)
    model = Layout(arena)
    w = weights()
    writes = DeferredWrites(arena, list(model.parameters()))
    for name, t in w.items():
        writes.note_source(name, t)
    with writes:
        load(model, w)
    later = PendingDigests()
    writes.checksum(model, "", later)
    w["norm"].untyped_storage().resize_(0)  # how FSDP2 reshards
    with pytest.raises(ExpectedDigestsError, match=r"weight 'norm': its memory was freed"):
        later.finish()


def test_a_generator_that_frees_each_weight_once_the_next_is_asked_for_gives_the_digests_of_a_dict(tiny):
    """FSDP-style: each weight is gathered, handed out, and freed when the next is asked for."""
    path, state = tiny

    def gathered():
        for name, t in state.items():
            full = t.clone()
            yield name, full
            full.untyped_storage().resize_(0)

    assert dict(weight_checker.expected_digests(path, gathered)) == dict(weight_checker.expected_digests(path, state))


def test_a_mapping_subclass_is_read_as_it_is_iterated(tiny):
    """A dict subclass may make its items as they are asked for: read once, copied at once."""
    path, state = tiny

    class Lazy(dict):
        def items(self):
            for name in self:
                full = state[name].clone()
                yield name, full
                full.untyped_storage().resize_(0)

    got = weight_checker.expected_digests(path, Lazy.fromkeys(state))
    assert dict(got) == dict(weight_checker.expected_digests(path, state)) and got.bytes_in_place == 0


# --- case 11: tuple shard ids ------------------------------------------------------------------


def test_a_tuple_shard_id_marks_each_of_its_shards_written():
    """Qwen3.5 loads a fused on-disk tensor as shard (0, 1, 2) and the last as 3:
    the load is complete, so the rank is not loaded a second time."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.linear import MergedColumnParallelLinear
    from weight_checker.expected.vllm.load_tracker import LoadTracker
    from weight_checker.expected.vllm.rank_groups import rank_groups

    with rank_groups(0, 1, 0, 1), set_current_vllm_config(VllmConfig()):
        layer = MergedColumnParallelLinear(16, [8, 8, 8, 4], bias=False, params_dtype=torch.bfloat16)
        tracker = LoadTracker(layer)
        w = layer.weight
        with tracker:
            w.weight_loader(w, torch.ones(24, 16, dtype=torch.bfloat16), (0, 1, 2))
            assert tracker.incomplete([w]) == [w]
            w.weight_loader(w, torch.ones(4, 16, dtype=torch.bfloat16), 3)
        assert tracker.incomplete([w]) == []
    assert bool((layer.weight == 1).all())


@pytest.mark.parametrize("form", ["list", "dict-items", "generator", "callable"])
def test_every_form_equals_the_same_computation_with_every_copy_real(tiny, form, monkeypatch):
    path, state = tiny

    def given():
        pairs = list(state.items())
        return {
            "list": pairs,
            "dict-items": state.items(),
            "generator": (p for p in pairs),
            "callable": lambda: iter(pairs),
        }[form]

    got = weight_checker.expected_digests(path, given())
    every_copy_real(monkeypatch)
    want = weight_checker.expected_digests(path, given())
    assert dict(got) == dict(want) == dict(weight_checker.expected_digests(path, state))


# --- case 9: no call keeps its arguments alive ---------------------------------------------------


def test_no_call_keeps_its_weights_alive_in_a_fresh_process(tiny):
    """vLLM keeps exceptions from its imports with their tracebacks, and with
    them every frame above the import: a call that imported vLLM's modules from
    the caller's stack kept the first call's weights (and the caller's locals)
    for the life of the process. Four calls with fresh tensors, each let go."""
    import json
    import subprocess
    import sys

    path, _ = tiny
    code = f"""
import gc, json, weakref
import weight_checker
from safetensors.torch import load_file

state = load_file({str(path / "model.safetensors")!r})
def step(call):
    weights = {{k: v.clone() for k, v in state.items()}}
    refs = [weakref.ref(t) for t in weights.values()]
    weight_checker.expected_digests({str(path)!r}, weights if call % 2 else list(weights.items()))
    return refs
alive = []
for call in range(4):
    refs = step(call)
    gc.collect()
    alive.append(sum(r() is not None for r in refs))
print("ALIVE " + json.dumps(alive))
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("ALIVE ")]
    assert r.returncode == 0 and lines, r.stderr[-3000:]
    assert json.loads(lines[-1].removeprefix("ALIVE ")) == [0, 0, 0, 0]


# --- case 10: the default dtype is the calling thread's ------------------------------------------


def test_a_call_never_changes_another_threads_default_dtype(tiny):
    import threading

    from weight_checker.expected.vllm.rank_model import release_buffers

    path, state = tiny
    seen: set[torch.dtype] = set()
    stop = threading.Event()

    def other_thread() -> None:
        while not stop.is_set():
            seen.add(torch.tensor(0.5).dtype)
            seen.add(torch.get_default_dtype())
            seen.add(torch.ones(2).dtype)

    watcher = threading.Thread(target=other_thread)
    watcher.start()
    try:
        release_buffers()  # the models built anew: construction is where the default dtype counts most
        for _ in range(3):
            got = weight_checker.expected_digests(path, state, dtype="bfloat16")
    finally:
        stop.set()
        watcher.join()
    assert seen == {torch.float32}
    assert torch.get_default_dtype() == torch.float32
    release_buffers()
    assert dict(got) == dict(weight_checker.expected_digests(path, state, dtype="bfloat16"))
