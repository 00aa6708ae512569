"""End to end, DP=2, with our endpoint plugin named in VLLM_PLUGINS: our
route replaces vLLM's built-in one and must fan out to both engines (the
path vLLM <= 0.31, which has no built-in route, relies on)."""

from __future__ import annotations

import pytest
from weight_checker.testing.launch import vllm_available

from . import vllm_checks as checks

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed"),
]


@pytest.fixture
def server(vllm_dp2_route):
    """The shared DP=2 server with this package's route (and an API key, which ``post`` sends)."""
    return vllm_dp2_route


def test_our_route_serves(server):
    assert "POST /weight_checker served by weight_checker.server" in server.log_text()


def test_bad_payloads_get_vllms_error_shape(server):
    checks.check_bad_payloads(server)
    status, body = server.post("/weight_checker", {"action": "CHECKSUM"})
    assert status == 400 and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["type"] == "Bad Request" and body["error"]["param"] == "body.action"


def test_both_dp_ranks(server):
    ours = checks.check_digests(server, {"dp0:pp0:pcp0:tp0", "dp1:pp0:pcp0:tp0"})
    # vLLM's own digests of the first engine's worker match ours for dp0.
    ref = checks.vllm_reference(server)
    assert ref and all(ours[k] == v for k, v in ref.items())
    dp0 = {k.split(":", 4)[4]: v for k, v in ours.items() if k.startswith("dp0:")}
    dp1 = {k.split(":", 4)[4]: v for k, v in ours.items() if k.startswith("dp1:")}
    assert dp0 == dp1  # two replicas of the same checkpoint


def test_changed_and_deleted_keys(server):
    checks.check_changed_and_deleted(server)


def test_seed_flow_reaches_both_engines(server):
    checks.check_seed_flow(server)


def test_rust_core_served_both_engines(server):
    checks.check_rust_core_served(server, checks.checksum(server), workers=2)


def test_replicas_of_one_dp2_server_are_consistent(server):
    import json
    import subprocess
    import sys

    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "weight_checker.cli",
            "replicas",
            "--url",
            server.url,
            "--api-key",
            server.api_key,
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    report = json.loads(r.stdout)
    assert report["consistent"] is True and report["replicas"] == ["dp0", "dp1"]
