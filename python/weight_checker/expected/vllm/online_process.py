"""vLLM's online FP8 processing of a layer, wrapped once for the expected
models built here: the rows an explanation zeroes, and the layers a one-pass
TP reduction holds back.

``Fp8PtpcOnlineLinearMethod.process_weights_after_loading`` is replaced by a
wrapper that runs vLLM's own on every layer not marked by this package (an
engine's own processing in the same process included). Two marks change
what happens before it runs:

- :data:`ZERO_ROWS` on a layer: those rows of its weight are zeroed first
  (an explanation's "had the trainer sent zeros" model, :mod:`.quantized_tensors`).
- :func:`holding_back` on the calling thread: a layer whose amax vLLM
  all-reduces over the TP group (a row-parallel one: each shard holds a part
  of every row) is not processed yet. vLLM's processing runs on a shallow
  copy of it instead, its cast skipped (:func:`.fp8_kernels.fast`), so the
  amax the rank contributes is recorded (:class:`.amax_reduce.AmaxReduce`);
  the layer itself keeps its loaded weight (its copies possibly still
  deferred, :func:`.deferred_rows.hand_on`: nothing may read it until then),
  and :func:`process_held` runs vLLM's processing on it once every rank's
  amax is reduced. So a rank of
  a TP > 1 engine is built and loaded once, not once a pass.
"""

from __future__ import annotations

import contextlib
import copy
import threading
from collections.abc import Iterator
from typing import Any

#: The attribute that marks a layer of a model built for an explanation: the
#: rows of its weight to zero before vLLM quantizes it.
ZERO_ROWS = "_weight_checker_zero_rows"
_DONE = "_already_called_process_weights_after_loading"
_LOCAL = threading.local()
_INSTALL = threading.Lock()


def install() -> None:
    """The wrapper put in place of vLLM's method, once per process."""
    from vllm.model_executor.layers.quantization.online.fp8 import Fp8PtpcOnlineLinearMethod

    with _INSTALL:
        original = Fp8PtpcOnlineLinearMethod.process_weights_after_loading
        if getattr(original, "weight_checker_original", None) is not None:
            return

        def process_weights_after_loading(self: Any, layer: Any) -> None:
            if getattr(layer, _DONE, False):
                original(self, layer)  # vLLM's own early return
                return
            if _hold_back(original, self, layer):
                return
            rows = getattr(layer, ZERO_ROWS, None)
            if rows is not None:
                layer.weight.data[rows] = 0
            original(self, layer)
            submit_final(layer)

        process_weights_after_loading.weight_checker_original = original  # type: ignore[attr-defined]
        Fp8PtpcOnlineLinearMethod.process_weights_after_loading = process_weights_after_loading  # type: ignore[method-assign]


@contextlib.contextmanager
def holding_back(held: list[Any], handed: list[Any] | None = None) -> Iterator[None]:
    """Inside, on this thread: the TP-reduced layers processed are appended
    to ``held`` (once each, in the order vLLM processes them) and left as
    loaded, their amaxes recorded (see the module docstring). ``handed``:
    where a held weight's copies still deferred (:mod:`.deferred_rows`) go,
    for the mode that processes it to read them where they lie."""
    install()
    previous = getattr(_LOCAL, "held", None), getattr(_LOCAL, "handed", None)
    _LOCAL.held, _LOCAL.handed = held, handed
    try:
        yield
    finally:
        _LOCAL.held, _LOCAL.handed = previous


def _hold_back(original: Any, method: Any, layer: Any) -> bool:
    held = getattr(_LOCAL, "held", None)
    if held is None:
        return False
    from vllm.model_executor.layers.quantization.online.fp8 import _is_tp_sharded

    # vLLM's own test of whether this layer's amax is all-reduced, as its
    # processing calls it.
    # A method that requantizes a checkpoint's own weights keeps state of
    # its own (the source parameters it releases): not held back, its amax
    # is recorded unheld, and the caller takes the two passes.
    if getattr(method, "requantization_source", None) is not None or getattr(layer, ZERO_ROWS, None) is not None:
        return False
    if not _is_tp_sharded(layer, reduces_output_dim=False):
        return False
    if any(h is layer for h in held):
        return True  # held already (vLLM's final pass over the model comes back to it)
    from weight_checker.expected.vllm import fp8_kernels

    # A shallow copy with parameter and buffer tables of its own: what vLLM
    # registers on it (the FP8 weight, the scale) stays off the layer.
    parameters, buffers = dict(layer._parameters), dict(layer._buffers)
    shadow = copy.copy(layer)
    shadow.__dict__["_parameters"] = dict(parameters)
    shadow.__dict__["_buffers"] = dict(buffers)
    try:
        with fp8_kernels.fast(amax_only=True):
            original(method, shadow)
    finally:
        shadow.__dict__["_parameters"].clear()  # its unwritten FP8 weight back to the pool, also on failure
        shadow.__dict__["_buffers"].clear()
    if not (_same(layer._parameters, parameters) and _same(layer._buffers, buffers)):
        raise RuntimeError(f"vLLM's processing of a copy of {type(layer).__name__} changed the layer itself")
    held.append(layer)
    handed = getattr(_LOCAL, "handed", None)
    if handed is not None:
        from weight_checker.expected.vllm import deferred_rows

        deferred_rows.hand_on(layer.weight, handed)
    return True


def submit_final(module: Any, skip: Any = ()) -> None:
    """The parameters of ``module`` and the modules under it (but those in
    ``skip``, held layers), final now, to this thread's idle hashing
    (:mod:`weight_checker.hashing.idle`), but a memory with copies still
    pending (:mod:`.deferred_rows`): a processed layer, or a rank's model
    once its load has written every copy it deferred."""
    from weight_checker.hashing import idle

    if idle.current() is None:
        return
    from weight_checker.expected.vllm.deferred_rows import pending_pieces

    skipped = {id(m) for m in skip}
    idle.submit(
        p
        for m in module.modules()
        if id(m) not in skipped
        for p in m._parameters.values()
        if p is not None and not pending_pieces(p)
    )


def _same(table: dict[str, Any], before: dict[str, Any]) -> bool:
    """Whether a module's table holds the very objects it held before."""
    return table.keys() == before.keys() and all(table[k] is v for k, v in before.items())


def process_held(held: list[Any]) -> None:
    """vLLM's processing of each held layer, in the order they were held
    (the order their amaxes were recorded), then what vLLM's layerwise
    loader does after it (the parameters' TP state reconciled)."""
    install()
    for layer in held:
        layer.quant_method.process_weights_after_loading(layer)
        if hasattr(layer, "update_param_tp_status"):
            layer.update_param_tp_status()
