"""What a checksum covers: its scope.

``target`` is the model vLLM's own checker covers (the default, and the only
scope of ``{"action": "checksum"}``: byte-identical to vLLM); ``draft`` adds
the draft model of speculative decoding (keys ``...:draft:{name}``);
``lora`` adds every LoRA adapter in a slot (keys
``...:lora:{adapter}:{module}.lora_a`` / ``.lora_b``); ``buffers`` adds the
target model's persistent buffers (keys ``...:buffer:{name}``). How each is
walked in a vLLM worker: :mod:`weight_checker.integrations.vllm.scope_walk`.
"""

from __future__ import annotations

from typing import Any

from weight_checker.errors import InputError

SCOPES = ("target", "draft", "lora", "buffers")
#: The scope when none is given: what vLLM's own checker covers.
DEFAULT = ("target",)


def parse_include(include: Any) -> tuple[str, ...]:
    """The scope as a tuple in :data:`SCOPES` order: ``None`` is the target
    only; a list or a comma-separated string names some of
    :data:`SCOPES`. Raises :class:`InputError` naming what it does not accept."""
    if include is None:
        return DEFAULT
    if isinstance(include, str):
        include = [part.strip() for part in include.split(",") if part.strip()]
    if not isinstance(include, (list, tuple)) or not include:
        raise InputError(f"include must be a non-empty list of {', '.join(SCOPES)}, got {include!r:.80}")
    unknown = [s for s in include if s not in SCOPES]
    if unknown:
        raise InputError(f"include: unknown scope {unknown[0]!r:.80}; expected some of {', '.join(SCOPES)}")
    return tuple(s for s in SCOPES if s in include)


def scope_of(key: str) -> str:
    """``target``, ``draft``, ``lora`` or ``buffers``: which scope a key belongs to."""
    from weight_checker.keys import key_name

    name = key_name(key)
    if name.startswith("draft:"):
        return "draft"
    if name.startswith("lora:"):
        return "lora"
    if name.startswith("buffer:"):
        return "buffers"
    return "target"
