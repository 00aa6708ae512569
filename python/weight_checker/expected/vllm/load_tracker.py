"""Which parameters vLLM's loader wrote in full, so that the arena is zeroed
only where it did not.

Every byte a rank's parameters hold must be what the weights wrote, or zero:
never what an earlier step or rank left in the arena. Zeroing the whole
arena before each load costs as much memory traffic as a third of the load
itself, and the loader overwrites nearly all of it. :class:`LoadTracker`
wraps each parameter's ``weight_loader`` and records the shards written: a
``QKVParallelLinear`` parameter is complete once its ``q``, ``k`` and ``v``
shards are, a ``MergedColumnParallelLinear`` one once each of its outputs
is, the parameters of the layers whose loader writes them whole in one call
(column, row and replicated linears, vocabulary embeddings, which zero their
padding rows, RMS norms) after that call. Only the other parameters are
zeroed before the load; if any tracked parameter the model still holds was
not completed (a shard the weights never wrote), the caller loads the rank
again into a fully zeroed arena.
"""

from __future__ import annotations

from typing import Any

#: Layers whose loader writes a parameter whole in one call with no shard id.
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
#: Parameter classes whose loaders write the parameter and nothing else: torch's
#: own, and vLLM's unquantized linear weight (its loader is the layer's).
_PARAMETER_KINDS = frozenset({"Parameter", "ModelWeightParameter"})
_SHARD_KWARGS = ("loaded_shard_id", "shard_id")


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


def _shards_written(param: Any, shard: Any) -> set[Any] | None:
    """The shards one loader call writes (``None``: the whole parameter). A
    tuple of shard ids (Qwen3.5 loads ``in_proj_qkv`` as ``(0, 1, 2)``: one
    checkpoint tensor fused on disk) is split by vLLM's merged-column loader
    into parts it numbers from 0, one per id, or copied whole where the
    parameter has no output dimension."""
    if shard is None:
        return None
    if not isinstance(shard, tuple):
        return {shard}
    if getattr(param, "output_dim", None) is None:
        return None
    if shard and all(isinstance(s, int) for s in shard):
        return set(range(shard[-1] - shard[0] + 1))
    return set(shard)


class LoadTracker:
    """Wraps the loaders of ``model``'s parameters while a ``with`` block
    loads it (and only then: the model may be cached and loaded again); then
    :meth:`incomplete` names the tracked parameters it did not write in full,
    and :meth:`tracked` says which it follows."""

    def __init__(self, model: Any):
        self._remaining: dict[int, set[Any]] = {}
        self._params: list[Any] = []
        for module in model.modules():
            shards = _required_shards(module)
            if shards is None:
                continue
            for _, param in module.named_parameters(recurse=False):
                kind = type(param).__name__
                # A tied parameter (lm_head = embed_tokens) is met twice: tracked once.
                if kind not in _PARAMETER_KINDS or param.device.type != "cpu" or id(param) in self._remaining:
                    continue
                self._remaining[id(param)] = set(shards)
                self._params.append(param)
        #: (parameter, its own weight_loader attribute or None), restored on exit.
        self._loaders: list[tuple[Any, Any]] = []

    def __enter__(self) -> LoadTracker:
        from vllm.model_executor.model_loader.weight_utils import default_weight_loader

        for param in self._params:
            loader = getattr(param, "weight_loader", default_weight_loader)
            # Restored on exit: a plain parameter's own attribute (or none),
            # a vLLM parameter's loader through its property.
            own = loader if type(param).__name__ != "Parameter" else param.__dict__.get("weight_loader")
            self._loaders.append((param, own))
            setattr(param, "weight_loader", self._wrapped(loader))  # noqa: B010 (vLLM reads the attribute)
        return self

    def __exit__(self, *exc: object) -> None:
        for param, loader in reversed(self._loaders):  # the model may be loaded again (a cached one)
            if loader is None:
                del param.weight_loader
            else:
                param.weight_loader = loader
        self._loaders.clear()

    def _wrapped(self, loader: Any) -> Any:
        def weight_loader(param: Any, loaded_weight: Any, *args: Any, **kwargs: Any) -> Any:
            out = loader(param, loaded_weight, *args, **kwargs)
            remaining = self._remaining.get(id(param))
            if remaining is not None:
                named = [kwargs[k] for k in _SHARD_KWARGS if k in kwargs]
                written = _shards_written(param, args[0] if args else (named[0] if named else None))
                if written is None:
                    remaining.clear()  # the whole parameter (a fused checkpoint tensor)
                else:
                    remaining.difference_update(written)
            return out

        return weight_loader

    def tracked(self, param: Any) -> bool:
        return id(param) in self._remaining

    def incomplete(self, params: list[Any]) -> list[Any]:
        """Of ``params``, the tracked ones the load did not write in full."""
        return [p for p in params if self._remaining.get(id(p))]
