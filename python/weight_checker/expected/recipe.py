"""The recompute's recipe: what ``expected_digests`` remembers of a call's engine and weights, read again later.

:func:`~weight_checker.expected.digests.expected_digests` keeps what a
recompute needs (:func:`remember`): the engine's configuration and where the
weights came from, never the weights themselves. A checkpoint is read again;
the trainer's tensors (a mapping or a list of pairs) are held by weak
references, each with its version counter and a weak reference to its memory
(a ``state_dict()``'s tensors are made for the call, but their memory is the
model's). What cannot be read again as it was (a one-shot iterator, a
callable, a lazy mapping) is refused by
:func:`~weight_checker.expected.recompute.expected_tensors`, saying why.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from weight_checker.errors import ExpectedDigestsError
from weight_checker.expected.weights import HELD, MAPPINGS, CheckpointWeights

__all__ = ["CHANGED", "Recipe", "WeightsReadAgain", "pairs_for", "read_again", "remember"]

#: Why a recompute is refused when the weights no longer give the digests.
CHANGED = "the expected tensors changed since the digests were computed (a trainer that updates in place?)"


# --- what expected_digests keeps ---------------------------------------------------------------


_TORCH: tuple[Any, Any] | None = None


def _torch_and_weak_ref() -> tuple[Any, Any]:
    """torch and its ``StorageWeakRef``, imported once (each of the trainer's
    weights is recorded at every ``expected_digests`` call: an import
    statement a weight cost more than the rest of its record)."""
    global _TORCH
    if _TORCH is None:
        # torch: imported when first used, so `import weight_checker` runs without it.
        import torch
        from torch.multiprocessing.reductions import StorageWeakRef

        _TORCH = (torch, StorageWeakRef)
    return _TORCH


class _Held:
    """One of the trainer's weights, held weakly: the tensor, its version
    counter then, and its memory (a weak reference to the storage, with the
    view's place in it), so that a tensor made for the call (``state_dict()``
    detaches every parameter anew) can be found again while its memory lives."""

    __slots__ = ("dtype", "name", "offset", "ref", "shape", "storage", "storage_at", "stride", "version")

    def __init__(self, name: str, tensor: Any):
        torch, storage_weak_ref = _torch_and_weak_ref()
        self.name = name
        self.ref: Any = None
        self.version: int | None = None
        self.storage: Any = None
        self.storage_at: tuple[int, int] | None = None
        if not isinstance(tensor, torch.Tensor):
            return
        self.ref = weakref.ref(tensor)
        self.dtype, self.shape, self.stride = tensor.dtype, tuple(tensor.shape), tuple(tensor.stride())
        self.offset = tensor.storage_offset()
        try:
            self.version = tensor._version
        except RuntimeError:  # an inference tensor: torch keeps no version counter
            self.version = None
        try:
            storage = tensor.untyped_storage()
            self.storage = storage_weak_ref(storage)
            self.storage_at = (int(storage.data_ptr()), int(storage.nbytes()))
        except (RuntimeError, NotImplementedError, TypeError):
            self.storage = None

    def tensor(self) -> Any:
        """The weight as it was given, or ``None`` where neither the tensor
        nor its memory lives any longer. Raises if it was written in place."""
        # torch: imported when first used, so `import weight_checker` runs without it.
        import torch

        t = self.ref() if self.ref is not None else None
        if t is not None:
            try:
                version = t._version
            except RuntimeError:
                version = None
            if version != self.version:
                raise _Changed(f"weight '{self.name}' was written in place since")
            return t
        if self.storage is None or self.storage.expired():
            return None
        storage = torch.UntypedStorage._new_with_weak_ptr(self.storage.cdata)  # type: ignore[attr-defined]
        if storage is None:
            return None
        if (int(storage.data_ptr()), int(storage.nbytes())) != self.storage_at:
            return None  # freed or resized (an FSDP reshard): not the memory it was
        return torch.empty(0, dtype=self.dtype, device=storage.device).set_(
            storage, self.offset, self.shape, self.stride
        )


class _Changed(Exception):
    """A weight written since the digests were computed (named by the caller with its keys)."""


class _Gone(Exception):
    """A weight that cannot be read again (named by the caller with its keys)."""


class Recipe:
    """What :func:`~.recompute.expected_tensors` needs to recompute a call's tensors:
    the engine (model, layout, engine arguments, the configuration cache's
    key) and the weights (a checkpoint, the trainer's tensors held weakly, or
    why they cannot be read again)."""

    def __init__(
        self,
        model: Any,
        cache_key: str | None,
        settings: dict[str, Any],
        checkpoint: Path | None = None,
        files: list[tuple[str, tuple[int, int, int, int]]] | None = None,
        held: list[_Held] | None = None,
        refusal: str | None = None,
    ):
        self.model = dict(model) if isinstance(model, Mapping) else model
        self.cache_key = cache_key
        self.settings = settings
        self.checkpoint = checkpoint
        self.files = files or []
        self.held = held
        self.refusal = refusal

    def __copy__(self) -> Recipe:
        return self

    def __deepcopy__(self, memo: Any) -> Recipe:
        return self

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        # Weak references do not cross processes: a copy there recomputes nothing.
        reason = "these expected digests were copied from another process (weak references do not travel)"
        return (Recipe, (None, None, {}, None, None, None, reason))


def _stat(path: Path) -> tuple[int, int, int, int]:
    st = path.stat()
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def remember(
    model: Any,
    weights: Any,
    checkpoint: Path | None,
    cache_key: str | None,
    source: Any = None,
    **settings: Any,
) -> Recipe:
    """What :func:`~.recompute.expected_tensors` will need, kept by
    :func:`~weight_checker.expected.digests.expected_digests` once its
    digests are made: nothing of the weights but weak references (or the
    checkpoint's path). ``settings``: ``tp``, ``pp``, ``dp``, ``dtype``,
    ``engine_args``, ``lora``, ``draft``, ``moe_dp``."""

    def checkpoint_recipe(path: Path) -> Recipe:
        files = getattr(getattr(source, "checkpoint", None), "files", None) or []
        try:
            stats = [(str(f), _stat(Path(f))) for f in files]
        except OSError:
            stats = []
        return Recipe(model, cache_key, settings, checkpoint=path, files=stats)

    if weights is None and checkpoint is not None:
        return checkpoint_recipe(checkpoint)
    if isinstance(weights, (str, Path)):
        return checkpoint_recipe(Path(weights))
    if isinstance(weights, Mapping):
        if type(weights) not in HELD:
            return Recipe(model, cache_key, settings, refusal=(
                f"the weights were a lazy mapping ({type(weights).__name__}), read as it was iterated: it cannot be "
                "read again as it was; give a dict, a list of pairs or a checkpoint"
            ))  # fmt: skip
        pairs: Iterable[Any] = weights.items()
    elif callable(weights):
        return Recipe(model, cache_key, settings, refusal=(
            "the weights came from a callable, which need not give the same tensors again; give a dict, a list of "
            "pairs or a checkpoint"
        ))  # fmt: skip
    elif type(weights) in HELD:
        pairs = weights
    elif iter(weights) is weights:
        return Recipe(model, cache_key, settings, refusal=(
            "the weights were a one-shot iterator, read already; give a dict, a list of pairs or a checkpoint"
        ))  # fmt: skip
    else:
        return Recipe(model, cache_key, settings, refusal=(
            f"the weights were a {type(weights).__name__}, which need not give the same tensors again; give a "
            "dict, a list of pairs or a checkpoint"
        ))  # fmt: skip
    # The records allocate a few objects a weight: the cyclic collector, run
    # by allocations, would scan the trainer's whole heap again and again
    # (4x the records' own cost at 20k weights): off while they are made.
    collecting = gc.isenabled()
    gc.disable()
    try:
        held = [_Held(name, tensor) for name, tensor in pairs]
    except Exception as e:  # never the digests' failure: only their explanation's
        return Recipe(model, cache_key, settings, refusal=f"the weights could not be held weakly: {e}")
    finally:
        if collecting:
            gc.enable()
    return Recipe(model, cache_key, settings, held=held)


# --- the weights, read again -------------------------------------------------------------------


class WeightsReadAgain:
    """The names of a call's weights (in order), and the tensors of those asked for."""

    def __init__(self, recipe: Recipe):
        self.recipe = recipe
        self._checkpoint: Any = None
        self._mapped_before: set[Any] = set()
        if recipe.held is not None:
            self.names = [h.name for h in recipe.held]
            self._held = recipe.held
        else:
            assert recipe.checkpoint is not None
            for file, stat in recipe.files:
                try:
                    now = _stat(Path(file))
                except OSError:
                    now = None
                if now != stat:
                    raise _Changed(f"the checkpoint file {file} was changed or removed since")
            self._mapped_before = set(MAPPINGS)
            self._checkpoint = CheckpointWeights(recipe.checkpoint)
            self._views = dict(self._checkpoint)
            self.names = list(self._views)

    def pairs(self, names: set[str] | None) -> list[tuple[str, Any]]:
        """The ``(name, tensor)`` pairs of ``names`` (``None``: all), in the
        order given. Raises :class:`_Changed` for one written since, and
        :class:`_Gone` for one freed."""
        if self._checkpoint is not None:
            return [(n, t) for n, t in self._views.items() if names is None or n in names]
        out = []
        for held in self._held:
            if names is not None and held.name not in names:
                continue
            if held.ref is None:
                raise _Gone(f"weight '{held.name}' is not a torch tensor: it cannot be held weakly")
            tensor = held.tensor()
            if tensor is None:
                raise _Gone(
                    f"weight '{held.name}' was freed since expected_digests returned (its tensor and its memory): "
                    "keep the weights alive until the check is explained, or give a checkpoint"
                )
            out.append((held.name, tensor))
        return out

    def close(self) -> None:
        """Drops the checkpoint mappings this recompute made (an expected_digests call keeps its own)."""
        if self._checkpoint is None:
            return
        self._views = {}
        for key in [k for k in MAPPINGS if k not in self._mapped_before]:
            del MAPPINGS[key]
        self._checkpoint = None


def read_again(recipe: Recipe, keys: Sequence[str]) -> WeightsReadAgain:
    """The recipe's weights, opened to be read again for ``keys`` (named
    where a checkpoint file changed since)."""
    try:
        return WeightsReadAgain(recipe)
    except _Changed as e:
        raise ExpectedDigestsError(f"{', '.join(keys)}: {CHANGED}: {e}") from None


def pairs_for(weights: WeightsReadAgain, names: set[str] | None, keys: list[str]) -> list[tuple[str, Any]]:
    """:meth:`WeightsReadAgain.pairs`, refused naming ``keys`` where a weight changed or was freed since."""
    try:
        return weights.pairs(names)
    except _Changed as e:
        raise ExpectedDigestsError(f"{', '.join(keys)}: {CHANGED}: {e}") from None
    except _Gone as e:
        raise ExpectedDigestsError(f"{', '.join(keys)}: cannot recompute the expected tensors: {e}") from None
