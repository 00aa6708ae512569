"""A sharded call's layout, kept for the next call with the same shards.

A trainer calls ``expected_digests`` with its shards at every step, and from
one step to the next nothing a layout is made of changes: the model's
config, the engine's arguments, every rank's shard shapes and offsets. Only
the bytes do. Making the layout runs the engine's loaders on address space
and cuts every key's runs at the holders' boundaries: 15-30 ms a call on a
1 GB Llama at TP=1, and about 0.1 s at TP=2, where a row-parallel key is a
run a row (tens of thousands of runs). So the last :data:`KEEP` layouts are
kept (each leg as runs of rows: :func:`.sharded.compact`), each under a
signature of everything it was made from: the model directory's configs
(read), its code files (size and time), the engine's arguments and every
rank's shard shapes and offsets. Anything that cannot be told apart by
value (an object shown by its address) is never kept. Not in the signature:
environment variables and the installed engine, which do not change within
a process; :func:`forget` drops every kept layout.
"""

from __future__ import annotations

import copy
import hashlib
import os
import threading
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

#: Layouts kept (two models, or two layouts of one, used in turn).
KEEP = 2
#: Arguments that change between calls without changing the layout: set
#: afresh on the result, never part of the signature.
PER_CALL = frozenset({"weight_version"})
#: A JSON file up to this size is read whole into the signature (a config);
#: a larger one (a tokenizer's) by its size and time.
_READ = 1 << 20

_KEPT: OrderedDict[str, tuple[Any, ...]] = OrderedDict()
_LOCK = threading.Lock()


def _config_files(model: Any) -> list[tuple[str, Any]]:
    """The model directory's JSON files (its config, the generation and
    quantization configs), each by its content, and its Python files (a
    model's own code) by size and time: an edited config is a new layout."""
    path = model
    if isinstance(model, Mapping):
        path = model.get("model")
    elif not isinstance(model, str | os.PathLike):
        path = getattr(model, "model", None)
    if not isinstance(path, str | os.PathLike) or not os.path.isdir(path):
        return []
    out: list[tuple[str, Any]] = []
    for entry in os.scandir(os.fspath(path)):
        name = str(entry.name)
        if not name.endswith((".json", ".py")) or not entry.is_file():
            continue
        st = entry.stat()
        if name.endswith(".json") and st.st_size <= _READ:
            with open(entry.path, "rb") as f:
                out.append((name, hashlib.sha256(f.read()).hexdigest()))
        else:
            out.append((name, (st.st_mtime_ns, st.st_size)))
    return sorted(out)


def signature(model: Any, every: list[Any], cast_to: Any, args: Mapping[str, Any]) -> str | None:
    """What the layout is made from, as one digest; ``None`` where part of
    it is an object told only by its address (never kept)."""
    made_of = [model, sorted((k, v) for k, v in args.items() if k not in PER_CALL), str(cast_to)]
    text = repr(made_of)
    if " at 0x" in text or "object at" in text:
        return None
    text += repr((_config_files(model), every))
    return hashlib.sha256(text.encode()).hexdigest()


def kept(sig: str | None, args: Mapping[str, Any]) -> tuple[Any, ...] | None:
    """The kept ``(layout, shell, keys, legs, plans)`` under ``sig``, its
    shell a fresh copy with this call's weight version (and no loader time),
    the rest shared with the next call (the plans made so far included)."""
    with _LOCK:
        if sig is None or sig not in _KEPT:
            return None
        _KEPT.move_to_end(sig)
        layout, shell, *rest = _KEPT[sig]
    shell = copy.deepcopy(shell)
    shell.weight_version = args.get("weight_version")
    if "load" in shell.seconds:
        shell.seconds["load"] = 0.0  # no loader ran this call (it was the first call's time)
    return (layout, shell, *rest)


def keep(sig: str | None, entry: tuple[Any, ...]) -> None:
    """Keep ``(layout, shell, keys, legs, plans)`` (the shell copied: the caller fills its own)."""
    if sig is None:
        return
    layout, shell, *rest = entry
    kept = (layout, copy.deepcopy(shell), *rest)
    with _LOCK:
        _KEPT[sig] = kept
        _KEPT.move_to_end(sig)
        while len(_KEPT) > KEEP:
            _KEPT.popitem(last=False)


def forget() -> None:
    """Drop every kept layout."""
    with _LOCK:
        _KEPT.clear()
