"""A differential fuzzer for the deferred writes of ``expected_digests``
(``weight_checker.expected.vllm.deferred``): vLLM's real loaders run twice on the
same weights, once under the deferral and once with every copy done for real
(the mode switched off), and the two must give equal digests, or the deferred
run a clear :class:`~weight_checker.ExpectedDigestsError`: never a difference.

What it draws, per example (``docs/expected.md`` lists the same):

- a tiny architecture: a dense Llama, a tied one (vocabulary padded per
  shard, one KV head), Phi-3 (q/k/v and gate/up fused on disk), Mixtral (MoE);
  TP 1 or 2;
- the form of the trainer's tensors: a dict, a list, ``dict.items()``, a
  generator (TP=1), a callable returning a list or a generator, a reused
  staging buffer refilled through torch or through numpy, inference tensors,
  strided and transposed views, fp32 tensors cast to the model's bf16;
- writes while the loader runs, between the pairs it reads: to a weight it
  was given (in place through torch, ``relu(inplace=True)``, numpy, the raw
  storage) or to the rank's parameters (through torch or numpy).

Examples are derandomized (the same ones every run): 100 in ``make test``;
``WEIGHT_CHECKER_FUZZ_EXAMPLES=N`` runs N.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import pytest
import torch
import weight_checker
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from weight_checker.errors import ExpectedDigestsError
from weight_checker.expected import weights as weights_module
from weight_checker.expected.vllm import deferred
from weight_checker.testing.launch import vllm_available

from .models import write_model

pytestmark = pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed")

ARCHITECTURES = {"dense": "llama", "tied": "tied", "fused": "phi3", "moe": "mixtral"}
FORMS = [
    "dict", "list", "items", "generator", "callable-list", "callable-generator",
    "staging-torch", "staging-numpy", "inference", "strided", "transposed", "fp32",
]  # fmt: skip
WRITES = ["none", "source-add", "source-relu", "source-numpy", "source-storage", "param-add", "param-numpy"]
EXAMPLES = int(os.environ.get("WEIGHT_CHECKER_FUZZ_EXAMPLES", "100"))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    from safetensors.torch import load_file

    root = tmp_path_factory.mktemp("fuzz")
    out = {}
    for arch, family in ARCHITECTURES.items():
        path = write_model(root / family, family)
        out[arch] = (path, load_file(str(path / "model.safetensors")))
    return out


def _strided(t: torch.Tensor) -> torch.Tensor:
    """The same values in every other element of a buffer twice as wide."""
    wide = torch.zeros(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype) if t.dim() else t.clone()
    if t.dim():
        wide[..., ::2] = t
        return wide[..., ::2]
    return wide


def _transposed(t: torch.Tensor) -> torch.Tensor:
    """The same values, stored transposed (a view whose rows are not contiguous)."""
    return t.t().contiguous().t() if t.dim() == 2 else t.clone()


def given_as(form: str, state: dict[str, torch.Tensor]) -> Any:
    """The weights of ``state`` (fresh tensors each call) in ``form``."""
    fresh = {k: v.clone() for k, v in state.items()}
    pairs = list(fresh.items())
    if form == "dict":
        return fresh
    if form == "list":
        return pairs
    if form == "items":
        return fresh.items()
    if form == "generator":
        return (p for p in pairs)
    if form == "callable-list":
        return lambda: list(pairs)
    if form == "callable-generator":
        return lambda: (p for p in pairs)
    if form in ("staging-torch", "staging-numpy"):
        largest = max(t.nbytes for t in fresh.values())

        def staged():
            buffer = torch.empty(largest, dtype=torch.uint8)
            for name, t in pairs:
                view, raw = buffer[: t.nbytes], t.contiguous().view(-1).view(torch.uint8)
                if form == "staging-torch":
                    view.copy_(raw)
                else:
                    view.numpy()[:] = raw.numpy()
                yield name, view.view(t.dtype).view(t.shape)

        return staged
    if form == "inference":
        with torch.inference_mode():
            return {k: v.clone() for k, v in fresh.items()}
    if form == "strided":
        return {k: _strided(v) for k, v in fresh.items()}
    if form == "transposed":
        return {k: _transposed(v) for k, v in fresh.items()}
    if form == "fp32":
        return {k: v.float() for k, v in fresh.items()}
    raise AssertionError(form)


def writing(write: str, at: int, rnd: Any) -> Callable[[list[Any]], None]:
    """The write done when the loader asks for pair ``at``: ``seen`` are the
    tensors handed out so far."""

    def do(seen: list[Any]) -> None:
        if write == "none" or len(seen) != at or not seen:
            return
        if write.startswith("source"):
            t = seen[rnd.randrange(len(seen))]
            if write == "source-add":
                t.add_(1)
            elif write == "source-relu":
                torch.nn.functional.relu(t, inplace=True)
            elif write == "source-numpy":
                t.view(torch.uint8).numpy()[:1] ^= 0xFF
            else:
                t.untyped_storage().fill_(3)
            return
        from weight_checker.expected.vllm.rank_model import TARGET_ARENA

        region = TARGET_ARENA.buffer[: 1 + rnd.randrange(1024)]
        if write == "param-add":
            region.add_(1)
        else:
            region.numpy()[:] ^= 0x55

    return do


@pytest.fixture
def interleave(monkeypatch):
    """Runs ``hook(seen)`` each time the loader asks for the next pair."""
    hooks: list[Callable[[list[Any]], None]] = []
    original = weights_module.Tracked.__iter__

    def tracked_iter(self):
        seen: list[Any] = []
        for name, t in original(self):
            for hook in hooks:
                hook(seen)
            seen.append(t)
            yield name, t

    monkeypatch.setattr(weights_module.Tracked, "__iter__", tracked_iter)
    return hooks


def every_copy_real(monkeypatch) -> None:
    real = lambda self, f, t, a=(), k=None: f(*a, **(k or {}))  # noqa: E731
    monkeypatch.setattr(deferred.DeferredWrites, "__torch_function__", real)


@settings(
    max_examples=EXAMPLES,
    derandomize=True,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    arch=st.sampled_from(sorted(ARCHITECTURES)),
    tp=st.sampled_from([1, 2]),
    form=st.sampled_from(FORMS),
    write=st.sampled_from(WRITES),
    at=st.integers(1, 12),
    rnd=st.randoms(use_true_random=False),
)
def test_deferred_and_real_copies_agree_or_the_deferred_run_refuses(
    checkpoints, interleave, arch, tp, form, write, at, rnd
):
    if form == "generator" and tp > 1:
        form = "list"  # a one-shot iterator is refused for several ranks (tests/test_expected_errors.py)
    path, state = checkpoints[arch]
    state_rnd = rnd.getstate()
    interleave[:] = [writing(write, at, rnd)]
    try:
        got = weight_checker.expected_digests(path, given_as(form, state), tp=tp, allow_unwritten=True)
    except ExpectedDigestsError as e:
        # A clear error, naming the weight (a write the fuzzer made may be refused by torch itself:
        # an in-place write to an inference tensor, named as the tensor the loader was reading).
        assert "weight '" in str(e) or "tensor '" in str(e), e
        return
    rnd.setstate(state_rnd)
    interleave[:] = [writing(write, at, rnd)]
    with pytest.MonkeyPatch.context() as mp:
        every_copy_real(mp)
        want = weight_checker.expected_digests(path, given_as(form, state), tp=tp, allow_unwritten=True)
    assert dict(got) == dict(want), (arch, tp, form, write, at)
    assert got.unwritten == want.unwritten
