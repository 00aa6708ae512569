"""The POST /weight_checker route against vLLM's contract (as vLLM 0.32 implements it).

The backend is two real "workers": small torch models hashed and zeroed by
weight_checker itself, each under its own rank prefix.
"""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import pytest
import torch
import weight_checker
from fastapi import FastAPI
from fastapi.testclient import TestClient
from hypothesis import given
from hypothesis import strategies as st
from torch import nn
from weight_checker.server import EngineAdapter, mount


class Workers:
    """Two TP ranks of one tiny model, hashed like vLLM's workers."""

    def __init__(self, duplicate: bool = False):
        torch.manual_seed(0)
        self.models = [nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2)) for _ in range(2)]
        tps = [0, 0] if duplicate else [0, 1]
        self.prefixes = [weight_checker.rank_prefix(0, 0, 0, tp) for tp in tps]
        self.events: list[str] = []

    async def checksums(self) -> list[dict[str, str]]:
        self.events.append("checksum-start")
        await asyncio.sleep(0.01)
        out = [weight_checker.checksum(m, p) for m, p in zip(self.models, self.prefixes, strict=True)]
        self.events.append("checksum-end")
        return out

    async def reset(self) -> None:
        self.events.append("reset-start")
        await asyncio.sleep(0.01)
        for m in self.models:
            weight_checker.reset(m)
        self.events.append("reset-end")


def make_app(workers: Workers, dev_mode: bool = True) -> FastAPI:
    app = FastAPI()
    adapter = EngineAdapter(checksums=workers.checksums, reset=workers.reset)
    mount(app, lambda request: adapter, enabled=dev_mode)

    @app.get("/health")
    async def health() -> dict:
        return {}

    return app


@pytest.fixture
def workers():
    return Workers()


@pytest.fixture
def client(workers):
    return TestClient(make_app(workers))


def post(client, body):
    return client.post("/weight_checker", json=body)


def assert_vllm_error(r: httpx.Response, code: int):
    assert r.status_code == code, r.text
    body = r.json()
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == code and isinstance(err["message"], str) and err["message"]
    assert err["type"] == {400: "Bad Request", 500: "Internal Server Error"}[code]


def test_checksum_merges_workers_and_is_stable(client, workers):
    r = post(client, {"action": "checksum"})
    assert r.status_code == 200
    sums = r.json()["checksums"]
    assert set(r.json()) == {"checksums"}
    assert len(sums) == 8  # 4 tensors x 2 ranks
    assert {k.split(":")[3] for k in sums} == {"tp0", "tp1"}
    assert all(re.fullmatch(r"[0-9a-f]{64}", v) for v in sums.values())
    assert post(client, {"action": "checksum"}).json()["checksums"] == sums
    # Independent oracle: the same digests through weight_checker's API.
    want = {}
    for m, p in zip(workers.models, workers.prefixes, strict=True):
        want.update(weight_checker.checksum(m, p))
    assert sums == want


def test_reset_then_compare_reports_every_rank_then_restore_matches(client, workers):
    baseline = post(client, {"action": "checksum"}).json()["checksums"]
    saved = [{k: v.clone() for k, v in m.state_dict().items()} for m in workers.models]
    assert post(client, {"action": "reset"}).json() == {"status": "reset"}
    r = post(client, {"action": "compare", "baseline": baseline}).json()
    assert r["match"] is False and r["mismatches"] == sorted(baseline)
    for m, sd in zip(workers.models, saved, strict=True):
        m.load_state_dict(sd)  # the "weight transfer"
    assert post(client, {"action": "compare", "baseline": baseline}).json() == {
        "match": True,
        "mismatches": [],
    }


def test_compare_changed_and_deleted_keys(client):
    baseline = post(client, {"action": "checksum"}).json()["checksums"]
    keys = sorted(baseline)
    changed, deleted = keys[1], keys[4]
    baseline[changed] = "0" * 64
    del baseline[deleted]
    r = post(client, {"action": "compare", "baseline": baseline}).json()
    assert r == {"match": False, "mismatches": sorted([changed, deleted])}
    baseline["dp9:pp0:pcp0:tp0:extra"] = "1" * 64
    r = post(client, {"action": "compare", "baseline": baseline}).json()
    assert r["mismatches"] == sorted([changed, deleted, "dp9:pp0:pcp0:tp0:extra"])


def test_duplicate_keys_are_a_500_naming_them():
    client = TestClient(make_app(Workers(duplicate=True)))
    r = post(client, {"action": "checksum"})
    assert_vllm_error(r, 500)
    assert "Duplicate weight checksum keys" in r.json()["error"]["message"]
    assert "dp0:pp0:pcp0:tp0:0.weight" in r.json()["error"]["message"]


VLLM_BAD_PAYLOADS = [{}, {"action": "frobnicate"}, {"action": "compare"}, []]


@pytest.mark.parametrize("payload", VLLM_BAD_PAYLOADS, ids=json.dumps)
def test_vllm_bad_payloads_are_400(client, payload):
    assert_vllm_error(post(client, payload), 400)
    assert client.get("/health").status_code == 200


def test_no_body_is_400(client):
    assert_vllm_error(client.post("/weight_checker"), 400)
    assert client.get("/health").status_code == 200


