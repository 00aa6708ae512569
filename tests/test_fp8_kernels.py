"""The core's FP8 arithmetic (expected/vllm/fp8_kernels.py) against its
oracle, vLLM's own functions: the per-row amax and the per-channel cast give
the same bytes for every finite bf16 value by many scales (the specials
among them), NaN goes to vLLM's own code, and only the thread inside
``fast()`` sees the replacement."""

from __future__ import annotations

import threading

import pytest
import torch
from weight_checker.expected.vllm import fp8_kernels
from weight_checker.testing.launch import vllm_available

pytestmark = pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed")


@pytest.fixture(scope="module")
def vllm_fp8():
    """vLLM's online FP8 module and its two functions, as vLLM defines them."""
    module = fp8_kernels._fp8_module()
    fp8_kernels._install()
    return module, {name: getattr(module, name).weight_checker_original for name in fp8_kernels._NAMES}


def every_finite_bf16() -> torch.Tensor:
    values = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    return values[torch.isfinite(values)]


def scales(n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    wide = torch.exp2(torch.empty(n, dtype=torch.float64).uniform_(-40, 40, generator=g)).float()
    special = torch.tensor([1 / 229376, 1.0, 448.0, 2.0**-126, 2.0**-149, 1e-38, 3e38, 0.0078125])
    return torch.cat([special, wide]).reshape(-1, 1)


def test_the_cast_equals_vllms_for_every_finite_bf16_by_many_scales(vllm_fp8):
    module, original = vllm_fp8
    weight = every_finite_bf16()
    s = scales(120)
    rows = weight.expand(s.shape[0], -1).contiguous()
    want = original["_fp8_quant_per_channel"](rows, s)
    with fp8_kernels.fast():
        got = module._fp8_quant_per_channel(rows, s)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert got.t().is_contiguous()  # laid out as vLLM keeps it, [K, N]
    differ = (got.view(torch.uint8) != want.view(torch.uint8)).nonzero()
    assert differ.numel() == 0, f"{len(differ)} bytes differ, first at {differ[:5].tolist()}"


@pytest.mark.parametrize("shape", [(1, 1), (7, 1), (64, 64), (129, 300), (3072, 2048), (200, 5632)])
def test_amax_and_cast_of_weight_like_tensors_equal_vllms(vllm_fp8, shape):
    module, original = vllm_fp8
    g = torch.Generator().manual_seed(shape[0] * 7919 + shape[1])
    weight = (torch.randn(shape, generator=g) * 0.02).to(torch.bfloat16)
    weight[0, 0] = float("inf")  # saturates, as torch's clamp does
    if shape[0] > 2:
        weight[1] = 0.0  # a zero row: the scale's floor
        weight[2, -1] = -0.0
    want_amax = original["weight_amax"](weight, dim=-1, keepdim=True)
    scale = module._fp8_channel_scale(want_amax)
    want = original["_fp8_quant_per_channel"](weight, scale)
    with fp8_kernels.fast():
        got_amax = module.weight_amax(weight, dim=-1, keepdim=True)
        got = module._fp8_quant_per_channel(weight, scale)
    assert got_amax.dtype == want_amax.dtype and torch.equal(got_amax, want_amax)
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


def test_nan_and_other_inputs_go_to_vllms_own_functions(vllm_fp8):
    module, original = vllm_fp8
    weight = (torch.randn(8, 40) * 0.02).to(torch.bfloat16)
    weight[3, 5] = float("nan")
    amax = original["weight_amax"](weight, dim=-1, keepdim=True)
    scale = module._fp8_channel_scale(amax)
    with fp8_kernels.fast():
        got_amax = module.weight_amax(weight, dim=-1, keepdim=True)
        got = module._fp8_quant_per_channel(weight, scale)
        as_fp32 = module._fp8_quant_per_channel(weight.float(), scale)  # not bf16: vLLM's
    assert torch.equal(got_amax.isnan(), amax.isnan()) and torch.equal(got_amax[~amax.isnan()], amax[~amax.isnan()])
    assert torch.equal(got.view(torch.uint8), original["_fp8_quant_per_channel"](weight, scale).view(torch.uint8))
    want_fp32 = original["_fp8_quant_per_channel"](weight.float(), scale)
    assert torch.equal(as_fp32.view(torch.uint8), want_fp32.view(torch.uint8))
    # No columns: vLLM's functions fail, and so do they inside fast() (never a made-up amax).
    empty = torch.zeros(3, 0, dtype=torch.bfloat16)
    for name, args in (("weight_amax", (empty,)), ("_fp8_quant_per_channel", (empty, torch.ones(3, 1)))):
        kwargs = {"dim": -1, "keepdim": True} if name == "weight_amax" else {}
        with pytest.raises(Exception) as vllms:
            original[name](*args, **kwargs)
        with fp8_kernels.fast(), pytest.raises(vllms.type):
            getattr(module, name)(*args, **kwargs)


def test_only_the_thread_inside_fast_runs_the_core(vllm_fp8, monkeypatch):
    module, _ = vllm_fp8
    from weight_checker import _core

    calls = []
    real = _core.fp8_quantize_rows
    monkeypatch.setattr(_core, "fp8_quantize_rows", lambda *a: calls.append(threading.get_ident()) or real(*a))
    weight = (torch.randn(4, 16) * 0.02).to(torch.bfloat16)
    scale = module._fp8_channel_scale(module.weight_amax(weight, dim=-1, keepdim=True))
    inside = threading.Event()
    leave = threading.Event()

    def hold():
        with fp8_kernels.fast():
            module._fp8_quant_per_channel(weight, scale)
            inside.set()
            leave.wait(10)

    t = threading.Thread(target=hold)
    t.start()
    assert inside.wait(10)
    module._fp8_quant_per_channel(weight, scale)  # this thread: vLLM's own, while the other is inside
    leave.set()
    t.join()
    assert calls == [t.ident]


def test_the_core_refuses_sizes_that_overflow_and_an_output_over_its_input():
    """The binding's own checks (the core builds slices from them): an
    overflowing size and an ``out`` sharing memory with an input are
    ValueErrors, and nothing is written."""
    import numpy as np
    from weight_checker import _core

    a = np.array([0x3F80, 0x4000], np.int16)
    out = np.full(2, 7, np.int16)
    with pytest.raises(ValueError, match="overflow"):
        _core.fp8_row_abs_max(a, 2**63 + 1, out)
    with pytest.raises(ValueError, match="out overlaps weight"):
        _core.fp8_row_abs_max(a, 1, a)
    scale = np.ones(2, np.float32)
    with pytest.raises(ValueError, match="out overlaps weight"):
        _core.fp8_quantize_rows(a, 1, scale, a.view(np.uint8)[:2], False)
    with pytest.raises(ValueError, match="out overlaps scale"):
        _core.fp8_quantize_rows(a, 1, scale, scale.view(np.uint8)[:2], False)
    assert out.tolist() == [7, 7]


def test_the_core_refuses_arrays_of_another_item_type_and_writes_nothing():
    """A float32 weight, a float16 one (numpy's only 2-byte float, not
    bf16), float64 or int32 scales: each a ValueError naming the argument
    and the format, whatever their byte counts; nothing is written."""
    import numpy as np
    from weight_checker import _core

    bits = np.array([[0x3F80, 0x4000], [0xBF80, 0x3F00]], np.uint16).view(np.int16)
    scale = np.ones(2, np.float32)
    out = np.full(4, 7, np.uint8)
    assert not _core.fp8_quantize_rows(bits, 2, scale, out, True)
    out[:] = 7
    for args, what in [
        ((bits.view(np.float16), 2, scale, out), "weight"),
        ((np.ones((2, 1), np.float32), 1, scale, out[:2]), "weight"),
        ((bits, 2, np.ones(1, np.float64), out), "scale"),
        ((bits, 2, scale.view(np.int32), out), "scale"),
    ]:
        with pytest.raises(ValueError, match=rf"^{what}: items of \d bytes, format"):
            _core.fp8_quantize_rows(*args, True)
    with pytest.raises(ValueError, match=r"^out: items of 2 bytes"):
        _core.fp8_quantize_rows(bits, 2, scale, np.zeros(4, np.uint16), True)
    with pytest.raises(ValueError, match=r"^source: items of 4 bytes"):
        _core.fp8_row_abs_max_piece(np.zeros(4, np.float32), 0, 2, 2, 2, np.zeros(2, np.int16))
    assert out.tolist() == [7] * 4


def test_the_onednn_handle_is_skipped_only_where_the_caller_keeps_the_weight():
    """Inside ``fast()``, vLLM's ``dispatch_cpu_unquantized_gemm`` (run as
    vLLM runs it, on a real layer) leaves the layer's parameters exactly as
    vLLM's own run outside it does, and makes no handle where it keeps the
    weight; where it drops the weight, vLLM's own handle is made (whether it
    is made, or fails and keeps the weight, decides the parameters)."""
    from vllm import _custom_ops
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    fp8_kernels._install()
    dispatcher = _custom_ops.create_onednn_mm
    original = dispatcher.weight_checker_original
    made = []

    def counting(*args, **kwargs):
        made.append(1)
        return original(*args, **kwargs)

    _custom_ops.create_onednn_mm = fp8_kernels._dispatch(counting, fp8_kernels._no_handle)
    try:
        for remove in (False, True):
            torch.manual_seed(0)
            theirs = torch.nn.Linear(256, 512, bias=False).to(torch.bfloat16)
            mine = torch.nn.Linear(256, 512, bias=False).to(torch.bfloat16)
            mine.load_state_dict(theirs.state_dict())
            made.clear()
            dispatch_cpu_unquantized_gemm(theirs, remove_weight=remove)
            assert made == [1]  # outside fast(): vLLM's own function
            made.clear()
            with fp8_kernels.fast():
                dispatch_cpu_unquantized_gemm(mine, remove_weight=remove)
            assert made == ([1] if remove else [])
            assert mine.weight.shape == theirs.weight.shape and torch.equal(mine.weight, theirs.weight)
    finally:
        _custom_ops.create_onednn_mm = dispatcher


@pytest.mark.vllm
@pytest.mark.parametrize("tp", [1, 2])
def test_a_cast_made_in_the_read_of_the_amax_is_kept_only_where_vllms_scale_is_the_one_it_was_made_by(
    models, monkeypatch, tp
):
    """Weights read where they lie are cast in the read of their amax, by
    the scale the core expects vLLM to derive: kept for every layer whose
    amax is not reduced, and the digests equal a run where nothing is read
    in place (vLLM's own sequence: the amax, then the cast). With vLLM's
    scale changed (twice its own), every cast made ahead is dropped, and
    the digests are again those of that run, with the changed scale."""
    import weight_checker
    from weight_checker.expected.vllm import warm_memory

    source = models.path("tiny-llama")
    monkeypatch.setattr(warm_memory, "POOL", warm_memory.WarmPool())

    def digests(in_place: bool) -> tuple[dict[str, str], dict[str, int]]:
        monkeypatch.setattr(warm_memory, "MIN_BYTES", 0 if in_place else 1 << 62)
        before = dict(fp8_kernels.FUSED)
        got = dict(weight_checker.expected_digests(source, tp=tp, quantization="fp8_per_channel"))
        return got, {k: fp8_kernels.FUSED[k] - before[k] for k in before}

    fused, counts = digests(in_place=True)
    plain, none = digests(in_place=False)
    assert fused == plain and none == {"made": 0, "kept": 0}
    assert counts["made"] == counts["kept"] > 0, counts

    module = fp8_kernels._fp8_module()
    vllms_scale = module._fp8_channel_scale
    monkeypatch.setattr(module, "_fp8_channel_scale", lambda amax: vllms_scale(amax) * 2)
    doubled, counts = digests(in_place=True)
    assert counts["made"] > 0 and counts["kept"] == 0, counts
    assert doubled == digests(in_place=False)[0]
    changed = {k for k in fused if fused[k] != doubled[k]}
    assert changed and all(k.endswith((".weight", ".weight_scale")) for k in changed)


def test_an_amax_kept_from_an_amax_only_pass_is_given_once_and_only_to_the_same_weight_unchanged(vllm_fp8, monkeypatch):
    """A held layer's amax is read once: its shadow's (an amax-only pass,
    read where its copies lie) is given again to its processing, once; a
    weight written in between (through ``.data``, which leaves its version
    as it was) or another tensor of the same values is read again (the amax
    of what it holds now, vLLM's own)."""
    from weight_checker import _core
    from weight_checker.expected.vllm import deferred_rows, warm_memory

    module, original = vllm_fp8
    reads = []
    real = _core.fp8_row_abs_max_piece
    monkeypatch.setattr(_core, "fp8_row_abs_max_piece", lambda *a: reads.append(1) or real(*a))
    amax = module.weight_amax  # the dispatcher
    pool = warm_memory.WarmPool()
    source = (torch.randn(512, 1024) * 0.02).to(torch.bfloat16)
    with warm_memory.serving(pool, mode=False), deferred_rows.DeferredCopies(pool, serves=True) as mode:
        mode.note_source("w", source)
        weight = torch.empty(512, 1024, dtype=torch.bfloat16, device="cpu")
        weight.copy_(source)  # deferred: read where it lies
        with fp8_kernels.remembering_amaxes():
            with fp8_kernels.fast(amax_only=True):
                shadow = amax(weight, dim=-1, keepdim=True)
            with fp8_kernels.fast():
                assert torch.equal(amax(weight, dim=-1, keepdim=True), shadow) and len(reads) == 1  # the kept one
                assert torch.equal(amax(weight, dim=-1, keepdim=True), shadow) and len(reads) == 2  # once only
            with fp8_kernels.fast(amax_only=True):
                amax(weight, dim=-1, keepdim=True)
            with fp8_kernels.fast():
                other = amax(weight.clone(), dim=-1, keepdim=True)  # the same values, another tensor: not given it
                assert torch.equal(other, shadow)
            weight.data[3] = 1.0  # written in between, its version unchanged
            with fp8_kernels.fast():
                again = amax(weight, dim=-1, keepdim=True)
        assert again[3].item() == 1.0 and torch.equal(again, original["weight_amax"](weight, dim=-1, keepdim=True))


def test_the_cast_by_its_own_amax_gives_vllms_scale_for_every_bf16_amax_and_the_usual_bytes(vllm_fp8):
    """``_core.fp8_amax_quantize_piece`` against its oracles: the amax of
    every non-negative bf16 value (one a row) and the scale vLLM's
    ``_fp8_channel_scale`` derives from it, bit for bit (the scale the cast
    made ahead is kept by); and, on pieces of a weight written at row
    ``first`` of a wider output, the bytes of the core's separate amax and
    cast by that scale."""
    import numpy as np
    from weight_checker import _core

    module, _ = vllm_fp8
    bits = np.arange(0, 0x7F81, dtype=np.uint16).view(np.int16)  # +0 .. +inf
    n = len(bits)
    amax, scale, out = np.empty(n, np.int16), np.empty(n, np.float32), np.empty(n, np.uint8)
    assert not _core.fp8_amax_quantize_piece(bits, 0, 1, n, 1, amax, scale, out, 0, n)
    assert np.array_equal(amax, bits)
    vllms = module._fp8_channel_scale(torch.from_numpy(bits.copy()).view(torch.bfloat16).reshape(-1, 1))
    assert np.array_equal(scale.view(np.uint32), vllms.reshape(-1).numpy().view(np.uint32))

    g = torch.Generator().manual_seed(3)
    weight = (torch.randn(300, 130, generator=g) * 0.05).to(torch.bfloat16)
    weight[7] = 0  # the floor scale
    src = weight.view(torch.int16).numpy().reshape(-1)
    total, first, cols = 310, 4, 100  # two pieces: rows 0-149 and 150-299, columns 10-109
    fused, apart = np.zeros(cols * total, np.uint8), np.zeros(cols * total, np.uint8)
    got_amax, got_scale = np.empty(300, np.int16), np.empty(300, np.float32)
    want_amax = np.empty(300, np.int16)
    for start in (0, 150):
        offset = start * 130 + 10
        rows = slice(start, start + 150)
        assert not _core.fp8_amax_quantize_piece(
            src, offset, 130, 150, cols, got_amax[rows], got_scale[rows], fused, first + start, total
        )
        assert not _core.fp8_row_abs_max_piece(src, offset, 130, 150, cols, want_amax[rows])
    want_scale = module._fp8_channel_scale(torch.from_numpy(want_amax).view(torch.bfloat16).reshape(-1, 1))
    want_scale = want_scale.reshape(-1).numpy()
    for start in (0, 150):
        offset = start * 130 + 10
        rows = slice(start, start + 150)
        assert not _core.fp8_quantize_piece(src, offset, 130, 150, cols, want_scale[rows], apart, first + start, total)
    assert np.array_equal(got_amax, want_amax) and np.array_equal(got_scale.view(np.uint32), want_scale.view(np.uint32))
    assert np.array_equal(fused, apart)


def test_the_cast_by_its_own_amax_refuses_bad_arguments_and_names_the_buffers():
    import numpy as np
    from weight_checker import _core

    src = np.arange(64, dtype=np.int16)
    amax, scale, out = np.zeros(4, np.int16), np.zeros(4, np.float32), np.full(4 * 16, 7, np.uint8)
    cases = [
        ((src, 0, 16, 4, 16, amax[:3], scale, out, 0, 4), "amax: 3 items"),
        ((src, 0, 16, 4, 16, amax, scale[:3], out, 0, 4), "scale: 3 items"),
        ((src, 0, 16, 4, 16, amax, scale, out[:-1], 0, 4), "out: 63 items"),
        ((src, 0, 16, 4, 16, amax, scale, out, 1, 4), r"rows 1\+4 of 4"),
        ((src, 1, 16, 4, 16, amax, scale, out, 0, 4), "end past"),
        ((src, 0, 16, 4, 16, amax, scale.view(np.int32), out, 0, 4), "^scale: items of 4 bytes, format"),
        ((src, 0, 16, 4, 16, src[:4], scale, out, 0, 4), "amax overlaps source"),
        ((src, 0, 16, 4, 16, amax, src[:8].view(np.float32), out, 0, 4), "scale overlaps source"),
        ((src, 0, 16, 4, 16, amax, out[:16].view(np.float32), out, 0, 4), "out overlaps scale"),
        ((src, 0, 16, 4, 16, out[:8].view(np.int16), scale, out, 0, 4), "out overlaps amax"),
    ]
    for args, message in cases:
        with pytest.raises(ValueError, match=message):
            _core.fp8_amax_quantize_piece(*args)
    assert out.tolist() == [7] * 64 and not amax.any() and not scale.any()


def test_a_cast_made_ahead_is_dropped_for_a_weight_written_through_data_or_another_tensor(vllm_fp8):
    """A write through ``.data`` leaves the weight's version as it was: the
    cast made ahead is dropped all the same (its copies were written and
    are no longer pending), and the cast is vLLM's of what the weight holds
    now; a different tensor with the same values never takes it."""
    from weight_checker.expected.vllm import deferred_rows, warm_memory

    module, original = vllm_fp8
    pool = warm_memory.WarmPool()
    source = (torch.randn(512, 1024) * 0.02).to(torch.bfloat16)
    with warm_memory.serving(pool, mode=False), deferred_rows.DeferredCopies(pool, serves=True) as mode:
        mode.note_source("w", source)
        for write in ("data", "other"):
            weight = torch.empty(512, 1024, dtype=torch.bfloat16, device="cpu")
            weight.copy_(source)  # deferred
            before = dict(fp8_kernels.FUSED)
            with fp8_kernels.fast(fuse=True):
                scale = module._fp8_channel_scale(module.weight_amax(weight, dim=-1, keepdim=True))
                if write == "data":
                    weight.data[3] = 1.0
                    target = weight
                else:
                    target = weight.clone()
                got = module._fp8_quant_per_channel(target, scale)
            assert fp8_kernels.FUSED["made"] == before["made"] + 1 and fp8_kernels.FUSED["kept"] == before["kept"]
            want = original["_fp8_quant_per_channel"](target.clone(), scale)
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), write
