"""Digests of tensors, arrays and bytes against hashlib (vLLM's routine)."""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import weight_checker
from hypothesis import given
from hypothesis import strategies as st
from weight_checker import _core

from .conftest import vllm_digest

EMPTY = hashlib.sha256(b"").hexdigest()


def all_dtypes() -> list[torch.dtype]:
    names = [
        "bool", "uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64",
        "float16", "bfloat16", "float32", "float64", "complex64", "complex128", "complex32",
        "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu",
    ]  # fmt: skip
    return [getattr(torch, n) for n in names if hasattr(torch, n)]


def random_tensor(shape, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Random bytes reinterpreted as `dtype` (every bit pattern, NaNs included)."""
    g = torch.Generator().manual_seed(seed)
    numel = int(np.prod(shape)) if len(shape) else 1
    itemsize = torch.empty((), dtype=dtype).element_size()
    # bool holds only 0/1 (torch's copy kernels canonicalise other bytes).
    high = 2 if dtype == torch.bool else 256
    raw = torch.randint(0, high, (numel * itemsize,), dtype=torch.uint8, generator=g)
    return raw.view(dtype).reshape(shape)


def test_nist_vectors():
    path = Path(__file__).parent / "data" / "sha256-nist.json"
    vectors = json.loads(path.read_text())["vectors"]
    msgs = [(v["message"] * v["repeat"]).encode() for v in vectors]
    assert weight_checker.sha256_many(msgs) == [v["digest"] for v in vectors]
    # The same bytes as tensors and as numpy arrays.
    tensors = [torch.frombuffer(bytearray(m), dtype=torch.uint8) if m else torch.empty(0) for m in msgs]
    assert weight_checker.sha256_many(tensors) == [v["digest"] for v in vectors]
    arrays = [np.frombuffer(m, dtype=np.uint8) for m in msgs]
    assert weight_checker.sha256_many(arrays) == [v["digest"] for v in vectors]


@pytest.mark.parametrize("dtype", all_dtypes(), ids=str)
def test_every_dtype_matches_vllm(dtype):
    for shape in [(), (0,), (1,), (7,), (3, 5), (2, 3, 33), (4096,)]:
        t = random_tensor(shape, dtype, seed=len(shape))
        assert weight_checker.sha256_many([t]) == [vllm_digest(t)], (dtype, shape)
        # Strided views of the same dtype: the digest of `.contiguous()`.
        if t.dim() >= 2:
            v = t.transpose(0, 1)
            assert weight_checker.sha256_many([v]) == [vllm_digest(v)], (dtype, shape, "T")
        if t.dim() >= 1 and t.shape[-1] > 2:
            v = t[..., 1::2]
            assert weight_checker.sha256_many([v]) == [vllm_digest(v)], (dtype, shape, "step")


def test_zero_dim_and_empty():
    scalar = torch.tensor(3.5, dtype=torch.float32)
    assert weight_checker.sha256_many([scalar]) == [hashlib.sha256(np.float32(3.5).tobytes()).hexdigest()]
    assert weight_checker.sha256_many([torch.empty(0, 5), b"", np.empty((3, 0))]) == [EMPTY] * 3


def test_views_slices_offsets_and_expand():
    base = random_tensor((64, 48), torch.bfloat16, seed=1)
    views = [
        base[3:40],  # storage offset, contiguous
        base[5],  # one row
        base[:, 7],  # a column (stride 48)
        base.t(),
        base[::3, ::2],
        base[10:20].unsqueeze(1).expand(10, 4, 48),  # stride 0
        base.view(8, 8, 48).permute(2, 0, 1),
        base.flip(0)[2:],  # flip copies; still a tensor with an offset view after slicing
        torch.as_strided(base, (5, 5), (7, 3), storage_offset=11),
    ]
    assert weight_checker.sha256_many(views) == [vllm_digest(v) for v in views]


def test_conjugate_view_hashes_its_logical_bytes():
    z = random_tensor((6, 4), torch.complex64, seed=2)
    c = z.conj()
    assert c.is_conj()
    assert weight_checker.sha256_many([c]) == [vllm_digest(c.resolve_conj())]


def test_large_tensor_and_misaligned_start():
    big = random_tensor((64 << 20,), torch.uint8, seed=3)
    assert weight_checker.sha256_many([big, big[1:], big[13:-7]]) == [
        vllm_digest(big),
        vllm_digest(big[1:]),
        vllm_digest(big[13:-7]),
    ]


def test_numpy_bytes_memoryview_bytearray():
    a = np.arange(1000, dtype=np.float64).reshape(25, 40)
    objs = [
        a,
        a.T,
        a[::2, 3:],
        a[::-1],
        bytes(range(256)),
        memoryview(b"xyz" * 100),
        bytearray(b"q" * 70),
    ]
    want = [
        hashlib.sha256(np.ascontiguousarray(o).tobytes() if isinstance(o, np.ndarray) else bytes(o)).hexdigest()
        for o in objs
    ]
    assert weight_checker.sha256_many(objs) == want


def test_many_small_tensors_take_the_streaming_path():
    # Over 128 inputs the core hashes batches while it acquires the rest;
    # mixing in large and strided ones exercises the final pass as well.
    ts = [random_tensor((n % 97,), torch.float16, seed=n) for n in range(1500)]
    ts[100] = random_tensor((3 << 20,), torch.uint8, seed=9)
    ts[700] = random_tensor((40, 30), torch.float32, seed=10).t()
    assert weight_checker.sha256_many(ts) == [vllm_digest(t) for t in ts]


@pytest.mark.parametrize("count", [127, 128, 129, 128 + 64, 128 + 65, 1000])
def test_counts_around_the_streaming_threshold_and_batch_size(count):
    # 128 inputs start the streaming path; batches close every 64.
    ts = [random_tensor((n % 300 + 1,), torch.uint8, seed=n) for n in range(count)]
    before = [sys.getrefcount(t) for t in ts]
    assert _core.sha256_many(ts) == [vllm_digest(t) for t in ts]
    assert [sys.getrefcount(t) for t in ts] == before  # every hold released


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_an_error_late_in_a_long_stream_raises_and_leaves_nothing_running(threads):
    # Helpers are hashing queued batches when input #1500 turns out bad: the
    # error names it, the helpers leave, and the next call works.
    _core.set_threads(threads)
    try:
        ts = [random_tensor((2048,), torch.uint8, seed=n) for n in range(2000)]
        bad = [*ts[:1500], object(), *ts[1500:]]
        before = [sys.getrefcount(t) for t in ts]
        with pytest.raises(TypeError, match="buffer #1500"):
            _core.sha256_many(bad)
        assert [sys.getrefcount(t) for t in ts] == before  # nothing held
        assert _core.sha256_many(ts) == [vllm_digest(t) for t in ts]
    finally:
        _core.set_threads(0)


def test_all_zero_flags():
    ts = [torch.zeros(100), torch.ones(3), torch.empty(0), torch.zeros(10, 10).t()]
    digests, zero = _core.digest_many(ts)
    assert zero == [True, False, True, True]
    assert digests == [vllm_digest(t) for t in ts]


def test_errors_name_the_tensor():
    meta = torch.empty(4, device="meta")
    with pytest.raises(_core.DeviceTensorError, match=r"'layer\.w'.*meta"):
        _core.sha256_many([torch.ones(2), meta], ["ok", "layer.w"])
    with pytest.raises(TypeError, match="buffer #1"):
        weight_checker.sha256_many([b"a", 3.5])
    with pytest.raises(ValueError, match="2 names for 1 buffers"):
        _core.sha256_many([b"a"], ["x", "y"])


def test_buffer_is_released_after_hashing():
    buf = bytearray(b"x" * 10_000)
    weight_checker.sha256_many([buf])
    buf.extend(b"more")  # raises BufferError if an export were still held
    buf2 = bytearray(b"y" * 10)
    with pytest.raises(TypeError):
        weight_checker.sha256_many([buf2, object()])
    buf2.extend(b"z")  # released on the error path too


@st.composite
def tensor_views(draw):
    dtype = draw(st.sampled_from(all_dtypes()))
    shape = tuple(draw(st.lists(st.integers(0, 9), min_size=0, max_size=3)))
    t = random_tensor(shape, dtype, seed=draw(st.integers(0, 2**16)))
    op = draw(st.sampled_from(["none", "transpose", "step", "offset", "expand", "permute"]))
    if op == "transpose" and t.dim() >= 2:
        t = t.transpose(0, -1)
    elif op == "step" and t.dim() >= 1:
        t = t[..., :: draw(st.integers(1, 3))]
    elif op == "offset" and t.dim() >= 1 and t.shape[0] > 1:
        t = t[draw(st.integers(1, t.shape[0] - 1)) :]
    elif op == "expand" and t.dim() >= 1:
        t = t.unsqueeze(0).expand(draw(st.integers(0, 3)), *t.shape)
    elif op == "permute" and t.dim() == 3:
        t = t.permute(2, 0, 1)
    return t


@given(st.lists(tensor_views(), min_size=0, max_size=6))
def test_random_views_match_vllm(ts):
    assert weight_checker.sha256_many(ts) == [vllm_digest(t) for t in ts]


# Lengths around SHA-256's block (64) and padding (56) edges.
EDGE = [0, 1, 55, 56, 57, 63, 64, 65, 119, 120, 127, 128, 129, 4095, 4096, 4097]


@given(
    st.lists(st.one_of(st.sampled_from(EDGE), st.integers(0, 300_000)), max_size=20),
    st.integers(0, 15),
)
def test_random_lengths_and_offsets_match_hashlib(lengths, offset):
    pool = np.random.default_rng(sum(lengths) + offset).integers(0, 256, sum(lengths) + offset, dtype=np.uint8)
    bufs, at = [], offset
    for n in lengths:
        bufs.append(pool[at : at + n])
        at += n
    assert weight_checker.sha256_many(bufs) == [hashlib.sha256(b.tobytes()).hexdigest() for b in bufs]


class PlainSubclass(torch.Tensor):
    """Not torch.Tensor/Parameter exactly: read through the attribute fallback
    instead of torch's DLPack exchange API."""


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn, torch.bool, torch.int64], ids=str)
def test_both_torch_paths_agree(dtype):
    base = random_tensor((40, 24), dtype, seed=5)
    views = [base, base.t(), base[3:, ::2], base[7], torch.nn.Parameter(base, requires_grad=False)]
    fast = weight_checker.sha256_many(views)
    slow = weight_checker.sha256_many([v.as_subclass(PlainSubclass) for v in views])
    assert fast == slow == [vllm_digest(v) for v in views]
