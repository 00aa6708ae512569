"""What the walk cannot see: weights an engine holds outside its parameters.

The walk (:mod:`.walk`) hashes ``named_parameters()``. A layer whose
quantization method moved its weights elsewhere leaves nothing there to
hash: vLLM's CPU W8A8 int8 kernel packs the int8 weight into a oneDNN handle
and sets ``weight = None``, so only the scales remain parameters, and a
checksum of them matches before and after an update that never reached the
weights (issue 55: a reload that left the engine generating zeros verified
as a MATCH). Such a layer is *unseen*, and a checksum must say so.

A layer is unseen where a parameter that holds weights (``weight``,
``qweight``, ``weight_packed`` and their kin; never a bias or a scale) is
registered as ``None``, or is empty while its layer says it has rows and
columns, on a module with a quantization method other than vLLM's
unquantized ones. vLLM's CPU backend also empties unquantized linear weights
into packed buffers; that long-known case is reported by :func:`unseen` only
where asked (``unquantized=True``), since every CPU server's keys have
always held those empty tensors (docs/vllm.md, limitations).

Each unseen parameter becomes a key ``{prefix}unseen:{name}`` whose value is
a fresh random 64-hex string on every call: no comparison of it can ever
match, so neither vLLM's own ``compare`` nor any client that compares digest
maps can report a match over weights nobody hashed, and clients that know
the ``unseen:`` scope report it by name (``verify``'s ``UNVERIFIED``).
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from typing import Any

#: The key scope of an unseen parameter: ``dp0:pp0:pcp0:tp0:unseen:{name}``.
UNSEEN_SCOPE = "unseen:"

#: vLLM's (and SGLang's) methods that leave the bytes they load in the parameters.
_UNQUANTIZED = ("UnquantizedLinearMethod", "UnquantizedEmbeddingMethod", "UnquantizedFusedMoEMethod")

#: Parameter names that never hold weights: an absent bias, dynamic scales.
_NOT_WEIGHTS = ("bias", "input_scale", "input_zero_point", "azp_adj")


def holds_weights(name: str) -> bool:
    """Whether a parameter of this name holds a layer's weights (never a bias, a scale or a zero point)."""
    if name in _NOT_WEIGHTS or "scale" in name or "zero" in name or name.endswith("g_idx"):
        return False
    return name == "weight" or name.endswith("weight") or name.endswith("weight_packed") or name == "qweight"


def _declared_size(module: Any) -> int:
    """Rows x columns the layer declares for its shard (0 where it says none)."""
    rows = getattr(module, "output_size_per_partition", None)
    cols = getattr(module, "input_size_per_partition", None)
    if isinstance(rows, int) and isinstance(cols, int):
        return rows * cols
    return 0


def _kernel_name(method: Any, module: Any = None) -> str:
    """The quantization method, and the kernel it handed the weights to where
    it names one, a few attributes deep (compressed-tensors keeps it on the
    layer's scheme: ``CompressedTensorsLinearMethod / CPUInt8ScaledMMLinearKernel``)."""
    kernels: set[str] = set()
    level = [method, getattr(module, "scheme", None)]
    for _ in range(3):
        found = []
        for obj in level:
            for value in getattr(obj, "__dict__", {}).values():
                if isinstance(value, (str, bytes, int, float, bool, type)) or value is None:
                    continue
                if type(value).__name__.endswith("Kernel"):
                    kernels.add(type(value).__name__)
                found.append(value)
        level = found[:64]
    return " / ".join([type(method).__name__, *sorted(kernels)])


def unseen(model: Any, *, unquantized: bool = False) -> dict[str, str]:
    """``{parameter name: why it is unseen}`` for every weight-holding
    parameter of ``model`` that is ``None`` or emptied (see the module's
    docstring); names as ``named_parameters()`` would give them."""
    out: dict[str, str] = {}
    for module_name, module in _modules(model):
        method = getattr(module, "quant_method", None)
        if method is None:
            continue
        quantized = type(method).__name__ not in _UNQUANTIZED
        if not quantized and not unquantized:
            continue
        params = getattr(module, "_parameters", None) or {}
        for pname, p in params.items():
            if not holds_weights(pname):
                continue
            name = f"{module_name}.{pname}" if module_name else pname
            if p is None:
                kernel = _kernel_name(method, module)
                out[name] = f"no tensor: {kernel} holds this layer's weights outside its parameters"
            elif getattr(p, "numel", lambda: 1)() == 0 and _declared_size(module) > 0:
                kernel = _kernel_name(method, module)
                out[name] = f"emptied: {kernel} moved this layer's weights into a packed buffer"
    return out


def _modules(model: Any) -> Iterator[tuple[str, Any]]:
    named = getattr(model, "named_modules", None)
    if callable(named):
        yield from named()


def unseen_keys(found: dict[str, str], prefix: str) -> dict[str, str]:
    """``{prefix}unseen:{name}`` -> a fresh random digest, for each unseen parameter."""
    return {f"{prefix}{UNSEEN_SCOPE}{name}": secrets.token_hex(32) for name in found}


def is_unseen_key(key: str) -> bool:
    """Whether ``key`` names an unseen parameter (any rank prefix)."""
    return f":{UNSEEN_SCOPE}" in key or key.startswith(UNSEEN_SCOPE)


def unseen_name(key: str) -> str:
    """``model.layers.0.mlp.down_proj.weight`` of ``dp0:pp0:pcp0:tp0:unseen:model.layers.0.mlp.down_proj.weight``."""
    return key.split(UNSEEN_SCOPE, 1)[1]


def unseen_warning(keys: list[str]) -> str:
    """One line naming the parameters no digest covers (``keys``: ``unseen:`` keys)."""
    names = sorted({unseen_name(k) for k in keys})
    shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
    return (
        f"{len(names)} weight tensor(s) are held outside the model's parameters (a quantization kernel packed them "
        f"into a buffer of its own), so no digest covers them: {shown}"
    )
