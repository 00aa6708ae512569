"""The walk: which tensors are covered, under which names (vLLM's walk:
named_parameters, SharedWeightParameter partitions, wrapper subclasses).

Each model is checked against two oracles: a straightforward rewrite of the
walk vLLM's checker does, and vLLM's own `compute_tensor_digests` (vLLM is
installed in the development environment; the comparison is skipped without it).
"""

from __future__ import annotations

import sys
from collections import OrderedDict

import pytest
import torch
import weight_checker
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass
from weight_checker import _core
from weight_checker.hashing.walk import collect, expand

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


# --- The walk in the core ---------------------------------------------------
# `weight_checker.checksum` walks a torch module in Rust (`_core.checksum_module`)
# when the module uses torch's own walk. Its names, order and digests must be
# exactly those of `named_parameters()` + the Python expansion; anything it
# cannot vouch for must answer None (and checksum still be right).


def python_walk(model, prefix=""):
    names, tensors = collect(model)
    return {prefix + n: vllm_digest(t) for n, t in zip(names, tensors, strict=True)}


def core_walk(model, prefix=""):
    out = _core.checksum_module(model, expand, prefix)
    assert out is not None, "the core should walk a plain torch module"
    digests, nbytes = out
    assert nbytes == sum(t.numel() * t.element_size() for t in collect(model)[1])
    return digests


def assert_same_walk(model, prefix=""):
    got, want = core_walk(model, prefix), python_walk(model, prefix)
    assert list(got.items()) == list(want.items())  # names, digests and order
    assert weight_checker.checksum(model, prefix) == want
    return got


def test_core_walk_shared_modules_tied_parameters_and_none_entries():
    m = Tied()
    shared = nn.Linear(4, 4)
    m.a = nn.Sequential(shared, nn.Linear(4, 2))
    m.b = nn.ModuleDict({"again": shared, "x": nn.Linear(2, 2)})  # same module, second path
    m.b.x.weight = m.a[1].weight  # a parameter shared across modules (first name wins)
    m.register_parameter("absent", None)
    m.add_module("missing", None)
    got = assert_same_walk(m)
    assert "a.0.weight" in got and "b.again.weight" not in got and "b.x.weight" not in got
    assert_same_walk(m, prefix=weight_checker.rank_prefix(0, 1, 0, 2))


def test_core_walk_of_vllm_parameter_subclasses_and_expansions():
    m = nn.Module()
    m.lin = nn.Linear(3, 3)
    m.gate_up = vllm_shared_weight_parameter({0: torch.randn(4, 3), 1: torch.randn(2)})
    if TwoTensor is not None:
        m.q = nn.Parameter(TwoTensor(torch.randn(5, 2), torch.randn(5, 2)), requires_grad=False)
    param = pytest.importorskip("vllm.model_executor.parameter")
    sub = param.BasevLLMParameter.__new__(param.BasevLLMParameter, torch.randn(6))
    m.register_parameter("vllm_param", sub)
    assert_same_walk(m)


def test_core_walk_many_parameters_streams():
    # Past the streaming threshold (128 inputs), small and large mixed.
    m = nn.Module()
    for i in range(700):
        m.register_parameter(f"p{i}", nn.Parameter(torch.randn(3 if i % 50 else 300_000), requires_grad=False))
    assert_same_walk(m, prefix="dp0:pp0:pcp0:tp0:")


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_core_walk_dict_keeps_torch_order_while_digests_arrive_out_of_order(threads):
    # Helpers finish batches in any order and large tensors are hashed after
    # the stream, so digests reach the dict out of order; its keys must still
    # follow named_parameters(), as vLLM's dict does.
    _core.set_threads(threads)
    try:
        m = nn.Module()
        for i in range(600):
            n = 300_000 if i % 97 == 5 else i % 13 + 1  # 1.2 MB: not streamed
            m.register_parameter(f"p{i}", nn.Parameter(torch.randn(n), requires_grad=False))
        got, nbytes = _core.checksum_module(m, expand, "dp0:")
        assert list(got) == ["dp0:" + n for n, _ in m.named_parameters()]
        assert got == {"dp0:" + n: vllm_digest(p) for n, p in m.named_parameters()}
        assert nbytes == sum(p.nbytes for p in m.parameters())
    finally:
        _core.set_threads(0)


