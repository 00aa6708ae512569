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
from typing import Any

_LOCAL = threading.local()
_INSTALL = threading.Lock()
#: The functions replaced, by their name in vLLM's online FP8 module.
_NAMES = ("weight_amax", "_fp8_quant_per_channel")


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
            pieces = deferred_rows.pieces_of(weight)  # its rows where the weights lie (no copy was made)
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
                    return out.view(torch.bfloat16).reshape(-1, 1)
            w = weight.detach().contiguous()
            out = torch.empty(w.shape[0], dtype=torch.int16)
            if not _core.fp8_row_abs_max(w.view(torch.int16).numpy(), w.shape[1], out.numpy()):
                return out.view(torch.bfloat16).reshape(-1, 1)
        return original(weight, dim=dim, keepdim=keepdim)

    return weight_amax


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
            # [K, N] storage: the [N, K] result vLLM transposes is then contiguous.
            out = warm_memory.empty((cols, rows), torch.float8_e4m3fn)  # written in full below
            if getattr(_LOCAL, "amax_only", False):
                return out.t()  # a pass that keeps only the amaxes: the bytes are never read
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
def fast(amax_only: bool = False) -> Iterator[None]:
    """vLLM's online FP8 arithmetic by the core, on this thread, inside.
    ``amax_only``: for a pass whose model is dropped once its amaxes are
    recorded (the TP reduction's first pass): the cast is skipped and the
    FP8 weights are left unwritten."""
    _install()
    previous = getattr(_LOCAL, "on", False), getattr(_LOCAL, "amax_only", False)
    _LOCAL.on, _LOCAL.amax_only = True, amax_only
    try:
        yield
    finally:
        _LOCAL.on, _LOCAL.amax_only = previous
