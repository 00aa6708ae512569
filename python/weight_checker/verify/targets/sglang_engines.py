"""In-process ``sglang.Engine``s as a target.

An ``sglang.Engine`` runs its schedulers (one per rank) in child processes
and keeps, in this process, the tokenizer manager that talks to them on the
engine's event loop. Every step goes through that manager, as the server's
routes do: pause and resume with ``pause_generation`` /
``continue_generation`` (in the mode asked for: SGLang's ``abort`` or
``in_place``), and this package's actions (:mod:`weight_checker.engines.sglang`)
through SGLang's own fan-out, ``check_weights``, to every rank's hook.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine, Iterable
from typing import Any

from weight_checker.engines import DEFAULT_PAUSE
from weight_checker.engines.sglang import CHECKSUM, RESET, SGLANG, SGLANG_MODES, rank_digests
from weight_checker.errors import DuplicateKeysError, InputError, VerifyError
from weight_checker.keys import merge_digests
from weight_checker.verify.targets.async_engines import run_on_loop
from weight_checker.verify.targets.engines import InProcessTarget


def is_sglang_engine(engine: Any) -> bool:
    """Whether ``engine`` is an in-process ``sglang.Engine`` (or one like it: its tokenizer manager and loop)."""
    return type(engine).__module__.startswith("sglang.") and hasattr(engine, "tokenizer_manager")


class SGLangEngineTarget(InProcessTarget):
    """In-process ``sglang.Engine``s, paused in ``pause`` (``abort`` or ``keep``)."""

    def __init__(self, engines: Iterable[Any], *, pause: str = DEFAULT_PAUSE, **options: Any):
        if pause not in SGLANG_MODES:
            raise InputError(f"SGLang has no {pause!r} pause: use {' or '.join(SGLANG_MODES)}")
        self.pause_mode = pause
        self._loop_locks: dict[int, threading.Lock] = {}
        super().__init__(engines, **options)

    def _label(self, engine: Any) -> str:
        return "in-process sglang.Engine"

    def run(self, name: str, coro: Coroutine[Any, Any, Any]) -> Any:
        """``coro`` on engine ``name``'s event loop: from this thread where the
        loop is idle (SGLang's own sync methods do so), else scheduled on it.
        Engines made in one thread share its loop: one call at a time on each."""
        loop = self.engines[name].loop
        if loop.is_running():
            return run_on_loop(loop, coro, self.timeout)
        with self._loop_locks.setdefault(id(loop), threading.Lock()):
            return loop.run_until_complete(asyncio.wait_for(coro, self.timeout))

    def ask(self, name: str, action: str, args: list[str] | None, step: str) -> list[dict[str, Any]]:
        """Every rank's answer to one of this package's actions, through SGLang's fan-out."""
        # sglang: the caller's engine is SGLang's, so SGLang is imported already.
        from sglang.srt.managers.io_struct import CheckWeightsReqInput

        request = CheckWeightsReqInput(action=action, selector="target", skip_tensor_list=args)
        try:
            success, message, ranks, _ = self.run(name, self.engines[name].tokenizer_manager.check_weights(request))
        except Exception as e:
            raise VerifyError(step, name, f"check_weights({action!r}) failed: {type(e).__name__}: {e}") from e
        if not success:
            raise VerifyError(step, name, f"SGLang's ranks answered {action!r} with: {message}")
        return list(ranks or ())

    def _call(self, name: str, op: str, step: str) -> Any:
        engine = self.engines[name]
        manager = engine.tokenizer_manager
        if op == "version":
            return None  # what versions are compared with: the vLLM that computed expected digests
        if op == "weight_version":
            version = manager.config_value("weight_version")
            return version if isinstance(version, str) else None
        if op == "dp_sharded":
            return None
        if op in ("pause", "resume"):
            # sglang: the caller's engine is SGLang's.
            from sglang.srt.managers.io_struct import ContinueGenerationReqInput, PauseGenerationReqInput

            if op == "pause":
                call = manager.pause_generation(PauseGenerationReqInput(mode=SGLANG_MODES[self.pause_mode]))
            else:
                call = manager.continue_generation(ContinueGenerationReqInput())
            try:
                return self.run(name, call)
            except Exception as e:
                raise VerifyError(step, name, f"{op} failed: {type(e).__name__}: {e}") from e
        if op == "checksum":
            try:
                return merge_digests(rank_digests(self.ask(name, CHECKSUM, None, step)))
            except DuplicateKeysError as e:
                raise VerifyError(step, name, f"two ranks produced the same keys: {e.keys[:5]}") from e
        if op == "reset":
            self.ask(name, RESET, None, step)
            return None
        raise VerifyError(step, name, f"{SGLANG.display} engines have no {op!r}")
