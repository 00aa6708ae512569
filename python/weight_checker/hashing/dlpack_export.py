"""Preparing awkward tensors for zero-copy export (called from the core)."""

from __future__ import annotations

from typing import Any


def dlpack_exportable(t: Any) -> Any:
    """A view of ``t`` with the same C-order bytes that DLPack can export.

    The core calls this only after torch refused to export ``t`` itself.
    Conjugate/negative bits are resolved (their logical bytes differ from
    memory; this copies, as vLLM's ``.contiguous()`` would). Dtypes DLPack
    refuses on some torch versions (bool, float8 variants, unsigned ints) are
    reinterpreted as bytes, which keeps strides and so stays zero-copy.
    """
    import torch

    t = t.detach()
    if t.is_complex() and (t.is_conj() or t.is_neg()):
        t = t.resolve_conj().resolve_neg()
    if t.element_size() == 1 or t.dim() == 0 or t.stride(-1) == 1:
        if t.dim() == 0:
            t = t.reshape(1)
        return t.view(torch.uint8)
    # Wider elements with a non-unit innermost stride cannot be reinterpreted
    # as bytes in place; copy (vLLM's reference copies every tensor anyway).
    return t.contiguous().view(torch.uint8)