@pytest.mark.parametrize(
    "payload,param",
    [
        ({"action": None}, "body.action"),
        ({"action": "CHECKSUM"}, "body.action"),
        ({"action": 3}, "body.action"),
        ({"action": ["checksum"]}, "body.action"),
        ({"action": "compare", "baseline": {"k": 5}}, "body.baseline.k"),
        ({"action": "compare", "baseline": {"k": None}}, "body.baseline.k"),
        ({"action": "compare", "baseline": ["k"]}, "body.baseline"),
        ({"action": "compare", "baseline": "k"}, "body.baseline"),
        ({"action": "compare", "baseline": None}, "body.baseline"),
        ({"action": "checksum", "baseline": {"k": 1}}, "body.baseline.k"),
        ("checksum", "body"),
        (17, "body"),
    ],
    ids=repr,
)
def test_malformed_bodies_are_400_with_param(client, payload, param):
    r = post(client, payload)
    assert_vllm_error(r, 400)
    assert r.json()["error"]["param"] == param


def test_invalid_json_and_content_type(client):
    h = {"content-type": "application/json"}
    assert_vllm_error(client.post("/weight_checker", content=b"{action: checksum", headers=h), 400)
    assert_vllm_error(client.post("/weight_checker", content=b"\xff\xfe", headers=h), 400)
    assert_vllm_error(client.post("/weight_checker", content=b"null", headers=h), 400)
    r = client.post("/weight_checker", content=b'{"action": "checksum"}', headers={"content-type": "text/plain"})
    assert_vllm_error(r, 400)
    r = client.post("/weight_checker", data={"action": "checksum"})  # form-encoded
    assert_vllm_error(r, 400)
    assert client.get("/health").status_code == 200
    # No Content-Type at all: JSON, as vLLM's own route takes it.
    r = client.post("/weight_checker", content=b'{"action": "checksum"}', headers={"content-type": ""})
    assert r.status_code == 200 and "checksums" in r.json()


def test_bad_requests_change_nothing(client, workers):
    before = post(client, {"action": "checksum"}).json()["checksums"]
    post(client, {"action": "Reset"})
    post(client, {"action": "reset", "baseline": {"k": 1}})
    assert post(client, {"action": "checksum"}).json()["checksums"] == before
    assert "reset-start" not in workers.events


def test_route_exists_only_in_dev_mode(workers, monkeypatch):
    # The route is engine-neutral: the caller decides whether to mount it...
    assert TestClient(make_app(workers, dev_mode=False)).post("/weight_checker", json={}).status_code == 404
    # ... and vLLM's glue mounts it only with VLLM_SERVER_DEV_MODE=1, as vLLM does.
    from weight_checker.integrations.vllm.endpoint import WeightCheckerEndpoint

    for flag, present in (("0", False), ("1", True)):
        monkeypatch.setenv("VLLM_SERVER_DEV_MODE", flag)
        app = FastAPI()
        WeightCheckerEndpoint().attach_router(app)
        assert ("/weight_checker" in {r.path for r in app.routes}) is present


def test_openapi_documents_vllms_three_actions_and_block_digests(client):
    spec = client.get("/openapi.json").json()
    op = spec["paths"]["/weight_checker"]["post"]
    variants = op["requestBody"]["content"]["application/json"]["schema"]["oneOf"]
    assert {v["properties"]["action"]["const"] for v in variants} == {
        "checksum",
        "reset",
        "compare",
        "block_digests",  # this package's own (issue 43)
    }
    assert {"200", "400", "500"} <= set(op["responses"])


async def _concurrently(app, bodies):
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
        return await asyncio.gather(*(c.post("/weight_checker", json=b) for b in bodies))


def test_fifty_concurrent_checksums_agree(workers):
    rs = asyncio.run(_concurrently(make_app(workers), [{"action": "checksum"}] * 50))
    assert all(r.status_code == 200 for r in rs)
    assert len({json.dumps(r.json(), sort_keys=True) for r in rs}) == 1


def test_reset_never_interleaves_with_checksum(workers):
    bodies = [{"action": "checksum"}, {"action": "reset"}, {"action": "checksum"}] * 5
    asyncio.run(_concurrently(make_app(workers), bodies))
    depth_checksum, in_reset = 0, False
    for e in workers.events:
        if e == "checksum-start":
            assert not in_reset
            depth_checksum += 1
        elif e == "checksum-end":
            depth_checksum -= 1
        elif e == "reset-start":
            assert depth_checksum == 0 and not in_reset
            in_reset = True
        elif e == "reset-end":
            in_reset = False


digest = st.sampled_from(["a" * 64, "b" * 64, "c" * 64])
key = st.sampled_from([f"dp0:pp0:pcp0:tp{t}:{n}.{w}" for t in (0, 1) for n in (0, 1) for w in ("weight", "bias")])


@given(st.dictionaries(key, digest), st.data())
def test_compare_route_matches_union_semantics(baseline, data):
    workers = Workers()
    client = TestClient(make_app(workers))
    current = post(client, {"action": "checksum"}).json()["checksums"]
    # Take some real digests into the baseline so that matches happen too.
    for k in data.draw(st.lists(st.sampled_from(sorted(current)), max_size=8)):
        baseline[k] = current[k]
    r = post(client, {"action": "compare", "baseline": baseline}).json()
    expect = sorted(
        (baseline.keys() ^ current.keys()) | {k for k in baseline.keys() & current.keys() if baseline[k] != current[k]}
    )
    assert r == {"match": not expect, "mismatches": expect}
