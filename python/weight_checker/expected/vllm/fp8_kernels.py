"""vLLM's online FP8 arithmetic, done by the Rust core, bit for bit.

An ``fp8_per_channel`` rank's expected digests run vLLM's own
``Fp8PtpcOnlineLinearMethod.process_weights_after_loading`` (which layers,
which scale, the TP reduction, the transpose: all vLLM's). Two of the
functions it calls do all the arithmetic over the weight, and torch does
each in several passes with fp32 temporaries, most of what an FP8 rank's
digests cost:

- ``weight_amax``: ``max(|W|)`` per row, exact in bf16;
- ``_fp8_quant_per_channel``: ``(W / scale).clamp(-448, 448)`` cast to
  ``float8_e4m3fn``, every step exact IEEE arithmetic or torch's integer
  cast routine.

:func:`fast` replaces both, for the calling thread only, with the core's
single-pass equivalents (``_core.fp8_row_abs_max`` and
``_core.fp8_quantize_rows``), which give the same bytes (checked against
vLLM's functions in tests/test_fp8_kernels.py, every finite bf16 value by
thousands of scales). The quantized weight comes back laid out as vLLM
keeps it (``qweight.t()`` is contiguous), so the digest reads it in order.
Any input they do not cover (another dtype or shape, a NaN, a platform whose
FP8 type or range differs) goes to vLLM's own function.

A third one costs time and no byte of the parameters: the oneDNN handle
vLLM's CPU backend packs for each unquantized layer that keeps its weight
(the ``lm_head`` beside quantized linears), a copy of the weight an expected
model never runs. Inside :func:`fast` it is not made where the caller keeps
the weight; where it drops the weight, vLLM makes it as the engine does.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

_LOCAL = threading.local()
_INSTALL = threading.Lock()
#: The functions replaced, by their name in vLLM's online FP8 module.
_NAMES = ("weight_amax", "_fp8_quant_per_channel")
#: Casts made in the read of the amax, and those vLLM's scale then kept, in
#: this process: a test's counters (tests/test_fp8_kernels.py), not thread-safe.
FUSED = {"made": 0, "kept": 0}


def _fp8_module() -> Any:
    from vllm.model_executor.layers.quantization.online import fp8

    return fp8


def _e4m3fn_range_is_torchs() -> bool:
    """Whether vLLM quantizes to torch's float8_e4m3fn at +-448 here (the
    core's cast); ROCm's e4m3fnuz at +-224 is not."""
    import torch
    from vllm.model_executor.layers.quantization.utils.quant_utils import get_fp8_min_max
    from vllm.platforms import current_platform

    return bool(current_platform.fp8_dtype() == torch.float8_e4m3fn and get_fp8_min_max() == (-448.0, 448.0))


def _plain_bf16(t: Any) -> bool:
    """A 2-D CPU bf16 tensor with columns (vLLM's functions fail on none: left to them)."""
    import torch

    plain = t.dim() == 2 and t.dtype == torch.bfloat16 and t.device.type == "cpu" and not t.is_quantized
    return plain and t.shape[1] > 0


def _row_abs_max(original: Any) -> Any:
    def weight_amax(weight: Any, *, dim: int | None = None, keepdim: bool = False) -> Any:
        import torch

        from weight_checker import _core
        from weight_checker.expected.vllm import deferred_rows

        if _plain_bf16(weight) and dim in (-1, 1) and keepdim:
            kept = _remembered(weight)
            if kept is not None:
                return kept
            pieces = deferred_rows.pieces_of(weight)  # its rows where the weights lie (no copy was made)
            if pieces is not None and getattr(_LOCAL, "fuse", False) and not getattr(_LOCAL, "amax_only", False):
                amax = _cast_ahead(weight, pieces)
                if amax is not None:
                    return amax
            if pieces is not None:
                out = torch.empty(weight.shape[0], dtype=torch.int16)
                into, cols = out.numpy(), weight.shape[1]
                nan = any(
                    _core.fp8_row_abs_max_piece(p.source, 0, p.stride, p.rows, cols, into[p.first : p.first + p.rows])
                    for p in pieces
                )
                for p in pieces:
                    p.check()  # read with the GIL released: the weights were not written meanwhile
                if not nan:
                    return _remember(weight, pieces, out.view(torch.bfloat16).reshape(-1, 1))
            w = weight.detach().contiguous()
            out = torch.empty(w.shape[0], dtype=torch.int16)
            if not _core.fp8_row_abs_max(w.view(torch.int16).numpy(), w.shape[1], out.numpy()):
                return _remember(weight, [], out.view(torch.bfloat16).reshape(-1, 1))
        return original(weight, dim=dim, keepdim=keepdim)

    return weight_amax


@dataclass
class _Read:
    """What was read of ``weight`` where its copies lie: valid while it is
    the same object, at the same version, over the very same pending
    copies (:func:`.deferred_rows.pending_pieces`), their sources unchanged."""

    weight: Any
    version: int
    pending: tuple[Any, ...]
    pieces: list[Any]

    def holds(self, weight: Any) -> bool:
        from weight_checker.expected.vllm import deferred_rows

        now = deferred_rows.pending_pieces(weight)
        if self.weight is not weight or weight._version != self.version or len(now) != len(self.pending):
            return False
        if not all(a is b for a, b in zip(now, self.pending, strict=True)):
            return False
        for p in self.pieces:
            p.check()  # the weights it was read from are as they were
        return True


def _read(weight: Any, pieces: list[Any]) -> _Read:
    from weight_checker.expected.vllm import deferred_rows

    return _Read(weight, weight._version, deferred_rows.pending_pieces(weight), pieces)


def _remember(weight: Any, pieces: list[Any], amax: Any) -> Any:
    """``amax``, read from ``pieces``, kept inside :func:`remembering_amaxes`
    when read by a pass that keeps amaxes only (a held layer's shadow), for
    the same weight's processing to take (:func:`_remembered`)."""
    remembered = getattr(_LOCAL, "amaxes", None)
    if remembered is not None and pieces and getattr(_LOCAL, "amax_only", False):
        remembered[id(weight)] = (_read(weight, pieces), amax.clone())
    return amax


def _remembered(weight: Any) -> Any:
    """The amax :func:`_remember` kept of this very ``weight``, its copies
    still pending as they were (:class:`_Read`), once; else ``None``."""
    remembered = getattr(_LOCAL, "amaxes", None)
    if not remembered or getattr(_LOCAL, "amax_only", False):
        return None
    kept = remembered.pop(id(weight), None)
    if kept is None or not kept[0].holds(weight):
        return None
    return kept[1]


@contextlib.contextmanager
def remembering_amaxes() -> Iterator[None]:
    """Inside, on this thread: the amax a pass that keeps amaxes only reads
    of a weight (a held layer's shadow, :mod:`.online_process`) is given
    again, once, to the same weight's processing, if the weight is unchanged
    since: its rows are read once, not twice. (vLLM then all-reduces a held
    layer's amax, which the TP reduction here replaces by the reduced one.)"""
    previous = getattr(_LOCAL, "amaxes", None)
    _LOCAL.amaxes = {}
    try:
        yield
    finally:
        _LOCAL.amaxes = previous


@dataclass
class _Ahead:
    """A cast made with the amax, by the scale vLLM is expected to derive from it."""

    read: _Read
    scale: Any  # numpy float32, one per row
    out: Any  # the [K, N] FP8 storage


def _cast_ahead(weight: Any, pieces: list[Any]) -> Any:
    """The amax of ``weight``'s rows, read where they lie, and in the same
    read its cast by the scale vLLM derives from that amax
    (``_core.fp8_amax_quantize_piece``: one read of the weight, not two),
    kept for :func:`_cast_made_ahead`; ``None`` on a NaN (then nothing is kept)."""
    import torch

    from weight_checker import _core
    from weight_checker.expected.vllm import warm_memory

    rows, cols = weight.shape
    amax = torch.empty(rows, dtype=torch.int16)
    scale = torch.empty(rows, dtype=torch.float32)
    out = warm_memory.empty((cols, rows), torch.float8_e4m3fn)
    top, scales, into = amax.numpy(), scale.numpy(), out.view(torch.uint8).numpy()
    nan = any(
        _core.fp8_amax_quantize_piece(
            p.source, 0, p.stride, p.rows, cols, top[p.first : p.first + p.rows],
            scales[p.first : p.first + p.rows], into, p.first, rows,
        )
        for p in pieces
    )  # fmt: skip
    for p in pieces:
        p.check()  # read with the GIL released: the weights were not written meanwhile
    if nan:
        return None
    _LOCAL.ahead = _Ahead(_read(weight, pieces), scales, out)
    FUSED["made"] += 1
    return amax.view(torch.bfloat16).reshape(-1, 1)


def _cast_made_ahead(weight: Any, scale: Any) -> Any:
    """The cast :func:`_cast_ahead` made of this very ``weight``, unchanged
    since, where ``scale`` is bit for bit the one it was cast by (else
    ``None``: the cast made ahead is dropped, and this one is made as usual).
    vLLM's own scale is what decides: a TP reduction of the amax, or any
    other formula, takes the usual cast."""
    import numpy as np

    ahead, _LOCAL.ahead = getattr(_LOCAL, "ahead", None), None
    if ahead is None or not ahead.read.holds(weight):
        return None
    given = scale.detach().contiguous().reshape(-1).numpy()
    if given.shape != ahead.scale.shape or not np.array_equal(given.view(np.uint32), ahead.scale.view(np.uint32)):
        return None
    FUSED["kept"] += 1
    return ahead.out


def _quant_per_channel(original: Any) -> Any:
    def fp8_quant_per_channel(weight: Any, scale: Any) -> Any:
        import torch

        from weight_checker import _core
        from weight_checker.expected.vllm import deferred_rows, warm_memory

        rows = weight.shape[0] if weight.dim() == 2 else -1
        if (
            _plain_bf16(weight)
            and scale.dtype == torch.float32
            and tuple(scale.shape) == (rows, 1)
            and scale.device.type == "cpu"
            and _e4m3fn_range_is_torchs()
        ):
            cols = weight.shape[1]
            ahead = _cast_made_ahead(weight, scale)
            if ahead is not None:
                return ahead.t()
            # [K, N] storage: the [N, K] result vLLM transposes is then contiguous.
            if getattr(_LOCAL, "amax_only", False):
                # A pass that keeps only the amaxes: the bytes are never written or read.
                return warm_memory.empty((cols, rows), torch.float8_e4m3fn, written=False).t()
            out = warm_memory.empty((cols, rows), torch.float8_e4m3fn)  # written in full below
            sc = scale.detach().contiguous().reshape(-1)
            pieces = deferred_rows.pieces_of(weight)  # its rows where the weights lie (no copy was made)
            if pieces is not None:
                scales, into = sc.numpy(), out.view(torch.uint8).numpy()
                nan = any(
                    _core.fp8_quantize_piece(
                        p.source, 0, p.stride, p.rows, cols, scales[p.first : p.first + p.rows], into, p.first, rows
                    )
                    for p in pieces
                )
                for p in pieces:
                    p.check()  # read with the GIL released: the weights were not written meanwhile
                if not nan:
                    return out.t()
            w = weight.detach().contiguous()
            bits, into = w.view(torch.int16).numpy(), out.view(torch.uint8).numpy()
            if not _core.fp8_quantize_rows(bits, cols, sc.numpy(), into, True):
                return out.t()
        return original(weight, scale)

    return fp8_quant_per_channel


def _no_handle(original: Any) -> Any:
    def create_onednn_mm(weight: Any, *args: Any, **kwargs: Any) -> Any:
        # vLLM's CPU backend packs an unquantized layer's weight into a oneDNN
        # handle (``dispatch_cpu_unquantized_gemm``): a copy the parameters
        # never see, which an expected model never runs. Skipped only where
        # the caller keeps the weight (``remove_weight`` false): there the
        # parameters are the same whether the handle is made or fails; where
        # it drops the weight, only a made handle does, so vLLM makes it.
        caller = sys._getframe(2)  # 1: the dispatcher (_dispatch); 2: vLLM's caller
        if caller.f_code.co_name == "dispatch_cpu_unquantized_gemm" and caller.f_locals.get("remove_weight") is False:
            return _NO_HANDLE
        return original(weight, *args, **kwargs)

    return create_onednn_mm


#: What an expected model's unquantized layers hold in place of a oneDNN handle.
_NO_HANDLE = object()


def _dispatch(original: Any, make: Any) -> Any:
    fast_version = make(original)

    def dispatcher(*args: Any, **kwargs: Any) -> Any:
        if getattr(_LOCAL, "on", False):
            return fast_version(*args, **kwargs)
        return original(*args, **kwargs)

    dispatcher.weight_checker_original = original  # type: ignore[attr-defined]
    return dispatcher


def _install() -> None:
    """The dispatchers put in place of vLLM's two functions in its online FP8
    module, once: each calls vLLM's own unless this thread is in :func:`fast`."""
    from vllm import _custom_ops

    module = _fp8_module()
    with _INSTALL:
        for name, make in zip(_NAMES, (_row_abs_max, _quant_per_channel), strict=True):
            current = getattr(module, name)
            if getattr(current, "weight_checker_original", None) is None:
                setattr(module, name, _dispatch(current, make))
        current = getattr(_custom_ops, "create_onednn_mm", None)
        if current is not None and getattr(current, "weight_checker_original", None) is None:
            _custom_ops.create_onednn_mm = _dispatch(current, _no_handle)


@contextlib.contextmanager
def fast(amax_only: bool = False, fuse: bool = False) -> Iterator[None]:
    """vLLM's online FP8 arithmetic by the core, on this thread, inside.
    ``amax_only``: for a pass whose model is dropped once its amaxes are
    recorded (the TP reduction's first pass): the cast is skipped and the
    FP8 weights are left unwritten. ``fuse``: a weight read where it lies
    is cast in the same read as its amax, by the scale vLLM is expected to
    derive (``channel_scale`` in the core, checked against vLLM's
    ``_fp8_channel_scale`` for every bf16 amax in tests/test_fp8_kernels.py):
    kept only where the scale vLLM passes is bit for bit that one (else the
    cast is made again; a reduced amax's layer wastes the one made ahead)."""
    _install()
    state = ("on", "amax_only", "fuse", "ahead")
    previous = [getattr(_LOCAL, name, None) for name in state]
    _LOCAL.on, _LOCAL.amax_only, _LOCAL.fuse, _LOCAL.ahead = True, amax_only, fuse, None
    try:
        yield
    finally:
        for name, value in zip(state, previous, strict=True):
            setattr(_LOCAL, name, value)
