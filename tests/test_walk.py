"""The walk: which tensors are covered, under which names (vLLM's walk:
named_parameters, SharedWeightParameter partitions, wrapper subclasses).

Each model is checked against two oracles: a straightforward rewrite of the
walk vLLM's checker does, and vLLM's own `compute_tensor_digests` (vLLM is
installed in the development environment; the comparison is skipped without it).
"""

from __future__ import annotations

import pytest
import torch
import weight_checker
from torch import nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from .conftest import vllm_digest

try:
    from torch.testing._internal.two_tensor import TwoTensor
except ImportError:  # pragma: no cover - older torch
    TwoTensor = None


def spec_walk(model: nn.Module) -> dict[str, str]:
    """vLLM's walk, written out plainly (duck-typed SharedWeightParameter)."""

    def leaves(name, t):
        if type(t).__name__ == "SharedWeightParameter" or any(
            c.__name__ == "SharedWeightParameter" for c in type(t).__mro__
        ):
            for i, part in t.partitions.items():
                yield from leaves(f"{name}.{i}", part)
        elif is_traceable_wrapper_subclass(t):
            for attr in t.__tensor_flatten__()[0]:
                yield from leaves(f"{name}.{attr}", getattr(t, attr))
        else:
            yield name, t

    return {n: vllm_digest(t) for name, p in model.named_parameters() for n, t in leaves(name, p)}


def vllm_reference(model: nn.Module) -> dict[str, str] | None:
    try:
        from vllm.model_executor.model_loader.weight_checksum import compute_tensor_digests
    except Exception:
        return None
    return compute_tensor_digests(model)


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(50, 8)
        self.body = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8, bias=False))
        self.head = nn.Linear(8, 50, bias=False)
        self.head.weight = self.embed.weight  # tied: appears once, as embed.weight
        self.register_buffer("rope_cache", torch.randn(4, 4))  # buffers are not covered
        self.norm = nn.LayerNorm(8)


def vllm_shared_weight_parameter(parts: dict[int, torch.Tensor]):
    """vLLM's real SharedWeightParameter (its __init__ needs a TP group)."""
    swp = pytest.importorskip("vllm.model_executor.parameter").SharedWeightParameter
    p = swp.__new__(swp)
    p.partitions = {i: nn.Parameter(t, requires_grad=False) for i, t in parts.items()}
    return p


def check(model: nn.Module, expect_names: set[str] | None = None):
    got = weight_checker.checksum(model)
    assert got == spec_walk(model)
    ref = vllm_reference(model)
    if ref is not None:
        assert got == ref
        assert list(got) == list(ref)  # same order too
    if expect_names is not None:
        assert set(got) == expect_names
    return got


def test_tied_weights_appear_once_and_buffers_are_skipped():
    got = check(Tied())
    assert "embed.weight" in got and "head.weight" not in got
    assert not any("rope_cache" in k for k in got)
    assert len(got) == len(list(Tied().named_parameters()))


def test_shared_weight_parameter_expands_partitions():
    m = nn.Module()
    m.gate_up = vllm_shared_weight_parameter({0: torch.randn(4, 3), 1: torch.randn(2)})
    m.lin = nn.Linear(3, 3)
    check(m, {"gate_up.0", "gate_up.1", "lin.weight", "lin.bias"})


@pytest.mark.skipif(TwoTensor is None, reason="torch has no TwoTensor")
def test_traceable_wrapper_subclass_expands_inner_tensors():
    m = nn.Module()
    m.q = nn.Parameter(TwoTensor(torch.randn(5, 2), torch.randn(5, 2)), requires_grad=False)
    m.plain = nn.Parameter(torch.randn(3))
    got = check(m, {"q.a", "q.b", "plain"})
    assert got["q.a"] == vllm_digest(m.q.a) and got["q.b"] == vllm_digest(m.q.b)


@pytest.mark.skipif(TwoTensor is None, reason="torch has no TwoTensor")
def test_nested_expansion():
    m = nn.Module()
    inner = TwoTensor(torch.randn(3), torch.randn(3))
    m.w = vllm_shared_weight_parameter({0: torch.randn(2), 7: torch.randn(1)})
    m.w.partitions[7] = nn.Parameter(inner, requires_grad=False)
    check(m, {"w.0", "w.7.a", "w.7.b"})


def test_mapping_and_pairs_sources_and_prefix():
    ts = {"a": torch.randn(3), "b.c": torch.arange(6).reshape(2, 3).t()}
    want = {k: vllm_digest(v) for k, v in ts.items()}
    assert weight_checker.checksum(ts) == want
    assert weight_checker.checksum(list(ts.items())) == want
    pre = weight_checker.rank_prefix(1, 0, 0, 3)
    assert weight_checker.checksum(ts, prefix=pre) == {pre + k: v for k, v in want.items()}


def test_bad_sources_raise_clear_errors():
    with pytest.raises(TypeError, match=r"nn\.Module, a mapping"):
        weight_checker.checksum(42)
    with pytest.raises(TypeError, match=r"\(name, tensor\) pairs"):
        weight_checker.checksum([("a", torch.ones(1)), "oops"])
    with pytest.raises(ValueError, match="'a' appears more than once"):
        weight_checker.checksum([("a", torch.ones(1)), ("a", torch.zeros(1))])
    with pytest.raises(TypeError, match="tensor 'x'"):
        weight_checker.checksum({"ok": torch.ones(1), "x": "not a tensor"})
    with pytest.raises(TypeError, match="prefix"):
        weight_checker.checksum({}, prefix=3)
