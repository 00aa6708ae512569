"""Engines hosted in Ray actors (the OpenRLHF / verl layout) on a local Ray
cluster, CPU only: two actors each with an in-process vllm.LLM (TP=1),
verified and replica-checked through their handles."""

from __future__ import annotations

import functools
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
from weight_checker.testing.launch import vllm_available, vllm_env

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed"),
    pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="Ray is not installed"),
]

SCRIPT = Path(__file__).with_name("ray_fleet.py")


def run(model: Path) -> dict:
    r = subprocess.run(
        [sys.executable, str(SCRIPT), str(model)],
        capture_output=True,
        text=True,
        timeout=900,
        env=vllm_env([]),
        start_new_session=True,
    )
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    assert r.returncode == 0 and lines, r.stdout[-3000:] + r.stderr[-3000:]
    return json.loads(lines[-1].removeprefix("RESULT "))


def background_jobs(env) -> dict[str, functools.partial]:
    """The Ray run, in the background from the session's start (tests/jobs.py)."""
    return {"ray-fleet": functools.partial(run, env.models.path("tiny-llama"))}


@pytest.mark.uses_jobs("ray-fleet")
def test_two_ray_hosted_engines_verify_replicas_and_name_the_skipped_one(jobs, tiny_llama):
    out = jobs.result("ray-fleet")
    import weight_checker

    # Every parameter of vLLM's own model class, once per engine.
    per_engine = len(weight_checker.expected_digests(tiny_llama))
    assert out["good"]["match"] is True and out["good"]["key_count"] == 2 * per_engine
    assert out["good"]["servers"] == ["engine 0 (ray actor)", "engine 1 (ray actor)"]
    # The transfer skipped engine 1: its keys, and only its, are untouched since the reset.
    assert list(out["skipped"]) == ["untouched-since-reset"]
    assert out["skipped"]["untouched-since-reset"]
    assert all(k.startswith("engine 1 (ray actor) dp0:") for k in out["skipped"]["untouched-since-reset"])
    assert out["consistent"] is True
    assert out["after_reset"]["consistent"] is False
    for held in out["after_reset"]["inconsistent"].values():
        assert set(held) == {"engine 0 (ray actor) dp0", "engine 1 (ray actor) dp0"}
