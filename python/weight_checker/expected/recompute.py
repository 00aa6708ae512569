"""The tensors behind expected digests, recomputed for the keys a failed check
names, with the tensors the same rank would hold had the trainer's weights
been transformed first (the candidate causes an explanation compares).

    expected = weight_checker.expected_digests("ckpt/", state_dict, tp=2)
    ...  # a check fails on dp0:pp0:pcp0:tp1:model.layers.3.self_attn.qkv_proj.weight
    tensors = expected_tensors(expected, [key], ["dtype-roundtrip:float16", "transposed"])
    tensors[key][None]                        # the bytes expected[key] is the SHA-256 of
    tensors[key]["dtype-roundtrip:float16"]   # had the weights gone through float16 first

:func:`~weight_checker.expected.digests.expected_digests` keeps what a
recompute needs (:func:`remember`): the engine's configuration and where the
weights came from, never the weights themselves. A checkpoint is read again;
the trainer's tensors (a mapping or a list of pairs) are held by weak
references, each with its version counter and a weak reference to its memory
(a ``state_dict()``'s tensors are made for the call, but their memory is the
model's). What cannot be read again as it was (a one-shot iterator, a
callable, a lazy mapping) is refused by :func:`expected_tensors`, saying why.

Exact or refused: every recomputed tensor is hashed and must equal the
digest; otherwise the key is named (the weights changed since). Only the
ranks the keys are on are loaded, and of the weights only those that feed the
keys where that can be told (vLLM's own name mapping: ``q_proj`` into
``qkv_proj``, each expert into the stacked experts), through vLLM's loader
under the deferred writes of :mod:`.deferred`: a parameter the loader copies
whole from the weights is hashed where they lie, on another core, while it is
copied out. Should that filter miss what writes a key, the rank is loaded
from all the weights instead. A rank model and the parameter arena of the
latest :func:`expected_digests` call are reused when the configuration is
the same, and left as the next call expects them.
"""

from __future__ import annotations

import gc
import hashlib
import re
import threading
import weakref
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from weight_checker.errors import ExpectedDigestsError
from weight_checker.expected.manifest import ExpectedDigests

__all__ = ["TRANSFORMS", "LazyPieces", "Recipe", "can_recompute", "expected_tensors", "remember"]

#: The candidate causes, by the names a report gives them.
TRANSFORMS = ("dtype-roundtrip:float16", "dtype-roundtrip:bfloat16", "truncate:bfloat16", "transposed")

_KEY = re.compile(r"dp(\d+):pp(\d+):pcp(\d+):tp(\d+):(.+)\Z", re.DOTALL)
_CHANGED = "the expected tensors changed since the digests were computed (a trainer that updates in place?)"


# --- what expected_digests keeps ---------------------------------------------------------------


_TORCH: tuple[Any, Any] | None = None