def test_core_walk_lets_go_of_every_tensor():
    # The core holds each tensor while its bytes may be read, then releases
    # it (streamed ones as their digests come out): no reference is left.
    m = nn.Module()
    for i in range(700):
        m.register_parameter(f"p{i}", nn.Parameter(torch.randn(3 if i % 50 else 300_000), requires_grad=False))
    before = [sys.getrefcount(p) for p in m._parameters.values()]
    _core.checksum_module(m, expand, "")
    assert [sys.getrefcount(p) for p in m._parameters.values()] == before


def test_core_walk_recognises_this_torchs_tensor_layout():
    # The walk prefetches each parameter's TensorImpl a few parameters early,
    # from the word torch's tensor object keeps its address in. Checked here
    # with ctypes against torch's own `_cdata`: if a torch upgrade moves it,
    # this fails (the prefetch is then off; digests never depend on it).
    import ctypes

    offset = _core.tensor_impl_offset()
    assert isinstance(offset, int)
    for t in (torch.randn(3), nn.Parameter(torch.randn(2, 2), requires_grad=False), torch.randn(6)[2:]):
        assert ctypes.c_size_t.from_address(id(t) + offset).value == t._cdata


def test_core_walk_prefetch_skips_what_is_not_a_plain_tensor():
    # The lookahead meets None entries, subclasses and expanded parameters
    # among many plain ones; the walk's result is unchanged.
    m = nn.Module()
    for i in range(60):
        if i % 7 == 3:
            m.register_parameter(f"p{i}", None)
        elif i % 11 == 5 and TwoTensor is not None:
            m.register_parameter(f"p{i}", nn.Parameter(TwoTensor(torch.randn(4), torch.randn(4)), requires_grad=False))
        elif i % 13 == 6:
            m.register_parameter(f"p{i}", vllm_shared_weight_parameter({0: torch.randn(3), 1: torch.randn(2)}))
        else:
            m.register_parameter(f"p{i}", nn.Parameter(torch.randn(i + 1), requires_grad=False))
    assert_same_walk(m)


def test_core_walk_duplicate_names_from_expansion_are_refused():
    m = nn.Module()
    m.w = vllm_shared_weight_parameter({0: torch.randn(2)})
    m._parameters["w.0"] = nn.Parameter(torch.randn(2))  # bypasses torch's name check
    with pytest.raises(ValueError, match=r"'w\.0' appears more than once"):
        _core.checksum_module(m, expand)
    with pytest.raises(ValueError, match=r"'w\.0' appears more than once"):
        weight_checker.checksum(m)


