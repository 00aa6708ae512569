"""Start and stop a local vLLM server: for the end-to-end tests, the demo and
your own integration tests.

    with vllm_server(write_tiny_llama(Path("tiny")), Path("vllm.log")) as server:
        server.post("/weight_checker", {"action": "checksum"})

A server runs in its own process group (setsid) and is stopped by that
group's id, also when the caller fails, so no stray engine or worker survives.
``VLLM_SERVER_DEV_MODE=1`` is set (the weight checker's route needs it).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from weight_checker.httpclient import HttpError, request

STARTUP_TIMEOUT_S = float(os.environ.get("WEIGHT_CHECKER_VLLM_STARTUP_S", "300"))


def vllm_available() -> bool:
    try:
        import vllm  # noqa: F401
    except Exception:
        return False
    return True


TINY_LLAMA = {
    "vocab_size": 512,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
}


def write_tiny_llama(path: Path, seed: int = 0, **config: object) -> Path:
    """A Llama checkpoint (config.json + model.safetensors), fixed seed, bf16:
    tiny by default, any ``LlamaConfig`` field overridable. Written once."""
    import torch
    import transformers

    if (path / "model.safetensors").exists():
        return path
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(**(TINY_LLAMA | config))
    transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path)
    return path


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


@contextlib.contextmanager
def vllm_server(
    model: Path,
    log: Path,
    *,
    extra_args: list[str] = (),
    env: dict[str, str] | None = None,
    python: str | None = None,
    api_key: str | None = None,
) -> Iterator[Server]:
    """A vLLM API server on a free port, stopped (whole process group) on exit.
    ``python``: the interpreter of another vLLM environment (e.g. vLLM 0.31);
    ``api_key``: started with ``--api-key``, and sent by ``Server.post``."""
    port = free_port()
    if api_key:
        extra_args = [*extra_args, "--api-key", api_key]
    cmd = [
        python or sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model), "--skip-tokenizer-init", "--enforce-eager",
        "--dtype", "bfloat16", "--max-model-len", "256",
        "--host", "127.0.0.1", "--port", str(port), *extra_args,
    ]  # fmt: skip
    full_env = dict(os.environ)
    full_env.update({"VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"})
    if any(a in ("-tp", "-dp", "--tensor-parallel-size", "--data-parallel-size") for a in extra_args):
        full_env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    full_env.update(env or {})
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=full_env, start_new_session=True)
    server = Server(f"http://127.0.0.1:{port}", str(model), log, proc, api_key)
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"vLLM exited with {proc.returncode}:\n{server.log_text()[-4000:]}")
            try:
                if server.get("/health", timeout=2)[0] == 200:
                    break
            except HttpError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"vLLM not healthy after {STARTUP_TIMEOUT_S}s:\n{server.log_text()[-4000:]}")
            time.sleep(1)
        yield server
    finally:
        stop(proc)


def stop(proc: subprocess.Popen) -> None:
    """Stops the server's whole process group: API server, engines, workers."""
    try:
        pgid = os.getpgid(proc.pid)
    except ProcessLookupError:
        return
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
