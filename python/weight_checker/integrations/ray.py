"""Engines hosted in Ray actors (the OpenRLHF / verl layout), verified as a fleet.

The protocol a Ray actor must expose, so that ``weight_checker.verify``,
``verify_async`` and ``replicas`` take its handle (or a list of handles):

- ``collective_rpc(method, timeout=None, args=(), kwargs=None)``: a
  pass-through to the hosted engine's ``collective_rpc`` that returns the
  per-worker results (the plugin's ``weight_checker_checksums`` /
  ``weight_checker_reset`` worker methods are called through it);
- optionally ``vllm_version()``: the engine's vLLM version, for the warning
  when expected digests came from another version.

:class:`EngineActorMixin` adds both to an actor class whose engine is
``self.llm`` (a ``vllm.LLM``)::

    @ray.remote
    class Engine(weight_checker.ray.EngineActorMixin):
        def __init__(self, model):
            self.llm = vllm.LLM(model=model, ...)

    engines = [Engine.remote(path) for _ in range(8)]
    weight_checker.verify(engines, transfer=push_to_all).raise_for_mismatch()

Importing this module does not import Ray; neither does anything else in the
package unless a Ray actor handle is passed (then ``ray.get`` is used).
"""

from __future__ import annotations

from typing import Any


class EngineActorMixin:
    """``collective_rpc`` and ``vllm_version`` for an actor hosting ``self.llm``."""

    llm: Any

    def collective_rpc(
        self, method: str, timeout: float | None = None, args: tuple = (), kwargs: dict[str, Any] | None = None
    ) -> list[Any]:
        return self.llm.collective_rpc(method, timeout=timeout, args=tuple(args), kwargs=kwargs)

    def vllm_version(self) -> str:
        import vllm

        return vllm.__version__
