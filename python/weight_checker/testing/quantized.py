"""Quantized copies of the tiny checkpoints of :mod:`.models`, written by hand
in pure torch (no llm-compressor, AutoGPTQ or AutoAWQ) in the on-disk layouts
vLLM's loaders read:

- :func:`write_w8a8_int8`: compressed-tensors ``int-quantized``, int8 weights
  (symmetric, per output channel), int8 dynamic per-token activations;
- :func:`write_fp8_channel`: compressed-tensors ``float-quantized``, FP8 e4m3
  weights per output channel, dynamic per-token activations;
- :func:`write_gptq_int4`: GPTQ 4-bit symmetric (``qweight`` / ``qzeros`` /
  ``scales`` / ``g_idx``, ``desc_act: false``);
- :func:`write_awq_int4`: AWQ 4-bit GEMM with zero points (``qweight`` /
  ``qzeros`` / ``scales``, AWQ's interleaved nibble order);
- :func:`write_w4a16_pack_quantized`: compressed-tensors ``pack-quantized``
  (``weight_packed`` / ``weight_scale`` / ``weight_shape``).

Each takes a bf16 checkpoint directory (``config.json`` + safetensors, as
:func:`.models.write_tiny_llama` writes one) and writes ``dst`` with
``config.json`` (the source's plus ``quantization_config``), the source's
other files (tokenizer, generation config) and one ``model.safetensors``. Only
the 2-D ``.weight`` of the decoder layers' projections (:data:`LINEAR_MODULES`:
q/k/v/o, gate/up/down) are quantized; norms, biases, embeddings and
``lm_head`` are copied as they are. Rounding is round-half-to-even
(``torch.round``) on fp32 values, so the output is a pure function of the input.

Scales follow the tools that write these formats: symmetric integer scales are
``amax / (range / 2)`` (compressed-tensors' and GPTQ's ``amax / 7.5`` for
int4, ``amax / 127.5`` for int8), AWQ's are ``(max - min) / 15`` with
``zero = -round(min / scale)``; the FP8 scales are vLLM's own online
``fp8_per_channel`` ones (``amax / 448`` floored at ``1 / (448 * 512)``), so a
checkpoint and an online-quantized engine hold the same tensors. The values
are quantized with the scale as it is stored (after its cast to fp16 / bf16).

Test support: torch and safetensors are imported inside the functions."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

#: The projections quantized (the last name component before ``.weight``).
LINEAR_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
#: Group size of the 4-bit forms unless told: the tiny models' 128 / 256 input
#: channels make several groups, and vLLM's CPU kernel takes multiples of 2.
DEFAULT_GROUP_SIZE = 32
#: Largest finite float8_e4m3fn value.
FP8_MAX = 448.0
#: Floor of the integer forms' scales (the smallest normal fp16): an all-zero
#: row or group keeps a finite, representable scale and quantizes to zeros.
INT_SCALE_FLOOR = 2.0**-14
#: AWQ's order of the eight 4-bit values in an int32: nibble ``i`` holds
#: column ``AWQ_ORDER[i]`` of each group of eight output channels.
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)

_CONFIG_FILES = ("config.json",)
_WEIGHT_SUFFIXES = (".safetensors", ".safetensors.index.json", ".bin", ".pt", ".pth")


# --- the five forms ----------------------------------------------------------


def write_w8a8_int8(src: Path, dst: Path) -> Path:
    """compressed-tensors W8A8 int8: per projection ``weight`` int8 ``[N, K]``
    and ``weight_scale`` fp32 ``[N, 1]`` (``amax / 127.5`` per output row)."""
    import torch

    def quantize(name: str, w: torch.Tensor) -> dict[str, torch.Tensor]:
        x = w.float()
        scale = (_amax(x, -1) / 127.5).clamp_min(INT_SCALE_FLOOR)
        q = torch.round(x / scale).clamp(-128, 127).to(torch.int8)
        return {f"{name}.weight": q, f"{name}.weight_scale": scale}

    weights = _args(8, "int", "channel")
    activations = _args(8, "int", "token", dynamic=True)
    config = _compressed_tensors_config("int-quantized", weights, activations)
    return _write(src, dst, quantize, config)


def write_fp8_channel(src: Path, dst: Path) -> Path:
    """compressed-tensors FP8 channel: ``weight`` float8_e4m3fn ``[N, K]`` and
    ``weight_scale`` fp32 ``[N, 1]``, computed as vLLM's online
    ``fp8_per_channel`` computes them (:func:`fp8_channel_quantize`)."""

    def quantize(name: str, w: torch.Tensor) -> dict[str, torch.Tensor]:
        q, scale = fp8_channel_quantize(w)
        return {f"{name}.weight": q, f"{name}.weight_scale": scale}

    weights = _args(8, "float", "channel")
    activations = _args(8, "float", "token", dynamic=True)
    config = _compressed_tensors_config("float-quantized", weights, activations)
    return _write(src, dst, quantize, config)


def write_gptq_int4(src: Path, dst: Path, group_size: int = DEFAULT_GROUP_SIZE) -> Path:
    """GPTQ 4-bit symmetric (AutoGPTQ's v1 checkpoint format), per projection:

    - ``qweight`` int32 ``[K / 8, N]``: eight input rows per int32, row
      ``8 i + j`` in bits ``4 j .. 4 j + 3``, values ``q + 8`` in 0..15;
    - ``qzeros`` int32 ``[K / g, N / 8]``: the zero point 8 stored as ``8 - 1``
      (v1's offset), eight output columns per int32, column ``8 c + j`` in
      nibble ``j`` (so every word is ``0x77777777``);
    - ``scales`` fp16 ``[K / g, N]`` (``amax / 7.5`` per group);
    - ``g_idx`` int32 ``[K]``: ``k // g`` (no activation order)."""
    import torch

    def quantize(name: str, w: torch.Tensor) -> dict[str, torch.Tensor]:
        q, scale = _int4_symmetric(w, group_size, torch.float16)  # q: [N, K] in 0..15
        n, k = q.shape
        zeros = torch.full((k // group_size, n), 8 - 1, dtype=torch.int64)
        return {
            f"{name}.qweight": _pack_rows(q.t()),
            f"{name}.qzeros": _pack_columns(zeros),
            f"{name}.scales": scale.t().contiguous(),
            f"{name}.g_idx": (torch.arange(k) // group_size).to(torch.int32),
        }

    config = {
        "quant_method": "gptq",
        "bits": 4,
        "group_size": group_size,
        "desc_act": False,
        "sym": True,
        "lm_head": False,
        "damp_percent": 0.01,
        "true_sequential": True,
        "static_groups": False,
        "checkpoint_format": "gptq",
    }
    return _write(src, dst, quantize, config)


def write_awq_int4(src: Path, dst: Path, group_size: int = DEFAULT_GROUP_SIZE) -> Path:
    """AWQ 4-bit GEMM with zero points (AutoAWQ's format), per projection:

    - ``qweight`` int32 ``[K, N / 8]``: eight output columns per int32, in
      :data:`AWQ_ORDER` (nibble ``i`` holds column ``8 c + AWQ_ORDER[i]``),
      values in 0..15;
    - ``qzeros`` int32 ``[K / g, N / 8]``: the zero points, packed the same way;
    - ``scales`` fp16 ``[K / g, N]``: ``(max - min) / 15`` per group.

    ``w ≈ (q - zero) * scale``, ``zero = clamp(-round(min / scale), 0, 15)``."""
    import torch

    def quantize(name: str, w: torch.Tensor) -> dict[str, torch.Tensor]:
        n, k = w.shape
        x = _groups(w, group_size)  # [N, G, g]
        lo, hi = x.aminmax(dim=-1)
        scale = ((hi - lo) / 15).clamp_min(INT_SCALE_FLOOR).to(torch.float16)  # [N, G]
        s = scale.float()
        zero = (-torch.round(lo / s)).clamp(0, 15)
        q = (torch.round(x / s[..., None]) + zero[..., None]).clamp(0, 15)
        q64 = q.reshape(n, k).to(torch.int64)
        return {
            f"{name}.qweight": _pack_columns(q64.t(), AWQ_ORDER),
            f"{name}.qzeros": _pack_columns(zero.to(torch.int64).t(), AWQ_ORDER),
            f"{name}.scales": scale.t().contiguous(),
        }

    config = {
        "quant_method": "awq",
        "bits": 4,
        "group_size": group_size,
        "zero_point": True,
        "version": "gemm",
        "modules_to_not_convert": None,
    }
    return _write(src, dst, quantize, config)


def write_w4a16_pack_quantized(src: Path, dst: Path, group_size: int = DEFAULT_GROUP_SIZE) -> Path:
    """compressed-tensors W4A16 ``pack-quantized`` (symmetric, per group), per
    projection: ``weight_packed`` int32 ``[N, K / 8]`` (input channel
    ``8 j + i`` in nibble ``i``, values ``q + 8``, as compressed-tensors'
    ``pack_to_int32`` packs them), ``weight_scale`` in the checkpoint's dtype
    ``[N, K / g]`` (``amax / 7.5``) and ``weight_shape`` int64 ``[2]`` = ``[N, K]``."""
    import torch

    def quantize(name: str, w: torch.Tensor) -> dict[str, torch.Tensor]:
        q, scale = _int4_symmetric(w, group_size, w.dtype)  # q: [N, K] in 0..15
        return {
            f"{name}.weight_packed": _pack_columns(q),
            f"{name}.weight_scale": scale,
            f"{name}.weight_shape": torch.tensor(list(w.shape), dtype=torch.int64),
        }

    weights = _args(4, "int", "group", group_size=group_size)
    config = _compressed_tensors_config("pack-quantized", weights, None)
    return _write(src, dst, quantize, config)


#: The writers by name, e.g. for a parametrised test.
WRITERS = {
    "w8a8_int8": write_w8a8_int8,
    "fp8_channel": write_fp8_channel,
    "gptq_int4": write_gptq_int4,
    "awq_int4": write_awq_int4,
    "w4a16_pack_quantized": write_w4a16_pack_quantized,
}


def fp8_channel_quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scale)`` of a ``[N, K]`` weight as vLLM's
    ``Fp8PtpcOnlineLinearMethod`` computes them: per output row
    ``scale = amax / 448`` (fp32, true division), floored at
    ``1 / (448 * 512)``, then ``q = clamp(w / scale, ±448)`` cast to
    float8_e4m3fn. ``q`` is ``[N, K]``, ``scale`` fp32 ``[N, 1]``; vLLM holds
    ``q.t()`` (a ``[K, N]`` view) and ``scale``."""
    import torch

    fp8_max = torch.tensor(FP8_MAX, dtype=torch.float32)
    lo, hi = weight.aminmax(dim=-1, keepdim=True)
    amax = torch.maximum(lo.abs(), hi.abs()).to(torch.float32)
    scale = (amax / fp8_max).clamp_min(1.0 / (fp8_max * 512))
    q = (weight / scale).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


# --- helpers -----------------------------------------------------------------


def _amax(x: torch.Tensor, dim: int) -> torch.Tensor:
    return x.abs().amax(dim=dim, keepdim=True)


def _groups(w: torch.Tensor, group_size: int) -> torch.Tensor:
    """``w`` ``[N, K]`` as fp32 ``[N, K / g, g]``."""
    n, k = w.shape
    if group_size <= 0 or k % group_size or k % 8 or n % 8:
        raise ValueError(f"weight {tuple(w.shape)}: needs K % group_size == 0 and K, N multiples of 8")
    return w.float().reshape(n, k // group_size, group_size)


def _int4_symmetric(w: torch.Tensor, group_size: int, scale_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric 4-bit per group: ``(q + 8`` int64 ``[N, K]`` in 0..15,
    ``scale`` ``[N, K / g]`` in ``scale_dtype)``, ``scale = amax / 7.5``."""
    import torch

    n, k = w.shape
    x = _groups(w, group_size)
    scale = (x.abs().amax(dim=-1) / 7.5).clamp_min(INT_SCALE_FLOOR).to(scale_dtype)
    q = torch.round(x / scale.float()[..., None]).clamp(-8, 7) + 8
    return q.reshape(n, k).to(torch.int64), scale


def _to_int32(x: torch.Tensor) -> torch.Tensor:
    """Unsigned 32-bit words held in int64 as int32 (two's complement)."""
    import torch

    return torch.where(x >= 2**31, x - 2**32, x).to(torch.int32)


def _pack_rows(q: torch.Tensor) -> torch.Tensor:
    """``[R, C]`` 4-bit values (int64) → int32 ``[R / 8, C]``: row ``8 i + j``
    in nibble ``j`` of row ``i`` (GPTQ's ``qweight``)."""
    import torch

    r, c = q.shape
    shifts = (torch.arange(8, dtype=torch.int64) * 4).view(1, 8, 1)
    return _to_int32((q.reshape(r // 8, 8, c) << shifts).sum(dim=1))


def _pack_columns(q: torch.Tensor, order: tuple[int, ...] = tuple(range(8))) -> torch.Tensor:
    """``[R, C]`` 4-bit values (int64) → int32 ``[R, C / 8]``: nibble ``i`` of
    word ``c`` holds column ``8 c + order[i]``."""
    import torch

    r, c = q.shape
    words = q.reshape(r, c // 8, 8)[:, :, list(order)]
    shifts = torch.arange(8, dtype=torch.int64) * 4
    return _to_int32((words << shifts).sum(dim=-1))


def _args(
    num_bits: int, kind: str, strategy: str, *, dynamic: bool = False, group_size: int | None = None
) -> dict[str, Any]:
    """A compressed-tensors ``QuantizationArgs`` as llm-compressor writes it."""
    return {
        "num_bits": num_bits,
        "type": kind,
        "symmetric": True,
        "strategy": strategy,
        "group_size": group_size,
        "block_structure": None,
        "dynamic": dynamic,
        "actorder": None,
        "observer": None if dynamic else "minmax",
        "observer_kwargs": {},
    }


def _compressed_tensors_config(fmt: str, weights: dict[str, Any], activations: dict[str, Any] | None) -> dict[str, Any]:
    return {
        "quant_method": "compressed-tensors",
        "format": fmt,
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": weights,
                "input_activations": activations,
                "output_activations": None,
                "format": fmt,
            }
        },
        "ignore": ["lm_head"],
        "kv_cache_scheme": None,
        "global_compression_ratio": None,
        "sparsity_config": {},
    }


def _is_linear(name: str, tensor: torch.Tensor) -> bool:
    parts = name.split(".")
    return (
        tensor.dim() == 2
        and len(parts) >= 3
        and parts[-1] == "weight"
        and parts[-2] in LINEAR_MODULES
        and ".layers." in name
    )


def _read_tensors(src: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(src.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {src}")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        tensors.update(load_file(str(f)))
    return tensors


def _write(src: Path, dst: Path, quantize: Any, quantization_config: dict[str, Any]) -> Path:
    """``dst`` from ``src``: each projection weight replaced by what
    ``quantize(module_name, weight)`` returns, everything else copied."""
    from safetensors.torch import save_file

    src, dst = Path(src), Path(dst)
    out: dict[str, torch.Tensor] = {}
    for name, tensor in sorted(_read_tensors(src).items()):
        if _is_linear(name, tensor):
            out.update(quantize(name.removesuffix(".weight"), tensor))
        else:
            out[name] = tensor
    dst.mkdir(parents=True, exist_ok=True)
    for f in sorted(src.iterdir()):
        if f.is_file() and f.name not in _CONFIG_FILES and not f.name.endswith(_WEIGHT_SUFFIXES):
            shutil.copyfile(f, dst / f.name)
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (dst / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    save_file({k: v.contiguous() for k, v in out.items()}, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst
