"""The TP amax all-reduce of quantized expected digests, reproduced across
ranks built one after another (expected/vllm/amax_reduce.py's AmaxReduce),
without vLLM: each stage's ranks reduce among themselves (at PP=2 a stage's
amaxes never reach the other's), the replacement is this thread's alone,
and a rank that calls differently is refused."""

from __future__ import annotations

import threading

import pytest
import torch
from weight_checker.errors import ExpectedDigestsError
from weight_checker.expected.vllm import amax_reduce


@pytest.fixture(autouse=True)
def no_vllm(monkeypatch):
    monkeypatch.setattr(amax_reduce, "_install", lambda: None)


def call(amax: torch.Tensor, sharded: bool = True) -> torch.Tensor:
    """What vLLM's processing calls; outside a replacement: the identity here."""
    replacement = getattr(amax_reduce._LOCAL, "replacement", None)
    return amax if replacement is None else replacement(amax, sharded)


def test_each_pipeline_stage_reduces_its_own_tp_ranks():
    reduce = amax_reduce.AmaxReduce(tp=2)
    local = {(0, 0): [1.0, 20.0], (0, 1): [10.0, 2.0], (1, 0): [5.0, 5.0], (1, 1): [3.0, 7.0]}
    for (pp, tp), values in local.items():
        with reduce.recording(pp, tp):
            call(torch.tensor(values))
            call(torch.tensor([99.0, 99.0]), sharded=False)  # a column-parallel layer: not reduced
    reduce.reduce()
    assert reduce.needed and reduce.recorded == {}
    got = {}
    for pp, tp in local:
        with reduce.for_rank(pp, tp):
            got[(pp, tp)] = call(torch.tensor(local[(pp, tp)])).tolist()
            assert call(torch.tensor([99.0, 99.0]), sharded=False).tolist() == [99.0, 99.0]
    assert got == {(0, 0): [10.0, 20.0], (0, 1): [10.0, 20.0], (1, 0): [5.0, 7.0], (1, 1): [5.0, 7.0]}


def test_the_replacement_is_this_threads_only():
    reduce = amax_reduce.AmaxReduce(tp=2)
    seen = []
    with reduce.recording(0, 0):
        other = threading.Thread(target=lambda: seen.append(getattr(amax_reduce._LOCAL, "replacement", None)))
        other.start()
        other.join()
        assert amax_reduce._LOCAL.replacement is not None
    assert seen == [None] and getattr(amax_reduce._LOCAL, "replacement", None) is None


def test_ranks_that_reduce_differently_are_refused():
    reduce = amax_reduce.AmaxReduce(tp=2)
    with reduce.recording(0, 0):
        call(torch.ones(2))
    with reduce.recording(0, 1):
        call(torch.ones(2))
        call(torch.ones(2))
    with pytest.raises(ExpectedDigestsError, match="different numbers of weight amaxes"):
        reduce.reduce()
    reduce = amax_reduce.AmaxReduce(tp=2)
    for tp in (0, 1):
        with reduce.recording(0, tp):
            call(torch.ones(2 + tp))
    with pytest.raises(ExpectedDigestsError, match="different shapes"):
        reduce.reduce()
