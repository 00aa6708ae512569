"""Where the expected tensors and their transformed candidates come from: TensorMap, ExpectedSource, versions."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from weight_checker.errors import WeightCheckerError

# Module, not names: recompute.expected_tensors is looked up at call time (tests count its calls there).
from weight_checker.expected import recompute
from weight_checker.expected.transforms import TRANSFORMS, transformed

# Named apart from this module's applies(t, name), which takes its arguments the other way round.
from weight_checker.expected.transforms import applies as changes
from weight_checker.verify.explain.model import ExpectedTensors, Table, Version


def with_candidates(source: ExpectedTensors, keys: Sequence[str]) -> tuple[Table, bool]:
    """The expected tensors of ``keys`` and, where the source gives them at no
    extra cost (a ``with_candidates(keys)`` method: the recompute, which
    loads and checks the weights once for both), the transformed candidates
    too. ``(table, whether the candidates are in it)``."""
    both = getattr(source, "with_candidates", None)
    if callable(both):
        try:
            return both(keys), True
        except WeightCheckerError:
            refused = getattr(source, "refused", None) or {}
            if all(k in refused for k in keys):
                raise  # every expected tensor refused: asking for them alone would refuse them again
            # Else a candidate it could not give: it must not cost the expected tensors, asked alone below.
    return source.tensors(keys, ()), False


class TensorMap:
    """Expected tensors the caller holds, ``{key: tensor}`` as each rank
    holds it (an in-process engine's layout). Transforms are computed on
    those tensors, which is exact where the source had the engine's dtype
    and layout (a dtype round trip of a bf16 source, a square matrix
    transposed at TP=1)."""

    def __init__(self, tensors: Mapping[str, Any]):
        self._tensors = dict(tensors)

    def tensors(self, keys: Sequence[str], transforms: Sequence[str]) -> dict[str, dict[str | None, Any]]:
        out: dict[str, dict[str | None, Any]] = {}
        for key in keys:
            if key in self._tensors:
                t = self._tensors[key].detach()
                out[key] = {None: t, **{name: LazyTransform(t, name) for name in transforms if applies(t, name)}}
        return out


def applies(t: Any, name: str) -> bool:
    """Whether transform ``name`` changes a tensor like ``t`` at all (the recompute's rule)."""
    return changes(name, t)


class LazyTransform:
    """``transform(t, name)``, computed a block at a time: a candidate is
    tried on the first block of each run first, so a transform that does not
    match costs a block, not the tensor."""

    def __init__(self, t: Any, name: str):
        self.t, self.name = t, name
        self.nbytes = int(t.numel()) * t.element_size()

    def block(self, start: int, end: int) -> Any:
        """Bytes ``[start, end)`` of the transformed tensor's C-order bytes."""
        import torch  # an optional dependency: only a tensor's own bytes need it

        size = self.t.element_size()
        if self.name == "transposed":  # rows of t.T are columns of t
            row = self.t.shape[1] * size
            first, last = start // row, -(-end // row)
            rows = self.t[:, first:last].t().contiguous().reshape(-1).view(torch.uint8)
            return rows[start - first * row : end - first * row]
        first, last = start // size, -(-end // size)
        part = transform(self.t.reshape(-1)[first:last], self.name).contiguous().view(torch.uint8)
        return part[start - first * size : end - first * size]


def transform(t: Any, name: str) -> Any:
    """``t`` transformed by ``name`` (one of :data:`TRANSFORMS`), or ``None``
    where it does not apply: the recompute's own transform, applied to a
    tensor the caller gave."""
    return transformed(name, t)


class ExpectedSource:
    """The expected tensors of :func:`weight_checker.expected_digests`'
    result, recomputed for the named keys only
    (:func:`weight_checker.expected.recompute.expected_tensors`: every
    tensor it gives hashes to the expected digest, else it refuses)."""

    def __init__(self, expected: Any):
        self.expected = expected
        #: Why a key's expected tensor could not be given (the explanation's note for it).
        self.refused: dict[str, str] = {}

    def tensors(self, keys: Sequence[str], transforms: Sequence[str]) -> Mapping[str, Mapping[str | None, Any]]:
        # Asked for transforms, the explanation uses only the transformed
        # tensors (new tensors of their own, or computed a block at a time
        # where the transform is elementwise); the untransformed, checked
        # against its digest again, is not kept: where it is one piece of a
        # weight no copy of it is made (fused or strided ones are copied).
        return self._each(keys, transforms, copy=not transforms)

    def with_candidates(self, keys: Sequence[str]) -> Table:
        """The expected tensors (copies: hashed in blocks later, while the
        trainer may run) and the transformed candidates that need no second
        load of the weights (the elementwise ones of parameters tiled by the
        weights' elements, computed a block at a time when tried), from one
        load and one check of the weights, against a second load and check
        of every tensor when asked for later. A candidate that needs the
        transformed weights loaded again (a transposed square weight, an
        elementwise one through the loader's own conversion) is
        :data:`~weight_checker.expected.transforms.DEFERRED`: computed only
        if blocks are still unexplained when it is tried."""
        return self._each(keys, TRANSFORMS, copy=True, defer=True)

    def unchecked(self, keys: Sequence[str], transforms: Sequence[str], defer: bool = True) -> Table:
        """The expected tensors (views, or read a block at a time) and the
        transformed candidates, from one load of the weights and no hash of
        them: the caller checks each block it reads against the chain
        states the expected digests recorded (an explanation that found the
        differing blocks from those states: :mod:`.chained`). ``defer``: as
        :meth:`with_candidates` leaves what needs the weights loaded again."""
        return self._each(keys, transforms, copy=False, defer=defer, check=False)

    def _each(
        self, keys: Sequence[str], transforms: Sequence[str], copy: bool, defer: bool = False, check: bool = True
    ) -> Table:
        for key in keys:
            self.refused.pop(key, None)
        kw = {"copy": copy, "lazy": True, "defer": defer, "check": check}
        try:
            return recompute.expected_tensors(self.expected, list(keys), transforms, **kw)
        except WeightCheckerError as e:
            if len(keys) == 1:
                self.refused[keys[0]] = str(e)
                raise
        # One key it cannot give must not hide the others'.
        out: dict[str, Mapping[str | None, Any]] = {}
        first: WeightCheckerError | None = None
        for key in keys:
            try:
                out.update(recompute.expected_tensors(self.expected, [key], transforms, **kw))
            except WeightCheckerError as e:
                self.refused[key] = str(e)
                first = first or e
        if not out and first is not None:
            raise first
        return out

    def confirm(self, keys: Sequence[str]) -> None:
        """Raises unless the weights still give the expected digests of
        ``keys`` (recomputed and hashed again, no copy kept)."""
        recompute.expected_tensors(self.expected, list(keys), copy=False)


def source_for(expected: Any) -> ExpectedTensors | None:
    """Where the expected tensors of ``expected`` come from: an
    :class:`ExpectedTensors` as given, expected digests that can recompute
    their tensors, else ``None`` (digests only: a manifest)."""
    if expected is None:
        return None
    if callable(getattr(expected, "tensors", None)):
        return expected  # type: ignore[no-any-return]
    return ExpectedSource(expected) if recompute.can_recompute(expected) else None


def versions_from(history: Sequence[Any]) -> list[Version]:
    """Previous versions, newest first, from expected digests (labelled by
    their ``weight_version``, else ``previous-1``, ``previous-2``...) or
    ``(label, expected digests)`` pairs."""
    out = []
    for i, item in enumerate(history):
        label, digests = item if isinstance(item, tuple) else (None, item)
        label = label or getattr(digests, "weight_version", None) or f"previous-{i + 1}"
        out.append(Version(str(label), digests, source_for(digests)))
    return out
