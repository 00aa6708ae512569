"""The API-key guard on vLLM's own AuthenticationMiddleware, in process
(the real-server tests are tests/test_vllm_guard.py)."""

from __future__ import annotations

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from weight_checker.integrations.vllm import guard
from weight_checker.testing.launch import vllm_available

from .test_server import Workers, make_app

pytestmark = pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed")


@pytest.fixture
def app() -> FastAPI:
    from vllm.entrypoints.serve.middleware.authenticate import AuthenticationMiddleware

    guard.install(AuthenticationMiddleware)  # idempotent, as the plugin does it
    app = make_app(Workers())  # our route, defined in weight_checker.server

    @app.get("/v1/models")
    async def models() -> dict:
        return {"data": []}

    app.add_middleware(AuthenticationMiddleware, tokens=["s3cret"])
    return app


def test_our_route_needs_the_token_and_health_does_not(app):
    client = TestClient(app)
    r = client.post("/weight_checker", json={"action": "reset"})
    assert r.status_code == 401
    assert r.json()["error"]["code"] == 401 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    ok = client.post("/weight_checker", json={"action": "checksum"}, headers={"Authorization": "Bearer s3cret"})
    assert ok.status_code == 200
    wrong = client.post("/weight_checker", json={"action": "checksum"}, headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401
    assert client.get("/health").status_code == 200
    # vLLM's own prefixes keep vLLM's own answer.
    assert client.get("/v1/models").json() == {"error": "Unauthorized"}
    assert client.get("/v1/models", headers={"Authorization": "Bearer s3cret"}).status_code == 200


def test_guarded_paths_are_derived_from_the_routes(app):
    assert guard.guarded_paths(app) == ["/weight_checker"]
    assert guard._paths_for(None) == frozenset()


def test_switch(monkeypatch):
    monkeypatch.setenv(guard.GUARD_ENV, "0")
    assert not guard.guard_enabled()
    monkeypatch.setenv(guard.GUARD_ENV, "1")
    assert guard.guard_enabled()
