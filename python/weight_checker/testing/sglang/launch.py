"""Start and stop a real SGLang server on this CPU, for the SGLang tests:

    with sglang_server(write_tiny_sglang_model(Path("llama")), Path("sglang.log"), tp=2) as server:
        server.post("/weight_checker", {"action": "checksum"})

It runs SGLang's own ``launch_server`` in the SGLang environment
(``WEIGHT_CHECKER_SGLANG_PYTHON``, default ``.venv-sglang/bin/python``), on
the CPU (``SGLANG_USE_CPU_ENGINE=1``, torch-native attention, no CUDA graph),
with the test-only ``sgl_kernel`` stand-in on its ``PYTHONPATH``
(:data:`~weight_checker.testing.sglang.STANDIN_DIR`) and this package's route
on (``WEIGHT_CHECKER_SGLANG_DEV_MODE=1``). As with vLLM
(:mod:`weight_checker.testing.launch`), the server runs in its own process
group and is stopped by it, so no scheduler survives a failed test.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

from weight_checker import settings
from weight_checker.testing.launch import Server, ci, free_port, start_with_retry
from weight_checker.testing.sglang import STANDIN_DIR

STARTUP_TIMEOUT_S = settings.get("WEIGHT_CHECKER_SGLANG_STARTUP_S") or 600.0
#: Where ``scripts/dev-env.sh`` puts the SGLang environment, from the repository root.
DEFAULT_PYTHON = ".venv-sglang/bin/python"


def sglang_python(root: Path) -> Path | None:
    """The SGLang environment's interpreter (``WEIGHT_CHECKER_SGLANG_PYTHON``,
    else ``root/.venv-sglang/bin/python``), or ``None`` where there is none.
    Under CI (``CI=true``) a missing one is an error: the SGLang suites must run there."""
    chosen = settings.get("WEIGHT_CHECKER_SGLANG_PYTHON")
    python = Path(chosen) if chosen else root / DEFAULT_PYTHON
    if python.exists():
        return python
    if ci():
        raise RuntimeError(f"CI=true but there is no SGLang environment at {python}: the SGLang suites would not run")
    return None


def sglang_env(tp: int, env: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of an SGLang server process started here."""
    full = {
        **os.environ,
        "SGLANG_USE_CPU_ENGINE": "1",
        "PYTHONPATH": os.pathsep.join([str(STANDIN_DIR), *filter(None, [os.environ.get("PYTHONPATH")])]),
        "WEIGHT_CHECKER_SGLANG_DEV_MODE": "1",
        **(env or {}),
    }
    if tp > 1:
        # One scheduler a core (SGLang's CPU engine asserts a binding for every rank), and no NCCL
        # library: PyPI's CUDA torch would otherwise try pynccl on a CPU tensor.
        full.setdefault("SGLANG_CPU_OMP_THREADS_BIND", "|".join(str(i % (os.cpu_count() or 1)) for i in range(tp)))
        full.setdefault("SGLANG_NCCL_SO_PATH", "/nonexistent/libnccl.so.2")
    return full


def start_sglang_server(
    model: Path,
    log: Path,
    python: Path,
    *,
    tp: int = 1,
    extra_args: list[str] | tuple[str, ...] = (),
    env: dict[str, str] | None = None,
    api_key: str | None = None,
) -> Server:
    """An SGLang server on a free port, healthy when this returns (stopped here
    if it never is; started once more if it hung: :func:`~weight_checker.testing.launch.start_with_retry`)."""
    if api_key:
        extra_args = [*extra_args, "--api-key", api_key]

    def launch() -> Server:
        port = free_port()
        cmd = [
            str(python), "-m", "sglang.launch_server",
            "--model-path", str(model), "--device", "cpu", "--attention-backend", "torch_native",
            "--disable-cuda-graph", "--max-total-tokens", "4096", "--context-length", "512",
            "--tp", str(tp), "--host", "127.0.0.1", "--port", str(port), *extra_args,
        ]  # fmt: skip
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, env=sglang_env(tp, env), start_new_session=True
            )
        return Server(f"http://127.0.0.1:{port}", str(model), log, proc, api_key)

    # /health runs a one-token generation: ready means it can serve.
    return start_with_retry(launch, "SGLang", STARTUP_TIMEOUT_S, health_timeout=10, poll=0.5)


@contextlib.contextmanager
def sglang_server(
    model: Path,
    log: Path,
    python: Path,
    *,
    tp: int = 1,
    extra_args: list[str] | tuple[str, ...] = (),
    env: dict[str, str] | None = None,
    api_key: str | None = None,
) -> Iterator[Server]:
    """:func:`start_sglang_server`, stopped (its whole process group) on exit."""
    server = start_sglang_server(model, log, python, tp=tp, extra_args=extra_args, env=env, api_key=api_key)
    try:
        yield server
    finally:
        server.stop()
