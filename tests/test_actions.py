"""reset, compare and rank_prefix."""

from __future__ import annotations

import pytest
import torch
import weight_checker
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from .test_walk import TwoTensor, vllm_shared_weight_parameter


def model_with_everything() -> nn.Module:
    m = nn.Module()
    m.lin = nn.Linear(4, 4)
    m.emb = nn.Embedding(10, 4)
    m.tied = nn.Linear(4, 10, bias=False)
    m.tied.weight = m.emb.weight
    m.register_buffer("buf", torch.ones(3))
    m.shared = vllm_shared_weight_parameter({0: torch.randn(3), 1: torch.randn(2, 2)})
    if TwoTensor is not None:
        m.sub = nn.Parameter(TwoTensor(torch.randn(2), torch.randn(2)), requires_grad=False)
    return m


def test_reset_zeroes_exactly_the_walked_tensors():
    m = model_with_everything()
    before = weight_checker.checksum(m)
    weight_checker.reset(m)
    after = weight_checker.checksum(m)
    assert set(after) == set(before)
    assert all(after[k] != before[k] for k in before)  # every covered tensor changed
    from weight_checker.hashing.walk import collect

    for name, t in zip(*collect(m), strict=True):
        assert torch.count_nonzero(t) == 0, name
    assert torch.equal(m.buf, torch.ones(3))  # buffers untouched
    assert torch.count_nonzero(m.tied.weight) == 0  # tied: the same tensor


def test_reset_with_bad_input_changes_nothing():
    a = torch.ones(3)
    with pytest.raises(TypeError):
        weight_checker.reset({"a": a, "b": object()})
    assert torch.equal(a, torch.ones(3))


def test_compare_union_semantics():
    base = {"k1": "a", "k2": "b", "k3": "c"}
    cur = {"k1": "a", "k2": "x", "k4": "d"}
    assert weight_checker.compare(base, cur) == {"match": False, "mismatches": ["k2", "k3", "k4"]}
    assert weight_checker.compare(base, dict(base)) == {"match": True, "mismatches": []}
    assert weight_checker.compare({}, {}) == {"match": True, "mismatches": []}


def test_compare_rejects_bad_input():
    with pytest.raises(TypeError, match="baseline must be a mapping"):
        weight_checker.compare(["k"], {})
    with pytest.raises(TypeError, match="not str -> str"):
        weight_checker.compare({"k": 5}, {})


digest_maps = st.dictionaries(
    st.text(min_size=1, max_size=6), st.sampled_from(["0" * 64, "1" * 64, "2" * 64]), max_size=12
)


@given(digest_maps, digest_maps)
def test_compare_is_symmetric_difference_plus_changed(base, cur):
    r = weight_checker.compare(base, cur)
    expect = sorted((base.keys() ^ cur.keys()) | {k for k in base.keys() & cur.keys() if base[k] != cur[k]})
    assert r["mismatches"] == expect
    assert r["match"] is (not expect)


def test_rank_prefix():
    assert weight_checker.rank_prefix(0, 1, 2, 3) == "dp0:pp1:pcp2:tp3:"
    for bad in (-1, 1.0, True, "0"):
        with pytest.raises(ValueError, match="non-negative int"):
            weight_checker.rank_prefix(bad, 0, 0, 0)
