"""A rank's parameters located: the weights that feed them, loaded by vLLM's loader, their bytes hashed where they lie.

Of the weights, only those that feed the keys are loaded where that can be
told (:func:`feeding`: vLLM's own name mapping), through vLLM's loader under
the deferred writes of :mod:`.deferred` (:func:`load_located`): a parameter
the loader copies whole from the weights lies in those weights, and is hashed
where they lie (:func:`digests_of`), on another core (:class:`Beside`), while
it is copied out.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from weight_checker.expected.vllm.load_tracker import LoadTracker
from weight_checker.expected.vllm.rank_model import load_weights_into
from weight_checker.expected.weights import Pass
from weight_checker.hashing.digests import digest_tensors

__all__ = ["Beside", "Located", "digests_of", "feeding", "load_located", "replay_into", "storage_of"]


# --- which weights feed a parameter ----------------------------------------------------------------


def feeding(model: Any, names: Iterable[str], sources: list[str]) -> list[set[str]]:
    """Sets of source names that may feed the parameters ``names`` of
    ``model``, narrowest first (vLLM's name mapping: those mapped onto the
    parameter itself; then those under its module or a module packed into
    it; then those under each module above it, short of the model's own),
    each tried before the next; the caller then loads them all."""
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    map_name = getattr(mapper, "map_name", None)
    packed: Mapping[str, list[str]] = getattr(model, "packed_modules_mapping", None) or {}

    def mapped(source: str) -> str | None:
        if map_name is None:
            return source
        try:
            result = map_name(source)
        except Exception:
            return source
        return result if isinstance(result, str) else None

    targets = {n.replace(".base_layer", "") for n in names}
    modules: set[str] = set()
    exact: set[str] = set(targets)
    for target in targets:
        module, _, attr = target.rpartition(".")
        if not module:
            continue
        modules.add(module)
        parent, _, leaf = module.rpartition(".")
        for part in packed.get(leaf, ()):
            alias = f"{parent}.{part}" if parent else part
            modules.add(alias)
            exact.add(f"{alias}.{attr}")
    as_mapped = {s: mapped(s) for s in sources}

    def under(prefixes: set[str]) -> set[str]:
        return {s for s, m in as_mapped.items() if any(x.startswith(p + ".") for x in (s, m or "") for p in prefixes)}

    levels = [{s for s, m in as_mapped.items() if s in exact or m in exact}, under(modules)]
    # Then the modules above, short of the model's own (MoE experts: each expert
    # under `experts.`, the stacked parameters under `experts.routed_experts.`).
    while modules := {m.rpartition(".")[0] for m in modules if "." in m.rpartition(".")[0]}:
        levels.append(under(modules))
    out: list[set[str]] = []
    for level in levels:
        if level and (not out or level != out[-1]):
            out.append(level)
    return out


# --- one rank, loaded ------------------------------------------------------------------------------


def _fresh(shape: Sequence[int], dtype: Any) -> Any:
    # torch: imported when first used, so `import weight_checker` runs without it.
    import torch

    return torch.empty(tuple(shape), dtype=dtype)


class Located:
    """Where a parameter's bytes lie once loaded: the deferred pieces that
    tile it (views of the weights, or zeros), or the parameter itself."""

    __slots__ = ("dtype", "param", "pieces", "shape", "start")

    def __init__(self, param: Any, start: int, pieces: list[Any] | None):
        self.param, self.start, self.pieces = param, start, pieces
        self.shape, self.dtype = tuple(param.shape), param.dtype

    def hashable_in_place(self) -> bool:
        # .deferred needs torch: imported when first used, so `import weight_checker` runs without it.
        from weight_checker.expected.vllm.deferred import rows_contiguous

        return self.pieces is not None and all(p.source is None or rows_contiguous(p.source) for p in self.pieces)

    def copy(self, owned: set[int], view: bool = False) -> Any:
        """The bytes, in a tensor of their own: a piece the caller made
        (``owned``: its storages) that is the whole parameter is taken as it
        is, and with ``view`` any one contiguous piece (a view of the weights)."""
        # torch: imported when first used, so `import weight_checker` runs without it.
        import torch

        if self.pieces is None:
            out = _fresh(self.shape, self.dtype)
            out.copy_(self.param.data)
            return out
        if len(self.pieces) == 1 and self.pieces[0].source is not None:
            src = self.pieces[0].source
            if src.is_contiguous() and tuple(src.shape) == self.shape:
                whole = src.storage_offset() == 0 and src.nbytes == src.untyped_storage().nbytes()
                if view or (whole and storage_of(src) in owned):
                    return src  # a tensor the transform made, all of it this parameter; or a view asked for
        out = _fresh(self.shape, self.dtype)
        flat = out.view(-1).view(torch.uint8)
        with torch.no_grad():
            for piece in self.pieces:
                region = flat[piece.offset - self.start : piece.offset - self.start + piece.nbytes]
                if piece.source is None:
                    region.zero_()
                else:
                    region.view(piece.dtype).view(piece.shape).copy_(piece.source)
        return out


def storage_of(t: Any) -> int | None:
    """The address of ``t``'s storage (``None``: it has none to give): which weight, or which copy, it is."""
    try:
        return int(t.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError, TypeError):
        return None


def load_located(
    model: Any, model_config: Any, arena: Any, pairs: list[tuple[str, Any]], params: dict[str, Any], zero: bool
) -> dict[str, Located] | None:
    """``pairs`` loaded into ``model`` by vLLM's loader (under the deferred
    writes): where each of ``params`` lies then. ``None``: a parameter the
    load may not have written in full, whose bytes were not zeroed first
    (the caller loads again with ``zero``)."""
    # .deferred needs torch: imported when first used, so `import weight_checker` runs without it.
    from weight_checker.expected.vllm.deferred import DeferredWrites

    bound = arena.bind(model, zero=False)
    if zero:
        for p in params.values():
            if p.numel():
                p.data.zero_()
    tracker = LoadTracker(model)
    deferred = DeferredWrites(arena.buffer, bound)
    base = arena.buffer.untyped_storage().data_ptr()
    load_weights_into(model, model_config, Pass(pairs, stable=True), tracker, deferred)
    out: dict[str, Located] = {}
    try:
        for name, p in params.items():
            if not p.numel():
                out[name] = Located(p, 0, [])
                continue
            start = p.data_ptr() - base
            pieces = deferred.tiled(start, p.nbytes)
            if pieces is not None:
                out[name] = Located(p, start, pieces)
            elif zero or (tracker.tracked(p) and not tracker.incomplete([p])):
                deferred.replay(start)  # its bytes in the arena: written in full, or over zeros
                out[name] = Located(p, start, None)
            else:
                return None
        return out
    finally:
        deferred.release()


# --- hashed where they lie ------------------------------------------------------------------------


def digests_of(located: Mapping[str, Located]) -> dict[str, str]:
    """SHA-256 of each parameter's bytes where they lie (run beside the copies)."""
    # .deferred needs torch: imported when first used, so `import weight_checker` runs without it.
    from weight_checker.expected.vllm.deferred import PendingDigests

    out: dict[str, str] = {}
    later = PendingDigests()
    names, tensors = [], []
    for name, where in located.items():
        if where.pieces is not None and not where.pieces:
            out[name] = hashlib.sha256(b"").hexdigest()
        elif where.hashable_in_place():
            later.add(name, where.pieces)  # type: ignore[arg-type]
        elif where.pieces is not None and len(where.pieces) == 1:
            where.pieces[0].check()
            names.append(name)
            tensors.append(where.pieces[0].source)
        elif where.pieces is not None:
            raise AssertionError("several pieces, not hashable in place: replayed by the caller")
        else:
            names.append(name)
            tensors.append(where.param.data)
    out.update(later.finish())
    if names:
        out.update(zip(names, digest_tensors(names, tensors)[0], strict=True))
    return out


class Beside:
    """``work()`` run on a thread of its own (the core hashes without the
    GIL) while the caller copies: :meth:`result` joins it."""

    def __init__(self, work: Any):
        self._value: list[Any] = []
        self._error: list[BaseException] = []

        def run() -> None:
            try:
                self._value.append(work())
            except BaseException as e:  # re-raised in the caller's thread
                self._error.append(e)

        self._thread = threading.Thread(target=run, name="weight-checker-recompute", daemon=True)
        self._thread.start()

    def result(self) -> Any:
        self._thread.join()
        if self._error:
            raise self._error[0]
        return self._value[0]


def replay_into(where: Located) -> None:
    """A parameter tiled by strided pieces: its bytes put in place, read from there."""
    # torch: imported when first used, so `import weight_checker` runs without it.
    import torch

    assert where.pieces is not None
    data = where.param.data.view(-1).view(torch.uint8)
    with torch.no_grad():
        for piece in where.pieces:
            piece.check()
            region = data[piece.offset - where.start : piece.offset - where.start + piece.nbytes]
            if piece.source is None:
                region.zero_()
            else:
                region.view(piece.dtype).view(piece.shape).copy_(piece.source)
    where.pieces = None
