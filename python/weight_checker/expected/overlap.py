"""Hashing a rank's parameters while vLLM's loader is still writing others.

vLLM's ``load_weights`` copies the weights one tensor at a time on one
thread; hashing the whole rank only once it returns leaves the other cores
idle for the whole load. :class:`LoadingHasher` wraps each parameter's
``weight_loader`` and hands a parameter to a background hashing thread as
soon as every shard it must receive has been written: for a
``QKVParallelLinear`` its ``q``, ``k`` and ``v`` shards, for a
``MergedColumnParallelLinear`` each of its outputs, for the other layers
whose loaders write a parameter in one call (column, row and replicated
linears, vocabulary embeddings, RMS norms) that one call. Everything else
(other layer kinds, tensor subclasses, parameters never written, tied ones)
is hashed after the load, as before.

No byte is hashed while it can change: a loader call for a parameter being
hashed waits for that hash to end, and a parameter written again after it
was hashed is hashed again at the end. The digests are those of the
parameters as the load left them, whatever order the loader writes in.
"""

from __future__ import annotations

import queue
import threading
from typing import Any

#: Layers whose loader writes a parameter in one call with no shard id.
_ONE_CALL = frozenset(
    {
        "ColumnParallelLinear",
        "RowParallelLinear",
        "ReplicatedLinear",
        "VocabParallelEmbedding",
        "ParallelLMHead",
        "RMSNorm",
    }
)
#: Start hashing once this many bytes are complete (or the load ended): big
#: enough batches to keep every thread of the core busy.
_BATCH_BYTES = 64 << 20


def _required_shards(module: Any) -> set[Any] | None:
    """The shard ids a parameter of ``module`` must receive, or ``None``
    where the layer is not one whose loader this knows."""
    kind = type(module).__name__
    if kind == "QKVParallelLinear":
        return {"q", "k", "v"}
    if kind == "MergedColumnParallelLinear":
        return set(range(len(module.output_sizes)))
    if kind in _ONE_CALL:
        return {None}
    return None


class LoadingHasher:
    """Digests of a model's plain parameters, computed as the loader
    completes each one. Use as a context manager around ``load_weights``;
    then :meth:`digests_of` the final model (after any re-tying or LoRA
    wrapping: parameters are matched by identity, not by name)."""

    def __init__(self, model: Any):
        import torch
        from vllm.model_executor.model_loader.weight_utils import default_weight_loader

        self._required: dict[int, set[Any]] = {}
        self._params: dict[int, Any] = {}
        #: (parameter, its own weight_loader attribute or None), restored on exit.
        self._loaders: list[tuple[Any, Any]] = []
        for module in model.modules():
            shards = _required_shards(module)
            if shards is None:
                continue
            for _, param in module.named_parameters(recurse=False):
                if type(param) is not torch.nn.Parameter or param.device.type != "cpu":
                    continue
                self._required[id(param)] = set(shards)
                self._params[id(param)] = param
                loader = getattr(param, "weight_loader", default_weight_loader)
                self._loaders.append((param, param.__dict__.get("weight_loader")))
                setattr(param, "weight_loader", self._wrapped(loader))  # noqa: B010 (vLLM reads the attribute)
        self._ready: queue.Queue[int | None] = queue.Queue()
        self._lock = threading.Lock()
        self._in_flight: dict[int, threading.Event] = {}
        self._submitted: set[int] = set()
        self._dirty: set[int] = set()
        self.digests: dict[int, str] = {}
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="weight-checker-load-hash", daemon=True)

    def __enter__(self) -> LoadingHasher:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._ready.put(None)
        self._thread.join()
        for param, loader in self._loaders:  # the model may be loaded again (a cached one)
            if loader is None:
                del param.weight_loader
            else:
                param.weight_loader = loader
        if self._error is not None and exc[0] is None:
            raise self._error

    def _wrapped(self, loader: Any) -> Any:
        def weight_loader(param: Any, loaded_weight: Any, *args: Any, **kwargs: Any) -> Any:
            key = id(param)
            with self._lock:
                event = self._in_flight.get(key)
            if event is not None:
                event.wait()  # never write bytes that are being hashed
            out = loader(param, loaded_weight, *args, **kwargs)
            shard = args[0] if args else kwargs.get("loaded_shard_id", kwargs.get("shard_id"))
            with self._lock:
                if key in self._submitted:
                    self._dirty.add(key)  # written again after it was handed over: hashed again at the end
                    return out
                remaining = self._required.get(key)
                if remaining is not None:
                    remaining.discard(shard)
                    if not remaining:
                        self._submitted.add(key)
                        self._in_flight[key] = threading.Event()
                        self._ready.put(key)
            return out

        return weight_loader

    def _run(self) -> None:
        from weight_checker import _core

        done = False
        while not done:
            batch: list[int] = []
            nbytes = 0
            item = self._ready.get()
            while item is not None:
                batch.append(item)
                nbytes += self._params[item].nbytes
                if nbytes >= _BATCH_BYTES:
                    break
                try:
                    item = self._ready.get(timeout=0.005)
                except queue.Empty:
                    break
            done = item is None
            if not batch:
                continue
            try:
                digests, _ = _core.digest_many([self._params[k] for k in batch])
                self.digests.update(zip(batch, digests, strict=True))
            except BaseException as e:  # reported by __exit__; the load itself goes on
                self._error = e
            finally:
                with self._lock:
                    for key in batch:
                        self._in_flight.pop(key).set()

    def digests_of(self, names: list[str], tensors: list[Any]) -> list[str]:
        """The digest of each tensor: the one computed during the load where
        it was not written again since, else computed now."""
        from weight_checker.hashing.digests import digest_tensors

        out: list[str | None] = [self.digests.get(id(t)) if id(t) not in self._dirty else None for t in tensors]
        todo = [i for i, d in enumerate(out) if d is None]
        if todo:
            rest, _ = digest_tensors([names[i] for i in todo], [tensors[i] for i in todo])
            for i, d in zip(todo, rest, strict=True):
                out[i] = d
        return [d for d in out if d is not None]
