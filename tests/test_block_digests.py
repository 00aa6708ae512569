"""``{"action": "block_digests"}`` on this package's route (issue 43): the
worker method over two stand-in TP workers (real torch models, keys under
their own prefixes), answered as hashlib's digests of each byte range; every
bad request a 400 in vLLM's error shape, after which the engine answers as
before. The real servers: tests/test_explain_engines.py."""

from __future__ import annotations

import asyncio
import hashlib
from types import SimpleNamespace

import pytest
import torch
from fastapi import FastAPI
from fastapi.testclient import TestClient
from weight_checker.hashing.blocks import MAX_KEYS, block_ranges
from weight_checker.integrations.vllm.worker import weight_checker_block_digests, weight_checker_checksums
from weight_checker.server import EngineAdapter, mount

from .test_server import assert_vllm_error


class Worker:
    def __init__(self, tp: int):
        g = torch.Generator().manual_seed(tp)
        self.model = torch.nn.Sequential(torch.nn.Linear(48, 64, bias=True), torch.nn.Linear(64, 8, bias=False))
        for p in self.model.parameters():
            p.data = torch.randn(p.shape, generator=g).to(torch.bfloat16)
        self.model_runner = SimpleNamespace(get_model=lambda: self.model)
        self.parallel_config = SimpleNamespace(world_size=2, local_world_size=2, data_parallel_size_local=1)
        self.prefix = f"dp0:pp0:pcp0:tp{tp}:"

    def _weight_checksum_prefix(self) -> str:
        return self.prefix


def make_app(workers: list[Worker], blocks: bool = True) -> FastAPI:
    async def checksums():
        return [weight_checker_checksums(w) for w in workers]

    async def reset():
        raise AssertionError("not used")

    async def block_digests(keys, block_bytes):
        await asyncio.sleep(0)
        return [weight_checker_block_digests(w, keys, block_bytes) for w in workers]

    app = FastAPI()
    adapter = EngineAdapter(checksums=checksums, reset=reset, block_digests=block_digests if blocks else None)
    mount(app, lambda request: adapter)

    @app.get("/health")
    async def health() -> dict:
        return {}

    return app


@pytest.fixture
def workers():
    return [Worker(0), Worker(1)]


@pytest.fixture
def client(workers):
    return TestClient(make_app(workers))


def oracle(t: torch.Tensor, block: int) -> list[str]:
    raw = t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes()
    return [hashlib.sha256(raw[a:b]).hexdigest() for a, b in block_ranges(len(raw), block)]


def test_block_digests_of_keys_on_two_workers_are_hashlibs(client, workers):
    keys = ["dp0:pp0:pcp0:tp0:0.weight", "dp0:pp0:pcp0:tp1:0.weight", "dp0:pp0:pcp0:tp1:1.weight"]
    r = client.post("/weight_checker", json={"action": "block_digests", "keys": keys, "block_bytes": 96})
    assert r.status_code == 200, r.text
    got = r.json()["block_digests"]
    assert sorted(got) == sorted(keys)
    for key in keys:
        tp = int(key.split(":")[3][2:])
        t = workers[tp].model.get_parameter(key.rsplit(":", 1)[1])
        assert got[key]["digests"] == oracle(t, 96)
        assert got[key] | {"digests": None} == {
            "digests": None, "block_bytes": 96, "nbytes": t.nbytes, "shape": list(t.shape), "dtype": "bfloat16"
        }  # fmt: skip


BAD = [
    ({"action": "block_digests", "keys": ["dp0:pp0:pcp0:tp0:nope"], "block_bytes": 96}, "body.keys", "no worker"),
    ({"action": "block_digests", "keys": ["dp0:pp0:pcp0:tp0:0.weight"], "block_bytes": 0}, "body.block_bytes", ""),
    ({"action": "block_digests", "keys": ["dp0:pp0:pcp0:tp0:0.weight"], "block_bytes": -4}, "body.block_bytes", ""),
    ({"action": "block_digests", "keys": ["dp0:pp0:pcp0:tp0:0.weight"], "block_bytes": True}, "body.block_bytes", ""),
    ({"action": "block_digests", "keys": ["dp0:pp0:pcp0:tp0:0.weight"], "block_bytes": "96"}, "body.block_bytes", ""),
    ({"action": "block_digests", "keys": ["dp0:pp0:pcp0:tp0:0.weight"], "block_bytes": 1.5}, "body.block_bytes", ""),
    ({"action": "block_digests", "keys": ["dp0:pp0:pcp0:tp0:0.weight"]}, "body.block_bytes", ""),
    ({"action": "block_digests", "keys": ["dp0:pp0:pcp0:tp0:0.bias"], "block_bytes": 129}, "body.block_bytes",
     "above the tensor"),
    ({"action": "block_digests", "keys": [], "block_bytes": 96}, "body.keys", ""),
    ({"action": "block_digests", "keys": "dp0:pp0:pcp0:tp0:0.weight", "block_bytes": 96}, "body.keys", ""),
    ({"action": "block_digests", "keys": ["dp0:pp0:pcp0:tp0:0.weight"] * 2, "block_bytes": 96}, "body.keys", "twice"),
    ({"action": "block_digests", "keys": [f"k{i}" for i in range(MAX_KEYS + 1)], "block_bytes": 96}, "body.keys",
     f"at most {MAX_KEYS}"),
    ({"action": "block_digests", "keys": [1], "block_bytes": 96}, "body.keys", ""),
    ({"action": "block_digests", "block_bytes": 96}, "body.keys", ""),
]  # fmt: skip


@pytest.mark.parametrize("body,param,says", BAD)
def test_a_bad_block_digests_request_is_a_400_and_the_engine_stays_healthy(client, body, param, says):
    before = client.post("/weight_checker", json={"action": "checksum"}).json()
    r = client.post("/weight_checker", json=body)
    assert_vllm_error(r, 400)
    assert r.json()["error"]["param"] == param
    assert says in r.json()["error"]["message"]
    assert client.get("/health").status_code == 200
    assert client.post("/weight_checker", json={"action": "checksum"}).json() == before


def test_an_engine_without_block_digests_refuses_the_action(workers):
    client = TestClient(make_app(workers, blocks=False))
    r = client.post("/weight_checker", json={"action": "block_digests", "keys": ["k"], "block_bytes": 1})
    assert_vllm_error(r, 400)
    assert "cannot give block digests" in r.json()["error"]["message"]


def test_a_block_size_that_cuts_a_tensor_into_too_many_blocks_is_a_400(client, monkeypatch):
    from weight_checker.hashing import blocks

    monkeypatch.setattr(blocks, "MAX_BLOCKS", 100)  # 0.weight: 6144 bytes, 1-byte blocks: 6144
    body = {"action": "block_digests", "keys": ["dp0:pp0:pcp0:tp0:0.weight"], "block_bytes": 1}
    r = client.post("/weight_checker", json=body)
    assert_vllm_error(r, 400)
    assert "6144 blocks: at most 100" in r.json()["error"]["message"]
    body["block_bytes"] = 96  # 64 blocks
    assert client.post("/weight_checker", json=body).status_code == 200
