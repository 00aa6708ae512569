"""vLLM's TP all-reduce of weight amaxes (``amax_for_tp_weight_quant``),
reproduced across ranks built one after another in one thread.

Online FP8 scales each output channel of a row-parallel layer by the amax of
the whole row, which vLLM all-reduces (MAX) over the TP group: each shard
holds a part of every row. :class:`AmaxReduce` records what each rank
contributes, reduces, and hands each rank's processing the reduced value in
place of the collective (:mod:`.quantized`).
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Iterator
from typing import Any

from weight_checker.errors import ExpectedDigestsError

_AMAX = "amax_for_tp_weight_quant"


class AmaxReduce:
    """vLLM's TP all-reduce (MAX) of weight amaxes, reproduced across ranks
    built one after another: :meth:`recording` keeps each sharded call's
    local amax, :meth:`reduce` takes the elementwise max over the TP ranks of
    each pipeline stage, :meth:`applying` hands each call its reduced value.
    Only the thread that records or applies sees the replacement
    (:func:`_dispatch`): any other thread, an engine's own processing in the
    same process among them, gets vLLM's collective."""

    def __init__(self, tp: int):
        self.tp = tp
        self.recorded: dict[tuple[int, int], list[Any]] = {}
        #: (pp_rank, index of the call) -> the reduced amax; kept for rebuilds.
        self.reduced: dict[int, list[Any]] = {}
        self.needed = False

    @contextlib.contextmanager
    def recording(self, pp_rank: int, tp_rank: int) -> Iterator[None]:
        calls = self.recorded.setdefault((pp_rank, tp_rank), [])
        calls.clear()

        def record(amax: Any, is_sharded: bool) -> Any:
            if is_sharded:
                calls.append(amax.detach().clone())
            return amax

        with _replaced(record):
            yield

    def reduce(self) -> None:
        """The elementwise max over each stage's TP ranks, call by call; the
        local amaxes are dropped."""
        import torch

        for pp_rank in sorted({pp for pp, _ in self.recorded}):
            stage = {tp: calls for (pp, tp), calls in self.recorded.items() if pp == pp_rank}
            counts = {tp: len(calls) for tp, calls in stage.items()}
            if len(set(counts.values())) > 1:
                raise ExpectedDigestsError(
                    f"the TP ranks of pp{pp_rank} reduce different numbers of weight amaxes: {counts}"
                )
            reduced = []
            for column in zip(*(stage[tp] for tp in sorted(stage)), strict=True):
                if len({tuple(t.shape) for t in column}) > 1:
                    raise ExpectedDigestsError(
                        f"the TP ranks of pp{pp_rank} reduce weight amaxes of different shapes: "
                        f"{[list(t.shape) for t in column]}"
                    )
                reduced.append(torch.stack(list(column)).amax(dim=0))
            self.reduced[pp_rank] = reduced
            self.needed = self.needed or bool(reduced)
        self.recorded.clear()

    @contextlib.contextmanager
    def applying(self, pp_rank: int, tp_rank: int) -> Iterator[None]:
        reduced = list(self.reduced.get(pp_rank, []))
        at = [0]

        def apply(amax: Any, is_sharded: bool) -> Any:
            if not is_sharded:
                return amax
            if at[0] >= len(reduced):
                raise ExpectedDigestsError(f"pp{pp_rank}:tp{tp_rank} reduces more weight amaxes than it did before")
            value = reduced[at[0]]
            at[0] += 1
            if value.shape != amax.shape:
                raise ExpectedDigestsError(
                    f"pp{pp_rank}:tp{tp_rank}: a reduced weight amax of shape {list(value.shape)} where vLLM holds "
                    f"{list(amax.shape)}"
                )
            amax.copy_(value)  # in place, as torch.distributed.all_reduce writes it
            return amax

        with _replaced(apply):
            yield

    def for_rank(self, pp_rank: int, tp_rank: int) -> Any:
        """What a rank's processing runs under: the reduced amaxes where the
        reduction was needed, else nothing replaced."""
        if self.needed:
            return self.applying(pp_rank, tp_rank)
        return contextlib.nullcontext()


#: This thread's replacement of vLLM's amax reduction, while one is in place.
_LOCAL = threading.local()
_INSTALL = threading.Lock()


def _dispatch(original: Any) -> Any:
    """vLLM's ``amax_for_tp_weight_quant``, or this thread's replacement."""

    def amax_for_tp_weight_quant(amax: Any, is_sharded: bool) -> Any:
        replacement = getattr(_LOCAL, "replacement", None)
        if replacement is None:
            return original(amax, is_sharded)
        return replacement(amax, is_sharded)

    amax_for_tp_weight_quant.weight_checker_original = original  # type: ignore[attr-defined]
    return amax_for_tp_weight_quant


def _install() -> None:
    """The dispatcher put in place of ``amax_for_tp_weight_quant`` in every
    loaded vLLM module that imported it by name (each quantization method
    does), once per module: it calls vLLM's own unless this thread replaced it."""
    from vllm.model_executor.layers.quantization.utils import quant_utils

    with _INSTALL:
        current = getattr(quant_utils, _AMAX)
        original = getattr(current, "weight_checker_original", current)
        if current is not original and len(sys.modules) == _SCANNED[0]:
            return  # no module imported since the last scan (a scan costs ~5 ms with vLLM loaded)
        dispatcher = current if current is not original else _dispatch(original)
        for name, module in list(sys.modules.items()):
            if name.startswith("vllm.") and getattr(module, _AMAX, None) is original:
                setattr(module, _AMAX, dispatcher)
        _SCANNED[0] = len(sys.modules)


#: How many modules were loaded at the last scan of :func:`_install`.
_SCANNED = [0]


@contextlib.contextmanager
def _replaced(fn: Any) -> Iterator[None]:
    _install()
    previous = getattr(_LOCAL, "replacement", None)
    _LOCAL.replacement = fn
    try:
        yield
    finally:
        _LOCAL.replacement = previous
