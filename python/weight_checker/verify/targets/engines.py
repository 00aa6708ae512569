"""In-process ``vllm.LLM`` engines and Ray actors hosting one, as a target:
the plugin's worker methods reached over ``collective_rpc``."""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import Any

from weight_checker.engines.vllm import sharded_names
from weight_checker.errors import DuplicateKeysError, InputError, VerifyError
from weight_checker.httpclient import clip
from weight_checker.keys import merge_digests
from weight_checker.scope import DEFAULT
from weight_checker.verify.engine_digests import Layout
from weight_checker.verify.fanout import DEFAULT_CONCURRENCY, NOTHING_TO_PAUSE, EngineSet, Progress


def worker_method(op: str, include: tuple[str, ...]) -> tuple[str, tuple[Any, ...]]:
    """The plugin's worker method (``weight_checker.integrations.vllm.worker``)
    and its arguments for ``checksum`` or ``reset`` of the scope ``include``,
    or ``dp_sharded``."""
    if op == "dp_sharded":
        return "weight_checker_dp_sharded", ()
    scoped = include != DEFAULT
    if op == "checksum":
        return ("weight_checker_scope_checksums", (list(include),)) if scoped else ("weight_checker_checksums", ())
    return "weight_checker_reset", ((list(include),) if scoped else ())


def merge_workers(results: Any, step: str, name: str, slots: dict[str, Any] | None = None) -> dict[str, str]:
    """One engine's map from its workers' answers to ``collective_rpc``: plain
    ``{key: hex}`` maps, or scoped answers whose ``lora_slots`` go to ``slots``."""
    if not isinstance(results, list) or not all(isinstance(r, dict) for r in results):
        raise VerifyError(step, name, f"unexpected answer {clip(str(results))}")
    if all("checksums" in r and "include" in r for r in results):
        if slots is not None:
            slots[name] = {r.get("rank", str(i)): r.get("lora_slots") for i, r in enumerate(results)}
        results = [r["checksums"] for r in results]
    try:
        return merge_digests(results)
    except DuplicateKeysError as e:
        raise VerifyError(step, name, f"two workers produced the same keys: {e.keys[:5]}") from e


def in_process_vllm_version() -> str | None:
    return getattr(sys.modules.get("vllm"), "__version__", None)


def engine_names(engines: list[Any], label: Any) -> list[str]:
    """``"in-process LLM"``, or ``"engine 0 (in-process LLM)"``, ... for several."""
    if len(engines) == 1:
        return [label(engines[0])]
    return [f"engine {i} ({label(e)})" for i, e in enumerate(engines)]


def is_ray_actor(obj: Any) -> bool:
    """A Ray actor handle, recognised without importing Ray."""
    return type(obj).__module__.startswith("ray.") and type(obj).__name__ == "ActorHandle"


class _LocalEngine:
    """One engine reached by ``collective_rpc(method, timeout=..., args=...)`` in this process."""

    def __init__(self, engine: Any, name: str, timeout: float | None):
        self.engine = engine
        self.name = name
        self.timeout = timeout

    def rpc(self, method: str, args: tuple[Any, ...], step: str) -> Any:
        try:
            return self._collective_rpc(method, args)
        except Exception as e:
            raise VerifyError(step, self.name, f"collective_rpc({method!r}) failed: {e}") from e

    def _collective_rpc(self, method: str, args: tuple[Any, ...]) -> Any:
        return self.engine.collective_rpc(method, timeout=self.timeout, args=args)

    def version(self) -> str | None:
        return in_process_vllm_version()

    def weight_version(self) -> str | None:
        get = getattr(self.engine, "get_weight_version", None)
        return _version_string(get()) if callable(get) else None

    def call(self, op: str, step: str, include: tuple[str, ...], slots: dict[str, Any]) -> Any:
        if op in ("pause", "resume"):
            return NOTHING_TO_PAUSE  # an offline engine serves nothing during the call
        if op == "version":
            return self.version()
        if op == "weight_version":
            return self.weight_version()
        method, args = worker_method(op, include)
        result = self.rpc(method, args, step)
        if op == "dp_sharded":
            return sharded_names(result)
        return merge_workers(result, step, self.name, slots) if op == "checksum" else None


def _version_string(value: Any) -> str | None:
    return value if isinstance(value, str) else None


class _RayEngine(_LocalEngine):
    """A Ray actor handle whose actor passes ``collective_rpc`` through to the
    engine it hosts (:class:`weight_checker.integrations.ray.EngineActorMixin`)."""

    def _collective_rpc(self, method: str, args: tuple[Any, ...]) -> Any:
        import ray  # only where a Ray handle was passed

        return ray.get(self.engine.collective_rpc.remote(method, args=args), timeout=self.timeout)

    def weight_version(self) -> str | None:
        import ray

        try:
            return _version_string(ray.get(self.engine.weight_version.remote(), timeout=self.timeout))
        except Exception:  # an actor without weight_version(): reported as unknown, not an error
            return None

    def version(self) -> str | None:
        import ray

        try:
            version = ray.get(self.engine.vllm_version.remote(), timeout=self.timeout)
        except Exception:  # an actor without vllm_version(): the version is unknown, not an error
            return None
        return version if isinstance(version, str) else None


class InProcessTarget(EngineSet):
    """Engines of this process (or Ray handles to them), named by kind and
    position; subclasses say how each is labelled, held and called."""

    def __init__(
        self,
        engines: Iterable[Any],
        *,
        timeout: float | None = None,
        concurrency: int = DEFAULT_CONCURRENCY,
        progress: Progress | None = None,
        layout: Layout | None = None,
        include: tuple[str, ...] = DEFAULT,
    ):
        engines = list(engines)
        if not engines:
            raise InputError("no engine given")
        self.timeout = timeout
        names = engine_names(engines, self._label)
        self.engines = {name: self._adopt(name, e) for name, e in zip(names, engines, strict=True)}
        super().__init__(names, concurrency, progress, layout, include)

    def _label(self, engine: Any) -> str:
        return f"in-process {type(engine).__name__}"

    def _adopt(self, name: str, engine: Any) -> Any:
        return engine


class RpcTarget(InProcessTarget):
    """In-process ``vllm.LLM`` engines or Ray actor handles (one or several)."""

    def _label(self, engine: Any) -> str:
        return "ray actor" if is_ray_actor(engine) else super()._label(engine)

    def _adopt(self, name: str, engine: Any) -> _LocalEngine:
        return (_RayEngine if is_ray_actor(engine) else _LocalEngine)(engine, name, self.timeout)

    def _call(self, name: str, op: str, step: str) -> Any:
        return self.engines[name].call(op, step, self.include, self.lora_slots)