def _torch_and_weak_ref() -> tuple[Any, Any]:
    """torch and its ``StorageWeakRef``, imported once (each of the trainer's
    weights is recorded at every ``expected_digests`` call: an import
    statement a weight cost more than the rest of its record)."""
    global _TORCH
    if _TORCH is None:
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
    """What :func:`expected_tensors` needs to recompute a call's tensors:
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
    """What :func:`expected_tensors` will need, kept by
    :func:`~weight_checker.expected.digests.expected_digests` once its
    digests are made: nothing of the weights but weak references (or the
    checkpoint's path). ``settings``: ``tp``, ``pp``, ``dp``, ``dtype``,
    ``engine_args``, ``lora``, ``draft``, ``moe_dp``."""
    from weight_checker.expected.weights import _HELD

    def checkpoint_recipe(path: Path) -> Recipe:
        files = getattr(getattr(source, "_checkpoint", None), "files", None) or []
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
        if type(weights) not in _HELD:
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
    elif type(weights) in _HELD:
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


# --- the keys asked for --------------------------------------------------------------------------


class _Wanted:
    """The keys of one rank model, by parameter name (a dense model's DP
    replicas share their dp0 rank's model)."""

    def __init__(self, dp_rank: int | None, pp_rank: int, tp_rank: int):
        self.dp_rank, self.pp_rank, self.tp_rank = dp_rank, pp_rank, tp_rank
        self.names: dict[str, list[str]] = {}


def _wanted(expected: ExpectedDigests, recipe: Recipe, keys: Sequence[str]) -> list[_Wanted]:
    settings = recipe.settings
    ranks: dict[tuple[int | None, int, int], _Wanted] = {}
    for key in keys:
        if not isinstance(key, str):
            raise ExpectedDigestsError(f"keys must be strings, got {type(key).__name__}")
        m = _KEY.match(key)
        if m is None:
            raise ExpectedDigestsError(f"{key!r}: not a key dp{{d}}:pp{{p}}:pcp{{c}}:tp{{t}}:{{name}}")
        dp_rank, pp_rank, pcp, tp_rank = (int(g) for g in m.groups()[:4])
        name = m.group(5)
        scope = next((s for s in ("lora:", "draft:", "buffer:") if name.startswith(s)), None)
        if scope is not None:
            raise ExpectedDigestsError(
                f"{key}: the expected tensors of {scope[:-1]} keys are not supported yet (target keys only)"
            )
        if key not in expected:
            why = " (a parameter the weights never wrote)" if key in expected.unwritten else ""
            raise ExpectedDigestsError(f"{key}: not one of these expected digests' keys{why}")
        if pcp != 0 or dp_rank >= settings["dp"] or pp_rank >= settings["pp"] or tp_rank >= settings["tp"]:
            raise ExpectedDigestsError(f"{key}: not a rank of this layout")
        rank = (dp_rank if settings["moe_dp"] else None, pp_rank, tp_rank)
        ranks.setdefault(rank, _Wanted(*rank)).names.setdefault(name, []).append(key)
    return list(ranks.values())


# --- the weights, read again -------------------------------------------------------------------


class _Weights:
    """The names of a call's weights (in order), and the tensors of those asked for."""

    def __init__(self, recipe: Recipe):
        self.recipe = recipe
        self._checkpoint: Any = None
        self._mapped_before: set[Any] = set()
        if recipe.held is not None:
            self.names = [h.name for h in recipe.held]
            self._held = recipe.held
        else:
            from weight_checker.expected.weights import MAPPINGS, CheckpointWeights

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
        from weight_checker.expected.weights import MAPPINGS

        self._views = {}
        for key in [k for k in MAPPINGS if k not in self._mapped_before]:
            del MAPPINGS[key]
        self._checkpoint = None


def _feeding(model: Any, names: Iterable[str], sources: list[str]) -> list[set[str]]:
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
    import torch

    return torch.empty(tuple(shape), dtype=dtype)


class _Located:
    """Where a parameter's bytes lie once loaded: the deferred pieces that
    tile it (views of the weights, or zeros), or the parameter itself."""

    __slots__ = ("dtype", "param", "pieces", "shape", "start")

    def __init__(self, param: Any, start: int, pieces: list[Any] | None):
        self.param, self.start, self.pieces = param, start, pieces
        self.shape, self.dtype = tuple(param.shape), param.dtype

    def hashable_in_place(self) -> bool:
        from weight_checker.expected.deferred import _rows_contiguous

        return self.pieces is not None and all(p.source is None or _rows_contiguous(p.source) for p in self.pieces)

    def copy(self, owned: set[int], view: bool = False) -> Any:
        """The bytes, in a tensor of their own: a piece the caller made
        (``owned``: its storages) that is the whole parameter is taken as it
        is, and with ``view`` any one contiguous piece (a view of the weights)."""
        import torch

        if self.pieces is None:
            out = _fresh(self.shape, self.dtype)
            out.copy_(self.param.data)
            return out
        if len(self.pieces) == 1 and self.pieces[0].source is not None:
            src = self.pieces[0].source
            if src.is_contiguous() and tuple(src.shape) == self.shape:
                whole = src.storage_offset() == 0 and src.nbytes == src.untyped_storage().nbytes()
                if view or (whole and _storage_of(src) in owned):
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


def _storage_of(t: Any) -> int | None:
    try:
        return int(t.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError, TypeError):
        return None


def _load_located(
    model: Any, model_config: Any, arena: Any, pairs: list[tuple[str, Any]], params: dict[str, Any], zero: bool
) -> dict[str, _Located] | None:
    """``pairs`` loaded into ``model`` by vLLM's loader (under the deferred
    writes): where each of ``params`` lies then. ``None``: a parameter the
    load may not have written in full, whose bytes were not zeroed first
    (the caller loads again with ``zero``)."""
    from weight_checker.expected.deferred import DeferredWrites
    from weight_checker.expected.load_tracker import LoadTracker
    from weight_checker.expected.rank_model import _load
    from weight_checker.expected.weights import Pass

    bound = arena.bind(model, zero=False)
    if zero:
        for p in params.values():
            if p.numel():
                p.data.zero_()
    tracker = LoadTracker(model)
    deferred = DeferredWrites(arena.buffer, bound)
    base = arena.buffer.untyped_storage().data_ptr()
    _load(model, model_config, Pass(pairs, stable=True), tracker, deferred)
    out: dict[str, _Located] = {}
    try:
        for name, p in params.items():
            if not p.numel():
                out[name] = _Located(p, 0, [])
                continue
            start = p.data_ptr() - base
            pieces = deferred.tiled(start, p.nbytes)
            if pieces is not None:
                out[name] = _Located(p, start, pieces)
            elif zero or (tracker.tracked(p) and not tracker.incomplete([p])):
                deferred._replay(start)  # its bytes in the arena: written in full, or over zeros
                out[name] = _Located(p, start, None)
            else:
                return None
        return out
    finally:
        deferred.pending.clear()
        deferred._sources.clear()


def _digests(located: Mapping[str, _Located]) -> dict[str, str]:
    """SHA-256 of each parameter's bytes where they lie (run beside the copies)."""
    from weight_checker.expected.deferred import PendingDigests
    from weight_checker.hashing.digests import digest_tensors

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


class _Beside:
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


def _transformed(transform: str, tensor: Any) -> Any:
    """``tensor`` as the transform makes it, or ``None`` where it does not apply."""
    import torch

    if transform.startswith("dtype-roundtrip:"):
        through = getattr(torch, transform.split(":", 1)[1])
        return _round_trip(tensor, through) if _changes(transform, tensor) else None
    if transform == "truncate:bfloat16":
        if tensor.dtype != torch.float32:
            return None
        return (tensor.view(torch.int32) & -65536).view(torch.float32)
    if transform == "transposed":
        if not _square(tensor):
            return None
        # A tensor of its own even where the weight is stored column-major (then
        # .t().contiguous() would be the weight itself, which the trainer may write).
        return tensor.t().clone(memory_format=torch.contiguous_format)
    raise AssertionError(transform)


#: Elements converted at a time through float32 (scratch that stays in cache).
_CHUNK = 1 << 20


def _round_trip(tensor: Any, through: Any) -> Any:
    """``tensor.to(through).to(tensor.dtype)``, the same values (see :func:`_round_trip_into`)."""
    import torch

    if tensor.dtype not in (torch.bfloat16, torch.float16, torch.float32) or tensor.device.type != "cpu":
        return tensor.to(through).to(tensor.dtype)
    out = torch.empty(tensor.shape, dtype=tensor.dtype)
    _round_trip_into(out, tensor, through)
    return out


def _round_trip_into(out: Any, src: Any, through: Any) -> None:
    """``out[...] = src.to(through).to(src.dtype)`` for a bfloat16, float16
    or float32 ``src`` (any strides): torch converts a half type to another
    through float32 (exact from each of the three, rounded to nearest even
    into the other), done here some rows at a time in float32 scratch that
    stays in cache (about twice as fast as the direct conversions into fresh
    memory)."""
    import torch

    if src.dim() == 0:
        out.copy_(src.to(through).to(src.dtype))
        return
    rows = src.shape[0]
    per_row = max(1, src.numel() // max(1, rows))
    step = max(1, _CHUNK // per_row)
    wide = torch.empty(min(rows, step) * per_row, dtype=torch.float32)
    narrow = torch.empty(wide.numel(), dtype=through)
    with torch.no_grad():
        for start in range(0, rows, step):
            part = src[start : start + step]
            w, n = wide[: part.numel()].view(part.shape), narrow[: part.numel()].view(part.shape)
            w.copy_(part)
            nan = w.isnan()
            n.copy_(w)
            w.copy_(n)
            out[start : start + step].copy_(w)
            if nan.any():  # NaN's bits as .to() gives them (through float32 scratch they come out others)
                out[start : start + step].copy_(part.to(through).to(src.dtype))


def _elementwise_into(transform: str, where: _Located, dtypes: Mapping[str, Any]) -> Any:
    """An elementwise transform of a parameter tiled by pieces of the weights
    in their own dtype, applied to the pieces (the loader only selects and
    places elements, whatever their values: transforming the weights first
    gives the same bytes); :data:`_UNCHANGED` where it changes none of them;
    ``None`` where a piece is not plainly a weight's elements in its own
    dtype (then the weights are transformed and loaded again)."""
    import torch

    verdict = _elementwise_verdict(transform, where, dtypes)
    if verdict is not True:
        return verdict
    assert where.pieces is not None
    out = _fresh(where.shape, where.dtype)
    flat = out.view(-1).view(torch.uint8)
    with torch.no_grad():
        for piece in where.pieces:
            region = flat[piece.offset - where.start : piece.offset - where.start + piece.nbytes]
            region = region.view(piece.dtype).view(piece.shape)
            src = piece.source
            if src is None:
                region.zero_()
                continue
            piece.check()
            if not _changes(transform, src):
                region.copy_(src)
                continue
            if transform == "truncate:bfloat16":
                torch.bitwise_and(src.view(torch.int32), -65536, out=region.view(torch.int32))
            else:
                through = getattr(torch, transform.split(":", 1)[1])
                if src.dtype in (torch.bfloat16, torch.float16, torch.float32):
                    _round_trip_into(region, src, through)
                else:
                    region.copy_(src.to(through).to(src.dtype))
    return out


class LazyPieces:
    """An elementwise transform of a parameter tiled by pieces (what
    :func:`_elementwise_into` would write), computed a block of bytes at a
    time: a candidate the explanation tries on one block of a run costs that
    block, not the tensor. ``nbytes``, ``shape``, ``dtype`` as the
    parameter's; :meth:`block` gives bytes ``[start, end)``."""

    def __init__(self, transform: str | None, where: _Located):
        import math

        assert where.pieces is not None
        self.transform, self.where = transform, where
        self.shape, self.dtype = where.shape, where.dtype
        self.nbytes = math.prod(where.shape) * where.param.element_size()

    def block(self, start: int, end: int) -> Any:
        import torch

        parts = []
        for piece in self.where.pieces or ():
            at = piece.offset - self.where.start
            lo, hi = max(start, at), min(end, at + piece.nbytes)
            if lo >= hi:
                continue
            if piece.source is None:
                parts.append(torch.zeros(hi - lo, dtype=torch.uint8))
                continue
            piece.check()
            parts.append(_piece_bytes(self.transform, piece.source, lo - at, hi - at))
        if not parts:
            return torch.empty(0, dtype=torch.uint8)
        return parts[0] if len(parts) == 1 else torch.cat(parts)


def _piece_bytes(transform: str | None, src: Any, start: int, end: int) -> Any:
    """Bytes ``[start, end)`` of ``src`` transformed (C order; ``None``: as it
    is): only the rows that hold them are read and transformed."""
    import torch

    size = src.element_size()
    first, last = start // size, -(-end // size)
    if src.dim() == 0:
        elements = src.reshape(1)
        skip = 0
    elif src.is_contiguous():
        elements = src.reshape(-1)[first:last]
        skip = first
    else:
        per_row = max(1, src.numel() // max(1, src.shape[0]))
        r0, r1 = first // per_row, -(-last // per_row)
        elements = src[r0:r1].contiguous().reshape(-1)[first - r0 * per_row : last - r0 * per_row]
        skip = first
    if transform is None or not _changes(transform, src):
        out = elements.contiguous()
    elif transform == "truncate:bfloat16":
        out = elements.contiguous().view(torch.int32).bitwise_and(-65536).view(torch.float32)
    else:
        out = _round_trip(elements, getattr(torch, transform.split(":", 1)[1]))
    raw = out.contiguous().view(torch.uint8)
    return raw[start - skip * size : end - skip * size]


def _lazy_elementwise(transform: str, where: _Located, dtypes: Mapping[str, Any]) -> Any:
    """:func:`_elementwise_into`'s answer without computing it: ``None`` and
    :data:`_UNCHANGED` as it says them, else a :class:`LazyPieces`."""
    verdict = _elementwise_verdict(transform, where, dtypes)
    return LazyPieces(transform, where) if verdict is True else verdict


def _elementwise_verdict(transform: str, where: _Located, dtypes: Mapping[str, Any]) -> Any:
    """``None`` where a piece is not plainly a weight's elements in its own
    dtype, :data:`_UNCHANGED` where the transform changes no piece, else ``True``."""
    assert where.pieces is not None
    for piece in where.pieces:
        if piece.source is not None and (piece.name not in dtypes or dtypes[piece.name] != piece.dtype):
            return None
    if not any(p.source is not None and _changes(transform, p.source) for p in where.pieces):
        return _UNCHANGED
    return True


def _changes(transform: str, tensor: Any) -> bool:
    """Whether an elementwise transform applies to ``tensor``: a round trip
    through another floating dtype than its own, a truncation of float32."""
    import torch

    if transform == "truncate:bfloat16":
        return bool(tensor.dtype == torch.float32)
    through = getattr(torch, transform.split(":", 1)[1])
    return bool(tensor.is_floating_point() and tensor.dtype != through)


#: What :func:`_elementwise_into` gives for a parameter the transform leaves as it was.
_UNCHANGED = object()


class _Deferred:
    def __repr__(self) -> str:
        return "DEFERRED"


#: A transform's entry :func:`expected_tensors` leaves to a later call
#: (``defer=True``): computing it means loading the transformed weights again.
DEFERRED: Any = _Deferred()


def _square(t: Any) -> bool:
    return bool(t.dim() == 2 and t.shape[0] == t.shape[1])


def applies(transform: str, t: Any) -> bool:
    """Whether ``transform`` (one of :data:`TRANSFORMS`) changes a tensor like
    ``t`` at all: a square matrix transposed, or :func:`_changes`."""
    if transform == "transposed":
        return _square(t)
    if transform.startswith("dtype-roundtrip:") or transform == "truncate:bfloat16":
        return _changes(transform, t)
    raise ValueError(f"unknown transform {transform!r}")


def _reload_needed(
    transform: str, located: Mapping[str, _Located], names: Iterable[str], pairs: list[tuple[str, Any]]
) -> list[str]:
    """Those of ``names`` whose bytes the transform may change, computed
    only by loading the transformed weights again: a parameter tiled by
    pieces of the weights, where one of those weights changes (a square one,
    for ``transposed``); any other, where any weight of the call changes."""
    weights = dict(pairs)
    out = []
    for name in names:
        pieces = located[name].pieces
        feeding = {p.name for p in pieces or () if p.source is not None}
        if pieces is not None and feeding <= weights.keys():
            if any(applies(transform, weights[n]) for n in feeding):
                out.append(name)
        elif any(applies(transform, t) for t in weights.values()):
            out.append(name)
    return out


def _same_bytes(a: Any, b: Any) -> bool:
    import torch

    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if not a.numel():
        return True
    x, y = a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8)
    try:  # compared 8 bytes at a time: torch compares bytes one by one, five times slower
        x, y = x.view(torch.int64), y.view(torch.int64)
    except RuntimeError:
        pass
    return bool(torch.equal(x, y))


def _rank_tensors(
    recipe: Recipe,
    config: Any,
    cached: Any,
    wanted: _Wanted,
    weights: _Weights,
    transforms: Sequence[str],
    expected: ExpectedDigests,
    copy: bool = True,
    lazy: bool = False,
    defer: bool = False,
) -> dict[str, dict[str | None, Any]]:
    from weight_checker.expected.digests import _on_rank, _Rank
    from weight_checker.expected.rank_model import TARGET_ARENA, _Arena, _build, in_a_clean_thread

    s = recipe.settings
    rank = _Rank(wanted.pp_rank, wanted.tp_rank, wanted.dp_rank)
    model_config = config.model_config
    keys_of = wanted.names
    every_key = [k for ks in keys_of.values() for k in ks]
    with _on_rank(config, config, model_config, rank, s["tp"], s["pp"], s["dp"], cached, lora=s["lora"]):
        model = cached if cached is not None else in_a_clean_thread(_build, config, model_config, {})
        arena = TARGET_ARENA if cached is not None else _Arena()
        by_name = dict(model.named_parameters())
        stripped = {n.replace(".base_layer", ""): p for n, p in by_name.items()}
        params = {}
        for name, keys in keys_of.items():
            p = by_name.get(name, stripped.get(name.replace(".base_layer", "")))
            if p is None:
                raise ExpectedDigestsError(f"{keys[0]}: {rank.name} has no such parameter (not a plain parameter?)")
            params[name] = p
        levels: list[set[str] | None] = [*_feeding(model, params, weights.names), None]
        for level, names in enumerate(levels):
            last = level == len(levels) - 1
            pairs = _pairs_for(weights, names, every_key)
            try:
                located = _load_located(model, model_config, arena, pairs, params, zero=False)
                if located is None:
                    located = _load_located(model, model_config, arena, pairs, params, zero=True)
            except ExpectedDigestsError:
                if last:
                    raise
                continue  # a loader that wants more than these weights: try more
            assert located is not None
            for where in located.values():  # several strided pieces: hashed from the parameter
                if where.pieces and not where.hashable_in_place() and len(where.pieces) > 1:
                    _replay_into(where)
            hashing = _Beside(lambda located=located: _digests(located))
            try:
                copies = {name: _untransformed(where, copy, lazy) for name, where in located.items()}
            finally:
                digests = hashing.result()
            wrong = [(k, name) for name, keys in keys_of.items() for k in keys if digests[name] != expected[k]]
            if not wrong:
                break
            if last:
                key, name = wrong[0]
                raise ExpectedDigestsError(
                    f"{', '.join(k for k, _ in wrong)}: {_CHANGED}: the weights now give "
                    f"{digests[name][:16]}... for {key}, not {expected[key][:16]}..."
                )
        out: dict[str, dict[str | None, Any]] = {k: {None: copies[name]} for name, ks in keys_of.items() for k in ks}
        dtypes = {n: t.dtype for n, t in pairs}
        assert located is not None
        for transform in transforms:
            found: dict[str, Any] = {}
            if transform != "transposed":  # elementwise: applied to the pieces of a tiled parameter
                elementwise = _lazy_elementwise if lazy else _elementwise_into
                for name, where in located.items():
                    if where.pieces is not None and (got := elementwise(transform, where, dtypes)) is not None:
                        found[name] = got
            rest = {name: p for name, p in params.items() if name not in found}
            if defer and rest:  # what needs the transformed weights loaded again: left to a later call
                found.update(dict.fromkeys(_reload_needed(transform, located, rest, pairs), DEFERRED))
                rest = {}
            made = [(n, _transformed(transform, t)) for n, t in pairs] if rest else []
            if any(t is not None for _, t in made):
                owned = {at for _, t in made if t is not None and (at := _storage_of(t)) is not None}
                # Storages of the weights the transform left as they were.
                kept = {
                    at for (_, t), (_, u) in zip(pairs, made, strict=True) if u is None and (at := _storage_of(t))
                } - owned
                changed = [(n, t if u is None else u) for (n, t), (_, u) in zip(pairs, made, strict=True)]
                again = _load_located(model, model_config, arena, changed, rest, zero=False)
                if again is None:
                    again = _load_located(model, model_config, arena, changed, rest, zero=True)
                assert again is not None
                for name, where in again.items():
                    if where.pieces is not None and all(
                        p.source is None or _storage_of(p.source) in kept for p in where.pieces
                    ):
                        continue  # every piece from a weight left as it was: as it was (no copy to compare)
                    if where.pieces and not where.hashable_in_place() and len(where.pieces) > 1:
                        _replay_into(where)
                    found[name] = where.copy(owned, view=not copy)
                del changed, again
            del made
            for name, tensor in found.items():
                if tensor is DEFERRED:
                    for k in keys_of[name]:
                        out[k][transform] = DEFERRED
                    continue
                if tensor is _UNCHANGED or (
                    not isinstance(tensor, LazyPieces) and _same_bytes(tensor, _dense(copies[name]))
                ):
                    continue  # the transform leaves this parameter as it was: it explains nothing
                for k in keys_of[name]:
                    out[k][transform] = tensor
        _pairs_for(weights, levels[level], every_key)  # nothing written while this ran
    return out


def _pairs_for(weights: _Weights, names: set[str] | None, keys: list[str]) -> list[tuple[str, Any]]:
    try:
        return weights.pairs(names)
    except _Changed as e:
        raise ExpectedDigestsError(f"{', '.join(keys)}: {_CHANGED}: {e}") from None
    except _Gone as e:
        raise ExpectedDigestsError(f"{', '.join(keys)}: cannot recompute the expected tensors: {e}") from None


def _untransformed(where: _Located, copy: bool, lazy: bool) -> Any:
    """The parameter's bytes as :func:`expected_tensors` gives them: a copy,
    a view (``copy=False``, one piece of a weight) or, with ``lazy`` and no
    copy, pieces of several weights as a :class:`LazyPieces` read when asked."""
    if lazy and not copy and where.pieces is not None and len(where.pieces) != 1:
        return LazyPieces(None, where)
    return where.copy(set(), view=not copy)


def _dense(t: Any) -> Any:
    """A tensor of ``t``'s bytes (a :class:`LazyPieces` read whole)."""
    if not isinstance(t, LazyPieces):
        return t
    return t.block(0, t.nbytes).view(t.dtype).view(t.shape)


def _replay_into(where: _Located) -> None:
    """A parameter tiled by strided pieces: its bytes put in place, read from there."""
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


# --- the entry point -------------------------------------------------------------------------------


def _configured(recipe: Recipe) -> tuple[Any, bool]:
    """vLLM's configuration of the recipe's engine: the cached one (and its
    rank models) when it is the same, else one made for this recompute alone
    (the cache is left to the next expected_digests call)."""
    from weight_checker.expected.rank_model import CACHE, in_a_clean_thread

    if recipe.cache_key is not None and CACHE.key == recipe.cache_key and CACHE.config is not None:
        return CACHE.config, True
    return in_a_clean_thread(_private_config, recipe), False


def _private_config(recipe: Recipe) -> Any:
    from weight_checker.expected.digests import _engine_config
    from weight_checker.expected.rank_model import import_vllm

    s = recipe.settings
    import_vllm(lora=s["lora"], draft=s["draft"])
    return _engine_config(recipe.model, s["tp"], s["pp"], s["dp"], s["dtype"], s["engine_args"])


def can_recompute(expected: Any) -> bool:
    """Whether :func:`expected_tensors` may recompute ``expected``'s tensors:
    digests computed by ``expected_digests`` in this process from weights
    that can be read again (a checkpoint, a dict or a list of pairs). The
    weights may still have been freed or changed since: then it refuses,
    naming the keys."""
    recipe = getattr(expected, "_recompute", None)
    return isinstance(recipe, Recipe) and recipe.refusal is None


def expected_tensors(
    expected: ExpectedDigests,
    keys: Sequence[str],
    transforms: Sequence[str] = (),
    *,
    copy: bool = True,
    lazy: bool = False,
    defer: bool = False,
) -> dict[str, dict[str | None, Any]]:
    """For each key, ``{None: the tensor that rank must hold}`` (a CPU
    tensor of its own, whose SHA-256 is ``expected[key]``), and for each of
    ``transforms`` that changes it, the tensor the rank would hold had the
    weights been transformed before loading:

    - ``"dtype-roundtrip:float16"``, ``"dtype-roundtrip:bfloat16"``: each
      floating-point weight cast to that dtype and back to its own;
    - ``"truncate:bfloat16"``: each float32 weight cut to bfloat16 by
      dropping its low 16 bits instead of rounding;
    - ``"transposed"``: each square matrix transposed.

    A transform is absent from a key's dict where it changes no weight that
    feeds the key, or leaves the key's bytes as they were. ``expected``: what
    :func:`~weight_checker.expected_digests` returned in this process (a
    manifest read back has nothing to recompute from). Each call loads the
    weights that feed the keys once and hashes every untransformed tensor:
    ask for all the transforms wanted in one call.

    ``copy=False``: a tensor whose bytes are one contiguous piece of a weight
    (a parameter the loader copies whole, or a row-range shard of one) is
    that weight's view instead of a copy (a fresh copy costs more than its
    digest here): valid while the weights stay unchanged, so hash it at once.

    ``lazy=True``: an elementwise transform (a round trip, a truncation) of
    a parameter tiled by pieces of the weights is a :class:`LazyPieces`
    (``.block(start, end)``: those bytes, computed when asked) instead of a
    tensor, given wherever it changes a weight that feeds the key (its bytes
    are not compared with the untransformed ones): what an explanation that
    tries a candidate on a few blocks wants. With ``copy=False`` too, an
    untransformed tensor made of several pieces of the weights (a fused
    ``qkv_proj``) is a :class:`LazyPieces` as well, read when asked.

    ``defer=True``: a transform that needs the transformed weights loaded
    again through vLLM's loader (a transposed square weight; an elementwise
    one whose parameter is not plainly tiled by the weights' elements) is
    not computed: its entry is :data:`DEFERRED`, for a later call to give
    where it is still wanted. What an explanation asks with the expected
    tensors, when no cause is known yet.

    Raises :class:`ExpectedDigestsError`: for keys of the ``lora``, ``draft``
    and ``buffers`` scopes (not supported yet), keys not in ``expected``,
    weights that cannot be read again as they were (a one-shot iterator, a
    callable, a lazy mapping) or that were freed, and, naming the keys, where
    the weights no longer give the expected digests (changed since: a
    trainer that updates in place).
    """
    unknown = [t for t in transforms if t not in TRANSFORMS]
    if unknown:
        raise ExpectedDigestsError(f"unknown transform(s) {', '.join(map(repr, unknown))}: known are {TRANSFORMS}")
    transforms = list(dict.fromkeys(transforms))
    recipe = getattr(expected, "_recompute", None)
    if not isinstance(recipe, Recipe):
        raise ExpectedDigestsError(
            "these expected digests were not computed by expected_digests in this process (a manifest read "
            "back?): there is nothing to recompute their tensors from"
        )
    if recipe.refusal is not None:
        named = f"{', '.join(keys)}: " if keys else ""
        raise ExpectedDigestsError(f"{named}cannot recompute the expected tensors: {recipe.refusal}")
    wanted = _wanted(expected, recipe, keys)
    if not wanted:
        return {}
    from weight_checker.expected.digests import _LOCK
    from weight_checker.expected.rank_model import CACHE, in_a_clean_thread

    out: dict[str, dict[str | None, Any]] = {}
    with _LOCK:
        try:
            weights = _Weights(recipe)
        except _Changed as e:
            raise ExpectedDigestsError(f"{', '.join(keys)}: {_CHANGED}: {e}") from None
        try:
            config, cached = _configured(recipe)
            if cached and any(_rank_name(r) not in CACHE.models for r in wanted):
                config, cached = in_a_clean_thread(_private_config, recipe), False
            for rank in wanted:
                model = CACHE.models[_rank_name(rank)][0] if cached else None
                out.update(_rank_tensors(recipe, config, model, rank, weights, transforms, expected, copy, lazy, defer))
        finally:
            weights.close()
    return out


def _rank_name(rank: _Wanted) -> str:
    from weight_checker.expected.digests import _Rank

    return _Rank(rank.pp_rank, rank.tp_rank, rank.dp_rank).name