class OwnNamedParameters(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(2, 2)

    def named_parameters(self, *args, **kwargs):
        yield from reversed(list(super().named_parameters(*args, **kwargs)))


class OwnNamedModules(nn.Linear):
    def named_modules(self, memo=None, prefix="", remove_duplicate=True):
        yield prefix, self  # hides nothing, but is not torch's code


class EqualModules(nn.Linear):
    """Equal to each other: torch's memo then skips the second one's parameters."""

    def __eq__(self, other):
        return isinstance(other, EqualModules)

    def __hash__(self):
        return 7


class OwnGetattribute(nn.Linear):
    def __getattribute__(self, name):
        return object.__getattribute__(self, name)


def _variants():
    root_override = OwnNamedParameters()
    instance_override = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    instance_override[1].named_modules = lambda memo=None, prefix="", remove_duplicate=True: iter(())
    child_override = nn.Sequential(nn.Linear(2, 2), OwnNamedModules(2, 2))
    equal = nn.Sequential(EqualModules(2, 2), EqualModules(2, 2))
    ordered = nn.Linear(2, 2)
    ordered._parameters = OrderedDict(ordered._parameters)  # a dict subclass
    odd_key = nn.Module()
    odd_key._parameters[3] = nn.Parameter(torch.randn(2))
    not_tensor = nn.Module()
    not_tensor._parameters["x"] = "not a tensor"
    return {
        "root named_parameters": root_override,
        "child named_modules": child_override,
        "instance named_modules": instance_override,
        "__getattribute__": nn.Sequential(OwnGetattribute(2, 2)),
        "module __hash__": equal,
        "OrderedDict _parameters": ordered,
        "non-str key": odd_key,
        "non-tensor parameter": not_tensor,
    }


@pytest.mark.parametrize("case", list(_variants()))
def test_core_walk_declines_what_it_cannot_vouch_for(case):
    model = _variants()[case]
    assert _core.checksum_module(model, expand) is None
    if case == "non-str key":
        with pytest.raises(TypeError):
            weight_checker.checksum(model)  # torch itself cannot join the name
    elif case == "non-tensor parameter":
        with pytest.raises(TypeError, match="tensor 'x'"):
            weight_checker.checksum(model)
    else:
        assert weight_checker.checksum(model) == spec_walk(model)


@st.composite
def module_trees(draw):
    """Random module graphs: nested, with shared submodules, tied and absent
    parameters, and parameter subclasses."""
    pool: list[nn.Module] = []
    params: list[nn.Parameter] = []
    root = nn.Module()
    for _ in range(draw(st.integers(1, 12))):
        parent = draw(st.sampled_from([root, *pool])) if pool else root
        kind = draw(st.sampled_from(["module", "param", "tied", "shared", "none"]))
        key = f"k{len(parent._modules) + len(parent._parameters)}"
        if kind == "module" or (kind == "shared" and not pool):
            child = nn.Module()
            pool.append(child)
            parent.add_module(key, child)
        elif kind == "shared":
            parent.add_module(key, draw(st.sampled_from(pool)))
        elif kind == "tied" and params:
            parent.register_parameter(key, draw(st.sampled_from(params)))
        elif kind == "none":
            parent.register_parameter(key, None)
        else:
            n = draw(st.integers(0, 9))
            p = nn.Parameter(torch.arange(n, dtype=torch.float32) + len(params), requires_grad=False)
            params.append(p)
            parent.register_parameter(key, p)
    return root


@settings(max_examples=60, deadline=None)
@given(model=module_trees(), prefix=st.sampled_from(["", "dp1:pp0:pcp0:tp3:"]))
def test_core_walk_equals_torch_on_random_module_graphs(model, prefix):
    got = assert_same_walk(model, prefix)
    assert [k[len(prefix) :] for k in got] == [n for n, _ in model.named_parameters()]


def test_core_walk_declines_late_after_hashing_started():
    # The walk is hashed as it goes; a reason to decline found after 600
    # parameters still answers None (and checksum then walks in Python).
    m = nn.Module()
    for i in range(600):
        m.register_parameter(f"p{i}", nn.Parameter(torch.randn(8), requires_grad=False))
    late = nn.Linear(2, 2)
    late._parameters[7] = nn.Parameter(torch.randn(2))  # a non-str key, torch cannot join it
    m.late = late
    assert _core.checksum_module(m, expand) is None
    with pytest.raises(TypeError):
        weight_checker.checksum(m)
    del late._parameters[7]
    assert_same_walk(m)


def test_core_walk_expand_errors_propagate():
    m = nn.Module()
    m.register_parameter("a", nn.Parameter(torch.randn(3)))
    m.register_parameter("b", vllm_shared_weight_parameter({0: torch.randn(2)}))

    def broken(name, tensor):
        raise RuntimeError(f"cannot expand {name}")

    with pytest.raises(RuntimeError, match="cannot expand b"):
        _core.checksum_module(m, broken)
    with pytest.raises(TypeError, match=r"\(name, tensor\) pairs"):
        _core.checksum_module(m, lambda name, tensor: [("only-a-name",)])
